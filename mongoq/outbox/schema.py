"""The outbox's storage: the layout of its five collections, their indexes, and every filter and
update `AsyncOutbox` and its claim (`mongoq.outbox.claim`) send, each a named function beside
the index that serves it. No I/O.

Collections (``<prefix>`` defaults to ``mongoq_outbox_``):

- ``events``: ``{_id: event id, type, payload, headers, key?, correlation_id?, causation_id?,
  sequence?, created_at, stored_at (the clock's, at its last publish), handlers: [the handlers
  whose delivery completed or died, and those a transactional publish wrote], finished: [those
  that completed or died], completed_at?}``;
- ``deliveries``: one per unfinished (or dead) event and handler: ``{_id: ObjectId, event_id,
  event_type, handler, key?, sequence?, lane_id, lane: "ready"|"parked", parked_key?, status:
  "pending"|"dead", due_at, attempts, claims, last_error?, requeue_uncounted?, created_at,
  updated_at}``. ``due_at`` and ``lane`` exist only while pending; ``attempts`` counts attempts
  that ended; ``claims`` is the claim generation (moves on whenever a claim of the delivery
  ends), which fences every settle. A completion deletes the document;
- ``key_sequences``: ``{_id: key, value}``, the per-key sequence counter;
- ``lanes``: 256 lane documents a handler and the slots, see
  `mongoq.outbox.lanes`;
- ``completed_deliveries`` (with ``completion_history``): one record per completion:
  ``{_id: the delivery's _id, event_id, event_type, handler, key?, sequence?, attempts, worker_id,
  created_at, completed_at}``.

Indexes (created by `setup`) and the queries they serve:

- deliveries ``event_handler`` ``(event_id, handler)`` unique: backstop of the idempotent append,
  lookups by event;
- deliveries ``claim`` ``(lane_id, due_at, _id, handler)`` partial ``lane: "ready"``: the claim
  scan, a merge of one index range per lane (at most 200 lanes per query, 100 past a first
  page); ``ready`` ``(due_at, _id, handler)`` partial ``lane: "ready"``: the claim scan when
  every lane is the claimer's or free (one range, due order across all lanes);
- deliveries ``ordering`` ``(handler, key, sequence)`` partial on pending keyed deliveries: what
  comes before the candidate heads of keys (one range a key, all keys in one query);
- deliveries ``parked_keys`` ``(lane, parked_key, sequence)`` partial ``lane: "parked"``:
  unparking (a distinct scan, on 6.0 too: ``lane`` is a key), the parked count and listing;
- deliveries ``due`` ``(due_at)`` partial on pending: `stats` (oldest due);
- deliveries ``status`` ``(status, _id)``, ``handler`` ``(handler, _id)``, ``event_type``
  ``(event_type, _id)``: counts and listings (``_id`` is an ObjectId: creation order);
  ``status_updated`` ``(status, updated_at)``: purge of dead deliveries;
- events ``created`` ``(created_at, _id)`` and ``completed`` ``(completed_at, _id)``: purge;
- completed_deliveries ``completed`` ``(completed_at, _id)``: purge; ``event``
  ``(event_id)``: references; ``handler`` ``(handler, _id)``, ``event_type``
  ``(event_type, _id)``: listing.

The lanes have no secondary index: an instance's lane view reads the ``_id`` ranges of its
claims' handlers now and then (the whole collection for a claim of every handler;
`mongoq.outbox.lanes`), and every write to a lane names its ``_id`` (`extend_lease` and
`relinquish` scan them for the owner's). Every time is the injected clock's
(`mongoq.clock`), passed in as ``now``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import bson

from mongoq import _driver
from mongoq._collections import DELIVERIES, EVENTS, HISTORY, LANES, SEQUENCES
from mongoq._indexes import IndexSpec

if TYPE_CHECKING:
    # (annotations only: the models read stored documents through `mongoq.outbox.quarantine`,
    # which reads this module)
    from mongoq.outbox.models import Delivery, Entry, Event

__all__ = [
    "CLAIM_INDEX",
    "COLLECTIONS",
    "DELIVERIES",
    "DUE_INDEX",
    "EVENTS",
    "HISTORY",
    "INDEXES",
    "IndexSpec",
    "LANES",
    "ORDERING_INDEX",
    "PARKED_INDEX",
    "READY_INDEX",
    "SEQUENCES",
]

#: The collections, by the name that follows the prefix, in the order `setup` creates them.
COLLECTIONS = (EVENTS, DELIVERIES, SEQUENCES, LANES, HISTORY)

READY = "ready"
PARKED = "parked"
PENDING = "pending"
DEAD = "dead"
COMPLETED = "completed"

#: A claim of a delivery: (its ``_id``, its claim generation then).
Claim = tuple[Any, int]


def after_key(field: str, value: Any, last_id: Any) -> dict[str, Any]:
    """The documents after ``(value, last_id)`` in ``(field, _id)`` order: the next page of a
    keyset scan (the claim scan, purge of events); served by the index that serves the scan."""
    return {"$or": [{field: {"$gt": value}}, {field: value, "_id": {"$gt": last_id}}]}


def with_ids(query: Mapping[str, Any], ids: Sequence[Any]) -> dict[str, Any]:
    """`query` narrowed to the documents `ids` (the deletes of purge repeat the query they read
    with, so that what changed since the read stays); served by ``_id``."""
    return {**query, "_id": {"$in": list(ids)}}


# ============================================================================== events

EVENT_CREATED = IndexSpec("created", (("created_at", 1), ("_id", 1)))
EVENT_COMPLETED = IndexSpec("completed", (("completed_at", 1), ("_id", 1)))
#: Seconds a never-completed event is kept at least after its publish stored it, whatever its
#: ``created_at``: longer than any publish between its two writes.
PUBLISH_GRACE = 600
#: Seconds a replay holds the deliveries it adds before it releases them (only a replay that
#: stopped midway leaves them held that long).
REPLAY_HOLD = 60
#: What a publish reads of an event that exists already.
EVENT_REPLAY_PROJECTION = {"handlers": 1, "finished": 1, "key": 1, "type": 1, "sequence": 1}


def event_document(event: Event, now: datetime, sequence: int | None) -> dict[str, Any]:
    """An event as stored, without ``_id`` and ``handlers`` (those the upserts write)."""
    doc: dict[str, Any] = {
        "type": event.type,
        "payload": event.payload,
        "headers": event.headers,
        "created_at": event.created_at or now,
        "stored_at": now,
    }
    for name in ("key", "correlation_id", "causation_id"):
        if getattr(event, name) is not None:
            doc[name] = getattr(event, name)
    if sequence is not None:
        # Kept on the event: a replay that adds a handler gives its delivery the same
        # sequence, so it never jumps ahead of the key's earlier deliveries.
        doc["sequence"] = sequence
    return doc


def event_by_id(event_id: str) -> dict[str, Any]:
    """One event: the upserts of `publish` (``_id``)."""
    return {"_id": event_id}


def events_by_ids(ids: Iterable[str]) -> dict[str, Any]:
    """Some events: a replay reading what exists, a claim reading its picks' events, a
    completion recording itself on its events (``_id``)."""
    return {"_id": {"$in": list(ids)}}


def _stored(document: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`document` without ``stored_at``, and the ``$max`` that writes it: every publish of an
    event moves it on (a purge leaves an event a publish just touched alone)."""
    rest = {k: v for k, v in document.items() if k != "stored_at"}
    return rest, {"stored_at": document["stored_at"]} if "stored_at" in document else {}


def event_inserting(document: Mapping[str, Any]) -> dict[str, Any]:
    """A non-transactional publish writing an event that lists no handler yet, or touching one
    that exists (`event_by_id`, upsert)."""
    rest, stored = _stored(document)
    update: dict[str, Any] = {"$setOnInsert": {**rest, "handlers": []}}
    if stored:
        update["$max"] = stored
    return update


def event_listing(
    handlers: Sequence[str], document: Mapping[str, Any] | None, now: datetime | None = None
) -> dict[str, Any]:
    """A publish listing `handlers` on an event, written whole (`document`) if it is missing,
    touched (``stored_at``) at `now` (`event_by_id`)."""
    update: dict[str, Any] = {"$addToSet": {"handlers": {"$each": list(handlers)}}}
    if document is not None:
        rest, _ = _stored(document)
        update["$setOnInsert"] = rest
    if now is not None:
        update["$max"] = {"stored_at": now}
    return update


def event_finishing(handlers: Sequence[str]) -> dict[str, Any]:
    """A burial listing its handler on its event, as finished (`event_by_id`)."""
    each = {"$each": list(handlers)}
    return {"$addToSet": {"handlers": each, "finished": each}}


def event_completing(now: datetime, handlers: Sequence[str]) -> dict[str, Any]:
    """A completion recorded on its event (`event_by_id`): the last one counts for purge, and
    its handlers are listed, as finished (a replay leaves them out)."""
    each = {"$each": list(handlers)}
    return {"$max": {"completed_at": now}, "$addToSet": {"handlers": each, "finished": each}}


def _published_before(instant: datetime) -> dict[str, Any]:
    """Events last published before `instant` (or before ``stored_at`` existed)."""
    return {"stored_at": {"$not": {"$gte": instant}}}


def event_uncompleted_before(cutoff: datetime, stored_before: datetime) -> dict[str, Any]:
    """Events that never completed, created before `cutoff` and stored before `stored_before`
    (a publish without a transaction writes its deliveries after its event: a purge leaves a
    young event alone, whatever ``created_at`` its caller gave it): purge (``created``)."""
    return {
        "completed_at": {"$exists": False},
        "created_at": {"$lt": cutoff},
        **_published_before(stored_before),
    }


def event_completed_before(cutoff: datetime, stored_before: datetime) -> dict[str, Any]:
    """Events whose last completion is before `cutoff`, not published since `stored_before`
    (a replay adding a delivery): purge (``completed``)."""
    return {"completed_at": {"$lt": cutoff}, **_published_before(stored_before)}


# ======================================================================= key_sequences


def sequence_of(key: str) -> dict[str, Any]:
    """The sequence counter of `key` (``_id``)."""
    return {"_id": key}


def sequence_taking(count: int) -> dict[str, Any]:
    """A keyed publish taking the next `count` sequences of its key (`sequence_of`, upsert)."""
    return {"$inc": {"value": count}}


# ========================================================================== deliveries


def delivery_document(
    event_id: str,
    event_type: str,
    handler: str,
    lane_id: int,
    key: str | None,
    sequence: int | None,
    now: datetime,
) -> dict[str, Any]:
    """A new delivery of event `event_id` to `handler`: pending, due now, ready in its lane."""
    doc: dict[str, Any] = {
        "_id": bson.ObjectId(),
        "event_id": event_id,
        "event_type": event_type,
        "handler": handler,
        "lane_id": lane_id,
        "lane": READY,
        "status": PENDING,
        "due_at": now,
        "attempts": 0,
        "claims": 0,
        "created_at": now,
        "updated_at": now,
    }
    if key is not None:
        doc["key"] = key
        doc["sequence"] = sequence
    return doc


# ------------------------------------------------------------------- the event_handler index

EVENT_HANDLER = IndexSpec("event_handler", (("event_id", 1), ("handler", 1)), unique=True)


def delivery_of(event_id: str, handler: str) -> dict[str, Any]:
    """The delivery of an event to a handler: a transactional publish's upsert
    (``event_handler``)."""
    return {"event_id": event_id, "handler": handler}


def delivery_inserting(document: Mapping[str, Any]) -> dict[str, Any]:
    """A transactional publish writing a delivery unless it exists (`delivery_of`, upsert)."""
    return {"$setOnInsert": document}


#: What `requeue` reads of a delivery first: whether there is anything to requeue, and where
#: (and what it repairs: `mongoq.outbox.quarantine.delivery_requeuing_repaired`).
REQUEUE_PROJECTION = {"lane_id": 1, "status": 1, "requeue_uncounted": 1, "claims": 1, "key": 1}


def delivery_dead(event_id: str, handler: str) -> dict[str, Any]:
    """The dead delivery of an event to a handler: `requeue` (``event_handler``)."""
    return {**delivery_of(event_id, handler), "status": DEAD}


def delivery_requeuing(now: datetime) -> dict[str, Any]:
    """`requeue` making a `delivery_dead` pending again, due now, attempts reset, marked until
    the requeue counted itself."""
    return {
        "$set": {"status": PENDING, "lane": READY, "due_at": now, "attempts": 0,
                 "updated_at": now, "requeue_uncounted": True},
        "$inc": {"claims": 1},
    }  # fmt: skip


def delivery_requeue_uncounted(event_id: str, handler: str) -> dict[str, Any]:
    """A delivery whose requeue has not counted itself yet: `requeue` (``event_handler``)."""
    return {**delivery_of(event_id, handler), "requeue_uncounted": True}


def delivery_requeue_counted() -> dict[str, Any]:
    """`requeue` clearing its mark (`delivery_requeue_uncounted`)."""
    return {"$unset": {"requeue_uncounted": ""}}


def deliveries_of_events(event_ids: Sequence[Any]) -> dict[str, Any]:
    """The deliveries (or completion records) of some events: purge's ``distinct`` of what is
    still referenced (``event_handler``; completed_deliveries ``event``)."""
    return {"event_id": {"$in": event_ids}}


# --------------------------------------------------------------------------- the claim index

CLAIM_INDEX = "claim"
CLAIM = IndexSpec(
    CLAIM_INDEX,
    (("lane_id", 1), ("due_at", 1), ("_id", 1), ("handler", 1)),
    partial={"lane": READY},
)
#: The claim order.
DUE_ORDER = [("due_at", 1), ("_id", 1)]
#: What the claim scan reads of a delivery (``status``: what a pick is checked for, see
#: `mongoq.outbox.quarantine`).
CLAIM_PROJECTION = {
    "event_id": 1, "handler": 1, "key": 1, "sequence": 1, "lane_id": 1,
    "attempts": 1, "claims": 1, "due_at": 1, "status": 1,
}  # fmt: skip


#: The claim scan when every lane is the claimer's or free: due order across all of them, which
#: no merge of ranges per lane can give (a server merges at most 200).
READY_INDEX = "ready"
READY_DELIVERIES = IndexSpec(
    READY_INDEX, (("due_at", 1), ("_id", 1), ("handler", 1)), partial={"lane": READY}
)


def delivery_due(
    lane_ids: Sequence[int] | None,
    now: datetime,
    handlers: Sequence[str] | None,
    after: tuple[datetime, Any] | None,
) -> dict[str, Any]:
    """The due, ready deliveries of `lane_ids` (of `handlers`), after ``(due_at, _id)``
    `after`: the claim scan, sorted by `DUE_ORDER` (``claim``, hinted); of every lane when
    `lane_ids` is None (``ready``, hinted)."""
    query: dict[str, Any] = {"lane": READY, "due_at": {"$lte": now}}
    if lane_ids is not None:
        query["lane_id"] = {"$in": list(lane_ids)}
    if handlers is not None:
        query["handler"] = {"$in": handlers}
    if after is not None:
        query.update(after_key("due_at", *after))
    return query


# ------------------------------------------------------------------------ the ordering index

ORDERING_INDEX = "ordering"
ORDERING = IndexSpec(
    ORDERING_INDEX,
    (("handler", 1), ("key", 1), ("sequence", 1)),
    partial={"due_at": {"$exists": True}, "key": {"$exists": True}},
)
#: What the head look-up reads of a delivery before a key's candidate.
HEAD_PROJECTION = {"_id": 1, "due_at": 1, "lane": 1, "handler": 1, "key": 1, "sequence": 1}


def deliveries_ahead(firsts: Iterable[tuple[str, str, int]]) -> dict[str, Any]:
    """The pending deliveries of each (handler, key, sequence) in `firsts` with a lower sequence
    of that handler and key: what comes before a candidate head (none: it is the head; else
    the lowest of them is). One query for any number of keys, a range of ``ordering`` each
    (hinted)."""
    clauses = [
        {"handler": handler, "key": key, "due_at": {"$exists": True}, "sequence": {"$lt": seq}}
        for handler, key, seq in firsts
    ]
    return clauses[0] if len(clauses) == 1 else {"$or": clauses}


# -------------------------------------------------------------------------- the parked index

PARKED_INDEX = "parked_keys"
#: ``parked_key``: one field for a parked delivery's (handler, key), so that unparking's
#: ``$group`` on it is a DISTINCT_SCAN (one index seek a key) on a server; a group on two
#: fields walks every parked entry. NUL is in neither a handler nor a key, and sorts first:
#: the field's order is the (handler, key) order.
#: ``lane`` leads although the filter fixes it: a key, its equality is a point bound; else 6.0
#: filters each fetch by it (7.0 drops it), and no filtered fetch becomes a distinct scan.
PARKED_DELIVERIES = IndexSpec(
    PARKED_INDEX, (("lane", 1), ("parked_key", 1), ("sequence", 1)), partial={"lane": PARKED}
)
_KEY_SEPARATOR = "\x00"


def parked_key(handler: str, key: str) -> str:
    """The ``parked_key`` of a parked delivery of `handler` and `key` (no query)."""
    return f"{handler}{_KEY_SEPARATOR}{key}"


def delivery_parked() -> dict[str, Any]:
    """The parked deliveries: `stats`' count (``parked_keys``, hinted)."""
    return {"lane": PARKED}


def delivery_parked_keys(
    handlers: Sequence[str] | None, after: tuple[str, str] | None, limit: int
) -> list[dict[str, Any]]:
    """The first `limit` parked (handler, key) pairs after `after` (within the span of
    `handlers`' names), each with its lowest parked delivery (``d``: _id, ``s``: sequence,
    ``t``: due_at, ``h``: handler, ``k``: key): unparking's aggregation, a distinct scan of
    ``parked_keys`` (hinted): one point of its first key (``lane``), one range of the second.

    One range of ``parked_key``: handlers named between the lowest and the highest of
    `handlers` are in it too (unparking their keys is harmless: it only moves a head nothing
    comes before back to its lane), so that the scan stays one range, which a distinct scan
    needs."""
    bounds: dict[str, Any] = {}
    if handlers:
        bounds["$gte"] = min(handlers) + _KEY_SEPARATOR
        bounds["$lt"] = max(handlers) + "\x01"
    if after is not None:
        bounds["$gt"] = parked_key(*after)
    match: dict[str, Any] = {"lane": PARKED}
    if bounds:
        match["parked_key"] = bounds
    first = {"$first": "$_id"}
    return [
        {"$match": match},
        {"$sort": {"parked_key": 1, "sequence": 1}},
        {"$group": {"_id": "$parked_key", "d": first, "s": {"$first": "$sequence"},
                    "t": {"$first": "$due_at"}, "h": {"$first": "$handler"},
                    "k": {"$first": "$key"}}},
        {"$sort": {"_id": 1}},
        {"$limit": limit},
    ]  # fmt: skip


def delivery_parkable(ids: Sequence[Any]) -> dict[str, Any]:
    """Deliveries a claim parks, if still pending and ready (``_id``)."""
    return {"_id": {"$in": list(ids)}, "lane": READY, "due_at": {"$exists": True}}


def delivery_parking() -> list[dict[str, Any]]:
    """A claim moving `delivery_parkable` deliveries out of the claim index (a pipeline
    update: each takes its ``parked_key``)."""
    return [{"$set": {"lane": PARKED, "parked_key": _parked_key_of_document()}}]


def _parked_key_of_document() -> dict[str, Any]:
    """`parked_key` of the document being updated, as an aggregation expression."""
    return {"$concat": ["$handler", _KEY_SEPARATOR, "$key"]}


def delivery_unparkable(ids: Sequence[Any]) -> dict[str, Any]:
    """Heads of keys a claim moves back, if still parked (``_id``)."""
    return {"_id": {"$in": list(ids)}, "lane": PARKED}


def delivery_unparking() -> dict[str, Any]:
    """A claim moving `delivery_unparkable` heads back into the claim index."""
    return {"$set": {"lane": READY}}


# ----------------------------------------------------------------------------- the due index

DUE_INDEX = "due"
DUE = IndexSpec(DUE_INDEX, (("due_at", 1),), partial={"due_at": {"$exists": True}})


def delivery_pending() -> dict[str, Any]:
    """The pending deliveries: `stats`' oldest due, the first by ``due_at`` (``due``, hinted)."""
    return {"due_at": {"$exists": True}}


def delivery_pending_dated() -> dict[str, Any]:
    """The pending deliveries whose due time is a date (one range of ``due``: dates only): `stats`'
    oldest due past one that holds no date, a hand edit (``due``, hinted)."""
    return {"due_at": {"$exists": True, "$type": "date"}}


def delivery_pending_for(handlers: Sequence[str]) -> dict[str, Any]:
    """The pending deliveries of `handlers` (parked and running ones included), the first by
    ``due_at``: what a drained dispatcher waits for (``due``, hinted)."""
    return {**delivery_pending(), "handler": {"$in": list(handlers)}}


# ----------------------------------------------- the status, handler and event_type indexes

STATUS = IndexSpec("status", (("status", 1), ("_id", 1)))
STATUS_UPDATED = IndexSpec("status_updated", (("status", 1), ("updated_at", 1)))
HANDLER = IndexSpec("handler", (("handler", 1), ("_id", 1)))
EVENT_TYPE = IndexSpec("event_type", (("event_type", 1), ("_id", 1)))


def delivery_in_status(status: str) -> dict[str, Any]:
    """The deliveries in `status`: `stats`' counts (``status``)."""
    return {"status": status}


def deliveries_dead_between(since: datetime, until: datetime | None) -> dict[str, Any]:
    """The deliveries buried in ``[since, until)``: `count_finished` (``status_updated``)."""
    return {"status": DEAD, "updated_at": _driver.within(since, until)}


def listed_by(handler: str | None, event_type: str | None) -> dict[str, Any]:
    """The deliveries (or completion records) of `handler` and `event_type`, either optional:
    `list_deliveries`, sorted by ``_id`` (``handler``, ``event_type``; completed_deliveries
    the same names)."""
    narrow: dict[str, Any] = {}
    if handler is not None:
        narrow["handler"] = handler
    if event_type is not None:
        narrow["event_type"] = event_type
    return narrow


def delivery_listed(
    status: str | None, handler: str | None, event_type: str | None
) -> dict[str, Any]:
    """The deliveries `list_deliveries` lists: by status (``status``), parked ones (``parked``,
    hinted, in key order), or all of them; narrowed by `listed_by`."""
    query = listed_by(handler, event_type)
    if status == PARKED:
        query["lane"] = PARKED
    elif status is not None:
        query["status"] = status
    return query


def delivery_dead_before(cutoff: datetime) -> dict[str, Any]:
    """Dead deliveries last updated before `cutoff`: purge (``status_updated``)."""
    return {"status": DEAD, "updated_at": {"$lt": cutoff}}


# -------------------------------------------------------- claims and settles (served by _id)


def delivery_fence(doc_id: Any, generation: int) -> dict[str, Any]:
    """The delivery of a claim, if the claim still holds (still pending at its generation):
    every single settle (``_id``)."""
    return {"_id": doc_id, "claims": generation, "due_at": {"$exists": True}}


def delivery_claimed(claims: Iterable[Claim]) -> dict[str, Any]:
    """The deliveries of `claims` still pending at their generations: a batch completion, what
    the live lanes run (`stats`, `list_deliveries`), freeing and charging claims (``_id``)."""
    return {**delivery_at_generation(claims), "due_at": {"$exists": True}}


def delivery_at_generation(claims: Iterable[Claim]) -> dict[str, Any]:
    """The deliveries of `claims` at their generations, pending or not: burying deliveries
    whose event is gone (``_id``)."""
    return _driver.owned_by(list(claims), "claims")


def deliveries_by_ids(ids: Sequence[Any]) -> dict[str, Any]:
    """Some deliveries: which of a batch completion are still there (``_id``)."""
    return {"_id": {"$in": list(ids)}}


def delivery_pending_by_ids(ids: Sequence[Any]) -> dict[str, Any]:
    """The pending ones of some deliveries: a claim looking up what its lanes list (``_id``)."""
    return {"_id": {"$in": list(ids)}, "due_at": {"$exists": True}}


def delivery_held(doc: Mapping[str, Any], until: datetime) -> dict[str, Any]:
    """A replay's new delivery, not due until `until`: written before the replay reads its
    event's handlers again, so no claim runs it meanwhile."""
    return {**doc, "due_at": until}


def deliveries_held(ids: Sequence[Any], until: datetime) -> dict[str, Any]:
    """A replay's held deliveries, if still as written (``_id``)."""
    return {"_id": {"$in": list(ids)}, "claims": 0, "due_at": until}


def delivery_releasing_held(now: datetime) -> dict[str, Any]:
    """A replay releasing its held deliveries (`deliveries_held`): due now."""
    return {"$set": {"due_at": now, "updated_at": now}}


def delivery_freeing(now: datetime) -> dict[str, Any]:
    """A claim ending without an attempt (`delivery_claimed`): claimable again, and any late
    settle of it refused."""
    return {"$inc": {"claims": 1}, "$set": {"updated_at": now}}


def delivery_charging(now: datetime) -> dict[str, Any]:
    """A claim lost with its lane charged its attempt (`delivery_claimed`)."""
    return {"$inc": {"attempts": 1, "claims": 1}, "$set": {"updated_at": now}}


def delivery_releasing(now: datetime) -> dict[str, Any]:
    """`release` (`delivery_fence`): due now, no attempt counted."""
    return {
        "$set": {"due_at": now, "lane": READY, "updated_at": now},
        "$inc": {"claims": 1},
    }


def delivery_rescheduling(now: datetime, delay: float, last_error: str | None) -> dict[str, Any]:
    """`reschedule` (`delivery_fence`): the attempt counted, due again after `delay` seconds."""
    return {
        "$set": {"due_at": now + timedelta(seconds=delay), "lane": READY,
                 "last_error": last_error, "updated_at": now},
        "$inc": {"attempts": 1, "claims": 1},
    }  # fmt: skip


def delivery_burying(last_error: str | None, now: datetime, *, charge: bool) -> dict[str, Any]:
    """`bury` (`delivery_fence`, the attempt charged), and a claim burying deliveries whose
    event is gone (`delivery_at_generation`): a dead letter, out of every pending index."""
    return {
        "$set": {"status": DEAD, "last_error": last_error, "updated_at": now},
        "$unset": {"due_at": "", "lane": ""},
        "$inc": {"claims": 1, "attempts": 1 if charge else 0},
    }


# ================================================================= completed_deliveries

HISTORY_COMPLETED = IndexSpec("completed", (("completed_at", 1), ("_id", 1)))
HISTORY_EVENT = IndexSpec("event", (("event_id", 1),))
HISTORY_HANDLER = IndexSpec("handler", (("handler", 1), ("_id", 1)))
HISTORY_EVENT_TYPE = IndexSpec("event_type", (("event_type", 1), ("_id", 1)))


def history_record(delivery: Delivery, now: datetime) -> dict[str, Any]:
    """The completion record of `delivery` (its ``_id`` is the delivery's)."""
    record: dict[str, Any] = {
        "_id": bson.ObjectId(delivery.id),
        "event_id": delivery.event.id,
        "event_type": delivery.event.type,
        "handler": delivery.handler,
        "attempts": delivery.attempt,
        "worker_id": delivery.worker_id,
        "created_at": delivery.event.created_at or now,
        "completed_at": now,
    }
    if delivery.event.key is not None:
        record["key"] = delivery.event.key
    if delivery.sequence is not None:
        record["sequence"] = delivery.sequence
    return record


def history_by_id(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record's own ``_id``: a completion upserting its record (``_id``)."""
    return {"_id": record["_id"]}


def history_inserting(record: Mapping[str, Any]) -> dict[str, Any]:
    """A completion writing its record unless one is there already (`history_by_id`, upsert)."""
    return {"$setOnInsert": {k: v for k, v in record.items() if k != "_id"}}


def history_completed_before(cutoff: datetime) -> dict[str, Any]:
    """Completion records before `cutoff`: purge (``completed``)."""
    return {"completed_at": {"$lt": cutoff}}


def history_completed_between(since: datetime, until: datetime | None) -> dict[str, Any]:
    """Completion records in ``[since, until)``: `count_finished` (``completed``)."""
    return {"completed_at": _driver.within(since, until)}


# =============================================================================== lanes


#: The lanes collection's document that numbers the handlers' slots: ``{_id: "slots",
#: handlers: [the handler of slot 0, of slot 1, ...]}``. A handler's lanes are ``slot * 256``
#: to ``slot * 256 + 255``.
SLOTS = "slots"


def lanes_all() -> dict[str, Any]:
    """The whole lanes collection (every handler's lanes and the slots):
    a claim of every handler, `stats` and the listings (no index, by design: 256 small
    documents a handler)."""
    return {}


def lanes_read(ranges: Sequence[tuple[int, int]], ids: Sequence[int]) -> dict[str, Any]:
    """The lanes of some handlers (their ``_id`` ranges, ``[first, end)``), some more lanes
    (`ids`) and the slots: a claim's lane view (``_id``, one range a handler)."""
    clauses: list[dict[str, Any]] = [*lanes_in(ranges)["$or"], slots_document()]
    if ids:
        clauses.append(lanes_by_ids(ids))
    return {"$or": clauses}


def lanes_in(ranges: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """The lanes of some handlers (their ``_id`` ranges, ``[first, end)``): seeding what is
    missing of them (``_id``)."""
    return {"$or": [{"_id": {"$gte": lo, "$lt": hi}} for lo, hi in ranges]}


def slots_document() -> dict[str, Any]:
    """The slots (``_id``)."""
    return {"_id": SLOTS}


def slots_creating() -> dict[str, Any]:
    """The slots before any handler has one (`slots_document`, upsert)."""
    return {"$setOnInsert": {"handlers": []}}


def slot_not_given(handler: str) -> dict[str, Any]:
    """The slots, while `handler` has none (``_id``): one document, so that two set-ups never
    give a handler two slots, and slot numbers have no gaps."""
    return {"_id": SLOTS, "handlers": {"$ne": handler}}


def slot_giving(handler: str) -> dict[str, Any]:
    """`handler` taking the next slot (`slot_not_given`)."""
    return {"$push": {"handlers": handler}}


def lanes_by_ids(ids: Iterable[int]) -> dict[str, Any]:
    """Some lanes: a claim reading back which of its lane writes took effect (``_id``)."""
    return {"_id": {"$in": list(ids)}}


def lanes_held(owner: str, instance: str) -> dict[str, Any]:
    """The lanes `owner` holds on `instance`: `extend_lease`, `relinquish` (a scan of the lane
    documents, 256 small ones a handler, by design)."""
    return {"owner": owner, "instance": instance}


def lane_by_id(lane_id: int) -> dict[str, Any]:
    """One lane: `requeue` counting itself (``_id``)."""
    return {"_id": lane_id}


def lane_held(
    lane_id: int, epoch: int, owner: str, instance: str, requeued: int | None = None
) -> dict[str, Any]:
    """A lane its holder still holds as read (same epoch): every write of a holder; with
    `requeued`, also no requeue in it since: a holder's write listing new picks (``_id``)."""
    query: dict[str, Any] = {"_id": lane_id, "epoch": epoch, "owner": owner, "instance": instance}
    if requeued is not None:
        query["requeued"] = requeued
    return query


def lane_as_read(lane_id: int, rev: int) -> dict[str, Any]:
    """A lane exactly as read (judged free then): a takeover; any write in between moves
    ``rev`` on and the take fails (``_id``)."""
    return {"_id": lane_id, "rev": rev}


def lane_as_left(lane_id: int, epoch: int, requeued: int) -> dict[str, Any]:
    """A lane as this instance handed it back: unowned, not taken since (only a take moves the
    epoch), no requeue since; a takeover of it (``_id``)."""
    return {"_id": lane_id, "epoch": epoch, "owner": None, "requeued": requeued}


def lane_at_epoch(lane_id: int, epoch: int) -> dict[str, Any]:
    """A lane not taken again since epoch `epoch`: clearing its charged ``lost`` (``_id``)."""
    return {"_id": lane_id, "epoch": epoch}


def lane_takeover(
    owner: str,
    instance: str,
    lease_until: datetime,
    in_flight: Sequence[Entry],
    lost: Sequence[Entry],
    write: str,
) -> dict[str, Any]:
    """A claim (`write`: its id) taking a lane (`lane_as_read`): a new epoch, listing what it
    claims there and what the previous holder left running (charged next)."""
    return {
        "$set": {"owner": owner, "instance": instance, "lease_until": lease_until,
                 "in_flight": [e.document() for e in in_flight],
                 "lost": [e.document() for e in lost], "write": write},
        "$inc": {"epoch": 1, "rev": 1},
    }  # fmt: skip


def lane_listing(in_flight: Sequence[Entry], lease_until: datetime, write: str) -> dict[str, Any]:
    """A holder's claim (`write`: its id) recording what runs in its lane now, renewing the
    lease (`lane_held`)."""
    return {
        "$set": {"in_flight": [e.document() for e in in_flight], "write": write},
        "$max": {"lease_until": lease_until},
        "$inc": {"rev": 1},
    }


def lane_handing_back(now: datetime, lost: Sequence[Entry]) -> dict[str, Any]:
    """A holder handing a lane back (`lane_held`): a claim's idle lane (nothing lost), or
    `relinquish` (what still runs is lost, charged by the next holder)."""
    return {
        "$set": {"owner": None, "instance": None, "lease_until": now,
                 "in_flight": [], "lost": [e.document() for e in lost]},
        "$inc": {"rev": 1},
    }  # fmt: skip


def lane_renewing(lease_until: datetime) -> dict[str, Any]:
    """`extend_lease` (`lanes_held`); an expired lease nobody took over is renewed too."""
    return {"$max": {"lease_until": lease_until}, "$inc": {"rev": 1}}


def lane_clearing_lost() -> dict[str, Any]:
    """Clearing a lane's ``lost`` once charged (`lane_at_epoch`)."""
    return {"$set": {"lost": []}, "$inc": {"rev": 1}}


def lane_requeue_counting() -> dict[str, Any]:
    """`requeue` counting itself in the lane of the delivery it requeues (`lane_by_id`): a
    holder's listing write fenced on the count before fails (`lane_held`), and so does a take
    (``rev``)."""
    return {"$inc": {"requeued": 1, "rev": 1}}


# ======================================================================= the index list

#: Every index, by collection (the name after the prefix), in the order `setup` creates them.
INDEXES: dict[str, tuple[IndexSpec, ...]] = {
    DELIVERIES: (
        EVENT_HANDLER,
        CLAIM,
        READY_DELIVERIES,
        ORDERING,
        PARKED_DELIVERIES,
        DUE,
        STATUS,
        STATUS_UPDATED,
        HANDLER,
        EVENT_TYPE,
    ),
    EVENTS: (EVENT_CREATED, EVENT_COMPLETED),
    HISTORY: (HISTORY_COMPLETED, HISTORY_EVENT, HISTORY_HANDLER, HISTORY_EVENT_TYPE),
}
