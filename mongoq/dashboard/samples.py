"""The dashboard's throughput chart: periodic samples of every primitive's backlog and of the
items it finished since the sample before (``count_finished``: a purge or a retention TTL of
older items does not disturb it), kept in memory (a bounded window per primitive), and the
series the chart draws from them.

Owns no collections: a sample is one `Catalog.summaries` read. The samples live in the
dashboard's process only; a restarted dashboard starts an empty chart.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from mongoq.clock import Clock, SystemClock
from mongoq.dashboard.readings import Catalog, Summary

log = logging.getLogger("mongoq.dashboard")

__all__ = ["CHART_WINDOW", "Point", "Sampler"]

#: The longest stretch the chart shows, in seconds: the last 30 minutes.
CHART_WINDOW = 1800.0


@dataclass(frozen=True)
class Point:
    """One sample of one primitive: when (on the sampler's clock), how much waited, and the
    items finished per minute since the sample before (None for the first, or where the
    primitive records no finished items)."""

    at: datetime
    backlog: int
    per_minute: float | None


class Sampler:
    """Samples `catalog` every `interval` seconds of `clock` (while `run` runs) and keeps the
    last `keep` samples of each primitive; `series` is the JSON behind the chart."""

    def __init__(
        self, catalog: Catalog, *, clock: Clock | None = None, interval: float = 10.0,
        keep: int = 360,
    ) -> None:  # fmt: skip
        self.catalog = catalog
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.interval = interval
        self.keep = keep
        self._points: dict[str, deque[Point]] = {}
        #: per primitive, where its last sample's window ended (on its own clock): where the
        #: next sample's window starts
        self._read_at: dict[str, datetime] = {}
        #: the summaries of the last sample, and when it was taken (on the sampler's clock)
        self.latest: list[Summary] = []
        self.latest_at: datetime | None = None

    async def sample(self) -> list[Summary]:
        """Take one sample of every registered primitive (a primitive no longer registered
        leaves the chart); returns the summaries it read."""
        summaries = await self.catalog.summaries(since=self._read_at)
        at = self.clock.now()
        live = {s.key for s in summaries}
        for key in [k for k in self._points if k not in live]:
            del self._points[key]
            self._read_at.pop(key, None)
        for summary in summaries:
            if summary.error is not None or summary.read_at is None:
                continue  # a gap in the chart, not a made-up zero
            before = self._read_at.get(summary.key)
            until = summary.counted_until
            if until is not None and (before is None or until > before):  # never backwards
                self._read_at[summary.key] = until
            points = self._points.setdefault(summary.key, deque(maxlen=self.keep))
            points.append(Point(at, summary.backlog, _rate(before, summary)))
        self.latest, self.latest_at = summaries, at
        return summaries

    def fresh(self) -> list[Summary] | None:
        """The last sample's summaries while no older than two intervals, else None."""
        if self.latest_at is None:
            return None
        age = (self.clock.now() - self.latest_at).total_seconds()
        return self.latest if 0 <= age <= 2 * self.interval else None

    async def run(self) -> None:
        """Sample now and then every `interval`, until cancelled; a failed sample is logged
        and the next one taken on time."""
        while True:
            try:
                await self.sample()
            except Exception:
                log.warning("the dashboard's sample failed", exc_info=True)
            await self.clock.sleep(self.interval)

    @property
    def window(self) -> float:
        """Seconds the chart shows: `CHART_WINDOW`, or less when fewer samples are kept."""
        return min(CHART_WINDOW, self.interval * self.keep)

    def sampled(self) -> set[str]:
        """The primitives sampled (``"tasks:emails"``)."""
        return set(self._points)

    def points(self, key: str) -> list[Point]:
        """The samples of one primitive (``"tasks:emails"``), oldest first."""
        return list(self._points.get(key, ()))

    def series(self) -> dict[str, Any]:
        """Per primitive (``"tasks:emails"``), its samples oldest first: the time (ISO 8601),
        the backlog, and the items finished per minute since the sample before (None for the
        first, and where the primitive records no finished items)."""
        out = {
            key: [{"at": p.at.isoformat(), "backlog": p.backlog, "per_minute": p.per_minute}
                  for p in points]
            for key, points in self._points.items()
        }  # fmt: skip
        return {"interval": self.interval, "window": self.window, "series": out}


def _rate(before: datetime | None, summary: Summary) -> float | None:
    """Items per minute over the window ``[before, counted_until)`` the summary counted."""
    if before is None or summary.finished is None or summary.counted_until is None:
        return None
    seconds = (summary.counted_until - before).total_seconds()
    return round(summary.finished * 60.0 / seconds, 3) if seconds > 0 else None
