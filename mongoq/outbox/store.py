"""`AsyncOutbox`: the transactional outbox's store (seed 002).

It checks what is published (the writes: `mongoq.outbox.publish`), settles claims (complete,
reschedule, release, bury, each fenced on the claim's generation), renews and hands back lanes,
and is the entry point of the claim (`mongoq.outbox.claim`) and of the operator calls
(`mongoq.outbox.operators`). It owns the collections ``events``, ``deliveries``,
``key_sequences``, ``lanes`` and ``completed_deliveries``: their layout, their indexes and
every filter and update sent to them are in `mongoq.outbox.schema`.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from logging import Logger
from typing import Any

from mongoq import _driver, registry
from mongoq._indexes import create_schema_indexes
from mongoq._validation import MAX_BATCH, check_batch, check_int, check_name, check_seconds
from mongoq._validation import check_worker_id as _check_owner
from mongoq.clock import Clock, ServerClock, stored_instant
from mongoq.errors import InvalidInput, LeaseLost
from mongoq.outbox import schema
from mongoq.outbox.claim import Claimer, parse_token
from mongoq.outbox.lanes import Lane, seed_lanes
from mongoq.outbox.models import (
    Delivery,
    DeliveryInfo,
    Event,
    OutboxStatistics,
    PublishResult,
    PurgeResult,
    check_handler,
)
from mongoq.outbox.operators import Operators
from mongoq.outbox.publish import Publisher
from mongoq.runtime import wakeups
from mongoq.runtime.events import report_start_delay
from mongoq.runtime.report import Attempt, error_text, log_attempt_end

__all__ = ["AsyncOutbox"]

log = logging.getLogger("mongoq.outbox")

_SUBSCRIBE_ALL = "*"


class AsyncOutbox:
    """Events written in the caller's MongoDB transaction, delivered at least once to each
    subscribed handler separately, in per-key order, with retries and dead letters.

    `subscriptions` maps an event type to the names of the handlers that receive it (``"*"``
    for every type); deliveries are created from the publisher's subscriptions, so every
    process that publishes needs the same map. Workers claim deliveries by leasing lanes for
    `lease` seconds (`OutboxDispatcher` does all of it). See `mongoq.outbox.schema` for the
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
            check_handler("subscriptions", event_type)
            if isinstance(names, str) or not isinstance(names, Iterable):
                raise InvalidInput(
                    f"subscriptions[{event_type!r}]", "must be a list of handler names"
                )
            checked = [check_handler(f"subscriptions[{event_type!r}]", n) for n in names]
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
        self.events = self._collection(schema.EVENTS)
        self.deliveries = self._collection(schema.DELIVERIES)
        self.sequences = self._collection(schema.SEQUENCES)
        self.lanes = self._collection(schema.LANES)
        self.history = self._collection(schema.HISTORY)
        # Lanes are held per owner *and* per instance: a process restarted under a fixed owner
        # name takes its predecessor's lanes over like any worker.
        self.instance = uuid.uuid4().hex
        self.wake_key = wakeups.key_of("outbox", db, prefix)
        self._claimer = Claimer(self)
        self._operators = Operators(self)
        self._publisher = Publisher(self)
        #: the handlers this instance knows have lanes (given by its `setup` or a publish)
        self._laned: set[str] = set()

    # ------------------------------------------------------------------------------ set-up

    def _collection(self, name: str) -> Any:
        return _driver.collection(self.db, f"{self.prefix}{name}")

    async def setup(self) -> None:
        """Create the collections, the indexes and 256 lane documents for each subscribed
        handler (and any lane missing from a handler that has lanes), and record the outbox
        in the database's registry (`mongoq.registry`); idempotent. Run it once before the
        first publish: collections created implicitly inside concurrent transactions conflict
        with each other."""
        await _driver.create_collections(
            self.db,
            [
                c.name
                for c in (self.events, self.deliveries, self.sequences, self.lanes, self.history)
            ],
        )
        await create_schema_indexes(self.db, schema.INDEXES, self._collection)
        subscribed = [h for names in self.subscriptions.values() for h in names]
        await seed_lanes(self.lanes, subscribed, every=True)
        self._laned.update(subscribed)
        await registry.register(
            self.db, "outbox", self.prefix, self.clock.now(),
            {"completion_history": self.completion_history},
        )  # fmt: skip

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
            await seed_lanes(self.lanes, missing)
            self._laned.update(missing)

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
            wanted = [check_handler("handlers", h) for h in handlers]
            if not wanted:
                return []
        check_int("limit", limit, low=1, high=MAX_BATCH)
        claimed = await self._claimer.claim(owner, wanted, limit)
        now = self.clock.now()
        for delivery in claimed:
            report_start_delay("outbox", self.prefix, delivery.due_at, now)
        return claimed

    # ------------------------------------------------------------------------------ settle

    @staticmethod
    def _fence(delivery: Delivery, field: str = "delivery") -> dict[str, Any]:
        doc_id, _, _, claims = parse_token(delivery, field)
        return schema.delivery_fence(doc_id, claims)

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
                self._forget([delivery], ended=True)  # its claim had ended
                raise
            # Still counted as running until the caller's transaction commits (the owner's next
            # claim looks it up and finds it gone). If it aborts, settle the delivery otherwise
            # (`reschedule`, `release`), as `OutboxDispatcher` does.
            self._claimer.unsure.add(delivery.owner)
            return True
        try:
            now = await self._now()
            if self.completion_history and await _driver.supports_transactions(self.db):
                done = await self._complete_in_own_transaction([delivery], [fence], now)
            else:
                await self._mark_completed([delivery], now, None)
                result = await self.deliveries.delete_one(fence)
                done = result.deleted_count == 1
                if done:
                    await self._write_history([delivery], now, None)
        except BaseException:
            self._forget([delivery])
            raise
        self._forget([delivery], ended=True)
        return done

    def _forget(self, deliveries: Iterable[Delivery], *, ended: bool = False) -> None:
        """Settled, or its outcome unknown: no longer counted as running by this instance; the
        next claim frees it if it was not settled after all (see `Claimer._reconcile`).
        `ended`: the outcome is known, the claim is over either way."""
        self._claimer.forget(deliveries, ended=ended)

    async def _complete_in(
        self, session: Any, deliveries: list[Delivery], fences: list[dict[str, Any]], now: datetime
    ) -> None:
        """All-or-nothing completion inside `session`'s transaction: `LeaseLost` if any of the
        claims has ended, which must abort the transaction (the deletions made so far with it)."""
        claimed = schema.delivery_claimed((f["_id"], f["claims"]) for f in fences)
        result = await self.deliveries.delete_many(claimed, session=session)
        if result.deleted_count != len(fences):
            raise LeaseLost(
                f"{len(fences) - result.deleted_count} of {len(fences)} deliveries are no longer "
                "held by their claim"
            )
        await self._mark_completed(deliveries, now, session)
        await self._write_history(deliveries, now, session)

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

    async def _mark_completed(
        self, deliveries: Sequence[Delivery], now: datetime, session: Any
    ) -> None:
        """Record on their events that `deliveries` completed: the completion time (the last
        one counts for purge) and their handlers listed (a replay then leaves them out). Sent
        before the deletion without a transaction: a handler is listed while its delivery
        still exists, never missing once it is gone. One that then does not complete (its
        claim had ended) is listed with its delivery still there, which a replay leaves alone
        too; its completion time only keeps the event longer."""
        handlers: dict[str, list[str]] = defaultdict(list)
        for delivery in deliveries:
            handlers[delivery.event.id].append(delivery.handler)
        await self.events.bulk_write(
            [
                _driver.update_by_id(
                    self.db, schema.event_by_id(event_id), schema.event_completing(now, names)
                )
                for event_id, names in handlers.items()
            ],
            ordered=False,
            session=session,
        )

    async def _write_history(
        self, deliveries: Sequence[Delivery], now: datetime, session: Any
    ) -> None:
        """The completion records of `deliveries` (with ``completion_history``)."""
        if not self.completion_history:
            return
        # Upserts, never an insert whose duplicate keys are ignored: inside a transaction any
        # write error aborts it on the server, caught or not, and the commit then fails
        # (NoSuchTransaction, retried by `with_transaction` into the same duplicate). A record
        # there already is kept as it is; the server retries the duplicate-key race of an
        # upsert by _id itself (in a transaction it is a write conflict, which is retried). The
        # same command with a session or without: no write error is swallowed anywhere.
        records = [schema.history_record(d, now) for d in deliveries]
        await self.history.bulk_write(
            [
                _driver.update_single(
                    self.db,
                    schema.history_by_id(record),
                    schema.history_inserting(record),
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
        self._forget(batch, ended=True)
        return done

    async def _complete_batch(
        self, batch: list[Delivery], fences: list[dict[str, Any]], now: datetime
    ) -> list[bool]:
        if self.completion_history and await _driver.supports_transactions(self.db):
            if await self._complete_in_own_transaction(batch, fences, now):
                return [True] * len(batch)
            # Some claim ended (the transaction wrote nothing): complete the others one by one.
            return [await self.complete(d) for d in batch]
        await self._mark_completed(batch, now, None)
        claimed = schema.delivery_claimed((f["_id"], f["claims"]) for f in fences)
        result = await self.deliveries.delete_many(claimed)
        if result.deleted_count == len(batch):
            done = [True] * len(batch)
        else:
            still = {
                doc["_id"]
                for doc in await _driver.find_list(
                    self.deliveries,
                    schema.deliveries_by_ids([f["_id"] for f in fences]),
                    projection={"_id": 1},
                )
            }
            # Unproven is not undone: the events of every delivery gone keep their completion
            # time and listing; the history records only what is proven.
            proven = result.deleted_count == len(batch) - len(still)
            done = [proven and f["_id"] not in still for f in fences]
        finished = [d for d, ok in zip(batch, done, strict=True) if ok]
        if finished:
            await self._write_history(finished, now, None)
        return done

    async def _settle(
        self,
        delivery: Delivery,
        update: Callable[[datetime], Mapping[str, Any]],
        *,
        failed: tuple[str, BaseException | str | None, float | None] | None = None,
        listed: bool = False,
    ) -> bool:
        """Apply ``update(now)`` to the delivery if its claim still holds. Whatever happens
        from here on, the claim no longer counts as running on this instance. `failed`, the
        failure this settle records (outcome, error, seconds until due again), is logged once
        it took effect."""
        fence = self._fence(delivery)
        try:
            now = await self._now()
            if listed:
                # A dead letter's handler is listed on its event, as a completed one's is: a
                # replay after the dead letter was purged does not create it again.
                await self.events.update_one(
                    schema.event_by_id(delivery.event.id),
                    schema.event_finishing([delivery.handler]),
                )
            result = await self.deliveries.update_one(fence, dict(update(now)))
        except BaseException:
            self._forget([delivery])
            raise
        self._forget([delivery], ended=True)
        done = bool(result.modified_count)
        if done and failed is not None:
            outcome, error, delay = failed
            item = f"{delivery.event.id}/{delivery.handler}"
            attempt = Attempt("outbox", self.prefix, item, delivery.attempt, delivery.owner)
            due = now + timedelta(seconds=delay) if delay is not None else None
            log_attempt_end(self.log, attempt, outcome, error, due)
        return done

    async def _next_due(self, handlers: Sequence[str]) -> datetime | None:
        """When the first pending delivery of `handlers` is due; None when none is left."""
        first = await _driver.find_list(
            self.deliveries, schema.delivery_pending_for(handlers), sort=[("due_at", 1)],
            limit=1, projection={"due_at": 1}, hint=schema.DUE_INDEX,
        )  # fmt: skip
        return stored_instant(first[0]["due_at"]) if first else None

    async def reschedule(
        self, delivery: Delivery, *, delay: float, error: BaseException | str | None = None
    ) -> bool:
        """End this attempt as failed and make the delivery due again after `delay` seconds
        (its key stays blocked until then). False if the claim had ended."""
        self._fence(delivery)
        seconds = check_seconds("delay", delay)
        return await self._settle(
            delivery,
            lambda now: schema.delivery_rescheduling(now, seconds, error_text(error)),
            failed=("retried", error, seconds),
        )

    async def release(self, delivery: Delivery) -> bool:
        """Hand the delivery back unrun (e.g. on shutdown), due now, no attempt counted."""
        return await self._settle(delivery, schema.delivery_releasing)

    async def bury(self, delivery: Delivery, *, error: BaseException | str | None = None) -> bool:
        """End this attempt as failed for good: the delivery becomes a dead letter (see
        `requeue`). Its key stays blocked behind it only while it is pending, so later
        deliveries of the key go on. False if the claim had ended."""
        return await self._settle(
            delivery,
            lambda now: schema.delivery_burying(error_text(error), now, charge=True),
            failed=("buried", error, None),
            listed=True,
        )

    async def extend_lease(self, owner: str) -> int:
        """Renew the lease of every lane `owner` holds on this instance; returns how many. An
        expired lease nobody took over is renewed too; a lane taken over is not."""
        owner = _check_owner("owner", owner)
        now = await self._now()
        result = await self.lanes.update_many(
            schema.lanes_held(owner, self.instance),
            schema.lane_renewing(now + timedelta(seconds=self.lease)),
        )
        return int(result.matched_count)

    async def relinquish(self, owner: str) -> int:
        """Hand back every lane `owner` holds on this instance at once (graceful stop); returns
        how many. Whatever they still list as running is charged an attempt by the next holder,
        unless it was settled meanwhile."""
        owner = _check_owner("owner", owner)
        now = await self._now()
        async with self._claimer.locks[owner]:
            self._claimer.invalidate()
            self._claimer.ended.pop(owner, None)  # what its lanes list is lost from here on
            docs = await _driver.find_list(self.lanes, schema.lanes_held(owner, self.instance))
            ops = []
            for lane in map(Lane.from_document, docs):
                fence = lane.fence(owner, self.instance)
                update = schema.lane_handing_back(now, lane.lost + lane.in_flight)
                ops.append(_driver.update_by_id(self.db, fence, update))
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
        return await self._operators.requeue(event_id, handler)

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
        return await self._operators.list_deliveries(status, handler, event_type, limit)

    async def stats(self) -> OutboxStatistics:
        """Counts per status, how many deliveries run now, the oldest due time of the
        unfinished ones, and how many lanes are held; a fixed number of commands."""
        return await self._operators.stats()

    async def count_finished(self, since: datetime, until: datetime | None = None) -> int | None:
        """How many deliveries finished (completed or buried) at or after `since` and before
        `until` (None: up to now) and are still recorded: a throughput that a purge of older
        ones leaves alone (two indexed counts; the dashboard's chart). None without
        `completion_history`: a completion then leaves no record to count."""
        return await self._operators.count_finished(since, until)

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
        return await self._operators.purge(dead_before, completed_before)
