"""`AsyncOutbox`: the transactional outbox's store (seed 002).

Collections (``<prefix>`` defaults to ``mongoq_outbox_``):

- ``events``: ``{_id: event id, type, payload, headers, key?, correlation_id?, causation_id?,
  created_at, handlers: [every handler it ever had a delivery for], completed_at?}``;
- ``deliveries``: one per unfinished (or dead) event and handler: ``{_id: ObjectId, event_id,
  event_type, handler, key?, sequence?, lane_id, lane: "ready"|"parked", status:
  "pending"|"dead", due_at, attempts, claims, last_error?, requeue_uncounted?, created_at,
  updated_at}``. ``due_at``
  and ``lane`` exist only while pending; ``attempts`` counts attempts that ended; ``claims`` is
  the claim generation (moves on whenever a claim of the delivery ends), which fences every
  settle. A completion deletes the document;
- ``key_sequences``: ``{_id: key, value}``, the per-key sequence counter;
- ``lanes``: see `mongoq.outbox.lanes`;
- ``completed_deliveries`` (with ``completion_history``): one record per completion.

Indexes (created by `setup`) and the queries they serve:

- deliveries ``event_handler`` ``(event_id, handler)`` unique: backstop of the idempotent append,
  lookups by event;
- deliveries ``claim`` ``(lane_id, due_at, _id, handler)`` partial ``lane: "ready"``: the claim
  scan, a merge of one index range per lane (at most 128 lanes per query);
- deliveries ``ordering`` ``(handler, key, sequence)`` partial on pending keyed deliveries: the
  head of a key (lowest pending sequence);
- deliveries ``parked`` ``(handler, key, sequence)`` partial ``lane: "parked"``: unparking;
- deliveries ``due`` ``(due_at)`` partial on pending: `statistics` (oldest due);
- deliveries ``status`` ``(status, _id)``, ``handler`` ``(handler, _id)``, ``event_type``
  ``(event_type, _id)``: counts and listings (``_id`` is an ObjectId: creation order);
  ``status_updated`` ``(status, updated_at)``: purge of dead deliveries;
- events ``created`` ``(created_at, _id)`` and ``completed`` ``(completed_at, _id)``: purge;
- completed_deliveries ``completed`` ``(completed_at, _id)``: purge; ``event``
  ``(event_id)``: references; ``handler`` ``(handler, _id)``, ``event_type``
  ``(event_type, _id)``: listing.

Per-key order: a keyed delivery is claimed only when it is the lowest pending sequence of its
handler and key and no delivery of them runs. All deliveries of a key share a lane and only the
lane's holder claims from it, so what runs is what the holder's lanes list.

What runs: an entry of a held lane whose delivery still has the listed generation and that this
instance handed out and has not seen settled. The owner's next claim frees any other such entry
(a claim whose reply was lost, a settle that failed) by moving its generation on, no attempt
charged, so nothing stays listed as running with nobody running it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from logging import Logger
from typing import Any

import bson
from pymongo import ReturnDocument, UpdateMany, UpdateOne
from pymongo.errors import BulkWriteError

from mongoq import _driver
from mongoq._validation import MAX_BATCH, check_batch, check_int, check_name, check_seconds
from mongoq._validation import check_worker_id as _check_owner
from mongoq.clock import Clock, ServerClock, stored_instant
from mongoq.errors import InvalidInput, LeaseLost
from mongoq.outbox.lanes import (
    REQUEUES,
    Entry,
    Lane,
    charge_lost,
    generation_filter,
    read_lanes,
    seed_lanes,
)
from mongoq.outbox.models import (
    Delivery,
    DeliveryInfo,
    Event,
    OutboxStatistics,
    PublishResult,
    PurgeResult,
    lane_of,
)
from mongoq.runtime.loop import error_text

__all__ = ["AsyncOutbox"]

log = logging.getLogger("mongoq.outbox")

READY = "ready"
PARKED = "parked"
PENDING = "pending"
DEAD = "dead"
COMPLETED = "completed"
CLAIM_INDEX = "claim"
ORDERING_INDEX = "ordering"
PARKED_INDEX = "parked"
#: A claim queries at most this many lanes at once: the server merges at most 200 sorted
#: index ranges, beyond which it would sort the whole due backlog.
LANES_PER_QUERY = 128
#: Waiting deliveries of one key a claim must see behind an unfinished head before parking them.
PARK_THRESHOLD = 32
#: Lanes left with deliveries listed that one claim takes over (and charges) at most.
STALE_LANES_PER_CLAIM = 32
#: Parked keys one claim looks at for a delivery to move back (keep simultaneously backlogged
#: keys in the hundreds).
UNPARK_KEYS_PER_CLAIM = 500
_DUPLICATE_KEY = 11000
_SUBSCRIBE_ALL = "*"


def _check_handler(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 256 or "\x00" in value:
        raise InvalidInput(field, "must be a non-empty string of at most 256 characters")
    return value


def _only_duplicates(error: BulkWriteError) -> bool:
    errors = error.details.get("writeErrors", [])
    return bool(errors) and all(e.get("code") == _DUPLICATE_KEY for e in errors)


def _parse_token(delivery: Any, field: str = "delivery") -> tuple[bson.ObjectId, int, int, int]:
    """(delivery _id, lane, epoch, claim generation) of a `Delivery`; a token this store cannot
    have issued is `InvalidInput` before any database call."""
    if not isinstance(delivery, Delivery):
        raise InvalidInput(field, f"must be a Delivery, got {type(delivery).__name__}")
    try:
        doc_id = bson.ObjectId(delivery.id)
        lane_text, epoch_text, claims_text = delivery.lease_token.split(":")
        lane, epoch, claims = int(lane_text), int(epoch_text), int(claims_text)
    except (bson.errors.InvalidId, TypeError, ValueError, AttributeError):
        raise InvalidInput(f"{field}.lease_token", "is not a token this outbox issued") from None
    if not 0 <= lane < 256 or epoch < 0 or claims < 0:
        raise InvalidInput(f"{field}.lease_token", "is not a token this outbox issued")
    return doc_id, lane, epoch, claims


class AsyncOutbox:
    """Events written in the caller's MongoDB transaction, delivered at least once to each
    subscribed handler separately, in per-key order, with retries and dead letters.

    `subscriptions` maps an event type to the names of the handlers that receive it (``"*"``
    for every type); deliveries are created from the publisher's subscriptions, so every
    process that publishes needs the same map. Workers claim deliveries by leasing lanes for
    `lease` seconds (`OutboxDispatcher` does all of it). See the module docstring for the
    layout and `mongoq.outbox` for the guarantees.
    """

    def __init__(
        self,
        db: Any,
        prefix: str = "mongoq_outbox_",
        *,
        subscriptions: Mapping[str, Iterable[str]],
        lease: float = 30,
        completion_history: bool = False,
        clock: Clock | None = None,
        logger: Logger | None = None,
        purge_batch_size: int = 500,
    ) -> None:
        _driver.backend_of(db)
        check_name("prefix", prefix)
        if not isinstance(subscriptions, Mapping):
            raise InvalidInput("subscriptions", "must map event types to handler names")
        self.subscriptions: dict[str, tuple[str, ...]] = {}
        for event_type, names in subscriptions.items():
            _check_handler("subscriptions", event_type)
            if isinstance(names, str) or not isinstance(names, Iterable):
                raise InvalidInput(
                    f"subscriptions[{event_type!r}]", "must be a list of handler names"
                )
            checked = [_check_handler(f"subscriptions[{event_type!r}]", n) for n in names]
            self.subscriptions[event_type] = tuple(dict.fromkeys(checked))
        self.lease = check_seconds("lease", lease, positive=True)
        if not isinstance(completion_history, bool):
            raise InvalidInput("completion_history", "must be a bool")
        self.completion_history = completion_history
        self.purge_batch_size = check_int("purge_batch_size", purge_batch_size, low=1, high=10_000)
        self.clock: Clock = clock if clock is not None else ServerClock(db)
        self.log = logger if logger is not None else log
        self.db = db
        self.prefix = prefix
        self.events = _driver.collection(db, f"{prefix}events")
        self.deliveries = _driver.collection(db, f"{prefix}deliveries")
        self.sequences = _driver.collection(db, f"{prefix}key_sequences")
        self.lanes = _driver.collection(db, f"{prefix}lanes")
        self.history = _driver.collection(db, f"{prefix}completed_deliveries")
        # Lanes are held per owner *and* per instance: a process restarted under a fixed owner
        # name takes its predecessor's lanes over like any worker, it does not adopt them.
        self.instance = uuid.uuid4().hex
        self._claim_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # owner -> {delivery _id: generation} of the claims this instance handed out and has
        # not seen settled: what runs in the owner's lanes (see `_reconcile`).
        self._issued: dict[str, dict[Any, int]] = defaultdict(dict)
        # handler set of a claim -> the last parked key its unparking looked at
        self._unpark_after: dict[tuple[str, ...] | None, tuple[str, str]] = {}

    # ------------------------------------------------------------------------------ set-up

    async def setup(self) -> None:
        """Create the collections, the indexes and the 256 lane documents; idempotent. Run it
        once before the first publish: collections created implicitly inside concurrent
        transactions conflict with each other."""
        await _driver.create_collections(
            self.db,
            [
                c.name
                for c in (self.events, self.deliveries, self.sequences, self.lanes, self.history)
            ],
        )
        pending = {"due_at": {"$exists": True}}
        d = self.deliveries
        await d.create_index([("event_id", 1), ("handler", 1)], name="event_handler", unique=True)
        await d.create_index(
            [("lane_id", 1), ("due_at", 1), ("_id", 1), ("handler", 1)],
            name=CLAIM_INDEX,
            partialFilterExpression={"lane": READY},
        )
        await d.create_index(
            [("handler", 1), ("key", 1), ("sequence", 1)],
            name=ORDERING_INDEX,
            partialFilterExpression={**pending, "key": {"$exists": True}},
        )
        await d.create_index(
            [("handler", 1), ("key", 1), ("sequence", 1)],
            name=PARKED_INDEX,
            partialFilterExpression={"lane": PARKED},
        )
        await d.create_index([("due_at", 1)], name="due", partialFilterExpression=pending)
        await d.create_index([("status", 1), ("_id", 1)], name="status")
        await d.create_index([("status", 1), ("updated_at", 1)], name="status_updated")
        await d.create_index([("handler", 1), ("_id", 1)], name="handler")
        await d.create_index([("event_type", 1), ("_id", 1)], name="event_type")
        await self.events.create_index([("created_at", 1), ("_id", 1)], name="created")
        await self.events.create_index([("completed_at", 1), ("_id", 1)], name="completed")
        await self.history.create_index([("completed_at", 1), ("_id", 1)], name="completed")
        await self.history.create_index([("event_id", 1)], name="event")
        await self.history.create_index([("handler", 1), ("_id", 1)], name="handler")
        await self.history.create_index([("event_type", 1), ("_id", 1)], name="event_type")
        await seed_lanes(self.db, self.lanes)

    async def _now(self) -> datetime:
        await self.clock.refresh()
        return self.clock.now()

    # ----------------------------------------------------------------------------- publish

    def handlers_for(self, event_type: str) -> tuple[str, ...]:
        """The handlers subscribed to `event_type` (its own, then the ``"*"`` ones)."""
        names = self.subscriptions.get(event_type, ()) + self.subscriptions.get(_SUBSCRIBE_ALL, ())
        return tuple(dict.fromkeys(names))

    async def publish(self, events: Event | Iterable[Event], *, session: Any) -> PublishResult:
        """Append `events` and one delivery per subscribed handler.

        `session` is required: the caller's session with a started transaction, so the events
        commit or roll back with the business writes beside them, or ``session=None`` for a
        non-transactional publish (the embedded backend; the blocking facade).

        Idempotent by event id: an event published again adds deliveries only for handlers it
        never had, so a handler that already completed never runs twice. A keyed event takes
        the next sequence of its key from a counter written in the same transaction, so
        sequence order is commit order (without a transaction, the order of the counter's
        reads: two publishers racing on one key may then commit out of sequence order).
        """
        transactional = session is not None
        if transactional and not _driver.in_transaction(session):
            raise InvalidInput("session", "has no transaction started; start one first")
        if transactional:
            await _driver.require_transactions(self.db, "publish(session=...)")
        batch = [events] if isinstance(events, Event) else check_batch("events", events)
        checked: dict[str, Event] = {}
        for index, event in enumerate(batch):
            if not isinstance(event, Event):
                raise InvalidInput(f"events[{index}]", "must be an Event")
            good = event.checked(f"events[{index}]")
            checked.setdefault(good.id, good)  # the same id twice in one call: the first wins
        if not checked:
            return PublishResult(0, 0)
        now = await self._now()
        if transactional:
            return await self._publish_in_transaction(list(checked.values()), session, now)
        return await self._publish_plain(list(checked.values()), now)

    def _event_document(self, event: Event, now: datetime, sequence: int | None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "type": event.type,
            "payload": event.payload,
            "headers": event.headers,
            "created_at": event.created_at or now,
        }
        for name in ("key", "correlation_id", "causation_id"):
            if getattr(event, name) is not None:
                doc[name] = getattr(event, name)
        if sequence is not None:
            # Kept on the event: a replay that adds a handler gives its delivery the same
            # sequence, so it never jumps ahead of the key's earlier deliveries.
            doc["sequence"] = sequence
        return doc

    async def _sequences(self, events: Sequence[Event], session: Any) -> dict[str, int]:
        """The next sequence of each keyed event's key, in the order of `events`."""
        per_key: dict[str, list[str]] = defaultdict(list)
        for event in events:
            if event.key is not None:
                per_key[event.key].append(event.id)
        sequences: dict[str, int] = {}
        for key, ids in per_key.items():
            counter = await self.sequences.find_one_and_update(
                {"_id": key},
                {"$inc": {"value": len(ids)}},
                upsert=True,
                return_document=ReturnDocument.AFTER,
                session=session,
            )
            first = int(counter["value"]) - len(ids) + 1
            for offset, event_id in enumerate(ids):
                sequences[event_id] = first + offset
        return sequences

    def _delivery_documents(
        self, event_id: str, stored: Mapping[str, Any], handlers: Iterable[str], now: datetime
    ) -> list[dict[str, Any]]:
        key = stored.get("key")
        lane_id = lane_of(key if key is not None else event_id)
        docs = []
        for handler in handlers:
            doc: dict[str, Any] = {
                "_id": bson.ObjectId(),
                "event_id": event_id,
                "event_type": stored["type"],
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
                doc["sequence"] = stored.get("sequence")
            docs.append(doc)
        return docs

    def _wanted(self, stored: Mapping[str, Any]) -> list[str]:
        """The subscribed handlers the stored event does not list yet."""
        listed = stored.get("handlers", ())
        return [h for h in self.handlers_for(stored["type"]) if h not in listed]

    async def _existing(self, ids: list[str], session: Any) -> dict[str, dict[str, Any]]:
        projection = {"handlers": 1, "key": 1, "type": 1, "sequence": 1}
        docs = await self.events.find({"_id": {"$in": ids}}, projection, session=session).to_list(
            None
        )
        return {doc["_id"]: doc for doc in docs}

    async def _publish_in_transaction(
        self, events: list[Event], session: Any, now: datetime
    ) -> PublishResult:
        # Read what exists, then write with upserts: a plain insert racing another transaction
        # would fail with a duplicate key, which aborts the transaction without a retry label;
        # an upsert race is a write conflict, which the caller's `with_transaction` retries.
        existing = await self._existing([e.id for e in events], session)
        new = [e for e in events if e.id not in existing]
        sequences = await self._sequences(new, session)
        ops: list[UpdateOne | UpdateMany] = []
        deliveries: list[UpdateOne | UpdateMany] = []
        for event in events:
            stored = existing.get(event.id) or self._event_document(
                event, now, sequences.get(event.id)
            )
            wanted = self._wanted(stored)
            if event.id in existing and not wanted:
                continue
            update: dict[str, Any] = {"$addToSet": {"handlers": {"$each": wanted}}}
            if event.id not in existing:
                update["$setOnInsert"] = stored
            ops.append(_driver.update_single(self.db, {"_id": event.id}, update, upsert=True))
            deliveries += [
                _driver.update_single(
                    self.db,
                    {"event_id": event.id, "handler": doc["handler"]},
                    {"$setOnInsert": doc},
                    upsert=True,
                )
                for doc in self._delivery_documents(event.id, stored, wanted, now)
            ]
        added = 0
        if ops:
            await self.events.bulk_write(ops, ordered=True, session=session)
        if deliveries:
            # Upserts too: a delivery left by a non-transactional publish that crashed before
            # listing its handler is kept, not a duplicate key that aborts the transaction.
            result = await self.deliveries.bulk_write(deliveries, ordered=True, session=session)
            added = len(result.upserted_ids)
        return PublishResult(len(new), added)

    async def _publish_plain(self, events: list[Event], now: datetime) -> PublishResult:
        # Without a transaction the order of the writes carries the guarantees: the event
        # exists before its deliveries (a claim never finds a delivery without its event), and
        # a handler is listed on the event only after its delivery exists (a crash in between
        # is repaired by publishing again: the unique index turns the repeated delivery into a
        # no-op, or, if it already completed, it runs once more: at least once, never lost).
        # Sequences are taken for every keyed event before knowing which are new: a replay
        # leaves a gap in its key's sequence, which blocks nothing.
        sequences = await self._sequences(events, None)
        documents = {e.id: self._event_document(e, now, sequences.get(e.id)) for e in events}
        upserts: list[UpdateOne | UpdateMany] = [
            _driver.update_single(
                self.db,
                {"_id": e.id},
                {"$setOnInsert": {**documents[e.id], "handlers": []}},
                upsert=True,
            )
            for e in events
        ]
        result = await self.events.bulk_write(upserts, ordered=True)
        new_ids = {events[index].id for index in result.upserted_ids}
        replayed = [e.id for e in events if e.id not in new_ids]
        existing = await self._existing(replayed, None) if replayed else {}
        deliveries: list[dict[str, Any]] = []
        listed: list[UpdateOne | UpdateMany] = []
        for event in events:
            stored = existing.get(event.id) or documents[event.id]
            wanted = self._wanted(stored)
            if not wanted:
                continue
            deliveries += self._delivery_documents(event.id, stored, wanted, now)
            # An upsert: should a purge have deleted the event since it was read (a replay of
            # an old id), it is written again rather than leave its new deliveries orphaned.
            listed.append(
                _driver.update_single(
                    self.db,
                    {"_id": event.id},
                    {
                        "$addToSet": {"handlers": {"$each": wanted}},
                        "$setOnInsert": self._event_document(event, now, stored.get("sequence")),
                    },
                    upsert=True,
                )
            )
        added = len(deliveries)
        if deliveries:
            try:
                await self.deliveries.insert_many(deliveries, ordered=False)
            except BulkWriteError as exc:
                if not _only_duplicates(exc):
                    raise
                added -= len(exc.details.get("writeErrors", []))
        if listed:
            await self.events.bulk_write(listed, ordered=False)
        return PublishResult(len(new_ids), added)

    # ------------------------------------------------------------------------------- claim

    async def claim(
        self, owner: str, handlers: Iterable[str] | None = None, *, limit: int = 16
    ) -> list[Delivery]:
        """Claim up to `limit` due deliveries for `owner` (of `handlers`, or of any handler).

        Claims from the lanes `owner` holds on this instance, then takes free lanes (no owner,
        or an expired lease) holding the oldest due deliveries; a lane that another claimer
        takes first is skipped, never waited for. A keyed delivery is taken only when it is the
        lowest pending sequence of its handler and key and none of them runs; one claim never
        takes two deliveries of one key. Lanes that yield nothing and run nothing are handed
        back. Claims of one owner on one instance run one after the other.
        """
        owner = _check_owner("owner", owner)
        wanted = None
        if handlers is not None:
            if isinstance(handlers, str):
                raise InvalidInput("handlers", "must be a list of handler names, not a string")
            wanted = [_check_handler("handlers", h) for h in handlers]
            if not wanted:
                return []
        check_int("limit", limit, low=1, high=MAX_BATCH)
        async with self._claim_locks[owner]:
            return await self._claim(owner, wanted, limit)

    async def _claim(self, owner: str, handlers: list[str] | None, limit: int) -> list[Delivery]:
        now = await self._now()
        lanes, requeues = await read_lanes(self.lanes)
        held = {lane.id: lane for lane in lanes if lane.held_by(owner, self.instance)}
        free = {lane.id: lane for lane in lanes if lane.id not in held and lane.is_free(now)}
        # A lane whose previous holder left deliveries listed (a crash, an expired lease, a
        # graceful stop) is taken over before anything is read from it: what was running there
        # is charged its lost attempt first, so the scan below sees current generations.
        stale = [lane for lane in free.values() if lane.in_flight or lane.lost]
        for lane in stale:  # those beyond this claim's share wait for a later claim
            del free[lane.id]
        if stale:
            held.update(await self._take_over(owner, stale[:STALE_LANES_PER_CLAIM], now))
        # A lost list on a lane this owner holds was left by a claim that failed between the
        # takeover and the charge: charge it now.
        unpaid = [(lane, lane.epoch) for lane in held.values() if lane.lost]
        if unpaid:
            await charge_lost(self.db, self.deliveries, self.lanes, unpaid, now)
            for lane, _ in unpaid:
                lane.lost = []
        await self._unpark(handlers)
        running = await self._reconcile(owner, held.values(), now)
        running_keys = {(e.handler, e.key) for e in running if e.key is not None}
        excluded = {e.delivery for e in running}

        picks: list[dict[str, Any]] = []
        waiting: dict[tuple[str, str], list[Any]] = defaultdict(list)
        heads: dict[tuple[str, str], dict[str, Any] | None] = {}
        taken_keys: set[tuple[str, str]] = set()
        after: tuple[datetime, Any] | None = None
        page = min(limit * 2 + PARK_THRESHOLD, MAX_BATCH)
        lane_ids = sorted([*held, *free])

        def blocked(hk: tuple[str, str]) -> bool:
            return hk in running_keys or hk in taken_keys

        def key_of(candidate: Mapping[str, Any]) -> tuple[str, str] | None:
            key = candidate.get("key")
            return None if key is None else (candidate["handler"], key)

        def unknown(hk: tuple[str, str] | None) -> bool:
            return hk is not None and hk not in heads and not blocked(hk)

        while len(picks) < limit and lane_ids:
            candidates = await self._scan(lane_ids, handlers, now, after, page)
            position = 0
            while position < len(candidates) and len(picks) < limit:
                # Look up the heads of the next keys only as far as the picks still needed
                # can reach, so a claim of one does not probe every key of a page.
                wave: list[tuple[str, str]] = []
                for candidate in candidates[position:]:
                    hk = key_of(candidate)
                    if hk is not None and unknown(hk) and hk not in wave:
                        wave.append(hk)
                        if len(wave) == limit - len(picks):
                            break
                heads.update(await self._heads(wave))
                for candidate in candidates[position:]:
                    hk = key_of(candidate)
                    if unknown(hk):
                        break  # beyond this wave
                    position += 1
                    after = (candidate["due_at"], candidate["_id"])
                    if candidate["_id"] in excluded:
                        continue
                    if hk is not None:
                        head = heads.get(hk)
                        if blocked(hk) or head is None or head["_id"] != candidate["_id"]:
                            waiting[hk].append(candidate["_id"])
                            continue
                        taken_keys.add(hk)
                    picks.append(candidate)
                    if len(picks) == limit:
                        break
            if len(candidates) < page:
                break
            page = min(page * 2, MAX_BATCH)  # a long blocked stretch: read further per query
        deliveries = await self._record(owner, now, held, free, running, picks)
        issued = self._issued[owner]
        for delivery in deliveries:
            issued[bson.ObjectId(delivery.id)] = _parse_token(delivery)[3]
        try:
            if any(d.event.key is not None for d in deliveries):
                deliveries = await self._recheck_after_requeue(owner, deliveries, requeues, now)
            await self._park(waiting, heads, now)
        except BaseException:
            self._forget(deliveries)  # never handed out (an error, a cancellation): freed next
            raise
        return deliveries

    async def _recheck_after_requeue(
        self, owner: str, deliveries: list[Delivery], requeues: int, now: datetime
    ) -> list[Delivery]:
        """Give back the keyed picks a dead letter requeued during this claim now precedes.

        `requeue` counts itself after making the delivery pending; a claim whose heads were
        read before that write and recorded after it sees the count moved here, reads the
        heads of its keyed picks again and gives back each that is no longer first (its claim
        generation moves on, no attempt is charged). A requeue that counts itself only after
        this claim returned is ordered after the claim, like one that came later.
        """
        counter = await _driver.find_list(self.lanes, {"_id": REQUEUES}, limit=1)
        if not counter or int(counter[0].get("value", 0)) == requeues:
            return deliveries
        keys = {(d.handler, d.event.key) for d in deliveries if d.event.key is not None}
        heads = await self._heads((h, k) for h, k in keys if k is not None)
        overtaken = [
            d
            for d in deliveries
            if d.event.key is not None
            and (heads.get((d.handler, d.event.key)) or {}).get("_id") != bson.ObjectId(d.id)
        ]
        if not overtaken:
            return deliveries
        await self._free([self._lease_entry(d) for d in overtaken], now)
        for delivery in overtaken:
            self._issued[owner].pop(bson.ObjectId(delivery.id), None)
        self.log.info("gave back %d pick(s) a requeued delivery now precedes", len(overtaken))
        return [d for d in deliveries if d not in overtaken]

    @staticmethod
    def _lease_entry(delivery: Delivery) -> Entry:
        doc_id, _, _, claims = _parse_token(delivery)
        return Entry(doc_id, claims, delivery.handler, delivery.event.key)

    async def _take_over(self, owner: str, stale: list[Lane], now: datetime) -> dict[int, Lane]:
        """Take `stale` lanes over and charge what their previous holders left running; returns
        the lanes now held (a lane another claimer took first is left out)."""
        lease_until = now + timedelta(seconds=self.lease)
        ops = [
            self._take(lane, owner, lease_until, [], lane.lost + lane.in_flight)
            for lane in stale
        ]  # fmt: skip
        result = await self.lanes.bulk_write(ops, ordered=False)
        expected: dict[int, tuple[int, list[Entry]]] = {
            lane.id: (lane.epoch + 1, []) for lane in stale
        }
        taken = (
            set(expected)
            if result.matched_count == len(ops)
            else await self._confirm(owner, expected)
        )
        adopted = {
            lane.id: Lane(lane.id, owner, self.instance, lease_until, lane.epoch + 1,
                          rev=lane.rev + 1, lost=lane.lost + lane.in_flight)
            for lane in stale
            if lane.id in taken
        }  # fmt: skip
        if adopted:
            self.log.info("took over %d lane(s) left with deliveries listed", len(adopted))
            await charge_lost(
                self.db, self.deliveries, self.lanes,
                [(lane, lane.epoch) for lane in adopted.values()], now,
            )  # fmt: skip
            for lane in adopted.values():
                lane.lost = []
        return adopted

    async def _reconcile(self, owner: str, held: Iterable[Lane], now: datetime) -> list[Entry]:
        """What runs in `held` lanes: entries whose delivery still exists at the listed
        generation and that this instance handed out and has not seen settled.

        Any other entry at its listed generation is a claim nobody will settle: its record
        reached the lane but the claim failed before handing it out (a lost reply), or its
        settle failed. Its generation moves on (no attempt charged), which frees it and its
        key at once, and any late settle of that claim is refused.

        Every listed entry is looked up, those this instance runs too: one whose settle went
        through another `AsyncOutbox` object, or committed in the caller's transaction, is
        gone from the collection, not from this instance's records. And `running` is decided
        after the lookup, so a settle that failed while it ran is freed, not skipped."""
        issued = self._issued[owner]
        entries = [entry for lane in held for entry in lane.in_flight]
        if not entries:
            issued.clear()
            return []
        current = {
            (doc["_id"], int(doc.get("claims", 0)))
            for doc in await _driver.find_list(
                self.deliveries,
                {"_id": {"$in": [e.delivery for e in entries]}, "due_at": {"$exists": True}},
                projection={"claims": 1},
            )
        }
        listed = [e for e in entries if (e.delivery, e.generation) in current]
        running = [e for e in listed if issued.get(e.delivery) == e.generation]
        orphaned = [e for e in listed if issued.get(e.delivery) != e.generation]
        self._issued[owner] = {e.delivery: e.generation for e in running}
        if orphaned:
            self.log.info("freeing %d claim(s) that were never handed out or settled",
                          len(orphaned))  # fmt: skip
            await self._free(orphaned, now)
        return running

    async def _free(self, entries: list[Entry], now: datetime) -> None:
        """End the claims `entries` list without an attempt: their generation moves on (each
        only if still at the listed one), so they are claimable again and any late settle of
        those claims is refused."""
        await self.deliveries.update_many(
            {**generation_filter(entries), "due_at": {"$exists": True}},
            {"$inc": {"claims": 1}, "$set": {"updated_at": now}},
        )

    async def _scan(
        self,
        lane_ids: Sequence[int],
        handlers: list[str] | None,
        now: datetime,
        after: tuple[datetime, Any] | None,
        page: int,
    ) -> list[dict[str, Any]]:
        """The next `page` due, ready deliveries of `lane_ids` in ``(due_at, _id)`` order."""
        base: dict[str, Any] = {"lane": READY, "due_at": {"$lte": now}}
        if handlers is not None:
            base["handler"] = {"$in": handlers}
        if after is not None:
            due, last = after
            base["$or"] = [{"due_at": {"$gt": due}}, {"due_at": due, "_id": {"$gt": last}}]
        projection = {
            "event_id": 1, "handler": 1, "key": 1, "sequence": 1, "lane_id": 1,
            "attempts": 1, "claims": 1, "due_at": 1,
        }  # fmt: skip
        chunks = [
            lane_ids[start : start + LANES_PER_QUERY]
            for start in range(0, len(lane_ids), LANES_PER_QUERY)
        ]
        results = await asyncio.gather(
            *(
                _driver.find_list(
                    self.deliveries,
                    {"lane_id": {"$in": list(chunk)}, **base},
                    sort=[("due_at", 1), ("_id", 1)],
                    limit=page,
                    projection=projection,
                    hint=CLAIM_INDEX,
                )
                for chunk in chunks
            )
        )
        merged = sorted(
            (doc for docs in results for doc in docs),
            key=lambda doc: (stored_instant(doc["due_at"]), doc["_id"]),
        )
        return merged[:page]

    async def _heads(
        self, keys: Iterable[tuple[str, str]]
    ) -> dict[tuple[str, str], dict[str, Any] | None]:
        """The lowest pending delivery of each handler and key (one indexed probe each, in
        parallel): ``{_id, due_at, lane}``, or None when the key has nothing pending."""

        async def head(hk: tuple[str, str]) -> tuple[tuple[str, str], dict[str, Any] | None]:
            found = await _driver.find_list(
                self.deliveries,
                {"handler": hk[0], "key": hk[1], "due_at": {"$exists": True}},
                sort=[("sequence", 1)],
                limit=1,
                projection={"_id": 1, "due_at": 1, "lane": 1},
                hint=ORDERING_INDEX,
            )
            return hk, found[0] if found else None

        return dict(await asyncio.gather(*(head(hk) for hk in keys)))

    async def _record(
        self,
        owner: str,
        now: datetime,
        held: dict[int, Lane],
        free: dict[int, Lane],
        running: list[Entry],
        picks: list[dict[str, Any]],
    ) -> list[Delivery]:
        """Read the picks' events, then record the picks on their lanes (taking the free ones),
        and hand back held lanes that yield nothing and run nothing. Returns the deliveries
        whose lane write took effect."""
        events = await self._events_of(picks, now)
        picks = [p for p in picks if p["event_id"] in events]
        by_lane: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for pick in picks:
            by_lane[pick["lane_id"]].append(pick)
        running_by_lane: dict[Any, list[Entry]] = defaultdict(list)
        running_ids = {e.delivery for e in running}
        for lane in held.values():
            running_by_lane[lane.id] = [e for e in lane.in_flight if e.delivery in running_ids]
        lease_until = now + timedelta(seconds=self.lease)
        ops: list[UpdateOne | UpdateMany] = []
        expected: dict[int, tuple[int, list[Entry]]] = {}  # lane -> (epoch, entries) once written
        for lane in held.values():
            entries = running_by_lane[lane.id] + [self._entry(p) for p in by_lane[lane.id]]
            if not entries:
                ops.append(_driver.update_by_id(self.db, lane.fence(owner, self.instance), {
                    "$set": {"owner": None, "instance": None, "lease_until": now,
                             "in_flight": [], "lost": []},
                    "$inc": {"rev": 1},
                }))  # fmt: skip
            elif by_lane[lane.id] or len(entries) != len(lane.in_flight):
                ops.append(_driver.update_by_id(self.db, lane.fence(owner, self.instance), {
                    "$set": {"in_flight": [e.document() for e in entries]},
                    "$max": {"lease_until": lease_until},
                    "$inc": {"rev": 1},
                }))  # fmt: skip
                expected[lane.id] = (lane.epoch, entries)
        for lane_id, lane_picks in by_lane.items():
            if lane_id in held:
                continue
            # A free lane with nothing listed (stale ones were taken over above).
            lane = free[lane_id]
            entries = [self._entry(p) for p in lane_picks]
            ops.append(self._take(lane, owner, lease_until, entries, []))
            expected[lane_id] = (lane.epoch + 1, entries)
        written = set(expected)
        if ops:
            result = await self.lanes.bulk_write(ops, ordered=False)
            if result.matched_count != len(ops):
                written = await self._confirm(owner, expected)
        epochs = {lane_id: epoch for lane_id, (epoch, _) in expected.items()}
        return [
            self._delivery(pick, events[pick["event_id"]], owner, epochs[pick["lane_id"]])
            for pick in picks
            if pick["lane_id"] in written
        ]

    def _take(
        self,
        lane: Lane,
        owner: str,
        lease_until: datetime,
        in_flight: list[Entry],
        lost: list[Entry],
    ) -> UpdateOne | UpdateMany:
        """The write that takes `lane` over for `owner`, as read (see `Lane.take_filter`)."""
        return _driver.update_by_id(self.db, lane.take_filter(), {
            "$set": {"owner": owner, "instance": self.instance, "lease_until": lease_until,
                     "in_flight": [e.document() for e in in_flight],
                     "lost": [e.document() for e in lost]},
            "$inc": {"epoch": 1, "rev": 1},
        })  # fmt: skip

    async def _confirm(self, owner: str, expected: dict[int, tuple[int, list[Entry]]]) -> set[int]:
        """Which of the lane writes took effect, read back after a bulk write matched fewer."""
        docs = await _driver.find_list(self.lanes, {"_id": {"$in": list(expected)}})
        confirmed = set()
        for lane in map(Lane.from_document, docs):
            epoch, entries = expected[lane.id]
            mine = lane.owner == owner and lane.instance == self.instance and lane.epoch == epoch
            listed = {(e.delivery, e.generation) for e in lane.in_flight}
            if mine and all((e.delivery, e.generation) in listed for e in entries):
                confirmed.add(lane.id)
        return confirmed

    @staticmethod
    def _entry(pick: Mapping[str, Any]) -> Entry:
        return Entry(pick["_id"], int(pick.get("claims", 0)), pick["handler"], pick.get("key"))

    async def _events_of(
        self, picks: list[dict[str, Any]], now: datetime
    ) -> dict[str, Mapping[str, Any]]:
        """The events of `picks`. A delivery whose event is gone (only possible when a purge
        without transactions raced a replayed publish) can never run: it is buried."""
        if not picks:
            return {}
        ids = list({p["event_id"] for p in picks})
        docs = await _driver.find_list(self.events, {"_id": {"$in": ids}})
        events: dict[str, Mapping[str, Any]] = {doc["_id"]: doc for doc in docs}
        orphans = [p for p in picks if p["event_id"] not in events]
        if orphans:
            self.log.error("%d delivery(ies) without their event; burying them", len(orphans))
            await self.deliveries.update_many(
                generation_filter(self._entry(p) for p in orphans),
                self._dead_update("its event is missing", now, charge=False),
            )
        return events

    def _delivery(
        self, pick: Mapping[str, Any], event_doc: Mapping[str, Any], owner: str, epoch: int
    ) -> Delivery:
        event = Event(
            id=event_doc["_id"],
            type=event_doc["type"],
            payload=event_doc.get("payload"),
            key=event_doc.get("key"),
            headers=event_doc.get("headers") or {},
            correlation_id=event_doc.get("correlation_id"),
            causation_id=event_doc.get("causation_id"),
            created_at=stored_instant(event_doc.get("created_at")),
        )
        claims = int(pick.get("claims", 0))
        return Delivery(
            id=str(pick["_id"]),
            event=event,
            handler=pick["handler"],
            attempt=int(pick.get("attempts", 0)) + 1,
            lease_token=f"{pick['lane_id']}:{epoch}:{claims}",
            owner=owner,
            sequence=pick.get("sequence"),
        )

    async def _park(
        self,
        waiting: Mapping[tuple[str, str], list[Any]],
        heads: Mapping[tuple[str, str], dict[str, Any] | None],
        now: datetime,
    ) -> None:
        """Move blocked backlogs out of the claim index, so that later claims do not scan them:
        the waiting deliveries of a key when there are `PARK_THRESHOLD` or more, or when its
        head is not due yet (they cannot run before it anyway). Best effort: a failure is
        logged, never fails the claim, and leaves them ready (scanned, but correct)."""
        parked: list[Any] = []
        for hk, ids in waiting.items():
            head = heads.get(hk)
            not_due = head is not None and (stored_instant(head.get("due_at")) or now) > now
            if len(ids) >= PARK_THRESHOLD or not_due:
                parked += ids
        if not parked:
            return
        try:
            result = await self.deliveries.update_many(
                {"_id": {"$in": parked}, "lane": READY, "due_at": {"$exists": True}},
                {"$set": {"lane": PARKED}},
            )
        except _driver.DRIVER_ERRORS as exc:
            self.log.warning("parking %d blocked deliveries failed (%s)", len(parked), exc)
            return
        self.log.debug("parked %d blocked deliveries", result.modified_count)

    async def _unpark(self, handlers: list[str] | None) -> None:
        """Level-triggered: each parked key whose lowest pending delivery is parked (nothing
        unfinished before it) gets that delivery back in the claim index. It looks at the
        current state only, so a crash while parking, or a head finishing while its followers
        were being parked, delays a key until the next claim but never strands it."""
        match: dict[str, Any] = {"lane": PARKED}
        if handlers is not None:
            match["handler"] = {"$in": handlers}
        cursor = None if handlers is None else tuple(sorted(handlers))
        if cursor in self._unpark_after:
            # Each claim goes on after the last key the previous one (for the same handlers)
            # looked at, wrapping around, so every parked key is looked at however many.
            handler, key = self._unpark_after[cursor]
            match["$or"] = [
                {"handler": {"$gt": handler}},
                {"handler": handler, "key": {"$gt": key}},
            ]
        # Sorted on the parked index's leading keys and grouped by them: a distinct scan of
        # the index on a server (one entry per key, however long its backlog).
        groups = await _driver.aggregate_list(
            self.deliveries,
            [
                {"$match": match},
                {"$sort": {"handler": 1, "key": 1}},
                {"$group": {"_id": {"h": "$handler", "k": "$key"}}},
                {"$sort": {"_id.h": 1, "_id.k": 1}},
                {"$limit": UNPARK_KEYS_PER_CLAIM},
            ],
            hint=PARKED_INDEX,
        )  # fmt: skip
        pairs = [(str(g["_id"]["h"]), str(g["_id"]["k"])) for g in groups]
        if len(pairs) == UNPARK_KEYS_PER_CLAIM:
            self._unpark_after[cursor] = pairs[-1]
        else:
            self._unpark_after.pop(cursor, None)
        if not pairs:
            return
        heads = await self._heads(pairs)
        ready = [h["_id"] for h in heads.values() if h is not None and h.get("lane") == PARKED]
        if ready:
            await self.deliveries.update_many(
                {"_id": {"$in": ready}, "lane": PARKED}, {"$set": {"lane": READY}}
            )

    # ------------------------------------------------------------------------------ settle

    @staticmethod
    def _fence(delivery: Delivery, field: str = "delivery") -> dict[str, Any]:
        doc_id, _, _, claims = _parse_token(delivery, field)
        return {"_id": doc_id, "claims": claims, "due_at": {"$exists": True}}

    def _history_record(self, delivery: Delivery, now: datetime) -> dict[str, Any]:
        record: dict[str, Any] = {
            "_id": bson.ObjectId(delivery.id),
            "event_id": delivery.event.id,
            "event_type": delivery.event.type,
            "handler": delivery.handler,
            "attempts": delivery.attempt,
            "owner": delivery.owner,
            "created_at": delivery.event.created_at or now,
            "completed_at": now,
        }
        if delivery.event.key is not None:
            record["key"] = delivery.event.key
        if delivery.sequence is not None:
            record["sequence"] = delivery.sequence
        return record

    async def complete(self, delivery: Delivery, *, session: Any = None) -> bool:
        """Finish `delivery`: its document is deleted and the event records the completion.

        With `session` (a started transaction of the handler's own) the completion commits
        with the handler's writes, or not at all; a lost lease then raises `LeaseLost`, so
        that the transaction is not committed. Without, True when it took effect, False when
        the claim had ended (another worker took the lane over, or it was settled already).
        """
        fence = self._fence(delivery)
        if session is not None and not _driver.in_transaction(session):
            raise InvalidInput("session", "has no transaction started; start one first")
        if session is not None:
            await _driver.require_transactions(self.db, "complete(delivery, session=...)")
            now = await self._now()
            try:
                await self._complete_in(session, [delivery], [fence], now)
            except LeaseLost:
                self._forget([delivery])  # its claim had ended
                raise
            # Still counted as running until the caller's transaction commits (the next claim
            # then finds it gone). If it aborts, settle the delivery otherwise (`reschedule`,
            # `release`), as `OutboxDispatcher` does.
            return True
        try:
            now = await self._now()
            if self.completion_history and await _driver.supports_transactions(self.db):
                done = await self._complete_in_own_transaction([delivery], [fence], now)
            else:
                result = await self.deliveries.delete_one(fence)
                done = result.deleted_count == 1
                if done:
                    await self._after_completion([delivery], now, None)
        except BaseException:
            self._forget([delivery])
            raise
        self._forget([delivery])
        return done

    def _forget(self, deliveries: Iterable[Delivery]) -> None:
        """Settled, or its outcome unknown: no longer counted as running by this instance; the
        next claim frees it if it was not settled after all (see `_reconcile`)."""
        for delivery in deliveries:
            doc_id, _, _, claims = _parse_token(delivery)
            issued = self._issued[delivery.owner]
            if issued.get(doc_id) == claims:  # a stale settle leaves a newer claim running
                del issued[doc_id]

    async def _complete_in(
        self, session: Any, deliveries: list[Delivery], fences: list[dict[str, Any]], now: datetime
    ) -> None:
        """All-or-nothing completion inside `session`'s transaction: `LeaseLost` if any of the
        claims has ended, which must abort the transaction (the deletions made so far with it)."""
        claimed = _driver.owned_by([(f["_id"], f["claims"]) for f in fences], "claims")
        result = await self.deliveries.delete_many(
            {**claimed, "due_at": {"$exists": True}}, session=session
        )
        if result.deleted_count != len(fences):
            raise LeaseLost(
                f"{len(fences) - result.deleted_count} of {len(fences)} deliveries are no longer "
                "held by their claim"
            )
        await self._after_completion(deliveries, now, session)

    async def _complete_in_own_transaction(
        self, deliveries: list[Delivery], fences: list[dict[str, Any]], now: datetime
    ) -> bool:
        async def work(session: Any) -> None:
            await self._complete_in(session, deliveries, fences, now)

        try:
            await _driver.run_in_transaction(self.db, work)
        except LeaseLost:
            return False
        return True

    async def _after_completion(
        self, deliveries: Sequence[Delivery], now: datetime, session: Any
    ) -> None:
        await self.events.update_many(
            {"_id": {"$in": list({d.event.id for d in deliveries})}},
            {"$max": {"completed_at": now}},
            session=session,
        )
        if self.completion_history:
            # Upserts, never an insert whose duplicate keys are ignored: inside a transaction
            # any write error aborts it on the server, caught or not, and the commit then fails
            # (NoSuchTransaction, retried by `with_transaction` into the same duplicate). A record
            # there already is kept as it is; the server retries the duplicate-key race of an
            # upsert by _id itself (in a transaction it is a write conflict, which is retried).
            # The same command with a session or without: no write error is swallowed anywhere.
            records = [self._history_record(d, now) for d in deliveries]
            await self.history.bulk_write(
                [
                    _driver.update_single(
                        self.db,
                        {"_id": record["_id"]},
                        {"$setOnInsert": {k: v for k, v in record.items() if k != "_id"}},
                        upsert=True,
                    )
                    for record in records
                ],
                ordered=False,
                session=session,
            )

    async def complete_many(self, deliveries: Sequence[Delivery]) -> list[bool]:
        """Complete a batch, from any number of lanes, in a few commands whatever its size.

        Returns, for each delivery, True only where the completion is proven: when fewer
        documents were deleted than claims fenced, the ones still present were not completed,
        and the missing ones are reported completed only if the count proves they all were.
        """
        batch = check_batch("deliveries", deliveries)
        fences = [self._fence(d, f"deliveries[{i}]") for i, d in enumerate(batch)]
        if len({f["_id"] for f in fences}) != len(fences):
            raise InvalidInput("deliveries", "lists the same delivery twice")
        if not batch:
            return []
        try:
            done = await self._complete_batch(batch, fences, await self._now())
        except BaseException:
            self._forget(batch)
            raise
        self._forget(batch)
        return done

    async def _complete_batch(
        self, batch: list[Delivery], fences: list[dict[str, Any]], now: datetime
    ) -> list[bool]:
        if self.completion_history and await _driver.supports_transactions(self.db):
            if await self._complete_in_own_transaction(batch, fences, now):
                return [True] * len(batch)
            # Some claim ended (the transaction wrote nothing): complete the others one by one.
            return [await self.complete(d) for d in batch]
        claimed = _driver.owned_by([(f["_id"], f["claims"]) for f in fences], "claims")
        result = await self.deliveries.delete_many({**claimed, "due_at": {"$exists": True}})
        if result.deleted_count == len(batch):
            done = [True] * len(batch)
        else:
            still = {
                doc["_id"]
                for doc in await _driver.find_list(
                    self.deliveries, {"_id": {"$in": [f["_id"] for f in fences]}},
                    projection={"_id": 1},
                )
            }  # fmt: skip
            proven = result.deleted_count == len(batch) - len(still)
            done = [proven and f["_id"] not in still for f in fences]
            if not proven:
                # Unproven is not undone: the events of every delivery gone keep their
                # completion time (it only lengthens how long they stay as deduplication
                # records); the history records only what is proven.
                gone = [d for d, f in zip(batch, fences, strict=True) if f["_id"] not in still]
                await self.events.update_many(
                    {"_id": {"$in": list({d.event.id for d in gone})}},
                    {"$max": {"completed_at": now}},
                )
                return done
        finished = [d for d, ok in zip(batch, done, strict=True) if ok]
        if finished:
            await self._after_completion(finished, now, None)
        return done

    def _dead_update(self, error: Any, now: datetime, *, charge: bool) -> dict[str, Any]:
        return {
            "$set": {"status": DEAD, "last_error": error_text(error), "updated_at": now},
            "$unset": {"due_at": "", "lane": ""},
            "$inc": {"claims": 1, "attempts": 1 if charge else 0},
        }

    async def _settle(
        self, delivery: Delivery, update: Callable[[datetime], Mapping[str, Any]]
    ) -> bool:
        """Apply ``update(now)`` to the delivery if its claim still holds. Whatever happens
        from here on, the claim no longer counts as running on this instance."""
        fence = self._fence(delivery)
        try:
            now = await self._now()
            result = await self.deliveries.update_one(fence, dict(update(now)))
        except BaseException:
            self._forget([delivery])
            raise
        self._forget([delivery])
        return bool(result.modified_count)

    async def reschedule(
        self, delivery: Delivery, *, delay: float, error: BaseException | str | None = None
    ) -> bool:
        """End this attempt as failed and make the delivery due again after `delay` seconds
        (its key stays blocked until then). False if the claim had ended."""
        self._fence(delivery)
        seconds = check_seconds("delay", delay)
        return await self._settle(delivery, lambda now: {
            "$set": {"due_at": now + timedelta(seconds=seconds), "lane": READY,
                     "last_error": error_text(error), "updated_at": now},
            "$inc": {"attempts": 1, "claims": 1},
        })  # fmt: skip

    async def release(self, delivery: Delivery) -> bool:
        """Hand the delivery back unrun (e.g. on shutdown), due now, no attempt counted."""
        return await self._settle(delivery, lambda now: {
            "$set": {"due_at": now, "lane": READY, "updated_at": now},
            "$inc": {"claims": 1},
        })  # fmt: skip

    async def bury(self, delivery: Delivery, *, error: BaseException | str | None = None) -> bool:
        """End this attempt as failed for good: the delivery becomes a dead letter (see
        `requeue`). Its key stays blocked behind it only while it is pending, so later
        deliveries of the key go on. False if the claim had ended."""
        return await self._settle(delivery, lambda now: self._dead_update(error, now, charge=True))

    async def extend_lease(self, owner: str) -> int:
        """Renew the lease of every lane `owner` holds on this instance; returns how many. An
        expired lease nobody took over is renewed too; a lane taken over is not."""
        owner = _check_owner("owner", owner)
        now = await self._now()
        result = await self.lanes.update_many(
            {"owner": owner, "instance": self.instance},
            {"$max": {"lease_until": now + timedelta(seconds=self.lease)}, "$inc": {"rev": 1}},
        )
        return int(result.matched_count)

    async def relinquish(self, owner: str) -> int:
        """Hand back every lane `owner` holds on this instance at once (graceful stop); returns
        how many. Whatever they still list as running is charged an attempt by the next holder,
        unless it was settled meanwhile."""
        owner = _check_owner("owner", owner)
        now = await self._now()
        async with self._claim_locks[owner]:
            docs = await _driver.find_list(self.lanes, {"owner": owner, "instance": self.instance})
            ops = []
            for lane in map(Lane.from_document, docs):
                lost = [e.document() for e in lane.lost + lane.in_flight]
                ops.append(_driver.update_by_id(self.db, lane.fence(owner, self.instance), {
                    "$set": {"owner": None, "instance": None, "lease_until": now,
                             "in_flight": [], "lost": lost},
                    "$inc": {"rev": 1},
                }))  # fmt: skip
            if not ops:
                return 0
            result = await self.lanes.bulk_write(ops, ordered=False)
            return int(result.matched_count)

    # --------------------------------------------------------------------------- operators

    async def requeue(self, event_id: str, handler: str) -> bool:
        """Make a dead delivery pending again, due now, with its attempts reset. It then comes
        before the later deliveries of its key that were not claimed yet, and does not start
        while one of them runs. False if there is no such dead delivery. A requeue that failed
        midway is finished by calling it again (it then returns True)."""
        if not isinstance(event_id, str) or not event_id:
            raise InvalidInput("event_id", "must be a non-empty string")
        _check_handler("handler", handler)
        now = await self._now()
        selector = {"event_id": event_id, "handler": handler}
        # Counted before and after the delivery turns pending: a claim whose heads were read
        # before that write and that records after it sees the count move either way (see
        # `_recheck_after_requeue`), even if the second count never happens.
        await self.lanes.update_one({"_id": REQUEUES}, {"$inc": {"value": 1}}, upsert=True)
        result = await self.deliveries.update_one(
            {**selector, "status": DEAD},
            {
                "$set": {"status": PENDING, "lane": READY, "due_at": now, "attempts": 0,
                         "updated_at": now, "requeue_uncounted": True},
                "$inc": {"claims": 1},
            },
        )  # fmt: skip
        if not result.modified_count:
            # A requeue that stopped before counting itself is finished by calling it again.
            unfinished = await self.deliveries.find_one(
                {**selector, "requeue_uncounted": True}, {"_id": 1}
            )
            if unfinished is None:
                return False
        # Counted after the delivery is pending: a claim in progress that sees the count move
        # checks its keyed picks again (see `_recheck_after_requeue`); then the mark goes.
        await self.lanes.update_one({"_id": REQUEUES}, {"$inc": {"value": 1}}, upsert=True)
        await self.deliveries.update_one(
            {**selector, "requeue_uncounted": True}, {"$unset": {"requeue_uncounted": ""}}
        )
        return True

    @staticmethod
    def _live(lanes: Iterable[Lane], now: datetime) -> list[Lane]:
        """The lanes held under a live lease."""
        return [lane for lane in lanes if lane.owner is not None and lane.lease_until > now]

    async def _running_ids(self, live: list[Lane]) -> set[Any]:
        """The deliveries the `live` lanes run: listed, and still at the listed generation."""
        entries = [e for lane in live for e in lane.in_flight]
        if not entries:
            return set()
        docs = await _driver.find_list(
            self.deliveries, {**generation_filter(entries), "due_at": {"$exists": True}},
            projection={"_id": 1},
        )  # fmt: skip
        return {doc["_id"] for doc in docs}

    async def list_deliveries(
        self,
        *,
        status: str | None = None,
        handler: str | None = None,
        event_type: str | None = None,
        limit: int = 100,
    ) -> list[DeliveryInfo]:
        """Deliveries, oldest first (parked ones in key order): ``pending`` (`running` tells
        which run now), ``parked``, ``dead``, or ``completed`` (the completion history; empty
        without it); all of them when `status` is None. `handler` and `event_type` narrow the
        list."""
        if status not in (None, PENDING, PARKED, DEAD, COMPLETED):
            raise InvalidInput("status", "must be None, 'pending', 'parked', 'dead' or 'completed'")
        if handler is not None:
            _check_handler("handler", handler)
        if event_type is not None:
            _check_handler("event_type", event_type)
        check_int("limit", limit, low=1, high=MAX_BATCH)
        now = await self._now()
        narrow: dict[str, Any] = {}
        if handler is not None:
            narrow["handler"] = handler
        if event_type is not None:
            narrow["event_type"] = event_type
        infos: list[DeliveryInfo] = []
        if status != COMPLETED:
            query = dict(narrow)
            hint = None
            if status == PARKED:
                query["lane"] = PARKED
                hint = PARKED_INDEX  # in key order (handler, key, sequence): the queue order
            elif status is not None:
                query["status"] = status
            docs = await _driver.find_list(
                self.deliveries, query, sort=None if hint else [("_id", 1)], limit=limit,
                hint=hint,
            )  # fmt: skip
            live = self._live((await read_lanes(self.lanes))[0], now) if docs else []
            running = await self._running_ids(live)
            infos += [self._info(doc, doc["_id"] in running) for doc in docs]
        if self.completion_history and status in (None, COMPLETED) and len(infos) < limit:
            docs = await _driver.find_list(
                self.history, narrow, sort=[("_id", 1)], limit=limit - len(infos)
            )
            infos += [self._info({**doc, "status": COMPLETED}, False) for doc in docs]
        return infos

    @staticmethod
    def _info(doc: Mapping[str, Any], running: bool) -> DeliveryInfo:
        status = doc.get("status", PENDING)
        if status == PENDING and doc.get("lane") == PARKED:
            status = PARKED
        return DeliveryInfo(
            id=str(doc["_id"]),
            event_id=doc["event_id"],
            event_type=doc.get("event_type", ""),
            handler=doc["handler"],
            status=status,
            attempts=int(doc.get("attempts", 0)),
            key=doc.get("key"),
            sequence=doc.get("sequence"),
            due_at=stored_instant(doc.get("due_at")),
            last_error=doc.get("last_error"),
            created_at=stored_instant(doc.get("created_at")),
            updated_at=stored_instant(doc.get("updated_at") or doc.get("completed_at")),
            running=running,
        )

    async def statistics(self) -> OutboxStatistics:
        """Counts per status, how many deliveries run now, the oldest due time of the
        unfinished ones, and how many lanes are held; a fixed number of commands."""
        now = await self._now()
        with _driver.index_required(self.deliveries, PARKED_INDEX):
            pending, parked, dead, completed, oldest, lanes = await asyncio.gather(
                self.deliveries.count_documents({"status": PENDING}),
                self.deliveries.count_documents({"lane": PARKED}, hint=PARKED_INDEX),
                self.deliveries.count_documents({"status": DEAD}),
                self.history.estimated_document_count() if self.completion_history else _zero(),
                _driver.find_list(
                    self.deliveries, {"due_at": {"$exists": True}}, sort=[("due_at", 1)],
                    limit=1, projection={"due_at": 1}, hint="due",
                ),
                read_lanes(self.lanes),
            )  # fmt: skip
        live = self._live(lanes[0], now)
        running = len(await self._running_ids(live))
        return OutboxStatistics(
            pending=int(pending),
            parked=int(parked),
            running=running,
            dead=int(dead),
            completed=int(completed),
            oldest_due_at=stored_instant(oldest[0]["due_at"]) if oldest else None,
            lanes_held=len(live),
        )

    async def purge(
        self, *, dead_before: datetime | None = None, completed_before: datetime | None = None
    ) -> PurgeResult:
        """Delete, in batches, dead deliveries last updated before `dead_before`, completion
        records before `completed_before`, and then the events nothing references any more.

        An event with a completion is kept as the deduplication record of its id until
        `completed_before` passes its last completion (a publish of the id after that runs
        its handlers again: keep completed retention longer than any redelivery window); an
        event that never completed goes once it was created before the earliest cutoff given.
        """
        for name, value in (("dead_before", dead_before), ("completed_before", completed_before)):
            if value is not None and not isinstance(value, datetime):
                raise InvalidInput(name, "must be None or a datetime")
        if dead_before is None and completed_before is None:
            return PurgeResult()
        dead = records = 0
        if dead_before is not None:
            dead = await self._purge_batches(
                self.deliveries, {"status": DEAD, "updated_at": {"$lt": dead_before}}, "updated_at"
            )
        if completed_before is not None and self.completion_history:
            records = await self._purge_batches(
                self.history, {"completed_at": {"$lt": completed_before}}, "completed_at"
            )
        events = await self._purge_events(dead_before, completed_before)
        return PurgeResult(dead, records, events)

    async def _purge_batches(self, collection: Any, query: dict[str, Any], field: str) -> int:
        total = 0
        while True:
            docs = await _driver.find_list(
                collection, query, sort=[(field, 1)], limit=self.purge_batch_size,
                projection={"_id": 1},
            )  # fmt: skip
            if not docs:
                return total
            # The query again in the delete: a dead delivery requeued since the read stays.
            result = await collection.delete_many(
                {**query, "_id": {"$in": [d["_id"] for d in docs]}}
            )
            total += int(result.deleted_count)
            if len(docs) < self.purge_batch_size:
                return total

    async def _purge_events(
        self, dead_before: datetime | None, completed_before: datetime | None
    ) -> int:
        cutoffs = [c for c in (dead_before, completed_before) if c is not None]
        queries: list[tuple[dict[str, Any], str]] = [
            (
                {"completed_at": {"$exists": False}, "created_at": {"$lt": min(cutoffs)}},
                "created_at",
            )
        ]
        if completed_before is not None:
            queries.append(({"completed_at": {"$lt": completed_before}}, "completed_at"))
        total = 0
        for query, field in queries:
            after: tuple[Any, Any] | None = None
            while True:
                page = dict(query)
                if after is not None:
                    page["$or"] = [
                        {field: {"$gt": after[0]}},
                        {field: after[0], "_id": {"$gt": after[1]}},
                    ]
                docs = await _driver.find_list(
                    self.events, page, sort=[(field, 1), ("_id", 1)],
                    limit=self.purge_batch_size, projection={field: 1},
                )  # fmt: skip
                if not docs:
                    break
                after = (docs[-1][field], docs[-1]["_id"])
                total += await self._delete_unreferenced(query, [d["_id"] for d in docs])
                if len(docs) < self.purge_batch_size:
                    break
        return total

    async def _delete_unreferenced(self, query: dict[str, Any], ids: list[Any]) -> int:
        async def delete(session: Any) -> int:
            referenced = set(
                await self.deliveries.distinct(
                    "event_id", {"event_id": {"$in": ids}}, session=session
                )
            )
            if self.completion_history:
                referenced |= set(
                    await self.history.distinct(
                        "event_id", {"event_id": {"$in": ids}}, session=session
                    )
                )
            free = [i for i in ids if i not in referenced]
            if not free:
                return 0
            result = await self.events.delete_many({**query, "_id": {"$in": free}}, session=session)
            return int(result.deleted_count)

        if await _driver.supports_transactions(self.db):
            # A publish adding a delivery to one of these events conflicts with the deletion,
            # and one of the two retries: a delivery never loses its event.
            return await _driver.run_in_transaction(self.db, delete)
        return await delete(None)


async def _zero() -> int:
    return 0
