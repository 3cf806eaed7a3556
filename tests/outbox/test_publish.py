"""AsyncOutbox.publish, setup and the Event model.

What is checked, always on the documents read back: `setup` is idempotent and leaves held lanes
alone; bad input is refused (`InvalidInput` naming the field) before any command is sent;
payloads and headers are stored and handed back JSON-normalized; one delivery per subscribed
handler, in the lane of its key; per-key sequences; the idempotent append under replays (same
call, later calls, after a completion, after the subscriptions grew); a crash between the
commands of a publish without a transaction is repaired by publishing again; a publish inside a
transaction commits or rolls back with the business writes beside it.
"""

from __future__ import annotations

import enum
import inspect
import math
import re
import uuid
from collections import Counter
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout, PyMongoError

from mongoq import _driver
from mongoq._validation import MAX_PAYLOAD_BYTES
from mongoq.errors import InvalidInput
from mongoq.outbox import AsyncOutbox, Event, PublishResult, lane_of
from mongoq.outbox import schema as schema_module
from mongoq.testing import CommandCounter, FaultInjector, ManualClock
from tests.conftest import EMBEDDED, SERVERS
from tests.support.helpers import nth, utc
from tests.support.outbox_helpers import (
    PREFIX,
    SUBSCRIPTIONS,
    counted_outbox,
    deliveries,
    delivery_of,
    events,
    faulty_outbox,
    lane_ids_of,
    lanes,
    new_outbox,
    order,
    publish_in_transaction,
)

SEQUENCES = f"{PREFIX}key_sequences"
#: The fields of a lane nobody ever held (the layout has more; these are the contract).
FREE_LANE = {
    "owner": None, "instance": None, "lease_until": datetime(1970, 1, 1, tzinfo=UTC),
    "epoch": 0, "in_flight": [], "lost": [],
}  # fmt: skip

# Every test marked `both_ways` runs a publish without a transaction on every backend, and one
# inside a transaction where there are transactions.
WAYS = (
    [(backend, "plain") for backend in EMBEDDED]
    + [("tx", "plain"), ("tx", "transaction")]
    + [(backend, way) for backend in SERVERS for way in ("plain", "transaction")]
)
both_ways = pytest.mark.parametrize(
    ("odb", "way"), WAYS, indirect=["odb"], ids=[f"{b}-{w}" for b, w in WAYS]
)


async def publish(db: Any, outbox: AsyncOutbox, batch: Any, way: str) -> PublishResult:
    if way == "plain":
        return await outbox.publish(batch, session=None)
    result: PublishResult = await publish_in_transaction(db, outbox, batch)
    return result


def unstored(stored: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Events without ``stored_at`` (which every publish of them moves on)."""
    return {i: {k: v for k, v in e.items() if k != "stored_at"} for i, e in stored.items()}


async def handlers_by_event(db: Any) -> dict[str, list[str]]:
    """The handlers of the stored deliveries, per event id, sorted; fails on a duplicate."""
    found: dict[str, list[str]] = {}
    docs = await deliveries(db)
    pairs = Counter((d["event_id"], d["handler"]) for d in docs)
    assert all(n == 1 for n in pairs.values()), pairs
    for doc in docs:
        found.setdefault(doc["event_id"], []).append(doc["handler"])
    return {event_id: sorted(names) for event_id, names in found.items()}


async def sequence_counters(db: Any) -> dict[str, int]:
    return {d["_id"]: d["value"] for d in await db[SEQUENCES].find({}).to_list(None)}


async def done(value: Any) -> Any:
    """`value`, awaited if it must be: session calls are coroutines in some drivers only."""
    return await value if inspect.isawaitable(value) else value


async def open_session(db: Any) -> Any:
    return await done(_driver.unwrap(db).client.start_session())


# ------------------------------------------------------------------------------------- setup


async def test_setup_twice_seeds_256_lanes_and_the_indexes_and_leaves_held_lanes_alone(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await outbox.setup()
    await outbox.publish(order(1), session=None)
    [claimed] = await outbox.claim("w", limit=1)
    held = await lanes(odb)
    # Another process starting up runs setup again: nothing it finds is reset.
    await new_outbox(odb, clock)
    assert await lanes(odb) == held
    stored = {lane_id: doc for lane_id, doc in held.items() if isinstance(lane_id, int)}
    assert sorted(stored) == list(range(512))  # 256 for each handler: stats's, then mail's
    assert {doc["handler"] for lane_id, doc in stored.items() if lane_id < 256} == {"stats"}
    assert {doc["handler"] for lane_id, doc in stored.items() if lane_id >= 256} == {"mail"}
    claimed_lane = await lane_ids_of(odb, claimed.handler) + lane_of("e1")
    mine = stored[claimed_lane]
    assert (mine["owner"], mine["epoch"]) == ("w", 1)
    assert [str(entry["d"]) for entry in mine["in_flight"]] == [claimed.id]
    assert len(await deliveries(odb)) == 2
    for lane_id, doc in stored.items():
        if lane_id != claimed_lane:
            assert utc({name: doc[name] for name in FREE_LANE}) == FREE_LANE, doc
    assert f"{PREFIX}key_sequences" in await odb.list_collection_names()

    documented = documented_indexes()
    assert {"event_handler", "claim", "ordering"} <= set(documented["deliveries"])
    for collection, indexes in documented.items():
        info = await odb[f"{PREFIX}{collection}"].index_information()
        assert set(info) == {"_id_", *indexes}, collection
        for name, fields in indexes.items():
            assert [field for field, _ in info[name]["key"]] == fields, (collection, name)
    info = await odb[f"{PREFIX}deliveries"].index_information()
    assert info["event_handler"]["unique"] is True
    assert info["claim"]["partialFilterExpression"] == {"lane": "ready"}


def documented_indexes() -> dict[str, dict[str, list[str]]]:
    """collection -> index name -> key fields, as the schema's module docstring lists them
    (bullets such as ``- deliveries ``claim`` ``(lane_id, due_at)`` partial ...``)."""
    doc = schema_module.__doc__ or ""
    section = doc.split("Indexes (created by `setup`)", 1)[1].split("\n\n", 2)[1]
    found: dict[str, dict[str, list[str]]] = {}
    for bullet in re.split(r"^- ", section, flags=re.MULTILINE)[1:]:
        collection = bullet.split(maxsplit=1)[0]
        for name, fields in re.findall(r"``(\w+)``\s+``\(([^)]*)\)``", bullet):
            found.setdefault(collection, {})[name] = [f.strip() for f in fields.split(",")]
    assert set(found) == {"deliveries", "events", "completed_deliveries"}, found
    return found


# ---------------------------------------------------------------------------------- bad input


def bad(payload: Any = None, **fields: Any) -> Event:
    return Event("e2", "order.created", payload, **fields)


#: name -> (the field named, relative to the event, and the bad event)
BAD_EVENTS: dict[str, tuple[str, Any]] = {
    "not-an-event": ("", {"id": "e2", "type": "order.created"}),
    "id-empty": (".id", Event("", "order.created")),
    "id-int": (".id", Event(2, "order.created")),  # type: ignore[arg-type]
    "id-too-long": (".id", Event("x" * 1025, "order.created")),
    "id-nul": (".id", Event("e\x002", "order.created")),
    "type-empty": (".type", Event("e2", "")),
    "type-none": (".type", Event("e2", None)),  # type: ignore[arg-type]
    "type-too-long": (".type", Event("e2", "t" * 1025)),
    "key-int": (".key", bad(key=7)),
    "key-empty": (".key", bad(key="")),
    "payload-dollar": (".payload.$set", bad({"$set": {"x": 1}})),
    "payload-dotted": (".payload.a.b", bad({"a.b": 1})),
    "payload-nested-dollar": (".payload.o.$inc", bad({"o": {"$inc": 1}})),
    "payload-nested-dotted": (".payload.i[1].x.y", bad({"i": [{}, {"x.y": 1}]})),
    "payload-int-key": (".payload", bad({1: "one"})),
    "payload-nan": (".payload.price", bad({"price": math.nan})),
    "payload-inf-in-list": (".payload[1]", bad([1, -math.inf])),
    "payload-set": (".payload", bad({1, 2})),
    "payload-object": (".payload.o", bad({"o": object()})),
    "payload-object-in-list": (".payload.l[0]", bad({"l": [object()]})),
    "payload-bytes": (".payload.b", bad({"b": b"raw"})),
    "payload-int-overflow": (".payload", bad({"n": 2**70})),
    "headers-not-a-mapping": (".headers", bad(headers=[("a", 1)])),
    "headers-dollar": (".headers.$h", bad(headers={"$h": 1})),
    "headers-too-big": (".headers", bad(headers={"h": "x" * 70_000})),
    "correlation-int": (".correlation_id", bad(correlation_id=5)),
    "created-at-text": (".created_at", bad(created_at="2024-01-01")),
}


@pytest.fixture
async def watched(odb: Any, clock: ManualClock, counter: CommandCounter) -> AsyncOutbox:
    """An outbox whose commands are counted from after its setup."""
    return await counted_outbox(odb, clock, counter)


async def assert_nothing_written(db: Any, counter: CommandCounter) -> None:
    assert counter.total == 0, counter.counts
    assert await events(db) == {}
    assert await deliveries(db) == []
    assert await sequence_counters(db) == {}


@pytest.mark.parametrize("case", list(BAD_EVENTS))
async def test_a_bad_event_after_a_good_one_is_refused_before_any_write(
    odb: Any, watched: AsyncOutbox, counter: CommandCounter, case: str
) -> None:
    suffix, bad = BAD_EVENTS[case]
    with pytest.raises(InvalidInput) as raised:
        await watched.publish([order(1, key="k"), bad], session=None)
    assert raised.value.field == f"events[1]{suffix}"
    await assert_nothing_written(odb, counter)


@pytest.mark.parametrize(
    ("field", "call"),
    [
        ("session", lambda o: o.publish([order(1)], session="a session")),
        ("events[0].id", lambda o: o.publish(Event("", "order.created"), session=None)),
        ("events", lambda o: o.publish("e1", session=None)),
        ("events", lambda o: o.publish([order(n) for n in range(1001)], session=None)),
    ],
    ids=["session-not-a-session", "single-event", "string", "too-many"],
)
async def test_bad_calls_are_refused_before_any_write(
    odb: Any, watched: AsyncOutbox, counter: CommandCounter, field: str, call: Any
) -> None:
    with pytest.raises(InvalidInput) as raised:
        await call(watched)
    assert raised.value.field == field
    await assert_nothing_written(odb, counter)


async def test_a_missing_session_is_refused_before_any_write(
    odb: Any, watched: AsyncOutbox, counter: CommandCounter
) -> None:
    # `session` is a required keyword (since 078a1c7): leaving it out is a TypeError naming it.
    with pytest.raises(TypeError, match="'session'"):
        await watched.publish([order(1, key="k")])  # type: ignore[call-arg]
    await assert_nothing_written(odb, counter)


async def test_a_session_without_a_transaction_is_refused_before_any_write(
    txdb: Any, clock: ManualClock, counter: CommandCounter
) -> None:
    outbox = await counted_outbox(txdb, clock, counter)
    session = await open_session(txdb)
    try:
        with pytest.raises(InvalidInput) as raised:
            await outbox.publish([order(1, key="k")], session=session)
    finally:
        await done(session.end_session())
    assert raised.value.field == "session"
    await assert_nothing_written(txdb, counter)


@pytest.mark.parametrize("events_argument", [None, 42])
async def test_a_non_iterable_events_argument_is_invalid_input(
    odb: Any, watched: AsyncOutbox, counter: CommandCounter, events_argument: Any
) -> None:
    try:
        with pytest.raises(InvalidInput) as raised:
            await watched.publish(events_argument, session=None)
        assert raised.value.field == "events"
    finally:
        await assert_nothing_written(odb, counter)


@pytest.mark.parametrize(
    ("field", "prefix", "subscriptions"),
    [
        ("subscriptions", PREFIX, ["mail"]),
        ("subscriptions", PREFIX, {"": ["mail"]}),
        ("subscriptions['order.created']", PREFIX, {"order.created": "mail"}),
        ("subscriptions['order.created']", PREFIX, {"order.created": 5}),
        ("subscriptions['order.created']", PREFIX, {"order.created": ["mail", ""]}),
        ("subscriptions['order.created']", PREFIX, {"order.created": [None]}),
        ("prefix", "", SUBSCRIPTIONS),
        ("prefix", "ob$", SUBSCRIPTIONS),
        ("prefix", "system.ob_", SUBSCRIPTIONS),
        ("prefix", 5, SUBSCRIPTIONS),
    ],
)
async def test_malformed_construction_is_refused_and_creates_nothing(
    odb: Any, clock: ManualClock, field: str, prefix: Any, subscriptions: Any
) -> None:
    with pytest.raises(InvalidInput) as raised:
        AsyncOutbox(odb, prefix, subscriptions=subscriptions, clock=clock)
    assert raised.value.field == field
    assert await odb.list_collection_names() == []


# ----------------------------------------------------------------------------- normalization


class Color(enum.Enum):
    RED = "red"
    PAIR = (1, (2, "x"))


MOMENT = datetime(2024, 5, 6, 7, 8, 9, 123000, tzinfo=UTC)
RAW_PAYLOAD = {
    "at": MOMENT, "naive": datetime(2024, 1, 2, 3, 4, 5), "day": date(2024, 5, 6),
    "id": uuid.UUID(int=1), "amount": Decimal("12.50"), "pair": (1, (2, "x")),
    "color": Color.RED, "both": Color.PAIR, "nested": [{"when": date(2000, 1, 1)}],
    "plain": [True, None, 1.5, "s", 3],
}  # fmt: skip
NORMAL_PAYLOAD = {
    "at": "2024-05-06T07:08:09.123000+00:00", "naive": "2024-01-02T03:04:05",
    "day": "2024-05-06", "id": "00000000-0000-0000-0000-000000000001", "amount": "12.50",
    "pair": [1, [2, "x"]], "color": "red", "both": [1, [2, "x"]],
    "nested": [{"when": "2000-01-01"}], "plain": [True, None, 1.5, "s", 3],
}  # fmt: skip


@both_ways
async def test_payload_and_headers_are_stored_and_claimed_json_normalized(
    odb: Any, way: str, clock: ManualClock
) -> None:
    event = Event(
        "e1", "order.created", RAW_PAYLOAD, key="k", headers={"sent": MOMENT, "v": (1, 2)},
        correlation_id="c-1", causation_id="c-0",
    )  # fmt: skip
    assert event.checked().payload == NORMAL_PAYLOAD
    assert event.payload is RAW_PAYLOAD  # the event itself is left as it was
    outbox = await new_outbox(odb, clock)
    await publish(odb, outbox, [event, Event("e2", "order.paid", created_at=MOMENT)], way)

    stored = await events(odb)
    assert stored["e1"]["payload"] == NORMAL_PAYLOAD
    assert stored["e1"]["headers"] == {"sent": "2024-05-06T07:08:09.123000+00:00", "v": [1, 2]}
    assert (stored["e1"]["correlation_id"], stored["e1"]["causation_id"]) == ("c-1", "c-0")
    assert utc(stored["e1"]["created_at"]) == clock.now()
    assert utc(stored["e2"]["created_at"]) == MOMENT
    assert "key" not in stored["e2"] and "correlation_id" not in stored["e2"]

    claimed = {(d.event.id, d.handler): d for d in await outbox.claim("w")}
    assert set(claimed) == {("e1", "mail"), ("e1", "stats"), ("e2", "stats")}
    handed = claimed["e1", "mail"].event
    assert handed.payload == NORMAL_PAYLOAD
    assert handed.headers == {"sent": "2024-05-06T07:08:09.123000+00:00", "v": [1, 2]}
    assert (handed.key, handed.correlation_id, handed.created_at) == ("k", "c-1", clock.now())
    assert claimed["e2", "stats"].event.created_at == MOMENT


class Level(enum.IntEnum):
    HIGH = 2


class Mood(enum.StrEnum):
    HAPPY = "happy"


async def test_int_and_str_enums_are_reduced_to_their_plain_value(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    event = Event("e1", "order.created", {"level": Level.HIGH, "mood": Mood.HAPPY})
    await outbox.publish(event, session=None)
    assert (await events(odb))["e1"]["payload"] == {"level": 2, "mood": "happy"}
    normal = event.checked().payload
    assert (type(normal["level"]), type(normal["mood"])) == (int, str)
    handed = (await outbox.claim("w"))[0].event.payload
    assert (type(handed["level"]), type(handed["mood"])) == (int, str)


# -------------------------------------------------------------------------------- deliveries


@both_ways
async def test_one_delivery_per_subscribed_handler_in_the_lane_of_its_key(
    odb: Any, way: str, clock: ManualClock
) -> None:
    subscriptions = {"order.created": ["mail", "stats", "mail"], "*": ["audit", "mail"]}
    outbox = await new_outbox(odb, clock, subscriptions=subscriptions)
    batch = [
        Event("e1", "order.created", key="cust-7"),
        Event("e2", "order.paid"),  # only the "*" handlers
        Event("e3", "order.created"),
    ]
    assert await publish(odb, outbox, batch, way) == PublishResult(3, 8)

    # A transaction lists the handlers at once; without one a handler is listed once its
    # delivery finished (a replay leaves it out then), never before its delivery exists.
    stored = await events(odb)
    created = {"e1": ["mail", "stats", "audit"], "e2": ["audit", "mail"],
               "e3": ["mail", "stats", "audit"]}  # fmt: skip
    listed = created if way == "transaction" else {"e1": [], "e2": [], "e3": []}
    assert {e: doc["handlers"] for e, doc in stored.items()} == listed
    assert await handlers_by_event(odb) == {
        "e1": ["audit", "mail", "stats"], "e2": ["audit", "mail"], "e3": ["audit", "mail", "stats"]
    }  # fmt: skip
    now = clock.now()
    for doc in await deliveries(odb):
        event = next(e for e in batch if e.id == doc["event_id"])
        common = {k: v for k, v in utc(doc).items() if k not in ("_id", "handler")}
        expected: dict[str, Any] = {
            "event_id": event.id, "event_type": event.type,
            "lane_id": lane_of(event.key or event.id), "lane": "ready", "status": "pending",
            "due_at": now, "attempts": 0, "claims": 0, "created_at": now, "updated_at": now,
        }  # fmt: skip
        if event.key is not None:
            expected.update(key=event.key, sequence=1)
        assert common == expected, doc


@both_ways
async def test_an_event_nobody_subscribes_to_is_kept_without_deliveries(
    odb: Any, way: str, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    result = await publish(odb, outbox, Event("x1", "nobody.cares", key="k"), way)
    assert result == PublishResult(1, 0)
    assert (await events(odb))["x1"]["handlers"] == []
    assert await deliveries(odb) == []
    assert await publish(odb, outbox, Event("x1", "nobody.cares"), way) == PublishResult(0, 0)
    assert list(await events(odb)) == ["x1"]


@both_ways
async def test_sequences_count_per_key_in_publish_order_across_calls(
    odb: Any, way: str, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await publish(odb, outbox, [order(1, "A"), order(2, "B"), order(3, "A"), order(4)], way)
    await publish(odb, outbox, [order(5, "A"), order(6, "B", kind="order.paid")], way)
    expected = {
        "e1": {("A", 1)}, "e3": {("A", 2)}, "e5": {("A", 3)},
        "e2": {("B", 1)}, "e6": {("B", 2)},
        "e4": {(None, None)},
    }  # fmt: skip
    assert await sequences_by_event(odb) == expected
    assert await sequence_counters(odb) == {"A": 3, "B": 2}

    # Replays keep the sequences they had; a new event of the key still comes after them.
    await publish(odb, outbox, [order(3, "A"), order(1, "A")], way)
    assert await sequences_by_event(odb) == expected
    await publish(odb, outbox, [order(7, "A")], way)
    [(key, sequence)] = (await sequences_by_event(odb))["e7"]
    assert key == "A" and sequence > 3
    if way == "transaction":  # a replay is read first there: it takes no number
        assert (sequence, await sequence_counters(odb)) == (4, {"A": 4, "B": 2})


async def sequences_by_event(db: Any) -> dict[str, set[Any]]:
    """(key, sequence) of the deliveries of each event (one pair when its handlers agree)."""
    found: dict[str, set[Any]] = {}
    for doc in await deliveries(db):
        found.setdefault(doc["event_id"], set()).add((doc.get("key"), doc.get("sequence")))
    return found


# ----------------------------------------------------------------------------------- replays


@both_ways
async def test_replays_in_the_same_and_later_calls_add_nothing(
    odb: Any, way: str, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    first = [order(1, "k"), order(2), order(1, "k")]
    assert await publish(odb, outbox, first, way) == PublishResult(2, 4)
    before = (await events(odb), await deliveries(odb))
    counters = await sequence_counters(odb)
    clock.advance(60)
    assert await publish(odb, outbox, first, way) == PublishResult(0, 0)
    # Another body under a known id changes nothing either: the first publish wins.
    changed = [Event("e1", "order.paid", {"other": True}, key="z"), Event("e2", "order.paid")]
    assert await publish(odb, outbox, changed, way) == PublishResult(0, 0)
    # (a replay without a transaction touches its event: `stored_at`, which purge reads)
    assert (unstored(await events(odb)), await deliveries(odb)) == (unstored(before[0]), before[1])
    if way == "transaction":  # without one, a replay may leave a gap in its key's sequence
        assert await sequence_counters(odb) == counters


@both_ways
async def test_the_same_id_twice_in_one_call_keeps_the_first(
    odb: Any, way: str, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    batch = [Event("e1", "order.created", {"v": 1}), Event("e1", "order.paid", {"v": 2})]
    assert await publish(odb, outbox, batch, way) == PublishResult(1, 2)
    stored = await events(odb)
    assert list(stored) == ["e1"]
    assert (stored["e1"]["type"], stored["e1"]["payload"]) == ("order.created", {"v": 1})
    assert await handlers_by_event(odb) == {"e1": ["mail", "stats"]}


@both_ways
async def test_publish_result_counts_new_replayed_and_partially_new_batches(
    odb: Any, way: str, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    assert await publish(odb, outbox, [order(1)], way) == PublishResult(1, 2)
    assert await publish(odb, outbox, [order(1)], way) == PublishResult(0, 0)
    batch = [order(1), order(2, kind="order.paid"), order(3)]
    assert await publish(odb, outbox, batch, way) == PublishResult(2, 3)
    assert await handlers_by_event(odb) == {
        "e1": ["mail", "stats"], "e2": ["stats"], "e3": ["mail", "stats"]
    }  # fmt: skip


@both_ways
async def test_a_completed_delivery_is_not_recreated_by_a_replay(
    odb: Any, way: str, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await publish(odb, outbox, [order(1, "k")], way)
    [mail] = await outbox.claim("w", ["mail"])
    assert await outbox.complete(mail) is True
    assert await delivery_of(odb, "e1", "mail") is None
    completed_at = clock.now()
    clock.advance(5)
    assert await publish(odb, outbox, [order(1, "k")], way) == PublishResult(0, 0)
    assert await handlers_by_event(odb) == {"e1": ["stats"]}
    stored = (await events(odb))["e1"]
    assert stored["handlers"] == (["mail", "stats"] if way == "transaction" else ["mail"])
    assert utc(stored["completed_at"]) == completed_at


@both_ways
async def test_grown_subscriptions_add_only_the_new_handler_once(
    odb: Any, way: str, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock)
    await publish(odb, outbox, [order(1), order(2, kind="order.paid")], way)
    [mail] = await outbox.claim("w", ["mail"])
    await outbox.complete(mail)
    grown = await new_outbox(
        odb, clock, subscriptions={**SUBSCRIPTIONS, "order.created": ["mail", "stats", "audit"]}
    )
    batch = [order(1), order(2, kind="order.paid")]
    assert await publish(odb, grown, batch, way) == PublishResult(0, 1)
    assert await publish(odb, grown, batch, way) == PublishResult(0, 0)
    assert await publish(odb, outbox, batch, way) == PublishResult(0, 0)  # the old map
    assert await handlers_by_event(odb) == {"e1": ["audit", "stats"], "e2": ["stats"]}
    stored = await events(odb)
    if way == "transaction":
        assert stored["e1"]["handlers"] == ["mail", "stats", "audit"]
        assert stored["e2"]["handlers"] == ["stats"]
    else:  # only what finished: mail's completion
        assert (stored["e1"]["handlers"], stored["e2"]["handlers"]) == (["mail"], [])
    audit = await delivery_of(odb, "e1", "audit")
    assert audit is not None
    assert (audit["lane_id"], audit["lane"], audit["attempts"]) == (lane_of("e1"), "ready", 0)


# ------------------------------------------------------------------ crashes without transactions

#: name -> (when the command fails, command, collection, which of its calls in the publish)
FAULTS = {
    "event-upsert-lost": ("before", "bulk_write", f"{PREFIX}events", 0),
    "event-upsert-applied": ("after", "bulk_write", f"{PREFIX}events", 0),
    "deliveries-lost": ("before", "insert_many", f"{PREFIX}deliveries", 0),
    "deliveries-applied": ("after", "insert_many", f"{PREFIX}deliveries", 0),
}
every_fault = pytest.mark.parametrize("point", list(FAULTS))


def inject(faults: FaultInjector, point: str) -> Any:
    when, name, collection, index = FAULTS[point]
    (faults.fail_before if when == "before" else faults.fail_after)(
        name, collection=collection, match=nth(index)
    )
    return pytest.raises(AutoReconnect if when == "before" else NetworkTimeout)


@both_ways
@every_fault
async def test_a_publish_that_crashed_is_repaired_by_publishing_again(
    odb: Any, way: str, clock: ManualClock, point: str
) -> None:
    """The publish without a transaction crashes; the retry runs with or without one."""
    outbox, faults = await faulty_outbox(odb, clock)
    await outbox.publish(order(3), session=None)  # replayed in the batch below
    batch = [order(1), order(2, kind="order.paid"), order(3)]
    with inject(faults, point):
        await outbox.publish(batch, session=None)
    assert faults.triggered, "the fault never fired"
    known = await events(odb)
    assert all(d["event_id"] in known for d in await deliveries(odb)), "a delivery without event"

    result = await publish(outbox.db, outbox, batch, way)
    assert result.events_added <= 2 and result.deliveries_added <= 3
    expected = {"e1": ["mail", "stats"], "e2": ["stats"], "e3": ["mail", "stats"]}
    assert await handlers_by_event(odb) == expected
    stored = await events(odb)
    listed = expected if way == "transaction" else {e: [] for e in expected}
    assert {e: sorted(doc["handlers"]) for e, doc in stored.items()} == listed
    snapshot = await deliveries(odb)
    assert await publish(outbox.db, outbox, batch, way) == PublishResult(0, 0)
    assert await deliveries(odb) == snapshot


@both_ways
@pytest.mark.parametrize("point", ["event-upsert-applied", "deliveries-lost", "deliveries-applied"])
async def test_a_retried_keyed_publish_keeps_its_place_in_the_key(
    odb: Any, way: str, clock: ManualClock, point: str
) -> None:
    outbox, faults = await faulty_outbox(odb, clock)
    await outbox.publish(order(1, "k"), session=None)
    with inject(faults, point):
        await outbox.publish(order(2, "k"), session=None)
    await publish(outbox.db, outbox, order(2, "k"), way)
    assert await handlers_by_event(odb) == {"e1": ["mail", "stats"], "e2": ["mail", "stats"]}
    # e1 was published first and is still pending: it must run first for each handler.
    assert [d.event.id for d in await outbox.claim("w", ["stats"])] == ["e1"]
    second = await delivery_of(odb, "e2", "stats")
    assert second is not None and second.get("sequence") == 2


# ------------------------------------------------------------------------------ transactions


class Rollback(Exception):
    pass


async def test_a_rolled_back_publish_leaves_nothing_and_takes_no_sequence(
    txdb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(txdb, clock)
    await _driver.create_collections(txdb, ["orders"])
    await publish_in_transaction(txdb, outbox, order(1, "k"))
    before = (await events(txdb), await deliveries(txdb))

    async def work(session: Any) -> None:
        await txdb["orders"].insert_one({"_id": "o2"}, session=session)
        result = await outbox.publish([order(2, "k"), order(3)], session=session)
        assert result == PublishResult(2, 4)
        raise Rollback

    with pytest.raises(Rollback):
        await _driver.run_in_transaction(txdb, work)
    assert (await events(txdb), await deliveries(txdb)) == before
    assert await sequence_counters(txdb) == {"k": 1}
    assert await txdb["orders"].find_one({"_id": "o2"}) is None

    await publish_in_transaction(txdb, outbox, order(2, "k"))
    second = await delivery_of(txdb, "e2", "mail")
    assert second is not None and second["sequence"] == 2


async def test_a_committed_publish_lands_with_the_business_write(
    txdb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(txdb, clock)
    await _driver.create_collections(txdb, ["orders"])

    async def work(session: Any) -> PublishResult:
        await txdb["orders"].insert_one({"_id": "o1", "total": 12}, session=session)
        return await outbox.publish([order(1, "k"), order(2, kind="order.paid")], session=session)

    assert await _driver.run_in_transaction(txdb, work) == PublishResult(2, 3)
    assert await txdb["orders"].find_one({"_id": "o1"}) == {"_id": "o1", "total": 12}
    assert set(await events(txdb)) == {"e1", "e2"}
    assert await handlers_by_event(txdb) == {"e1": ["mail", "stats"], "e2": ["stats"]}
    assert await sequence_counters(txdb) == {"k": 1}


async def test_sequences_follow_commit_order_across_conflicting_transactions(
    txdb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(txdb, clock)
    await publish_in_transaction(txdb, outbox, order(0, "k"))  # the counter exists
    first, second = await open_session(txdb), await open_session(txdb)
    # Transactions started with primary reads and majority writes, as docs/deployment.md asks:
    # a client whose default is secondary reads would have them refused otherwise.
    try:
        await done(first.start_transaction(**_driver.transaction_options()))
        await outbox.publish(order(1, "k"), session=first)
        await done(second.start_transaction(**_driver.transaction_options()))
        with pytest.raises(PyMongoError) as conflict:
            await outbox.publish(order(2, "k"), session=second)
        assert conflict.value.has_error_label("TransientTransactionError")
        await second.abort_transaction()
        await first.abort_transaction()  # the first one's business logic failed: it retries
        await done(second.start_transaction(**_driver.transaction_options()))
        await outbox.publish(order(2, "k"), session=second)
        await second.commit_transaction()
        await done(first.start_transaction(**_driver.transaction_options()))
        await outbox.publish(order(1, "k"), session=first)
        await first.commit_transaction()
    finally:
        await done(first.end_session())
        await done(second.end_session())
    found = {(d["event_id"], d["handler"]): d["sequence"] for d in await deliveries(txdb)}
    assert found == {
        ("e0", "mail"): 1, ("e0", "stats"): 1, ("e2", "mail"): 2, ("e2", "stats"): 2,
        ("e1", "mail"): 3, ("e1", "stats"): 3,
    }  # fmt: skip
    assert await sequence_counters(txdb) == {"k": 3}


async def test_an_event_that_would_pass_16_mib_as_a_whole_is_refused_before_any_write(
    odb: Any, clock: ManualClock
) -> None:
    """Payload and headers each under their own limit, but the event document with its id,
    type and key over the server's 16 MiB: refused with `InvalidInput` (a server would refuse
    the upsert with 17420, inside a caller's transaction aborting it)."""
    outbox = await new_outbox(odb, clock)
    payload = "x" * (MAX_PAYLOAD_BYTES - 64)
    headers = {"h": "y" * (60 * 1024)}
    big = Event(id="e1", type="order.placed", payload=payload, headers=headers, key="k" * 1024)
    with pytest.raises(InvalidInput, match=r"^events\[0\]: payload, headers, id, type and keys"):
        await outbox.publish([big], session=None)
    assert await odb[f"{PREFIX}events"].count_documents({}) == 0
    assert await odb[f"{PREFIX}deliveries"].count_documents({}) == 0
