"""Helpers shared by the group-transport tests.

Backend-neutral like `tests.support.helpers`: reads go straight to the collections
(``{prefix}_messages``, ``{prefix}_locks``, ``{prefix}_counters``, ``{prefix}_dead``), so the
assertions see what is stored, with every datetime made UTC-aware.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import anyio.lowlevel
import bson

from mongoq import AsyncGroupTransport, GroupLease, NewMessage, PermanentError
from mongoq.testing import CommandCounter, ManualClock, instrument, settle
from tests.support.helpers import Actors, Trace, every_order, indexed, later, utc

#: The lease_ttl of the tests' transports: a lease lasts 30 s, run() renews it every 10 s.
VISIBILITY = 30.0
PREFIX = "mq"
#: `available_at` of a group nobody has claimed yet.
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
KINDS = ("messages", "locks", "counters", "dead")


async def new_transport(
    db: Any, clock: ManualClock, prefix: str = PREFIX, **options: Any
) -> AsyncGroupTransport:
    """A transport driven by the test's clock, with the tests' lease_ttl, and its indexes."""
    return await indexed(
        AsyncGroupTransport, db, prefix, clock, **{"lease_ttl": VISIBILITY, **options}
    )


async def counted_transport(
    db: Any, clock: ManualClock, *, record: bool = False, **options: Any
) -> tuple[AsyncGroupTransport, CommandCounter]:
    """`new_transport` whose commands a `CommandCounter` counts (and, with `record`, keeps),
    from after the index set-up."""
    counter = CommandCounter()
    counter.record = record
    transport = await new_transport(instrument(db, counter), clock, **options)
    counter.reset()
    return transport, counter


async def docs(db: Any, kind: str, prefix: str = PREFIX) -> dict[Any, dict[str, Any]]:
    """Every document of ``{prefix}_{kind}``, by id."""
    found = await db[f"{prefix}_{kind}"].find({}).to_list(None)
    return {doc["_id"]: utc(dict(doc)) for doc in found}


async def messages(db: Any, prefix: str = PREFIX) -> dict[Any, dict[str, Any]]:
    return await docs(db, "messages", prefix)


async def locks(db: Any, prefix: str = PREFIX) -> dict[Any, dict[str, Any]]:
    return await docs(db, "locks", prefix)


async def dead(db: Any, prefix: str = PREFIX) -> dict[Any, dict[str, Any]]:
    return await docs(db, "dead", prefix)


async def lock(db: Any, group_id: Any, prefix: str = PREFIX) -> dict[str, Any] | None:
    doc = await db[f"{prefix}_locks"].find_one({"_id": group_id})
    return None if doc is None else utc(dict(doc))


def assert_fields(
    doc: dict[str, Any] | None, what: str, expected: dict[str, Any]
) -> dict[str, Any]:
    """`doc` exists and holds the `expected` value in each of those fields; `doc`."""
    assert doc is not None, f"no {what}"
    found = {field: doc[field] for field in expected}
    assert found == expected, f"{what}: {doc}"
    return doc


async def assert_lock(
    db: Any, group_id: Any, prefix: str = PREFIX, **fields: Any
) -> dict[str, Any]:
    """The group's lock is there with these `fields`; the lock, for further checks."""
    return assert_fields(await lock(db, group_id, prefix), f"lock of {group_id!r}", fields)


async def assert_released(
    db: Any, group_id: Any, at: datetime, prefix: str = PREFIX
) -> dict[str, Any]:
    """The group's lock is there, held by nobody, claimable from `at` (a released group); the
    lock, for further checks."""
    return await assert_lock(db, group_id, prefix, available_at=at, token=None)


async def message(db: Any, seq: int, prefix: str = PREFIX) -> dict[str, Any] | None:
    doc = await db[f"{prefix}_messages"].find_one({"_id": seq})
    return None if doc is None else utc(dict(doc))


async def assert_message(db: Any, seq: int, prefix: str = PREFIX, **fields: Any) -> dict[str, Any]:
    """Message `seq` is stored with these `fields`; the message, for further checks."""
    return assert_fields(await message(db, seq, prefix), f"message {seq}", fields)


async def counter_value(db: Any, prefix: str = PREFIX) -> int | None:
    doc = await db[f"{prefix}_counters"].find_one({"_id": "seq"})
    return None if doc is None else int(doc["value"])


async def snapshot(db: Any, prefix: str = PREFIX) -> dict[str, dict[Any, bytes]]:
    """The BSON bytes of every document of the four collections: equal snapshots mean nothing
    was written (same fields, values and field order)."""
    return {
        kind: {key: bson.encode(doc) for key, doc in (await docs(db, kind, prefix)).items()}
        for kind in KINDS
    }


@asynccontextmanager
async def unchanged(db: Any, prefix: str = PREFIX) -> AsyncIterator[None]:
    """The block must write nothing: the `snapshot` after it equals the one before."""
    before = await snapshot(db, prefix)
    yield
    assert await snapshot(db, prefix) == before, "the block changed what is stored"


async def group_messages(db: Any, prefix: str = PREFIX) -> dict[Any, list[Any]]:
    """The stored events of each group, in seq (FIFO) order."""
    by_group: dict[Any, list[Any]] = defaultdict(list)
    for _, doc in sorted((await messages(db, prefix)).items()):
        by_group[doc["group_id"]].append(doc["event"])
    return dict(by_group)


async def publish_each(
    transport: AsyncGroupTransport, group_id: Any, *events: Any, priority: int = 0
) -> list[int]:
    """Publish `events` to `group_id` one `publish` after the other; their seqs."""
    return [await transport.publish(group_id, event, priority=priority) for event in events]


async def claim_one(
    transport: AsyncGroupTransport,
    worker: str = "w",
    *,
    group: Any = None,
    event: Any = None,
    min_priority: int = 0,
) -> GroupLease:
    """Claim a group that must be claimable (and be `group` / carry `event`, when given)."""
    lease = await transport.claim(worker, min_priority=min_priority)
    assert lease is not None, "nothing was claimable"
    if group is not None:
        assert lease.group_id == group, f"claimed {lease.group_id!r}, expected {group!r}"
    if event is not None:
        assert lease.event == event, f"got {lease.event!r}, expected {event!r}"
    return lease


async def claim_and_ack(
    transport: AsyncGroupTransport, worker: str = "w", *, group: Any = None, event: Any = None
) -> GroupLease:
    """`claim_one`, then ack the lease at once (it must still be held)."""
    lease = await claim_one(transport, worker, group=group, event=event)
    assert await transport.ack(lease), f"{worker} lost {lease.group_id!r} before its ack"
    return lease


async def drain(
    transport: AsyncGroupTransport, clock: ManualClock, worker: str = "rescuer"
) -> list[GroupLease]:
    """Claim and ack until nothing is claimable, a millisecond apart; the leases, in order."""
    delivered: list[GroupLease] = []
    for _ in range(10_000):
        lease = await transport.claim(worker)
        if lease is None:
            return delivered
        delivered.append(lease)
        clock.advance(0.001)
        assert await transport.ack(lease)
        clock.advance(0.001)
    raise AssertionError("drain did not end")


def by_group(leases: list[GroupLease]) -> dict[Any, list[Any]]:
    """The events delivered to each group, in delivery order."""
    found: dict[Any, list[Any]] = defaultdict(list)
    for lease in leases:
        found[lease.group_id].append(lease.event)
    return dict(found)


def first_occurrences(events: list[Any]) -> list[Any]:
    """`events` without the repeats (an at-least-once delivery may repeat an event)."""
    seen: list[Any] = []
    for event in events:
        if event not in seen:
            seen.append(event)
    return seen


async def assert_empty(db: Any, prefix: str = PREFIX) -> None:
    """No message waits and no group is left (every drained group's lock was dropped)."""
    assert await messages(db, prefix) == {}
    assert await locks(db, prefix) == {}


class Bookkeeping:
    """A handler that notices two runs on one group overlapping (exclusivity), records what each
    group processed in order (FIFO), and fails the first delivery of the `flaky` seqs."""

    def __init__(self, flaky: frozenset[int] = frozenset(), yields: int = 3) -> None:
        self.flaky = flaky
        self.yields = yields
        self.in_flight: set[Any] = set()
        self.overlaps: list[Any] = []
        self.processed: dict[Any, list[Any]] = defaultdict(list)
        self.runs: dict[int, int] = defaultdict(int)

    async def handler(self, lease: GroupLease) -> None:
        if lease.group_id in self.in_flight:
            self.overlaps.append(lease.group_id)
        self.in_flight.add(lease.group_id)
        try:
            for _ in range(self.yields):
                await anyio.lowlevel.checkpoint()  # let the other workers interleave
            self.runs[lease.seq] += 1
            if lease.seq in self.flaky and lease.deliveries == 1:
                raise RuntimeError(f"transient failure of {lease.seq}")
            self.processed[lease.group_id].append(lease.event)
        finally:
            self.in_flight.discard(lease.group_id)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, rounds: int = 10_000) -> None:
    """Let other tasks run until the async `check()` holds (event-loop turns only, no clock
    time): on the embedded backend the first `settle()` is enough; a real server needs I/O."""
    for _ in range(rounds):
        await settle()
        if await check():
            return
    raise AssertionError(f"timed out waiting for {what}")


async def race(
    db: Any,
    clock: ManualClock,
    counts: dict[str, int],
    setup: Callable[[AsyncGroupTransport], Awaitable[Actors]],
    check: Callable[[AsyncGroupTransport, dict[str, Any], Trace], Awaitable[str]],
) -> Counter[str]:
    """`every_order` on a transport with fresh collections (prefix ``race{n}``) per order."""

    async def fresh(db: Any, prefix: str) -> AsyncGroupTransport:
        return await new_transport(db, clock, prefix=prefix)

    return await every_order(db, counts, fresh, setup, check)


def assert_outcomes(seen: Counter[str], orders: int, outcomes: set[str]) -> None:
    """A race ran all its `orders` orders and they ended in exactly these `outcomes`."""
    assert sum(seen.values()) == orders, seen
    assert set(seen) == outcomes, seen


#: How the ack of a group's last message ends while a publish to the group races it: its
#: check saw the new message (it releases), or it dropped the lock (the publish's ready makes a
#: new one), or the ready moved the version first, so the drop matched nothing (it releases).
SEEN_BY_THE_CHECK = "seen by the check, released"
RECREATED = "dropped, re-created by the publish"
DROP_REFUSED = "drop refused, released"


#: The two ways to publish g1 to group "g" (the actor of a race).
PUBLISHES: dict[str, Callable[[AsyncGroupTransport], Awaitable[Any]]] = {
    "publish": lambda transport: transport.publish("g", "g1"),
    "publish_many": lambda transport: transport.publish_many([NewMessage("g", "g1")]),
}


def failing_handler(handled: list[tuple[Any, int]]) -> Callable[[GroupLease], Awaitable[None]]:
    """A handler that records each (event, deliveries) in `handled`, fails "permanent" for good
    (PermanentError) and "flaky" on its first delivery, and handles every other event."""

    async def handler(lease: GroupLease) -> None:
        handled.append((lease.event, lease.deliveries))
        if lease.event == "permanent":
            raise PermanentError("cannot ever work")
        if lease.event == "flaky" and lease.deliveries == 1:
            raise RuntimeError("try later")

    return handler


async def assert_permanent_buried_and_flaky_parked(
    db: Any, clock: ManualClock, retry_delay: float
) -> None:
    """After a run of `failing_handler` over g = ["permanent", "g-ok"] and h = ["flaky" (seq 3),
    "h-ok"]: "permanent" is dead-lettered with its error, and h is parked for `retry_delay`
    with both its messages left and the error recorded on its head."""
    (buried,) = (await dead(db)).values()
    assert buried["event"] == "permanent"
    assert buried["error"].endswith("PermanentError: cannot ever work")
    assert await group_messages(db) == {"h": ["flaky", "h-ok"]}
    parked = await lock(db, "h")
    assert parked is not None
    assert (parked["available_at"], parked["parked"]) == (later(clock, retry_delay), True)
    assert (await message(db, 3) or {})["last_error"].endswith("RuntimeError: try later")
