"""Completions an event refuses (DESIGN.md, "Hostile data"): an event whose ``handlers`` (or
``finished``) was edited by hand to hold no array while its delivery ran refuses the completion
record (``$addToSet`` of a non-array: code 2). That delivery is set aside, a dead letter naming
the field, and the others of the batch complete, with ``completion_history`` too: on a replica
set the refusal aborts the completion's transaction (nothing of it written), and the set-aside
and the completion of the rest follow it, outside it. It is never run again.

Any other write error (a validator's 121, a size refusal) completes nothing and sets nothing
aside: the completion raises, as the server said.

Every test edits a stored document, completes, then reads the collections back. They run on
every lane of the outbox (`odb`): the embedded backends and the transactional test engine
refuse as a server does (code 2), the engine inside a transaction (aborting it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
from pymongo.errors import BulkWriteError

from mongoq.outbox import AsyncOutbox, DeliveryContext, Event
from mongoq.testing import ManualClock
from tests.support.helpers import set_asides
from tests.support.outbox_helpers import (
    ONLY_H,
    deliveries,
    dispatcher,
    event,
    events,
    faulty_outbox,
    new_outbox,
)

DELIVERIES = "ob_deliveries"
EVENTS = "ob_events"
HISTORY = "ob_completed_deliveries"
NOT_AN_ARRAY = {"$set": {"handlers": "h"}}


async def published(db: Any, clock: ManualClock, count: int = 3) -> AsyncOutbox:
    """An outbox of `ONLY_H` keeping its completion history, with e1...e<count> published."""
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H, completion_history=True)
    await outbox.publish([event(n) for n in range(1, count + 1)], session=None)
    return outbox


async def recorded(db: Any) -> list[str]:
    """The event ids of the completion records, sorted."""
    return sorted(doc["event_id"] for doc in await db[HISTORY].find({}).to_list(None))


async def assert_completed(db: Any, event_ids: Sequence[str]) -> None:
    """Exactly `event_ids` completed: their deliveries gone, their events listing "h" as
    finished, one completion record each."""
    stored = await events(db)
    for event_id in event_ids:
        assert stored[event_id]["handlers"] == ["h"]
        assert stored[event_id]["finished"] == ["h"]
        assert "completed_at" in stored[event_id]
    left = {doc["event_id"] for doc in await deliveries(db)}
    assert not left & set(event_ids)
    assert await recorded(db) == sorted(event_ids)


async def assert_refused(db: Any, event_ids: Sequence[str]) -> None:
    """The deliveries of `event_ids` are dead letters naming their event's ``handlers``, and
    their events are as edited (nothing of the aborted completion written)."""
    stored = await events(db)
    docs = {doc["event_id"]: doc for doc in await deliveries(db)}
    assert sorted(docs) == sorted(event_ids)
    for event_id in event_ids:
        doc = docs[event_id]
        assert doc["status"] == "dead"
        assert "due_at" not in doc and "lane" not in doc
        assert doc["last_error"].startswith(f"event {event_id!r}: field 'handlers' holds a string")
        assert "(the server refused: " in doc["last_error"]
        assert stored[event_id]["handlers"] == "h"
        assert "finished" not in stored[event_id] and "completed_at" not in stored[event_id]


@pytest.mark.parametrize(
    "refusing", [["e2"], ["e1", "e3"], ["e1", "e2", "e3"]], ids=["one", "two", "all"]
)
async def test_a_batch_completion_sets_aside_what_its_events_refuse_and_completes_the_rest(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, refusing: list[str]
) -> None:
    outbox = await published(odb, clock)
    claimed = await outbox.claim("A", limit=3)
    assert sorted(d.event.id for d in claimed) == ["e1", "e2", "e3"]
    for event_id in refusing:
        await odb[EVENTS].update_one({"_id": event_id}, NOT_AN_ARRAY)

    done = await outbox.complete_many(claimed)

    assert done == [d.event.id not in refusing for d in claimed]
    await assert_refused(odb, refusing)
    await assert_completed(odb, [e for e in ("e1", "e2", "e3") if e not in refusing])
    assert sorted(set_asides(caplog)) == [
        (EVENTS, f"{e}/h", "handlers", "buried") for e in refusing
    ]
    stats = await outbox.stats()
    assert (stats.pending, stats.dead, stats.running) == (0, len(refusing), 0)
    assert await outbox.claim("A", limit=3) == []  # never run again


async def test_a_completion_whose_event_refuses_its_record_sets_its_delivery_aside(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await published(odb, clock, count=1)
    [claimed] = await outbox.claim("A")
    await odb[EVENTS].update_one({"_id": "e1"}, NOT_AN_ARRAY)

    assert await outbox.complete(claimed) is False

    await assert_refused(odb, ["e1"])
    assert await recorded(odb) == []
    assert set_asides(caplog) == [(EVENTS, "e1/h", "handlers", "buried")]
    assert await outbox.claim("A") == []


async def test_a_dispatcher_runs_a_delivery_whose_event_refuses_its_record_once(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await published(odb, clock)
    ran: list[str] = []

    async def edit_while_running(event: Event, context: DeliveryContext) -> None:
        ran.append(event.id)
        if event.id == "e1":
            await odb[EVENTS].update_one({"_id": "e1"}, NOT_AN_ARRAY)

    with anyio.fail_after(10):
        await dispatcher(outbox, {"h": edit_while_running}).run(stop_when_empty=True)

    assert sorted(ran) == ["e1", "e2", "e3"]  # e1 once: its side effects are not repeated
    await assert_refused(odb, ["e1"])
    await assert_completed(odb, ["e2", "e3"])
    assert set_asides(caplog) == [(EVENTS, "e1/h", "handlers", "buried")]
    stats = await outbox.stats()
    assert (stats.pending, stats.dead, stats.running) == (0, 1, 0)


def refusal(code: int, message: str) -> BulkWriteError:
    """A bulk write's refusal of its first write, as a server answers it."""
    return BulkWriteError({
        "writeErrors": [{"index": 0, "code": code, "errmsg": message}],
        "writeConcernErrors": [], "nInserted": 0, "nUpserted": 0, "nMatched": 0,
        "nModified": 0, "nRemoved": 0, "upserted": [],
    })  # fmt: skip


@pytest.mark.parametrize("history", [False, True], ids=["plain", "history"])
@pytest.mark.parametrize(
    ("code", "message"),
    [(121, "Document failed validation"), (17419, "Resulting document after update is larger")],
    ids=["validator", "size"],
)
async def test_another_refusal_of_a_completion_record_raises_and_sets_nothing_aside(
    odb: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, code: int, message: str,
    history: bool,
) -> None:  # fmt: skip
    # Not an event refusing its record for a field of the wrong type: nothing says the
    # deliveries cannot complete, so they are left at their claims (freed by the next one).
    outbox, faults = await faulty_outbox(
        odb, clock, subscriptions=ONLY_H, completion_history=history
    )
    await outbox.publish([event(1), event(2)], session=None)
    claimed = await outbox.claim("A", limit=2)
    faults.fail_before("bulk_write", collection=EVENTS, error=refusal(code, message))

    with pytest.raises(BulkWriteError) as raised:
        await outbox.complete_many(claimed)

    assert raised.value.details["writeErrors"][0]["code"] == code
    docs = await deliveries(odb)
    assert sorted(d["event_id"] for d in docs) == ["e1", "e2"]
    assert {d["status"] for d in docs} == {"pending"}
    assert set_asides(caplog) == []
    assert await recorded(odb) == []
    # Freed by the next claim (no attempt counted), and then completed.
    clock.advance(31)
    again = await outbox.claim("B", limit=2)
    assert sorted(d.event.id for d in again) == ["e1", "e2"]
    assert await outbox.complete_many(again) == [True, True]
