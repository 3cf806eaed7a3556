"""AsyncGroupTransport's batched forms: `claim_many`, `ack_many`, `extend_many` and
`run(..., batch_size=N)`.

The batched forms must cost a fixed number of commands whatever the batch size and keep every
guarantee of the single forms: the groups that waited longest first, per-group FIFO and
round-robin, one holder per group under every interleaving of two claimers' commands, settles
fenced on the lease (a batch that lost some groups acks only the ones it holds and says
which), max_deliveries, the version-fenced drop of empty groups racing a publish, and recovery
after a command failed before it applied or applied with its reply lost. Assertions read the
stored documents.

What the batch slot of `run` promises whatever the primitive (renewals, lost items left alone,
cancellation, counting) is tested once against a fake holder in tests/runtime; here, what the
group adapter (`mongoq.groups.batch`) writes for it, fenced on the lock token and head stamp.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout

from mongoq import (
    AsyncGroupTransport,
    GroupLease,
    GroupRunSummary,
    InvalidInput,
    NewMessage,
)
from mongoq._validation import MAX_BATCH
from mongoq.runtime.loop import WORKER_STOPPED
from mongoq.testing import (
    CommandCounter,
    FaultInjector,
    ManualClock,
    Operation,
    Pause,
    instrument,
)
from tests.support.group_helpers import (
    EPOCH,
    PREFIX,
    PUBLISHES,
    VISIBILITY,
    Bookkeeping,
    assert_empty,
    assert_permanent_buried_and_flaky_parked,
    assert_released,
    by_group,
    claim_one,
    dead,
    failing_handler,
    first_occurrences,
    group_messages,
    lock,
    locks,
    message,
    messages,
    new_transport,
    race,
    snapshot,
)
from tests.support.helpers import Actors, Trace, later, nth, unexpected_errors, wait_for

#: claim_many's three commands: (collection, command, a fresh `match` for the rule)
CLAIM_MANY: dict[str, tuple[str, str, Callable[[], Any]]] = {
    "select": ("mq_locks", "aggregate", lambda: nth(0)),  # the candidates with their heads
    "lease": ("mq_locks", "update_many", lambda: None),
    "stamp": ("mq_messages", "update_many", lambda: None),
}

#: ack_many's four commands (for a batch where one group drains and one does not)
ACK_MANY = {
    "delete": ("mq_messages", "delete_many"),
    "drained?": ("mq_messages", "distinct"),
    "drop": ("mq_locks", "bulk_write"),
    "release": ("mq_locks", "update_many"),
}


def cost(commands: Mapping[str, tuple[Any, ...]], *steps: str) -> Counter[str]:
    """The commands `steps` of a batched call send (every step when none is named), by
    ``collection.command`` as a `CommandCounter` counts them."""
    return Counter(f"{commands[step][0]}.{commands[step][1]}" for step in steps or commands)


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()


@dataclass
class Failure:
    """The fault a test injects through `faults`: the command it picks fails `when` it runs,
    "before" it applied, or "after" with its reply lost; `log` holds the warnings it left."""

    faults: FaultInjector
    when: str
    log: pytest.LogCaptureFixture

    def inject(self, collection: str, name: str, **rule: Any) -> type[Exception]:
        """Make the next `name` on `collection` fail; the error its caller then sees."""
        getattr(self.faults, f"fail_{self.when}")(name, collection=collection, **rule)
        return AutoReconnect if self.when == "before" else NetworkTimeout


@pytest.fixture(params=["before", "after"])
def failure(
    request: pytest.FixtureRequest, faults: FaultInjector, caplog: pytest.LogCaptureFixture
) -> Failure:
    """Each fault test runs both ways: the command fails before it applied, or after."""
    caplog.set_level(logging.WARNING)
    return Failure(faults, request.param, caplog)


@pytest.fixture
def counter() -> CommandCounter:
    return CommandCounter()


@pytest.fixture
async def transport(
    db: Any, clock: ManualClock, faults: FaultInjector, counter: CommandCounter
) -> AsyncGroupTransport:
    """The transport under test: its commands pass `faults` (no rule until a test sets one) and
    are counted by `counter` from after the index set-up."""
    transport = await new_transport(instrument(db, faults, counter), clock)
    counter.reset()
    return transport


def groups_of(leases: list[GroupLease]) -> list[Any]:
    return [lease.group_id for lease in leases]


async def publish_groups(
    transport: AsyncGroupTransport, groups: list[str], per_group: int
) -> dict[str, list[str]]:
    """`per_group` messages for each group, published round by round in one batch; the events
    of each group in FIFO order."""
    published: dict[str, list[str]] = {group: [] for group in groups}
    batch = []
    for n in range(per_group):
        for group in groups:
            published[group].append(f"{group}.{n}")
            batch.append(NewMessage(group, f"{group}.{n}"))
    await transport.publish_many(batch)
    return published


async def due_groups(db: Any, clock: ManualClock, prefix: str = PREFIX) -> list[Any]:
    return [
        group
        for group, doc in (await locks(db, prefix)).items()
        if doc["available_at"] <= clock.now()
    ]


async def drain_batched(
    db: Any,
    transport: AsyncGroupTransport,
    clock: ManualClock,
    n: int = 10,
    worker: str = "rescuer",
) -> list[GroupLease]:
    """Claim and ack in batches, a millisecond apart, until no group is due; every ack must
    take effect. A round may return nothing while groups are still due (a group found empty,
    a head dead-lettered): the drain goes on until none is."""
    delivered: list[GroupLease] = []
    for _ in range(100):
        leases = await transport.claim_many(n, worker)
        if leases:
            delivered.extend(leases)
            clock.advance(0.001)
            assert await transport.ack_many(leases) == [True] * len(leases)
        elif not await due_groups(db, clock, transport.prefix):
            return delivered
        clock.advance(0.001)
    stuck = await locks(db, transport.prefix)
    heads = await messages(db, transport.prefix)
    raise AssertionError(f"the drain did not end: groups {stuck}, heads {heads}")


async def drain_the_rest(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> list[GroupLease]:
    """A millisecond on, `drain_batched` what is left; then no message and no group may
    remain. What the drain delivered."""
    clock.advance(0.001)
    delivered = await drain_batched(db, transport, clock)
    await assert_empty(db, transport.prefix)
    return delivered


async def assert_holds(db: Any, lease: GroupLease, prefix: str = PREFIX) -> None:
    """The group is leased by `lease` and its head stamped with the lease's token."""
    stored = await lock(db, lease.group_id, prefix)
    assert stored is not None
    assert (stored["token"], stored["available_at"], stored["parked"]) == (
        lease.token,
        lease.lease_until,
        False,
    )
    head = await message(db, lease.seq, prefix)
    assert head is not None
    assert (head["group_id"], head["event"]) == (lease.group_id, lease.event)
    assert (head["token"], head["stamp_until"]) == (lease.token, lease.lease_until)
    assert head["deliveries"] == lease.deliveries


async def assert_left_to(db: Any, group: Any, lease: GroupLease) -> None:
    """`group` is still locked under `lease` (its token, until its lease ends): nobody gets
    the group before then."""
    stored = await lock(db, group)
    assert stored is not None
    assert (stored["token"], stored["available_at"]) == (lease.token, lease.lease_until)


# ---------------------------------------------------------------------------- command counts


@pytest.mark.parametrize("n", [1, 5, 40])
async def test_claim_many_costs_three_commands_whatever_n(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, clock: ManualClock, n: int
) -> None:
    groups = [f"g{i:02}" for i in range(50)]
    await publish_groups(transport, groups, 2)
    clock.advance(1)
    counter.reset()

    leases = await transport.claim_many(n, "A")

    assert counter.counts == cost(CLAIM_MANY)
    assert len(leases) == n
    assert len(set(groups_of(leases))) == n
    (token,) = {lease.token for lease in leases}
    assert token.startswith("A:")
    for lease in leases:
        # Each group's first message (seqs are published round by round).
        assert lease.event == f"{lease.group_id}.0"
        assert lease.seq == groups.index(lease.group_id) + 1
        assert (lease.deliveries, lease.worker_id, lease.was_last) == (1, "A", False)
        assert lease.lease_until == later(clock, VISIBILITY)
        await assert_holds(db, lease)
    leased = set(groups_of(leases))
    for group, doc in (await locks(db)).items():
        if group not in leased:
            assert (doc["token"], doc["available_at"]) == (None, EPOCH)
    for seq, doc in (await messages(db)).items():
        if seq not in {lease.seq for lease in leases}:
            assert (doc["token"], doc["deliveries"]) == (None, 0)


async def test_claim_many_with_nothing_due_costs_one_command_and_writes_nothing(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter
) -> None:
    await transport.publish("g", "g0")
    await claim_one(transport, "A", group="g")
    before = await snapshot(db)
    counter.reset()

    assert await transport.claim_many(10, "B") == []

    assert counter.counts == cost(CLAIM_MANY, "select")
    assert await snapshot(db) == before


async def test_ack_many_costs_at_most_four_commands_and_two_when_no_group_drains(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, clock: ManualClock
) -> None:
    pairs = [("a", "a0"), ("b", "b0"), ("c", "c0"), ("b", "b1"), ("d", "d0"), ("d", "d1")]
    await transport.publish_many(NewMessage(group, event) for group, event in pairs)
    leases = await transport.claim_many(10, "A")
    assert sorted((lease.group_id, lease.was_last) for lease in leases) == [
        ("a", True),
        ("b", False),
        ("c", True),
        ("d", False),
    ]
    clock.advance(1)
    counter.reset()

    assert await transport.ack_many(leases) == [True] * 4

    assert counter.counts == cost(ACK_MANY)
    # a and c drained: their locks are dropped; b and d are released, claimable now.
    assert await group_messages(db) == {"b": ["b1"], "d": ["d1"]}
    assert sorted(await locks(db)) == ["b", "d"]
    for group in "bd":
        assert (await assert_released(db, group, clock.now()))["parked"] is False

    # b1 and d1 are their groups' last messages when claimed; then b2 and d2 are published.
    leases = await transport.claim_many(10, "A")
    assert sorted((lease.event, lease.was_last) for lease in leases) == [
        ("b1", True),
        ("d1", True),
    ]
    await transport.publish_many([NewMessage("b", "b2"), NewMessage("d", "d2")])
    counter.reset()

    assert await transport.ack_many(leases) == [True, True]

    # The check finds b2 and d2: no drop is sent, the groups are released.
    assert counter.counts == cost(ACK_MANY, "delete", "drained?", "release")
    assert await group_messages(db) == {"b": ["b2"], "d": ["d2"]}
    assert sorted(await locks(db)) == ["b", "d"]


async def test_ack_many_of_heads_that_are_not_the_last_costs_two_commands(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter
) -> None:
    await publish_groups(transport, ["a", "b", "c"], 2)
    leases = await transport.claim_many(10, "A")
    counter.reset()

    assert await transport.ack_many(leases) == [True] * 3

    assert counter.counts == cost(ACK_MANY, "delete", "release")
    assert await group_messages(db) == {"a": ["a.1"], "b": ["b.1"], "c": ["c.1"]}


@pytest.mark.parametrize("call", ["ack_many", "extend_many"])
async def test_no_lease_costs_nothing_and_a_batch_over_the_limit_is_refused_unsent(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, call: str
) -> None:
    """An empty batch answers at once; MAX_BATCH + 1 leases (the same lease repeated: the size
    alone is refused) raise InvalidInput naming the argument. Neither sends a command."""
    await transport.publish("g", "g0")
    (lease,) = await transport.claim_many(1, "A")
    before = await snapshot(db)
    counter.reset()
    settle_batch = getattr(transport, call)

    assert await settle_batch([]) == []
    refusal = f"^leases: at most {MAX_BATCH} per call, got {MAX_BATCH + 1}$"
    with pytest.raises(InvalidInput, match=refusal):
        await settle_batch([lease] * (MAX_BATCH + 1))

    assert counter.total == 0
    assert await snapshot(db) == before


async def test_extend_many_accepts_a_batch_at_the_limit(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await transport.publish("g", "g0")
    (lease,) = await transport.claim_many(1, "A")
    clock.advance(1)

    assert await transport.extend_many([lease] * MAX_BATCH) == [True] * MAX_BATCH

    stored = await lock(db, "g")
    assert stored is not None and stored["available_at"] == later(clock, VISIBILITY)


async def test_a_batched_lifecycle_over_100_groups_costs_at_most_0_1_commands_per_message(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter
) -> None:
    await transport.publish_many(NewMessage(f"g{i:03}", i) for i in range(100))
    leases = await transport.claim_many(100, "A")
    acked = await transport.ack_many(leases)

    assert acked == [True] * 100
    assert sorted(lease.event for lease in leases) == list(range(100))
    assert counter.total / 100 <= 0.1, counter.counts
    # publish_many 3, claim_many 3, ack_many 3 (every group drains: no release is left to send)
    assert counter.total == 9
    await assert_empty(db)


# ------------------------------------------------------------------------------------ order


async def test_claim_many_takes_the_groups_that_waited_longest_with_their_heads(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    groups = ["g0", "g1", "g2", "g3", "g4"]
    await publish_groups(transport, groups, 3)
    # Serve each group once, acking a second apart in this order: their waiting order.
    served = ["g3", "g1", "g4", "g0", "g2"]
    leases = await transport.claim_many(5, "A")
    by_id = {lease.group_id: lease for lease in leases}
    for group in served:
        clock.advance(1)
        assert await transport.ack_many([by_id[group]]) == [True]
    clock.advance(1)
    await transport.publish("new", "new.0")  # never claimed: it waited longest of all

    first = await transport.claim_many(4, "B")
    second = await transport.claim_many(4, "B")

    assert groups_of(first) == ["new", "g3", "g1", "g4"]
    assert [lease.event for lease in first] == ["new.0", "g3.1", "g1.1", "g4.1"]
    assert groups_of(second) == ["g0", "g2"]
    assert [lease.event for lease in second] == ["g0.1", "g2.1"]
    for lease in first + second:
        await assert_holds(db, lease)


async def test_claim_many_respects_the_priority_floor(
    db: Any, transport: AsyncGroupTransport
) -> None:
    await transport.publish_many([NewMessage(f"p{p}", f"p{p}.0", priority=p) for p in range(5)])
    before = await snapshot(db)

    leases = await transport.claim_many(10, "A", min_priority=3)

    assert sorted(groups_of(leases)) == ["p3", "p4"]
    assert {lease.priority for lease in leases} == {3, 4}
    after = await snapshot(db)
    for group, seq in (("p0", 1), ("p1", 2), ("p2", 3)):
        assert after["locks"][group] == before["locks"][group]
        assert after["messages"][seq] == before["messages"][seq]


async def test_repeated_claim_many_and_ack_many_keep_fifo_and_round_robin(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    """Four groups of three messages, batches of two: each round takes the two groups that
    waited longest, so the rounds alternate between the two pairs, and each group's messages
    come in publish order."""
    groups = ["a", "b", "c", "d"]
    published = await publish_groups(transport, groups, 3)
    rounds: list[list[GroupLease]] = []

    while leases := await transport.claim_many(2, "w"):
        rounds.append(leases)
        clock.advance(1)
        assert await transport.ack_many(leases) == [True] * len(leases)
        clock.advance(1)

    assert len(rounds) == 6
    pairs = [frozenset(groups_of(leases)) for leases in rounds]
    assert all(len(pair) == 2 for pair in pairs)
    assert pairs[0] | pairs[1] == set(groups)
    assert pairs == [pairs[0], pairs[1]] * 3
    assert by_group([lease for leases in rounds for lease in leases]) == published
    assert all(lease.deliveries == 1 for leases in rounds for lease in leases)
    await assert_empty(db)


async def test_a_group_published_between_rounds_goes_before_the_groups_served_again(
    transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await publish_groups(transport, ["a", "b"], 2)
    served = await transport.claim_many(2, "w")
    clock.advance(1)
    assert await transport.ack_many(served) == [True, True]
    clock.advance(1)
    await transport.publish("new", "new.0")

    leases = await transport.claim_many(2, "w")

    assert groups_of(leases)[0] == "new"
    assert len(leases) == 2


# ------------------------------------------------------------------------------ exclusivity


async def assert_one_holder_per_group(
    db: Any,
    clock: ManualClock,
    transport: AsyncGroupTransport,
    claimed: dict[str, list[GroupLease]],
    published: dict[str, list[str]],
) -> None:
    """No group is in two claimers' hands; each leased group is stored under its claimer's
    lease with its first message as the head, delivered once; every other group is claimable
    now with its head untouched. Then everything is delivered, in per-group order."""
    prefix = transport.prefix
    taken = [lease.group_id for leases in claimed.values() for lease in leases]
    assert len(taken) == len(set(taken)), f"shared: {taken}"
    for worker, leases in claimed.items():
        for lease in leases:
            assert lease.worker_id == worker
            assert (lease.event, lease.deliveries) == (published[lease.group_id][0], 1)
            await assert_holds(db, lease, prefix)
    stored = await locks(db, prefix)
    heads = await messages(db, prefix)
    for group in set(published) - set(taken):
        assert stored[group]["token"] is None
        assert stored[group]["available_at"] <= clock.now()
    for seq, head in heads.items():
        if seq not in {lease.seq for leases in claimed.values() for lease in leases}:
            assert (head["token"], head["deliveries"]) == (None, 0)
    for leases in claimed.values():
        assert await transport.ack_many(leases) == [True] * len(leases)
    rest = await drain_the_rest(db, transport, clock)
    delivered = [lease for leases in claimed.values() for lease in leases] + rest
    assert by_group(delivered) == published


async def claimed_by(transport: AsyncGroupTransport, worker: str, n: int | None) -> list[Any]:
    """What `worker` claims: `n` groups in one `claim_many`, or (`n` None) one `claim`."""
    if n is not None:
        return await transport.claim_many(n, worker)
    lease = await transport.claim(worker)
    return [] if lease is None else [lease]


@pytest.mark.parametrize(
    ("groups", "claimers", "outcomes"),
    [
        # Whoever leases first gets two groups; the other gets the third in every order: had it
        # read its candidates before that lease, it read again past them (70 orders).
        pytest.param("ghk", {"A": 2, "B": 2}, {"A 2 / B 1": 35, "A 1 / B 2": 35}, id="two-batches"),
        # Four groups: the single claim always finds one. S's lease between A's read and A's
        # lease takes one of A's candidates: A gets two.
        pytest.param(
            "ghkm", {"A": 3, "S": None}, {"A 3 / S 1": 11, "A 2 / S 1": 4}, id="batch-and-single"
        ),
    ],
)
async def test_a_batch_claimer_never_shares_a_group_with_another_claimer_in_any_order(
    db: Any,
    clock: ManualClock,
    groups: str,
    claimers: dict[str, int | None],
    outcomes: dict[str, int],
) -> None:
    """Each claimer asks for `claimers[name]` of the groups (two messages each) in one
    claim_many (three commands, four when another took some of its candidates first), or for
    one with a single claim (two); every order of their commands."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await publish_groups(transport, list(groups), 2)
        return {name: partial(claimed_by, transport, name, n) for name, n in claimers.items()}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        published = {group: [f"{group}.0", f"{group}.1"] for group in groups}
        await assert_one_holder_per_group(db, clock, transport, results, published)
        return " / ".join(f"{name} {len(results[name])}" for name in claimers)

    commands = {name: 2 if n is None else 4 for name, n in claimers.items()}
    assert await race(db, clock, commands, setup, check) == outcomes


async def test_an_expired_batch_acking_while_another_worker_takes_over_reports_what_it_acked(
    db: Any, clock: ManualClock
) -> None:
    """A's leases on g and h expired; A acks both while B claims (and stamps the head of) one
    group. For each lease, A's answer must say what happened: True exactly when its head was
    removed, False (and nothing changed) when B holds it."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await publish_groups(transport, ["g", "h"], 2)
        stale = await transport.claim_many(2, "A")
        clock.advance(VISIBILITY + 1)

        async def ack() -> tuple[list[GroupLease], list[bool]]:
            return stale, await transport.ack_many(stale)

        return {"A": ack, "B": lambda: transport.claim("B")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        prefix = transport.prefix
        stale, acked = results["A"]
        taken: GroupLease | None = results["B"]
        assert taken is not None
        await assert_holds(db, taken, prefix)
        for lease, ok in zip(stale, acked, strict=True):
            head = await message(db, lease.seq, prefix)
            if ok:
                assert head is None, f"{lease.group_id}: A told True, its head is still there"
            else:
                assert head is not None and head["token"] != lease.token
                assert taken.group_id == lease.group_id and taken.seq == lease.seq
        assert await transport.ack(taken)
        rest = await drain_the_rest(db, transport, clock)
        delivered = first_occurrences(
            [(x.group_id, x.event) for x in sorted([taken, *rest], key=lambda x: x.seq)]
        )
        for group in "gh":
            lease = next(x for x in stale if x.group_id == group)
            acked_here = acked[stale.index(lease)]
            expected = [f"{group}.1"] if acked_here else [f"{group}.0", f"{group}.1"]
            assert [e for g, e in delivered if g == group] == expected
        return f"A acked {sum(acked)}, B got {taken.event}"

    outcomes = await race(db, clock, {"A": 4, "B": 2}, setup, check)
    assert sum(outcomes.values()) == 15
    # B stamped a head before A deleted it (A told False for that group), or after (B got
    # the next message, or a released group's).
    assert any(outcome.startswith("A acked 1,") for outcome in outcomes)
    assert any(outcome.startswith("A acked 2,") for outcome in outcomes)


async def test_a_claim_many_racing_a_nack_without_delay_leaves_the_group_claimable_at_once(
    db: Any, clock: ManualClock
) -> None:
    """nack(0) releases the lock, then clears the head's stamp. A claim_many that leases the
    released lock in between finds the head still stamped by A's live lease: it must give the
    group back (not keep it for a lease_ttl), so that C got g0, or a claim right after does."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g.0")
        (lease,) = await transport.claim_many(1, "A")
        await transport.publish("h", "h.0")
        return {"A": lambda: transport.nack(lease), "C": lambda: transport.claim_many(2, "C")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        prefix = transport.prefix
        assert results["A"] is True
        claimed = {lease.group_id: lease for lease in results["C"]}
        assert "h" in claimed  # h was free all along
        outcome = "C got g0" if "g" in claimed else "C gave g back"
        if "g" not in claimed:
            released = await lock(db, "g", prefix)
            assert released is not None and released["token"] is None
            assert released["available_at"] <= clock.now()
            (again,) = await transport.claim_many(10, "D")  # same instant: no lease to wait
            claimed["g"] = again
        assert (claimed["g"].event, claimed["g"].deliveries) == ("g.0", 2)
        for lease in claimed.values():
            await assert_holds(db, lease, prefix)
        assert await transport.ack_many(list(claimed.values())) == [True, True]
        await assert_empty(db, prefix)
        return outcome

    outcomes = await race(db, clock, {"A": 2, "C": 4}, setup, check)
    # C gets g0 only if it reads the groups and their heads (one command) after A cleared the
    # stamp (1 order of 15).
    assert outcomes == {"C got g0": 1, "C gave g back": 14}


# ---------------------------------------------------------------------- a batch losing leases


async def stored_groups(db: Any, groups: set[Any]) -> dict[str, dict[Any, bytes]]:
    """The stored bytes of `groups`' locks and messages."""
    everything = await snapshot(db)
    of_groups = {seq for seq, doc in (await messages(db)).items() if doc["group_id"] in groups}
    return {
        "locks": {key: value for key, value in everything["locks"].items() if key in groups},
        "messages": {
            key: value for key, value in everything["messages"].items() if key in of_groups
        },
    }


async def lose_two_of_four(
    db: Any, clock: ManualClock, transport: AsyncGroupTransport
) -> tuple[list[GroupLease], set[Any], dict[str, dict[Any, bytes]]]:
    """A leases g1..g4; its leases expire; B takes two of the groups over and acks the head
    of one. Returns A's batch, the stolen groups, and their stored bytes."""
    await publish_groups(transport, ["g1", "g2", "g3", "g4"], 2)
    batch = await transport.claim_many(4, "A")
    assert len(batch) == 4
    clock.advance(VISIBILITY + 1)
    thief = await transport.claim_many(2, "B")
    assert len(thief) == 2 and all(lease.deliveries == 2 for lease in thief)
    assert await transport.ack(thief[0])
    clock.advance(1)
    stolen = set(groups_of(thief))
    return batch, stolen, await stored_groups(db, stolen)


async def test_a_batch_that_lost_some_groups_acks_only_the_ones_it_holds(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    batch, stolen, before = await lose_two_of_four(db, clock, transport)

    acked = await transport.ack_many(batch)

    assert acked == [lease.group_id not in stolen for lease in batch]
    assert await stored_groups(db, stolen) == before
    for lease in batch:
        if lease.group_id in stolen:
            continue
        assert await message(db, lease.seq) is None
        await assert_released(db, lease.group_id, clock.now())
    assert await dead(db) == {}


async def test_extend_many_tells_which_groups_are_held_and_extends_only_those(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, clock: ManualClock
) -> None:
    batch, stolen, before = await lose_two_of_four(db, clock, transport)
    counter.reset()

    assert await transport.extend_many(batch) == [lease.group_id not in stolen for lease in batch]

    assert counter.counts == {
        "mq_locks.update_many": 1,
        "mq_locks.find": 1,
        "mq_messages.update_many": 1,
    }

    assert await stored_groups(db, stolen) == before
    for lease in batch:
        if lease.group_id in stolen:
            continue
        stored = await lock(db, lease.group_id)
        head = await message(db, lease.seq)
        assert stored is not None and head is not None
        assert (stored["token"], stored["available_at"]) == (lease.token, later(clock, VISIBILITY))
        assert (head["token"], head["stamp_until"]) == (lease.token, later(clock, VISIBILITY))
    # Only the group B released is claimable; A's renewed groups are not.
    assert set(groups_of(await transport.claim_many(10, "C"))) < stolen


async def test_ack_many_tells_a_stale_lease_from_the_live_one_on_the_same_head(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, clock: ManualClock
) -> None:
    """A's lease on g expired and B took g over: the same head (seq) under another token.
    Acked in one batch, only B's lease takes effect and only B's is reported acked."""
    await transport.publish_many([NewMessage("g", "g0"), NewMessage("g", "g1")])
    (stale,) = await transport.claim_many(1, "A")
    clock.advance(VISIBILITY + 1)
    (live,) = await transport.claim_many(1, "B")
    assert (live.seq, live.deliveries) == (stale.seq, 2) and live.token != stale.token
    counter.reset()

    assert await transport.ack_many([stale, live]) == [False, True]

    # Two deletes asked, one done: which heads are left, then which groups are held, tell.
    assert counter.counts == cost(ACK_MANY, "delete", "release") + Counter(
        {"mq_messages.find": 1, "mq_locks.find": 1}
    )
    assert await group_messages(db) == {"g": ["g1"]}
    await assert_released(db, "g", clock.now())
    assert await dead(db) == {}


@pytest.mark.parametrize("rival_acks", [False, True], ids=["taken-over", "taken-over-and-acked"])
async def test_an_ack_many_overtaken_just_before_its_delete_reports_only_what_it_proves(
    db: Any,
    transport: AsyncGroupTransport,
    faults: FaultInjector,
    clock: ManualClock,
    rival_acks: bool,
) -> None:
    """A's leases on g and h expired. Just before A's delete, B takes g over (and, in the
    second case, acks g's head). A's delete removes h's head only. If g's head is still there,
    the one head gone is h's. If g's head is gone too, two heads vanished for one deleted: h's
    group is still A's (nobody else could stamp its head), so the one A removed is h's, and g's
    was B's. Either way A reports h acked and g not, raises nothing, and both groups go on."""
    rival = await new_transport(db, clock)  # another process
    await transport.publish_many(
        [
            NewMessage("g", "g0", priority=1),
            NewMessage("h", "h0"),
            NewMessage("g", "g1", priority=1),
            NewMessage("h", "h1"),
        ]
    )
    stale = await transport.claim_many(2, "A")
    by_group_id = {lease.group_id: lease for lease in stale}
    assert sorted(by_group_id) == ["g", "h"]
    clock.advance(VISIBILITY + 1)
    delete = faults.pause_before("delete_many", collection="mq_messages")
    results: list[list[bool]] = []

    async def ack() -> None:
        results.append(await transport.ack_many(stale))

    async with anyio.create_task_group() as group:
        group.start_soon(ack)
        await wait_for(delete.reached.is_set, "A's delete")
        taken = await claim_one(rival, "B", group="g", min_priority=1)
        assert (taken.event, taken.deliveries) == ("g0", 2)
        if rival_acks:
            assert await rival.ack(taken)
        delete.release()

    (acked,) = results
    assert acked == [lease.group_id == "h" for lease in stale]
    assert await group_messages(db) == {
        "g": ["g1"] if rival_acks else ["g0", "g1"],
        "h": ["h1"],  # A's delete did remove h0
    }
    await assert_released(db, "h", clock.now())
    if not rival_acks:
        await assert_holds(db, taken)
        assert await rival.ack(taken)

    delivered = await drain_the_rest(db, transport, clock)

    assert sorted((x.event, x.deliveries) for x in delivered) == [("g1", 1), ("h1", 1)]
    assert await dead(db) == {}


async def test_a_batch_whose_groups_were_all_taken_changes_nothing(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await publish_groups(transport, ["g1", "g2"], 2)
    batch = await transport.claim_many(2, "A")
    clock.advance(VISIBILITY + 1)
    assert len(await transport.claim_many(2, "B")) == 2
    before = await snapshot(db)

    assert await transport.extend_many(batch) == [False, False]
    assert await transport.ack_many(batch) == [False, False]

    assert await snapshot(db) == before


# --------------------------------------------------------------------- max_deliveries, drops


async def deliver_twice_and_nack(
    transport: AsyncGroupTransport, clock: ManualClock, poison: Any
) -> None:
    """g gets `poison` then g1; `poison` is delivered twice, a second apart, and nacked each
    time ("boom 1", "boom 2"), so that under max_deliveries=2 the next claim buries it; then
    h gets h0."""
    await transport.publish_many([NewMessage("g", poison), NewMessage("g", "g1")])
    for delivery in (1, 2):
        (lease,) = await transport.claim_many(10, "A")
        assert (lease.group_id, lease.event, lease.deliveries) == ("g", poison, delivery)
        assert await transport.nack(lease, error=f"boom {delivery}")
        clock.advance(1)
    await transport.publish("h", "h0")


async def test_claim_many_dead_letters_an_over_limit_head_and_releases_its_group(
    db: Any, clock: ManualClock
) -> None:
    transport = await new_transport(db, clock, max_deliveries=2)
    await deliver_twice_and_nack(transport, clock, {"poison": True})
    clock.advance(1)

    leases = await transport.claim_many(10, "A")  # g's head is over the limit: buried

    assert [(lease.group_id, lease.event) for lease in leases] == [("h", "h0")]
    (buried,) = (await dead(db)).values()
    assert (buried["_id"], buried["group_id"], buried["event"]) == (1, "g", {"poison": True})
    assert buried["published_at"] == later(clock, -3)
    assert (buried["error"], buried["deliveries"]) == ("boom 2", 3)
    assert buried["dead_at"] == clock.now()
    assert await group_messages(db) == {"g": ["g1"], "h": ["h0"]}
    await assert_released(db, "g", clock.now())
    assert await transport.ack_many(leases) == [True]
    clock.advance(0.001)

    (nxt,) = await transport.claim_many(10, "A")  # the group's next head, at once

    assert (nxt.group_id, nxt.seq, nxt.event, nxt.deliveries) == ("g", 2, "g1", 1)
    assert await transport.ack_many([nxt]) == [True]
    await assert_empty(db)


async def test_claim_many_drops_an_empty_group_and_returns_the_others(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter
) -> None:
    """A group whose last message was dead-lettered keeps its lock; the claim that finds it
    empty drops it (one more command) and still returns the other groups of the batch."""
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g")
    assert await transport.dead_letter(lease, "bad")
    await transport.publish("h", "h0")
    assert await group_messages(db) == {"h": ["h0"]}
    assert sorted(await locks(db)) == ["g", "h"]
    counter.reset()

    leases = await transport.claim_many(10, "A")

    assert [(x.group_id, x.event) for x in leases] == [("h", "h0")]
    assert sorted(await locks(db)) == ["h"]
    assert counter.counts["mq_locks.delete_one"] == 1
    assert counter.total == 4  # claim_many's three and the drop


async def assert_g1_kept_its_group(db: Any, prefix: str) -> dict[str, Any]:
    """g1 is the one message left, and its group has a lock (g1 is not stranded); the lock."""
    assert await group_messages(db, prefix) == {"g": ["g1"]}
    stored = await lock(db, "g", prefix)
    assert stored is not None, "g1 is stranded: its group has no lock"
    return stored


@pytest.mark.parametrize("publish", list(PUBLISHES))
async def test_a_publish_racing_the_claim_many_that_finds_its_group_empty_is_never_stranded(
    db: Any, clock: ManualClock, publish: str
) -> None:
    """g's lock is left behind by a dead-lettered last message. C's claim_many finds g empty
    and drops it, fenced on the version it read, while a publish (allocate, insert, ready)
    races: whatever the order, g1 has a lock and is delivered."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        lease = await claim_one(transport, "A", group="g")
        assert await transport.dead_letter(lease, "bad")
        return {
            "C": lambda: transport.claim_many(2, "C"),
            "P": lambda: PUBLISHES[publish](transport),
        }

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        prefix = transport.prefix
        claimed: list[GroupLease] = results["C"]
        stored = await assert_g1_kept_its_group(db, prefix)
        path = [name for who, _, name in trace if who == "C"]
        if claimed:
            (lease,) = claimed
            assert (lease.event, lease.deliveries) == ("g1", 1)
            await assert_holds(db, lease, prefix)
            assert await transport.ack_many(claimed) == [True]
            outcome = "C got g1"
        elif "update_one" in path:  # the drop matched nothing: released, claimable now
            assert (stored["token"], stored["available_at"], stored["version"]) == (
                None,
                clock.now(),
                2,
            )
            outcome = "drop refused (version moved), released"
        else:  # dropped: the ready upserted a fresh lock, as for a new group
            assert path[-1] == "delete_one", path
            assert (stored["token"], stored["available_at"], stored["version"]) == (None, EPOCH, 1)
            outcome = "dropped, re-created by the publish"
        rest = await drain_the_rest(db, transport, clock)
        assert [x.event for x in rest] == ([] if claimed else ["g1"])
        return outcome

    outcomes = await race(db, clock, {"C": 4, "P": 3}, setup, check)
    # C's read of the groups and heads after the insert: C gets g1 (5 orders). Otherwise C
    # drops g before the ready re-creates it (23), or the ready's version bump refuses the
    # drop (7).
    assert outcomes == {
        "C got g1": 5,
        "dropped, re-created by the publish": 23,
        "drop refused (version moved), released": 7,
    }


async def test_a_publish_racing_the_ack_many_that_drops_its_drained_group_is_never_stranded(
    db: Any, clock: ManualClock
) -> None:
    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        (lease,) = await transport.claim_many(1, "A")
        assert lease.was_last
        return {
            "A": lambda: transport.ack_many([lease]),
            "P": lambda: transport.publish("g", "g1"),
        }

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results["A"] == [True]
        stored = await assert_g1_kept_its_group(db, transport.prefix)
        assert stored["token"] is None and stored["available_at"] <= clock.now()
        path = [name for who, _, name in trace if who == "A"]
        assert [x.event for x in await drain_the_rest(db, transport, clock)] == ["g1"]
        if "bulk_write" not in path:
            return "seen by the check, released"
        if stored["available_at"] == EPOCH:
            return "dropped, re-created by the publish"
        return "drop refused, released"

    outcomes = await race(db, clock, {"A": 4, "P": 3}, setup, check)
    assert outcomes == {
        "seen by the check, released": 13,
        "dropped, re-created by the publish": 19,
        "drop refused, released": 3,
    }


# -------------------------------------------------------------------------------- faults


@pytest.mark.parametrize("command", list(CLAIM_MANY))
async def test_a_claim_many_that_failed_on_any_command_is_recoverable(
    db: Any, transport: AsyncGroupTransport, failure: Failure, clock: ManualClock, command: str
) -> None:
    published = await publish_groups(transport, ["g", "h", "k"], 2)
    before = await snapshot(db)
    collection, name, match = CLAIM_MANY[command]

    with pytest.raises(failure.inject(collection, name, match=match())):
        await transport.claim_many(10, "A")

    when = failure.when
    leased = command not in ("select", "lease") or (command, when) == ("lease", "after")
    stamped = (command, when) == ("stamp", "after")
    if not leased:
        assert await snapshot(db) == before
    else:
        # A holds the groups without knowing it: nobody gets them until the lease ends.
        for group, doc in (await locks(db)).items():
            assert doc["token"].startswith("A:"), group
            assert doc["available_at"] == later(clock, VISIBILITY)
        for doc in (await messages(db)).values():
            first = doc["event"].endswith(".0")
            assert doc["deliveries"] == (1 if stamped and first else 0)
            assert (doc["token"] is not None) == (stamped and first)
        assert await transport.claim_many(10, "B") == []
        clock.advance(VISIBILITY - 0.001)
        assert await transport.claim_many(10, "B") == []

    delivered = await drain_the_rest(db, transport, clock)

    assert by_group(delivered) == published
    firsts = [lease.deliveries for lease in delivered if lease.event.endswith(".0")]
    assert firsts == [1 + stamped] * 3


@pytest.mark.parametrize("command", list(ACK_MANY))
async def test_an_ack_many_that_failed_on_any_command_is_recoverable(
    db: Any, transport: AsyncGroupTransport, failure: Failure, clock: ManualClock, command: str
) -> None:
    await transport.publish_many([NewMessage("g", "g0"), NewMessage("g", "g1")])
    await transport.publish("h", "h0")
    leases = await transport.claim_many(10, "A")
    assert sorted((x.event, x.was_last) for x in leases) == [("g0", False), ("h0", True)]
    before = await snapshot(db)
    clock.advance(1)

    with pytest.raises(failure.inject(*ACK_MANY[command])):
        await transport.ack_many(leases)

    when = failure.when
    removed = (command, when) != ("delete", "before")
    dropped = command == "release" or (command, when) == ("drop", "after")
    released = (command, when) == ("release", "after")
    if not removed:
        assert await snapshot(db) == before
    assert await group_messages(db) == (
        {"g": ["g1"]} if removed else {"g": ["g0", "g1"], "h": ["h0"]}
    )
    assert (await lock(db, "h") is None) == dropped
    if released:
        await assert_released(db, "g", clock.now())
    else:
        # Still A's until its lease ends; then a claim redelivers what is left.
        await assert_left_to(db, "g", leases[0])
        assert await transport.claim_many(10, "B") == []
        clock.advance(VISIBILITY)

    delivered = await drain_the_rest(db, transport, clock)

    events = [(x.event, x.deliveries) for x in sorted(delivered, key=lambda x: x.seq)]
    if removed:
        assert events == [("g1", 1)]
    else:
        assert events == [("g0", 2), ("g1", 1), ("h0", 2)]
    assert await dead(db) == {}


#: the commands of the burial claim_many runs for an over-limit head: mark it (fenced on the
#: token), copy it to the dead letters, delete it, then release the group
BURIAL = {
    "mark": ("mq_messages", "find_one_and_update"),
    "copy": ("mq_dead", "replace_one"),
    "delete": ("mq_messages", "delete_one"),
    "release": ("mq_locks", "update_one"),
}


def assert_logged_follow_up_failure(caplog: pytest.LogCaptureFixture, group: str) -> None:
    """claim_many logged that settling `group` failed (and raised nothing)."""
    failures = [
        record
        for record in caplog.records
        if record.name == "mongoq.groups"
        and record.levelno == logging.WARNING
        and record.getMessage() == f"claim_many: settling group {group!r} failed"
    ]
    assert len(failures) == 1, [record.getMessage() for record in caplog.records]
    assert failures[0].exc_info is not None


async def claim_h_past_a_failed_follow_up(
    db: Any,
    transport: AsyncGroupTransport,
    faults: FaultInjector,
    caplog: pytest.LogCaptureFixture,
    triggered: int,
) -> GroupLease:
    """A claim_many over g, whose follow-up write (a burial, a drop) is set to fail, and h (h0
    alone): `triggered` faults fired in all, the failure on g is logged and nothing raised, and
    h's lease comes back, held. That lease."""
    with caplog.at_level(logging.WARNING, logger="mongoq.groups"):
        leases = await transport.claim_many(10, "A")

    assert len(faults.triggered) == triggered
    assert_logged_follow_up_failure(caplog, "g")
    (h,) = leases
    assert (h.group_id, h.event, h.deliveries, h.was_last) == ("h", "h0", 1, True)
    await assert_holds(db, h)
    return h


async def interrupt_a_burial_after_its_mark(
    transport: AsyncGroupTransport, faults: FaultInjector
) -> None:
    """g gets g0 and g1; A leases g and dead-letters g0 ("bad g0"): the head is marked, then
    the copy to the dead letters fails."""
    await transport.publish_many([NewMessage("g", "g0"), NewMessage("g", "g1")])
    (lease,) = await transport.claim_many(10, "A")
    faults.fail_before("replace_one", collection="mq_dead")
    with pytest.raises(AutoReconnect):
        await transport.dead_letter(lease, "bad g0")


async def assert_batched_workers_finish_the_burial(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, event: str, error: str
) -> None:
    """Once g's lease has ended, batched workers alone (`drain_batched`) deliver g1 once and
    leave exactly one dead letter: g's first message (seq 1, `event`) with `error`."""
    clock.advance(VISIBILITY)
    delivered = await drain_the_rest(db, transport, clock)
    assert [(x.event, x.deliveries) for x in delivered] == [("g1", 1)]
    (letter,) = (await dead(db)).values()
    assert (letter["_id"], letter["event"], letter["error"]) == (1, event, error)


@pytest.mark.parametrize("command", list(BURIAL))
async def test_a_dead_lettering_by_claim_many_that_failed_on_any_command_is_recoverable(
    db: Any, failure: Failure, clock: ManualClock, command: str
) -> None:
    """Whichever command of the burial failed, claim_many logs it and still returns the other
    group's lease; the burial stops exactly there, the failed group stays leased until its
    lease ends (unless the release applied), and batched workers alone then finish it: the
    head ends in the dead letters exactly once and the group's next message is delivered."""
    transport = await new_transport(instrument(db, failure.faults), clock, max_deliveries=2)
    await deliver_twice_and_nack(transport, clock, "poison")
    failure.inject(*BURIAL[command])

    h = await claim_h_past_a_failed_follow_up(
        db, transport, failure.faults, failure.log, triggered=1
    )

    # The burial went exactly as far as the failed command (which applied, if "after").
    applied = list(BURIAL).index(command) + (failure.when == "after")
    head = await message(db, 1)
    if applied >= 3:  # deleted
        assert head is None
    else:
        assert head is not None and head["event"] == "poison"
        assert (head["dead"] is not None) == (applied >= 1)
    assert len(await dead(db)) == (1 if applied >= 2 else 0)
    if applied == 4:  # released
        await assert_released(db, "g", clock.now())
    else:  # left to its lease: nobody gets g until it ends
        await assert_left_to(db, "g", h)
    assert await transport.ack_many([h]) == [True]
    if applied < 4:
        assert await transport.claim_many(10, "B") == []

    await assert_batched_workers_finish_the_burial(db, transport, clock, "poison", "boom 2")


async def test_a_claim_many_whose_drop_of_an_empty_group_failed_returns_the_others(
    db: Any, transport: AsyncGroupTransport, failure: Failure, clock: ManualClock
) -> None:
    """g's lock outlived its last message (dead-lettered). The drop claim_many sends for it
    fails: logged, h's lease returned; g is gone if the drop applied, else leased until its
    lease ends and dropped by the claim after it."""
    await transport.publish("g", "g0")
    assert await transport.dead_letter(await claim_one(transport, "A", group="g"), "bad")
    await transport.publish("h", "h0")
    failure.inject("mq_locks", "delete_one")

    h = await claim_h_past_a_failed_follow_up(
        db, transport, failure.faults, failure.log, triggered=1
    )

    if failure.when == "after":
        assert await lock(db, "g") is None
    else:
        await assert_left_to(db, "g", h)
    assert await transport.ack_many([h]) == [True]
    assert await transport.claim_many(10, "B") == []
    clock.advance(VISIBILITY)

    assert await drain_the_rest(db, transport, clock) == []

    (letter,) = (await dead(db)).values()
    assert (letter["group_id"], letter["event"]) == ("g", "g0")


async def test_a_claim_many_whose_finishing_of_a_burial_failed_returns_the_others(
    db: Any,
    transport: AsyncGroupTransport,
    faults: FaultInjector,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A burial stopped after its mark; the claim_many that finds the marked head fails to
    copy it: logged, h's lease returned, g left to the lease; the next claim finishes the
    burial (one dead letter) and delivers g1."""
    await interrupt_a_burial_after_its_mark(transport, faults)
    await transport.publish("h", "h0")
    clock.advance(VISIBILITY + 0.001)
    faults.fail_before("replace_one", collection="mq_dead")

    h = await claim_h_past_a_failed_follow_up(db, transport, faults, caplog, triggered=2)

    marked = await message(db, 1)
    assert marked is not None and marked["dead"] is not None
    assert await dead(db) == {}
    await assert_left_to(db, "g", h)
    assert await transport.ack_many([h]) == [True]
    assert await transport.claim_many(10, "B") == []

    await assert_batched_workers_finish_the_burial(db, transport, clock, "g0", "bad g0")


async def test_a_burial_interrupted_after_the_mark_is_finished_by_claim_many(
    db: Any, transport: AsyncGroupTransport, faults: FaultInjector, clock: ManualClock
) -> None:
    """dead_letter marked the head, then its connection broke before the copy. Once the
    holder's lease ended, batched claimers alone (a `run` with `batch_size` > 1 claims only
    through `claim_many`) must finish the move, as a single `claim` does, and go on with the
    group's next message; otherwise the group is leased and released again forever and g1 is
    never delivered."""
    await interrupt_a_burial_after_its_mark(transport, faults)
    marked = await message(db, 1)
    assert marked is not None and marked["dead"] is not None
    assert await dead(db) == {}

    await assert_batched_workers_finish_the_burial(db, transport, clock, "g0", "bad g0")


# ------------------------------------------------------------------------- run(batch_size=N)


async def run_until_empty(
    transport: AsyncGroupTransport, handler: Any, **options: Any
) -> GroupRunSummary:
    options.setdefault("worker_id", "w")
    return await transport.run(handler, stop_when_empty=True, **options)


async def test_run_with_batches_processes_everything_in_fewer_commands(
    db: Any, clock: ManualClock
) -> None:
    counters = {"batched": CommandCounter(), "single": CommandCounter()}
    transports = {
        kind: await new_transport(instrument(db, counter), clock, prefix=kind)
        for kind, counter in counters.items()
    }
    groups = [f"g{i:02}" for i in range(12)]
    for transport in transports.values():
        published = await publish_groups(transport, groups, 2)
    handled: dict[str, list[GroupLease]] = defaultdict(list)

    def handler(kind: str) -> Callable[[GroupLease], Awaitable[None]]:
        async def handle(lease: GroupLease) -> None:
            handled[kind].append(lease)

        return handle

    for counter in counters.values():
        counter.reset()

    batched = await run_until_empty(transports["batched"], handler("batched"), batch_size=12)
    single = await run_until_empty(transports["single"], handler("single"))

    for kind, summary in (("batched", batched), ("single", single)):
        assert summary == GroupRunSummary(claimed=24, acked=24), kind
        assert by_group(handled[kind]) == published
        await assert_empty(db, kind)
    assert "batched_locks.find_one_and_update" not in counters["batched"].counts
    assert counters["batched"].total * 3 < counters["single"].total, (
        counters["batched"].counts,
        counters["single"].counts,
    )


async def test_run_with_batches_keeps_fifo_and_exclusivity_across_workers(
    db: Any, clock: ManualClock
) -> None:
    faults = FaultInjector(yield_between=True)
    transports = [await new_transport(instrument(db, faults), clock) for _ in range(3)]
    groups = [f"g{i:02}" for i in range(16)]
    published = await publish_groups(transports[0], groups, 4)
    flaky = frozenset(range(1, 65, 7))
    books = Bookkeeping(flaky)
    summaries: list[GroupRunSummary] = []

    async def worker(transport: AsyncGroupTransport, name: str) -> None:
        summaries.append(
            await transport.run(
                books.handler, worker_id=name, concurrency=2, batch_size=3, retry_delay=0,
                stop_when_empty=True,
            )
        )  # fmt: skip

    async with anyio.create_task_group() as group:
        for number, transport in enumerate(transports):
            group.start_soon(worker, transport, f"w{number}")
    clock.advance(0.001)
    await worker(transports[1], "late")  # whatever was released at the very end

    assert books.overlaps == []
    assert dict(books.processed) == published
    assert dict(books.runs) == {seq: 1 + (seq in flaky) for seq in range(1, 65)}
    assert sum(s.acked for s in summaries) == 64
    assert sum(s.retried for s in summaries) == len(flaky)
    assert sum(s.lost + s.dead + s.unknown for s in summaries) == 0
    await assert_empty(db)


async def test_run_with_batches_nacks_failures_and_dead_letters_permanent_errors_per_group(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await transport.publish_many(
        [
            NewMessage("g", "permanent"),
            NewMessage("g", "g-ok"),
            NewMessage("h", "flaky"),
            NewMessage("h", "h-ok"),
            NewMessage("k", "k0"),
        ]
    )
    handled: list[tuple[Any, int]] = []
    handler = failing_handler(handled)

    first = await run_until_empty(transport, handler, batch_size=10, retry_delay=5)

    assert sorted(handled) == [("flaky", 1), ("g-ok", 1), ("k0", 1), ("permanent", 1)]
    assert first == GroupRunSummary(claimed=4, acked=2, dead=1, retried=1)
    await assert_permanent_buried_and_flaky_parked(db, clock, retry_delay=5)

    clock.advance(5)
    second = await run_until_empty(transport, handler, batch_size=10, retry_delay=5)

    assert handled[4:] == [("flaky", 2), ("h-ok", 1)]
    assert second == GroupRunSummary(claimed=2, acked=2)
    await assert_empty(db)


def is_extend_many(op: Operation) -> bool:
    """The batch renewal's first command: the locks still held, extended."""
    update = op.args[1]
    return (
        op.collection.endswith("_locks")
        and op.name == "update_many"
        and set(update.get("$max", {})) == {"available_at"}  # not a release (no `$max`)
        and update.get("$set") == {"parked": False}
    )


def is_single_extend(op: Operation) -> bool:
    """`extend`'s lock update (a re-check before a head starts, or a one-lease renewal)."""
    update = op.args[1] if op.name == "update_one" else {}
    return (
        op.collection.endswith("_locks")
        and set(update.get("$max", {})) == {"available_at"}
        and update.get("$set") == {"parked": False}
    )


def is_restamp(op: Operation) -> bool:
    """The renewal's last command: the stamps of the heads whose locks are still held."""
    update = op.args[1] if op.name == "update_many" else {}
    return (
        op.collection.endswith("_messages")
        and set(update) == {"$max"}
        and set(update["$max"]) == {"stamp_until"}
    )


def is_park(op: Operation) -> bool:
    """`nack` with a delay: the lock parked."""
    update = op.args[1].get("$set", {}) if op.name == "update_one" else {}
    return op.collection.endswith("_locks") and update.get("parked") is True


class Completed:
    """A hook listing the commands that completed (applied or failed), in order."""

    def __init__(self) -> None:
        self.operations: list[Operation] = []

    async def before(self, op: Operation) -> None:
        return None

    async def after(self, op: Operation, error: BaseException | None) -> None:
        self.operations.append(op)


@dataclass
class StalledBatch:
    """Groups a, b and c (two messages each, their first served a second apart in that order),
    so that one batch of `run` claims their heads a.1, b.1 and c.1 in that order; a.1's
    handler stalls past the lease_ttl the claim granted while the batch's renewal
    (`extend_many`) is held back at `renewal`, and `rival`, another process, may take groups
    over meanwhile."""

    clock: ManualClock
    transport: AsyncGroupTransport
    rival: AsyncGroupTransport
    renewal: Pause
    #: every command the transport sent, and those that completed
    sent: CommandCounter
    completed: Completed
    #: the heads the batch's handler started, in order
    started: list[str] = field(default_factory=list)
    #: what `rival` took over
    taken: list[GroupLease] = field(default_factory=list)

    @classmethod
    async def set_up(
        cls, db: Any, clock: ManualClock, priorities: tuple[int, int, int]
    ) -> StalledBatch:
        faults = FaultInjector()
        sent = CommandCounter()
        sent.record = True
        completed = Completed()
        transport = await new_transport(instrument(db, faults, sent, completed), clock)
        renewal = faults.pause_before("update_many", collection="mq_locks", match=is_extend_many)
        await transport.publish_many(
            NewMessage(group, f"{group}.{n}", priority=priority)
            for n in range(2)
            for group, priority in zip("abc", priorities, strict=True)
        )
        first = {lease.group_id: lease for lease in await transport.claim_many(3, "setup")}
        for group in "abc":
            clock.advance(1)
            assert await transport.ack_many([first[group]]) == [True]
        clock.advance(1)
        rival = await new_transport(db, clock)
        return cls(clock, transport, rival, renewal, sent, completed)

    async def let_the_renewal_run(self) -> None:
        self.renewal.release()
        await wait_for(
            lambda: any(is_restamp(op) for op in self.completed.operations), "the renewal to end"
        )

    async def run(
        self, caplog: pytest.LogCaptureFixture, stalled: Callable[[], Awaitable[None]]
    ) -> GroupRunSummary:
        """Run the batch; in a.1's handler, once past the lease_ttl with the renewal due (and
        held back), call `stalled`. Nothing may be logged as an error."""

        async def handler(lease: GroupLease) -> None:
            self.started.append(lease.event)
            if lease.group_id == "a":
                self.clock.advance(VISIBILITY + 1)
                await wait_for(self.renewal.reached.is_set, "the renewal to be due (held back)")
                await stalled()

        with caplog.at_level(logging.WARNING):
            summary = await run_until_empty(self.transport, handler, batch_size=3)
        assert not unexpected_errors(caplog)
        return summary


@pytest.mark.parametrize("taken_over", [False, True], ids=["still-held", "taken-over"])
async def test_a_batch_past_its_last_renewal_rechecks_each_lease_before_starting_its_head(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, taken_over: bool
) -> None:
    """Before each later head starts, one `extend` re-checks its group (the renewal is held
    back): still held (nobody took it), the head runs; taken over, it never starts under the
    lost lease and counts as lost, and the new holder's lease is untouched."""
    batch = await StalledBatch.set_up(db, clock, (0, 0, 0))

    async def take_over() -> None:
        if taken_over:
            batch.taken.extend(await batch.rival.claim_many(3, "B"))

    summary = await batch.run(caplog, take_over)

    rechecks = [op.filter["_id"] for op in batch.sent.operations if is_single_extend(op)]
    assert rechecks == ["b", "c"]  # one extend each, before its head would start
    if not taken_over:
        assert batch.started == ["a.1", "b.1", "c.1"]
        assert summary == GroupRunSummary(claimed=3, acked=3)
        await assert_empty(db)
        return
    assert batch.started == ["a.1"]  # never b.1 or c.1 under a lost lease
    assert summary == GroupRunSummary(claimed=3, lost=3)
    assert sorted(lease.event for lease in batch.taken) == ["a.1", "b.1", "c.1"]
    for lease in batch.taken:
        assert lease.deliveries == 2
        await assert_holds(db, lease)


@pytest.mark.parametrize("outcome", ["returns", "raises"])
@pytest.mark.parametrize("seen_by", ["the settle", "a renewal"])
async def test_run_with_batches_reports_a_group_lost_mid_batch(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, seen_by: str, outcome: str
) -> None:
    """B takes a over while a's handler stalls. Whether the loss is found by a's settle (the
    fenced ack or nack refused: the renewal held back) or by the renewal (`extend_many`)
    while a's handler still runs, a counts as lost once, nothing escapes the batch, b and c
    still run and are acked, and B keeps a's head, on which nothing was written."""
    batch = await StalledBatch.set_up(db, clock, (1, 0, 0))

    async def take_over_a() -> None:
        batch.taken.extend(await batch.rival.claim_many(10, "B", min_priority=1))
        if seen_by == "a renewal":
            await batch.let_the_renewal_run()
        if outcome == "raises":
            raise RuntimeError("a failed")

    summary = await batch.run(caplog, take_over_a)

    assert batch.started == ["a.1", "b.1", "c.1"]
    assert summary == GroupRunSummary(claimed=3, acked=2, lost=1)
    (stolen,) = batch.taken
    assert (stolen.group_id, stolen.deliveries) == ("a", 2)
    await assert_holds(db, stolen)
    head = await message(db, stolen.seq)
    assert head is not None and head.get("last_error") is None  # the lost nack wrote nothing
    assert await group_messages(db) == {"a": ["a.1"]}


async def test_a_failure_settle_that_raised_a_driver_error_counts_unknown_and_the_batch_goes_on(
    db: Any, transport: AsyncGroupTransport, failure: Failure, clock: ManualClock
) -> None:
    """a's handler fails and its nack raises a driver error (applied or not): counted
    unknown, logged, and b and c still run and are acked. a's head is delivered again once
    its lease ends."""
    await transport.publish_many([NewMessage(group, f"{group}0") for group in "abc"])
    failure.inject("mq_locks", "update_one", match=is_park)
    leases: dict[Any, GroupLease] = {}

    async def handler(lease: GroupLease) -> None:
        leases[lease.group_id] = lease
        if lease.group_id == "a":
            raise RuntimeError("a failed")

    summary = await run_until_empty(transport, handler, batch_size=3, retry_delay=5)

    assert len(failure.faults.triggered) == 1
    assert summary == GroupRunSummary(claimed=3, acked=2, unknown=1)
    logged = [record.getMessage() for record in failure.log.records]
    assert "settling group 'a' failed; its lease will expire" in logged
    assert not unexpected_errors(failure.log)
    assert await group_messages(db) == {"a": ["a0"]}
    a = await lock(db, "a")
    assert a is not None and a["token"] == leases["a"].token
    if failure.when == "before":  # untouched: held until the lease ends
        assert (a["available_at"], a["parked"]) == (leases["a"].lease_until, False)
    else:  # parked; the head's error was never written
        assert (a["available_at"], a["parked"]) == (later(clock, 5), True)
    head = await message(db, leases["a"].seq)
    assert head is not None and head.get("last_error") is None
    assert await transport.claim_many(10, "B") == []
    clock.advance(VISIBILITY)

    delivered = await drain_the_rest(db, transport, clock)

    assert [(x.event, x.deliveries) for x in delivered] == [("a0", 2)]


@contextmanager
def sigterm_left_to_run() -> Iterator[None]:
    """SIGTERM does nothing of its own meanwhile (never the default: exit), only what a `run`
    with `handle_signals` makes of it."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_a_hard_stopped_batch_acks_the_finished_and_gives_back_the_unstarted_as_released(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A second SIGTERM cancels the in-flight batch of a, b, c and d (two messages each) while
    its second head runs, and `run` returns its summary: the head handled is acked; the one
    cut short is nacked with the retry delay (parked, a delivery, "worker stopped"); the two
    never handed to the handler are given back at once, their heads untouched and their
    deliveries not counted, and counted `released`, not `retried`."""
    await publish_groups(transport, ["a", "b", "c", "d"], 2)
    started: list[GroupLease] = []
    summaries: list[GroupRunSummary] = []

    async def handler(lease: GroupLease) -> None:
        started.append(lease)
        if len(started) == 2:
            await anyio.sleep_forever()

    async def worker() -> None:
        summaries.append(
            await transport.run(handler, batch_size=4, retry_delay=10, handle_signals=True)
        )

    async def stop_twice() -> None:
        await wait_for(lambda: len(started) == 2, "the batch to reach its second head")
        os.kill(os.getpid(), signal.SIGTERM)  # graceful: the batch goes on
        await wait_for(
            lambda: any("stopping after" in r.getMessage() for r in caplog.records),
            "the first signal",
        )
        assert len(started) == 2
        os.kill(os.getpid(), signal.SIGTERM)  # hard: the batch is cancelled

    with sigterm_left_to_run(), caplog.at_level(logging.INFO, logger="mongoq.worker"):
        async with anyio.create_task_group() as group:
            group.start_soon(worker)
            await stop_twice()

    (summary,) = summaries
    assert summary == GroupRunSummary(claimed=4, acked=1, retried=1, released=2)
    done, cut = started
    assert (await group_messages(db))[done.group_id] == [f"{done.group_id}.1"]
    parked = await lock(db, cut.group_id)
    assert parked is not None
    assert (parked["token"], parked["available_at"], parked["parked"]) == (
        cut.token,
        later(clock, 10),
        True,
    )
    cut_head = await message(db, cut.seq)
    assert cut_head is not None
    assert (cut_head["deliveries"], cut_head.get("last_error")) == (1, WORKER_STOPPED)
    for unstarted in sorted(set("abcd") - {done.group_id, cut.group_id}):
        await assert_released(db, unstarted, clock.now())
        head = await message(db, "abcd".index(unstarted) + 1)
        assert head is not None and head["token"] is None
        assert head["deliveries"] == 0, f"{unstarted}'s head never reached the handler"


# ------------------------------------------------- what claim_many reads before its lease


class Before:
    """A hook running `action` once, just before the first `name` command on `collection`."""

    def __init__(self, collection: str, name: str, action: Callable[[], Awaitable[None]]) -> None:
        self.collection, self.name, self.action = collection, name, action
        self.done = False

    async def before(self, op: Operation) -> None:
        if not self.done and (op.collection, op.name) == (self.collection, self.name):
            self.done = True
            await self.action()

    async def after(self, op: Operation, error: BaseException | None) -> None:
        return None


async def leave_g_empty(transport: AsyncGroupTransport) -> None:
    """g's lock left behind by its only message, dead-lettered (version 1, no message)."""
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "X", group="g")
    assert await transport.dead_letter(lease, "bad")


async def test_a_claim_many_beaten_to_a_candidate_never_drops_a_group_published_to_since(
    db: Any, clock: ManualClock
) -> None:
    """A reads g (empty) and h; before A's lease, B claims h and g1 is published: A's lease
    takes only g and reads it back at the new version. Fenced on the lock as read with the
    empty head, A's drop fails: g keeps its lock, and g1 is delivered."""
    other = await new_transport(db, clock)
    await leave_g_empty(other)
    clock.advance(1)
    await other.publish("h", "h0")

    async def meanwhile() -> None:
        assert (await claim_one(other, "B", group="h")).event == "h0"
        await other.publish("g", "g1")

    hook = Before("mq_locks", "update_many", meanwhile)
    a = AsyncGroupTransport(instrument(db, hook), PREFIX, lease_ttl=VISIBILITY, clock=clock)
    assert await a.claim_many(2, "A") == []
    assert hook.done
    stored = await lock(db, "g")
    assert stored is not None, "g1 is stranded: its group has no lock"
    assert (stored["token"], stored["available_at"]) == (None, clock.now())  # released
    assert [lease.event for lease in await a.claim_many(2, "A")] == ["g1"]


async def test_a_claim_many_never_drops_a_group_dropped_and_made_again_since_its_read(
    db: Any, clock: ManualClock
) -> None:
    """A reads g (empty, version 1); before A's lease, C drops g and g1 makes it again, at
    version 1 again. A's lease takes the new lock; its drop, fenced on the last seq as well,
    fails: g1 keeps its group."""
    other = await new_transport(db, clock)
    await leave_g_empty(other)
    clock.advance(1)

    async def meanwhile() -> None:
        assert await other.claim("C") is None  # finds g empty and drops it
        assert await lock(db, "g") is None
        await other.publish("g", "g1")

    hook = Before("mq_locks", "update_many", meanwhile)
    a = AsyncGroupTransport(instrument(db, hook), PREFIX, lease_ttl=VISIBILITY, clock=clock)
    assert await a.claim_many(1, "A") == []
    assert hook.done
    stored = await lock(db, "g")
    assert stored is not None, "g1 is stranded: its group has no lock"
    assert stored["version"] == 1 and stored["token"] is None
    assert [lease.event for lease in await a.claim_many(1, "A")] == ["g1"]


async def test_a_head_given_back_after_claim_many_read_it_is_not_counted_twice(
    db: Any, clock: ManualClock
) -> None:
    """T0's lease on g expired; between A's read and A's lease, T0 gives g0 back (its
    delivery taken back). A's stamp takes heads only as read: g0 is not stamped on the stale
    count (which would have buried it with max_deliveries=1), and the next claim gets it,
    delivered once."""
    other = await new_transport(db, clock, max_deliveries=1)
    await other.publish("g", "g0")
    (t0,) = await other.claim_many(1, "T0")
    clock.advance(VISIBILITY + 1)

    async def meanwhile() -> None:
        assert await other._unclaim(t0)

    hook = Before("mq_locks", "update_many", meanwhile)
    a = AsyncGroupTransport(
        instrument(db, hook), PREFIX, lease_ttl=VISIBILITY, clock=clock, max_deliveries=1
    )
    assert await a.claim_many(1, "A") == []
    assert hook.done
    assert await dead(db) == {}
    assert (await message(db, t0.seq) or {}).get("deliveries") == 0
    (lease,) = await a.claim_many(1, "A")
    assert (lease.event, lease.deliveries) == ("g0", 1)
