"""`OutboxDispatcher`: runs an outbox's handlers.

Each `run` (and each `run_once`) is one shared run loop (`mongoq.runtime.loop.WorkerLoop`)
over one `DeliverySource` (`mongoq.outbox.source`): the loop brings the slots, wake-ups,
graceful and hard stops, signals; the source claims deliveries of the dispatcher's handlers,
runs them, settles them and renews its lanes. The dispatcher keeps what every run shares: the
handlers, the attempt limit and backoff, the totals. On stop, `run` lets running handlers
finish, then hands its lanes back. Owns no collections.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import (
    check_async_handler,
    check_concurrency,
    check_int,
    check_timeout,
)
from mongoq.errors import InvalidInput
from mongoq.outbox.models import Event, OutboxRunSummary, check_handler
from mongoq.outbox.source import DeliveryContext, DeliverySource, Handler, default_backoff
from mongoq.outbox.store import AsyncOutbox
from mongoq.runtime.events import Tally
from mongoq.runtime.loop import RunOptions, WorkerHost, WorkerLoop

__all__ = ["DeliveryContext", "Handler", "OutboxDispatcher", "default_backoff"]

log = logging.getLogger("mongoq.outbox.dispatcher")


@names_unreachable_server
class OutboxDispatcher(WorkerHost):
    """Runs `handlers` (handler name -> ``async def handler(event, context)``) for `outbox`.

    A handler that returns completes its delivery; one that raises `PermanentError` buries it
    as a dead letter; any other exception reschedules it after ``backoff(attempt)`` seconds
    (`default_backoff` when None), until the attempt numbered `max_attempts` fails, which
    buries it. Handlers must be idempotent: delivery is at least once. How a run goes (its
    worker id, concurrency, poll interval, handler time limit) is given to `run` or
    `run_once`, as to every primitive's `run`.

    Through `mongoq_sync`, handlers are plain functions run in worker threads; their context
    gives `delivery` and `attempt` (completing inside a transaction needs the async API).
    """

    def __init__(
        self,
        outbox: AsyncOutbox,
        handlers: Mapping[str, Callable[[Event, DeliveryContext], Awaitable[Any]]],
        *,
        max_attempts: int = 10,
        backoff: Callable[[int], float] | None = None,
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
        self.max_attempts = check_int("max_attempts", max_attempts, low=1)
        self.backoff = backoff if backoff is not None else default_backoff
        self.summary = OutboxRunSummary()
        self.tally = Tally(self.summary, "outbox", outbox.prefix)

    @property
    def worker_id(self) -> str:
        """The worker id a run given none claims as (``hostname:pid:uuid8``): the owner of the
        lanes a `run_once` given none keeps between calls."""
        return self._worker(None)

    @property
    def stopping(self) -> bool:
        """`stop()` was called, and no `run` returned since."""
        return self._stop_pending

    def _source(self, worker_id: str | None, handler_timeout: float | None) -> DeliverySource:
        return DeliverySource(
            self, worker_id=self._worker(worker_id),
            handler_timeout=check_timeout("handler_timeout", handler_timeout),
        )  # fmt: skip

    async def run_once(
        self,
        *,
        worker_id: str | None = None,
        concurrency: int = 1,
        handler_timeout: float | None = None,
    ) -> OutboxRunSummary:
        """Claim one batch (up to `concurrency`), run it to the end, settle it; returns what
        this call did. Lanes stay held for the next call with the same `worker_id` (see
        `stop`/`run`); a claim that fails claims nothing. The options are `run`'s."""
        slots = check_concurrency(concurrency)
        source = self._source(worker_id, handler_timeout)
        before = OutboxRunSummary(**vars(self.summary))
        loop = WorkerLoop(
            [source], concurrency=slots, once=True,
            name=f"{source.name} dispatcher {source.worker_id}",
        )  # fmt: skip
        try:
            await loop.run()
        finally:
            # Also when cancelled: what finished is completed, not left to run again. Bounded,
            # so a dead server cannot hold the caller longer than the lease would have lasted.
            with anyio.move_on_after(self.outbox.lease_ttl, shield=True):
                await source.flush()
        return OutboxRunSummary(
            **{name: value - getattr(before, name) for name, value in vars(self.summary).items()}
        )

    async def run(
        self,
        *,
        worker_id: str | None = None,
        concurrency: int = 1,
        poll_interval: float = 1.0,
        handler_timeout: float | None = None,
        stop_when_empty: bool = False,
        stop_when_drained: bool = False,
        handle_signals: bool = False,
        give_up_after: float | None = None,
    ) -> OutboxRunSummary:
        """Dispatch until `stop()`, as `worker_id` (default: `worker_id`, this dispatcher's),
        with up to `concurrency` handlers at once, claiming again every `poll_interval` seconds
        when idle; a handler running past `handler_timeout` seconds (of the outbox's clock) is
        cancelled, and its attempt fails with ``HandlerTimeout: timed out after N s``.
        `stop_when_empty` returns as soon as nothing is claimable
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
        options = RunOptions.checked(
            concurrency=concurrency, poll_interval=poll_interval, stop_when_empty=stop_when_empty,
            stop_when_drained=stop_when_drained, give_up_after=give_up_after,
        )  # fmt: skip
        source = self._source(worker_id, handler_timeout)
        loop = options.loop([source], name=f"{source.name} dispatcher {source.worker_id}")
        try:
            await self._run_loop(loop, handle_signals=handle_signals, lease=self.outbox.lease_ttl)
        finally:
            with anyio.CancelScope(shield=True):
                await source.flush()
                try:
                    await self.outbox.relinquish(source.worker_id)
                except _driver.DRIVER_ERRORS as exc:
                    log.warning("handing lanes back failed (%s); their leases will expire", exc)
            if not self._loops:  # a stop() while this run handed its lanes back was for it
                self._stop_pending = False
        return self.summary
