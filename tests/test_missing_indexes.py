"""A primitive whose indexes were never created says so once, clearly, and claims nothing.

Claims name their index (a hint), and a server refuses a hint to an index that does not exist.
Before, a worker started before ``setup()`` ran logged a driver failure on every poll,
forever; the embedded backend ignored hints, so this only ever showed in production. Now every
hinted query raises `IndexesMissing`, naming the collection, the index and the set-up call, and a
run loop stops with it. Runs on both embedded lanes and on a real server.
"""

from __future__ import annotations

from typing import Any

import pytest

from mongoq import (
    AsyncGroupTransport,
    AsyncTaskQueue,
    GroupLease,
    IndexesMissing,
    NewMessage,
    NewTask,
    Task,
)
from mongoq.outbox import AsyncOutbox, DeliveryContext, Event, OutboxDispatcher
from mongoq.testing import ManualClock
from tests.support.helpers import read

NAMES_THE_FIX = r"has no index 'claim'.*setup\(\)"


async def test_a_task_queue_without_indexes_refuses_to_claim(db: Any, clock: ManualClock) -> None:
    queue = AsyncTaskQueue(db, "tasks", clock=clock)  # no setup()
    await queue.put("t", 1)
    with pytest.raises(IndexesMissing, match=NAMES_THE_FIX):
        await queue.claim("w")
    with pytest.raises(IndexesMissing, match=NAMES_THE_FIX):
        await queue.claim_many(5, "w")
    ran: list[Any] = []

    async def handler(task: Task) -> None:
        ran.append(task.id)

    # The run loop stops with the error instead of logging a failure every poll.
    with pytest.raises(IndexesMissing):
        await queue.run(handler, concurrency=2)
    assert ran == []
    stored = await read(db, "t")
    assert stored is not None
    assert (stored["status"], stored["attempts"]) == ("pending", 0)
    await queue.setup()
    assert (await queue.claim("w")) is not None


async def test_a_group_transport_without_indexes_refuses_to_claim(
    db: Any, clock: ManualClock
) -> None:
    transport = AsyncGroupTransport(db, "mq", clock=clock)
    await transport.publish_many([NewMessage("g", "e")])
    with pytest.raises(IndexesMissing, match=NAMES_THE_FIX):
        await transport.claim("w")
    with pytest.raises(IndexesMissing, match=NAMES_THE_FIX):
        await transport.claim_many(5, "w")

    async def handler(lease: GroupLease) -> None:
        raise AssertionError("nothing may be delivered")

    with pytest.raises(IndexesMissing):
        await transport.run(handler, batch_size=4)
    lock = await db["mq_locks"].find_one({"_id": "g"})
    assert lock is not None and lock["token"] is None  # never leased
    message = await db["mq_messages"].find_one({"group_id": "g"})
    assert message is not None and message["deliveries"] == 0
    await transport.setup()
    assert (await transport.claim("w")) is not None


async def test_an_outbox_without_setup_refuses_to_claim(db: Any, clock: ManualClock) -> None:
    outbox = AsyncOutbox(db, subscriptions={"order.placed": ["h"]}, clock=clock)
    await outbox.publish(Event(id="e1", type="order.placed"), session=None)
    with pytest.raises(IndexesMissing, match=r"has no index .*setup\(\)"):
        await outbox.claim("w")

    async def handle(event: Event, context: DeliveryContext) -> None:
        raise AssertionError("nothing may be delivered")

    with pytest.raises(IndexesMissing):
        await OutboxDispatcher(outbox, {"h": handle}).run()
    delivery = await db["mongoq_outbox_deliveries"].find_one({"event_id": "e1"})
    assert delivery is not None and delivery["attempts"] == 0
    await outbox.setup()
    assert len(await outbox.claim("w")) == 1


async def test_put_needs_no_index(db: Any, clock: ManualClock) -> None:
    """Producers may start before the indexes exist: only consumers' queries name one."""
    queue = AsyncTaskQueue(db, "tasks", clock=clock)
    assert (await queue.put_many([NewTask("a"), NewTask("b")])).inserted == 2
