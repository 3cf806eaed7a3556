"""Batched run loops keep every slot busy when commands interleave (as on a server).

On the embedded backend's plain lane no two claims overlap; on the interleaving lane (and on a
server) the slots of one worker read the same candidates at once. A claim that lost its
candidates to another slot must move past them rather than report "nothing due": otherwise the
slot naps (or, with ``stop_when_empty``, exits) while due work waits, and one slot of eight does
all the work. Assertions read the stored documents, and count the handlers running at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio.lowlevel

from mongoq import AsyncGroupTransport, AsyncTaskQueue, NewMessage, NewTask
from mongoq.testing import ManualClock
from tests.support.group_helpers import assert_empty, new_transport
from tests.support.helpers import new_queue, read_all

ITEMS = 400
SLOTS = 8
BATCH = 10


#: Event-loop turns a handler waits at most for the other slots to start theirs: yields only
#: (the manual clock does not move), enough for a server's round trips too.
PATIENCE = 20_000


class Busy:
    """Counts handlers running at once. Until all slots have been busy together, each handler
    waits (a bounded number of yields) for the others to start theirs, so the count says
    whether every slot got work while due work remained, on any backend's timing."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.seen: Counter[Any] = Counter()

    async def work(self, item: Any) -> None:
        self.seen[item] += 1
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            for _ in range(PATIENCE):
                if self.most >= SLOTS:
                    break
                await anyio.lowlevel.checkpoint()
        finally:
            self.now -= 1


async def run_with_every_slot_busy(
    runner: AsyncTaskQueue | AsyncGroupTransport, item: Callable[[Any], Any]
) -> Any:
    """`runner.run` to the end with every slot and batches, each handler working on
    `item(what it was handed)`; asserts that all slots were busy at once and every one of the
    `ITEMS` was handled once, and returns the run's summary."""
    busy = Busy()

    async def handle(handed: Any) -> None:
        await busy.work(item(handed))

    summary = await runner.run(
        handle, concurrency=SLOTS, batch_size=BATCH, stop_when_empty=True, worker_id="w"
    )
    assert busy.most == SLOTS
    assert set(busy.seen.values()) == {1} and len(busy.seen) == ITEMS
    return summary


async def test_every_task_slot_is_busy_at_once(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    await queue.put_many(NewTask(f"t{i}", i) for i in range(ITEMS))

    summary = await run_with_every_slot_busy(queue, lambda task: task.id)

    assert summary.completed == ITEMS
    stored = await read_all(db)
    assert len(stored) == ITEMS
    assert {doc["status"] for doc in stored.values()} == {"done"}
    assert all(doc["attempts"] == 1 for doc in stored.values())  # each claimed once


async def test_every_group_slot_is_busy_at_once(db: Any, clock: ManualClock) -> None:
    transport = await new_transport(db, clock)
    await transport.publish_many(NewMessage(f"g{i}", i) for i in range(ITEMS))

    summary = await run_with_every_slot_busy(transport, lambda lease: lease.event)

    assert summary.acked == ITEMS
    await assert_empty(db)  # every message acked, every group dropped
