"""The dashboard's chart of one primitive, drawn on the server as SVG: the backlog (left axis)
and the items finished per minute (right axis) of the samples within a stated window ("last 30
min"), with labelled ticks on both value axes, times on the time axis (UTC) and the latest
values written out. Fewer than two samples show what there is and say the chart is still
collecting samples. Everything written is escaped; the page's script only swaps in a fresh copy.

Owns no collections.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html import escape

from mongoq.dashboard.samples import Point

__all__ = ["SIZES", "Size", "nice_ticks", "render", "time_ticks", "window_label"]

#: Time-axis steps, in seconds, from which the widest that still gives a few ticks is chosen.
_TIME_STEPS = (10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
#: How many value ticks an axis aims at (0 included).
_VALUE_TICKS = 5


@dataclass(frozen=True)
class Size:
    """A chart's size in CSS pixels, and its margins (room for the tick labels)."""

    width: int
    height: int
    left: int = 46
    right: int = 50
    top: int = 22
    bottom: int = 22
    #: the most time ticks the axis holds
    time_ticks: int = 6


SIZES = {"small": Size(420, 150, time_ticks=4), "large": Size(960, 240)}


def window_label(seconds: float) -> str:
    """``last 30 min``, ``last 6 min``, ``last 45 s``, ``last 2 h``."""
    if seconds >= 7200 and seconds % 3600 == 0:
        return f"last {seconds / 3600:g} h"
    if seconds >= 60:
        return f"last {round(seconds / 60)} min"
    return f"last {seconds:g} s"


def nice_ticks(top: float, count: int = _VALUE_TICKS) -> list[float]:
    """Ticks from 0 to at least `top` in a step of 1, 2 or 5 times a power of ten (about
    `count` steps, never below 1 once `top` is); ``[0, 1]`` for a top of 0."""
    if top <= 0:
        return [0.0, 1.0]
    rough = top / count
    power = 10 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= rough)
    if step < 1 and top >= 1:
        step = 1.0  # whole items: no 0.5 between 0 and 1
    steps = math.ceil(top / step - 1e-9)
    return [round(i * step, 6) for i in range(steps + 1)]


def time_ticks(start: datetime, end: datetime, most: int) -> list[datetime]:
    """Round instants within ``[start, end]`` (whole minutes, five minutes...), in the
    smallest step that cuts the span into at most `most` steps."""
    span = (end - start).total_seconds()
    step = next((s for s in _TIME_STEPS if span / s <= most), _TIME_STEPS[-1])
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    first = math.ceil((start - epoch).total_seconds() / step) * step
    ticks, at = [], first
    while at <= (end - epoch).total_seconds() + 1e-6:
        ticks.append(epoch + timedelta(seconds=at))
        at += step
    return ticks


def _number(value: float) -> str:
    """``1.2k``, ``950``, ``2.5``: short enough for an axis."""
    if abs(value) >= 10_000:
        return f"{value / 1000:.0f}k"
    if abs(value) >= 1000:
        return f"{value / 1000:.1f}k".replace(".0k", "k")
    return f"{value:g}" if value == int(value) else f"{value:.1f}"


def _clock(at: datetime, seconds: bool) -> str:
    return at.astimezone(UTC).strftime("%H:%M:%S" if seconds else "%H:%M")


@dataclass(frozen=True)
class _Frame:
    """Where values land: the plot's box and the scales of its three axes."""

    size: Size
    start: datetime
    window: float
    backlog_top: float
    rate_top: float

    def x(self, at: datetime) -> float:
        share = (at - self.start).total_seconds() / self.window if self.window > 0 else 1.0
        inner = self.size.width - self.size.left - self.size.right
        return round(self.size.left + min(1.0, max(0.0, share)) * inner, 1)

    def y(self, value: float, top: float) -> float:
        inner = self.size.height - self.size.top - self.size.bottom
        return round(self.size.height - self.size.bottom - value / top * inner, 1)


def render(
    key: str, name: str, points: Sequence[Point], *, now: datetime, window: float,
    size: str = "small",
) -> str:  # fmt: skip
    """The chart of `points` (oldest first) within the `window` seconds before `now`, at one
    of the `SIZES`."""
    return _render(key, name, points, now, window, size, SIZES[size])


def _render(
    key: str, name: str, points: Sequence[Point], now: datetime, window: float, named: str,
    size: Size,
) -> str:  # fmt: skip
    start = now - timedelta(seconds=window)
    shown = [p for p in points if start <= p.at <= now]
    backlog_ticks = nice_ticks(max((p.backlog for p in shown), default=0))
    rates = [p.per_minute for p in shown if p.per_minute is not None]
    rate_ticks = nice_ticks(max(rates, default=0.0))
    frame = _Frame(size, start, window, backlog_ticks[-1], rate_ticks[-1])
    parts = [
        _axes(frame, backlog_ticks, rate_ticks if rates else [], now),
        _line(frame, [(p.at, float(p.backlog)) for p in shown], frame.backlog_top, "backlog"),
    ]
    if rates:
        pairs = [(p.at, p.per_minute) for p in shown]
        parts.append(_line(frame, pairs, frame.rate_top, "rate"))
    parts.append(_caption(frame, shown, window))
    label = f"{_summary(shown)} ({window_label(window)}) of {name}"
    return (
        f'<svg class="chart" data-key="{escape(key)}" data-size="{escape(named)}" '
        f'width="{size.width}" '
        f'height="{size.height}" viewBox="0 0 {size.width} {size.height}" role="img" '
        f'aria-label="{escape(label)}"><title>{escape(label)}</title>{"".join(parts)}</svg>'
    )


def _summary(shown: Sequence[Point]) -> str:
    if not shown:
        return "no samples yet"
    last = shown[-1]
    rate = "-" if last.per_minute is None else _number(last.per_minute)
    return f"backlog {last.backlog}, {rate} finished per minute, {len(shown)} samples"


def _axes(frame: _Frame, backlog: list[float], rate: list[float], now: datetime) -> str:
    size = frame.size
    left, right = size.left, size.width - size.right
    bottom = size.height - size.bottom
    out = [f'<rect class="plot" x="{left}" y="{size.top}" width="{right - left}" '
           f'height="{bottom - size.top}"/>']  # fmt: skip
    for value in backlog:
        y = frame.y(value, frame.backlog_top)
        out.append(f'<line class="grid" x1="{left}" y1="{y}" x2="{right}" y2="{y}"/>'
                   f'<text class="tick backlog" x="{left - 4}" y="{y + 4}" '
                   f'text-anchor="end">{_number(value)}</text>')  # fmt: skip
    for value in rate:
        y = frame.y(value, frame.rate_top)
        out.append(f'<text class="tick rate" x="{right + 4}" y="{y + 4}">{_number(value)}</text>')
    ticks = time_ticks(frame.start, now, size.time_ticks)
    seconds = len(ticks) > 1 and (ticks[1] - ticks[0]).total_seconds() < 60
    for at in ticks:
        x = frame.x(at)
        out.append(f'<line class="tick" x1="{x}" y1="{bottom}" x2="{x}" y2="{bottom + 4}"/>'
                   f'<text class="tick time" x="{x}" y="{bottom + 16}" '
                   f'text-anchor="middle">{_clock(at, seconds)}</text>')  # fmt: skip
    out.append(f'<text class="axis backlog" x="{left}" y="{size.top - 7}" '
               'text-anchor="end">backlog</text>')  # fmt: skip
    if rate:
        out.append(f'<text class="axis rate" x="{right}" y="{size.top - 7}">per min</text>')
    return "".join(out)


def _line(
    frame: _Frame, pairs: Sequence[tuple[datetime, float | None]], top: float, css: str
) -> str:
    """The series as polylines (a None breaks it: a gap, never a made-up value), and a dot on
    each sample when they are few enough to tell apart."""
    runs: list[list[str]] = [[]]
    dots = []
    for at, value in pairs:
        if value is None:
            runs.append([])
            continue
        point = f"{frame.x(at)},{frame.y(value, top)}"
        runs[-1].append(point)
        dots.append(point)
    out = [f'<polyline class="{css}" points="{" ".join(run)}"/>' for run in runs if len(run) > 1]
    if len(dots) <= 60:
        out += [f'<circle class="{css}" cx="{d.split(",")[0]}" cy="{d.split(",")[1]}" r="2.2"/>'
                for d in dots]  # fmt: skip
    return "".join(out)


def _caption(frame: _Frame, shown: Sequence[Point], window: float) -> str:
    """Above the plot, the window and the latest values; with fewer than two samples, the
    word that more are coming."""
    size = frame.size
    right = size.width - size.right
    latest = ""
    if shown:
        last = shown[-1]
        rate = "" if last.per_minute is None else f", {_number(last.per_minute)} finished/min"
        latest = f' · <tspan class="latest">latest: backlog {last.backlog}{rate}</tspan>'
    out = [f'<text class="window" x="{size.left + 4}" y="{size.top - 7}">'
           f"{escape(window_label(window))} (UTC){latest}</text>"]  # fmt: skip
    if len(shown) < 2:
        cx = (size.left + right) / 2
        cy = (size.top + size.height - size.bottom) / 2
        out.append(f'<text class="collecting" x="{cx}" y="{cy}" text-anchor="middle">'
                   f"collecting samples ({len(shown)} of 2)</text>")  # fmt: skip
    return "".join(out)
