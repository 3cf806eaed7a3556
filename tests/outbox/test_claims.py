"""AsyncOutbox claims, lanes, fencing and settles, one call at a time.

A claim leases lanes, not deliveries: it records what it hands out in the lane documents and
writes no delivery document. These tests read the lane and delivery documents back after every
step: who holds which lane until when, what it lists as running, what each settle wrote, that a
stale token changes nothing (byte for byte), that a takeover charges a lost attempt exactly once,
and that deliveries of one key and handler run one at a time in sequence order.
Races between concurrent calls and injected faults are in tests/outbox/test_races.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import bson
import pytest

from mongoq import _driver
from mongoq.outbox import AsyncOutbox, Delivery, Event, lane_of
from mongoq.runtime.report import error_text
from mongoq.testing import CommandCounter, ManualClock, instrument
from tests.support.helpers import rejects, utc
from tests.support.outbox_helpers import (
    LEASE,
    PREFIX,
    bury_head,
    deliveries,
    delivery_of,
    drain,
    entry,
    events,
    key_in_lane,
    keys_in_distinct_lanes,
    lane_docs,
    lane_ids_of,
    new_outbox,
    order,
    paid,
    pairs,
    stored,
)


def token(delivery: Delivery) -> tuple[int, int, int]:
    lane, epoch, claims = delivery.lease_token.split(":")
    return int(lane), int(epoch), int(claims)


async def settle_stale(outbox: AsyncOutbox, delivery: Delivery) -> list[Any]:
    """Every settle of a delivery whose claim ended: each must return False."""
    return [
        await outbox.complete(delivery),
        await outbox.complete_many([delivery]),
        await outbox.reschedule(delivery, delay=5, error="stale"),
        await outbox.release(delivery),
        await outbox.bury(delivery, error="stale"),
    ]


# ------------------------------------------------------------------------------ claim basics


async def test_a_claim_hands_out_due_deliveries_oldest_first_and_records_them_on_lanes(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await outbox.publish(order(3), session=None)
    clock.advance(1)
    await outbox.publish([order(1), paid("p2")], session=None)
    clock.advance(1)
    before = await stored(odb)

    batch = await outbox.claim("A", limit=10)

    assert pairs(batch) == [("e3", "mail"), ("e3", "stats"), ("e1", "mail"), ("e1", "stats"),
                            ("p2", "stats")]  # fmt: skip
    assert await stored(odb) == before  # a claim writes no delivery document
    docs = {(d["event_id"], d["handler"]): d for d in await deliveries(odb)}
    expected: dict[int, list[dict[str, Any]]] = {}  # by lane _id: each handler its own lanes
    for delivery in batch:
        doc = docs[(delivery.event.id, delivery.handler)]
        lane = lane_of(delivery.event.id)
        assert (delivery.id, delivery.attempt, delivery.worker_id) == (str(doc["_id"]), 1, "A")
        assert delivery.lease_token == f"{lane}:1:0" and delivery.lane_id == lane
        assert (delivery.sequence, doc["attempts"], doc["claims"]) == (None, 0, 0)
        lane_id = await lane_ids_of(odb, delivery.handler) + lane
        expected.setdefault(lane_id, []).append(entry(doc))
    assert batch[0].event.payload == {"n": 3} and batch[0].event.type == "order.created"
    stored_lanes = await lane_docs(odb)
    for lane, listed in expected.items():
        doc = stored_lanes.pop(lane)
        assert (doc["owner"], doc["instance"], doc["epoch"]) == ("A", outbox.instance, 1)
        assert utc(doc["lease_until"]) == clock.now() + timedelta(seconds=LEASE)
        assert (doc["in_flight"], doc["lost"]) == (listed, [])
    assert {(d["owner"], d["epoch"], len(d["in_flight"])) for d in stored_lanes.values()} == {
        (None, 0, 0)
    }


async def test_a_claim_respects_its_limit_and_handlers(odb: Any, clock: ManualClock) -> None:
    outbox = await new_outbox(odb, clock)
    ids = keys_in_distinct_lanes(3, "u")  # unkeyed: each event's id names its lane
    await outbox.publish([Event(id=i, type="order.created") for i in ids], session=None)
    first = await outbox.claim("A", ["stats"], limit=2)
    assert pairs(first) == [(ids[0], "stats"), (ids[1], "stats")]
    assert pairs(await outbox.claim("A", ["mail"], limit=1)) == [(ids[0], "mail")]
    assert await outbox.claim("A", ["nobody"]) == []
    assert await outbox.claim("A", []) == []
    # The rest, oldest first, from held and free lanes alike.
    rest = await outbox.claim("A", limit=10)
    assert pairs(rest) == [(ids[1], "mail"), (ids[2], "mail"), (ids[2], "stats")]
    for doc in await deliveries(odb):
        assert (doc["attempts"], doc["claims"]) == (0, 0)
    listed = [e["d"] for lane in (await lane_docs(odb)).values() for e in lane["in_flight"]]
    assert sorted(listed) == sorted(d["_id"] for d in await deliveries(odb))
    with rejects("limit"):
        await outbox.claim("A", limit=0)
    with rejects("handlers"):
        await outbox.claim("A", "stats")


# ------------------------------------------------------------------- exclusivity and takeover


async def test_a_leased_lane_is_exclusive_and_its_takeover_charges_and_fences_the_old_holder(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    lane = lane_of("k")
    neighbour = key_in_lane(lane)
    await outbox.publish([paid("x", "k"), paid("n", neighbour)], session=None)
    [held] = await outbox.claim("A", limit=1)
    assert (held.event.id, held.lease_token) == ("x", f"{lane}:1:0")
    lanes_before, docs_before = await lane_docs(odb), await stored(odb)

    # Due work in A's lane is invisible to B, and to another instance under A's own name.
    twin = await new_outbox(odb, clock)
    clock.advance(LEASE - 0.001)
    assert await outbox.claim("B") == []
    assert await twin.claim("A") == []
    assert await twin.extend_lease("A") == 0
    assert (await lane_docs(odb), await stored(odb)) == (lanes_before, docs_before)

    clock.advance(0.001)  # A's lease ends: B takes the lane over
    taken = await outbox.claim("B")
    assert pairs(taken) == [("x", "stats"), ("n", "stats")]
    assert [(d.attempt, d.lease_token) for d in taken] == [(2, f"{lane}:2:1"), (1, f"{lane}:2:0")]
    x = await delivery_of(odb, "x", "stats")
    assert x is not None and (x["attempts"], x["claims"]) == (1, 1)
    assert utc(x["updated_at"]) == clock.now()
    n = await delivery_of(odb, "n", "stats")
    assert n is not None and (n["attempts"], n["claims"]) == (0, 0)
    doc = (await lane_docs(odb))[lane]
    assert (doc["owner"], doc["instance"], doc["epoch"]) == ("B", outbox.instance, 2)
    assert (doc["in_flight"], doc["lost"]) == ([entry(x), entry(n)], [])

    # A's token is stale: nothing it does changes anything, whatever it calls.
    lanes_before, docs_before = await lane_docs(odb), await stored(odb)
    assert await settle_stale(outbox, held) == [False, [False], False, False, False]
    assert await outbox.extend_lease("A") == 0
    assert await outbox.claim("A") == []
    assert (await lane_docs(odb), await stored(odb)) == (lanes_before, docs_before)
    # B's claim is charged once only: a later claim by B neither charges again nor re-hands it.
    assert await outbox.claim("B") == []
    assert await stored(odb) == docs_before
    assert await outbox.complete_many(taken) == [True, True]
    assert await deliveries(odb) == []


@pytest.mark.parametrize("settle", ["complete", "complete_many", "reschedule", "release", "bury"])
async def test_a_stale_settle_leaves_the_same_owners_newer_claim_of_the_delivery_running(
    odb: Any, clock: ManualClock, settle: str
) -> None:
    """A's handler of x outlives its lease: B takes the lane over and releases x, and A claims
    x again (a newer claim, running now). Then A's first handler ends and settles with its old
    token: that must change nothing, neither the delivery nor which claim of x A runs. So A's
    next claim does not hand x out a second time, and the newer claim still completes."""
    outbox = await new_outbox(odb, clock)
    await outbox.publish([paid("x", "k"), paid("x2", "k")], session=None)
    [old] = await outbox.claim("A")
    clock.advance(LEASE)
    [taken] = await outbox.claim("B")
    assert await outbox.release(taken)
    assert await outbox.relinquish("B") == 1
    [current] = await outbox.claim("A")
    assert (current.attempt, token(old)[2], token(taken)[2], token(current)[2]) == (2, 0, 1, 2)
    before = await stored(odb)

    stale = {
        "complete": lambda: outbox.complete(old),
        "complete_many": lambda: outbox.complete_many([old]),
        "reschedule": lambda: outbox.reschedule(old, delay=0, error="late"),
        "release": lambda: outbox.release(old),
        "bury": lambda: outbox.bury(old, error="late"),
    }
    assert await stale[settle]() in (False, [False])
    assert await stored(odb) == before
    assert await outbox.claim("A") == []  # x runs (current), x2 waits behind it
    assert await stored(odb) == before
    assert await outbox.complete(current)
    assert pairs(await drain(outbox, "A")) == [("x2", "stats")]


async def test_a_takeover_beyond_one_claims_share_of_stale_lanes_still_charges_them(
    odb: Any, clock: ManualClock
) -> None:
    """A claim takes over (and charges) at most 32 stale lanes; a stale lane beyond that share
    with other due work must not be taken with its lost deliveries forgotten: they would run
    again uncharged, and their old holder's token would still complete them."""
    outbox = await new_outbox(odb, clock)
    keys = keys_in_distinct_lanes(34)
    await outbox.publish([paid(f"e{i}", key) for i, key in enumerate(keys)], session=None)
    crashed = await outbox.claim("A", limit=100)
    assert len(crashed) == 34
    last = max(crashed, key=lambda d: d.lane_id)  # stale lanes are taken lowest first
    await outbox.publish(paid("y", key_in_lane(last.lane_id)), session=None)
    clock.advance(LEASE)
    for _ in range(3):
        await outbox.claim("B", limit=100)
    assert await outbox.complete(last) is False  # the old holder's token is stale
    doc = await delivery_of(odb, last.event.id, "stats")
    assert doc is not None and (doc["attempts"], doc["claims"]) == (1, 1)
    for d in await deliveries(odb):
        if d["event_id"] != "y":
            assert d["attempts"] == 1, d


# ------------------------------------------------------------- hand back, renew, relinquish


async def test_held_lanes_that_yield_nothing_and_run_nothing_are_handed_back(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    done, retried, running = keys_in_distinct_lanes(3)
    await outbox.publish([paid("d", done), paid("r", retried), paid("s", running)], session=None)
    d, r, s = await outbox.claim("A")
    assert await outbox.complete(d)
    assert await outbox.reschedule(r, delay=60)
    clock.advance(5)

    assert await outbox.claim("A") == []
    stored_lanes = await lane_docs(odb)
    for lane in (d.lane_id, r.lane_id):
        doc = stored_lanes[lane]
        assert (doc["owner"], doc["instance"], doc["epoch"]) == (None, None, 1)
        assert (utc(doc["lease_until"]), doc["in_flight"], doc["lost"]) == (clock.now(), [], [])
    kept = stored_lanes[s.lane_id]  # still running: kept, lease unchanged
    assert (kept["owner"], kept["epoch"], len(kept["in_flight"])) == ("A", 1, 1)
    assert utc(kept["lease_until"]) == clock.now() + timedelta(seconds=LEASE - 5)
    # A handed-back lane is free at once: its retry goes to whoever claims when it is due.
    assert await outbox.complete(s)
    clock.advance(60)
    [again] = await outbox.claim("B")
    assert (again.event.id, again.attempt, again.lease_token) == ("r", 2, f"{r.lane_id}:2:1")


async def test_extend_lease_renews_every_lane_this_instance_holds(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    first, second = keys_in_distinct_lanes(2)
    await outbox.publish(paid("a", first), session=None)
    [a] = await outbox.claim("A")
    clock.advance(10)
    await outbox.publish(paid("b", second), session=None)
    [b] = await outbox.claim("A")
    stored_lanes = await lane_docs(odb)
    assert utc(stored_lanes[a.lane_id]["lease_until"]) == clock.now() + timedelta(seconds=20)
    assert utc(stored_lanes[b.lane_id]["lease_until"]) == clock.now() + timedelta(seconds=30)
    clock.advance(10)
    assert await outbox.extend_lease("A") == 2
    assert await outbox.extend_lease("B") == 0
    assert await (await new_outbox(odb, clock)).extend_lease("A") == 0  # another instance
    for lane in (a.lane_id, b.lane_id):
        assert utc((await lane_docs(odb))[lane]["lease_until"]) == clock.now() + timedelta(
            seconds=30
        )
    # An expired lease nobody took over is renewed too, and then keeps others out.
    clock.advance(LEASE + 1)
    assert await outbox.extend_lease("A") == 2
    assert await outbox.claim("B") == []
    assert {d["claims"] for d in await deliveries(odb)} == {0}
    assert await outbox.complete_many([a, b]) == [True, True]


async def test_relinquish_hands_everything_back_and_only_what_still_ran_is_charged(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    keys = keys_in_distinct_lanes(3)
    await outbox.publish([paid(name, key) for name, key in zip("crs", keys, strict=True)],
                         session=None)  # fmt: skip
    c, r, s = await outbox.claim("A")
    assert await outbox.complete(c)
    assert await outbox.release(r)
    assert await outbox.relinquish("A") == 3
    assert await outbox.relinquish("A") == 0
    stored_lanes = await lane_docs(odb)
    for delivery in (c, r, s):
        doc = stored_lanes[delivery.lane_id]
        assert (doc["owner"], doc["instance"], doc["epoch"]) == (None, None, 1)
        assert (utc(doc["lease_until"]), doc["in_flight"]) == (clock.now(), [])
        assert [e["d"] for e in doc["lost"]] == [bson.ObjectId(delivery.id)]
    # No lease to wait out; the next claimer charges s (still running), not r (released).
    taken = await outbox.claim("B")
    assert [(d.event.id, d.attempt) for d in taken] == [("r", 1), ("s", 2)]
    assert {d["event_id"]: (d["attempts"], d["claims"]) for d in await deliveries(odb)} == {
        "r": (0, 1), "s": (1, 1)
    }  # fmt: skip
    stored_lanes = await lane_docs(odb)
    assert stored_lanes[c.lane_id]["owner"] is None  # taken over, yielded nothing: handed back
    assert stored_lanes[c.lane_id]["lost"] == []
    assert [stored_lanes[d.lane_id]["owner"] for d in (r, s)] == ["B", "B"]
    assert await settle_stale(outbox, s) == [False, [False], False, False, False]


# ---------------------------------------------------------------------------- per-key order


async def test_one_key_and_handler_runs_one_delivery_at_a_time_in_sequence_order(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await outbox.publish([order(1, "k"), order(2, "k"), order(3, "k"), order(4, "j"),
                          order(5, "j")], session=None)  # fmt: skip
    heads = await outbox.claim("A", limit=50)
    assert pairs(heads) == [("e1", "mail"), ("e1", "stats"), ("e4", "mail"), ("e4", "stats")]
    assert [d.sequence for d in heads] == [1, 1, 1, 1]
    assert await outbox.claim("A", limit=50) == []
    assert await outbox.complete(heads[0])  # k's mail: its next starts; k's stats still runs
    [k2_mail] = await outbox.claim("A", limit=50)
    assert (pairs([k2_mail]), k2_mail.sequence) == ([("e2", "mail")], 2)
    assert await outbox.complete(heads[1])
    [k2_stats] = await outbox.claim("A", limit=50)
    assert (pairs([k2_stats]), k2_stats.sequence) == ([("e2", "stats")], 2)
    assert await outbox.claim("B", limit=50) == []  # the lanes are A's
    assert await outbox.complete_many([heads[2], heads[3], k2_mail, k2_stats]) == [True] * 4
    ran = [*heads, k2_mail, k2_stats, *await drain(outbox, "A")]
    per_key: dict[tuple[str, str | None], list[int | None]] = {}
    for delivery in ran:
        per_key.setdefault((delivery.handler, delivery.event.key), []).append(delivery.sequence)
    assert per_key == {("mail", "k"): [1, 2, 3], ("stats", "k"): [1, 2, 3],
                       ("mail", "j"): [1, 2], ("stats", "j"): [1, 2]}  # fmt: skip
    assert await deliveries(odb) == []


async def test_a_rescheduled_head_blocks_its_key_until_it_is_due_and_done(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await outbox.publish([paid("e1", "k"), paid("e2", "k")], session=None)
    [head] = await outbox.claim("A", limit=10)
    assert await outbox.reschedule(head, delay=10, error="busy")
    doc = await delivery_of(odb, "e1", "stats")
    assert doc is not None and utc(doc["due_at"]) == clock.now() + timedelta(seconds=10)
    assert (doc["attempts"], doc["claims"], doc["last_error"]) == (1, 1, "busy")
    assert await outbox.claim("A", limit=10) == []
    assert await outbox.claim("B", limit=10) == []
    clock.advance(9.999)
    assert await outbox.claim("B", limit=10) == []
    follower = await delivery_of(odb, "e2", "stats")
    assert follower is not None and (follower["attempts"], follower["claims"]) == (0, 0)
    clock.advance(0.001)
    [again] = await outbox.claim("B", limit=10)
    assert (again.event.id, again.attempt, token(again)[2]) == ("e1", 2, 1)
    assert await outbox.claim("B", limit=10) == []
    assert await outbox.complete(again)
    assert pairs(await drain(outbox, "B")) == [("e2", "stats")]


async def test_a_buried_head_unblocks_its_followers(odb: Any, clock: ManualClock) -> None:
    outbox = await new_outbox(odb, clock)
    await bury_head(outbox, error="poison")
    [follower] = await outbox.claim("A")
    assert (follower.event.id, follower.sequence) == ("e2", 2)
    dead = await delivery_of(odb, "e1", "stats")
    assert dead is not None and dead["status"] == "dead"
    assert pairs(await drain(outbox, "A")) == []  # e3 waits for e2, which runs
    assert await outbox.complete(follower)
    assert pairs(await drain(outbox, "A")) == [("e3", "stats")]
    assert [d["event_id"] for d in await deliveries(odb)] == ["e1"]


async def test_a_requeued_head_that_was_not_overtaken_runs_before_its_followers(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await bury_head(outbox)
    clock.advance(1)
    assert await outbox.requeue("e1", "stats")
    doc = await delivery_of(odb, "e1", "stats")
    assert doc is not None and (doc["status"], doc["attempts"], doc["claims"]) == ("pending", 0, 2)
    assert utc(doc["due_at"]) == clock.now()
    [again] = await outbox.claim("A", limit=10)  # e2 was due first, but e1 comes first again
    assert (again.event.id, again.attempt, token(again)[2]) == ("e1", 1, 2)
    assert await outbox.claim("B", limit=10) == []
    assert await outbox.complete(again)
    assert [d.event.id for d in await drain(outbox, "A")] == ["e2", "e3"]


async def test_a_requeued_head_does_not_start_while_a_later_delivery_of_its_key_runs(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await bury_head(outbox)
    [overtaking] = await outbox.claim("A")
    assert overtaking.event.id == "e2"
    assert await outbox.requeue("e1", "stats")
    assert await outbox.claim("A", limit=10) == []  # e1 is the head again, but e2 runs
    assert await outbox.claim("B", limit=10) == []
    assert await outbox.complete(overtaking)
    assert [d.event.id for d in await drain(outbox, "A")] == ["e1", "e3"]


# ----------------------------------------------------------------------------- completions


@pytest.mark.parametrize("history", [False, True], ids=["plain", "history"])
async def test_complete_many_of_held_deliveries_deletes_them_and_records_the_completion(
    odb: Any, clock: ManualClock, history: bool
) -> None:
    outbox = await new_outbox(odb, clock, completion_history=history)
    await outbox.publish([order(1), paid("p2", "k")], session=None)
    batch = await outbox.claim("A")
    clock.advance(3)
    assert await outbox.complete_many(batch) == [True, True, True]
    assert await deliveries(odb) == []
    assert {i: utc(e.get("completed_at")) for i, e in (await events(odb)).items()} == {
        "e1": clock.now(), "p2": clock.now()
    }  # fmt: skip
    records = await odb[f"{PREFIX}completed_deliveries"].find({}).to_list(None)
    assert sorted(str(r["_id"]) for r in records) == (
        sorted(d.id for d in batch) if history else []
    )
    assert await outbox.complete_many(batch) == [False, False, False]
    assert await outbox.complete_many([]) == []


@pytest.mark.parametrize("history", [False, True], ids=["plain", "history"])
async def test_complete_many_never_reports_a_delivery_taken_over_meanwhile(
    odb: Any, clock: ManualClock, history: bool
) -> None:
    outbox = await new_outbox(odb, clock, completion_history=history)
    first, second, third = keys_in_distinct_lanes(3)
    await outbox.publish(paid("y", second), session=None)
    [y] = await outbox.claim("A")
    clock.advance(20)
    await outbox.publish([paid("x", first), paid("z", third)], session=None)
    x, z = await outbox.claim("A")
    clock.advance(10)  # y's lane expired, the others run 20 s more
    [taken] = await outbox.claim("B")
    assert (taken.event.id, taken.attempt) == ("y", 2)

    # y is still there, so the count proves that x and z were completed.
    assert await outbox.complete_many([x, y, z]) == [True, False, True]
    assert [d["event_id"] for d in await deliveries(odb)] == ["y"]
    kept = await delivery_of(odb, "y", "stats")
    assert kept is not None and (kept["attempts"], kept["claims"]) == (1, 1)
    # Without a transaction recorded on the events before the deletion, so y's too: it only
    # keeps y's event longer, and y's handler listed beside its delivery changes no replay.
    # In one (the history kept), y's aborted and recorded nothing.
    marked = {"x", "z"} if history and await _driver.supports_transactions(odb) else {*"xyz"}
    stored = await events(odb)
    assert {i for i, e in stored.items() if "completed_at" in e} == marked
    assert {i: e["handlers"] for i, e in stored.items()} == {
        i: ["stats"] if i in marked else [] for i in "xyz"
    }
    if history:
        records = await odb[f"{PREFIX}completed_deliveries"].find({}).to_list(None)
        assert sorted(r["event_id"] for r in records) == ["x", "z"]
    assert await outbox.complete(y) is False
    assert await outbox.complete(taken)
    assert await deliveries(odb) == []


# --------------------------------------------------------------------------------- settles


async def test_reschedule_release_and_bury_write_what_they_say(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await outbox.publish([paid("r"), paid("l"), paid("b")], session=None)
    r, released, b = sorted(await outbox.claim("A"), key=lambda d: "rlb".index(d.event.id))
    clock.advance(4)
    failure = RuntimeError("handler broke")
    assert await outbox.reschedule(r, delay=7.5, error=failure)
    assert await outbox.release(released)
    assert await outbox.bury(b, error="poison")
    docs = {d["event_id"]: d for d in await deliveries(odb)}
    now = clock.now()
    assert utc(docs["r"]["due_at"]) == now + timedelta(seconds=7.5)
    assert (docs["r"]["attempts"], docs["r"]["claims"], docs["r"]["status"]) == (1, 1, "pending")
    assert docs["r"]["last_error"] == error_text(failure) and "handler broke" in error_text(failure)
    assert (utc(docs["l"]["due_at"]), docs["l"]["attempts"], docs["l"]["claims"]) == (now, 0, 1)
    assert "last_error" not in docs["l"]
    assert (docs["b"]["status"], docs["b"]["attempts"], docs["b"]["claims"]) == ("dead", 1, 1)
    assert docs["b"]["last_error"] == "poison"
    assert "due_at" not in docs["b"] and "lane" not in docs["b"]
    assert {utc(d["updated_at"]) for d in docs.values()} == {now}
    before = await stored(odb)
    for delivery in (r, released, b):  # each claim ended with its settle
        assert await settle_stale(outbox, delivery) == [False, [False], False, False, False]
    assert await stored(odb) == before
    [again] = await outbox.claim("A")
    assert (again.event.id, again.attempt, token(again)[2]) == ("l", 1, 1)
    clock.advance(7.5)
    [retry] = await outbox.claim("A")
    assert (retry.event.id, retry.attempt, token(retry)[2]) == ("r", 2, 1)
    assert await outbox.claim("A") == []  # the dead letter stays out


async def test_invalid_settles_raise_before_any_database_call(
    odb: Any, clock: ManualClock, counter: CommandCounter
) -> None:
    outbox = await new_outbox(instrument(odb, counter), clock)
    await outbox.publish(paid("x"), session=None)
    [x] = await outbox.claim("A")
    before = await stored(odb)
    counter.reset()

    def forged(**changes: Any) -> Delivery:
        fields = {**vars(x), **changes}
        return Delivery(**fields)

    for delay in (-1, float("nan"), float("inf"), "5", True, None):
        with rejects("delay"):
            await outbox.reschedule(x, delay=delay)
    for bad in ("x", None, {"id": x.id, "lease_token": x.lease_token}):
        for call in (outbox.complete, outbox.release, outbox.bury):
            with rejects("delivery"):
                await call(bad)  # type: ignore[arg-type]
        with rejects("delivery"):
            await outbox.reschedule(bad, delay=1)  # type: ignore[arg-type]
    lane = x.lane_id
    for fake, field in (
        (forged(lease_token="256:1:0"), "lease_token"),
        (forged(lease_token=f"{lane}:1"), "lease_token"),
        (forged(lease_token=f"{lane}:-1:0"), "lease_token"),
        (forged(lease_token=f"{lane}:1:x"), "lease_token"),
        (forged(id="not-an-object-id"), "id"), (forged(lease_token=None), "lease_token"),
    ):  # fmt: skip
        for call in (outbox.complete, outbox.release, outbox.bury):
            with rejects(f"delivery.{field}"):
                await call(fake)
        with rejects(f"deliveries[1].{field}"):
            await outbox.complete_many([x, fake])
    with rejects("deliveries"):
        await outbox.complete_many([x, x])
    assert counter.total == 0
    assert await stored(odb) == before
    assert await outbox.complete(x)
