"""AsyncGroupTransport bad input: every rejected call raises `InvalidInput` (a `ValueError`)
naming the field, before any command is sent, so nothing is written."""

from __future__ import annotations

import math
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import pytest

from mongoq import AsyncGroupTransport, GroupLease, NewMessage
from mongoq.testing import CommandCounter, ManualClock, instrument
from tests.support.group_helpers import PREFIX, claim_one, new_transport, snapshot
from tests.support.helpers import SIXTEEN_MIB, rejects


@pytest.fixture
def counter() -> CommandCounter:
    return CommandCounter()


@pytest.fixture
async def transport(db: Any, clock: ManualClock, counter: CommandCounter) -> AsyncGroupTransport:
    """A transport with two groups: "held" (claimed, see `lease`) and "g" (ready), so an
    injected filter would have something to match."""
    transport = await new_transport(instrument(db, counter), clock)
    await transport.publish("held", {"keep": True})
    await transport.publish("held", "second")
    return transport


@pytest.fixture
async def lease(transport: AsyncGroupTransport, counter: CommandCounter) -> GroupLease:
    held = await claim_one(transport, "A", group="held")
    await transport.publish("g", "g0")
    counter.reset()
    return held


@pytest.fixture
async def before(db: Any, lease: GroupLease, counter: CommandCounter) -> dict[str, Any]:
    """What is stored before the rejected call (the claim included); commands counted from here."""
    state = await snapshot(db)
    counter.reset()
    return state


async def assert_nothing_written(db: Any, counter: CommandCounter, before: Any) -> None:
    assert counter.total == 0, counter.counts
    assert await snapshot(db) == before


async def never_called(lease: GroupLease) -> None:
    """The handler of a run that must be refused before it claims anything."""
    raise AssertionError("never called")


BAD_GROUP_IDS = {
    "operator-injection": {"$ne": None},
    "gt-injection": {"$gt": ""},
    "empty": "",
    "bool": True,
    "false": False,
    "none": None,
    "float": 1.5,
    "list": ["g"],
    "nul": "g\x00",
    "too-long": "g" * 1025,
    "too-big-int": 2**63,
}


class Opaque:
    pass


BAD_EVENTS = {
    "object": object(),
    "custom-class": Opaque(),
    "set": {1, 2},
    "dollar-key": {"$set": {"a": 1}},
    "dotted-key": {"a.b": 1},
    "nested-dollar-key": {"outer": {"$where": "1"}},
    "dotted-key-in-list": [{"ok": 1}, {"x.y": 2}],
    "int-key": {1: "one"},
    "oversized": "x" * (SIXTEEN_MIB + 1),
    "oversized-dict": {"blob": b"\x00" * SIXTEEN_MIB},
    "too-big-int": 2**64,
}


BAD_PRIORITIES = {
    "minus-one": -1,
    "five": 5,
    "string": "1",
    "float": 1.0,
    "bool": True,
    "none": None,
}


@pytest.mark.parametrize("group_id", list(BAD_GROUP_IDS.values()), ids=list(BAD_GROUP_IDS))
async def test_publish_rejects_a_bad_group_id(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any, group_id: Any
) -> None:
    with rejects("group_id") as raised:
        await transport.publish(group_id, "event")

    assert isinstance(raised.value, ValueError)
    assert raised.value.field == "group_id"
    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize("group_id", list(BAD_GROUP_IDS.values()), ids=list(BAD_GROUP_IDS))
async def test_publish_many_rejects_a_bad_group_id(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any, group_id: Any
) -> None:
    batch = [NewMessage("g", "fine"), NewMessage(group_id, "event")]

    with rejects("messages[1].group_id"):
        await transport.publish_many(batch)

    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize(
    "group_id", [v for v in BAD_GROUP_IDS.values() if v is not None], ids=lambda v: repr(v)[:20]
)
async def test_operator_calls_reject_a_bad_group_id(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any, group_id: Any
) -> None:
    with rejects("group_id"):
        await transport.dead_letters(group_id=group_id)
    with rejects("group_id"):
        await transport.redrive(group_id=group_id)

    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize("event", list(BAD_EVENTS.values()), ids=list(BAD_EVENTS))
async def test_publish_rejects_a_bad_event(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any, event: Any
) -> None:
    with rejects("event") as raised:
        await transport.publish("new-group", event)

    assert raised.value.field.startswith("event")
    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize("event", list(BAD_EVENTS.values()), ids=list(BAD_EVENTS))
async def test_publish_many_with_one_bad_event_writes_nothing_of_the_batch(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any, event: Any
) -> None:
    batch = [NewMessage("g", "g1"), NewMessage("new", "n0"), NewMessage("g", event)]

    with rejects("messages[2].event"):
        await transport.publish_many(batch)

    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize("priority", list(BAD_PRIORITIES.values()), ids=list(BAD_PRIORITIES))
async def test_publish_rejects_a_priority_outside_0_to_4(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any, priority: Any
) -> None:
    with rejects("priority"):
        await transport.publish("new-group", "event", priority=priority)
    with rejects("messages[0].priority"):
        await transport.publish_many([NewMessage("new-group", "event", priority=priority)])

    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize(
    "item",
    [("g", "event"), {"group_id": "g", "event": "event"}, None, "g"],
    ids=["tuple", "dict", "none", "string"],
)
async def test_publish_many_rejects_an_item_that_is_not_a_new_message(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any, item: Any
) -> None:
    with rejects("messages[1]") as raised:
        await transport.publish_many([NewMessage("g", "g1"), item])

    assert raised.value.field == "messages[1]"
    assert "NewMessage" in str(raised.value)
    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize("worker_id", ["", "   ", 123, b"w", ["w"]])
async def test_claim_and_run_reject_a_bad_worker_id(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any, worker_id: Any
) -> None:
    with rejects("worker_id"):
        await transport.claim(worker_id)
    with rejects("worker_id"):
        await transport.run(never_called, worker_id=worker_id, stop_when_empty=True)

    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize("min_priority", [-1, 5, "0", 2.0, True, None])
async def test_claim_and_run_reject_a_priority_floor_outside_0_to_4(
    db: Any,
    transport: AsyncGroupTransport,
    counter: CommandCounter,
    before: Any,
    min_priority: Any,
) -> None:
    with rejects("min_priority"):
        await transport.claim("w", min_priority=min_priority)
    with rejects("min_priority"):
        await transport.run(never_called, min_priority=min_priority, stop_when_empty=True)

    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("concurrency", 0),
        ("concurrency", 1.5),
        ("poll_interval", 0),
        ("poll_interval", -1),
        ("retry_delay", -1),
        ("retry_delay", math.nan),
    ],
)
async def test_run_rejects_bad_options(
    db: Any,
    transport: AsyncGroupTransport,
    counter: CommandCounter,
    before: Any,
    option: str,
    value: Any,
) -> None:
    with rejects(option):
        await transport.run(never_called, stop_when_empty=True, **{option: value})

    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("lease_ttl", 0),
        ("lease_ttl", -1),
        ("lease_ttl", math.inf),
        ("lease_ttl", "30"),
        ("max_deliveries", 0),
        ("max_deliveries", -1),
        ("max_deliveries", 1.5),
        ("max_deliveries", True),
    ],
)
async def test_the_constructor_rejects_bad_options(
    db: Any, clock: ManualClock, option: str, value: Any
) -> None:
    with rejects(option):
        AsyncGroupTransport(db, PREFIX, clock=clock, **{option: value})

    assert await snapshot(db) == {"messages": {}, "locks": {}, "counters": {}, "dead": {}}


@pytest.mark.parametrize("prefix", ["", "a$b", "a\x00b", "system.x", 7])
async def test_the_constructor_rejects_a_bad_prefix(
    db: Any, clock: ManualClock, prefix: Any
) -> None:
    with rejects("prefix"):
        AsyncGroupTransport(db, prefix, clock=clock)

    assert await db.list_collection_names() == []


@pytest.mark.parametrize("delay", [-1, -0.001, math.nan, math.inf, "1", None])
async def test_nack_rejects_a_negative_or_bad_delay(
    db: Any,
    transport: AsyncGroupTransport,
    lease: GroupLease,
    counter: CommandCounter,
    before: Any,
    delay: Any,
) -> None:
    with rejects("delay"):
        await transport.nack(lease, delay, error="would be recorded")

    await assert_nothing_written(db, counter, before)
    assert await transport.ack(lease)  # still held


@pytest.mark.parametrize("lease_ttl", [0, -5, math.nan, "30"])
async def test_extend_rejects_a_bad_visibility(
    db: Any,
    transport: AsyncGroupTransport,
    lease: GroupLease,
    counter: CommandCounter,
    before: Any,
    lease_ttl: Any,
) -> None:
    with rejects("lease_ttl"):
        await transport.extend(lease, lease_ttl)

    await assert_nothing_written(db, counter, before)


def lookalikes(lease: GroupLease) -> list[Any]:
    return [None, object(), asdict(lease), SimpleNamespace(**asdict(lease)), lease.token]


@pytest.mark.parametrize("call", ["ack", "nack", "extend", "dead_letter"])
async def test_settles_reject_anything_but_a_group_lease(
    db: Any,
    transport: AsyncGroupTransport,
    lease: GroupLease,
    counter: CommandCounter,
    before: Any,
    call: str,
) -> None:
    for fake in lookalikes(lease):
        with rejects("lease"):
            if call == "dead_letter":
                await transport.dead_letter(fake, "error")
            else:
                await getattr(transport, call)(fake)

    await assert_nothing_written(db, counter, before)
    assert await transport.ack(lease)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seqs": [0]}, "seqs[0]"),
        ({"seqs": [1, "2"]}, "seqs[1]"),
        ({"seqs": [{"$gt": 0}]}, "seqs[0]"),
        ({"limit": 0}, "limit"),
    ],
)
async def test_redrive_and_dead_letters_reject_bad_selections(
    db: Any,
    transport: AsyncGroupTransport,
    counter: CommandCounter,
    before: Any,
    kwargs: dict[str, Any],
    field: str,
) -> None:
    with rejects(field):
        await transport.redrive(**kwargs)
    if "limit" in kwargs:
        with rejects("limit"):
            await transport.dead_letters(limit=0)

    await assert_nothing_written(db, counter, before)


async def test_a_rejected_publish_leaves_later_publishes_unaffected(
    db: Any, transport: AsyncGroupTransport, counter: CommandCounter, before: Any
) -> None:
    with rejects("event"):
        await transport.publish("g", {"$bad": 1})

    assert await transport.publish("g", "g1") == 4  # no sequence number was spent
    after = await snapshot(db)
    assert set(after["messages"]) == {*before["messages"], 4}
