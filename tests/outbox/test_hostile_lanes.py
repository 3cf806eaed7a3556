"""Hostile data in the outbox's bookkeeping (DESIGN.md, "Hostile data"; issue 34): a lane or the
slots document edited by hand is repaired at its first encounter (one WARNING naming
collection, lane and field), the listings show a document they cannot read marked
`unreadable`, a requeue works on a dead letter whose bookkeeping fields were broken, and a
hand-built `Delivery` with fields of the wrong type is refused with `InvalidInput` naming the
field, before any command.

Every test reads the collections back after the call it makes.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

import anyio
import bson
import pytest

from mongoq.outbox import AsyncOutbox, Delivery, DeliveryContext, DeliveryInfo, Event, lane_of
from mongoq.testing import ManualClock
from tests.support.helpers import rejects, set_asides
from tests.support.outbox_helpers import (
    ONLY_H,
    SUBSCRIPTIONS,
    deliveries,
    delivery_of,
    dispatcher,
    event,
    lanes,
    new_outbox,
    stored,
)

LANES = "ob_lanes"
DELIVERIES = "ob_deliveries"


async def dispatch(outbox: AsyncOutbox, handlers: tuple[str, ...] = ("h",)) -> list[str]:
    ran: list[str] = []

    async def record(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)

    with anyio.fail_after(10):
        await dispatcher(outbox, dict.fromkeys(handlers, record)).run(stop_when_empty=True)
    return ran


def usable_lane(doc: dict[str, Any]) -> None:
    """Every field of a lane document has the type mongoq writes."""
    assert isinstance(doc["handler"], str) and doc["n"] == doc["_id"] % 256
    for name in ("epoch", "rev", "requeued"):
        assert isinstance(doc[name], int) and not isinstance(doc[name], bool), name
    assert doc["owner"] is None or isinstance(doc["owner"], str)
    assert doc["instance"] is None or isinstance(doc["instance"], str)
    assert isinstance(doc["lease_until"], datetime)
    for name in ("in_flight", "lost"):
        assert isinstance(doc[name], list)
        assert all(isinstance(e["g"], int) and isinstance(e["h"], str) for e in doc[name])


# -------------------------------------------------------------------------------- lanes

#: name -> (update of e1's lane, the field named)
LANE_SHAPES: dict[str, tuple[dict[str, Any], str]] = {
    "epoch a string": ({"$set": {"epoch": "x"}}, "epoch"),
    "epoch a fraction": ({"$set": {"epoch": 1.5}}, "epoch"),
    "rev missing": ({"$unset": {"rev": ""}}, "rev"),
    "rev a string": ({"$set": {"rev": "x"}}, "rev"),
    "requeued a string": ({"$set": {"requeued": "x"}}, "requeued"),
    "in_flight a string": ({"$set": {"in_flight": "x"}}, "in_flight"),
    "in_flight a broken entry": (
        {"$set": {"in_flight": [{"d": 1, "g": "x", "h": "h"}]}},
        "in_flight",
    ),
    "lost a number": ({"$set": {"lost": 3}}, "lost"),
    "handler missing": ({"$unset": {"handler": ""}}, "handler"),
    "n a string": ({"$set": {"n": "x"}}, "n"),
    "owner a number": ({"$set": {"owner": 5}}, "owner"),
    "lease_until a string": ({"$set": {"lease_until": "x"}}, "lease_until"),
    "write a number": ({"$set": {"write": 5}}, "write"),
}


@pytest.mark.parametrize("shape", LANE_SHAPES)
async def test_an_unreadable_lane_is_repaired_at_the_first_claim_and_nothing_stalls(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, shape: str
) -> None:
    update, field = LANE_SHAPES[shape]
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish([event(1), event(2), event(3)], session=None)
    lane_id = lane_of("e1")  # "h" has slot 0: its lane n is _id n
    await odb[LANES].update_one({"_id": lane_id}, update)

    # The operator's views work before any claim met it.
    assert (await outbox.stats()).pending == 3
    assert len(await outbox.list_deliveries()) == 3

    assert sorted(await dispatch(outbox)) == ["e1", "e2", "e3"]

    usable_lane((await lanes(odb))[lane_id])
    assert set_asides(caplog) == [(LANES, str(lane_id), field, "repaired")]
    assert await deliveries(odb) == []
    assert (await outbox.stats()).pending == 0


async def test_a_held_lane_whose_revision_breaks_is_repaired_by_the_renewal_and_stays_held(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H)
    await outbox.publish(event(1), session=None)
    [claimed] = await outbox.claim("A")
    lane_id = lane_of("e1")
    await db[LANES].update_one({"_id": lane_id}, {"$set": {"rev": "x"}})
    clock.advance(10)

    assert await outbox.extend_lease("A") == 1  # its $inc of rev was refused (code 14)

    lane = (await lanes(db))[lane_id]
    usable_lane(lane)
    assert lane["owner"] == "A" and [e["d"] for e in lane["in_flight"]] == [
        bson.ObjectId(claimed.id)
    ]
    assert set_asides(caplog) == [(LANES, str(lane_id), "rev", "repaired")]
    assert await outbox.complete(claimed)


async def test_a_requeue_counting_itself_in_a_broken_lane_repairs_it(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H)
    await outbox.publish(event(1), session=None)
    [claimed] = await outbox.claim("A")
    assert await outbox.bury(claimed, error="no")
    assert await outbox.relinquish("A") == 1
    lane_id = lane_of("e1")
    await db[LANES].update_one({"_id": lane_id}, {"$set": {"requeued": "x"}})

    assert await outbox.requeue("e1", "h")

    usable_lane((await lanes(db))[lane_id])
    assert set_asides(caplog) == [(LANES, str(lane_id), "requeued", "repaired")]
    assert await dispatch(outbox) == ["e1"]


async def test_an_unreadable_lane_of_no_handler_is_reported_once_and_claims_go_on(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish([event(1), event(2)], session=None)
    await odb[LANES].insert_one({"_id": 5 * 256, "epoch": "x"})  # slot 5: nobody's

    ran = []
    for _ in range(3):  # a claim of every handler reads every lane, that one too
        for claimed in await outbox.claim("A"):
            ran.append(claimed.event.id)
            assert await outbox.complete(claimed)
    assert sorted(ran) == ["e1", "e2"]
    assert set_asides(caplog) == [(LANES, "1280", "handler", "reported")]
    assert await odb[LANES].find_one({"_id": 5 * 256}) == {"_id": 5 * 256, "epoch": "x"}
    assert (await outbox.stats()).pending == 0


#: name -> update of the slots document
SLOTS_SHAPES: dict[str, dict[str, Any]] = {
    "handlers a string": {"$set": {"handlers": "stats"}},
    "handlers missing": {"$unset": {"handlers": ""}},
    "handlers of numbers": {"$set": {"handlers": [1, 2]}},
}


@pytest.mark.parametrize("shape", SLOTS_SHAPES)
async def test_an_unreadable_slots_document_is_rebuilt_from_the_lanes(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, shape: str
) -> None:
    outbox = await new_outbox(odb, clock)  # "stats" slot 0, "mail" slot 1
    await outbox.publish(Event(id="c1", type="order.created"), session=None)
    await odb[LANES].update_one({"_id": "slots"}, SLOTS_SHAPES[shape])
    fresh = AsyncOutbox(odb, "ob_", subscriptions=SUBSCRIPTIONS, lease_ttl=30, clock=clock)

    assert (await fresh.stats()).pending == 2
    assert sorted(await dispatch(fresh, ("mail", "stats"))) == ["c1", "c1"]

    slots = await odb[LANES].find_one({"_id": "slots"})
    assert slots["handlers"] == ["stats", "mail"]
    assert set_asides(caplog) == [(LANES, "slots", "handlers", "repaired")]


# ----------------------------------------------------------------------------- listings


async def test_listings_show_documents_they_cannot_read_marked_unreadable(
    odb: Any, clock: ManualClock
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H, completion_history=True)
    await outbox.publish([event(n) for n in range(1, 6)], session=None)
    for claimed in await outbox.claim("A", limit=1):
        assert await outbox.complete(claimed)  # one completion record
    edits = {
        "e2": {"$set": {"attempts": "x"}},
        "e3": {"$unset": {"status": ""}},
        "e4": {"$set": {"created_at": "yesterday", "sequence": "x"}},
        "e5": {"$set": {"event_type": 5}},
    }
    for event_id, update in edits.items():
        await odb[DELIVERIES].update_one({"event_id": event_id}, update)
    await odb["ob_completed_deliveries"].update_many({}, {"$set": {"attempts": None}})

    listed = {info.event_id: info for info in await outbox.list_deliveries()}

    assert sorted(listed) == ["e1", "e2", "e3", "e4", "e5"]
    assert listed["e2"].unreadable == "field 'attempts' holds a string ('x')"
    assert listed["e2"].attempts == 0 and listed["e2"].status == "pending"
    assert listed["e3"].unreadable == "field 'status' holds nothing"
    assert listed["e4"].unreadable == "field 'sequence' holds a string ('x')"
    assert listed["e4"].sequence is None
    assert listed["e5"].unreadable == "field 'event_type' holds an int (5)"
    assert listed["e1"].status == "completed"
    assert listed["e1"].unreadable == "field 'attempts' holds null"
    # what the dashboard's item page reads through
    doc = await delivery_of(odb, "e2", "h")
    assert DeliveryInfo.from_document(doc, False).unreadable is not None
    assert (await outbox.stats()).pending == 3  # (e3 is no pending one any more)


# ------------------------------------------------------------------------------ requeue


@pytest.mark.parametrize(
    "update",
    [{"$set": {"claims": "x"}}, {"$set": {"lane_id": "x"}}, {"$unset": {"lane_id": ""}},
     {"$set": {"attempts": None}}],
    ids=["claims a string", "lane_id a string", "lane_id missing", "attempts null"],
)  # fmt: skip
async def test_a_requeue_repairs_the_bookkeeping_of_a_dead_letter(
    odb: Any, clock: ManualClock, update: dict[str, Any]
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish(event(1, "k"), session=None)
    [claimed] = await outbox.claim("A")
    assert await outbox.bury(claimed, error="no")
    assert await outbox.relinquish("A") == 1
    await odb[DELIVERIES].update_one({"event_id": "e1"}, update)

    assert await outbox.requeue("e1", "h")

    doc = await delivery_of(odb, "e1", "h")
    assert doc is not None and doc["status"] == "pending"
    assert doc["lane_id"] == lane_of("k") and isinstance(doc["claims"], int)
    [again] = await outbox.claim("B")
    assert (again.event.id, again.attempt) == ("e1", 1)
    assert await outbox.complete(again)


# ------------------------------------------------------------------ hand-built deliveries

#: name -> (the changed fields of a claimed Delivery, the field named)
FORGED: dict[str, tuple[dict[str, Any], str]] = {
    "id an operator": ({"id": {"$gt": ""}}, "delivery.id"),
    "id no object id": ({"id": "abc"}, "delivery.id"),
    "token a document": ({"lease_token": {"$gt": ""}}, "delivery.lease_token"),
    "worker a document": ({"worker_id": {"$gt": ""}}, "delivery.worker_id"),
    "handler an operator": ({"handler": {"$gt": ""}}, "delivery.handler"),
    "event no Event": ({"event": "e1"}, "delivery.event"),
    "attempt a string": ({"attempt": "1"}, "delivery.attempt"),
    "sequence a string": ({"sequence": "1"}, "delivery.sequence"),
}
#: name -> (the changed fields of the claimed Delivery's event, the field named)
FORGED_EVENTS: dict[str, tuple[dict[str, Any], str]] = {
    "event id an operator": ({"id": {"$gt": ""}}, "delivery.event.id"),
    "event type a number": ({"type": 5}, "delivery.event.type"),
    "event key a document": ({"key": {"$gt": ""}}, "delivery.event.key"),
    "event created_at a string": ({"created_at": "x"}, "delivery.event.created_at"),
}


def forge(delivery: Delivery, shape: str) -> tuple[Delivery, str]:
    if shape in FORGED:
        changes, field = FORGED[shape]
        return dataclasses.replace(delivery, **changes), field
    changes, field = FORGED_EVENTS[shape]
    return dataclasses.replace(
        delivery, event=dataclasses.replace(delivery.event, **changes)
    ), field


@pytest.mark.parametrize("call", ["complete", "complete_many", "reschedule", "release", "bury"])
@pytest.mark.parametrize("shape", [*FORGED, *FORGED_EVENTS])
async def test_a_hand_built_delivery_with_wrong_typed_fields_is_refused_naming_the_field(
    odb: Any, clock: ManualClock, shape: str, call: str
) -> None:
    outbox = await new_outbox(odb, clock, subscriptions=ONLY_H)
    await outbox.publish(event(1, "k"), session=None)
    [claimed] = await outbox.claim("A")
    forged, field = forge(claimed, shape)
    before = [await stored(odb, name) for name in ("deliveries", "events", "lanes")]

    if call == "complete_many":
        with rejects(field.replace("delivery", "deliveries[0]", 1)):
            await outbox.complete_many([forged])
    else:
        calls = {
            "complete": lambda: outbox.complete(forged),
            "reschedule": lambda: outbox.reschedule(forged, delay=1),
            "release": lambda: outbox.release(forged),
            "bury": lambda: outbox.bury(forged),
        }
        with rejects(field):
            await calls[call]()

    assert [await stored(odb, name) for name in ("deliveries", "events", "lanes")] == before
    assert await outbox.complete(claimed)  # the real claim still holds
