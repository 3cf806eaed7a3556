"""AsyncGroupTransport: publish, claim, ack/nack/extend, round-robin, priority floor, stats.

Every test reads the stored documents (`tests.support.group_helpers`) besides the return values.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
import pytest

from mongoq import AsyncGroupTransport, GroupRunSummary, GroupStats, InvalidInput, NewMessage
from mongoq.testing import FaultInjector, ManualClock, instrument
from tests.support.group_helpers import (
    EPOCH,
    PREFIX,
    VISIBILITY,
    Bookkeeping,
    assert_empty,
    assert_lock,
    assert_message,
    assert_released,
    claim_and_ack,
    claim_one,
    counted_transport,
    counter_value,
    dead,
    group_messages,
    locks,
    messages,
    new_transport,
    publish_each,
    unchanged,
)
from tests.support.helpers import later

#: What the ack of the last message a group was readied with sends first: the head's delete,
#: then the check for a message published since; then it releases the group or drops its lock.
DELETE_AND_CHECK = {"mq_messages.delete_one": 1, "mq_messages.find_one": 1}


@pytest.fixture
async def transport(db: Any, clock: ManualClock) -> AsyncGroupTransport:
    return await new_transport(db, clock)


# ------------------------------------------------------------------------------------ publish


async def test_publish_returns_increasing_seqs_and_writes_the_message_and_its_lock(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    first_at = clock.now()
    seqs = [await transport.publish("g", {"n": 0}, priority=2)]
    clock.advance(1)
    seqs.append(await transport.publish("h", "h0", priority=3))
    seqs.append(await transport.publish("g", {"n": 1}, priority=4))

    assert seqs == [1, 2, 3]
    assert await counter_value(db) == 3
    # Unstamped (no token, no stamp_until), not on its way to the dead letters.
    assert await messages(db) == {
        1: {
            "_id": 1, "group_id": "g", "event": {"n": 0}, "priority": 2,
            "published_at": first_at, "deliveries": 0, "token": None, "stamp_until": None,
            "last_error": None, "dead": None,
        },
        2: {
            "_id": 2, "group_id": "h", "event": "h0", "priority": 3,
            "published_at": clock.now(), "deliveries": 0, "token": None, "stamp_until": None,
            "last_error": None, "dead": None,
        },
        3: {
            "_id": 3, "group_id": "g", "event": {"n": 1}, "priority": 4,
            "published_at": clock.now(), "deliveries": 0, "token": None, "stamp_until": None,
            "last_error": None, "dead": None,
        },
    }  # fmt: skip
    # A new group is claimable at once (the epoch sorts before every real instant); its
    # priority is the first publish's (2, not 4); version counts the publishes into it and
    # last_seq is the largest seq they readied it with.
    assert await locks(db) == {
        "g": {
            "_id": "g", "available_at": EPOCH, "token": None, "priority": 2, "parked": False,
            "version": 2, "last_seq": 3,
        },
        "h": {
            "_id": "h", "available_at": EPOCH, "token": None, "priority": 3, "parked": False,
            "version": 1, "last_seq": 2,
        },
    }  # fmt: skip


async def test_priority_is_fixed_by_the_first_publish(
    db: Any, transport: AsyncGroupTransport
) -> None:
    await transport.publish("g", "g0", priority=1)
    await transport.publish("g", "g1", priority=4)

    await assert_lock(db, "g", priority=1)
    assert await transport.claim("w", min_priority=2) is None
    await assert_lock(db, "g", token=None)  # the floor kept it untouched
    lease = await claim_one(transport, min_priority=1, group="g", event="g0")
    assert lease.priority == 1


async def test_a_publish_never_pulls_an_in_flight_or_parked_group_back(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g", event="g0")
    in_flight = await assert_lock(db, "g", available_at=later(clock, VISIBILITY), token=lease.token)

    await transport.publish("g", "g1")

    # Only the publish count and last seq moved: the group stays leased to A, not claimable.
    assert await locks(db) == {"g": {**in_flight, "version": 2, "last_seq": 2}}
    assert await transport.claim("B") is None

    assert await transport.nack(lease, delay=60)
    parked = await assert_lock(
        db, "g", available_at=later(clock, 60), token=lease.token, parked=True
    )

    await transport.publish("g", "g2")

    assert await locks(db) == {"g": {**parked, "version": 3, "last_seq": 3}}
    clock.advance(59)
    assert await transport.claim("B") is None
    clock.advance(1)
    again = await claim_one(transport, "B", group="g", event="g0")
    assert again.deliveries == 2
    assert await group_messages(db) == {"g": ["g0", "g1", "g2"]}


async def test_publish_many_allocates_a_contiguous_range_in_three_commands(
    db: Any, clock: ManualClock
) -> None:
    transport, counter = await counted_transport(db, clock)
    await transport.publish("a", "a0", priority=1)
    counter.reset()

    seqs = await transport.publish_many(
        [
            NewMessage("a", "a1", priority=4),
            NewMessage("b", "b0", priority=3),
            NewMessage("a", "a2"),
            NewMessage(7, {"int": "group"}),
            NewMessage("b", "b1", priority=0),
        ]
    )

    assert seqs == [2, 3, 4, 5, 6]
    assert counter.counts == {
        "mq_counters.find_one_and_update": 1,
        "mq_messages.insert_many": 1,
        "mq_locks.bulk_write": 1,
    }
    assert await counter_value(db) == 6
    stored = await messages(db)
    assert [
        (seq, doc["group_id"], doc["event"], doc["priority"]) for seq, doc in sorted(stored.items())
    ] == [
        (1, "a", "a0", 1),
        (2, "a", "a1", 4),
        (3, "b", "b0", 3),
        (4, "a", "a2", 0),
        (5, 7, {"int": "group"}, 0),
        (6, "b", "b1", 0),
    ]
    groups = await locks(db)
    # A group new to the transport takes its first message's priority; an existing one keeps
    # its own. A batch counts once in the version of each group it touches, and records the
    # group's largest seq in it as last_seq.
    assert {g: (doc["priority"], doc["version"], doc["last_seq"]) for g, doc in groups.items()} == {
        "a": (1, 2, 4),
        "b": (3, 1, 6),
        7: (0, 1, 5),
    }
    assert {doc["available_at"] for doc in groups.values()} == {EPOCH}

    counter.reset()
    big = await transport.publish_many(NewMessage(f"g{i % 10}", i) for i in range(100))

    assert big == list(range(7, 107))
    assert counter.total == 3
    assert await counter_value(db) == 106
    assert len(await messages(db)) == 106
    counter.reset()
    assert await transport.publish_many([]) == []
    assert counter.total == 0
    assert await counter_value(db) == 106


async def test_publish_claim_and_ack_cost_three_two_and_two_or_three_commands(
    db: Any, clock: ManualClock
) -> None:
    transport, counter = await counted_transport(db, clock)

    await transport.publish("g", "g0")
    assert counter.counts == {
        "mq_counters.find_one_and_update": 1,
        "mq_messages.insert_one": 1,
        "mq_locks.update_one": 1,
    }
    await transport.publish("g", "g1")
    counter.reset()
    lease = await claim_one(transport, group="g", event="g0")
    assert counter.counts == {
        "mq_locks.find_one_and_update": 1,
        "mq_messages.find_one_and_update": 1,
    }
    counter.reset()
    # g1 waits behind g0: the ack deletes the head and releases the group.
    assert await transport.ack(lease)
    assert counter.counts == {"mq_messages.delete_one": 1, "mq_locks.update_one": 1}
    assert list(await messages(db)) == [2]
    await assert_released(db, "g", clock.now())
    lease = await claim_one(transport, group="g", event="g1")
    counter.reset()
    # g1 was the group's last message and nothing was published since: the ack deletes the
    # head, checks that no other message is there, drops the lock, and leaves nothing behind.
    assert await transport.ack(lease)
    assert counter.counts == {**DELETE_AND_CHECK, "mq_locks.delete_one": 1}
    await assert_empty(db)
    counter.reset()
    assert await transport.claim("w") is None
    assert counter.counts == {"mq_locks.find_one_and_update": 1}


# --------------------------------------------------------------------------- FIFO, fairness


async def test_per_group_fifo_with_concurrent_workers(db: Any, clock: ManualClock) -> None:
    faults = FaultInjector(yield_between=True)
    transport = await new_transport(instrument(db, faults), clock)
    groups = [f"g{i}" for i in range(6)]
    published: dict[str, list[Any]] = {g: [] for g in groups}
    batch = []
    for n in range(8):
        for g in groups:
            published[g].append({"g": g, "n": n})
            batch.append(NewMessage(g, {"g": g, "n": n}))
    await transport.publish_many(batch[:20])
    for item in batch[20:]:
        await transport.publish(item.group_id, item.event)
    books = Bookkeeping()
    summaries: list[GroupRunSummary] = []

    async def worker(name: str) -> None:
        summaries.append(
            await transport.run(books.handler, worker_id=name, concurrency=4, stop_when_empty=True)
        )

    async with anyio.create_task_group() as group:
        group.start_soon(worker, "w1")
        group.start_soon(worker, "w2")

    assert books.overlaps == []
    assert dict(books.processed) == published
    assert sum(s.acked for s in summaries) == sum(s.claimed for s in summaries) == len(batch)
    assert sum(s.lost + s.retried + s.dead + s.unknown for s in summaries) == 0
    await assert_empty(db)
    assert await dead(db) == {}


async def test_round_robin_a_backlog_delays_later_groups_by_at_most_one_turn(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    order: list[Any] = []

    async def turn() -> None:
        lease = await claim_one(transport)
        order.append(lease.event)
        clock.advance(0.001)  # acks a millisecond apart: equal instants would tie
        assert await transport.ack(lease)

    await transport.publish_many(NewMessage("big", f"b{i}") for i in range(6))
    await turn()  # b0
    await assert_released(db, "big", clock.now())
    await transport.publish_many([NewMessage("a", "a0"), NewMessage("a", "a1")])
    await assert_lock(db, "a", available_at=EPOCH)  # sorts before "big"
    await turn()  # a0: published after big's turn, served before big's next one
    await transport.publish("c", "c0")
    await turn()  # c0
    assert sorted(await locks(db)) == ["a", "big"]  # c0's ack dropped the drained "c"
    for _ in range(6):
        await turn()

    assert order == ["b0", "a0", "c0", "b1", "a1", "b2", "b3", "b4", "b5"]
    # Each group's last ack dropped its lock ("c", then "a", then "big"): nothing is left.
    await assert_empty(db)
    assert await transport.claim("w") is None


async def test_the_priority_floor_excludes_lower_groups(db: Any, clock: ManualClock) -> None:
    transport, counter = await counted_transport(db, clock, record=True)
    await transport.publish("low", "l0", priority=0)
    await transport.publish("mid", "m0", priority=2)
    await transport.publish("high", "h0", priority=4)
    counter.reset()

    high = await claim_one(transport, "A", min_priority=3, group="high")
    # The floor is an `$in` over the claim index's leading key, and the claim hints that index.
    lease_op = counter.operations[0]
    assert (lease_op.collection, lease_op.name) == ("mq_locks", "find_one_and_update")
    assert lease_op.filter["priority"] == {"$in": [3, 4]}
    assert lease_op.kwargs["hint"] == "claim"
    assert await transport.claim("B", min_priority=3) is None  # high is in flight
    stored = await locks(db)
    assert {g: doc["token"] for g, doc in stored.items()} == {
        "low": None,
        "mid": None,
        "high": high.token,
    }
    mid = await claim_one(transport, "B", min_priority=2, group="mid")
    assert await transport.claim("C", min_priority=1) is None
    low = await claim_one(transport, "C", min_priority=0, group="low")
    assert (high.priority, mid.priority, low.priority) == (4, 2, 0)
    assert await transport.claim("D") is None
    stored = await locks(db)
    assert {g: doc["token"] for g, doc in stored.items()} == {
        "low": low.token,
        "mid": mid.token,
        "high": high.token,
    }


@pytest.mark.parametrize("priority", [-1, 5, "1"])
async def test_a_priority_outside_0_to_4_is_rejected_and_nothing_written(
    db: Any, transport: AsyncGroupTransport, priority: Any
) -> None:
    await transport.publish("g", "g0", priority=4)

    async with unchanged(db):
        with pytest.raises(InvalidInput, match=r"^priority"):
            await transport.publish("g", "g1", priority=priority)
        with pytest.raises(InvalidInput, match=r"^messages\[0\]\.priority"):
            await transport.publish_many([NewMessage("h", "h0", priority=priority)])


# -------------------------------------------------------------------- ack, nack, extend


async def test_ack_removes_the_head_and_releases_the_group(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await publish_each(transport, "g", "g0", "g1")
    lease = await claim_one(transport, "A", group="g", event="g0")
    assert (lease.seq, lease.deliveries, lease.lease_until) == (1, 1, later(clock, VISIBILITY))
    await assert_message(db, 1, token=lease.token, deliveries=1)
    await assert_message(db, 2, token=None)
    clock.advance(5)

    assert await transport.ack(lease)

    assert list(await messages(db)) == [2]
    released = await assert_released(db, "g", clock.now())
    assert released["parked"] is False
    assert not await transport.ack(lease)  # once only
    assert list(await messages(db)) == [2]
    nxt = await claim_one(transport, "B", group="g", event="g1")
    assert (nxt.seq, nxt.deliveries) == (2, 1)


async def test_nack_without_delay_makes_the_group_claimable_at_once_behind_those_waiting(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g")
    await publish_each(transport, "w", "w0", "w1")
    await claim_and_ack(transport, "B", group="w", event="w0")
    await transport.publish("h", "h0")  # never claimed
    clock.advance(1)

    assert await transport.nack(lease)

    released = await assert_released(db, "g", clock.now())
    assert released["parked"] is False
    # The head is given back too: no token, no stamp; the delivery stays counted.
    await assert_message(db, 1, token=None, stamp_until=None, deliveries=1, last_error=None)
    assert not await transport.extend(lease)  # released: no longer held
    # Claimable at once, but behind the never-claimed "h" and "w", released a second earlier.
    assert [(await claim_one(transport, "C")).event for _ in range(3)] == ["h0", "w1", "g0"]
    again = await assert_message(db, 1, deliveries=2)
    await assert_lock(db, "g", token=again["token"])


async def test_nack_with_a_delay_parks_the_group_until_then(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g")

    assert await transport.nack(lease, delay=60, error="busy")

    parked = await assert_lock(
        db, "g", available_at=later(clock, 60), token=lease.token, parked=True
    )
    # The head keeps the lease's token; its stamp lasts as long as the parking.
    await assert_message(db, 1, token=lease.token, stamp_until=later(clock, 60), last_error="busy")
    clock.advance(59.999)
    assert await transport.claim("B") is None
    assert await locks(db) == {"g": parked}
    clock.advance(0.001)
    again = await claim_one(transport, "B", group="g", event="g0")
    assert again.deliveries == 2
    await assert_lock(db, "g", token=again.token, parked=False)
    await assert_message(db, 1, token=again.token, stamp_until=again.lease_until)
    assert not await transport.ack(lease)  # the parked holder lost it to B
    assert list(await messages(db)) == [1]


async def test_the_parked_holder_can_still_ack(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await publish_each(transport, "g", "g0", "g1")
    lease = await claim_one(transport, "A", group="g")
    assert await transport.nack(lease, delay=60)
    clock.advance(10)

    assert await transport.ack(lease)

    assert list(await messages(db)) == [2]
    released = await assert_released(db, "g", clock.now())
    assert released["parked"] is False
    await claim_one(transport, "B", group="g", event="g1")


async def test_extend_pushes_available_at_and_the_heads_stamp_in_two_commands(
    db: Any, clock: ManualClock
) -> None:
    transport, counter = await counted_transport(db, clock)
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g")
    clock.advance(20)
    counter.reset()

    assert await transport.extend(lease)

    assert counter.counts == {"mq_locks.update_one": 1, "mq_messages.update_one": 1}
    await assert_lock(db, "g", available_at=later(clock, VISIBILITY))
    await assert_message(db, 1, token=lease.token, stamp_until=later(clock, VISIBILITY))
    clock.advance(15)  # past the claim's own lease
    assert await transport.claim("B") is None
    assert await transport.extend(lease, lease_ttl=100)
    await assert_lock(db, "g", available_at=later(clock, 100))
    await assert_message(db, 1, stamp_until=later(clock, 100))
    clock.advance(99)
    assert await transport.claim("B") is None
    await assert_lock(db, "g", token=lease.token)
    await assert_message(db, 1, deliveries=1)
    assert await transport.ack(lease)
    await assert_empty(db)


async def test_the_ack_of_a_groups_last_message_drops_its_lock(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await transport.publish("g", "g0")
    await publish_each(transport, "h", "h0", "h1")
    g = await claim_one(transport, "A", group="g", event="g0")
    h = await claim_one(transport, "B", group="h", event="h0")
    clock.advance(1)

    assert await transport.ack(g)

    assert list(await locks(db)) == ["h"]  # "g" drained: gone at once, no claim needed
    assert await transport.ack(h)
    await assert_released(db, "h", clock.now())  # h1 waits: released, not dropped
    await claim_and_ack(transport, "C", group="h", event="h1")
    await assert_empty(db)


async def test_an_ack_whose_group_got_a_publish_since_the_claim_releases_it(
    db: Any, clock: ManualClock
) -> None:
    transport, counter = await counted_transport(db, clock)
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "A", group="g", event="g0")  # the last message, then
    await transport.publish("g", "g1")
    clock.advance(1)
    counter.reset()

    assert await transport.ack(lease)

    # The check before the drop sees g1: no drop; the group is released.
    assert counter.counts == {**DELETE_AND_CHECK, "mq_locks.update_one": 1}
    assert await group_messages(db) == {"g": ["g1"]}
    released = await assert_released(db, "g", clock.now())
    assert (released["version"], released["last_seq"]) == (2, 2)
    await claim_and_ack(transport, "B", group="g", event="g1")
    await assert_empty(db)


async def test_a_drained_group_left_with_its_lock_is_dropped_by_the_next_claim(
    db: Any, clock: ManualClock
) -> None:
    """dead_letter releases the group without looking for more messages: a group whose last
    message went to the dead letters keeps an empty lock until a claim drops it."""
    transport, counter = await counted_transport(db, clock)
    await transport.publish("g", "g0")
    g = await claim_one(transport, "A", group="g")
    await publish_each(transport, "h", "h0", "h1")
    h = await claim_one(transport, "B", group="h")
    assert await transport.dead_letter(g, "bad")
    clock.advance(0.001)
    assert await transport.ack(h)
    clock.advance(0.001)
    # "g" waits, empty, before "h" in the claim order.
    assert {key: doc["available_at"] for key, doc in (await locks(db)).items()} == {
        "g": later(clock, -0.002),
        "h": later(clock, -0.001),
    }
    assert list(await messages(db)) == [3]
    counter.reset()

    lease = await claim_one(transport, "C", group="h", event="h1")  # "g" was dropped on the way

    assert counter.counts == {
        "mq_locks.find_one_and_update": 2,
        "mq_messages.find_one_and_update": 2,
        "mq_locks.delete_one": 1,
    }
    assert list(await locks(db)) == ["h"]
    assert await transport.ack(lease)
    assert await transport.claim("C") is None
    await assert_empty(db)
    assert list(await dead(db)) == [1]


# ------------------------------------------------------------------------------ operators


async def test_stats_counts_groups_messages_and_dead_letters(db: Any, clock: ManualClock) -> None:
    transport, counter = await counted_transport(db, clock)
    assert await transport.stats() == GroupStats(0, 0, 0, 0, 0, None)
    # The totals come from collection metadata, not from counting documents.
    assert counter.counts == {
        "mq_locks.count_documents": 3,
        "mq_messages.estimated_document_count": 1,
        "mq_dead.estimated_document_count": 1,
        "mq_messages.find": 1,
    }

    # Each group is claimed while it is the only claimable one: no tie to break.
    await transport.publish("flight", "f0")
    flight = await claim_one(transport, "A", group="flight")
    await transport.publish("park", "p0")
    park = await claim_one(transport, "B", group="park")
    assert await transport.nack(park, delay=60)
    await publish_each(transport, "dead", "d0", "d1")
    doomed = await claim_one(transport, "C", group="dead")
    assert await transport.dead_letter(doomed, "bad")
    await publish_each(transport, "ready", "r0", "r1")
    clock.advance(15)
    counter.reset()

    stats = await transport.stats()

    assert counter.total == 6
    # ready: "ready" (never claimed) and "dead" (released after its head died).
    assert stats == GroupStats(
        ready=2, in_flight=1, parked=1, messages=5, dead=1, oldest_message_age=15.0
    )
    assert len(await messages(db)) == 5
    assert len(await dead(db)) == 1
    stored = await locks(db)
    now = clock.now()
    assert sorted(g for g, doc in stored.items() if doc["available_at"] <= now) == [
        "dead",
        "ready",
    ]
    assert stored["flight"]["token"] == flight.token
    assert stored["park"]["parked"] is True


async def test_setup_creates_the_claim_head_and_dead_indexes_idempotently(
    db: Any, clock: ManualClock
) -> None:
    transport = AsyncGroupTransport(db, PREFIX, lease_ttl=VISIBILITY, clock=clock)
    await transport.publish("g", "g0")

    await transport.setup()
    await transport.setup()

    lock_indexes = await db["mq_locks"].index_information()
    assert set(lock_indexes) == {"_id_", "claim", "parked"}
    # Priority first: the floor's `$in` becomes at most five ranges walked in available_at order.
    assert list(lock_indexes["claim"]["key"]) == [("priority", 1), ("available_at", 1)]
    assert list(lock_indexes["parked"]["key"]) == [("parked", 1), ("available_at", 1)]
    message_indexes = await db["mq_messages"].index_information()
    assert set(message_indexes) == {"_id_", "group_head", "published"}
    assert list(message_indexes["group_head"]["key"]) == [("group_id", 1), ("_id", 1)]
    assert list(message_indexes["published"]["key"]) == [("published_at", 1)]
    dead_indexes = await db["mq_dead"].index_information()
    assert set(dead_indexes) == {"_id_", "group"}
    assert list(dead_indexes["group"]["key"]) == [("group_id", 1), ("_id", 1)]
    assert not any("expireAfterSeconds" in spec for spec in lock_indexes.values())
    # The hinted claim works once the indexes exist, and nothing else was written.
    await claim_one(transport, group="g", event="g0")
    assert list(await messages(db)) == [1]


EVENTS = {
    "dict": {"a": 1, "nested": {"b": [1, "two", None]}, "s": "é"},
    "list": [1, {"x": "y"}, [2, 3]],
    "string": "hello",
    "int": 42,
    "big-int": 2**40,
    "float": 1.5,
    "none": None,
    "bool": True,
    "empty-dict": {},
    "empty-list": [],
}


@pytest.mark.parametrize("event", list(EVENTS.values()), ids=list(EVENTS))
async def test_the_event_handed_back_equals_what_was_published(
    db: Any, transport: AsyncGroupTransport, event: Any
) -> None:
    await transport.publish("g", event)
    await transport.publish_many([NewMessage("h", event)])

    first = await claim_one(transport)
    second = await claim_one(transport)

    assert {first.group_id, second.group_id} == {"g", "h"}
    assert first.event == event and type(first.event) is type(event)
    assert second.event == event and type(second.event) is type(event)
    assert [doc["event"] for doc in (await messages(db)).values()] == [event, event]


async def test_the_lease_until_matches_the_stored_lock(
    db: Any, transport: AsyncGroupTransport, clock: ManualClock
) -> None:
    await transport.publish("g", "g0")
    lease = await claim_one(transport, "worker-1", group="g")
    assert lease.worker_id == "worker-1"
    assert lease.token.startswith("worker-1:")
    assert lease.lease_until == clock.now() + timedelta(seconds=VISIBILITY)
    await assert_lock(db, "g", available_at=lease.lease_until)
    # The head carries the same lease: its token, stamped until the lock's lease ends.
    await assert_message(
        db, lease.seq, token=lease.token, stamp_until=lease.lease_until, deliveries=1
    )
