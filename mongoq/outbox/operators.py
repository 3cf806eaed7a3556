"""The outbox's operator calls, mixed into `AsyncOutbox`: `requeue`, `list_deliveries`,
`stats`, `count_finished` and `purge`.

They read every collection of the outbox and write ``deliveries`` (a requeue; purge of dead
letters), ``events`` and ``completed_deliveries`` (purge), and a requeue's count in its lane
(through `mongoq.outbox.lanes.LaneStore`); the layout and every filter and update are in
`mongoq.outbox.schema`. They own no collection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import MAX_BATCH, check_instant, check_int, check_window
from mongoq.clock import Clock, stored_instant
from mongoq.errors import InvalidInput
from mongoq.outbox import schema
from mongoq.outbox.faults import whole
from mongoq.outbox.lanes import Lane, LaneStore, read_lanes
from mongoq.outbox.models import (
    LANES,
    DeliveryInfo,
    OutboxStats,
    PurgeResult,
    check_handler,
    lane_of,
)
from mongoq.outbox.quarantine import dead_as_read, delivery_requeuing_repaired
from mongoq.outbox.schema import (
    COMPLETED,
    DEAD,
    PARKED,
    PARKED_INDEX,
    PENDING,
    after_key,
    with_ids,
)

__all__ = ["OutboxOperators"]


@names_unreachable_server
class OutboxOperators:
    """`requeue`, `list_deliveries`, `stats`, `count_finished` and `purge` of `AsyncOutbox`."""

    # set by the outbox's constructor
    db: Any
    clock: Clock
    completion_history: bool
    purge_batch_size: int
    events: Any
    deliveries: Any
    lanes: Any
    history: Any
    _lane_store: LaneStore

    if TYPE_CHECKING:

        async def _now(self) -> datetime: ...  # the outbox's (`AsyncOutbox._now`)

    async def requeue(self, event_id: str, handler: str) -> bool:
        """Make a dead delivery pending again, due now, with its attempts reset. It then comes
        before the later deliveries of its key that were not claimed yet, and does not start
        while one of them runs. False if there is no such dead delivery. A requeue that failed
        midway is finished by calling it again (it then returns True)."""
        if not isinstance(event_id, str) or not event_id:
            raise InvalidInput("event_id", "must be a non-empty string")
        check_handler("handler", handler)
        now = await self._now()
        found = await self.deliveries.find_one(
            schema.delivery_of(event_id, handler), schema.REQUEUE_PROJECTION
        )
        if found is None or not (found.get("status") == DEAD or found.get("requeue_uncounted")):
            return False
        query, update, lane = _requeuing(found, event_id, handler, now)
        # Counted in the delivery's lane before and after it turns pending: a claim that read
        # the lane before a count and lists picks in it after fails that write, either way,
        # even if the second count never happens (see `Lane.listing_fence`).
        await self._lane_store.count_requeue(handler, lane, now)
        result = await self.deliveries.update_one(query, update)
        if not result.modified_count and not found.get("requeue_uncounted"):
            return False  # requeued by another call meanwhile
        # (A requeue that stopped before counting itself is finished by calling it again.)
        await self._lane_store.count_requeue(handler, lane, now)
        await self.deliveries.update_one(
            schema.delivery_requeue_uncounted(event_id, handler), schema.delivery_requeue_counted()
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
            self.deliveries,
            schema.delivery_claimed(e.claim for e in entries),
            projection={"_id": 1},
        )
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
            check_handler("handler", handler)
        if event_type is not None:
            check_handler("event_type", event_type)
        check_int("limit", limit, low=1, high=MAX_BATCH)
        now = await self._now()
        infos: list[DeliveryInfo] = []
        if status != COMPLETED:
            # Parked ones in key order (handler, key, sequence): the queue order.
            hint = PARKED_INDEX if status == PARKED else None
            docs = await _driver.find_list(
                self.deliveries, schema.delivery_listed(status, handler, event_type),
                sort=None if hint else [("_id", 1)], limit=limit, hint=hint,
            )  # fmt: skip
            live = self._live((await read_lanes(self.lanes))[0], now) if docs else []
            running = await self._running_ids(live)
            infos += [DeliveryInfo.from_document(doc, doc["_id"] in running) for doc in docs]
        history = self.completion_history
        if history and status in (None, COMPLETED) and len(infos) < limit:
            docs = await _driver.find_list(
                self.history, schema.listed_by(handler, event_type), sort=[("_id", 1)],
                limit=limit - len(infos),
            )  # fmt: skip
            infos += [
                DeliveryInfo.from_document({**doc, "status": COMPLETED}, False) for doc in docs
            ]
        return infos

    async def count_finished(self, since: datetime, until: datetime | None = None) -> int | None:
        """How many deliveries finished (completed or buried) at or after `since` and before
        `until` (None: up to now) and are still recorded: a throughput that a purge of older
        ones leaves alone (two indexed counts; the dashboard's chart). None without
        `completion_history`: a completion then leaves no record to count."""
        since, until = check_window(since, until)
        if not self.completion_history:
            return None
        dead, completed = await asyncio.gather(
            self.deliveries.count_documents(schema.deliveries_dead_between(since, until)),
            self.history.count_documents(schema.history_completed_between(since, until)),
        )
        return int(dead) + int(completed)

    async def stats(self) -> OutboxStats:
        """Counts per status, how many deliveries run now, the oldest due time of the
        unfinished ones, and how many lanes are held; a fixed number of commands."""
        now = await self._now()
        history = self.completion_history
        with _driver.index_required(self.deliveries, PARKED_INDEX):
            pending, parked, dead, completed, oldest, lanes = await asyncio.gather(
                self.deliveries.count_documents(schema.delivery_in_status(PENDING)),
                self.deliveries.count_documents(schema.delivery_parked(), hint=PARKED_INDEX),
                self.deliveries.count_documents(schema.delivery_in_status(DEAD)),
                self.history.estimated_document_count() if history else _zero(),
                _driver.find_list(
                    self.deliveries, schema.delivery_pending(), sort=[("due_at", 1)],
                    limit=1, projection={"due_at": 1}, hint=schema.DUE_INDEX,
                ),
                read_lanes(self.lanes),
            )  # fmt: skip
        live = self._live(lanes[0], now)  # (a lane that cannot be read: counted as not held)
        running = len(await self._running_ids(live))
        oldest_due = stored_instant(oldest[0]["due_at"]) if oldest else None
        if oldest and oldest_due is None:
            # The first by due time holds no date (a hand edit; the dispatcher sets it aside):
            # the oldest date is read past it, a range of the same index (dates only).
            dated = await _driver.find_list(
                self.deliveries, schema.delivery_pending_dated(), sort=[("due_at", 1)],
                limit=1, projection={"due_at": 1}, hint=schema.DUE_INDEX,
            )  # fmt: skip
            oldest_due = stored_instant(dated[0]["due_at"]) if dated else None
        return OutboxStats(
            pending=int(pending),
            parked=int(parked),
            running=running,
            dead=int(dead),
            completed=int(completed),
            oldest_due_at=oldest_due,
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
        check_instant("dead_before", dead_before)
        check_instant("completed_before", completed_before)
        if dead_before is None and completed_before is None:
            return PurgeResult()
        dead = records = 0
        if dead_before is not None:
            dead = await self._purge_batches(
                self.deliveries, schema.delivery_dead_before(dead_before), "updated_at"
            )
        if completed_before is not None and self.completion_history:
            records = await self._purge_batches(
                self.history, schema.history_completed_before(completed_before), "completed_at"
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
            result = await collection.delete_many(with_ids(query, [d["_id"] for d in docs]))
            total += int(result.deleted_count)
            if len(docs) < self.purge_batch_size:
                return total

    async def _purge_events(
        self, dead_before: datetime | None, completed_before: datetime | None
    ) -> int:
        cutoffs = [c for c in (dead_before, completed_before) if c is not None]
        young = await self._now() - timedelta(seconds=schema.PUBLISH_GRACE)
        queries: list[tuple[dict[str, Any], str]] = [
            (schema.event_uncompleted_before(min(cutoffs), young), "created_at")
        ]
        if completed_before is not None:
            queries.append((schema.event_completed_before(completed_before, young), "completed_at"))
        total = 0
        for query, field in queries:
            after: tuple[Any, Any] | None = None
            while True:
                page = dict(query) if after is None else {**query, **after_key(field, *after)}
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
                    "event_id", schema.deliveries_of_events(ids), session=session
                )
            )
            if self.completion_history:
                referenced |= set(
                    await self.history.distinct(
                        "event_id", schema.deliveries_of_events(ids), session=session
                    )
                )
            free = [i for i in ids if i not in referenced]
            if not free:
                return 0
            result = await self.events.delete_many(with_ids(query, free), session=session)
            return int(result.deleted_count)

        if await _driver.supports_transactions(self.db):
            # A publish adding a delivery to one of these events conflicts with the deletion,
            # and one of the two retries: a delivery never loses its event.
            return await _driver.run_in_transaction(self.db, delete)
        return await delete(None)


async def _zero() -> int:
    return 0


def _requeuing(
    found: dict[str, Any], event_id: str, handler: str, now: datetime
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The filter and update of `requeue` of the dead delivery `found` (as read), and its lane
    number. A lane or generation that holds no number (a hand edit: a dead letter set aside
    keeps what it held) is repaired: the lane of its key (or event), a new generation."""
    if whole(found.get("lane_id"), 0, LANES) and whole(found.get("claims")):
        query, update = schema.delivery_dead(event_id, handler), schema.delivery_requeuing(now)
        return query, update, int(found["lane_id"])
    key = found.get("key")
    lane = lane_of(key if isinstance(key, str) else event_id)
    update = delivery_requeuing_repaired(now, lane, int(now.timestamp() * 1000))
    return dead_as_read(event_id, handler, found), update, lane
