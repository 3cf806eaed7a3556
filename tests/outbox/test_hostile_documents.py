"""Hostile data (DESIGN.md, "Hostile data"; issue 34): a delivery or an event document written
by hand, by another program or by a bad restore, that a claim, a settle or the dispatcher
cannot use, is set aside at its first encounter: the delivery becomes a dead letter whose
error names the field and what it holds, with one WARNING naming collection, item and field.
It never raises out of the dispatcher's run, never holds back the other deliveries (of its
key too), never stays leased, and stats() and the listings keep working.

Every test corrupts a stored document, runs, then reads the collections back. The shapes that
make a server refuse an update (``$inc`` of a non-number: code 14; ``$addToSet`` to a
non-array: code 2) run on every lane (`odb`): the embedded backend and the test engine of the
"tx" lane refuse them with the server's codes too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anyio
import bson
import pytest
from pymongo.errors import BulkWriteError

from mongoq import UnreadableDocument
from mongoq.outbox import AsyncOutbox, DeliveryContext, Event, lane_of
from mongoq.testing import ManualClock
from tests.support.helpers import set_asides
from tests.support.outbox_helpers import (
    LEASE,
    ONLY_H,
    deliveries,
    delivery_of,
    dispatcher,
    event,
    events,
    faulty_outbox,
    key_in_lane,
    lanes,
    new_outbox,
    publish_in_transaction,
)

DELIVERIES = "ob_deliveries"
EVENTS = "ob_events"


async def published(db: Any, clock: ManualClock, key: str | None = None) -> AsyncOutbox:
    """An outbox of `ONLY_H` with e1, e2 and e3 published (of `key`, in that order)."""
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H)
    await outbox.publish([event(1, key), event(2, key), event(3, key)], session=None)
    return outbox


async def dispatch(
    outbox: AsyncOutbox, handle: Callable[..., Any] | None = None, **options: Any
) -> list[str]:
    """Run a dispatcher of "h" until nothing is claimable (bounded); returns the event ids it
    ran, in order."""
    ran: list[str] = []

    async def record(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)
        if handle is not None:
            await handle(event, context)

    with anyio.fail_after(10):
        await dispatcher(outbox, {"h": record}, **options).run(stop_when_empty=True)
    return ran


async def corrupt(db: Any, event_id: str, update: dict[str, Any]) -> Any:
    """Apply `update` to the delivery of `event_id` to "h"; returns its ``_id``."""
    doc = await delivery_of(db, event_id, "h")
    assert doc is not None
    await db[DELIVERIES].update_one({"_id": doc["_id"]}, update)
    return doc["_id"]


async def assert_set_aside(db: Any, doc_id: Any, field: str, found: str) -> dict[str, Any]:
    """The delivery `doc_id` is a dead letter saying its `field` holds `found`, out of every
    pending index and listed by no lane; returns it."""
    doc = await db[DELIVERIES].find_one({"_id": doc_id})
    assert doc is not None
    assert doc["status"] == "dead"
    assert "due_at" not in doc and "lane" not in doc
    assert f"field '{field}' holds {found}" in doc["last_error"]
    listed = [e["d"] for lane in (await lanes(db)).values() for e in lane["in_flight"]]
    assert doc["_id"] not in listed
    return doc


async def assert_operator_views_work(outbox: AsyncOutbox, dead: int = 1) -> None:
    stats = await outbox.stats()
    assert (stats.pending, stats.dead, stats.running) == (0, dead, 0)
    listed = await outbox.list_deliveries()
    assert [info.status for info in listed] == ["dead"] * dead


# ------------------------------------------------------------------ deliveries a claim meets

#: name -> (update of e1's delivery, the field named, what the error says it holds)
DELIVERY_SHAPES: dict[str, tuple[dict[str, Any], str, str]] = {
    "attempts a string": ({"$set": {"attempts": "x"}}, "attempts", "a string ('x')"),
    "attempts null": ({"$set": {"attempts": None}}, "attempts", "null"),
    "attempts missing": ({"$unset": {"attempts": ""}}, "attempts", "nothing"),
    "attempts negative": ({"$set": {"attempts": -1}}, "attempts", "an int (-1)"),
    "claims a string": ({"$set": {"claims": "x"}}, "claims", "a string ('x')"),
    "claims null": ({"$set": {"claims": None}}, "claims", "null"),
    "claims a fraction": ({"$set": {"claims": 2.5}}, "claims", "a float (2.5)"),
    "lane_id a string": ({"$set": {"lane_id": "x"}}, "lane_id", "a string ('x')"),
    "lane_id out of range": ({"$set": {"lane_id": 999}}, "lane_id", "an int (999)"),
    "event_id a document": ({"$set": {"event_id": {"a": 1}}}, "event_id", "a document"),
    "status missing": ({"$unset": {"status": ""}}, "status", "nothing"),
    "status unknown": ({"$set": {"status": "sleeping"}}, "status", "a string ('sleeping')"),
    "sequence a string": ({"$set": {"sequence": "x"}}, "sequence", "a string ('x')"),
}


@pytest.mark.parametrize("shape", DELIVERY_SHAPES)
async def test_an_unusable_delivery_is_set_aside_at_its_claim_and_the_others_run(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, shape: str
) -> None:
    update, field, found = DELIVERY_SHAPES[shape]
    outbox = await published(odb, clock)
    doc_id = await corrupt(odb, "e1", update)

    assert sorted(await dispatch(outbox)) == ["e2", "e3"]

    await assert_set_aside(odb, doc_id, field, found)
    item = "e1/h" if field != "event_id" else "{'a': 1}/h"
    assert set_asides(caplog) == [(DELIVERIES, item, field, "buried")]
    await assert_operator_views_work(outbox)


async def test_a_delivery_whose_id_is_no_object_id_is_set_aside(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await published(odb, clock)
    doc = await delivery_of(odb, "e1", "h")
    assert doc is not None
    await odb[DELIVERIES].delete_one({"_id": doc["_id"]})
    await odb[DELIVERIES].insert_one({**doc, "_id": "not-an-object-id"})

    assert sorted(await dispatch(outbox)) == ["e2", "e3"]

    await assert_set_aside(odb, "not-an-object-id", "_id", "a string ('not-an-object-id')")
    assert set_asides(caplog) == [(DELIVERIES, "e1/h", "_id", "buried")]
    await assert_operator_views_work(outbox)


#: name -> (update of e1's delivery (the head of key k), the field, what it holds)
KEYED_SHAPES: dict[str, tuple[dict[str, Any], str, str]] = {
    "sequence a string": ({"$set": {"sequence": "x"}}, "sequence", "a string ('x')"),
    "sequence null": ({"$set": {"sequence": None}}, "sequence", "null"),
    "sequence missing": ({"$unset": {"sequence": ""}}, "sequence", "nothing"),
    "key a document": ({"$set": {"key": {"a": 1}}}, "key", "a document"),
    "key a number": ({"$set": {"key": 5}}, "key", "an int (5)"),
    "attempts a string": ({"$set": {"attempts": "x"}}, "attempts", "a string ('x')"),
    "claims a fraction": ({"$set": {"claims": 0.5}}, "claims", "a float (0.5)"),
    # never scanned (the claim reads only dates), but the head of its key: found by the
    # look-up of what comes before its followers
    "due_at a string": ({"$set": {"due_at": "soon"}}, "due_at", "a string ('soon')"),
    "lane unknown": ({"$set": {"lane": "x"}}, "lane", "a string ('x')"),
    "lane missing": ({"$unset": {"lane": ""}}, "lane", "nothing"),
}


@pytest.mark.parametrize("shape", KEYED_SHAPES)
async def test_an_unusable_head_of_a_key_is_set_aside_and_its_followers_run_in_order(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, shape: str
) -> None:
    update, field, found = KEYED_SHAPES[shape]
    outbox = await published(odb, clock, key="k")
    doc_id = await corrupt(odb, "e1", update)

    ran: list[str] = []
    for _ in range(3):  # one run claims one delivery of the key at a time
        ran += await dispatch(outbox)
    assert ran == ["e2", "e3"]

    await assert_set_aside(odb, doc_id, field, found)
    assert set_asides(caplog) == [(DELIVERIES, "e1/h", field, "buried")]
    await assert_operator_views_work(outbox)


async def test_an_unusable_follower_is_set_aside_and_never_blocks_the_key(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await published(odb, clock, key="k")
    doc_id = await corrupt(odb, "e2", {"$set": {"attempts": "x"}})

    ran: list[str] = []
    for _ in range(3):
        ran += await dispatch(outbox)
    assert ran == ["e1", "e3"]
    await assert_set_aside(odb, doc_id, "attempts", "a string ('x')")
    assert set_asides(caplog) == [(DELIVERIES, "e2/h", "attempts", "buried")]


async def test_an_unusable_due_time_no_claim_scans_is_set_aside_by_a_dispatcher_draining(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await published(odb, clock)
    doc_id = await corrupt(odb, "e1", {"$set": {"due_at": "2020-01-01"}})
    # stats reads past it: the oldest due time is a real one
    stats = await outbox.stats()
    assert stats.pending == 3 and stats.oldest_due_at is not None

    ran: list[str] = []

    async def record(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)

    with anyio.fail_after(10):
        await dispatcher(outbox, {"h": record}).run(stop_when_drained=True)

    assert sorted(ran) == ["e2", "e3"]
    await assert_set_aside(odb, doc_id, "due_at", "a string ('2020-01-01')")
    assert set_asides(caplog) == [(DELIVERIES, "e1/h", "due_at", "buried")]
    await assert_operator_views_work(outbox)


# ---------------------------------------------------------------------- events a claim meets

#: name -> (update of event e1, the field, what it holds)
EVENT_SHAPES: dict[str, tuple[dict[str, Any], str, str]] = {
    "type missing": ({"$unset": {"type": ""}}, "type", "nothing"),
    "type a number": ({"$set": {"type": 7}}, "type", "an int (7)"),
    "handlers a string": ({"$set": {"handlers": "h"}}, "handlers", "a string ('h')"),
    "finished a number": ({"$set": {"finished": 1}}, "finished", "an int (1)"),
    "headers a string": ({"$set": {"headers": "x"}}, "headers", "a string ('x')"),
    "key a number": ({"$set": {"key": 5}}, "key", "an int (5)"),
    "created_at a string": ({"$set": {"created_at": "today"}}, "created_at", "a string ('today')"),
    "completed_at a string": ({"$set": {"completed_at": "x"}}, "completed_at", "a string ('x')"),
}


@pytest.mark.parametrize("shape", EVENT_SHAPES)
async def test_a_delivery_of_an_unusable_event_is_set_aside_and_the_event_kept(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, shape: str
) -> None:
    update, field, found = EVENT_SHAPES[shape]
    outbox = await published(odb, clock)
    await odb[EVENTS].update_one({"_id": "e1"}, update)
    before = (await events(odb))["e1"]
    stored = await delivery_of(odb, "e1", "h")
    assert stored is not None

    assert sorted(await dispatch(outbox)) == ["e2", "e3"]

    doc = await assert_set_aside(odb, stored["_id"], field, found)
    assert doc["last_error"].startswith("event 'e1': ")
    assert (await events(odb))["e1"] == before  # left for the operator to see and fix
    assert set_asides(caplog) == [(EVENTS, "e1/h", field, "buried")]
    await assert_operator_views_work(outbox)


# --------------------------------------------------- documents that change while a claim runs


@pytest.mark.parametrize("max_attempts", [1, 3], ids=["bury", "retry"])
async def test_a_delivery_whose_attempts_break_while_it_runs_is_set_aside_at_its_settle(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, max_attempts: int
) -> None:
    outbox = await published(odb, clock)

    async def fail_after_edit(event: Event, context: DeliveryContext) -> None:
        if event.id == "e1":
            await corrupt(odb, "e1", {"$set": {"attempts": "x"}})
            raise RuntimeError("failed")

    stored = await delivery_of(odb, "e1", "h")
    assert stored is not None

    # The settle's $inc of attempts is refused (code 14): the delivery is set aside instead.
    assert sorted(await dispatch(outbox, fail_after_edit, max_attempts=max_attempts)) == [
        "e1", "e2", "e3",
    ]  # fmt: skip
    await assert_set_aside(odb, stored["_id"], "attempts", "a string ('x')")
    assert set_asides(caplog) == [(DELIVERIES, "e1/h", "attempts", "buried")]
    assert [d["event_id"] for d in await deliveries(odb)] == ["e1"]
    await assert_operator_views_work(outbox)


async def test_a_delivery_whose_generation_breaks_while_it_runs_is_set_aside_at_its_next_claim(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await published(odb, clock)

    async def edit(event: Event, context: DeliveryContext) -> None:
        if event.id == "e1":
            await corrupt(odb, "e1", {"$set": {"claims": "x"}})

    stored = await delivery_of(odb, "e1", "h")
    assert stored is not None
    # Its completion no longer matches its claim; the next claim finds it.
    assert sorted(await dispatch(outbox, edit)) == ["e1", "e2", "e3"]
    await assert_set_aside(odb, stored["_id"], "claims", "a string ('x')")
    assert set_asides(caplog) == [(DELIVERIES, "e1/h", "claims", "buried")]
    await assert_operator_views_work(outbox)


async def test_a_lost_delivery_whose_attempts_break_is_set_aside_and_its_lane_taken_over(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    first = key_in_lane(lane_of("a0"), "a")
    second = key_in_lane(lane_of("a0"), "b")  # another key, the same lane
    await outbox.publish([event(1, first), event(2, second)], session=None)
    claimed = await outbox.claim("A", limit=2)
    assert sorted(d.event.id for d in claimed) == ["e1", "e2"]
    doc_id = await corrupt(odb, "e1", {"$set": {"attempts": "x"}})
    clock.advance(LEASE + 1)  # A is gone

    # B takes the lane over and charges what A ran: e1's charge is refused (code 14).
    [again] = await outbox.claim("B", limit=2)
    assert (again.event.id, again.attempt) == ("e2", 2)
    await assert_set_aside(odb, doc_id, "attempts", "a string ('x')")
    assert set_asides(caplog) == [(DELIVERIES, "e1/h", "attempts", "buried")]
    lane = (await lanes(odb))[lane_of(first)]
    assert lane["owner"] == "B" and lane["lost"] == []


async def test_a_parked_delivery_whose_sequence_breaks_is_set_aside_when_unparked(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await published(odb, clock, key="k")
    [head] = await outbox.claim("A")
    assert await outbox.reschedule(head, delay=60)
    assert await outbox.claim("A") == []  # e2 and e3 wait behind a head not due: parked
    assert [d.get("lane") for d in await deliveries(odb)] == ["ready", "parked", "parked"]
    doc_id = await corrupt(odb, "e2", {"$set": {"sequence": None}})
    clock.advance(61)

    ran: list[str] = []
    for _ in range(3):
        ran += await dispatch(outbox)
    assert ran == ["e1", "e3"]
    await assert_set_aside(odb, doc_id, "sequence", "null")
    assert set_asides(caplog) == [(DELIVERIES, "e2/h", "sequence", "buried")]


async def test_a_completion_whose_event_refuses_its_record_sets_the_delivery_aside(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    # What a server answers when an event's `handlers` stopped being an array while its
    # delivery ran, in a server's words (tests/outbox/test_refused_completions.py: refused
    # by the backend itself).
    outbox, faults = await faulty_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish(event(1), session=None)
    [claimed] = await outbox.claim("A")
    await odb[EVENTS].update_one({"_id": "e1"}, {"$set": {"handlers": "h"}})
    refusal = {
        "writeErrors": [{"index": 0, "code": 2, "errmsg": "Cannot apply $addToSet to non-array "
                         "field. Field named 'handlers' has non-array type string"}],
        "writeConcernErrors": [], "nInserted": 0, "nUpserted": 0, "nMatched": 0,
        "nModified": 0, "nRemoved": 0, "upserted": [],
    }  # fmt: skip
    faults.fail_before("bulk_write", collection=EVENTS, error=BulkWriteError(refusal))

    assert await outbox.complete_many([claimed]) == [False]

    [doc] = await deliveries(odb)
    assert doc["status"] == "dead" and "due_at" not in doc
    assert doc["last_error"].startswith("event 'e1': ")
    assert "Cannot apply $addToSet" in doc["last_error"]
    assert set_asides(caplog) == [(EVENTS, "e1/h", "handlers", "buried")]
    assert isinstance(doc["_id"], bson.ObjectId)


async def test_a_key_counter_that_holds_no_number_refuses_the_publish_naming_it(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions={"*": ["h"]})
    await outbox.publish([Event(id="e1", type="t", key="k")], session=None)
    counters = outbox.sequences
    await counters.update_one({"_id": "k"}, {"$set": {"value": "x"}})

    with pytest.raises(UnreadableDocument) as refused:
        await outbox.publish([Event(id="e2", type="t", key="k")], session=None)

    assert (refused.value.collection, refused.value.field) == (counters.name, "value")
    assert await outbox.events.count_documents({"_id": "e2"}) == 0
    assert (await counters.find_one({"_id": "k"}) or {})["value"] == "x"


#: name -> (what a hand edit left in key k's counter, what the error says it holds, what the
#: publish's ``$inc`` leaves there: it is applied before the value is read)
UNREADABLE_COUNTERS: dict[str, tuple[Any, str, Any]] = {
    "NaN": (math.nan, "a float (nan)", math.nan),  # NaN + 2 is NaN: as it was
    "infinity": (math.inf, "a float (inf)", math.inf),
    "minus infinity": (-math.inf, "a float (-inf)", -math.inf),
    # a double beyond 2**53: an $inc of it may round the increment away (sequences twice)
    "a double too large": (2.0**60, "a float (1.152921504606847e+18)", 2.0**60),
}


def same_value(found: Any, expected: Any) -> bool:
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(found, float) and math.isnan(found)
    return bool(found == expected)


async def assert_counter_refused(
    outbox: AsyncOutbox, publish: Callable[[list[Event]], Any], found: str, left: Any
) -> None:
    """`publish` of e2 and e3 (of key k) raises `UnreadableDocument` naming k's counter and
    what it holds; nothing is written but the counter's own ``$inc`` (which leaves `left`)."""
    counters = outbox.sequences
    with pytest.raises(UnreadableDocument) as refused:
        await publish([Event(id="e2", type="t", key="k"), Event(id="e3", type="t", key="k")])

    error = refused.value
    assert (error.collection, error.document_id, error.field) == (counters.name, "k", "value")
    assert error.found == found
    assert sorted(await events(outbox.db)) == ["e1"]
    assert [d["event_id"] for d in await deliveries(outbox.db)] == ["e1"]
    assert same_value((await counters.find_one({"_id": "k"}) or {})["value"], left)


@pytest.mark.parametrize("shape", UNREADABLE_COUNTERS)
async def test_a_key_counter_that_holds_no_usable_number_refuses_the_publish_naming_it(
    odb: Any, clock: ManualClock, shape: str
) -> None:
    value, found, left = UNREADABLE_COUNTERS[shape]
    outbox = await new_outbox(odb, clock, subscriptions={"*": ["h"]})
    await outbox.publish([Event(id="e1", type="t", key="k")], session=None)
    await outbox.sequences.update_one({"_id": "k"}, {"$set": {"value": value}})

    async def publish(batch: list[Event]) -> Any:
        return await outbox.publish(batch, session=None)

    await assert_counter_refused(outbox, publish, found, left)


@pytest.mark.parametrize(
    ("value", "found"),
    [
        (bson.Decimal128("NaN"), "a Decimal128 (Decimal128('NaN'))"),
        (bson.Decimal128("-Infinity"), "a Decimal128 (Decimal128('-Infinity'))"),
        (math.nan, "a float (nan)"),
    ],
    ids=["decimal NaN", "decimal infinity", "NaN"],
)
@pytest.mark.parametrize("in_transaction", [False, True], ids=["plain", "transaction"])
async def test_a_key_counter_that_holds_no_usable_number_refuses_a_transactional_publish_too(
    txdb: Any, clock: ManualClock, value: Any, found: str, in_transaction: bool
) -> None:
    # (The embedded backends cannot add to a Decimal128: mongomock raises TypeError.)
    outbox = await new_outbox(txdb, clock, subscriptions={"*": ["h"]})
    await outbox.publish([Event(id="e1", type="t", key="k")], session=None)
    await outbox.sequences.update_one({"_id": "k"}, {"$set": {"value": value}})

    async def publish(batch: list[Event]) -> Any:
        if in_transaction:  # the caller's transaction aborts: its $inc is undone too
            return await publish_in_transaction(txdb, outbox, batch)
        return await outbox.publish(batch, session=None)

    await assert_counter_refused(outbox, publish, found, value)


@pytest.mark.parametrize(
    ("value", "after"),
    [(7.0, 9.0), (6.5, 8.5), (bson.Int64(7), 9)],
    ids=["a whole double", "a fraction", "an int64"],
)
async def test_a_key_counter_that_holds_another_numeric_type_goes_on_from_its_value(
    odb: Any, clock: ManualClock, value: Any, after: Any
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions={"*": ["h"]})
    await outbox.publish([Event(id="e1", type="t", key="k")], session=None)
    await outbox.sequences.update_one({"_id": "k"}, {"$set": {"value": value}})

    await outbox.publish(
        [Event(id="e2", type="t", key="k"), Event(id="e3", type="t", key="k")], session=None
    )

    stored = await events(odb)
    assert (stored["e2"]["sequence"], stored["e3"]["sequence"]) == (int(after) - 1, int(after))
    assert (await outbox.sequences.find_one({"_id": "k"}) or {})["value"] == after


async def test_a_key_counter_that_holds_a_decimal_goes_on_from_its_value(
    txdb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(txdb, clock, subscriptions={"*": ["h"]})
    await outbox.publish([Event(id="e1", type="t", key="k")], session=None)
    await outbox.sequences.update_one({"_id": "k"}, {"$set": {"value": bson.Decimal128("7")}})

    await outbox.publish([Event(id="e2", type="t", key="k")], session=None)
    await publish_in_transaction(txdb, outbox, [Event(id="e3", type="t", key="k")])

    stored = await events(txdb)
    assert (stored["e2"]["sequence"], stored["e3"]["sequence"]) == (8, 9)
    assert [d["sequence"] for d in await deliveries(txdb)] == [1, 8, 9]
    assert (await outbox.sequences.find_one({"_id": "k"}) or {})["value"] == bson.Decimal128("9")
