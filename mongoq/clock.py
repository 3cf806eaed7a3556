"""Time, from one injectable source per primitive instance.

Leases compare instants written by different workers, so every instant mongoq stores or filters
on comes from a `Clock`, computed client-side (the embedded backend silently ignores ``$$NOW``
in a pipeline update); `ServerClock` follows the server's clock, so that workers whose own
clocks drift apart still agree on when a lease ends.

Instants are timezone-aware UTC `datetime`s truncated to milliseconds, the precision of a BSON
date, so what a worker computes is exactly what the server stores.

`ManualClock` is time that moves only when told to: tests use it (``mongoq.testing``
re-exports it), and so does the demo, which jumps it to the next due instant. Owns no
collections.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.lowlevel
from pymongo.errors import ServerSelectionTimeoutError

from mongoq import _driver
from mongoq._unreachable import server_unavailable
from mongoq.errors import ServerUnavailable

__all__ = [
    "Clock",
    "ManualClock",
    "ServerClock",
    "SystemClock",
    "stored_instant",
    "to_millis",
]

log = logging.getLogger("mongoq.clock")


def to_millis(instant: datetime) -> datetime:
    """Truncate to BSON precision (milliseconds) and make the instant UTC-aware."""
    # On every claim and settle, hence the short cuts: one `replace` for a naive instant (as
    # drivers read dates back), none for one that is UTC and whole milliseconds already.
    tzinfo = instant.tzinfo
    if tzinfo is None:
        return instant.replace(tzinfo=UTC, microsecond=instant.microsecond // 1000 * 1000)
    if tzinfo is not UTC:
        instant = instant.astimezone(UTC)
    micros = instant.microsecond
    return instant if micros % 1000 == 0 else instant.replace(microsecond=micros // 1000 * 1000)


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
    network error it keeps the last offset and tries again at the next refresh. With no server
    to select at all, `refresh()` raises `ServerUnavailable`: the command it precedes would
    only wait out the same timeout again.
    """

    def __init__(self, db: Any, *, resync_interval: float = 300.0) -> None:
        self._db = db
        self._resync_interval = resync_interval
        self._offset = timedelta(0)
        self._measured_at: float | None = None  # monotonic seconds
        self._unavailable = False
        self._lock = anyio.Lock()
        self._tries = 0  # measurements begun
        self._failure: ServerUnavailable | None = None  # the last one's, when no server answered

    @property
    def offset(self) -> timedelta:
        """Server time minus system time, as last measured."""
        return self._offset

    def now(self) -> datetime:
        return to_millis(datetime.now(UTC) + self._offset)

    async def refresh(self) -> None:
        if self._unavailable or not self._is_stale():
            return
        tries = self._tries
        async with self._lock:
            if self._unavailable or not self._is_stale():
                return
            if self._tries != tries and self._failure is not None:
                # Another caller's measurement found no server while this one waited for the
                # lock: said to every waiter, rather than each waiting out the timeout in turn.
                raise self._failure
            await self._measure()

    def _is_stale(self) -> bool:
        return (
            self._measured_at is None
            or time.monotonic() - self._measured_at >= self._resync_interval
        )

    async def _measure(self) -> None:
        before = datetime.now(UTC)
        self._tries += 1
        self._failure = None
        try:
            server_time = await _driver.server_local_time(self._db)
        except ServerSelectionTimeoutError as exc:
            # No server at all: the caller's own command would wait out the same timeout a
            # second time. Say so now; the next refresh measures again.
            self._failure = server_unavailable(exc)
            raise self._failure from None
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


class ManualClock:
    """A `Clock` that moves only through `advance()` / `set()`.

    It starts at the current wall-clock time (milliseconds), never at 0: orderings such as
    "never-claimed sorts before just-acked" depend on realistic instants.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = to_millis(start if start is not None else datetime.now(UTC))
        self._sleepers: list[tuple[datetime, int, anyio.Event, asyncio.AbstractEventLoop]] = []
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def now(self) -> datetime:
        return self._now

    async def refresh(self) -> None:
        return None

    async def sleep(self, seconds: float) -> None:
        await self._sleep(lambda now: now + timedelta(seconds=seconds))

    async def sleep_until(self, deadline: datetime) -> None:
        """Wait until the clock reads `deadline`: absolute, so an advance from another thread
        between reading the clock and calling this cannot postpone the wake-up."""
        deadline = to_millis(deadline)
        await self._sleep(lambda now: deadline)

    async def _sleep(self, deadline_from: Callable[[datetime], datetime]) -> None:
        wake = anyio.Event()
        loop = asyncio.get_running_loop()
        with self._lock:
            deadline = deadline_from(self._now)
            if deadline <= self._now:
                entry = None
            else:
                entry = (deadline, next(self._counter), wake, loop)
                heapq.heappush(self._sleepers, entry)
        if entry is None:
            await anyio.lowlevel.checkpoint()
            return
        try:
            await wake.wait()
        finally:
            with self._lock:
                if entry in self._sleepers:
                    self._sleepers.remove(entry)
                    heapq.heapify(self._sleepers)

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has come."""
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self.set(self._now + timedelta(seconds=seconds))

    def set(self, instant: datetime) -> None:
        """Move time to `instant` (never backwards) and wake the sleepers that are due.

        Safe from any thread: a sleeper in another thread's event loop (the `mongoq_sync`
        portal) is woken through that loop."""
        instant = to_millis(instant)
        with self._lock:
            if instant < self._now:
                raise ValueError("a clock does not go backwards")
            self._now = instant
            due = []
            while self._sleepers and self._sleepers[0][0] <= self._now:
                due.append(heapq.heappop(self._sleepers))
        for _, _, wake, loop in due:
            if _running_loop() is loop:
                wake.set()
            else:
                loop.call_soon_threadsafe(wake.set)

    @property
    def sleepers(self) -> int:
        """How many tasks are waiting in `sleep()`."""
        return len(self._sleepers)

    def next_wakeup(self) -> datetime | None:
        """The earliest deadline of a sleeping task, if any."""
        return self._sleepers[0][0] if self._sleepers else None

    def sleeping_until(self, deadline: datetime) -> int:
        """How many tasks sleep until exactly `deadline`: a test waits for the one it expects
        (``clock.sleeping_until(clock.now() + timedelta(seconds=60)) == 1``) instead of for
        "nothing left to run", which a command's round trip would end too early."""
        deadline = to_millis(deadline)
        with self._lock:
            return sum(1 for entry in self._sleepers if to_millis(entry[0]) == deadline)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
