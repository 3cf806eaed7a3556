"""AsyncGroupTransport under forced interleavings of its commands.

Each server command is atomic, so these tests run EVERY order of the commands of two or three
actors (`Interleaving` + `all_interleavings`), each on fresh collections, and check the stored
state afterwards: a published message is never stranded (its group has a lock, so a later claim
delivers it), a group has one holder at a time, and a group's messages come in publish order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from mongoq import AsyncGroupTransport, GroupLease, GroupRunSummary, NewMessage
from mongoq.testing import FaultInjector, Interleaving, ManualClock, all_interleavings, instrument
from tests.group_helpers import (
    VISIBILITY,
    Bookkeeping,
    assert_empty,
    claim_one,
    drain,
    group_messages,
    lock,
    locks,
    message,
    messages,
    new_transport,
    snapshot,
)

Actors = dict[str, Callable[[], Awaitable[Any]]]
Trace = list[tuple[str, str, str]]


async def race(
    db: Any,
    clock: ManualClock,
    counts: dict[str, int],
    setup: Callable[[AsyncGroupTransport], Awaitable[Actors]],
    check: Callable[[AsyncGroupTransport, dict[str, Any], Trace], Awaitable[str]],
) -> Counter[str]:
    """For every interleaving of `counts`, on fresh collections (prefix ``race{n}``): `setup`
    the transport (its commands run freely) and get the actors, run them in that order, then
    `check(transport, results, trace)`, which asserts and names the outcome. An actor with
    fewer commands than its turns has them skipped; commands beyond its turns run freely once
    the order is used up. Returns the outcomes seen: a race whose orders all end the same way
    did not test much."""
    outcomes: Counter[str] = Counter()
    for number, order in enumerate(all_interleavings(counts)):
        interleaving = Interleaving(order)
        transport = await new_transport(instrument(db, interleaving), clock, prefix=f"race{number}")
        actors = await setup(transport)
        results = await interleaving.run(actors)
        label = "".join(order)
        errors = {actor: r for actor, r in results.items() if isinstance(r, BaseException)}
        assert not errors, f"order {label}: {errors}"
        assert interleaving.trace[0][0] == order[0], f"order {label}: {interleaving.trace}"
        try:
            outcomes[await check(transport, results, interleaving.trace)] += 1
        except AssertionError as failure:
            raise AssertionError(f"order {label}: {failure}\n{interleaving.trace}") from failure
    return outcomes


def commands_of(trace: Trace, actor: str) -> list[str]:
    return [
        f"{collection.split('_', 1)[1]}.{name}" for who, collection, name in trace if who == actor
    ]


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


async def test_a_publish_racing_the_ack_that_drains_its_group_is_never_stranded(
    db: Any, clock: ManualClock
) -> None:
    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        lease = await claim_one(transport, "A", group="g")
        return {"A": lambda: transport.ack(lease), "P": lambda: transport.publish("g", "g1")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results == {"A": True, "P": 2}
        assert await group_messages(db, transport.prefix) == {"g": ["g1"]}
        stored = await lock(db, "g", transport.prefix)
        assert stored is not None and stored["token"] is None  # claimable now
        assert stored["available_at"] <= clock.now()
        await deliver_the_rest(db, transport, clock, ["g1"])
        release = trace.index(("A", f"{transport.prefix}_locks", "update_one"))
        ready = trace.index(("P", f"{transport.prefix}_locks", "update_one"))
        return "released before the publish readied" if release < ready else "readied first"

    outcomes = await race(db, clock, {"A": 2, "P": 3}, setup, check)
    assert outcomes == {"released before the publish readied": 6, "readied first": 4}


async def test_a_publish_racing_the_claim_that_finds_its_group_empty_is_never_stranded(
    db: Any, clock: ManualClock
) -> None:
    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        lease = await claim_one(transport, "A", group="g")
        assert await transport.ack(lease)  # "g" is empty; its lock stays until a claim drops it
        return {"C": lambda: transport.claim("C"), "P": lambda: transport.publish("g", "g1")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results["P"] == 2
        claimed: GroupLease | None = results["C"]
        path = commands_of(trace, "C")
        if claimed is None:
            # C dropped the empty group before the publish readied it again.
            assert path == ["locks.find_one_and_update", "messages.find_one_and_update",
                            "locks.delete_one", "locks.find_one_and_update"]  # fmt: skip
            stored = await lock(db, "g", transport.prefix)
            assert stored is not None and stored["token"] is None
            assert stored["available_at"] <= clock.now()
            await deliver_the_rest(db, transport, clock, ["g1"])
            return "dropped, then readied by the publish"
        assert (claimed.group_id, claimed.event, claimed.deliveries) == ("g", "g1", 1)
        stored = await lock(db, "g", transport.prefix)
        assert stored is not None and stored["token"] == claimed.token
        assert (await message(db, 2, transport.prefix) or {})["token"] == claimed.token
        assert await transport.ack(claimed)
        await deliver_the_rest(db, transport, clock, [])
        if "locks.update_one" in path:
            return "drop refused (version moved), released, claimed again"
        if "locks.delete_one" in path:
            return "dropped, re-created by the publish, claimed again"
        return "claimed at once"

    outcomes = await race(db, clock, {"C": 4, "P": 3}, setup, check)
    assert sum(outcomes.values()) == 35
    assert set(outcomes) == {
        "dropped, then readied by the publish",
        "drop refused (version moved), released, claimed again",
        "dropped, re-created by the publish, claimed again",
        "claimed at once",
    }


async def test_a_publish_racing_an_ack_and_the_next_claim_is_never_stranded(
    db: Any, clock: ManualClock
) -> None:
    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        lease = await claim_one(transport, "A", group="g")

        async def ack_then_claim() -> GroupLease | None:
            assert await transport.ack(lease)
            return await transport.claim("A")

        return {"A": ack_then_claim, "P": lambda: transport.publish("g", "g1")}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results["P"] == 2
        claimed: GroupLease | None = results["A"]
        if claimed is None:
            await deliver_the_rest(db, transport, clock, ["g1"])
            return "A found it empty"
        assert (claimed.event, claimed.seq, claimed.deliveries) == ("g1", 2, 1)
        assert (await lock(db, "g", transport.prefix) or {})["token"] == claimed.token
        assert await transport.ack(claimed)
        await deliver_the_rest(db, transport, clock, [])
        return "A got it"

    outcomes = await race(db, clock, {"A": 6, "P": 3}, setup, check)
    assert sum(outcomes.values()) == 84
    assert set(outcomes) == {"A found it empty", "A got it"}


async def test_a_publish_many_racing_the_claim_that_drains_is_never_stranded(
    db: Any, clock: ManualClock
) -> None:
    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        lease = await claim_one(transport, "A", group="g")

        async def ack_then_claim() -> GroupLease | None:
            assert await transport.ack(lease)
            return await transport.claim("A")

        async def publish() -> list[int]:
            return await transport.publish_many([NewMessage("g", "g1"), NewMessage("g", "g2")])

        return {"A": ack_then_claim, "P": publish}

    async def check(transport: AsyncGroupTransport, results: dict[str, Any], trace: Trace) -> str:
        assert results["P"] == [2, 3]
        claimed: GroupLease | None = results["A"]
        if claimed is None:
            await deliver_the_rest(db, transport, clock, ["g1", "g2"])
            return "A found it empty"
        assert claimed.event == "g1"
        assert await transport.ack(claimed)
        await deliver_the_rest(db, transport, clock, ["g2"])
        return "A got it"

    outcomes = await race(db, clock, {"A": 6, "P": 3}, setup, check)
    assert sum(outcomes.values()) == 84
    assert set(outcomes) == {"A found it empty", "A got it"}


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
            stored = await lock(db, lease.group_id, transport.prefix)
            assert stored is not None and stored["token"] == lease.token
            head = await message(db, lease.seq, transport.prefix)
            assert head is not None and (head["token"], head["deliveries"]) == (lease.token, 1)
        (empty_handed,) = set(results) - set(leases)
        return f"{empty_handed} got nothing"

    outcomes = await race(db, clock, {"A": 2, "B": 2, "C": 2}, setup, check)
    assert sum(outcomes.values()) == 90
    assert set(outcomes) == {"A got nothing", "B got nothing", "C got nothing"}


async def test_two_workers_on_one_group_hold_it_one_after_the_other_in_fifo_order(
    db: Any, clock: ManualClock
) -> None:
    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        await transport.publish("g", "g1")

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

    outcomes = await race(db, clock, {"A": 4, "B": 4}, setup, check)
    assert sum(outcomes.values()) == 70
    assert set(outcomes) == {"1 holder(s)", "2 holder(s)"}


STALE_SETTLES: dict[str, Callable[[AsyncGroupTransport, GroupLease], Awaitable[bool]]] = {
    "ack": lambda transport, lease: transport.ack(lease),
    "nack-error": lambda transport, lease: transport.nack(lease, error="late failure"),
    "dead_letter": lambda transport, lease: transport.dead_letter(lease, "late failure"),
    "extend": lambda transport, lease: transport.extend(lease),
}


@pytest.mark.parametrize("call", list(STALE_SETTLES))
async def test_an_expired_holder_racing_the_takeover_leaves_one_owner_of_the_head(
    db: Any, clock: ManualClock, call: str
) -> None:
    """A's lease has expired and B takes the group over while A settles late. Either A's
    settle took effect (True, and B gets the next message) or it changed nothing (False, and B
    has the head) - never both, never a change reported as False."""

    async def setup(transport: AsyncGroupTransport) -> Actors:
        await transport.publish("g", "g0")
        await transport.publish("g", "g1")
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
        if taken is None:  # only a renewal before the claim keeps B out
            assert settled and call == "extend"
            assert (await lock(db, "g", transport.prefix) or {})["token"].startswith("A:")
            return "A renewed first and kept it"
        if settled and call in ("ack", "dead_letter"):
            assert head is None
            assert (taken.event, taken.deliveries) == ("g1", 1)
            return "A settled first"
        if settled:  # nack(0) released the group first: B takes the same head
            assert call == "nack-error"
            assert (taken.event, taken.deliveries) == ("g0", 2)
            return "A released first"
        assert (taken.event, taken.deliveries) == ("g0", 2)
        assert head is not None
        assert (head["token"], head["last_error"]) == (taken.token, None)
        assert (await lock(db, "g", transport.prefix) or {})["token"] == taken.token
        assert await transport.dead_letters() == []
        return "A refused"

    outcomes = await race(db, clock, {"A": 4, "B": 2}, setup, check)
    assert sum(outcomes.values()) == 15
    assert "A refused" in outcomes


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
    assert (await snapshot(db))["dead"] == {}
    assert await messages(db) == {}
