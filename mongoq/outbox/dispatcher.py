"""`OutboxDispatcher`: runs an outbox's handlers.

It claims batches of deliveries for its handlers (as many as it has free slots), runs each
handler coroutine, renews its lanes while any runs, completes finished deliveries in batches
(`complete_many`: the completions that finish while one batch is being written form the next),
reschedules failures with backoff, buries a delivery after `max_attempts` (or at once on
`PermanentError`), and on stop lets running handlers finish, then hands its lanes back. Owns no
collections.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel

from mongoq import _driver
from mongoq._validation import (
    check_async_handler,
    check_int,
    check_seconds,
    check_stop_when,
    check_timeout,
)
from mongoq._validation import check_worker_id as _check_owner
from mongoq.errors import InvalidInput, LeaseLost, PermanentError
from mongoq.outbox.models import Delivery, DispatchSummary, Event, check_handler
from mongoq.outbox.store import AsyncOutbox
from mongoq.runtime import changes, wakeups
from mongoq.runtime import lease as leases
from mongoq.runtime.events import Tally
from mongoq.runtime.handler import call_handler
from mongoq.runtime.loop import (
    default_worker_id,
    mongoq_errors_unwrapped,
    note_embedded,
    require_main_thread,
    watch_signals,
)

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


class OutboxDispatcher:
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
        owner: str | None = None,
        concurrency: int = 8,
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
        self.outbox = outbox
        self.handlers = dict(handlers)
        self.owner = _check_owner("owner", owner) if owner is not None else default_worker_id()
        self.concurrency = check_int("concurrency", concurrency, low=1, high=1000)
        self.max_attempts = check_int("max_attempts", max_attempts, low=1)
        self.backoff = backoff if backoff is not None else default_backoff
        self.handler_timeout = check_timeout("handler_timeout", handler_timeout)
        self.poll_interval = check_seconds("poll_interval", poll_interval, positive=True)
        self.summary = DispatchSummary()
        self._tally = Tally(self.summary, "outbox", outbox.prefix)
        self._active = 0
        self._scope: anyio.CancelScope | None = None
        #: one per running handler: cancelled when a renewal finds every lane lost
        self._guards: set[anyio.CancelScope] = set()
        self._ended = 0  # handlers that ended, ever
        self._stopping = False
        self._nap: anyio.CancelScope | None = None
        self._wakes = 0  # publishes of this process that woke it, ever
        self._finished: list[Delivery] = []
        self._flush_lock = anyio.Lock()

    # ------------------------------------------------------------------------------- loops

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """Graceful stop: claim nothing more, let running handlers finish, hand lanes back.
        The stop holds until `run` returns: a `run` that starts meanwhile (one called just
        before, whose loop was not running yet, or one called after a stop with none
        running) returns at once, having claimed nothing."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        if self._nap is not None:
            self._nap.cancel()

    def _woken(self) -> None:
        """A publish of this process: claim at once (or again, if a claim is under way)."""
        self._wakes += 1
        self._wake()

    async def run_once(self) -> DispatchSummary:
        """Claim one batch (up to `concurrency`), run it to the end, settle it; returns what
        this call did. Lanes stay held for the next call (see `stop`/`run`)."""
        before = DispatchSummary(**vars(self.summary))
        batch, lease_end = await self._claim(self.concurrency)
        try:
            if batch:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._renew_while_running)
                    async with anyio.create_task_group() as handlers:
                        for delivery in batch:
                            self._active += 1
                            handlers.start_soon(self._run_one, delivery, lease_end)
                    group.cancel_scope.cancel()
        finally:
            # Also when cancelled: what finished is completed, not left to run again. Bounded,
            # so a dead server cannot hold the caller longer than the lease would have lasted.
            with anyio.move_on_after(self.outbox.lease, shield=True):
                await self._flush()
        return DispatchSummary(
            **{name: value - getattr(before, name) for name, value in vars(self.summary).items()}
        )

    async def run(
        self,
        *,
        stop_when_empty: bool = False,
        stop_when_drained: bool = False,
        handle_signals: bool = False,
    ) -> DispatchSummary:
        """Dispatch until `stop()`. `stop_when_empty` returns as soon as nothing is claimable
        now and nothing runs (deliveries waiting out a backoff, or behind a busy key, wait for
        a later run); `stop_when_drained` only when no delivery of these handlers is left
        pending at all, sleeping on the outbox's clock until the next one is due meanwhile.
        With `handle_signals`, SIGTERM/SIGINT stop gracefully and a second one cancels.
        Cancelling the call releases the deliveries still running (no attempt counted) and
        hands the lanes back. Returns the totals of this dispatcher."""
        check_stop_when(stop_when_empty, stop_when_drained)
        if handle_signals:
            require_main_thread()
        note_embedded(self.outbox.db, f"outbox:{self.outbox.prefix} dispatcher {self.owner}")
        until = "empty" if stop_when_empty else "drained" if stop_when_drained else None
        try:
            with mongoq_errors_unwrapped():
                await self._run_loops(handle_signals, until)
        finally:
            with anyio.CancelScope(shield=True):
                await self._flush()
                try:
                    await self.outbox.relinquish(self.owner)
                except _driver.DRIVER_ERRORS as exc:
                    log.warning("handing lanes back failed (%s); their leases will expire", exc)
            self._stopping = False  # a later run() starts afresh; a stop() before it holds
        return self.summary

    def _cancel_running(self) -> None:
        """Hard stop: cancel the running handlers (their deliveries are released) and return
        from `run` (`mongoq_sync`'s second signal)."""
        self.stop()
        if self._scope is not None:
            self._scope.cancel()

    async def _run_loops(self, handle_signals: bool, until: str | None) -> None:
        async with anyio.create_task_group() as group:
            self._scope = group.cancel_scope
            if handle_signals:
                group.start_soon(watch_signals, self, group.cancel_scope, self.owner)
            group.start_soon(self._renew_while_running)
            group.start_soon(partial(
                changes.watch, self.outbox.deliveries, changes.DELIVERIES_READY,
                lambda _: self._woken(),
                clock=self.outbox.clock, retry=self.poll_interval, name=f"dispatcher {self.owner}",
            ))  # fmt: skip
            with wakeups.listen(self.outbox.wake_key, self._woken):
                async with anyio.create_task_group() as handlers:
                    await self._claim_loop(handlers, until)
            group.cancel_scope.cancel()

    async def _claim_loop(self, handlers: anyio.abc.TaskGroup, until: str | None) -> None:
        while not self._stopping:
            await anyio.lowlevel.checkpoint_if_cancelled()  # the claim's shield would hide it
            free = self.concurrency - self._active
            ended, wakes = self._ended, self._wakes
            batch, lease_end = await self._claim(free) if free > 0 else ([], None)
            for delivery in batch:
                self._active += 1
                handlers.start_soon(self._run_one, delivery, lease_end)
            if batch or self._ended != ended or (free > 0 and self._wakes != wakes):
                # Claimed, or a handler ended or a publish came while the claim ran (its
                # wake-up found no nap, and the claim may have read the state from before
                # it): claim again.
                continue
            idle = self._active == 0 and free > 0
            if idle and until == "empty":
                return
            if idle and until == "drained":
                due = await self._next_due()
                if due is None:
                    return
                if self._wakes != wakes:
                    continue  # a publish came meanwhile: claim again at once
                # Due already: running under another owner's lane, or behind a busy key.
                await self._sleep(due if due > self.outbox.clock.now() else None)
                continue
            await self._sleep()

    async def _next_due(self) -> datetime | None:
        try:
            return await self.outbox._next_due(list(self.handlers))
        except _driver.DRIVER_ERRORS as exc:
            log.warning("reading what is left failed (%s)", exc)
            return self.outbox.clock.now()

    async def _sleep(self, until: datetime | None = None) -> None:
        """Wait `poll_interval` (or until `until`, if sooner), or until a handler finishes or
        `stop()` is called."""
        with anyio.CancelScope() as scope:
            self._nap = scope
            try:
                if not self._stopping:
                    wake = self.outbox.clock.now() + timedelta(seconds=self.poll_interval)
                    await self.outbox.clock.sleep_until(wake if until is None else min(until, wake))
            finally:
                self._nap = None

    async def _claim(self, limit: int) -> tuple[list[Delivery], datetime | None]:
        """Up to `limit` deliveries, and when the lease of their lanes ends: the claim writes
        each lane it hands a delivery from with a lease dated no earlier than it was sent."""
        sent = self.outbox.clock.now()
        try:
            # Shielded: a claim applied on the server but cancelled before its reply is read
            # would keep its lanes, unseen, for a whole lease.
            with anyio.CancelScope(shield=True):
                batch = await self.outbox.claim(self.owner, list(self.handlers), limit=limit)
        except _driver.DRIVER_ERRORS as exc:
            log.warning("claim failed (%s); retrying after %.1fs", exc, self.poll_interval)
            return [], None
        self._tally("claimed", len(batch))
        return batch, leases.renewed_until(sent, self.outbox.lease)

    async def _renew_while_running(self) -> None:
        interval = self.outbox.lease / 3
        while True:
            await self.outbox.clock.sleep(interval)
            if self._active == 0:
                continue
            # Only what ran before the renewal: a handler started on a lane claimed while it
            # was on its way is not among the lost.
            running = list(self._guards)
            try:
                if await self.outbox.extend_lease(self.owner) == 0:
                    # Taken over: whatever runs can no longer settle; stop it. (A loss of some
                    # lanes only is found by the settles, which the lane epoch fences.)
                    log.warning("%s holds no lane any more; cancelling %d running handler(s)",
                                self.owner, len(running))  # fmt: skip
                    for guard in running:
                        guard.cancel()
            except _driver.DRIVER_ERRORS as exc:
                log.warning("renewing lanes failed (%s); retrying", exc)

    # ---------------------------------------------------------------------------- delivery

    async def _run_one(self, delivery: Delivery, lease_end: datetime | None) -> None:
        guard = anyio.CancelScope()
        self._guards.add(guard)
        try:
            now = self.outbox.clock.now()
            if lease_end is not None and leases.startable(lease_end, now, self.outbox.lease):
                await self._dispatch(delivery, guard)
            else:
                # The claim answered too late to show its lanes' lease live: another worker
                # may have taken the lane over. Handed back, fenced on the claim's generation.
                log.info("delivery %s: the claim answered too late; not started", delivery.id,
                         extra={"mongoq_delivery": delivery.id})  # fmt: skip
                await self._settle(delivery, "released", self.outbox.release(delivery))
        finally:
            self._guards.discard(guard)
            self._active -= 1
            self._ended += 1
            self._wake()

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
                timed=self._tally.handler_time,
            )  # fmt: skip
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
                self._tally("lost")
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
                self._tally("unknown")
            return
        if quiet:
            return
        field = outcome if done else otherwise
        self._tally(field)

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
            self._tally("lost", len(batch) - len(newest))  # their claims ended: counted once
            batch = list(newest.values())
            with anyio.CancelScope(shield=True):
                try:
                    done = await self.outbox.complete_many(batch)
                except _driver.DRIVER_ERRORS as exc:
                    # Applied or not: what was not deleted is freed by the next claim.
                    log.warning("completing %d deliveries failed (%s); the ones not completed "
                                "will run again", len(batch), exc)  # fmt: skip
                    self._tally("unknown", len(batch))
                    return
            self._tally("completed", sum(done))
            self._tally("lost", len(done) - sum(done))
