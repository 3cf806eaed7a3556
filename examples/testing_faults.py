"""Testing code that uses mongoq: a lost reply, forced with `mongoq.testing`, and a lease that
expires without waiting, on a `ManualClock`.

Runs on the embedded in-memory backend: ``python examples/testing_faults.py``.
"""

from __future__ import annotations

import asyncio

from pymongo.errors import PyMongoError

import mongoq
from mongoq.testing import FaultInjector, ManualClock, instrument, memory_database


async def main() -> None:
    faults = FaultInjector()
    db = instrument(memory_database(), faults)
    clock = ManualClock()
    queue = mongoq.AsyncTaskQueue(db, "emails", lease_ttl=60, clock=clock)
    await queue.setup()
    await queue.put("mail-1", {"to": "ada@example.com"})

    task = await queue.claim("worker-a")
    assert task is not None
    # The next update applies on the database, then "loses" its reply: the caller cannot tell
    # whether its completion counted. Completing again is safe: the lease fences it.
    faults.fail_after("update_one")
    try:
        await queue.complete(task, {"sent": True})
    except PyMongoError as error:  # what a network error mid-command raises
        print("the completion's reply was lost:", error)
    assert faults.triggered, "the fault fired"
    done = await queue.get("mail-1")
    assert done is not None
    print("status after the lost reply:", done.status)

    await queue.put("mail-2", {"to": "bob@example.com"})
    stalled = await queue.claim("worker-b")
    assert stalled is not None
    clock.advance(61)  # the lease ends: no sleeping in a test
    print("reclaimed:", await queue.reclaim_expired())
    again = await queue.claim("worker-c")
    assert again is not None and again.id == "mail-2" and again.attempts == 2
    print("worker-c took over mail-2, attempt", again.attempts)


asyncio.run(main())
