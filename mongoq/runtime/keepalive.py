"""`KeepAlive`: renews a lease every interval of clock time while its holder works.

It never lets a driver error reach the block, and stops when the renewal says the lease is gone.
Owns no collections.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import anyio

from mongoq import _driver
from mongoq.clock import Clock

__all__ = ["KeepAlive"]

# The run loops' logger: a renewal is part of running work.
log = logging.getLogger("mongoq.worker")


class KeepAlive:
    """Renews a lease every `interval` seconds of `clock` time while an ``async with`` block runs.

    `renew()` returns True (still held), False (lost: `lost` turns True and renewing stops) or
    None (nothing left to renew, e.g. the lease was settled: stop quietly). The first renewal is
    due at `first_at`, counted from the lease the claim granted rather than from when this task
    first runs, so tests on a manual clock and slow event loops see the same schedule. A driver
    error is logged and retried after a third of the interval, well before the lease runs out.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        interval: float,
        renew: Callable[[], Awaitable[bool | None]],
        first_at: datetime,
        name: str,
    ) -> None:
        self._clock = clock
        self._interval = interval
        self._renew = renew
        self._next = first_at
        self._name = name
        self._group: Any = None
        self.lost = False
        self.renewals = 0

    async def __aenter__(self) -> KeepAlive:
        self._group = anyio.create_task_group()
        await self._group.__aenter__()  # no checkpoint: a pending cancellation hits the block
        self._group.start_soon(self._run)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._group.cancel_scope.cancel()
        # Raises the cancellation here when the enclosing block is being cancelled.
        await self._group.__aexit__(None, None, None)

    async def _run(self) -> None:
        while True:
            await self._clock.sleep_until(self._next)
            try:
                held = await self._renew()
            except _driver.DRIVER_ERRORS as exc:
                log.warning("%s: renewal failed (%s); retrying", self._name, exc)
                self._next = self._clock.now() + timedelta(seconds=self._interval / 3)
                continue
            if held is None:
                return
            if not held:
                self.lost = True
                log.warning("%s: the lease is no longer held; renewal stopped", self._name)
                return
            self.renewals += 1
            self._next = self._clock.now() + timedelta(seconds=self._interval)
