"""Maintenance services: the named background mechanisms a run loop keeps going beside its slots.

A source of work (`mongoq.runtime.source`) names the services it needs (the task queue's
``reclaim``, ``schedules``, ``holders`` and ``presence``; the transport's ``orphans``; the
dispatcher's ``lanes``), each a `Service` built in the file of its own mechanism. `Services`
runs them for one `WorkerLoop`: the rounds marked `Service.at_start` before the slots start,
then each service every `Service.interval` (or at the time its round names, or at once on a
wake-up of its `Service.wake_key`), a `Service.when_idle` one also when a slot finds nothing
to claim (unless it ran within its interval), and each `Service.close` once the slots have
ended. One line of the run's log lists them; each round is reported to the observers
(`mongoq.runtime.events`: ``mongoq_service_rounds_total`` in `mongoq.metrics`). A round that
fails with a driver error is noted on the loop's `Outage` and tried again after its backoff;
any other error is the service's own to handle. Owns no collections.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import anyio
import anyio.abc

from mongoq import _driver
from mongoq.clock import Clock
from mongoq.runtime import wakeups
from mongoq.runtime.events import report_service_round
from mongoq.runtime.outage import Outage

__all__ = ["Service", "Services"]

log = logging.getLogger("mongoq.worker")

#: Seconds a service's `close` may take at most: a server that does not answer must not hold a
#: stop up.
CLOSE_WAIT = 5.0


@dataclass(frozen=True)
class Service:
    """One maintenance mechanism of a source of work.

    `round` does one round of it, given the service's interval, and may return when the next
    round is due (None: after `interval`; never later than that). `interval` is in seconds of
    the source's clock; None means the run's poll interval. `wake_key`
    (`mongoq.runtime.wakeups`) starts a round at once when notified. `when_idle` also runs a
    round when a slot finds nothing to claim, unless one ran within `interval`. `at_start`
    runs the first round before any slot claims, `at_once` beside the slots as they start
    (otherwise the first round waits an interval). `close` runs once after the slots have
    ended (shielded, bounded by `CLOSE_WAIT`). A round that may send no command at all
    (``holders``, ``lanes``: only while work is held) sets `proves_server` False: its success
    does not end an outage, which only a command that reached the server can.
    """

    name: str
    round: Callable[[float], Awaitable[datetime | None]]
    interval: float | None = None
    when_idle: bool = False
    at_start: bool = False
    at_once: bool = False
    close: Callable[[], Awaitable[Any]] | None = None
    wake_key: wakeups.Key | None = None
    proves_server: bool = True


@dataclass(frozen=True)
class _Labels:
    primitive: str
    queue: str


class Services:
    """The services of one run loop's sources, run beside its slots."""

    def __init__(
        self,
        named: Sequence[tuple[str, str, Service]],
        *,
        clock: Clock,
        poll_interval: float,
        outage: Outage,
        name: str,
        quiet: bool = False,
    ) -> None:
        # (primitive, queue, service) for every service of every source, in their order
        self._services = [(_Labels(primitive, queue), s) for primitive, queue, s in named]
        self._clock = clock
        self._poll_interval = poll_interval
        self._outage = outage
        self._name = name
        self._quiet = quiet  # (a loop run again and again, as `run_once`: no line each time)
        self._ran_at: dict[int, datetime] = {}

    def _interval(self, service: Service) -> float:
        return self._poll_interval if service.interval is None else service.interval

    def describe(self) -> str:
        """``reclaim every 300 s, holders every 1 s``: what the run's log lists."""
        return ", ".join(f"{s.name} every {self._interval(s):g} s" for _, s in self._services)

    async def start(self, group: anyio.abc.TaskGroup) -> None:
        """Run the `at_start` rounds, then start every service's rounds in `group`."""
        if self._services and not self._quiet:
            log.info("%s: services: %s", self._name, self.describe(),
                     extra={"mongoq_loop": self._name,
                            "mongoq_services": [s.name for _, s in self._services]})  # fmt: skip
        for index, (labels, service) in enumerate(self._services):
            if service.at_start:
                await self._round(index, labels, service)
        for index, (labels, service) in enumerate(self._services):
            group.start_soon(partial(self._serve, index, labels, service, service.at_start))

    async def idle(self) -> None:
        """A slot found nothing to claim: the `when_idle` services' rounds, unless recent."""
        now = self._clock.now()
        for index, (labels, service) in enumerate(self._services):
            last = self._ran_at.get(index)
            recent = last is not None and (now - last).total_seconds() < self._interval(service)
            if service.when_idle and not recent:
                await self._round(index, labels, service)

    async def close(self) -> None:
        """Every service's `close`, shielded and bounded (once the slots have ended)."""
        for _, service in self._services:
            if service.close is not None:
                with anyio.move_on_after(CLOSE_WAIT, shield=True):
                    await service.close()

    async def _serve(self, index: int, labels: _Labels, service: Service, started: bool) -> None:
        woken = anyio.Event()

        def wake() -> None:
            woken.set()

        listening = (
            wakeups.listen(service.wake_key, wake)
            if service.wake_key is not None
            else contextlib.nullcontext()
        )
        with listening:
            upcoming: datetime | None = None
            if service.at_once and not started:
                upcoming = await self._round(index, labels, service)
            while True:
                interval = timedelta(seconds=self._interval(service))
                until = self._clock.now() + interval
                until = until if upcoming is None else min(upcoming, until)
                await wakeups.sleep_until_woken(self._clock, until, woken)
                woken = anyio.Event()  # (set before the round: a wake during it is not lost)
                upcoming = await self._round(index, labels, service)

    async def _round(self, index: int, labels: _Labels, service: Service) -> datetime | None:
        started = self._clock.now()
        self._ran_at[index] = started
        try:
            upcoming = await service.round(self._interval(service))
        except _driver.DRIVER_ERRORS as exc:
            delay = self._outage.failed(exc, f"the {service.name} service", started)
            report_service_round(labels.primitive, labels.queue, service.name, "failed")
            return self._clock.now() + timedelta(seconds=delay)
        if service.proves_server:
            self._outage.succeeded(started)
        report_service_round(labels.primitive, labels.queue, service.name, "ran")
        return upcoming
