"""`DeliverySource`: one run of an `OutboxDispatcher` as a source of work for the shared run
loop (`mongoq.runtime.source`), as `OutboxDispatcher.run` and `run_once` make one.

It fills: its claim hands out deliveries for every free slot in one command, each with when
the lease of its lane ends. It runs each handler coroutine, completes finished deliveries in
batches (`complete_many`: the completions that finish while one batch is being written form
the next), reschedules failures with the dispatcher's backoff, buries a delivery after
`max_attempts` (or at once on `PermanentError`). Its one maintenance service, ``lanes``, renews
the lanes it holds every ``lease_ttl / 3`` while a handler runs, and cancels what runs once
every lane is lost. Owns no collections: every command goes through the outbox.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from mongoq import _driver
from mongoq._validation import check_seconds
from mongoq.clock import Clock
from mongoq.errors import HandlerAbandoned, LeaseLost, PermanentError
from mongoq.outbox.models import Delivery, Event
from mongoq.outbox.store import AsyncOutbox
from mongoq.runtime import changes, wakeups
from mongoq.runtime import lease as leases
from mongoq.runtime.events import Tally
from mongoq.runtime.handler import call_handler
from mongoq.runtime.services import Service
from mongoq.runtime.source import ChangeFeed

if TYPE_CHECKING:
    from mongoq.outbox.dispatcher import OutboxDispatcher

__all__ = ["DeliveryContext", "DeliverySource", "Handler", "default_backoff"]

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


class DeliverySource:
    """The deliveries of `dispatcher`'s handlers, claimed by `worker_id`, each handler call
    cancelled after `handler_timeout` seconds; counted into the dispatcher's summary."""

    fills = True

    def __init__(
        self, dispatcher: OutboxDispatcher, *, worker_id: str, handler_timeout: float | None
    ) -> None:
        outbox = dispatcher.outbox
        self.dispatcher = dispatcher
        self.outbox = outbox
        self.worker_id = worker_id
        self.handler_timeout = handler_timeout
        self.name = f"outbox:{outbox.prefix}"
        self.clock: Clock = outbox.clock
        self.tally: Tally = dispatcher.tally
        self.wake_key: wakeups.Key = outbox.wake_key
        self.changes = ChangeFeed(outbox.deliveries, changes.DELIVERIES_READY)
        self.services = [Service(
            "lanes", self._renew_lanes, interval=outbox.lease_ttl / 3, proves_server=False
        )]  # fmt: skip
        #: one per running handler: cancelled when a renewal finds every lane lost
        self._guards: set[anyio.CancelScope] = set()
        self._finished: list[Delivery] = []
        self._flush_lock = anyio.Lock()

    async def next_due(self) -> datetime | None:
        return await self.outbox._next_due(list(self.dispatcher.handlers))

    async def claim(self, limit: int) -> list[tuple[Delivery, datetime]]:
        """Up to `limit` deliveries, each with when the lease of its lane ends: the claim
        writes each lane it hands a delivery from with a lease dated no earlier than it was
        sent."""
        sent = self.outbox.clock.now()
        batch = await self.outbox.claim(self.worker_id, list(self.dispatcher.handlers), limit=limit)
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
        if delivery.attempt > self.dispatcher.max_attempts:
            # Its earlier attempts were lost with the workers running them: a poison message.
            await self._settle(
                delivery, "buried",
                self.outbox.bury(delivery, error=f"gave up after {self.dispatcher.max_attempts} "
                                 "attempts; the workers running the last ones were lost"),
            )  # fmt: skip
            return
        context = DeliveryContext(self.outbox, delivery)
        try:
            await call_handler(
                partial(self.dispatcher.handlers[delivery.handler], delivery.event, context),
                clock=self.outbox.clock, limit=self.handler_timeout, guard=guard,
                timed=self.tally.handler_time, name=f"delivery {delivery.id}",
            )  # fmt: skip
        except HandlerAbandoned as exc:
            # It runs on, unsupervised. Its key's other deliveries must not wait behind it under
            # a lane this worker keeps renewing: it is retried after its backoff (or buried on
            # its last attempt), as after any failure, and counted lost.
            self.tally("lost")
            if delivery.attempt >= self.dispatcher.max_attempts:
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
            if delivery.attempt >= self.dispatcher.max_attempts:
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
            await self.flush()

    def _delay(self, delivery: Delivery) -> float:
        """``backoff(attempt)``; a backoff that fails or gives no usable number of seconds is
        logged and replaced by `default_backoff`, so a retry is never lost to it."""
        try:
            return check_seconds("backoff", self.dispatcher.backoff(delivery.attempt))
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

    async def flush(self) -> None:
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
