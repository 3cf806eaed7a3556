"""The outbox's publish: the writes `AsyncOutbox.publish` sends once it checked its events,
run by `Publisher`, built from the collections it writes and the subscriptions.

It writes ``events`` (an event, its ``stored_at``; a transaction's handler listing),
``deliveries`` (one per subscribed handler the event has none for; a replay's held ones) and
``key_sequences`` (a keyed event's sequence); the layout and every filter and update are in
`mongoq.outbox.schema`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pymongo import ReturnDocument, UpdateMany, UpdateOne
from pymongo.errors import BulkWriteError, OperationFailure

from mongoq import _driver
from mongoq.errors import UnreadableDocument
from mongoq.outbox import schema
from mongoq.outbox.faults import counter_value, kind
from mongoq.outbox.models import Event, PublishResult, lane_of, subscribed_handlers

__all__ = ["Publisher"]


class Publisher:
    """The publish of one `AsyncOutbox`: in the caller's transaction (`in_transaction`) or
    without one (`plain`)."""

    def __init__(
        self, db: Any, *, events: Any, deliveries: Any, sequences: Any,
        subscriptions: Mapping[str, tuple[str, ...]],
    ) -> None:  # fmt: skip
        self.db = db
        self.events = events
        self.deliveries = deliveries
        self.sequences = sequences
        self.subscriptions = subscriptions

    async def _sequences(self, events: Sequence[Event], session: Any) -> dict[str, int]:
        """The next sequence of each keyed event's key, in the order of `events`.

        A counter whose value says no sequence to trust (`faults.counter_value`) raises
        `UnreadableDocument` before anything else is written (no event, no delivery): only
        this counter orders the key's deliveries, so no guess is safe. A value that is no
        number (a string, null) is refused by the server (code 14): nothing written. Else
        (NaN, an infinity, a double beyond 2**53, a number beyond 64 bits) the ``$inc`` was
        applied before the value could be read: NaN and the infinities stay what they were,
        a large double may have moved by a rounding step (the operator sets it anyway). In
        the caller's transaction (`in_transaction`) it aborts with the error: undone too."""
        per_key: dict[str, list[str]] = defaultdict(list)
        for event in events:
            if event.key is not None:
                per_key[event.key].append(event.id)
        sequences: dict[str, int] = {}
        for key, ids in per_key.items():
            try:
                counter = await self.sequences.find_one_and_update(
                    schema.sequence_of(key),
                    schema.sequence_taking(len(ids)),
                    upsert=True,
                    return_document=ReturnDocument.AFTER,
                    session=session,
                )
            except OperationFailure as refused:
                if not _driver.type_mismatch(refused):
                    raise
                raise self._unreadable(key, "no number") from refused
            value = counter.get("value")
            last = counter_value(value)
            if last is None:
                raise self._unreadable(key, kind(value))
            first = last - len(ids) + 1
            for offset, event_id in enumerate(ids):
                sequences[event_id] = first + offset
        return sequences

    def _unreadable(self, key: str, found: str) -> UnreadableDocument:
        return UnreadableDocument(
            self.sequences.name, key, "value", found,
            "set it to a whole number no lower than the highest sequence of the key's events",
        )  # fmt: skip

    def _delivery_documents(
        self, event_id: str, stored: Mapping[str, Any], handlers: Iterable[str], now: datetime
    ) -> list[dict[str, Any]]:
        key = stored.get("key")
        lane_id = lane_of(key if key is not None else event_id)
        sequence = stored.get("sequence") if key is not None else None
        return [
            schema.delivery_document(event_id, stored["type"], handler, lane_id, key, sequence, now)
            for handler in handlers
        ]

    def _wanted(self, stored: Mapping[str, Any]) -> list[str]:
        """The subscribed handlers the stored event does not list yet."""
        listed = stored.get("handlers", ())
        return [
            h for h in subscribed_handlers(self.subscriptions, stored["type"]) if h not in listed
        ]

    async def _existing(self, ids: list[str], session: Any) -> dict[str, dict[str, Any]]:
        docs = await self.events.find(
            schema.events_by_ids(ids), schema.EVENT_REPLAY_PROJECTION, session=session
        ).to_list(None)
        return {doc["_id"]: doc for doc in docs}

    async def in_transaction(
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
            stored = existing.get(event.id) or schema.event_document(
                event, now, sequences.get(event.id)
            )
            wanted = self._wanted(stored)
            if event.id in existing and not wanted:
                continue
            # Touched (`stored_at`) too: a purge whose delete comes after this commit leaves it.
            update = schema.event_listing(wanted, None if event.id in existing else stored, now)
            ops.append(
                _driver.update_single(self.db, schema.event_by_id(event.id), update, upsert=True)
            )
            deliveries += [
                _driver.update_single(
                    self.db,
                    schema.delivery_of(event.id, doc["handler"]),
                    schema.delivery_inserting(doc),
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

    async def plain(self, events: list[Event], now: datetime) -> PublishResult:
        """Publish without a transaction. The order of the writes carries the guarantees, in
        two commands for new events: the event exists before its deliveries (a claim never
        finds a delivery without its event, and a purge leaves a young event alone), and a
        handler is listed on the event only once its delivery finished (`complete`, `bury`),
        never while it has none. A replay creates the deliveries of the handlers not listed:
        the unique index turns the ones still there into no-ops, and a crash before they were
        written is repaired by publishing again (at least once, never lost)."""
        stored_of, new_ids = await self._write_events(events, now)
        hold_until = now + timedelta(seconds=schema.REPLAY_HOLD)
        deliveries: list[dict[str, Any]] = []
        for event in events:
            stored = stored_of[event.id]
            docs = self._delivery_documents(event.id, stored, self._wanted(stored), now)
            if event.id not in new_ids:  # held: see `_release_replayed`
                docs = [schema.delivery_held(doc, hold_until) for doc in docs]
            deliveries += docs
        inserted = await self._insert_deliveries(deliveries)
        held = [d for d in inserted if d["event_id"] not in new_ids]
        dropped = 0
        if held:
            sequences_of = {i: stored.get("sequence") for i, stored in stored_of.items()}
            dropped = await self._release_replayed(events, sequences_of, held, hold_until, now)
        return PublishResult(len(new_ids), len(inserted) - dropped)

    async def _write_events(
        self, events: list[Event], now: datetime
    ) -> tuple[dict[str, Mapping[str, Any]], set[str]]:
        """Upsert `events`; returns each as stored (a replayed one as read back) and the ids
        of the new ones. Sequences are taken for every keyed event before knowing which are
        new: a replay leaves a gap in its key's sequence, which blocks nothing."""
        sequences = await self._sequences(events, None)
        documents = {e.id: schema.event_document(e, now, sequences.get(e.id)) for e in events}
        upserts: list[UpdateOne | UpdateMany] = [
            _driver.update_single(
                self.db,
                schema.event_by_id(e.id),
                schema.event_inserting(documents[e.id]),
                upsert=True,
            )
            for e in events
        ]
        result = await self.events.bulk_write(upserts, ordered=True)
        # By the upserted _id (the event id), not its position: mongomock numbers the upserts
        # of a bulk write among themselves, a server by request.
        new_ids = set(result.upserted_ids.values())
        replayed = [e.id for e in events if e.id not in new_ids]
        existing = await self._existing(replayed, None) if replayed else {}
        return {e.id: existing.get(e.id) or documents[e.id] for e in events}, new_ids

    async def _insert_deliveries(self, deliveries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Insert `deliveries`, a duplicate (the delivery is there already) refused; returns
        the inserted ones."""
        if not deliveries:
            return []
        try:
            await self.deliveries.insert_many(deliveries, ordered=False)
        except BulkWriteError as exc:
            if not _driver.only_duplicates(exc):
                raise
            refused = {e["index"] for e in exc.details.get("writeErrors", [])}
            return [d for i, d in enumerate(deliveries) if i not in refused]
        return list(deliveries)

    async def _release_replayed(
        self,
        events: list[Event],
        sequences: Mapping[str, int | None],
        held: list[dict[str, Any]],
        hold_until: datetime,
        now: datetime,
    ) -> int:
        """A replay's new deliveries were written held (not due): read their events again. A
        handler listed since (its delivery completed while the replay ran, after the replay
        read the event) gets no second delivery: deleted. The others are released, due now;
        an event a purge deleted meanwhile is written again first (with its sequence). Returns
        how many were deleted."""
        ids = list({d["event_id"] for d in held})
        current = await self._existing(ids, None)
        restored = [
            _driver.update_single(
                self.db, schema.event_by_id(e.id),
                schema.event_inserting(schema.event_document(e, now, sequences.get(e.id))),
                upsert=True,
            )
            for e in events if e.id in ids and e.id not in current
        ]  # fmt: skip
        if restored:
            await self.events.bulk_write(restored, ordered=False)
        # Finished, not merely listed: a transactional publish lists the handlers it creates.
        finished = [
            d["_id"] for d in held
            if d["handler"] in current.get(d["event_id"], {}).get("finished", ())
        ]  # fmt: skip
        release = [d["_id"] for d in held if d["_id"] not in set(finished)]
        dropped = 0
        if finished:
            result = await self.deliveries.delete_many(schema.deliveries_held(finished, hold_until))
            dropped = int(result.deleted_count)
        if release:
            await self.deliveries.update_many(
                schema.deliveries_held(release, hold_until), schema.delivery_releasing_held(now)
            )
        return dropped
