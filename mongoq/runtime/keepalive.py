"""`KeepAlive`: renews a lease every interval of clock time while its holder works.

It never lets a driver error reach the block, and stops when the renewal says the lease is gone.
Owns no collections.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import anyio

from mongoq import _driver
from mongoq.clock import Clock

__all__ = ["KeepAlive"]

# The run loops' logger: a renewal is part of running work.
log = logging.getLogger("mongoq.worker")


@dataclass(eq=False, kw_only=True)
class KeepAlive:
    """Renews a lease every `interval` seconds of `clock` time while an ``async with`` block runs.

    `renew()` returns True (still held), False (lost: `lost` turns True and renewing stops) or
    None (nothing left to renew, e.g. the lease was settled: stop quietly). The first renewal is
    due at `first_at`, counted from the lease the claim granted rather than from when this task
    first runs, so tests on a manual clock and slow event loops see the same schedule. A driver
    error is logged and retried after a third of the interval, well before the lease runs out.
    """

    clock: Clock
    interval: float
    renew: Callable[[], Awaitable[bool | None]]
    first_at: datetime
    #: names the lease in the log lines
    name: str
    lost: bool = field(default=False, init=False)
    _guards: set[anyio.CancelScope] = field(default_factory=set, init=False)
    renewals: int = field(default=0, init=False)
    _next: datetime = field(init=False)
    _group: Any = field(default=None, init=False)
    _sleep: anyio.CancelScope | None = field(default=None, init=False)
    _told: int = field(default=0, init=False)  # `renew_now` calls so far

    def __post_init__(self) -> None:
        self._next = self.first_at

    def guard(self) -> anyio.CancelScope:
        """A scope this keep-alive cancels when it finds the lease lost (at once if it already
        has): what stops a handler whose work can no longer count."""
        scope = anyio.CancelScope()
        self._guards.add(scope)
        if self.lost:
            scope.cancel()
        return scope

    async def __aenter__(self) -> KeepAlive:
        self._group = anyio.create_task_group()
        await self._group.__aenter__()  # no checkpoint: a pending cancellation hits the block
        self._group.start_soon(self._run)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._group.cancel_scope.cancel()
        # Raises the cancellation here when the enclosing block is being cancelled.
        await self._group.__aexit__(None, None, None)

    def renew_now(self) -> None:
        """Renew at once, not at the next interval: the lease may have ended elsewhere (the
        item was cancelled or removed), and a renewal is how the holder finds out. Told while
        a renewal is in flight (sent before the news), it renews once more after it."""
        self._told += 1
        self._next = self.clock.now()
        if self._sleep is not None:
            self._sleep.cancel()

    async def _run(self) -> None:
        while True:
            with anyio.CancelScope() as self._sleep:
                await self.clock.sleep_until(self._next)
            self._sleep = None
            told = self._told
            try:
                held = await self.renew()
            except _driver.DRIVER_ERRORS as exc:
                log.warning("%s: renewal failed (%s); retrying", self.name, exc)
                self._next = self.clock.now() + timedelta(seconds=self.interval / 3)
                continue
            if held is None:
                return
            if not held:
                self.lost = True
                for guard in self._guards:
                    guard.cancel()
                log.warning("%s: the lease is no longer held; renewal stopped", self.name)
                return
            self.renewals += 1
            self._next = self.clock.now()
            if self._told == told:  # else told during the renewal: once more, at once
                self._next += timedelta(seconds=self.interval)
