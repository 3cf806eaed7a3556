"""The lease holder's calls of `AsyncOutbox`, mixed into it: complete (one delivery, in the
caller's transaction or not, or a batch), reschedule, release, bury, and the renewal and
hand-back of a worker's lanes. Every settle is fenced on the claim's generation: a worker whose
claim ended changes nothing. They write ``deliveries``, ``events`` (completions, dead letters
listed) and ``completed_deliveries`` (with ``completion_history``); the lanes through
`mongoq.outbox.lanes.LaneStore`. They own no collection.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from logging import Logger
from typing import TYPE_CHECKING, Any

from pymongo.errors import BulkWriteError, OperationFailure

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import check_batch, check_seconds, check_worker_id
from mongoq.clock import Clock
from mongoq.errors import InvalidInput, LeaseLost
from mongoq.outbox import schema
from mongoq.outbox.claim import Claimer
from mongoq.outbox.faults import event_fault
from mongoq.outbox.lanes import LaneStore
from mongoq.outbox.models import Delivery, parse_token
from mongoq.outbox.quarantine import Unusable
from mongoq.runtime.report import Attempt, error_text, log_attempt_end

__all__ = ["RECORD_REFUSED_CODES", "OutboxSettles"]

#: ``$addToSet`` (or ``$push``) to a field that holds no array: BadValue.
NOT_AN_ARRAY = 2
#: The server's refusals of an event's completion record for a field of the wrong type (a hand
#: edit: ``handlers`` or ``finished`` no array, `NOT_AN_ARRAY`; a type mismatch,
#: `mongoq._driver.TYPE_MISMATCH_CODES`). Definite: nothing was written. Only these set the
#: delivery aside; any other write error (a validator's 121, a size refusal) is raised.
RECORD_REFUSED_CODES = frozenset({NOT_AN_ARRAY, *_driver.TYPE_MISMATCH_CODES})


class _RecordsRefused(BulkWriteError):
    """The server's refusal of completion records inside a transaction, which it aborted:
    raised on (never swallowed in the session) and mapped after the transaction ended.
    `events`: the events that refused theirs, by id, with the server's message. A
    `BulkWriteError` with the server's details for a caller's own transaction."""

    def __init__(self, details: Mapping[str, Any], events: Mapping[str, str]) -> None:
        super().__init__(dict(details))
        self.events = dict(events)

    def __reduce__(self) -> tuple[Any, Any]:
        return self.__class__, (self.details, self.events)


def _refused_records(error: BulkWriteError, event_ids: Sequence[str]) -> dict[str, str] | None:
    """The events that refused their completion record (`event_ids`: the events of the bulk
    write's requests, in order), by id, with the server's message; None when the error is
    anything else too (a write concern error, another code): raised as it is."""
    errors = error.details.get("writeErrors") or []
    if (
        error.details.get("writeConcernErrors")
        or not errors
        or any(e.get("code") not in RECORD_REFUSED_CODES for e in errors)
    ):
        return None
    return {event_ids[e["index"]]: str(e.get("errmsg", "")) for e in errors}


@names_unreachable_server
class OutboxSettles:
    """`complete`, `complete_many`, `reschedule`, `release`, `bury`, `extend_lease` and
    `relinquish` of `AsyncOutbox`."""

    # set by the outbox's constructor
    db: Any
    prefix: str
    clock: Clock
    log: Logger
    lease_ttl: float
    completion_history: bool
    events: Any
    deliveries: Any
    history: Any
    _claimer: Claimer
    _lane_store: LaneStore

    if TYPE_CHECKING:

        async def _now(self) -> datetime: ...  # the outbox's (`AsyncOutbox._now`)

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
            self._claimer.unsure.add(delivery.worker_id)
            return True
        try:
            now = await self._now()
            # (False too when its event refused the completion record: set aside instead)
            if self.completion_history and await _driver.supports_transactions(self.db):
                outcome = await self._complete_transacted([delivery], [fence], now)
                done = outcome is not None and outcome[0]
            elif refused := await self._mark_completed([delivery], now, None):
                await self._set_aside_refused([delivery], refused, now)
                done = False
            else:
                result = await self.deliveries.delete_one(fence)
                done = result.deleted_count == 1
                if done:
                    await self._write_history([delivery], now, None)
        except BaseException:
            self._forget([delivery])
            raise
        self._forget([delivery], ended=True)
        return done

    def _was_set_aside(self, delivery: Delivery) -> bool:
        """Whether a settle of `delivery` set it aside (a hand-edited field) instead of doing
        what it was asked (asked once, by the dispatcher counting it)."""
        return self._claimer.quarantine.was_set_aside(delivery.id)

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
        """`_complete_in` a transaction of its own: False when some claim had ended (nothing
        written); `_RecordsRefused` when events refused their records (nothing written)."""

        async def work(session: Any) -> None:
            await self._complete_in(session, deliveries, fences, now)

        try:
            await _driver.run_in_transaction(self.db, work)
        except LeaseLost:
            return False
        return True

    async def _complete_transacted(
        self, batch: list[Delivery], fences: list[dict[str, Any]], now: datetime
    ) -> list[bool] | None:
        """Complete `batch` in a transaction of its own: True for each; None when some claim
        had ended (the transaction wrote nothing). When events refused their completion
        records, the server aborted the transaction (nothing of it written): once it ended,
        their deliveries are set aside with writes of their own, and the others completed in
        a new transaction (and so on: in a transaction a server reports its first refusal)."""
        try:
            if await self._complete_in_own_transaction(batch, fences, now):
                return [True] * len(batch)
            return None
        except _RecordsRefused as refused:  # (the transaction has ended: aborted)
            return await self._complete_unrefused(batch, fences, refused.events, now)

    async def _mark_completed(
        self, deliveries: Sequence[Delivery], now: datetime, session: Any
    ) -> dict[str, str]:
        """Record on their events that `deliveries` completed: the completion time (the last
        one counts for purge) and their handlers listed (a replay then leaves them out). Sent
        before the deletion without a transaction: a handler is listed while its delivery
        still exists, never missing once it is gone. One that then does not complete (its
        claim had ended) is listed with its delivery still there, which a replay leaves alone
        too; its completion time only keeps the event longer.

        Returns the events that refused their record (a hand edit: ``handlers`` no array,
        `RECORD_REFUSED_CODES`), by id, with the server's message: without a session, their
        deliveries are set aside by the caller and the others complete. In a session the
        server aborted the transaction: `_RecordsRefused` is raised, for the caller to map once
        the transaction ended. Any other error is raised as it is."""
        handlers: dict[str, list[str]] = defaultdict(list)
        for delivery in deliveries:
            handlers[delivery.event.id].append(delivery.handler)
        try:
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
        except BulkWriteError as exc:
            refused = _refused_records(exc, list(handlers))
            if refused is None:
                raise
            if session is not None:
                raise _RecordsRefused(exc.details, refused) from exc
            return refused
        return {}

    async def _set_aside_refused(
        self, deliveries: Sequence[Delivery], refused: Mapping[str, str], now: datetime
    ) -> None:
        """Set aside the deliveries (of `deliveries`, still at their claims) whose events
        refused their completion record (`refused`: the server's message, by event id)."""
        mine = [d for d in deliveries if d.event.id in refused]
        events = {
            doc["_id"]: doc
            for doc in await _driver.find_list(self.events, schema.events_by_ids(list(refused)))
        }
        claims = [(doc_id, claims) for doc_id, _, _, claims in map(parse_token, mine)]
        docs = await _driver.find_list(self.deliveries, schema.delivery_claimed(claims))
        found = [
            Unusable(doc, *(event_fault(events.get(doc["event_id"], {})) or ("document", "?")),
                     schema.EVENTS, refused[doc["event_id"]])
            for doc in docs
        ]  # fmt: skip
        quarantine = self._claimer.quarantine
        quarantine.remember(await quarantine.set_aside(found, now, mine[0].worker_id))

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
            done = await self._complete_transacted(batch, fences, now)
            if done is not None:
                return done
            # Some claim ended (the transaction wrote nothing): complete the others one by one.
            return [await self.complete(d) for d in batch]
        if refused := await self._mark_completed(batch, now, None):
            return await self._complete_unrefused(batch, fences, refused, now)
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

    async def _complete_unrefused(
        self, batch: list[Delivery], fences: list[dict[str, Any]], refused: Mapping[str, str],
        now: datetime,
    ) -> list[bool]:  # fmt: skip
        """A batch some of whose events refused their completion record: those deliveries set
        aside (not completed), the others completed. Without a transaction their events took
        the record already (written again: no change); in one, nothing of it was written."""
        await self._set_aside_refused(batch, refused, now)
        kept = [i for i, d in enumerate(batch) if d.event.id not in refused]
        done = [False] * len(batch)
        if kept:
            rest = [batch[i] for i in kept], [fences[i] for i in kept]
            for i, ok in zip(kept, await self._complete_batch(*rest, now), strict=True):
                done[i] = ok
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
            done, kept = await self._apply(delivery, fence, update(now), now)
            failed = failed if kept else None  # (a set-aside logged itself)
        except BaseException:
            self._forget([delivery])
            raise
        self._forget([delivery], ended=True)
        if done and failed is not None:
            outcome, error, delay = failed
            item = f"{delivery.event.id}/{delivery.handler}"
            attempt = Attempt("outbox", self.prefix, item, delivery.attempt, delivery.worker_id)
            due = now + timedelta(seconds=delay) if delay is not None else None
            log_attempt_end(self.log, attempt, outcome, error, due)
        return done

    async def _apply(
        self, delivery: Delivery, fence: dict[str, Any], update: Mapping[str, Any], now: datetime
    ) -> tuple[bool, bool]:
        """Apply a settle's `update` to its `fence`: (whether it took effect, whether as asked).
        The server refuses it (code 14) when the delivery's ``attempts`` was edited to hold no
        number while it ran: then it is set aside instead, a dead letter."""
        try:
            result = await self.deliveries.update_one(fence, dict(update))
        except OperationFailure as exc:
            if not _driver.type_mismatch(exc):
                raise
            quarantine = self._claimer.quarantine
            aside = await quarantine.set_aside_read(fence, now, delivery.worker_id)
            quarantine.remember(aside)
            return bool(aside), False
        return bool(result.modified_count), True

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

    async def extend_lease(self, worker_id: str) -> int:
        """Renew the lease of every lane `worker_id` holds on this instance; returns how many. An
        expired lease nobody took over is renewed too; a lane taken over is not."""
        owner = check_worker_id("worker_id", worker_id)
        now = await self._now()
        return await self._lane_store.renew(owner, now + timedelta(seconds=self.lease_ttl), now)

    async def relinquish(self, worker_id: str) -> int:
        """Hand back every lane `worker_id` holds on this instance at once (graceful stop); returns
        how many. Whatever they still list as running is charged an attempt by the next holder,
        unless it was settled meanwhile."""
        owner = check_worker_id("worker_id", worker_id)
        return await self._claimer.relinquish(owner, await self._now())
