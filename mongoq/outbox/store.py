"""`AsyncOutbox`, the transactional outbox's face: its constructor, `setup`, `publish` and
`claim`. What a lease holder calls is mixed in from `mongoq.outbox.settles`, what an operator
calls from `mongoq.outbox.operators`; the writes of a publish are `mongoq.outbox.publish`'s,
the claim `mongoq.outbox.claim`'s, every lane write `mongoq.outbox.lanes`'. It owns the
collections ``events``, ``deliveries``, ``key_sequences``, ``lanes`` and
``completed_deliveries``: their layout, their indexes and every filter and update sent to them
are in `mongoq.outbox.schema`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from logging import Logger
from typing import Any

from mongoq import _driver, registry
from mongoq._indexes import create_schema_indexes
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import (
    MAX_BATCH,
    check_batch,
    check_int,
    check_lease_seconds,
    check_name,
    check_worker_id,
)
from mongoq.clock import Clock, ServerClock, stored_instant
from mongoq.errors import InvalidInput
from mongoq.outbox import schema
from mongoq.outbox.claim import Claimer
from mongoq.outbox.lanes import LaneStore
from mongoq.outbox.models import Delivery, Event, PublishResult, check_handler, subscribed_handlers
from mongoq.outbox.operators import OutboxOperators
from mongoq.outbox.publish import Publisher
from mongoq.outbox.quarantine import SET_ASIDE_PER_READ, Quarantine
from mongoq.outbox.settles import OutboxSettles
from mongoq.runtime import wakeups
from mongoq.runtime.events import report_start_delay

__all__ = ["AsyncOutbox"]

log = logging.getLogger("mongoq.outbox")


@names_unreachable_server
class AsyncOutbox(OutboxSettles, OutboxOperators):
    """Events written in the caller's MongoDB transaction, delivered at least once to each
    subscribed handler separately, in per-key order, with retries and dead letters.

    `subscriptions` maps an event type to the names of the handlers that receive it (``"*"``
    for every type); deliveries are created from the publisher's subscriptions, so every
    process that publishes needs the same map. Workers claim deliveries by leasing lanes for
    `lease_ttl` seconds (`OutboxDispatcher` does all of it). See `mongoq.outbox.schema` for the
    layout and `mongoq.outbox` for the guarantees.
    """

    def __init__(
        self,
        db: Any,
        prefix: str = "mongoq_outbox_",
        *,
        subscriptions: Mapping[str, Iterable[str]],
        lease_ttl: float = 30,
        completion_history: bool = False,
        clock: Clock | None = None,
        logger: Logger | None = None,
        purge_batch_size: int = 500,
    ) -> None:
        _driver.backend_of(db)
        check_name("prefix", prefix, prefix=True)
        if not isinstance(subscriptions, Mapping):
            raise InvalidInput("subscriptions", "must map event types to handler names")
        self.subscriptions: dict[str, tuple[str, ...]] = {}
        for event_type, names in subscriptions.items():
            check_handler("subscriptions", event_type)
            if isinstance(names, str) or not isinstance(names, Iterable):
                raise InvalidInput(
                    f"subscriptions[{event_type!r}]", "must be a list of handler names"
                )
            checked = [check_handler(f"subscriptions[{event_type!r}]", n) for n in names]
            self.subscriptions[event_type] = tuple(dict.fromkeys(checked))
        self.lease_ttl = check_lease_seconds("lease_ttl", lease_ttl)
        if not isinstance(completion_history, bool):
            raise InvalidInput("completion_history", "must be a bool")
        self.completion_history = completion_history
        self.purge_batch_size = check_int("purge_batch_size", purge_batch_size, low=1, high=10_000)
        self.clock: Clock = clock if clock is not None else ServerClock(db)
        self.log = logger if logger is not None else log
        self.db = db
        self.prefix = prefix
        self.events = self._collection(schema.EVENTS)
        self.deliveries = self._collection(schema.DELIVERIES)
        self.sequences = self._collection(schema.SEQUENCES)
        self.lanes = self._collection(schema.LANES)
        self.history = self._collection(schema.HISTORY)
        # Lanes are held per worker *and* per instance: a process restarted under a fixed worker
        # id takes its predecessor's lanes over like any worker.
        self.instance = uuid.uuid4().hex
        self.wake_key = wakeups.key_of("outbox", db, prefix)
        self._quarantine = Quarantine(
            deliveries=self.deliveries, lanes=self.lanes, prefix=prefix, log=self.log
        )
        self._lane_store = LaneStore(db, self.lanes, self.instance, self._quarantine)
        self._claimer = Claimer(
            lanes=self._lane_store, deliveries=self.deliveries, events=self.events,
            clock=self.clock, lease_ttl=self.lease_ttl, log=self.log, quarantine=self._quarantine,
        )  # fmt: skip
        self._publisher = Publisher(
            db, events=self.events, deliveries=self.deliveries, sequences=self.sequences,
            subscriptions=self.subscriptions,
        )  # fmt: skip
        #: the handlers this instance knows have lanes (given by its `setup` or a publish)
        self._laned: set[str] = set()

    # ------------------------------------------------------------------------------ set-up

    def _collection(self, name: str) -> Any:
        return _driver.collection(self.db, f"{self.prefix}{name}")

    async def _now(self) -> datetime:
        await self.clock.refresh()
        return self.clock.now()

    async def setup(self) -> None:
        """Create the collections, the indexes and 256 lane documents for each subscribed
        handler (and any lane missing from a handler that has lanes), and record the outbox
        in the database's registry (`mongoq.registry`); idempotent. Run it once before the
        first publish: collections created implicitly inside concurrent transactions conflict
        with each other. `InvalidInput`, before anything is written, if a collection of it is
        another registered primitive's."""
        await registry.check_collections(self.db, "outbox", self.prefix)
        await _driver.create_collections(
            self.db,
            [
                c.name
                for c in (self.events, self.deliveries, self.sequences, self.lanes, self.history)
            ],
        )
        await create_schema_indexes(self.db, schema.INDEXES, self._collection)
        subscribed = [h for names in self.subscriptions.values() for h in names]
        await self._lane_store.seed(subscribed, every=True)
        self._laned.update(subscribed)
        await registry.register(
            self.db, "outbox", self.prefix, self.clock.now(),
            {"completion_history": self.completion_history},
        )  # fmt: skip

    # ----------------------------------------------------------------------------- publish

    def handlers_for(self, event_type: str) -> tuple[str, ...]:
        """The handlers subscribed to `event_type` (its own, then the ``"*"`` ones)."""
        return subscribed_handlers(self.subscriptions, event_type)

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
        await self._lanes_for(checked.values())
        now = await self._now()
        if transactional:
            return await self._publisher.in_transaction(list(checked.values()), session, now)
        result = await self._publisher.plain(list(checked.values()), now)
        if result.deliveries_added:
            wakeups.notify(self.wake_key)  # committed already: this process's dispatchers
        return result

    async def _lanes_for(self, events: Iterable[Event]) -> None:
        """Lanes for the handlers `events` go to, before their deliveries exist (outside any
        transaction: lanes are never rolled back): a claim for every handler (None) finds
        the handlers by their lanes. Once per handler and instance; `setup` gave its own."""
        wanted = {h for e in events for h in self.handlers_for(e.type)}
        missing = sorted(wanted - self._laned)
        if missing:
            await self._lane_store.seed(missing)
            self._laned.update(missing)

    # ------------------------------------------------------------------------------- claim

    async def claim(
        self, worker_id: str, handlers: Iterable[str] | None = None, *, limit: int = 16
    ) -> list[Delivery]:
        """Claim up to `limit` due deliveries for `worker_id` (of `handlers`, or of any handler).

        Claims from the lanes `worker_id` holds on this instance, then takes free lanes (no owner,
        or an expired lease) holding the oldest due deliveries; a lane that another claimer
        takes first is skipped, never waited for. A keyed delivery is taken only when it is the
        lowest pending sequence of its handler and key and none of them runs; one claim never
        takes two deliveries of one key. Lanes that yield nothing and run nothing are handed
        back. Claims of one worker on one instance run one after the other.
        """
        owner = check_worker_id("worker_id", worker_id)
        wanted = None
        if handlers is not None:
            if isinstance(handlers, str):
                raise InvalidInput("handlers", "must be a list of handler names, not a string")
            wanted = [check_handler("handlers", h) for h in handlers]
            if not wanted:
                return []
        check_int("limit", limit, low=1, high=MAX_BATCH)
        claimed = await self._claimer.claim(owner, wanted, limit)
        now = self.clock.now()
        for delivery in claimed:
            report_start_delay("outbox", self.prefix, delivery.due_at, now)
        return claimed

    async def _next_due(self, handlers: Sequence[str]) -> datetime | None:
        """When the first pending delivery of `handlers` is due; None when none is left. One
        whose due time is no date (a hand edit: no claim ever scans it) is set aside, and the
        next one read (a few at most: then it says now, and is asked again)."""
        for _ in range(SET_ASIDE_PER_READ):
            first = await _driver.find_list(
                self.deliveries, schema.delivery_pending_for(handlers), sort=[("due_at", 1)],
                limit=1, projection={"due_at": 1}, hint=schema.DUE_INDEX,
            )  # fmt: skip
            due = stored_instant(first[0]["due_at"]) if first else None
            if due is not None or not first:
                return due
            query = schema.deliveries_by_ids([first[0]["_id"]])
            await self._quarantine.set_aside_read(query, await self._now(), None)
        return self.clock.now()
