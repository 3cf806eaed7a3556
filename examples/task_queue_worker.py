"""A worker loop: ``queue.run(handler)`` with retries, permanent failures and a graceful stop.

Runs on the embedded in-memory backend: ``python examples/task_queue_worker.py``.
In production, leave out ``stop_when_empty`` and pass ``handle_signals=True``: the first
SIGTERM lets in-flight tasks finish, a second one releases them for retry.
"""

from __future__ import annotations

import asyncio
import logging

import mongoq
from mongoq import NewTask, PermanentError, Task

attempts_seen: dict[str, int] = {}


async def send_email(task: Task) -> dict[str, str]:
    address = task.payload["to"]
    if "@" not in address:
        raise PermanentError(f"not an address: {address!r}")  # failed now, no retries
    attempts_seen[address] = attempts_seen.get(address, 0) + 1
    if address.startswith("flaky") and attempts_seen[address] == 1:
        raise ConnectionError("SMTP server busy")  # retried after a backoff
    return {"status": "sent"}


async def main() -> None:
    db = mongoq.connect()
    # A short backoff so that the retry is due within this example's lifetime.
    queue = mongoq.AsyncTaskQueue(db, "emails", backoff_base=0.2, backoff_cap=1)
    await queue.setup()
    await queue.put_many(
        NewTask(f"mail-{number}", {"to": to})
        for number, to in enumerate(["ada@example.com", "flaky@example.com", "nobody"])
    )
    summary = await queue.run(send_email, concurrency=4, poll_interval=0.1, stop_when_empty=True)
    print("first pass:", summary)
    await asyncio.sleep(0.5)  # the flaky one is due again after its backoff
    print("second pass:", await queue.run(send_email, stop_when_empty=True))
    stats = await queue.stats()
    print("final:", {status: count for status, count in stats.counts.items() if count})


if __name__ == "__main__":
    # mongoq logs (never prints): retries at INFO, failures given up at WARNING.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main())
