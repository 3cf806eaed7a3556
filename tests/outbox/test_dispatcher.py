"""OutboxDispatcher: runs every subscribed handler's deliveries, in per-key order, with retries,
dead letters and requeue; stops, is cancelled and renews its lanes as documented; a
transactional handler completes its delivery in its own transaction, or not at all.

Every test reads the stored documents back (deliveries, events, lanes) after the dispatcher is
done; time moves only through the manual clock.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import bson
import pytest

from mongoq.errors import LeaseLost, PermanentError
from mongoq.outbox import (
    AsyncOutbox,
    DeliveryContext,
    Event,
    OutboxDispatcher,
    OutboxRunSummary,
    lane_of,
)
from mongoq.testing import FaultInjector, ManualClock, instrument
from tests.support.helpers import rejects, until, utc, wait_for
from tests.support.outbox_helpers import (
    LEASE,
    ONLY_H,
    Handler,
    deliveries,
    delivery_of,
    dispatcher,
    event,
    events,
    faulty_outbox,
    lanes,
    new_outbox,
    projecting,
    projection_collection,
)


async def holding(
    db: Any, clock: ManualClock, published: Event | list[Event], **options: Any
) -> AsyncOutbox:
    """An outbox of `ONLY_H` (one delivery to "h" per `event`) with `published` published."""
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H, **options)
    await outbox.publish(published, session=None)
    return outbox


async def e1_delivery(db: Any) -> dict[str, Any]:
    """The stored delivery of e1 to "h", which must be there."""
    stored = await delivery_of(db, "e1", "h")
    assert stored is not None
    return stored


def recorder(seen: list[tuple[str, str, int]], name: str = "h") -> Handler:
    """A handler that records (`name`, event id, attempt) in `seen`, yields once (so that
    concurrent runs interleave) and completes."""

    async def handle(event: Event, context: DeliveryContext) -> None:
        seen.append((name, event.id, context.attempt))
        await anyio.lowlevel.checkpoint()

    return handle


async def assert_lanes_handed_back(db: Any) -> None:
    held = {i: lane["owner"] for i, lane in (await lanes(db)).items() if lane["owner"] is not None}
    assert held == {}, f"lanes still held: {held}"


async def assert_all_completed(db: Any, ids: list[str]) -> None:
    assert await deliveries(db) == []
    stored = await events(db)
    assert sorted(stored) == sorted(ids)
    assert all(stored[i].get("completed_at") is not None for i in ids)


# ------------------------------------------------------------------------------- running


async def test_run_until_empty_runs_every_subscribed_handler_once_and_hands_lanes_back(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)  # order.created -> mail, stats; order.paid -> stats
    published = [Event(id=f"c{n}", type="order.created", payload={"n": n}) for n in range(3)]
    published.append(Event(id="p0", type="order.paid"))
    await outbox.publish(published, session=None)
    seen: list[tuple[str, str, int]] = []

    # A dispatcher runs only its own handlers: the stats deliveries wait for another one.
    mail_only = await dispatcher(outbox, {"mail": recorder(seen, "mail")}).run(stop_when_empty=True)
    assert mail_only == OutboxRunSummary(claimed=3, completed=3)
    assert sorted(d["event_id"] for d in await deliveries(odb)) == ["c0", "c1", "c2", "p0"]
    assert {d["handler"] for d in await deliveries(odb)} == {"stats"}
    assert {e["_id"] for e in (await events(odb)).values() if "completed_at" in e} == {
        "c0", "c1", "c2"
    }  # fmt: skip

    handlers = {"mail": recorder(seen, "mail"), "stats": recorder(seen, "stats")}
    summary = await dispatcher(outbox, handlers, worker_id="w2").run(stop_when_empty=True)
    assert summary == OutboxRunSummary(claimed=4, completed=4)
    assert sorted(seen) == sorted(
        [("mail", f"c{n}", 1) for n in range(3)]
        + [("stats", f"c{n}", 1) for n in range(3)]
        + [("stats", "p0", 1)]
    )
    await assert_all_completed(odb, ["c0", "c1", "c2", "p0"])
    await assert_lanes_handed_back(odb)


async def test_concurrent_dispatch_keeps_per_key_order_and_never_runs_one_key_twice_at_once(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    keys = ["k0", "k1", "k2"]
    for n in range(15):  # interleaved across the keys, published one at a time
        await outbox.publish(event(n, keys[n % 3]), session=None)
    started: list[tuple[str, int]] = []
    running: set[str] = set()
    overlaps: list[tuple[str, int]] = []
    widest = 0

    async def handle(event: Event, context: DeliveryContext) -> None:
        nonlocal widest
        assert event.key is not None and context.delivery.sequence is not None
        if event.key in running:
            overlaps.append((event.key, context.delivery.sequence))
        running.add(event.key)
        widest = max(widest, len(running))
        started.append((event.key, context.delivery.sequence))
        for _ in range(3):  # let the other keys' handlers and the claim loop interleave
            await anyio.lowlevel.checkpoint()
        running.discard(event.key)

    summary = await dispatcher(outbox, {"h": handle}, concurrency=8).run(stop_when_empty=True)
    assert overlaps == []
    assert widest > 1, "the keys never ran side by side: the test proves nothing"
    for key in keys:
        assert [seq for k, seq in started if k == key] == [1, 2, 3, 4, 5]
    assert summary == OutboxRunSummary(claimed=15, completed=15)
    await assert_all_completed(odb, [f"e{n}" for n in range(15)])
    await assert_lanes_handed_back(odb)


async def test_run_once_claims_one_batch_returns_its_own_summary_and_keeps_lanes(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, [event(n) for n in range(3)])
    seen: list[tuple[str, str, int]] = []
    worker = dispatcher(outbox, {"h": recorder(seen)}, concurrency=2)
    assert await worker.run_once() == OutboxRunSummary(claimed=2, completed=2)
    ran = [event_id for _, event_id, _ in seen]
    assert len(ran) == 2
    assert [d["event_id"] for d in await deliveries(odb)] == [
        e for e in ("e0", "e1", "e2") if e not in ran
    ]
    assert {lane["owner"] for lane in (await lanes(odb)).values()} == {None, "w"}

    assert await worker.run_once() == OutboxRunSummary(claimed=1, completed=1)
    assert sorted(seen) == [("h", "e0", 1), ("h", "e1", 1), ("h", "e2", 1)]
    assert worker.summary == OutboxRunSummary(claimed=3, completed=3)  # the running totals
    await assert_all_completed(odb, ["e0", "e1", "e2"])
    # Nothing left: the claim hands back the lanes that yield nothing and run nothing.
    assert await worker.run_once() == OutboxRunSummary()
    await assert_lanes_handed_back(odb)


# ------------------------------------------------------------------- retries and dead letters


async def test_a_failure_is_rescheduled_after_the_backoff_and_then_completes(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, event(1))
    calls: list[tuple[str, int]] = []

    async def flaky(event: Event, context: DeliveryContext) -> None:
        calls.append((event.id, context.attempt))
        if context.attempt == 1:
            raise RuntimeError("flaky downstream")

    worker = dispatcher(outbox, {"h": flaky}, max_attempts=3)
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(claimed=1, retried=1)
    stored = await e1_delivery(odb)
    assert stored["status"] == "pending" and stored["attempts"] == 1
    assert utc(stored["due_at"]) == clock.now() + timedelta(seconds=10)
    assert "flaky downstream" in stored["last_error"]

    clock.advance(9)  # not due yet
    assert await worker.run_once() == OutboxRunSummary()
    assert calls == [("e1", 1)]
    clock.advance(1)
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(
        claimed=2, completed=1, retried=1
    )
    assert calls == [("e1", 1), ("e1", 2)]
    await assert_all_completed(odb, ["e1"])
    await assert_lanes_handed_back(odb)


async def test_a_poison_delivery_is_buried_after_max_attempts_with_its_error(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, event(1))
    attempts: list[int] = []

    async def poison(event: Event, context: DeliveryContext) -> None:
        attempts.append(context.attempt)
        raise ValueError(f"cannot parse payload {event.payload}")

    worker = dispatcher(outbox, {"h": poison}, max_attempts=3)
    for _ in range(3):
        await worker.run(stop_when_empty=True)
        clock.advance(10)
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(
        claimed=3, retried=2, buried=1
    )
    assert attempts == [1, 2, 3]
    stored = await e1_delivery(odb)
    assert stored["status"] == "dead" and stored["attempts"] == 3
    assert "due_at" not in stored
    assert "ValueError: cannot parse payload {'n': 1}" in stored["last_error"]
    assert "completed_at" not in (await events(odb))["e1"]
    await assert_lanes_handed_back(odb)


async def test_permanent_error_buries_at_once_and_the_key_goes_on(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, [event(1, "k"), event(2, "k")])
    ran: list[str] = []

    async def handle(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)
        if event.id == "e1":
            raise PermanentError("customer deleted")

    summary = await dispatcher(outbox, {"h": handle}, max_attempts=5).run(stop_when_empty=True)
    assert summary == OutboxRunSummary(claimed=2, completed=1, buried=1)
    assert ran == ["e1", "e2"]
    [dead] = await deliveries(odb)
    assert (dead["event_id"], dead["status"], dead["attempts"]) == ("e1", "dead", 1)
    assert "customer deleted" in dead["last_error"]
    assert "completed_at" in (await events(odb))["e2"]


async def test_requeue_runs_a_dead_letter_again_before_its_unclaimed_followers(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, [event(1, "k"), event(2, "k")])
    ran: list[tuple[str, int]] = []
    broken = True

    async def handle(event: Event, context: DeliveryContext) -> None:
        ran.append((event.id, context.attempt))
        if broken and event.id == "e1":
            raise RuntimeError("bug in handler")

    worker = dispatcher(outbox, {"h": handle}, max_attempts=1, concurrency=1)
    assert await worker.run_once() == OutboxRunSummary(claimed=1, buried=1)  # e1 dead
    assert await worker.run_once() == OutboxRunSummary(claimed=1, completed=1)  # e2 went on
    assert ran == [("e1", 1), ("e2", 1)]
    await outbox.publish([event(3, "k"), event(4, "k")], session=None)  # after the burial

    broken = False  # the handler is fixed; the operator requeues the dead letter
    assert await outbox.requeue("e1", "h") is True
    stored = await e1_delivery(odb)
    assert (stored["status"], stored["attempts"], stored["sequence"]) == ("pending", 0, 1)
    assert utc(stored["due_at"]) == clock.now()
    assert await outbox.requeue("e1", "h") is False  # not dead any more

    # e1 runs again although e2 already ran, and e3 and e4 (never claimed) wait behind it.
    await worker.run(stop_when_empty=True)
    assert ran[2:] == [("e1", 1), ("e3", 1), ("e4", 1)]
    await assert_all_completed(odb, ["e1", "e2", "e3", "e4"])


async def test_requeued_dead_letter_waits_while_a_later_delivery_of_its_key_runs(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, [event(1, "k"), event(2, "k")])
    gate = anyio.Event()
    ran: list[str] = []

    async def handle(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)
        if event.id == "e1" and len(ran) == 1:
            raise PermanentError("first try fails")
        if event.id == "e2":
            await gate.wait()

    worker = dispatcher(outbox, {"h": handle}, concurrency=2, poll_interval=1)
    async with anyio.create_task_group() as group:
        group.start_soon(partial(worker.run, stop_when_empty=True))
        await wait_for(lambda: ran == ["e1", "e2"], "e1 buried and e2 running")
        assert await outbox.requeue("e1", "h") is True
        clock.advance(5)  # the claim loop polls again: e1 must not start beside e2
        next_poll = clock.now() + timedelta(seconds=1)
        await wait_for(lambda: clock.sleeping_until(next_poll) == 1, "the poll's claim to end")
        assert ran == ["e1", "e2"]
        gate.set()
    assert ran == ["e1", "e2", "e1"]
    await assert_all_completed(odb, ["e1", "e2"])


async def test_a_delivery_charged_past_max_attempts_by_takeovers_is_buried_unrun(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, event(1), lease_ttl=LEASE)
    # Two workers crash while running it: each takeover charges the attempt they lost.
    for crashed in ("ghost1", "ghost2"):
        [claimed] = await outbox.claim(crashed, ["h"])
        clock.advance(LEASE + 1)
    assert claimed.attempt == 2
    seen: list[tuple[str, str, int]] = []
    summary = await dispatcher(outbox, {"h": recorder(seen)}, max_attempts=2).run(
        stop_when_empty=True
    )
    assert seen == []
    assert summary == OutboxRunSummary(claimed=1, buried=1)
    stored = await e1_delivery(odb)
    assert stored["status"] == "dead"
    # the two lost attempts, plus the third that ended as the burial
    assert stored["attempts"] == 3
    assert "gave up after 2 attempts" in stored["last_error"]
    await assert_lanes_handed_back(odb)


# --------------------------------------------------------------- stopping and cancellation


async def test_stop_from_a_handler_lets_running_handlers_finish_and_claims_nothing_more(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, [event(n) for n in range(5)])
    ran: list[str] = []

    async def handle(event: Event, context: DeliveryContext) -> None:
        worker.stop()
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        ran.append(event.id)

    worker = dispatcher(outbox, {"h": handle}, concurrency=2)
    assert await worker.run() == OutboxRunSummary(claimed=2, completed=2)
    assert len(ran) == 2
    left = await deliveries(odb)
    assert sorted(d["event_id"] for d in left) == sorted({f"e{n}" for n in range(5)} - set(ran))
    assert all(d["attempts"] == 0 and d["claims"] == 0 for d in left)
    await assert_lanes_handed_back(odb)

    # The next dispatcher runs the rest, each on its first attempt.
    seen: list[tuple[str, str, int]] = []
    await dispatcher(outbox, {"h": recorder(seen)}, worker_id="w2").run(stop_when_empty=True)
    assert sorted(seen) == sorted(("h", d["event_id"], 1) for d in left)
    await assert_all_completed(odb, [f"e{n}" for n in range(5)])


def claim_brake(allowed: int) -> tuple[FaultInjector, Callable[[], None]]:
    """A fault that, once armed, lets `allowed` lane reads through and fails the next ones: it
    ends a claim loop that keeps claiming after a cancellation (instead of hanging the test)."""
    brake = FaultInjector()
    armed: list[int] = []

    def over(op: Any) -> bool:
        if not armed:
            return False
        armed[0] += 1
        return armed[0] > allowed

    brake.fail_before("find", collection="ob_lanes", times=5, match=over)
    return brake, lambda: armed.append(0)


async def test_cancelling_run_releases_the_running_delivery_uncharged_and_hands_lanes_back(
    odb: Any, clock: ManualClock
) -> None:
    brake, arm = claim_brake(allowed=2)
    outbox = await holding(instrument(odb, brake), clock, event(1, "k"))
    started: list[int] = []
    running = anyio.Event()

    async def hang(event: Event, context: DeliveryContext) -> None:
        started.append(context.attempt)
        running.set()
        await anyio.Event().wait()

    worker = dispatcher(outbox, {"h": hang})
    async with anyio.create_task_group() as group:
        group.start_soon(worker.run)
        await running.wait()
        clock.advance(3)
        arm()
        group.cancel_scope.cancel()
    assert started == [1]
    assert worker.summary == OutboxRunSummary(claimed=1, released=1)
    stored = await e1_delivery(odb)
    assert (stored["status"], stored["attempts"], stored["claims"]) == ("pending", 0, 1)
    assert utc(stored["due_at"]) == clock.now()
    assert brake.triggered == []
    brake.clear()
    await assert_lanes_handed_back(odb)

    seen: list[tuple[str, str, int]] = []
    await dispatcher(outbox, {"h": recorder(seen)}, worker_id="w2").run(stop_when_empty=True)
    assert seen == [("h", "e1", 1)]  # the released run was not charged by the next holder
    await assert_all_completed(odb, ["e1"])


async def test_a_long_handler_keeps_its_lanes_renewed_and_its_key_to_itself(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await holding(odb, clock, [event(1, "k"), event(2, "k")], lease_ttl=LEASE)
    other = await new_outbox(odb, clock, subscriptions=ONLY_H, lease_ttl=LEASE)  # another process
    gate = anyio.Event()
    ran: list[str] = []

    async def handle(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)
        if event.id == "e1":
            await gate.wait()

    lane_id = lane_of("k")
    worker = dispatcher(outbox, {"h": handle})
    async with anyio.create_task_group() as group:
        group.start_soon(partial(worker.run, stop_when_empty=True))
        await wait_for(lambda: ran == ["e1"], "e1 to start")
        epoch = (await lanes(odb))[lane_id]["epoch"]
        previous = utc((await lanes(odb))[lane_id]["lease_until"])
        for _ in range(9):  # three whole leases
            clock.advance(LEASE / 3)
            renewed = clock.now() + timedelta(seconds=LEASE)
            every = await until(
                partial(lanes, odb),
                lambda docs, at=renewed: utc(docs[lane_id]["lease_until"]) == at,
                "the renewal",
            )
            lane = every[lane_id]
            assert (lane["owner"], lane["epoch"]) == ("w", epoch)
            assert utc(lane["lease_until"]) == clock.now() + timedelta(seconds=LEASE)
            assert utc(lane["lease_until"]) > previous
            previous = utc(lane["lease_until"])
            assert await other.claim("intruder", ["h"]) == []
        assert [d["event_id"] for d in await deliveries(odb)] == ["e1", "e2"]
        gate.set()
    assert ran == ["e1", "e2"]
    assert worker.summary == OutboxRunSummary(claimed=2, completed=2)
    await assert_all_completed(odb, ["e1", "e2"])
    await assert_lanes_handed_back(odb)


# ------------------------------------------------------------------ transactional handlers


async def test_transactional_handler_completes_with_its_projection(
    txdb: Any, clock: ManualClock
) -> None:
    outbox = await holding(txdb, clock, [event(1, "k"), event(2, "k")])
    projection = await projection_collection(txdb)
    summary = await dispatcher(outbox, {"h": projecting(txdb)}).run(stop_when_empty=True)
    assert summary == OutboxRunSummary(claimed=2, completed=2)
    assert await projection.find({}, sort=[("_id", 1)]).to_list(None) == [
        {"_id": "e1", "attempt": 1},
        {"_id": "e2", "attempt": 1},
    ]
    await assert_all_completed(txdb, ["e1", "e2"])
    await assert_lanes_handed_back(txdb)


async def test_transactional_handler_aborted_after_completing_is_retried_not_completed(
    txdb: Any, clock: ManualClock
) -> None:
    outbox = await holding(txdb, clock, event(1))
    projection = await projection_collection(txdb)
    failure = RuntimeError("validation failed after completing")

    worker = dispatcher(outbox, {"h": projecting(txdb, fail_first=failure)})
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(claimed=1, retried=1)
    assert await projection.count_documents({}) == 0
    stored = await e1_delivery(txdb)
    assert (stored["status"], stored["attempts"]) == ("pending", 1)
    assert "validation failed after completing" in stored["last_error"]
    assert "completed_at" not in (await events(txdb))["e1"]

    clock.advance(10)
    await worker.run(stop_when_empty=True)
    assert await projection.find({}).to_list(None) == [{"_id": "e1", "attempt": 2}]
    await assert_all_completed(txdb, ["e1"])


async def test_transactional_handler_that_lost_its_lane_raises_lease_lost_and_writes_nothing(
    txdb: Any, clock: ManualClock
) -> None:
    # The dispatcher's lane renewals fail (a partition), so its lease runs out mid-handler and
    # another worker takes the lane over, charging the lost attempt.
    outbox, partition = await faulty_outbox(txdb, clock, subscriptions=ONLY_H)
    partition.fail_before("update_many", collection="ob_lanes", times=1000)
    other = await new_outbox(txdb, clock, subscriptions=ONLY_H)
    projection = await projection_collection(txdb)
    await outbox.publish(event(1), session=None)
    taken: list[Any] = []
    outcomes: list[str] = []
    project = projecting(txdb)

    async def slow(event: Event, context: DeliveryContext) -> None:
        if context.attempt == 1:
            clock.advance(LEASE + 1)
            taken.extend(await other.claim("intruder", ["h"]))
        try:
            await project(event, context)
        except LeaseLost:
            outcomes.append("lease lost")
            raise

    worker = dispatcher(outbox, {"h": slow}, concurrency=1)
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(claimed=1, lost=1)
    assert outcomes == ["lease lost"]
    assert [(d.event.id, d.attempt) for d in taken] == [("e1", 2)]
    assert await projection.count_documents({}) == 0
    stored = await e1_delivery(txdb)
    assert (stored["status"], stored["attempts"], stored["claims"]) == ("pending", 1, 1)
    lane = (await lanes(txdb))[taken[0].lane_id]
    assert lane["owner"] == "intruder"
    assert lane["in_flight"] == [{"d": bson.ObjectId(taken[0].id), "g": 1, "h": "h"}]

    # The intruder crashes too; the next worker runs it a third time, once.
    clock.advance(LEASE + 1)
    await dispatcher(other, {"h": projecting(txdb)}, worker_id="w2").run(stop_when_empty=True)
    assert await projection.find({}).to_list(None) == [{"_id": "e1", "attempt": 3}]
    await assert_all_completed(txdb, ["e1"])


# ------------------------------------------------------------------------------ validation


async def noop(event: Event, context: DeliveryContext) -> None:
    return None


@pytest.mark.parametrize(
    ("field", "handlers", "options"),
    [
        ("handlers", {}, {}),
        ("handlers", [("h", noop)], {}),
        ("handlers", {"": noop}, {}),
        ("handlers['h']", {"h": "not callable"}, {}),
        ("max_attempts", {"h": noop}, {"max_attempts": 0}),
        ("concurrency", {"h": noop}, {"run": {"concurrency": 0}}),
        ("concurrency", {"h": noop}, {"run": {"concurrency": 1001}}),
        ("worker_id", {"h": noop}, {"run": {"worker_id": ""}}),
        ("poll_interval", {"h": noop}, {"run": {"poll_interval": 0}}),
        ("handler_timeout", {"h": noop}, {"run": {"handler_timeout": -1}}),
        ("concurrency", {"h": noop}, {"run_once": {"concurrency": 0}}),
        ("handler_timeout", {"h": noop}, {"run_once": {"handler_timeout": -1}}),
    ],
)
async def test_bad_dispatcher_arguments_are_refused(
    odb: Any, clock: ManualClock, field: str, handlers: Any, options: dict[str, Any]
) -> None:
    outbox = await holding(odb, clock, event(1))
    with rejects(field):
        built = OutboxDispatcher(
            outbox, handlers, **{k: v for k, v in options.items() if k not in ("run", "run_once")}
        )
        run, run_once = options.get("run"), options.get("run_once")
        if run is not None:
            await built.run(stop_when_empty=True, **run)
        if run_once is not None:
            await built.run_once(**run_once)
    [stored] = await deliveries(odb)
    assert (stored["status"], stored["attempts"], stored["claims"]) == ("pending", 0, 0)
    await assert_lanes_handed_back(odb)
