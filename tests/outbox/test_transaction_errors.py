"""Regression tests for issue item 6: a write error inside a transaction is never swallowed.

On a server, any write error inside a multi-document transaction (a duplicate key among them)
aborts the transaction, even if the client catches it: the commit then fails with
NoSuchTransaction, labelled TransientTransactionError, so ``with_transaction`` runs the callback
again, which meets the same duplicate: a loop until the driver's 120 s limit. The test engine
(tests/support/txengine.py) behaves the same way, giving up after a few attempts.

The completion history was written with an insert whose duplicate keys were ignored. Each test
here plants the history record of a delivery before completing it (as a completion whose outcome
was lost, written outside a transaction, would leave it), completes it in a transaction (the
handler's, or the outbox's own), and reads back what committed: the delivery gone, the event's
completion time, exactly one history record.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import bson

from mongoq import _driver
from mongoq.outbox import AsyncOutbox, Delivery, Event, OutboxRunSummary
from mongoq.testing import ManualClock
from tests.support.helpers import utc
from tests.support.outbox_helpers import (
    ONLY_H,
    PREFIX,
    deliveries,
    dispatcher,
    events,
    new_outbox,
    projecting,
    projection_collection,
)


async def history(db: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = await (
        db[f"{PREFIX}completed_deliveries"].find({}, sort=[("_id", 1)]).to_list(None)
    )
    return found


async def plant_history_record(db: Any, delivery: Delivery, clock: ManualClock) -> None:
    """The record a completion of `delivery` writes, there already."""
    await db[f"{PREFIX}completed_deliveries"].insert_one(
        {
            "_id": bson.ObjectId(delivery.id),
            "event_id": delivery.event.id,
            "event_type": delivery.event.type,
            "handler": delivery.handler,
            "attempts": delivery.attempt,
            "worker_id": delivery.worker_id,
            "created_at": clock.now(),
            "completed_at": clock.now(),
        }
    )


async def assert_completed_once(
    db: Any, clock: ManualClock, completed: list[Delivery], left: int = 0
) -> None:
    assert len(await deliveries(db)) == left
    stored = await events(db)
    for delivery in completed:
        assert utc(stored[delivery.event.id]["completed_at"]) == clock.now()
    records = await history(db)
    assert sorted(r["_id"] for r in records) == sorted(bson.ObjectId(d.id) for d in completed)
    for record, delivery in zip(records, sorted(completed, key=lambda d: d.id), strict=True):
        assert (record["event_id"], record["handler"]) == (delivery.event.id, delivery.handler)


async def planted_outbox(
    db: Any, clock: ManualClock, count: int = 1, plant: int = 0
) -> tuple[AsyncOutbox, list[Delivery]]:
    """An outbox with completion history, its `count` deliveries (of e1, e2, ... to "h")
    claimed, and the history record of the `plant`-th of them already there."""
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H, completion_history=True)
    await outbox.publish([Event(f"e{n}", "t") for n in range(1, count + 1)], session=None)
    batch = await outbox.claim("w", ["h"], limit=count)
    assert len(batch) == count
    await plant_history_record(db, batch[plant], clock)
    return outbox, batch


async def test_completing_in_the_handlers_transaction_over_an_existing_history_record_commits(
    txdb: Any, clock: ManualClock
) -> None:
    outbox, [delivery] = await planted_outbox(txdb, clock)
    projection = await projection_collection(txdb)
    clock.advance(1)
    runs = 0

    async def work(session: Any) -> bool:
        nonlocal runs
        runs += 1
        await projection.insert_one({"_id": delivery.event.id}, session=session)
        return await outbox.complete(delivery, session=session)

    assert await _driver.run_in_transaction(txdb, work) is True
    assert runs == 1  # committed at once, not retried
    assert await projection.count_documents({}) == 1  # the handler's write committed
    await assert_completed_once(txdb, clock, [delivery])


async def test_a_dispatched_handler_completing_over_an_existing_history_record_commits(
    txdb: Any, clock: ManualClock
) -> None:
    outbox, [delivery] = await planted_outbox(txdb, clock)
    projection = await projection_collection(txdb)
    assert await outbox.release(delivery)

    worker = dispatcher(outbox, {"h": projecting(txdb)})
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(claimed=1, completed=1)
    assert await projection.find({}).to_list(None) == [{"_id": "e1", "attempt": 1}]
    await assert_completed_once(txdb, clock, [delivery])


async def test_completing_in_the_outboxs_own_transaction_over_an_existing_history_record(
    txdb: Any, clock: ManualClock
) -> None:
    outbox, [delivery] = await planted_outbox(txdb, clock)
    clock.advance(1)
    assert await outbox.complete(delivery) is True
    await assert_completed_once(txdb, clock, [delivery])


async def test_a_batch_completion_with_one_existing_history_record_commits_them_all(
    txdb: Any, clock: ManualClock
) -> None:
    outbox, batch = await planted_outbox(txdb, clock, 3, plant=1)
    clock.advance(1)
    assert await outbox.complete_many(batch) == [True, True, True]
    await assert_completed_once(txdb, clock, batch)


async def test_a_completion_on_any_backend_keeps_an_existing_history_record_and_adds_none(
    odb: Any, clock: ManualClock
) -> None:
    """With transactions or without (the embedded backend): one record per delivery."""
    outbox, (first, second) = await planted_outbox(odb, clock, 2)
    clock.advance(1)
    assert await outbox.complete_many([first, second]) == [True, True]
    await assert_completed_once(odb, clock, [first, second])
    [planted] = [r for r in await history(odb) if r["_id"] == bson.ObjectId(first.id)]
    assert utc(planted["completed_at"]) == clock.now() - timedelta(seconds=1)  # kept as it was
