"""Time, from one injectable source per primitive instance.

Leases compare instants written by different workers, so every instant mongoq stores or filters
on comes from a `Clock`. The seed computed them on the server with ``$$NOW``; the embedded
backend silently ignores ``$$NOW``, so mongoq computes them client-side and keeps the seed's
protection against skew between workers with `ServerClock`, which follows the server's clock.

Instants are timezone-aware UTC `datetime`s truncated to milliseconds, the precision of a BSON
date, so what a worker computes is exactly what the server stores. Owns no collections.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

import anyio

from mongoq import _driver

__all__ = ["Clock", "ServerClock", "SystemClock", "stored_instant", "to_millis"]

log = logging.getLogger("mongoq.clock")


def to_millis(instant: datetime) -> datetime:
    """Truncate to BSON precision (milliseconds) and make the instant UTC-aware."""
    instant = instant.replace(tzinfo=UTC) if instant.tzinfo is None else instant.astimezone(UTC)
    return instant.replace(microsecond=instant.microsecond // 1000 * 1000)


def stored_instant(value: Any) -> datetime | None:
    """An instant read back from a document (naive or aware, by driver) as UTC-aware; None for
    anything that is not a datetime."""
    return to_millis(value) if isinstance(value, datetime) else None


@runtime_checkable
class Clock(Protocol):
    """Where a primitive gets "now" from and how it waits."""

    def now(self) -> datetime:
        """The current instant: UTC-aware, millisecond precision."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time."""
        ...

    async def sleep_until(self, deadline: datetime) -> None:
        """Wait until this clock reads `deadline` (at once if it has passed)."""
        ...

    async def refresh(self) -> None:
        """Re-synchronise if the clock follows another one; cheap when nothing is due."""
        ...


class SystemClock:
    """This machine's clock."""

    def now(self) -> datetime:
        return to_millis(datetime.now(UTC))

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(max(0.0, seconds))

    async def sleep_until(self, deadline: datetime) -> None:
        await self.sleep((deadline - self.now()).total_seconds())

    async def refresh(self) -> None:
        return None


class ServerClock(SystemClock):
    """The server's clock, followed through a measured offset.

    The offset is measured from ``hello``'s ``localTime`` (midpoint of the round trip) on the first
    `refresh()` and again every `resync_interval` seconds. Where the server cannot tell (the
    embedded backend has no ``hello``), it falls back to the system clock once and for all; after a
    network error it keeps the last offset and tries again at the next refresh.
    """

    def __init__(self, db: Any, *, resync_interval: float = 300.0) -> None:
        self._db = db
        self._resync_interval = resync_interval
        self._offset = timedelta(0)
        self._measured_at: float | None = None  # monotonic seconds
        self._unavailable = False
        self._lock = anyio.Lock()

    @property
    def offset(self) -> timedelta:
        """Server time minus system time, as last measured."""
        return self._offset

    def now(self) -> datetime:
        return to_millis(datetime.now(UTC) + self._offset)

    async def refresh(self) -> None:
        if self._unavailable or not self._is_stale():
            return
        async with self._lock:
            if self._unavailable or not self._is_stale():
                return
            await self._measure()

    def _is_stale(self) -> bool:
        return (
            self._measured_at is None
            or time.monotonic() - self._measured_at >= self._resync_interval
        )

    async def _measure(self) -> None:
        before = datetime.now(UTC)
        try:
            server_time = await _driver.server_local_time(self._db)
        except _driver.TRANSIENT_ERRORS as exc:
            log.warning("could not measure the server clock (%s); keeping the last offset", exc)
            self._measured_at = time.monotonic()
            return
        after = datetime.now(UTC)
        if server_time is None:
            log.info("the backend does not report its clock; using the system clock")
            self._unavailable = True
            return
        midpoint = before + (after - before) / 2
        self._offset = to_millis(server_time) - midpoint
        self._measured_at = time.monotonic()
        log.debug("server clock offset %.3f s", self._offset.total_seconds())
