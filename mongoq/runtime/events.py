"""What the run loops report as they go, for observers such as `mongoq.metrics`: each outcome
counted in a run summary, how long each handler ran, and how long after falling due each item
was claimed (the claims report that one, whoever calls them). Process-wide, like logging: an
observer subscribes once and hears the loops of every primitive; with none subscribed, a
report costs a loop over an empty list. An observer that raises is logged and kept out of the
loop's way. Owns no collections.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

__all__ = [
    "RunEvent",
    "Tally",
    "report_handler_time",
    "report_outcome",
    "report_service_round",
    "report_start_delay",
    "subscribe",
]

log = logging.getLogger("mongoq.worker")


@dataclass(frozen=True)
class RunEvent:
    """One report: `count` items of `primitive` `queue` ended in `outcome` (a run summary's
    field: ``claimed``, ``completed`` / ``acked``, ``retried``, ``failed`` / ``dead`` /
    ``buried``, ``released``, ``lost``, ``unknown``); or, with `outcome` ``"handler_seconds"``,
    one handler ran `seconds`; or, with ``"start_delay_seconds"``, one item was claimed
    `seconds` after it fell due (its due time, or its lease's end for a take-over); or, with
    ``"service_ran"`` / ``"service_failed"``, one round of the maintenance service `service`
    (`mongoq.runtime.services`) ran, or failed with a driver error."""

    primitive: str
    queue: str
    outcome: str
    count: int = 1
    seconds: float = 0.0
    service: str = ""


Observer = Callable[[RunEvent], None]
_observers: list[Observer] = []


def subscribe(observer: Observer) -> Callable[[], None]:
    """Call `observer` with every `RunEvent` from now on; returns the call that stops it."""
    _observers.append(observer)

    def unsubscribe() -> None:
        if observer in _observers:
            _observers.remove(observer)

    return unsubscribe


def _emit(event: RunEvent) -> None:
    for observer in list(_observers):
        try:
            observer(event)
        except Exception:
            log.exception("a run-event observer failed; the run goes on")


def report_outcome(primitive: str, queue: str, outcome: str, count: int = 1) -> None:
    if _observers and count:
        _emit(RunEvent(primitive, queue, outcome, count))


def report_handler_time(primitive: str, queue: str, seconds: float) -> None:
    if _observers:
        _emit(RunEvent(primitive, queue, "handler_seconds", 1, seconds))


def report_start_delay(primitive: str, queue: str, due: datetime | None, now: datetime) -> None:
    """A claim took an item at `now` that fell due at `due` (nothing when unknown)."""
    if _observers and due is not None:
        _emit(RunEvent(primitive, queue, "start_delay_seconds", 1, (now - due).total_seconds()))


def report_service_round(primitive: str, queue: str, service: str, outcome: str) -> None:
    """One round of `service` ended: ``"ran"`` or ``"failed"``."""
    if _observers:
        _emit(RunEvent(primitive, queue, f"service_{outcome}", 1, service=service))


@dataclass(frozen=True)
class Tally:
    """Counts a run's outcomes into its summary (a dataclass of int fields) and reports each
    to the observers: the one place a run loop adds to its summary."""

    summary: object
    primitive: str
    queue: str

    def __call__(self, outcome: str, count: int = 1) -> None:
        setattr(self.summary, outcome, getattr(self.summary, outcome) + count)
        report_outcome(self.primitive, self.queue, outcome, count)

    def handler_time(self, seconds: float) -> None:
        report_handler_time(self.primitive, self.queue, seconds)
