"""Regression tests for what two reviews of the outbox found (each fixed in the library).

One review scenario per test, named after the behaviour it guarantees, each reading the stored
documents back; a bounded random-fault run closes the file. Covered elsewhere: a keyed publish
retried after its event write lost its reply (test_outbox_publish.py). Not tested: workers that
serve disjoint handler sets starving each other of a lane (a documented limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel
import bson
import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout, OperationFailure, PyMongoError

import mongoq.outbox.parking as parking_module
from mongoq import _driver
from mongoq.errors import LeaseLost
from mongoq.outbox import AsyncOutbox, Delivery, DeliveryContext, Event, OutboxRunSummary, lane_of
from mongoq.outbox.dispatcher import OutboxDispatcher
from mongoq.outbox.source import DeliverySource
from mongoq.testing import ManualClock, Operation, instrument
from tests.support.helpers import nth, utc
from tests.support.outbox_helpers import (
    LEASE,
    ONLY_H,
    another,
    attempts,
    bury_head,
    deliveries,
    delivery_of,
    dispatcher,
    drain,
    entry,
    events,
    faulty_outbox,
    keys_in_distinct_lanes,
    lanes,
    new_outbox,
    paid,
    projecting,
    projection_collection,
    ran,
    stored,
)


async def lane_of_key(db: Any, key: str) -> dict[str, Any]:
    return (await lanes(db))[lane_of(key)]


async def parked(db: Any) -> list[str]:
    return sorted(d["event_id"] for d in await deliveries(db) if d.get("lane") == "parked")


async def claim_into(found: list[Delivery], outbox: AsyncOutbox, owner: str) -> None:
    found.extend(await outbox.claim(owner))


# ----------------------------------------------------- claims and settles nobody will finish


class FlakyClock(ManualClock):
    """A manual clock whose next refresh fails once `armed` (a server clock's `hello` failing)."""

    armed = False

    async def refresh(self) -> None:
        if self.armed:
            self.armed = False
            raise OperationFailure("injected: hello failed")


#: fault -> (what fails, the settle of d that fails; None: the claim of d loses its reply)
FAILURES: dict[str, tuple[str, Any]] = {
    "claim, reply lost": ("bulk_write", None),
    "complete_many, delete failed": ("delete_many", lambda o, d: o.complete_many([d])),
    "complete, delete failed": ("delete_one", lambda o, d: o.complete(d)),
    "reschedule, update failed": ("update_one", lambda o, d: o.reschedule(d, delay=60)),
    "complete_many, clock failed": ("clock", lambda o, d: o.complete_many([d])),
    "complete, clock failed": ("clock", lambda o, d: o.complete(d)),
    "reschedule, clock failed": ("clock", lambda o, d: o.reschedule(d, delay=60)),
}


@pytest.mark.parametrize("fault", list(FAILURES))
async def test_a_delivery_nobody_will_settle_is_handed_out_again_by_its_owners_next_claim(
    odb: Any, fault: str
) -> None:
    """s1, s2 and settle_before_try: A runs `busy` in one lane and keeps renewing. d is listed
    as A's on a second lane, but nobody will settle it: the claim that recorded it lost its
    reply, or settling it failed before any write (at the command, or at the clock refresh
    ahead of it). A's next claim frees d (generation +1, no attempt charged) and hands it out;
    nobody else can meanwhile, and d2 stays behind d."""
    clock = FlakyClock()
    outbox, faults = await faulty_outbox(odb, clock)
    other = another(outbox.db, clock)
    k1, k2 = keys_in_distinct_lanes(2)
    await outbox.publish([paid("busy", k1), paid("d", k2), paid("d2", k2)], session=None)
    [busy] = await outbox.claim("A", limit=1)
    point, settle = FAILURES[fault]
    if settle is None:
        faults.fail_after(point, collection="ob_lanes")
    else:
        [d] = await outbox.claim("A", limit=1)
        if point == "clock":
            clock.armed = True
        else:
            faults.fail_before(point, collection="ob_deliveries")
    before = await stored(odb)
    with pytest.raises(PyMongoError):
        await (outbox.claim("A", limit=1) if settle is None else settle(outbox, d))
    assert not clock.armed and len(faults.triggered) == (point != "clock")
    assert await stored(odb) == before  # a claim writes no delivery; the settle wrote nothing
    lane = await lane_of_key(odb, k2)
    assert (lane["owner"], lane["instance"], lane["epoch"]) == ("A", outbox.instance, 1)
    assert lane["in_flight"] == [entry(await delivery_of(odb, "d", "stats"))]

    handed: list[Delivery] = []
    for _ in range(6):  # two leases
        clock.advance(LEASE / 3)
        assert await outbox.extend_lease("A") == 2
        handed += await outbox.claim("A", limit=5)
        assert await other.claim("B", limit=5) == []
    assert ran(handed) == [("d", 1)]
    assert handed[0].lease_token == f"{lane_of(k2)}:1:1"
    assert attempts(await deliveries(odb)) == {"busy": (0, 0), "d": (0, 1), "d2": (0, 0)}
    assert await outbox.complete_many([busy, *handed]) == [True, True]
    assert ran(await drain(outbox, "A")) == [("d2", 1)]
    assert await deliveries(odb) == []


# ------------------------------------------------------------------------------- takeovers


async def test_a_takeover_applies_only_to_the_lane_state_it_judged_free(
    odb: Any, clock: ManualClock
) -> None:
    """s4: B reads K's lane free (A's lease lapsed, nothing listed) and picks e0. Before B's
    take lands, A renews, runs and completes e0, hands the lane back (same epoch, no owner) and
    e1 of K is published. B's take pins the lane's `rev`, so it matches nothing: B hands out
    neither the completed e0 nor e1 beside it; its claim tries once more, from the lanes as they
    are now, and takes e1 in a take of its own (a new epoch)."""
    crashed, faults = await faulty_outbox(odb, clock)
    a, b = another(crashed.db, clock), another(crashed.db, clock)
    lane_id = lane_of("K")
    await crashed.publish(paid("e0", "K"), session=None)
    assert ran(await crashed.claim("Z")) == [("e0", 1)]
    clock.advance(LEASE)
    faults.fail_before("aggregate", collection="ob_deliveries")  # after A's takeover and charge
    with pytest.raises(PyMongoError):
        await a.claim("A")
    lane = await lane_of_key(odb, "K")
    assert (lane["owner"], lane["epoch"], lane["in_flight"], lane["lost"]) == ("A", 2, [], [])
    assert attempts(await deliveries(odb)) == {"e0": (1, 1)}
    clock.advance(LEASE)  # A's renewal is late: its lane looks free and lists nothing

    pause = faults.pause_before("bulk_write", collection="ob_lanes")
    got_b: list[Delivery] = []
    async with anyio.create_task_group() as group:
        group.start_soon(claim_into, got_b, b, "B")
        await pause.reached.wait()  # B picked e0 and is about to take the lane
        assert await a.extend_lease("A") == 1
        [e0] = await a.claim("A")
        assert (e0.event.id, e0.attempt) == ("e0", 2)
        assert await a.complete(e0)
        assert await a.claim("A") == []  # nothing left: the lane is handed back
        await a.publish(paid("e1", "K"), session=None)
        pause.release()
    [e1] = got_b
    assert (e1.event.id, e1.attempt, e1.lease_token) == ("e1", 1, f"{lane_id}:3:0")
    lane = await lane_of_key(odb, "K")
    assert (lane["owner"], lane["epoch"], lane["lost"]) == ("B", 3, [])
    assert [entry["d"] for entry in lane["in_flight"]] == [bson.ObjectId(e1.id)]
    assert attempts(await deliveries(odb)) == {"e1": (0, 0)}
    assert await b.claim("B") == []
    assert await b.complete(e1)
    assert await deliveries(odb) == []


# ------------------------------------------------------------------------------- requeues


@pytest.mark.parametrize("count", ["counted", "count failed"])
async def test_a_pick_a_requeue_overtook_during_its_claim_is_not_handed_out(
    odb: Any, clock: ManualClock, count: str
) -> None:
    """s5 and requeue_uncounted: e1 of k is dead, e2 and e3 wait. A claim reads e2 as k's head;
    e1 is requeued before the claim records e2 (in the second case the requeue's second count
    fails, and calling requeue again finishes it: True, the lane's count moves, the mark goes). The
    count in the lane fails the claim's lane write, so e2 is never recorded nor charged; the
    claim tries once more from the lanes as they are now and hands out e1, which runs first."""
    outbox, faults = await faulty_outbox(odb, clock)
    await bury_head(outbox, error="boom")
    pause = faults.pause_before("bulk_write", collection="ob_lanes")
    got: list[Delivery] = []
    async with anyio.create_task_group() as group:
        group.start_soon(claim_into, got, outbox, "A")
        await pause.reached.wait()
        if count == "count failed":
            # The requeue counts itself before and after making e1 pending: the second count
            # fails here.
            faults.fail_before("update_one", collection="ob_lanes", match=nth(1))
            with pytest.raises(PyMongoError):
                await outbox.requeue("e1", "stats")
            doc = await delivery_of(odb, "e1", "stats")
            assert doc is not None
            assert (doc["status"], doc.get("requeue_uncounted")) == ("pending", True)
        assert await outbox.requeue("e1", "stats") is True
        pause.release()
    assert [(d.event.id, d.attempt) for d in got] == [("e1", 1)]
    docs = await deliveries(odb)
    assert attempts(docs) == {"e1": (0, 2), "e2": (0, 0), "e3": (0, 0)}
    assert [(d["status"], "requeue_uncounted" in d) for d in docs] == [("pending", False)] * 3
    lane = await lane_of_key(odb, "k")
    assert lane["requeued"] == (2 if count == "counted" else 3)
    assert [entry["d"] for entry in lane["in_flight"]] == [bson.ObjectId(got[0].id)]
    assert await outbox.requeue("e1", "stats") is False  # nothing left to finish
    assert (await outbox.stats()).running == 1
    assert await outbox.complete(got[0])
    assert [d.event.id for d in await drain(outbox, "A")] == ["e2", "e3"]
    assert await deliveries(odb) == []


# -------------------------------------------------------------------------------- parking

TWO_HANDLERS = {"a": ["h1"], "b": ["h2"]}


@pytest.mark.parametrize("alternate", [False, True], ids=["alone", "beside-other-handlers"])
async def test_unparking_pages_through_every_parked_key_with_a_cursor_per_handler_set(
    odb: Any, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, alternate: bool
) -> None:
    """s7 and unpark_cursor (one page: 2 keys): keys b0-b3 stay blocked (heads retry in two
    hours, followers parked), x's follower is parked behind a head that then completes. Each
    claim looks one page further, so x-2 is moved back and runs within three claims, also
    when another claimer of the same outbox, for other handlers, claims in between."""
    monkeypatch.setattr(parking_module, "UNPARK_KEYS_PER_CLAIM", 2)
    outbox = await new_outbox(odb, clock, subscriptions=TWO_HANDLERS)
    keys = ["b0", "b1", "b2", "b3", "x"]  # the order unparking visits them in
    await outbox.publish(
        [Event(f"{k}-{n}", "a", key=k) for k in keys for n in (1, 2)], session=None
    )
    heads = await outbox.claim("X", ["h1"], limit=10)
    assert ran(heads) == [(f"{k}-1", 1) for k in keys]
    for head in heads:
        hours = 1 if head.event.key == "x" else 2
        assert await outbox.reschedule(head, delay=hours * 3600, error="downstream down")
    assert await outbox.claim("X", ["h1"]) == []  # parks the followers: no head is due
    assert await parked(odb) == [f"{k}-2" for k in keys]

    clock.advance(3600)
    handed: list[str] = []
    for _ in range(4):
        for delivery in await outbox.claim("X", ["h1"]):
            handed.append(delivery.event.id)
            assert await outbox.complete(delivery)
        if alternate:
            assert await outbox.claim("Y", ["h2"]) == []
    assert handed == ["x-1", "x-2"]
    assert await parked(odb) == [f"{k}-2" for k in keys[:4]]
    docs = {d["event_id"]: d for d in await deliveries(odb)}
    for key in keys[:4]:
        head = docs[f"{key}-1"]
        assert (head["lane"], head["attempts"]) == ("ready", 1)
        assert utc(head["due_at"]) == clock.now() + timedelta(hours=1)


async def test_a_claim_cancelled_while_parking_leaves_its_picks_to_the_next_claim(
    odb: Any, clock: ManualClock
) -> None:
    """park_cancel: x0 of k1 runs on A and 33 more of k1 wait; A's claim records y (k2), then is
    cancelled while parking k1's backlog. y is not counted as running: A's next claim hands it
    out (generation +1, no attempt) and parks the backlog, which then runs in order."""
    outbox, faults = await faulty_outbox(odb, clock)
    k1, k2 = keys_in_distinct_lanes(2)
    await outbox.publish(paid("x0", k1), session=None)
    [x0] = await outbox.claim("A")
    backlog = [f"x{n}" for n in range(1, 34)]  # more than PARK_THRESHOLD
    await outbox.publish([*(paid(name, k1) for name in backlog), paid("y", k2)], session=None)
    pause = faults.pause_before("update_many", collection="ob_deliveries")
    async with anyio.create_task_group() as group:
        group.start_soon(outbox.claim, "A")
        await pause.reached.wait()
        group.cancel_scope.cancel()
    assert [op.name for op in faults.triggered] == ["update_many"]
    lane, y = await lane_of_key(odb, k2), await delivery_of(odb, "y", "stats")
    assert (lane["owner"], lane["in_flight"]) == ("A", [entry(y)])
    assert await parked(odb) == []

    handed: list[Delivery] = []
    for _ in range(3):  # one lease; x0 still runs
        clock.advance(LEASE / 3)
        assert await outbox.extend_lease("A") == 2
        handed += await outbox.claim("A")
    assert ran(handed) == [("y", 1)]
    assert attempts(await deliveries(odb))["y"] == (0, 1)
    assert await parked(odb) == sorted(backlog)
    statistics = await outbox.stats()
    assert (statistics.running, statistics.parked) == (2, 33)
    assert await outbox.complete_many([x0, *handed]) == [True, True]
    assert [d.event.id for d in await drain(outbox, "A")] == backlog
    assert await deliveries(odb) == []


# ------------------------------------------------------------------------------ dispatcher


async def test_a_handlers_own_lease_lost_is_retried_with_backoff_then_buried(
    odb: Any, clock: ManualClock
) -> None:
    """leaselost_loop: a LeaseLost the handler raises itself (not from `context.complete`) is a
    failure like any other: rescheduled after the backoff, charged, buried after max_attempts."""
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish(Event("e1", "t", key="k"), session=None)
    calls: list[int] = []

    async def handler(event: Event, context: DeliveryContext) -> None:
        calls.append(context.attempt)
        if len(calls) > 3:
            worker.stop()  # ends a loop that would run it again at once
        raise LeaseLost("the task lease this handler used was lost")

    worker = dispatcher(outbox, {"h": handler}, max_attempts=3)
    for attempt in (1, 2):
        await worker.run(stop_when_empty=True)
        doc = await delivery_of(odb, "e1", "h")
        assert doc is not None
        assert (doc["status"], doc["attempts"], doc["claims"]) == ("pending", attempt, attempt)
        assert utc(doc["due_at"]) == clock.now() + timedelta(seconds=10)
        assert "LeaseLost: the task lease" in doc["last_error"]
        clock.advance(10)
    await worker.run(stop_when_empty=True)
    assert calls == [1, 2, 3]
    assert worker.summary == OutboxRunSummary(claimed=3, retried=2, buried=1)
    [doc] = await deliveries(odb)
    assert (doc["status"], doc["attempts"], "due_at" in doc) == ("dead", 3, False)


async def test_lease_lost_from_context_complete_counts_as_lost_and_changes_nothing(
    txdb: Any, clock: ManualClock
) -> None:
    """The other side: `context.complete(session)` raising LeaseLost means another worker runs
    the delivery, so this dispatcher counts it lost and neither retries nor charges it."""
    outbox, partition = await faulty_outbox(txdb, clock, subscriptions=ONLY_H)
    # The lane renewals fail: the lease runs out mid-handler.
    partition.fail_before("update_many", collection="ob_lanes", times=1000)
    await outbox.publish(Event("e1", "t"), session=None)
    taken: list[Delivery] = []

    async def handler(event: Event, context: DeliveryContext) -> None:
        clock.advance(LEASE)
        taken.extend(await another(txdb, clock, ONLY_H).claim("intruder", ["h"]))
        await _driver.run_in_transaction(txdb, context.complete)

    summary = await dispatcher(outbox, {"h": handler}).run(stop_when_empty=True)
    assert summary == OutboxRunSummary(claimed=1, lost=1)
    assert ran(taken) == [("e1", 2)]
    [doc] = await deliveries(txdb)
    assert (doc["status"], doc["attempts"], doc["claims"]) == ("pending", 1, 1)
    assert "last_error" not in doc
    lane = (await lanes(txdb))[taken[0].lane_id]
    assert (lane["owner"], lane["in_flight"]) == ("intruder", [{"d": doc["_id"], "g": 1, "h": "h"}])


def raising_backoff(attempt: int) -> float:
    raise ZeroDivisionError("bug in the backoff")


@pytest.mark.parametrize(
    "backoff",
    [lambda a: -1.0, lambda a: float("nan"), lambda a: float("inf"), raising_backoff],
    ids=["negative", "nan", "infinite", "raising"],
)
async def test_a_backoff_without_a_usable_delay_falls_back_to_the_default_and_keeps_the_retry(
    odb: Any, clock: ManualClock, backoff: Any
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish([Event("e1", "t", key="k"), Event("e2", "t", key="k")], session=None)
    calls: list[tuple[str, int]] = []

    async def flaky(event: Event, context: DeliveryContext) -> None:
        calls.append((event.id, context.attempt))
        if calls == [("e1", 1)]:
            raise RuntimeError("flaky downstream")

    worker = dispatcher(outbox, {"h": flaky}, max_attempts=3, backoff=backoff)
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(claimed=1, retried=1)
    first, second = await deliveries(odb)
    assert (first["status"], first["attempts"], first["claims"]) == ("pending", 1, 1)
    assert "flaky downstream" in first["last_error"]
    # default_backoff(1): one second times a jitter in [1, 1.25)
    due = utc(first["due_at"])
    assert clock.now() + timedelta(seconds=1) <= due <= clock.now() + timedelta(seconds=1.25)
    assert (second["event_id"], second["attempts"], second["claims"]) == ("e2", 0, 0)
    clock.advance(1.25)
    await worker.run(stop_when_empty=True)
    assert calls == [("e1", 1), ("e1", 2), ("e2", 1)]
    assert worker.summary == OutboxRunSummary(claimed=3, completed=2, retried=1)
    assert await deliveries(odb) == []


@pytest.mark.parametrize("stale", ["first", "last"])
async def test_a_flush_holding_two_claims_of_one_delivery_completes_it_by_the_newest(
    odb: Any, clock: ManualClock, stale: str
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish(Event("e1", "t"), session=None)
    [old] = await outbox.claim("w", ["h"])
    assert await outbox.release(old)
    [new] = await outbox.claim("w", ["h"])
    assert old.id == new.id and (old.lease_token[-2:], new.lease_token[-2:]) == (":0", ":1")

    async def noop(event: Event, context: DeliveryContext) -> None:
        return None

    worker = OutboxDispatcher(outbox, {"h": noop})
    source = DeliverySource(worker, worker_id="w", handler_timeout=None)
    source._finished = [old, new] if stale == "first" else [new, old]
    await source.flush()
    assert source._finished == []
    # The older claim had ended: counted lost, so that each claim is counted once.
    assert worker.summary == OutboxRunSummary(completed=1, lost=1)
    assert await deliveries(odb) == []
    assert (await events(odb))["e1"].get("completed_at") is not None


class Rollback(Exception):
    pass


async def test_a_transactional_handler_returning_after_its_transaction_aborted_is_retried(
    txdb: Any, clock: ManualClock
) -> None:
    """s8: the handler completes in its transaction, the transaction aborts, and the handler
    swallows the error and returns. The delivery is rescheduled, not completed without the
    handler's writes; the next attempt commits both."""
    outbox = await new_outbox(txdb, clock, subscriptions=ONLY_H)
    projection = await projection_collection(txdb)
    await outbox.publish(Event("e1", "t"), session=None)
    project = projecting(txdb, fail_first=Rollback())

    async def swallowing(event: Event, context: DeliveryContext) -> None:
        with contextlib.suppress(Rollback):
            await project(event, context)

    worker = dispatcher(outbox, {"h": swallowing})
    assert await worker.run(stop_when_empty=True) == OutboxRunSummary(claimed=1, retried=1)
    [doc] = await deliveries(txdb)
    assert (doc["status"], doc["attempts"], doc["claims"]) == ("pending", 1, 1)
    assert utc(doc["due_at"]) == clock.now() + timedelta(seconds=10)
    assert "did not commit the completion" in doc["last_error"]
    assert await projection.count_documents({}) == 0
    assert "completed_at" not in (await events(txdb))["e1"]

    clock.advance(10)
    await worker.run(stop_when_empty=True)
    assert worker.summary == OutboxRunSummary(claimed=2, completed=1, retried=1)
    assert await projection.find({}).to_list(None) == [{"_id": "e1", "attempt": 2}]
    assert await deliveries(txdb) == []
    assert "completed_at" in (await events(txdb))["e1"]


# ---------------------------------------------------------------------- random faults


class RandomFaults:
    """Fails a random share of the writes, before they apply or after (the reply lost); every
    command first yields, so concurrent workers interleave command by command."""

    def __init__(self, rng: random.Random, share: float) -> None:
        self.rng, self.share, self.on, self.hits = rng, share, False, 0

    def _fires(self, op: Operation) -> bool:
        if self.on and op.name not in ("find", "aggregate") and self.rng.random() < self.share:
            self.hits += 1
            return True
        return False

    async def before(self, op: Operation) -> None:
        await anyio.lowlevel.checkpoint()
        if self._fires(op):
            raise AutoReconnect(f"injected before {op.collection}.{op.name}")

    async def after(self, op: Operation, error: BaseException | None) -> None:
        if error is None and self._fires(op):
            raise NetworkTimeout(f"injected after {op.collection}.{op.name}")


#: (weight, settle) of each way the random run settles a delivery
SETTLES: list[tuple[int, Any]] = [
    (50, lambda o, d: o.complete(d)),
    (15, lambda o, d: o.complete_many([d])),
    (15, lambda o, d: o.release(d)),
    (12, lambda o, d: o.reschedule(d, delay=0, error="failed")),
    (8, lambda o, d: o.bury(d, error="failed")),
]


@pytest.mark.parametrize("seed", range(3))
async def test_random_faults_never_hand_out_a_delivery_or_key_twice_at_once_and_all_drains(
    db: Any, clock: ManualClock, seed: int
) -> None:
    """fuzz: owners A and C on one instance and B on another claim, settle (any way), renew
    and requeue dead letters while 8% of the writes fail before or after applying; no lease
    expires. No delivery, and no (handler, key), is handed out while an earlier hand-out of it
    is unsettled (its settle not yet attempted); once the faults stop, everything drains."""
    rng = random.Random(seed)
    faults = RandomFaults(rng, 0.08)
    first = await new_outbox(instrument(db, faults), clock)
    workers = [("A", first), ("C", first), ("B", another(instrument(db, faults), clock))]
    for batch in range(4):
        events_ = [paid(f"e{batch}.{n}", rng.choice(["a", "b", "c", None])) for n in range(6)]
        await first.publish(events_, session=None)
    unsettled: dict[str, tuple[str, str | None, str]] = {}  # delivery -> handler, key, owner
    overlaps: list[str] = []
    handed = 0

    async def work(owner: str, outbox: AsyncOutbox) -> list[Delivery]:
        nonlocal handed
        mine: list[Delivery] = []
        for _ in range(60):
            clock.advance(0.001)
            roll = rng.random()
            if roll < 0.45:
                try:
                    got = await outbox.claim(owner, limit=rng.randint(1, 3))
                except PyMongoError:
                    got = []
                for d in got:
                    keys = {(h, k) for h, k, _ in unsettled.values() if k is not None}
                    if d.id in unsettled or (d.handler, d.event.key) in keys:
                        overlaps.append(f"{d.event.id} to {owner} while unsettled: {unsettled}")
                    unsettled[d.id] = (d.handler, d.event.key, owner)
                handed += len(got)
                mine += got
            elif roll < 0.85 and mine:
                delivery = mine.pop(rng.randrange(len(mine)))
                unsettled.pop(delivery.id, None)  # its settle is attempted from here on
                [(_, way)] = rng.choices(SETTLES, [weight for weight, _ in SETTLES])
                with contextlib.suppress(PyMongoError):
                    await way(outbox, delivery)
            elif roll < 0.9:
                with contextlib.suppress(PyMongoError):
                    await outbox.extend_lease(owner)
            else:
                dead = [d for d in await deliveries(db) if d["status"] == "dead"]
                if dead:
                    pick = rng.choice(dead)
                    with contextlib.suppress(PyMongoError):
                        await outbox.requeue(pick["event_id"], pick["handler"])
            await anyio.lowlevel.checkpoint()
        return mine

    faults.on = True
    leftovers = await asyncio.gather(*(work(owner, outbox) for owner, outbox in workers))
    faults.on = False
    assert overlaps == []
    assert faults.hits > 0 and handed > 0
    for (_, outbox), mine in zip(workers, leftovers, strict=True):
        for delivery in mine:
            await outbox.complete(delivery)
    for _ in range(100):  # each owner's own claims free what its failed calls left listed
        moved = False
        for owner, outbox in workers:
            for delivery in await outbox.claim(owner, limit=10):
                moved = True
                assert await outbox.complete(delivery)
        if not moved:
            break
    left = await deliveries(db)
    assert [d["event_id"] for d in left if d["status"] != "dead"] == []
    statistics = await first.stats()
    assert (statistics.pending, statistics.parked, statistics.running) == (0, 0, 0)


# -------------------------------------------------------------------- third review (r1, r3)


def _is_running_lookup(op: Operation) -> bool:
    """The claim's look at what its lanes list: ``{_id: {$in}, due_at: {$exists}}``."""
    spec = op.filter or {}
    return (
        op.name == "find"
        and isinstance(spec.get("_id"), dict)
        and "$in" in spec["_id"]
        and spec.get("due_at") == {"$exists": True}
    )


@pytest.mark.parametrize("settle", ["reschedule", "complete"])
async def test_a_settle_failing_during_a_claims_lookup_is_freed_and_its_late_write_refused(
    odb: Any, clock: ManualClock, settle: str
) -> None:
    """r1: A runs x (key k1); z's claim lost its reply, so the next claim looks its lanes up.
    While that lookup is in flight, x's settle fails. The claim frees x to the next claim
    generation (no attempt charged), so the failed settle's token, arriving late, is refused,
    and x's follower y never runs beside the new run of x."""
    outbox, faults = await faulty_outbox(odb, clock)
    k1, k2 = keys_in_distinct_lanes(2)
    await outbox.publish([paid("x", k1), paid("y", k1), paid("z", k2)], session=None)
    [x] = await outbox.claim("A", limit=1)
    faults.fail_after("bulk_write", collection="ob_lanes")  # z's claim loses its reply
    with pytest.raises(PyMongoError):
        await outbox.claim("A", limit=1)
    pause = faults.pause_before("find", collection="ob_deliveries", match=_is_running_lookup)
    got: list[Delivery] = []
    async with anyio.create_task_group() as group:
        group.start_soon(claim_into, got, outbox, "A")
        await pause.reached.wait()
        faults.fail_before("update_one" if settle == "reschedule" else "delete_one",
                           collection="ob_deliveries")  # fmt: skip
        with pytest.raises(PyMongoError):
            await (outbox.reschedule(x, delay=60) if settle == "reschedule" else outbox.complete(x))
        pause.release()
    rerun = {d.event.id: d for d in got}
    assert "x" in rerun and rerun["x"].lease_token != x.lease_token
    stored_x = await delivery_of(odb, "x", "stats")
    assert stored_x is not None and (stored_x["claims"], stored_x["attempts"]) == (1, 0)
    late = outbox.reschedule(x, delay=60) if settle == "reschedule" else outbox.complete(x)
    assert await late is False  # the old claim's write, arriving late, changes nothing
    again = await delivery_of(odb, "x", "stats")
    assert again is not None and (again["claims"], again["attempts"]) == (1, 0)
    assert "y" not in [d.event.id for d in await outbox.claim("A", limit=5)]  # x runs
    assert await outbox.complete(rerun["x"])


async def test_a_delivery_settled_through_another_outbox_object_does_not_block_its_key(
    odb: Any, clock: ManualClock
) -> None:
    """r3: x is claimed through one AsyncOutbox and completed through another over the same
    collections; the claiming object's next claim finds x gone and hands out y."""
    first = await new_outbox(odb, clock)
    second = await new_outbox(odb, clock)
    await first.publish([paid("x", "k"), paid("y", "k")], session=None)
    [x] = await first.claim("A")
    assert await second.complete(x)
    assert await delivery_of(odb, "x", "stats") is None
    assert [d.event.id for d in await first.claim("A")] == ["y"]
