"""AsyncOutbox claims and settles under injected faults and forced interleavings.

Faults: a command fails before it applies, or applies and loses its reply (`FaultInjector`), at
each write of a takeover, at a claim's lane record and at `complete_many`'s delete; each test
checks the stored state right after the failure, then that nothing is lost, nothing runs twice
and every lost attempt is charged exactly once.

Interleavings: two claimers share nothing but the lane documents (a claim writes no delivery
document), so their race runs every order of their lane reads and lane writes (`Interleaving`,
`lane_orders`). Races that write deliveries (a takeover's charge against the old holder's
completion or another takeover, a requeue against a claim) run every order of the commands
involved (`every_order`), sized by counting a claim's commands first (`CommandCounter`); the
largest, a requeue against a claim, runs one order of each set that differ only by swapping
steps that commute (`every_order_by_class`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import bson
import pytest
from pymongo.errors import PyMongoError

from mongoq.outbox import AsyncOutbox, Delivery, lane_of
from mongoq.outbox.lanes import lane_document
from mongoq.testing import CommandCounter, Interleaving, ManualClock, all_interleavings, instrument
from tests.support.helpers import Actors, Trace, every_order, nth
from tests.support.outbox_helpers import (
    LEASE,
    PREFIX,
    SUBSCRIPTIONS,
    another,
    attempts,
    bury_head,
    deliveries,
    delivery_of,
    drain,
    faulty_outbox,
    keys_in_distinct_lanes,
    lane_docs,
    new_outbox,
    paid,
    ran,
    stored,
)

#: One handler, "stats", for the "order.paid" events `bury_head` and `paid` publish.
PAID_ONLY = {"order.paid": ["stats"]}

# ------------------------------------------------------------- faults on a takeover's writes

#: fault -> (before or after, command, collection, which one of them, whether the charge applied)
TAKEOVER_FAULTS: dict[str, tuple[str, str, str, int, bool]] = {
    "takeover applied, reply lost": ("after", "bulk_write", "ob_lanes", 0, False),
    "charge failed": ("before", "update_many", "ob_deliveries", 0, False),
    "charge applied, reply lost": ("after", "update_many", "ob_deliveries", 0, True),
    "charged, clearing failed": ("before", "bulk_write", "ob_lanes", 1, True),
}


@pytest.mark.parametrize("recovery", ["same claimer", "next claimer"])
@pytest.mark.parametrize("fault", list(TAKEOVER_FAULTS))
async def test_a_takeover_interrupted_anywhere_charges_each_lost_delivery_exactly_once(
    odb: Any, clock: ManualClock, fault: str, recovery: str
) -> None:
    """A crashed holding x, y and u; B takes the lanes over and fails at one of its writes.
    Then B claims again (its lanes are live: nobody else may), or B crashed too and C takes
    the lanes over after B's lease: either way each lost delivery is charged once in total."""
    outbox, faults = await faulty_outbox(odb, clock)
    k1, k2 = keys_in_distinct_lanes(2)
    await outbox.publish([paid("x", k1), paid("x2", k1), paid("y", k2), paid("u")], session=None)
    crashed = await outbox.claim("A")
    assert ran(crashed) == [("u", 1), ("x", 1), ("y", 1)]
    held = {d.lane_id for d in crashed}
    clock.advance(LEASE)
    when, command, collection, index, charged = TAKEOVER_FAULTS[fault]
    inject = faults.fail_before if when == "before" else faults.fail_after
    inject(command, collection=collection, match=nth(index))

    with pytest.raises(PyMongoError):
        await outbox.claim("B")
    assert [(op.collection, op.name) for op in faults.triggered] == [(collection, command)]
    lost = sorted(
        (e["d"], e["g"]) for lane in (await lane_docs(odb)).values() for e in lane["lost"]
    )
    assert lost == sorted((bson.ObjectId(d.id), 0) for d in crashed)  # still to be (re)charged
    for lane_id in held:
        doc = (await lane_docs(odb))[lane_id]
        assert (doc["owner"], doc["epoch"], doc["in_flight"]) == ("B", 2, [])
    charge = (1, 1) if charged else (0, 0)
    assert attempts(await deliveries(odb)) == {"x": charge, "x2": (0, 0), "y": charge, "u": charge}

    holder = "B" if recovery == "same claimer" else "C"
    if holder == "B":
        assert await outbox.claim("C") == []  # B's lanes are live
    else:
        clock.advance(LEASE)
    batch = await outbox.claim(holder)
    assert ran(batch) == [("u", 2), ("x", 2), ("y", 2)]
    assert attempts(await deliveries(odb)) == {"x": (1, 1), "x2": (0, 0), "y": (1, 1), "u": (1, 1)}
    assert all(lane["lost"] == [] for lane in (await lane_docs(odb)).values())
    assert await outbox.complete_many(batch) == [True, True, True]
    assert await outbox.relinquish(holder) == len(held)
    assert ran(await drain(outbox)) == [("x2", 1)]
    assert await deliveries(odb) == []


# ----------------------------------------------------------- faults on a claim's lane record


async def lose_the_claims_reply(odb: Any, clock: ManualClock) -> tuple[AsyncOutbox, list[Any]]:
    """An outbox on which A's claim of x and y (keys in two lanes) recorded them on the lanes,
    then lost the reply and raised; returns it and the stored x and y."""
    outbox, faults = await faulty_outbox(odb, clock)
    k1, k2 = keys_in_distinct_lanes(2)
    await outbox.publish([paid("x", k1), paid("x2", k1), paid("y", k2)], session=None)
    before = await stored(odb)
    faults.fail_after("bulk_write", collection="ob_lanes")
    with pytest.raises(PyMongoError):
        await outbox.claim("A")
    assert await stored(odb) == before  # recorded on the lanes only
    docs = [await delivery_of(odb, name, "stats") for name in ("x", "y")]
    stored_lanes = await lane_docs(odb)
    for doc in docs:
        assert doc is not None
        lane = stored_lanes[lane_of(doc["key"])]
        assert (lane["owner"], lane["instance"], lane["epoch"]) == ("A", outbox.instance, 1)
        assert lane["in_flight"] == [{"d": doc["_id"], "g": 0, "h": "stats", "k": doc["key"]}]
    return outbox, docs


async def test_a_claim_whose_lane_record_lost_its_reply_is_freed_by_the_next_claim(
    odb: Any, clock: ManualClock
) -> None:
    """x and y are listed as A's, but nobody runs them: the claim raised. A's next claim on
    this instance (a dispatcher claims again while its other handlers run and its lanes stay
    renewed) frees them: their generation moves on, no attempt is charged, and they are handed
    out again under the new generation, so no token of the failed claim can ever settle them.
    Meanwhile nobody else sees their lanes, and x2 stays behind x."""
    outbox, (x, y) = await lose_the_claims_reply(odb, clock)
    assert await outbox.claim("B") == []
    clock.advance(LEASE / 3)
    assert await outbox.extend_lease("A") == 2
    again = await outbox.claim("A")
    assert ran(again) == [("x", 1), ("y", 1)]
    assert [d.lease_token for d in again] == [
        f"{lane_of(x['key'])}:1:1",
        f"{lane_of(y['key'])}:1:1",
    ]
    # Generation 0, the failed claim's, can settle nothing any more; no attempt was charged.
    assert attempts(await deliveries(odb)) == {"x": (0, 1), "x2": (0, 0), "y": (0, 1)}
    listed = {e["d"]: e["g"] for lane in (await lane_docs(odb)).values() for e in lane["in_flight"]}
    assert listed == {x["_id"]: 1, y["_id"]: 1}
    assert await outbox.claim("A") == []  # x2 waits for x, which runs now
    assert await outbox.complete_many(again) == [True, True]
    assert ran(await drain(outbox, "A")) == [("x2", 1)]
    assert await deliveries(odb) == []


async def test_a_claim_whose_lane_record_lost_its_reply_is_charged_once_by_a_later_takeover(
    odb: Any, clock: ManualClock
) -> None:
    """The same, but A's process stopped after the failed claim (its instance never claims
    again): once the lease expired, B takes the lanes over and charges x and y the attempt that
    may have run, once."""
    outbox, _ = await lose_the_claims_reply(odb, clock)
    clock.advance(LEASE - 0.001)
    assert await outbox.claim("B") == []
    clock.advance(0.001)
    batch = await outbox.claim("B")
    assert ran(batch) == [("x", 2), ("y", 2)]
    assert attempts(await deliveries(odb)) == {"x": (1, 1), "x2": (0, 0), "y": (1, 1)}
    assert await outbox.claim("B") == []
    assert await outbox.complete_many(batch) == [True, True]
    assert await outbox.relinquish("B") == 2
    assert ran(await drain(outbox)) == [("x2", 1)]
    assert await deliveries(odb) == []


async def test_a_claim_failing_after_its_lane_record_strands_nothing_while_its_owner_renews(
    odb: Any, clock: ManualClock
) -> None:
    """A runs w (a long handler: its dispatcher keeps renewing the lanes every lease/3 and
    claiming). A claim of x records x on its lane, but the reply of that last command is lost:
    x was never handed out, so a later claim must hand it out."""
    outbox, faults = await faulty_outbox(odb, clock)
    k1, k2 = keys_in_distinct_lanes(2)
    await outbox.publish(paid("w", k1), session=None)
    [w] = await outbox.claim("A")
    await outbox.publish(paid("x", k2), session=None)
    faults.fail_after("bulk_write", collection="ob_lanes")
    with pytest.raises(PyMongoError):
        await outbox.claim("A")
    assert len(faults.triggered) == 1
    handed: list[Delivery] = []
    for _ in range(6):  # two leases
        clock.advance(LEASE / 3)
        assert await outbox.extend_lease("A") == 2  # w still runs
        handed += await outbox.claim("A")
    assert ran(handed) == [("x", 1)]
    assert await outbox.complete_many([w, *handed]) == [True, True]
    assert await deliveries(odb) == []


# --------------------------------------------------------------- faults on complete_many


async def test_complete_many_whose_reply_was_lost_runs_nothing_twice(
    odb: Any, clock: ManualClock
) -> None:
    outbox, faults = await faulty_outbox(odb, clock)
    k1, k2 = keys_in_distinct_lanes(2)
    await outbox.publish([paid("a", k1), paid("b", k2), paid("c")], session=None)
    batch = await outbox.claim("A")
    faults.fail_after("delete_many", collection="ob_deliveries")
    with pytest.raises(PyMongoError):
        await outbox.complete_many(batch)
    assert await deliveries(odb) == []
    assert await outbox.complete_many(batch) == [False, False, False]  # gone, but not proven
    assert await outbox.claim("A") == []
    clock.advance(LEASE)
    assert await outbox.claim("B") == []  # taken over, nothing to charge, handed back
    assert {(lane["owner"], len(lane["in_flight"]), len(lane["lost"]))
            for lane in (await lane_docs(odb)).values()} == {(None, 0, 0)}  # fmt: skip
    assert await deliveries(odb) == []


# ------------------------------------------------------------------ claims under interleavings


async def reset(db: Any) -> None:
    """Empty outbox collections, every lane free and never held (cheaper than a new setup)."""
    for name in ("deliveries", "events", "key_sequences", "completed_deliveries"):
        await db[f"{PREFIX}{name}"].delete_many({})
    fresh = {name: value for name, value in lane_document(0, "h").items()
             if name not in ("_id", "handler", "n")}  # fmt: skip
    # A lane leaves its initial state only by being taken, which moves its epoch on.
    await db[f"{PREFIX}lanes"].update_many({"epoch": {"$gt": 0}}, {"$set": fresh})


def lane_orders(blocks: dict[str, tuple[int, int]]) -> list[list[str]]:
    """Every order of each actor's two blocks of commands, as turns for `Interleaving`:
    ``blocks[a]`` is how many commands a runs up to its lane write (its lane read and the
    delivery reads after it), and how many from it (the write and any reads after)."""
    orders = []
    for sequence in all_interleavings({actor: 2 for actor in blocks}):
        turns: list[str] = []
        for position, actor in enumerate(sequence):
            first = actor not in sequence[:position]
            turns += [actor] * blocks[actor][0 if first else 1]
        orders.append(turns)
    return orders


async def run_orders(
    db: Any,
    orders: list[list[str]],
    setup: Callable[[Any], Awaitable[Actors]],
    check: Callable[[dict[str, Any], Trace], Awaitable[str]],
) -> Counter[str]:
    """Like `every_order`, over given orders, on the same collections `reset` between orders."""
    outcomes: Counter[str] = Counter()
    for order in orders:
        await reset(db)
        interleaving = Interleaving(order)
        actors = await setup(instrument(db, interleaving))
        results = await interleaving.run(actors)
        label = "".join(order)
        errors = {a: r for a, r in results.items() if isinstance(r, BaseException)}
        assert not errors, f"order {label}: {errors}"
        try:
            outcomes[await check(results, interleaving.trace)] += 1
        except AssertionError as failure:
            raise AssertionError(f"order {label}: {failure}\n{interleaving.trace}") from failure
    return outcomes


#: Commands that only read (an aggregation may write: ``$out``, ``$merge``).
READS = frozenset({"find", "find_one", "count_documents", "distinct"})
#: Whether step `i` of an actor (its `i`-th command, from 0, with what the actor does up to its
#: next one) touches what the actors share besides the collections, given the actor's commands
#: (``collection.name``) in the run: such a step is ordered against every step of the others.
#: (What an actor does before its first command must touch nothing another actor writes.)
Shares = Callable[[str, list[str], int], bool]


def _depend(steps: dict[str, list[str]], shares: Shares, a: str, i: int, b: str, j: int) -> bool:
    """Whether step `i` of `a` and step `j` of `b` may end differently in either order: one of
    them touches what the actors share in memory, or their commands use one collection and
    not only to read. Steps either actor never ran (it ended earlier) depend on nothing."""
    if i >= len(steps[a]) or j >= len(steps[b]):
        return False
    if shares(a, steps[a], i) or shares(b, steps[b], j):
        return True
    (one, name_one), (other, name_other) = (s.rsplit(".", 1) for s in (steps[a][i], steps[b][j]))
    return one == other and not (name_one in READS and name_other in READS)


def _turns(order: Sequence[str]) -> dict[str, list[int]]:
    """Where each actor's turns are in `order`."""
    turns: dict[str, list[int]] = defaultdict(list)
    for position, actor in enumerate(order):
        turns[actor].append(position)
    return turns


def _class_of(turns: dict[str, list[int]], pairs: list[tuple[str, int, str, int]]) -> Any:
    """Where an order (its `_turns`) puts each of `pairs` of steps: whether `a`'s `i`-th turn
    comes before `b`'s `j`-th."""
    return tuple(turns[a][i] < turns[b][j] for a, i, b, j in pairs)


async def every_order_by_class(
    db: Any,
    orders: list[list[str]],
    fresh: Callable[[Any, str], Awaitable[AsyncOutbox]],
    setup: Callable[[AsyncOutbox], Awaitable[Actors]],
    check: Callable[[AsyncOutbox, dict[str, Any], Trace], Awaitable[str]],
    shares: Shares,
) -> tuple[Counter[str], int]:
    """`every_order` over `orders`, each order run or proven to end as one that ran.

    A step is an actor's command and what it does up to its next one. Two adjacent steps of
    different actors commute when neither touches what the actors share in memory (`shares`)
    and their commands use different collections or both only read: swapped, each reads and
    writes what it did, so every later step does too. Orders that put every pair of steps
    that do not commute (`_depend`) the same way around are one swap after another apart, so
    they run alike: the first order not yet accounted for is run, and with it every order of
    its class is accounted for. The steps are those of that run's trace (which commands an
    actor sends depends on the order), never assumed. Returns the outcomes by order (a class's
    outcome once for each of its orders) and how many orders ran."""
    outcomes: Counter[str] = Counter()
    left = [(list(order), _turns(order)) for order in orders]
    runs = 0
    while left:
        order, turns = left[0]
        interleaving = Interleaving(order)
        subject = await fresh(instrument(db, interleaving), f"race{runs}")
        actors = await setup(subject)
        results = await interleaving.run(actors)
        runs += 1
        label = "".join(order)
        errors = {actor: r for actor, r in results.items() if isinstance(r, BaseException)}
        assert not errors, f"order {label}: {errors}"
        assert interleaving.trace[0][0] == order[0], f"order {label}: {interleaving.trace}"
        try:
            outcome = await check(subject, results, interleaving.trace)
        except AssertionError as failure:
            raise AssertionError(f"order {label}: {failure}\n{interleaving.trace}") from failure
        steps: dict[str, list[str]] = {actor: [] for actor in actors}
        for actor, collection, name in interleaving.trace:
            steps[actor].append(f"{collection}.{name}")
        pairs = [
            (a, i, b, j)
            for a in sorted(turns) for b in sorted(turns) if a < b
            for i in range(len(turns[a])) for j in range(len(turns[b]))
            if _depend(steps, shares, a, i, b, j)
        ]  # fmt: skip
        mine = _class_of(turns, pairs)
        others = [other for other in left if _class_of(other[1], pairs) != mine]
        outcomes[outcome] += len(left) - len(others)
        left = others
    return outcomes, runs


async def commands_of_claim(
    db: Any, clock: ManualClock, setup: Callable[[Any], Awaitable[Actors]], actor: str,
    subscriptions: Any = SUBSCRIPTIONS,
) -> list[str]:  # fmt: skip
    """The commands (``collection.name``) of `actor` in a race set up by `setup`, run alone."""
    counter = CommandCounter()
    counter.record = True
    await reset(db)
    actors = await setup(another(instrument(db, counter), clock, subscriptions))
    counter.reset()
    await actors[actor]()
    return [f"{op.collection}.{op.name}" for op in counter.operations]


async def takeover_commands(
    db: Any, clock: ManualClock, setup: Callable[[Any], Awaitable[Actors]]
) -> list[str]:
    """The commands of B's claim taking a lane over, alone: the lane read, the takeover write,
    then the charge of what the lane's old holder lost (what the races below order against)."""
    takeover = await commands_of_claim(db, clock, setup, "B")
    assert takeover[:3] == [f"{PREFIX}lanes.find", f"{PREFIX}lanes.bulk_write",
                            f"{PREFIX}deliveries.update_many"]  # fmt: skip
    return takeover


def _nth(order: list[str], actor: str, n: int) -> int:
    """Where `actor`'s `n`-th command is in `order`."""
    return [i for i, who in enumerate(order) if who == actor][n - 1]


def fresh_outbox(
    db: Any, clock: ManualClock, subscriptions: Any = SUBSCRIPTIONS
) -> Callable[[Any, str], Awaitable[AsyncOutbox]]:
    """`every_order`'s `fresh`: another instance on the collections `new_outbox` set up, `reset`
    first (all orders share them, cheaper than a new setup per order)."""

    async def fresh(idb: Any, name: str) -> AsyncOutbox:
        await reset(db)
        return another(idb, clock, subscriptions)

    return fresh


async def held_past_its_lease(outbox: AsyncOutbox, clock: ManualClock) -> Delivery:
    """x (key k, x2 behind it) claimed by A, whose lease then ran out."""
    await outbox.publish([paid("x", "k"), paid("x2", "k")], session=None)
    [x] = await outbox.claim("A")
    clock.advance(LEASE)
    return x


@pytest.mark.parametrize(
    "instances", ["two owners, one outbox", "two owners, two outboxes", "one owner, two outboxes"]
)
async def test_concurrent_claims_never_share_a_delivery_or_a_key(
    db: Any, clock: ManualClock, instances: str
) -> None:
    """Keys a and b (two deliveries each) and an unkeyed u, in three lanes. A claims one
    delivery, B up to ten. Whoever records a lane first holds it; the other's record of that
    lane matches nothing, so it hands out nothing from it. In every order: no delivery and no
    key (handler, key) is handed to both, each lane lists exactly what its holder got, and
    after both finish the rest runs in sequence order."""
    await new_outbox(db, clock)
    a, b = keys_in_distinct_lanes(2, "a")
    work = [paid("a1", a), paid("a2", a), paid("b1", b), paid("b2", b), paid("u")]
    assert len({lane_of(a), lane_of(b), lane_of("u")}) == 3
    owners = {"A": "A", "B": "B"} if instances.startswith("two owners") else {"A": "w", "B": "w"}
    shared = instances.endswith("one outbox")
    limits = {"A": 1, "B": 10}
    blocks: dict[str, tuple[int, int]] = {}
    for actor, limit in limits.items():
        counter = CommandCounter()
        counter.record = True
        await reset(db)
        await another(db, clock).publish(work, session=None)
        await another(instrument(db, counter), clock).claim(actor, limit=limit)
        # What `lane_orders` relies on: the lane read first, one write (the lane record), and
        # only reads besides (a claim writes no delivery document).
        names = [f"{op.collection}.{op.name}" for op in counter.operations]
        writes = [i for i, n in enumerate(names) if n.split(".")[1] not in ("find", "aggregate")]
        assert names[0] == f"{PREFIX}lanes.find", names
        assert [names[i] for i in writes] == [f"{PREFIX}lanes.bulk_write"], names
        blocks[actor] = (writes[0], len(names) - writes[0])
    outboxes: dict[str, AsyncOutbox] = {}
    before: dict[Any, bytes] = {}

    async def setup(idb: Any) -> Actors:
        nonlocal before
        one = another(idb, clock)
        outboxes.update(A=one, B=one if shared else another(idb, clock))
        await one.publish(work, session=None)
        before = await stored(db)
        return {
            actor: (lambda actor=actor: outboxes[actor].claim(owners[actor], limit=limits[actor]))
            for actor in ("A", "B")
        }

    async def check(results: dict[str, Any], trace: Trace) -> str:
        got: dict[str, list[Delivery]] = results
        both = got["A"] + got["B"]
        assert len({d.id for d in both}) == len(both)
        assert len({(d.handler, d.event.key) for d in both if d.event.key}) == len(
            [d for d in both if d.event.key]
        )
        assert sorted(d.event.id for d in both) == ["a1", "b1", "u"]
        assert await stored(db) == before  # claims write no delivery document
        stored_lanes = await lane_docs(db)
        for actor, batch in got.items():
            for delivery in batch:
                lane = stored_lanes[delivery.lane_id]
                assert (lane["owner"], lane["instance"]) == (
                    owners[actor],
                    outboxes[actor].instance,
                )
                assert lane["epoch"] == int(delivery.lease_token.split(":")[1]) == 1
                assert [e["d"] for e in lane["in_flight"]] == [bson.ObjectId(delivery.id)]
        for actor, batch in got.items():
            assert await outboxes[actor].complete_many(batch) == [True] * len(batch)
            await outboxes[actor].relinquish(owners[actor])
        rest = await drain(outboxes["A"])
        assert sorted((d.event.id, d.attempt) for d in rest) == sorted(
            (name, 1) for name in {"a1", "a2", "b1", "b2", "u"} - {d.event.id for d in both}
        )
        assert await deliveries(db) == []
        writes = [who for who, collection, name in trace if name == "bulk_write"]
        assert (len(got["A"]), len(got["B"])) == ((1, 2) if writes[0] == "A" else (0, 3))
        return f"A got {len(got['A'])}, B got {len(got['B'])}"

    outcomes = await run_orders(db, lane_orders(blocks), setup, check)
    # Of the 6 orders of two reads and two writes, A records first in 3: A holds a1's lane and
    # B the two others; in the other 3 B records first and holds all three. (On a server, an
    # actor's parallel reads may share a turn and move its write earlier: the check reads the
    # outcome from the trace, and both outcomes still occur.)
    assert set(outcomes) == {"A got 1, B got 2", "A got 0, B got 3"}
    assert sum(outcomes.values()) == 6


async def test_a_takeover_racing_the_old_holders_completion_never_lets_both_succeed(
    db: Any, clock: ManualClock
) -> None:
    """A's lease on x ran out while its handler finished: A completes x while B takes the lane
    over. In every order of A's delete against B's commands, exactly one of them wins x: A's
    completion (x is gone, not charged, and B gets x2, the next of the key), or B's charge (A's
    completion returns False, x is charged once and B runs it; x2 waits behind it)."""
    await new_outbox(db, clock)

    async def setup(outbox: AsyncOutbox) -> Actors:
        x = await held_past_its_lease(outbox, clock)
        return {"A": lambda: outbox.complete(x), "B": lambda: outbox.claim("B")}

    async def check(outbox: AsyncOutbox, results: dict[str, Any], trace: Trace) -> str:
        completed: bool = results["A"]
        taken = ran(results["B"])
        docs = attempts(await deliveries(db))
        lane = (await lane_docs(db))[lane_of("k")]
        assert (lane["owner"], lane["epoch"], lane["lost"]) == ("B", 2, [])
        delete = trace.index(("A", f"{PREFIX}deliveries", "delete_one"))
        charge = trace.index(("B", f"{PREFIX}deliveries", "update_many"))
        assert completed == (delete < charge)
        if completed:
            assert taken == [("x2", 1)] and docs == {"x2": (0, 0)}
            outcome = "completed by its holder"
        else:
            assert taken == [("x", 2)] and docs == {"x": (1, 1), "x2": (0, 0)}
            outcome = "taken over"
        assert await outbox.complete_many(results["B"]) == [True]
        assert await outbox.relinquish("B") == 1
        rest = await drain(outbox)
        assert [d.event.id for d in rest] == ([] if completed else ["x2"])
        return outcome

    def settling(actor: str, commands: list[str], i: int) -> bool:
        """The completion's last step: after its delete it records the settle on the outbox
        (`Claimer.forget`), whose records the claim reads; before, it shares nothing with
        the claim but the collections."""
        return actor == "A" and i == len(commands) - 1

    takeover = await takeover_commands(db, clock, setup)
    counts = {"A": 2, "B": len(takeover)}  # A: x's completion on its event, then its delete
    # A wins when its delete (its second command) lands before B's charge (B's third).
    orders = list(all_interleavings(counts))
    wins = sum(1 for order in orders if _nth(order, "A", 2) < _nth(order, "B", 3))
    outcomes, runs = await every_order_by_class(
        db, orders, fresh_outbox(db, clock), setup, check, settling
    )
    assert outcomes == {"completed by its holder": wins, "taken over": len(orders) - wins}, runs


async def test_two_claimers_taking_over_one_lane_charge_its_lost_delivery_once(
    db: Any, clock: ManualClock
) -> None:
    """A crashed holding x; B and C claim once its lease ran out. Every order of their lane
    reads, takeover writes and charges: one of them takes the lane and charges x once."""
    await new_outbox(db, clock)

    async def setup(outbox: AsyncOutbox) -> Actors:
        await held_past_its_lease(outbox, clock)
        return {"B": lambda: outbox.claim("B"), "C": lambda: outbox.claim("C")}

    async def check(outbox: AsyncOutbox, results: dict[str, Any], trace: Trace) -> str:
        winners = [actor for actor in ("B", "C") if results[actor]]
        takes = [who for who, collection, name in trace if name == "bulk_write"]
        assert winners == [takes[0]]  # the first takeover write wins, the other matches nothing
        [winner] = winners
        assert ran(results[winner]) == [("x", 2)]
        assert attempts(await deliveries(db)) == {"x": (1, 1), "x2": (0, 0)}
        lane = (await lane_docs(db))[lane_of("k")]
        assert (lane["owner"], lane["epoch"], lane["lost"]) == (winner, 2, [])
        assert await outbox.complete_many(results[winner]) == [True]
        assert await outbox.relinquish(winner) == 1
        assert ran(await drain(outbox)) == [("x2", 1)]
        return f"{winner} took it over"

    await takeover_commands(db, clock, setup)
    # Every order of both lane reads, takeover writes and charges (what runs after them sees
    # the lane taken).
    outcomes = await every_order(db, {"B": 3, "C": 3}, fresh_outbox(db, clock), setup, check)
    assert set(outcomes) == {"B took it over", "C took it over"}


async def test_a_requeue_racing_a_claim_never_lets_a_later_delivery_overtake_it_unordered(
    db: Any, clock: ManualClock
) -> None:
    """e1 (key k) is dead, e2 and e3 wait. A claims while an operator requeues e1. In every
    order of the requeue's commands (its read, a count in e1's lane, e1 pending, a count again,
    its mark cleared) against the claim's: the claim hands out e1, or nothing, or e2 only when
    the requeue's last count came after the claim's last lane write (it is then ordered after
    the claim, and e1 waits for e2); a lane write a count came before fails, and the claim
    tries once more from the lanes as they are. Nothing is charged, e1 never runs beside e2,
    and runs before e3. Only "stats" is subscribed (one handler's lanes to read per claim: the
    race is within one handler's lane). Of the 462 orders, about 100 run: those that differ
    only in which of two commuting steps comes first end alike (`every_order_by_class`)."""
    await new_outbox(db, clock, subscriptions=PAID_ONLY)

    async def setup(outbox: AsyncOutbox) -> Actors:
        await bury_head(outbox)
        return {"A": lambda: outbox.claim("A"), "R": lambda: outbox.requeue("e1", "stats")}

    async def check(outbox: AsyncOutbox, results: dict[str, Any], trace: Trace) -> str:
        assert results["R"] is True
        got: list[Delivery] = results["A"]
        assert len(got) <= 1
        docs = attempts(await deliveries(db))
        assert docs["e2"][0] == 0 and docs["e3"] == (0, 0)  # nothing charged
        # The requeue counts itself before and after making e1 pending: the second count is
        # the one that orders it after a claim that did not see it.
        counted = max(
            i for i, step in enumerate(trace) if step == ("R", f"{PREFIX}lanes", "update_one")
        )
        recorded = [i for i, step in enumerate(trace) if step == ("A", f"{PREFIX}lanes",
                                                                   "bulk_write")]  # fmt: skip
        if got and got[0].event.id == "e2":
            assert counted > max(recorded), "e2 handed out although the requeue counted before"
            outcome = "e2 first, the requeue ordered after the claim"
        elif got:
            assert got[0].event.id == "e1" and got[0].attempt == 1
            outcome = "e1 first"
        else:
            outcome = "nothing picked"
        assert docs["e2"] == (0, 0)  # never recorded where it could run, never charged
        order_run = [d.event.id for d in got]
        if got:
            assert await outbox.claim("A") == []  # its key runs
            assert await outbox.complete(got[0])
        await outbox.relinquish("A")  # the lane, if the claim kept it
        # One at a time: a claim that fills its limit needs no fresh read of the lanes.
        order_run += [d.event.id for d in await drain(outbox, limit=1)]
        assert order_run in (["e1", "e2", "e3"], ["e2", "e1", "e3"])
        assert (order_run[0] == "e2") == outcome.startswith("e2 first")
        assert await deliveries(db) == []
        return outcome

    def counting(actor: str, commands: list[str], i: int) -> bool:
        """The requeue's steps before its lane counts. All the requeue shares with the claim
        besides the collections is the outbox's lane view, which `LaneStore.count_requeue`
        marks to be read again right before it counts: a claim that came up short reads that
        mark to decide whether to try again, and its read of the lanes clears it."""
        following = commands[i + 1 : i + 2]
        return actor == "R" and following != [] and following[0].startswith(f"{PREFIX}lanes.")

    claim = await commands_of_claim(db, clock, setup, "A", PAID_ONLY)
    orders = list(all_interleavings({"A": len(claim), "R": 5}))
    outcomes, runs = await every_order_by_class(
        db, orders, fresh_outbox(db, clock, PAID_ONLY), setup, check, counting
    )
    assert sum(outcomes.values()) == len(orders) > runs, (runs, outcomes)
    assert {"e1 first", "e2 first, the requeue ordered after the claim"} <= set(outcomes), outcomes
