"""`OutboxDispatcher`: runs an outbox's handlers.

It is a source of work for the shared run loop (`mongoq.runtime.source`): one that fills, its
claim handing out deliveries for every free slot in one command; the loop brings wake-ups,
graceful and hard stops, signals. Its one maintenance service, ``lanes``, renews the lanes it
holds every ``lease_ttl / 3`` while a handler runs. It claims deliveries of
its handlers, runs each handler coroutine, renews its lanes while any runs, completes finished
deliveries in batches (`complete_many`: the completions that finish while one batch is being
written form the next), reschedules failures with backoff, buries a delivery after
`max_attempts` (or at once on `PermanentError`), and on stop lets running handlers finish,
then hands its lanes back. Owns no collections.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import (
    check_async_handler,
    check_concurrency,
    check_int,
    check_interval,
    check_seconds,
    check_stop_when,
    check_timeout,
    check_worker_id,
)
from mongoq.errors import HandlerAbandoned, InvalidInput, LeaseLost, PermanentError
from mongoq.outbox.models import Delivery, Event, OutboxRunSummary, check_handler
from mongoq.outbox.store import AsyncOutbox
from mongoq.runtime import changes
from mongoq.runtime import lease as leases
from mongoq.runtime.events import Tally
from mongoq.runtime.handler import call_handler
from mongoq.runtime.loop import WorkerHost, WorkerLoop, default_worker_id
from mongoq.runtime.services import Service
from mongoq.runtime.source import ChangeFeed

__all__ = ["DeliveryContext", "Handler", "OutboxDispatcher", "default_backoff"]

log = logging.getLogger("mongoq.outbox.dispatcher")


def default_backoff(attempt: int) -> float:
    """Seconds before retrying after failed attempt number `attempt`: 1, 2, 4, ... capped at
    ten minutes, times a jitter in [1.0, 1.25) so that failures do not retry in lockstep."""
    return min(2.0 ** min(max(attempt - 1, 0), 30), 600.0) * random.uniform(1.0, 1.25)


class DeliveryContext:
    """What a handler gets besides the event: the delivery, and `complete(session)` to finish
    the delivery inside the handler's own transaction (effectively-once projections)."""

    def __init__(self, outbox: AsyncOutbox, delivery: Delivery) -> None:
        self.outbox = outbox
        self.delivery = delivery
        self.completed_in_transaction = False
        self.lease_lost = False

    @property
    def attempt(self) -> int:
        return self.delivery.attempt

    async def complete(self, session: Any) -> None:
        """Complete the delivery in `session`'s started transaction, so that it commits with
        the handler's writes or not at all. Raises `LeaseLost` if the claim has ended (let it
        abort the transaction: another worker runs the delivery)."""
        try:
            await self.outbox.complete(self.delivery, session=session)
        except LeaseLost:
            self.lease_lost = True
            raise
        self.completed_in_transaction = True


Handler = Callable[[Event, DeliveryContext], Awaitable[Any]]


@names_unreachable_server
class OutboxDispatcher(WorkerHost):
    """Runs `handlers` (handler name -> ``async def handler(event, context)``) for `outbox`.

    A handler that returns completes its delivery; one that raises `PermanentError` buries it
    as a dead letter; any other exception reschedules it after ``backoff(attempt)`` seconds
    (`default_backoff` when None), until the attempt numbered `max_attempts` fails, which
    buries it. Handlers must be idempotent: delivery is at least once. A handler running past
    `handler_timeout` seconds (of the outbox's clock) is cancelled, and its attempt fails with
    ``HandlerTimeout: timed out after N s``.

    Through `mongoq_sync`, handlers are plain functions run in worker threads; their context
    gives `delivery` and `attempt` (completing inside a transaction needs the async API).
    """

    def __init__(
        self,
        outbox: AsyncOutbox,
        handlers: Mapping[str, Callable[[Event, DeliveryContext], Awaitable[Any]]],
        *,
        worker_id: str | None = None,
        concurrency: int = 1,
        max_attempts: int = 10,
        backoff: Callable[[int], float] | None = None,
        poll_interval: float = 1.0,
        handler_timeout: float | None = None,
    ) -> None:
        if not isinstance(outbox, AsyncOutbox):
            raise InvalidInput("outbox", "must be an AsyncOutbox")
        if not isinstance(handlers, Mapping) or not handlers:
            raise InvalidInput("handlers", "must map at least one handler name to a coroutine")
        for name, handler in handlers.items():
            check_handler("handlers", name)
            check_async_handler(f"handlers[{name!r}]", handler)
        if backoff is not None and not callable(backoff):
            raise InvalidInput("backoff", "must be None (the default backoff) or callable")
        super().__init__()
        self.outbox = outbox
        self.db = outbox.db
        self.handlers = dict(handlers)
        self.worker_id = (
            check_worker_id("worker_id", worker_id)
            if worker_id is not None
            else default_worker_id()
        )
        self.concurrency = check_concurrency(concurrency)
        self.max_attempts = check_int("max_attempts", max_attempts, low=1)
        self.backoff = backoff if backoff is not None else default_backoff
        self.handler_timeout = check_timeout("handler_timeout", handler_timeout)
        self.poll_interval = check_interval("poll_interval", poll_interval)
        self.summary = OutboxRunSummary()
        self.tally = Tally(self.summary, "outbox", outbox.prefix)
        self.name = f"outbox:{outbox.prefix}"
        self.clock = outbox.clock
        self.wake_key = outbox.wake_key
        self.changes = ChangeFeed(outbox.deliveries, changes.DELIVERIES_READY)
        self.services = [Service(
            "lanes", self._renew_lanes, interval=outbox.lease_ttl / 3, proves_server=False
        )]  # fmt: skip
        #: one per running handler: cancelled when a renewal finds every lane lost
        self._guards: set[anyio.CancelScope] = set()
        self._finished: list[Delivery] = []
        self._flush_lock = anyio.Lock()

    # ------------------------------------------------------------------------------- loops

    @property
    def stopping(self) -> bool:
        """`stop()` was called, and no `run` returned since."""
        return self._stop_pending

    async def run_once(self) -> OutboxRunSummary:
        """Claim one batch (up to `concurrency`), run it to the end, settle it; returns what
        this call did. Lanes stay held for the next call (see `stop`/`run`); a claim that
        fails claims nothing."""
        before = OutboxRunSummary(**vars(self.summary))
        loop = WorkerLoop(
            [self], concurrency=self.concurrency, poll_interval=self.poll_interval, once=True,
            name=f"{self.name} dispatcher {self.worker_id}",
        )  # fmt: skip
        try:
            await loop.run()
        finally:
            # Also when cancelled: what finished is completed, not left to run again. Bounded,
            # so a dead server cannot hold the caller longer than the lease would have lasted.
            with anyio.move_on_after(self.outbox.lease_ttl, shield=True):
                await self._flush()
        return OutboxRunSummary(
            **{name: value - getattr(before, name) for name, value in vars(self.summary).items()}
        )

    async def run(
        self,
        *,
        stop_when_empty: bool = False,
        stop_when_drained: bool = False,
        handle_signals: bool = False,
        give_up_after: float | None = None,
    ) -> OutboxRunSummary:
        """Dispatch until `stop()`. `stop_when_empty` returns as soon as nothing is claimable
        now and nothing runs (deliveries waiting out a backoff, or behind a busy key, wait for
        a later run); `stop_when_drained` only when no delivery of these handlers is left
        pending at all, sleeping on the outbox's clock until the next one is due meanwhile.
        A claim that fails (a driver error: an election, a lost connection) never counts as an
        empty outbox. One that cannot reach the server is retried with a growing backoff (the
        poll interval, doubled each time, at most 30 s); one warning says the server is lost
        and one that it is back. With `give_up_after` (seconds) the call raises
        `ServerUnavailable` once the server has been gone that long; by default it waits for
        the server forever.
        With `handle_signals`, SIGTERM/SIGINT stop gracefully and a second one cancels.
        Cancelling the call releases the deliveries still running (no attempt counted) and
        hands the lanes back. Returns the totals of this dispatcher."""
        check_stop_when(stop_when_empty, stop_when_drained)
        give_up = check_timeout("give_up_after", give_up_after)
        loop = WorkerLoop(
            [self], concurrency=self.concurrency, poll_interval=self.poll_interval,
            stop_when_empty=stop_when_empty, stop_when_drained=stop_when_drained,
            give_up_after=give_up, name=f"{self.name} dispatcher {self.worker_id}",
        )  # fmt: skip
        try:
            await self._run_loop(loop, handle_signals=handle_signals, lease=self.outbox.lease_ttl)
        finally:
            with anyio.CancelScope(shield=True):
                await self._flush()
                try:
                    await self.outbox.relinquish(self.worker_id)
                except _driver.DRIVER_ERRORS as exc:
                    log.warning("handing lanes back failed (%s); their leases will expire", exc)
            if not self._loops:  # a stop() while this run handed its lanes back was for it
                self._stop_pending = False
        return self.summary

    # -------------------------------------------------------------- as a source of work

    fills = True

    async def next_due(self) -> datetime | None:
        return await self.outbox._next_due(list(self.handlers))

    async def claim(self, limit: int) -> list[tuple[Delivery, datetime]]:
        """Up to `limit` deliveries, each with when the lease of its lane ends: the claim
        writes each lane it hands a delivery from with a lease dated no earlier than it was
        sent."""
        sent = self.outbox.clock.now()
        batch = await self.outbox.claim(self.worker_id, list(self.handlers), limit=limit)
        self.tally("claimed", len(batch))
        lease_end = leases.renewed_until(sent, self.outbox.lease_ttl)
        return [(delivery, lease_end) for delivery in batch]

    async def _renew_lanes(self, interval: float) -> None:
        """One round of the ``lanes`` service: the lanes renewed while a handler runs."""
        if not self._guards:
            return
        # Only what ran before the renewal: a handler started on a lane claimed while it was
        # on its way is not among the lost.
        running = list(self._guards)
        if await self.outbox.extend_lease(self.worker_id) == 0:
            # Taken over: whatever runs can no longer settle; stop it. (A loss of some lanes
            # only is found by the settles, which the lane epoch fences.)
            log.warning("%s holds no lane any more; cancelling %d running handler(s)",
                        self.worker_id, len(running))  # fmt: skip
            for guard in running:
                guard.cancel()

    # ---------------------------------------------------------------------------- delivery

    async def process(self, claimed: tuple[Delivery, datetime]) -> None:
        delivery, lease_end = claimed
        guard = anyio.CancelScope()
        self._guards.add(guard)
        try:
            now = self.outbox.clock.now()
            if leases.startable(lease_end, now, self.outbox.lease_ttl):
                await self._dispatch(delivery, guard)
            else:
                # The claim answered too late to show its lanes' lease live: another worker
                # may have taken the lane over. Handed back, fenced on the claim's generation.
                log.info("delivery %s: the claim answered too late; not started", delivery.id,
                         extra={"mongoq_delivery": delivery.id})  # fmt: skip
                await self._settle(delivery, "released", self.outbox.release(delivery))
        finally:
            self._guards.discard(guard)

    async def _dispatch(self, delivery: Delivery, guard: anyio.CancelScope) -> None:
        if delivery.attempt > self.max_attempts:
            # Its earlier attempts were lost with the workers running them: a poison message.
            await self._settle(
                delivery, "buried",
                self.outbox.bury(delivery, error=f"gave up after {self.max_attempts} attempts; "
                                 "the workers running the last ones were lost"),
            )  # fmt: skip
            return
        context = DeliveryContext(self.outbox, delivery)
        try:
            await call_handler(
                partial(self.handlers[delivery.handler], delivery.event, context),
                clock=self.outbox.clock, limit=self.handler_timeout, guard=guard,
                timed=self.tally.handler_time, name=f"delivery {delivery.id}",
            )  # fmt: skip
        except HandlerAbandoned as exc:
            # It runs on, unsupervised. Its key's other deliveries must not wait behind it under
            # a lane this worker keeps renewing: it is retried after its backoff (or buried on
            # its last attempt), as after any failure, and counted lost.
            self.tally("lost")
            if delivery.attempt >= self.max_attempts:
                call = self.outbox.bury(delivery, error=exc)
            else:
                call = self.outbox.reschedule(delivery, delay=self._delay(delivery), error=exc)
            await self._settle(delivery, "lost", call, True)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._settle(delivery, "released", self.outbox.release(delivery))
            raise
        except PermanentError as exc:
            await self._settle(delivery, "buried", self.outbox.bury(delivery, error=exc))
        except Exception as exc:
            if isinstance(exc, LeaseLost) and (context.lease_lost or guard.cancel_called):
                # `context.complete` found the claim ended, or the lanes were lost and the
                # handler cancelled: another worker runs the delivery. The release changes
                # nothing then; it only stops this instance counting it as running. (A
                # LeaseLost of the handler's own is a failure like any other.)
                self.tally("lost")
                await self._settle(delivery, "released", self.outbox.release(delivery), True)
                return
            if delivery.attempt >= self.max_attempts:
                await self._settle(delivery, "buried", self.outbox.bury(delivery, error=exc))
            else:
                call = self.outbox.reschedule(delivery, delay=self._delay(delivery), error=exc)
                await self._settle(delivery, "retried", call)
        else:
            if context.completed_in_transaction:
                # Normally gone with the handler's commit already: the retry below then changes
                # nothing (fenced) and it counts as completed. If the handler returned although
                # its transaction did not commit, the delivery runs again, with its writes.
                retry = self.outbox.reschedule(
                    delivery,
                    delay=self._delay(delivery),
                    error="the handler returned, but its transaction did not commit the completion",
                )
                await self._settle(delivery, "retried", retry, otherwise="completed")
                return
            self._finished.append(delivery)
            await self._flush()

    def _delay(self, delivery: Delivery) -> float:
        """``backoff(attempt)``; a backoff that fails or gives no usable number of seconds is
        logged and replaced by `default_backoff`, so a retry is never lost to it."""
        try:
            return check_seconds("backoff", self.backoff(delivery.attempt))
        except Exception:
            log.exception("backoff(%d) failed; using the default backoff", delivery.attempt)
            return default_backoff(delivery.attempt)

    async def _settle(
        self,
        delivery: Delivery,
        outcome: str,
        call: Awaitable[bool],
        quiet: bool = False,
        otherwise: str = "lost",
    ) -> None:
        """Await the settle `call` and count `outcome` when it took effect, `otherwise` when
        it did not (nothing with `quiet`)."""
        try:
            done = await call
        except _driver.DRIVER_ERRORS as exc:
            # Applied or not, nobody can tell; if not, the owner's next claim frees it (see
            # `Claimer._reconcile`) and it runs again.
            log.warning("settling delivery %s failed (%s); it will run again unless the settle "
                        "applied", delivery.id, exc)  # fmt: skip
            if not quiet:
                self.tally("unknown")
            return
        if quiet:
            return
        if done and self.outbox._was_set_aside(delivery):
            outcome = "buried"  # a hand-edited field: a dead letter instead (logged as such)
        field = outcome if done else otherwise
        self.tally(field)

    async def _flush(self) -> None:
        """Complete what finished, in one batch; completions that finish meanwhile wait for
        the lock and form the next batch."""
        async with self._flush_lock:
            batch, self._finished = self._finished, []
            if not batch:
                return
            # One delivery at two claim generations (it was lost and claimed again while a
            # flush waited): only the newest claim can still complete it.
            newest: dict[str, Delivery] = {}
            for delivery in batch:
                kept = newest.get(delivery.id)
                if kept is None or delivery.generation > kept.generation:
                    newest[delivery.id] = delivery
            self.tally("lost", len(batch) - len(newest))  # their claims ended: counted once
            batch = list(newest.values())
            with anyio.CancelScope(shield=True):
                try:
                    done = await self.outbox.complete_many(batch)
                except _driver.DRIVER_ERRORS as exc:
                    # Applied or not: what was not deleted is freed by the next claim.
                    log.warning("completing %d deliveries failed (%s); the ones not completed "
                                "will run again", len(batch), exc)  # fmt: skip
                    self.tally("unknown", len(batch))
                    return
            self.tally("completed", sum(done))
            # (an event refusing its record: the delivery set aside, a dead letter)
            aside = sum(
                not ok and self.outbox._was_set_aside(d) for d, ok in zip(batch, done, strict=True)
            )
            if aside:
                self.tally("buried", aside)
            self.tally("lost", len(done) - sum(done) - aside)
