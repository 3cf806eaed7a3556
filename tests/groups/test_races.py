"""AsyncGroupTransport under forced interleavings of its commands.

Each server command is atomic, so these tests run EVERY order of the commands of two or three
actors (`Interleaving` + `all_interleavings`), each on fresh collections, and check the stored
state afterwards: a published message is never stranded (its group has a lock, so a later claim
delivers it), a group has one holder at a time, and a group's messages come in publish order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from pymongo.errors import AutoReconnect

from mongoq import AsyncGroupTransport, GroupLease, GroupRunSummary, NewMessage
from mongoq.testing import FaultInjector, Interleaving, ManualClock, instrument
from tests.support.group_helpers import (
    DROP_REFUSED,
    EPOCH,
    PUBLISHES,
    RECREATED,
    SEEN_BY_THE_CHECK,
    VISIBILITY,
    Bookkeeping,
    assert_empty,
    assert_lock,
    assert_message,
    assert_outcomes,
    claim_one,
    dead,
    drain,
    group_messages,
    locks,
    message,
    messages,
    new_transport,
    publish_each,
    race,
)
from tests.support.helpers import Actors, Trace, later


def commands_of(trace: Trace, actor: str) -> list[str]:
    return [
        f"{collection.split('_', 1)[1]}.{name}" for who, collection, name in trace if who == actor
    ]


def last_ack_outcome(commands: list[str]) -> str:
    """What the ack of a group's last message did while a publish raced it, from the ack's
    `commands`: it deleted the head and checked for another message of the group, then
    released the group (the check saw the new message), dropped it (the publish then makes a
    new lock), or had its drop refused (the ready moved the version) and released it."""
    checked = ["messages.delete_one", "messages.find_one"]
    if commands == [*checked, "locks.update_one"]:
        return SEEN_BY_THE_CHECK
    if commands == [*checked, "locks.delete_one"]:
        return RECREATED
    assert commands == [*checked, "locks.delete_one", "locks.update_one"]
    return DROP_REFUSED


async def assert_nothing_stranded(db: Any, prefix: str) -> None:
    """Every group that has a message has a lock document: a claim can reach it."""
    groups = await group_messages(db, prefix)
    held = await locks(db, prefix)
    assert set(groups) <= set(held), f"messages without a lock: {set(groups) - set(held)}"


async def deliver_the_rest(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, expect: list[Any]
) -> None:
    """A later claimer gets exactly `expect` for group "g", at once (no lease to wait out),
    and then the collections are empty."""
    await assert_nothing_stranded(db, transport.prefix)
    delivered = await drain(transport, clock)
    assert [(x.group_id, x.event) for x in delivered] == [("g", e) for e in expect]
    await assert_empty(db, transport.prefix)


# ------------------------------------------------- a publish racing the drain of its group


@pytest.mark.parametrize("publish", list(PUBLISHES))
async def test_a_publish_racing_the_ack_that_drops_its_drained_group_is_never_stranded(
    db: Any, clock: ManualClock, publish: str
) -> None:
    """A holds g0, the group's last message: its ack deletes the head, checks that no other
    message of the group is there, and drops the lock (fenced on version and last_seq). A
    publish (allocate, insert, ready) races with it. If the insert lands before the check, the
    ack releases the group; if the ready lands between the check and the drop, the drop fails
    and the ack releases the group (a fourth command); if the drop lands first, the ready
    re-creates the lock. Either way g1 has a lock and is claimable at once. A has up to 4
    commands, so every order is run."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        lease = await claim_one(transport, "A", group="g")
        assert lease.was_last
        return {"A": lambda: transport.ack(lease), "P": lambda: PUBLISHES[publish](transport)}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results == {"A": True, "P": 2 if publish == "publish" else [2]}
        assert await group_messages(db, transport.prefix) == {"g": ["g1"]}
        stored = await assert_lock(db, "g", transport.prefix, token=None)  # claimable now
        outcome = last_ack_outcome(commands_of(trace, "A"))
        insert = trace.index(("P", f"{transport.prefix}_messages", PUBLISH_INSERT[publish]))
        look = trace.index(("A", f"{transport.prefix}_messages", "find_one"))
        if outcome == SEEN_BY_THE_CHECK:
            # The check saw g1: no drop, the group is released.
            assert insert < look
        elif outcome == RECREATED:
            # Dropped before the ready: the publish made a new lock, as for a new group.
            assert (stored["available_at"], stored["version"], stored["last_seq"]) == (EPOCH, 1, 2)
        else:  # drop refused, released
            # The ready bumped version first: the drop matched nothing; released instead.
            ready = trace.index(("P", f"{transport.prefix}_locks", PUBLISH_READY[publish]))
            drop = trace.index(("A", f"{transport.prefix}_locks", "delete_one"))
            assert look < insert < ready < drop
            assert (stored["available_at"], stored["version"], stored["last_seq"]) == (
                clock.now(),
                2,
                2,
            )
        await deliver_the_rest(db, transport, clock, ["g1"])
        return outcome

    outcomes = await race(db, clock, {"A": 4, "P": 3}, setup, check)
    # Of the 35 orders: the insert before the check in 13 (no drop); the insert and the ready
    # both between the check and the drop in 3 (the allocation before, between or after A's
    # first two commands: drop refused); the drop before the ready in the other 19.
    assert outcomes == {SEEN_BY_THE_CHECK: 13, DROP_REFUSED: 3, RECREATED: 19}


#: the command by which each kind of publish writes its message
PUBLISH_INSERT = {"publish": "insert_one", "publish_many": "insert_many"}


#: the command by which each kind of publish readies its group
PUBLISH_READY = {"publish": "update_one", "publish_many": "bulk_write"}


async def test_a_publish_racing_the_claim_and_ack_of_its_groups_last_message_is_never_stranded(
    db: Any, clock: ManualClock
) -> None:
    """The claim decides whether its head is the group's last message (`was_last`) from the
    lock it leased; a publish racing with the whole claim + ack must still never be stranded,
    whether it readied the group before the lease (not last: released), between the lease and
    the drop (drop refused: released), or after the drop (lock re-created)."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")

        async def claim_then_ack() -> GroupLease:
            lease = await claim_one(transport, "A", group="g", event="g0")
            assert await transport.ack(lease)
            return lease

        return {"A": claim_then_ack, "P": lambda: transport.publish("g", "g1")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        lease: GroupLease = results["A"]
        assert results["P"] == 2
        assert (lease.seq, lease.deliveries) == (1, 1)
        assert await group_messages(db, transport.prefix) == {"g": ["g1"]}
        stored = await assert_lock(db, "g", transport.prefix, token=None)
        assert stored["available_at"] <= clock.now()
        path = commands_of(trace, "A")[2:]  # the ack's commands
        ready = trace.index(("P", f"{transport.prefix}_locks", "update_one"))
        leased = trace.index(("A", f"{transport.prefix}_locks", "find_one_and_update"))
        assert lease.was_last == (ready > leased)
        if not lease.was_last:
            assert path == ["messages.delete_one", "locks.update_one"]
            outcome = "not the last: released"
        else:
            outcome = last_ack_outcome(path)
            if outcome == RECREATED:
                assert stored["available_at"] == EPOCH
        await deliver_the_rest(db, transport, clock, ["g1"])
        return outcome

    outcomes = await race(db, clock, {"A": 6, "P": 3}, setup, check)
    # Of the 84 orders: the ready before A's lease in 1 (the head is not the last); the insert
    # and the ready between A's check and its drop in 5 (the allocation anywhere before them:
    # drop refused); the insert before the check in 49; the drop before the ready in 29.
    assert outcomes == {
        "not the last: released": 1,
        DROP_REFUSED: 5,
        SEEN_BY_THE_CHECK: 49,
        RECREATED: 29,
    }


@pytest.mark.parametrize("left_by", ["dead_letter", "interrupted-ack"])
async def test_a_publish_racing_the_claim_that_finds_its_group_empty_is_never_stranded(
    db: Any, clock: ManualClock, left_by: str
) -> None:
    """A drained group keeps its lock when its last message was dead-lettered (dead_letter
    releases, it does not drop) or when the ack died between deleting the head and dropping
    the lock: the next claim finds it empty and drops it, fenced on version, while a publish
    races with it."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        if left_by == "dead_letter":
            lease = await claim_one(transport, "A", group="g")
            assert await transport.dead_letter(lease, "bad")
        else:
            faults = FaultInjector()
            crashing = await new_transport(instrument(db, faults), clock, prefix=transport.prefix)
            lease = await claim_one(crashing, "A", group="g")
            faults.fail_before("delete_one", collection=f"{transport.prefix}_locks")
            with pytest.raises(AutoReconnect):
                await crashing.ack(lease)
            clock.advance(VISIBILITY)  # A's lease ends
        assert await group_messages(db, transport.prefix) == {}
        await assert_lock(db, "g", transport.prefix)
        return {"C": lambda: transport.claim("C"), "P": lambda: transport.publish("g", "g1")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results["P"] == 2
        claimed: GroupLease | None = results["C"]
        path = commands_of(trace, "C")
        if claimed is None:
            # C dropped the empty group before the publish readied it again.
            assert path == ["locks.find_one_and_update", "messages.find_one_and_update",
                            "locks.delete_one", "locks.find_one_and_update"]  # fmt: skip
            await assert_lock(db, "g", transport.prefix, token=None, available_at=EPOCH, version=1)
            await deliver_the_rest(db, transport, clock, ["g1"])
            return "dropped, then readied by the publish"
        assert (claimed.group_id, claimed.event, claimed.deliveries) == ("g", "g1", 1)
        await assert_lock(db, "g", transport.prefix, token=claimed.token)
        await assert_message(db, 2, transport.prefix, token=claimed.token)
        assert await transport.ack(claimed)
        await deliver_the_rest(db, transport, clock, [])
        # C's claim drops the empty group as an ack drops a drained one, and ends the same ways.
        if "locks.update_one" in path:
            return f"{DROP_REFUSED}, claimed again"
        if "locks.delete_one" in path:
            return f"{RECREATED}, claimed again"
        return "claimed at once"

    outcomes = await race(db, clock, {"C": 4, "P": 3}, setup, check)
    assert outcomes == {
        "dropped, then readied by the publish": 12,
        f"{DROP_REFUSED}, claimed again": 3,
        f"{RECREATED}, claimed again": 7,
        "claimed at once": 13,
    }


#: What P publishes to "g" while A acks g0 and claims again: the call, what it returns, the
#: events it publishes.
PUBLISHES_AFTER_G0: dict[
    str, tuple[Callable[[AsyncGroupTransport], Awaitable[Any]], Any, list[str]]
] = {
    "publish": (lambda transport: transport.publish("g", "g1"), 2, ["g1"]),
    "publish_many": (
        lambda transport: transport.publish_many([NewMessage("g", "g1"), NewMessage("g", "g2")]),
        [2, 3],
        ["g1", "g2"],
    ),
}


@pytest.mark.parametrize("publish", list(PUBLISHES_AFTER_G0))
async def test_a_publish_racing_an_ack_and_the_next_claim_is_never_stranded(
    db: Any, clock: ManualClock, publish: str
) -> None:
    call, seqs, events = PUBLISHES_AFTER_G0[publish]

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        lease = await claim_one(transport, "A", group="g")

        async def ack_then_claim() -> GroupLease | None:
            assert await transport.ack(lease)
            return await transport.claim("A")

        return {"A": ack_then_claim, "P": lambda: call(transport)}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results["P"] == seqs
        claimed: GroupLease | None = results["A"]
        if claimed is None:
            await deliver_the_rest(db, transport, clock, events)
            return "A found it empty"
        assert (claimed.event, claimed.seq, claimed.deliveries) == ("g1", 2, 1)
        await assert_lock(db, "g", transport.prefix, token=claimed.token)
        assert await transport.ack(claimed)
        await deliver_the_rest(db, transport, clock, events[1:])
        return "A got it"

    seen = await race(db, clock, {"A": 6, "P": 3}, setup, check)
    assert_outcomes(seen, 84, {"A found it empty", "A got it"})


# -------------------------------------------------------------------------- exclusivity


async def test_claimers_never_get_the_same_group_in_any_order(db: Any, clock: ManualClock) -> None:
    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        await transport.publish("h", "h0")
        return {name: (lambda name=name: transport.claim(name)) for name in "ABC"}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        leases = {name: lease for name, lease in results.items() if lease is not None}
        assert sorted(lease.group_id for lease in leases.values()) == ["g", "h"]
        for name, lease in leases.items():
            assert lease.worker_id == name
            await assert_lock(db, lease.group_id, transport.prefix, token=lease.token)
            await assert_message(db, lease.seq, transport.prefix, token=lease.token, deliveries=1)
        (empty_handed,) = set(results) - set(leases)
        return f"{empty_handed} got nothing"

    seen = await race(db, clock, {"A": 2, "B": 2, "C": 2}, setup, check)
    assert_outcomes(seen, 90, {"A got nothing", "B got nothing", "C got nothing"})


async def test_two_workers_on_one_group_hold_it_one_after_the_other_in_fifo_order(
    db: Any, clock: ManualClock
) -> None:
    async def setup(transport: AsyncGroupTransport) -> Actors:
        await publish_each(transport, "g", "g0", "g1")

        def worker(name: str) -> Callable[[], Awaitable[Any]]:
            async def act() -> tuple[GroupLease | None, bool | None]:
                lease = await transport.claim(name)
                if lease is None:
                    return None, None
                return lease, await transport.ack(lease)

            return act

        return {"A": worker("A"), "B": worker("B")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        got = {name: lease for name, (lease, _) in results.items() if lease is not None}
        assert all(acked for lease, acked in results.values() if lease is not None)
        first = next(name for name, lease in got.items() if lease.event == "g0")
        assert got[first].seq == 1
        left = ["g1"]
        if len(got) == 2:
            (second,) = set(got) - {first}
            assert got[second].event == "g1"
            # The second holder's lease came after the first one released the group.
            lease_at = trace.index((second, f"{transport.prefix}_locks", "find_one_and_update"))
            release_at = trace.index((first, f"{transport.prefix}_locks", "update_one"))
            assert lease_at > release_at
            left = []
        await deliver_the_rest(db, transport, clock, left)
        return f"{len(got)} holder(s)"

    seen = await race(db, clock, {"A": 4, "B": 4}, setup, check)
    assert_outcomes(seen, 70, {"1 holder(s)", "2 holder(s)"})


STALE_SETTLES: dict[str, Callable[[AsyncGroupTransport, GroupLease], Awaitable[bool]]] = {
    "ack": lambda transport, lease: transport.ack(lease),
    "nack-error": lambda transport, lease: transport.nack(lease, error="late failure"),
    "dead_letter": lambda transport, lease: transport.dead_letter(lease, "late failure"),
    "extend": lambda transport, lease: transport.extend(lease),
}


#: the most commands each stale settle and B's claim can take: A's dead_letter marks, copies,
#: deletes and releases; a claim that finds the head marked finishes the burial (copy, delete)
#: and stamps the next head. Every order of those is run.
STALE_COUNTS = {"dead_letter": {"A": 4, "B": 5}}


@pytest.mark.parametrize("call", list(STALE_SETTLES))
async def test_an_expired_holder_racing_the_takeover_leaves_one_owner_of_the_head(
    db: Any, clock: ManualClock, call: str
) -> None:
    """A's lease has expired and B takes the group over while A settles late. Either A's
    settle took effect (True, and B gets the next message) or it changed nothing (False, and B
    has the head) - never both, never a change reported as False."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await publish_each(transport, "g", "g0", "g1")
        stale = await claim_one(transport, "A", group="g")
        clock.advance(VISIBILITY + 1)
        return {
            "A": lambda: STALE_SETTLES[call](transport, stale),
            "B": lambda: transport.claim("B"),
        }

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        settled: bool = results["A"]
        taken: GroupLease | None = results["B"]
        head = await message(db, 1, transport.prefix)
        letters = await transport.dead_letters()
        if taken is None:  # only a renewal before the claim keeps B out
            assert settled and call == "extend"
            assert (await assert_lock(db, "g", transport.prefix))["token"].startswith("A:")
            assert head is not None and head["token"].startswith("A:")
            assert head["stamp_until"] == later(clock, VISIBILITY)
            return "A renewed first and kept it"
        # Whoever B got, B alone holds it: the lock and the head carry B's lease.
        await assert_lock(db, "g", transport.prefix, token=taken.token)
        await assert_message(
            db, taken.seq, transport.prefix, token=taken.token, stamp_until=taken.lease_until
        )
        if settled and call in ("ack", "dead_letter"):
            assert head is None
            assert (taken.event, taken.deliveries) == ("g1", 1)
            # A's burial happened exactly once, whether A or B's claim finished it.
            assert [letter.seq for letter in letters] == ([1] if call == "dead_letter" else [])
            return "A settled first"
        assert letters == []
        if settled:  # nack(0) released the group first: B takes the same head
            assert call == "nack-error"
            assert (taken.event, taken.deliveries) == ("g0", 2)
            return "A released first"
        assert (taken.event, taken.deliveries) == ("g0", 2)
        assert head is not None
        assert (head["token"], head["last_error"], head["dead"]) == (taken.token, None, None)
        return "A refused"

    counts = STALE_COUNTS.get(call, {"A": 4, "B": 2})
    outcomes = await race(db, clock, counts, setup, check)
    assert sum(outcomes.values()) == (126 if call == "dead_letter" else 15)
    assert "A refused" in outcomes


async def test_a_claim_racing_a_nack_without_delay_leaves_the_group_claimable_at_once(
    db: Any, clock: ManualClock
) -> None:
    """nack(0) releases the lock, then clears the head's token and stamp. A claim that leases
    the released lock in between finds the head still stamped by A's live lease. Whatever
    the order, the head must be claimable at once afterwards (the group is not parked for a
    lease_ttl behind a lease that holds nothing): C got it, or a claim right after does."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        lease = await claim_one(transport, "A", group="g")
        return {"A": lambda: transport.nack(lease), "C": lambda: transport.claim("C")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results["A"] is True  # A held the group: C cannot lease it before the release
        claimed: GroupLease | None = results["C"]
        outcome = "C got it" if claimed is not None else "C found nothing"
        if claimed is None:
            claimed = await transport.claim("D")  # same instant: no lease to wait out
            stored = await locks(db, transport.prefix)
            assert claimed is not None, f"g0 unclaimable, the locks: {stored}"
        assert (claimed.event, claimed.deliveries) == ("g0", 2)
        await assert_message(
            db, 1, transport.prefix, token=claimed.token, stamp_until=claimed.lease_until
        )
        assert await transport.ack(claimed)
        await assert_empty(db, transport.prefix)
        return outcome

    seen = await race(db, clock, {"A": 2, "C": 3}, setup, check)
    assert_outcomes(seen, 10, {"C got it", "C found nothing"})


# ------------------------------------------------------------ many workers over many groups


async def test_many_workers_over_many_groups_keep_fifo_and_exclusivity(
    db: Any, clock: ManualClock
) -> None:
    faults = FaultInjector(yield_between=True)
    transports = [await new_transport(instrument(db, faults), clock) for _ in range(3)]
    publisher = transports[0]
    groups = [f"g{i:02}" for i in range(24)]
    published: dict[str, list[Any]] = {g: [] for g in groups}
    batch: list[NewMessage] = []
    for n in range(5):
        for i, g in enumerate(groups):
            published[g].append(f"{g}.{n}")
            batch.append(NewMessage(g, f"{g}.{n}", priority=i % 5))
    await publisher.publish_many(batch[:60])
    flaky = frozenset(range(1, len(batch) + 1, 7))
    books = Bookkeeping(flaky)
    summaries: list[GroupRunSummary] = []

    async def worker(transport: AsyncGroupTransport, name: str) -> None:
        summaries.append(
            await transport.run(
                books.handler, worker_id=name, concurrency=5, retry_delay=0, stop_when_empty=True
            )
        )

    async def publish_rest() -> None:
        for item in batch[60:]:
            await publisher.publish(item.group_id, item.event, priority=item.priority)

    async with anyio.create_task_group() as group:
        group.start_soon(publish_rest)
        for number, transport in enumerate(transports):
            group.start_soon(worker, transport, f"w{number}")
    # Workers may have stopped before the last publishes: one more pass takes the rest.
    await worker(transports[1], "late")

    assert books.overlaps == []
    assert dict(books.processed) == published
    assert dict(books.runs) == {seq: 1 + (seq in flaky) for seq in range(1, len(batch) + 1)}
    assert sum(s.acked for s in summaries) == len(batch)
    assert sum(s.retried for s in summaries) == len(flaky)
    assert sum(s.lost + s.dead + s.unknown for s in summaries) == 0
    await assert_empty(db)
    assert await dead(db) == {}
    assert await messages(db) == {}


async def test_overlapping_publishes_to_one_group_have_no_order(
    db: Any, clock: ManualClock
) -> None:
    """The guarantee is "ordered when one publish returned before the other was called", not
    "delivered in seq order": allocating a seq and inserting the message are two commands, so a
    publisher holding the smaller seq can insert after a later publish was delivered. Both are
    delivered, once each, one at a time."""
    interleaving = Interleaving(
        # A allocates, B allocates, inserts and readies; C claims (lease, head): B's message;
        # then A inserts and readies.
        ["A", "B", "B", "B", "C", "C", "A", "A"]
    )
    transport = await new_transport(instrument(db, interleaving), clock)
    results = await interleaving.run(
        {
            "A": lambda: transport.publish("g", "a"),
            "B": lambda: transport.publish("g", "b"),
            "C": lambda: transport.claim("c"),
        }
    )
    seq_a, seq_b, first = results["A"], results["B"], results["C"]
    assert seq_a < seq_b
    assert isinstance(first, GroupLease) and (first.seq, first.event) == (seq_b, "b")
    assert await transport.ack(first)
    second = await transport.claim("c")
    assert second is not None and (second.seq, second.event) == (seq_a, "a")
    assert await transport.ack(second)
    # The group's lock outlives its last message here (the ack of a head that is not the
    # group's largest seq cannot drop it); the next claim finds it empty and drops it.
    clock.advance(0.001)
    assert await transport.claim("c") is None
    await assert_empty(db)
