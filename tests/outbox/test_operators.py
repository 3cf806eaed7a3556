"""AsyncOutbox's operator calls: `stats`, `list_deliveries`, `requeue`, `purge`, and the
completion history behind ``completion_history=True``.

Each test builds the states it lists (pending, running, dead, completed) through the public
calls, then compares what the operator call reports with the documents read back, and what a
purge deletes with what stays.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from mongoq.outbox import (
    AsyncOutbox,
    Delivery,
    DeliveryContext,
    Event,
    OutboxRunSummary,
    OutboxStats,
    PublishResult,
    PurgeResult,
)
from mongoq.outbox.schema import PUBLISH_GRACE
from mongoq.testing import CommandCounter, ManualClock, instrument
from tests.support.helpers import rejects, utc
from tests.support.outbox_helpers import (
    LEASE,
    ONLY_H,
    PREFIX,
    deliveries,
    dispatcher,
    event,
    events,
    new_outbox,
    order,
    projecting,
    projection_collection,
)


async def claim_all(outbox: AsyncOutbox, handler: str | None = None) -> dict[str, Delivery]:
    """Claim every due delivery (of `handler`), by ``<event id>/<handler>``."""
    batch = await outbox.claim("w", None if handler is None else [handler], limit=100)
    return {f"{d.event.id}/{d.handler}": d for d in batch}


async def history(db: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = await (
        db[f"{PREFIX}completed_deliveries"].find({}, sort=[("event_id", 1), ("handler", 1)])
    ).to_list(None)
    return found


async def count(db: Any, **query: Any) -> int:
    return int(await db[f"{PREFIX}deliveries"].count_documents(query))


# --------------------------------------------------------------------------------- stats


async def test_stats_count_pending_running_dead_and_held_lanes(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock, lease_ttl=LEASE)  # order.created: mail, stats
    assert await outbox.stats() == OutboxStats(0, 0, 0, 0, 0, None, 0)
    t0 = clock.now()
    await outbox.publish([order(1), order(2, kind="order.paid")], session=None)
    clock.advance(5)
    await outbox.publish(order(3), session=None)
    assert await outbox.stats() == OutboxStats(5, 0, 0, 0, 0, t0, 0)

    claimed = await claim_all(outbox, "mail")
    assert sorted(claimed) == ["e1/mail", "e3/mail"]
    lanes_used = len({d.lane_id for d in claimed.values()})
    assert await outbox.stats() == OutboxStats(5, 0, 2, 0, 0, t0, lanes_used)

    assert await outbox.bury(claimed["e1/mail"], error="bad address")
    assert await outbox.complete(claimed["e3/mail"])
    assert (await count(odb, status="pending"), await count(odb, status="dead")) == (3, 1)
    # Running means claimed and not settled; the lanes stay held until their leases end.
    assert await outbox.stats() == OutboxStats(3, 0, 0, 1, 0, t0, lanes_used)

    clock.advance(LEASE)
    stats = await outbox.stats()
    assert stats == OutboxStats(3, 0, 0, 1, 0, t0, 0)
    assert stats.oldest_due_at == min(
        utc(d["due_at"]) for d in await deliveries(odb) if "due_at" in d
    )


async def test_completion_history_records_every_completion_for_statistics_and_listing(
    odb: Any, clock: ManualClock
) -> None:
    # On "memory" the completions are not transactional, on "tx" they run in a transaction.
    outbox = await new_outbox(odb, clock, completion_history=True)
    t0 = clock.now()
    await outbox.publish([order(1), order(2, kind="order.paid")], session=None)
    clock.advance(7)

    async def handle(event: Event, context: DeliveryContext) -> None:
        return None

    worker = dispatcher(outbox, {"mail": handle, "stats": handle})
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(claimed=3, completed=3)
    assert await deliveries(odb) == []
    records = await history(odb)
    assert [(r["event_id"], r["handler"], r["attempts"], r["worker_id"]) for r in records] == [
        ("e1", "mail", 1, "w"),
        ("e1", "stats", 1, "w"),
        ("e2", "stats", 1, "w"),
    ]
    assert {utc(r["completed_at"]) for r in records} == {clock.now()}
    assert {utc(r["created_at"]) for r in records} == {t0}
    assert await outbox.stats() == OutboxStats(0, 0, 0, 0, 3, None, 0)

    listed = await outbox.list_deliveries(status="completed")
    assert [(i.event_id, i.handler, i.status, i.attempts) for i in listed] == [
        (r["event_id"], r["handler"], "completed", 1) for r in records
    ]
    assert {i.id for i in listed} == {str(r["_id"]) for r in records}
    assert [i.event_id for i in await outbox.list_deliveries(event_type="order.paid")] == ["e2"]
    assert len(await outbox.list_deliveries(handler="stats", status="completed")) == 2


async def test_without_completion_history_no_delivery_is_reported_completed(
    odb: Any, clock: ManualClock
) -> None:
    # Records left by a process that had completion history on (or by an earlier config).
    recording = await new_outbox(odb, clock, completion_history=True)
    await recording.publish(order(1), session=None)
    claimed = await claim_all(recording)
    assert await recording.complete_many(list(claimed.values())) == [True, True]
    await recording.publish(order(2, kind="order.paid"), session=None)
    assert len(await history(odb)) == 2

    plain = await new_outbox(odb, clock)
    # Held: the lane of e1's number for each handler, mail's and stats's.
    assert await plain.stats() == OutboxStats(1, 0, 0, 0, 0, clock.now(), 2)
    assert [(i.event_id, i.status) for i in await plain.list_deliveries()] == [("e2", "pending")]
    assert await plain.list_deliveries(status="completed") == []
    assert len(await history(odb)) == 2


async def test_completion_history_of_a_transactional_handler_commits_or_aborts_with_it(
    txdb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(txdb, clock, subscriptions=ONLY_H, completion_history=True)
    projection = await projection_collection(txdb)
    await outbox.publish(event(1), session=None)
    project = projecting(txdb, fail_first=RuntimeError("abort after completing"))

    worker = dispatcher(outbox, {"h": project})
    await worker.run(stop_when_empty=True)
    assert await history(txdb) == []
    assert await projection.count_documents({}) == 0
    assert (await outbox.stats()).completed == 0

    clock.advance(10)
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(
        claimed=2, completed=1, retried=1
    )
    [record] = await history(txdb)
    assert (record["event_id"], record["handler"], record["attempts"]) == ("e1", "h", 2)
    assert await projection.find({}).to_list(None) == [{"_id": "e1", "attempt": 2}]
    assert await deliveries(txdb) == []
    assert (await outbox.stats()).completed == 1


# ------------------------------------------------------------------------- list_deliveries


async def test_list_deliveries_filters_by_status_handler_and_type_oldest_first(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await outbox.publish(order(1), session=None)  # e1: mail, stats
    clock.advance(1)
    await outbox.publish(order(2, kind="order.paid"), session=None)  # e2: stats
    clock.advance(1)
    await outbox.publish(order(3), session=None)  # e3: mail, stats
    [mail] = await outbox.claim("w", ["mail"], limit=1)
    assert await outbox.bury(mail, error="mailbox full")
    [stats] = await outbox.claim("w", ["stats"], limit=1)
    assert (mail.event.id, stats.event.id) == ("e1", "e1")
    before = await deliveries(odb)

    everything = await outbox.list_deliveries()
    assert [(i.event_id, i.handler, i.status, i.running) for i in everything] == [
        ("e1", "mail", "dead", False),
        ("e1", "stats", "pending", True),
        ("e2", "stats", "pending", False),
        ("e3", "mail", "pending", False),
        ("e3", "stats", "pending", False),
    ]
    by_id = {str(d["_id"]): d for d in before}
    for info in everything:
        doc = by_id[info.id]
        assert (info.event_id, info.handler, info.attempts) == (
            doc["event_id"], doc["handler"], doc["attempts"]
        )  # fmt: skip
        assert info.event_type == doc["event_type"]
        assert info.due_at == (utc(doc["due_at"]) if "due_at" in doc else None)
        assert info.created_at == utc(doc["created_at"])
    dead = everything[0]
    assert dead.attempts == 1 and dead.due_at is None
    assert dead.last_error is not None and "mailbox full" in dead.last_error

    def pick(infos: list[Any]) -> list[tuple[str, str]]:
        return [(i.event_id, i.handler) for i in infos]

    assert pick(await outbox.list_deliveries(status="dead")) == [("e1", "mail")]
    assert pick(await outbox.list_deliveries(status="pending")) == [
        ("e1", "stats"), ("e2", "stats"), ("e3", "mail"), ("e3", "stats"),
    ]  # fmt: skip
    assert pick(await outbox.list_deliveries(handler="mail")) == [("e1", "mail"), ("e3", "mail")]
    assert pick(await outbox.list_deliveries(event_type="order.paid")) == [("e2", "stats")]
    assert pick(await outbox.list_deliveries(status="pending", handler="stats", limit=2)) == [
        ("e1", "stats"), ("e2", "stats"),
    ]  # fmt: skip
    assert pick(await outbox.list_deliveries(limit=1)) == [("e1", "mail")]
    assert await outbox.list_deliveries(status="completed") == []  # no completion history
    assert await outbox.list_deliveries(status="dead", handler="stats") == []

    # Once the claim ends (the lease runs out), nothing is listed as running any more.
    clock.advance(LEASE)
    assert [i.running for i in await outbox.list_deliveries()] == [False] * 5
    assert await deliveries(odb) == before  # listing writes nothing


async def test_operator_calls_refuse_bad_arguments_before_touching_anything(
    odb: Any, clock: ManualClock, counter: CommandCounter
) -> None:
    outbox = await new_outbox(instrument(odb, counter), clock, subscriptions=ONLY_H)
    await outbox.publish(event(1), session=None)
    before = await deliveries(odb)
    counter.reset()
    with rejects("status"):
        await outbox.list_deliveries(status="running")
    with rejects("limit"):
        await outbox.list_deliveries(limit=0)
    with rejects("handler"):
        await outbox.list_deliveries(handler="")
    with rejects("event_id"):
        await outbox.requeue("", "h")
    with rejects("handler"):
        await outbox.requeue("e1", "")
    with rejects("dead_before"):
        await outbox.purge(dead_before="yesterday")  # type: ignore[arg-type]
    with rejects("completed_before"):
        await outbox.purge(completed_before=1234)  # type: ignore[arg-type]
    assert counter.total == 0, counter.counts
    assert await outbox.requeue("e1", "h") is False  # pending, not dead
    assert await outbox.requeue("nope", "h") is False
    assert await outbox.purge() == PurgeResult()  # no cutoff: nothing to do
    assert await deliveries(odb) == before


# --------------------------------------------------------------------------------- purge


async def test_purge_removes_dead_letters_older_than_the_cutoff_and_their_events(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish([event(1), event(2), event(3)], session=None)
    clock.advance(PUBLISH_GRACE)  # a purge leaves events stored since less than that alone
    t0 = clock.now()
    claimed = await claim_all(outbox)
    assert await outbox.bury(claimed["e1/h"], error="old failure")
    assert await outbox.release(claimed["e3/h"])
    clock.advance(100)
    assert await outbox.bury(claimed["e2/h"], error="new failure")

    cutoff = t0 + timedelta(seconds=50)
    assert await outbox.purge(dead_before=cutoff) == PurgeResult(dead_deliveries=1, events=1)
    assert [(d["event_id"], d["status"]) for d in await deliveries(odb)] == [
        ("e2", "dead"), ("e3", "pending"),
    ]  # fmt: skip
    assert sorted(await events(odb)) == ["e2", "e3"]  # still referenced
    assert await outbox.purge(dead_before=cutoff) == PurgeResult()

    # A later cutoff takes the newer dead letter; the pending delivery's event stays, however
    # old it is.
    assert await outbox.purge(dead_before=clock.now()) == PurgeResult()  # not before: stays
    later = clock.now() + timedelta(milliseconds=1)
    assert await outbox.purge(dead_before=later) == PurgeResult(dead_deliveries=1, events=1)
    assert [(d["event_id"], d["status"]) for d in await deliveries(odb)] == [("e3", "pending")]
    assert sorted(await events(odb)) == ["e3"]
    assert await outbox.requeue("e2", "h") is False  # purged: nothing to requeue


async def test_purge_keeps_each_event_while_a_pending_or_dead_delivery_references_it(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(
        odb, clock, subscriptions={**ONLY_H, "order.created": ["mail", "stats"]}
    )
    t0 = clock.now()
    await outbox.publish([order(1), event(2), Event(id="e3", type="nobody.listens")], session=None)
    claimed = await claim_all(outbox)
    assert await outbox.complete(claimed["e1/mail"])
    assert await outbox.bury(claimed["e1/stats"], error="failed")
    assert await outbox.release(claimed["e2/h"])
    clock.advance(1000)
    now = clock.now()

    # e3 never completed and nothing references it, but it is not older than the earliest
    # cutoff (dead_before = t0): it stays.
    assert await outbox.purge(dead_before=t0, completed_before=now) == PurgeResult()
    assert sorted(await events(odb)) == ["e1", "e2", "e3"]

    # e1 completed long ago but its dead letter references it; e2 is pending.
    assert await outbox.purge(completed_before=now) == PurgeResult(events=1)
    assert sorted(await events(odb)) == ["e1", "e2"]

    # dead_before alone deletes the dead letter but never an event that has a completion.
    assert await outbox.purge(dead_before=now) == PurgeResult(dead_deliveries=1)
    assert sorted(await events(odb)) == ["e1", "e2"]
    assert await outbox.purge(completed_before=now) == PurgeResult(events=1)
    assert sorted(await events(odb)) == ["e2"]
    assert [(d["event_id"], d["status"]) for d in await deliveries(odb)] == [("e2", "pending")]


async def test_purge_keeps_a_completed_event_as_dedup_record_until_its_last_completion_passes_then_republishing_runs_the_handlers_again(  # noqa: E501
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)  # order.created: mail, stats
    await outbox.publish(order(1), session=None)
    claimed = await claim_all(outbox)
    t0 = clock.now()
    assert await outbox.complete(claimed["e1/mail"])
    clock.advance(20)
    assert await outbox.complete(claimed["e1/stats"])
    last = clock.now()
    assert utc((await events(odb))["e1"]["completed_at"]) == last
    clock.advance(1000)

    # The first completion has passed, the last has not: the event stays, and a redelivery
    # of its id adds nothing.
    for cutoff in (t0 + timedelta(seconds=10), last):
        assert await outbox.purge(completed_before=cutoff) == PurgeResult()
        assert await outbox.publish(order(1), session=None) == PublishResult(0, 0)
        assert await deliveries(odb) == []
    assert await outbox.purge(dead_before=clock.now()) == PurgeResult()  # not a dead_before job

    clock.advance(PUBLISH_GRACE + 1)  # the replays touched it: a purge leaves it that long
    assert await outbox.purge(completed_before=last + timedelta(milliseconds=1)) == PurgeResult(
        events=1
    )
    assert await events(odb) == {}
    # Documented: past the completed retention the id is new again, and both handlers run
    # once more.
    assert await outbox.publish(order(1), session=None) == PublishResult(1, 2)
    assert sorted(await claim_all(outbox)) == ["e1/mail", "e1/stats"]


async def test_purge_with_completion_history_removes_records_before_their_events(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock, completion_history=True)
    await outbox.publish([order(1), order(2, kind="order.paid")], session=None)
    claimed = await claim_all(outbox)
    assert await outbox.complete_many([claimed["e1/mail"], claimed["e1/stats"]]) == [True, True]
    cutoff = clock.now() + timedelta(seconds=50)
    clock.advance(100)
    assert await outbox.complete(claimed["e2/stats"])
    assert len(await history(odb)) == 3

    clock.advance(PUBLISH_GRACE + 1)  # a purge leaves events published since less than that alone
    assert await outbox.purge(completed_before=cutoff) == PurgeResult(completed_records=2, events=1)
    assert [(r["event_id"], r["handler"]) for r in await history(odb)] == [("e2", "stats")]
    assert sorted(await events(odb)) == ["e2"]
    assert (await outbox.stats()).completed == 1
    assert await outbox.publish(order(2, kind="order.paid"), session=None) == PublishResult(0, 0)

    clock.advance(PUBLISH_GRACE + 1)  # the replay touched e2
    assert await outbox.purge(completed_before=clock.now() + timedelta(seconds=1)) == PurgeResult(
        completed_records=1, events=1
    )
    assert await history(odb) == [] and await events(odb) == {}


async def test_purge_in_batches_smaller_than_the_data_deletes_exactly_what_qualifies(
    odb: Any, clock: ManualClock, counter: CommandCounter
) -> None:
    outbox = AsyncOutbox(
        instrument(odb, counter), PREFIX, subscriptions=ONLY_H, clock=clock,
        completion_history=True, purge_batch_size=2,
    )  # fmt: skip
    await outbox.setup()
    # Ids sort as e0 e1 e10 e11 e12 e13 e2 ...: the events of pending deliveries (e10-e12)
    # fall between deletable ones in every page.
    dead, done, waiting = range(5), range(5, 10), range(10, 13)
    # One instant for all: the pages break ties on _id. e13-e15 have no subscriber.
    published = [event(n, kind="t" if n < 13 else "nobody") for n in range(16)]
    await outbox.publish(published, session=None)
    claimed = await claim_all(outbox)
    for n in dead:
        assert await outbox.bury(claimed[f"e{n}/h"], error="poison")
    assert await outbox.complete_many([claimed[f"e{n}/h"] for n in done]) == [True] * 5
    for n in waiting:
        assert await outbox.release(claimed[f"e{n}/h"])
    clock.advance(100)

    counter.reset()
    clock.advance(PUBLISH_GRACE)  # a purge leaves events stored since less than that alone
    result = await outbox.purge(dead_before=clock.now(), completed_before=clock.now())
    assert result == PurgeResult(dead_deliveries=5, completed_records=5, events=13)
    assert [(d["event_id"], d["status"]) for d in await deliveries(odb)] == [
        (f"e{n}", "pending") for n in waiting
    ]
    assert sorted(await events(odb)) == ["e10", "e11", "e12"]
    assert await history(odb) == []
    assert counter.counts[f"{PREFIX}deliveries.delete_many"] == 3  # 2 + 2 + 1
    assert counter.counts[f"{PREFIX}completed_deliveries.delete_many"] == 3
    assert await outbox.purge(dead_before=clock.now(), completed_before=clock.now()) == (
        PurgeResult()
    )
