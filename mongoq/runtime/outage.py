"""A run loop's view of its server: when a command fails because the server cannot be reached,
one line says the server is lost, the loop retries with a growing backoff (its poll interval,
doubled after each failure, at most `MAX_BACKOFF` seconds), one line says when it is back, and
with `give_up_after` the loop stops with `ServerUnavailable` once the server has been gone
that long. Any other driver error is logged each time and retried after the poll interval.
Owns no collections.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from pymongo.errors import ConnectionFailure, ServerSelectionTimeoutError

from mongoq._text import one_line
from mongoq._unreachable import server_unavailable
from mongoq.clock import Clock
from mongoq.errors import ServerUnavailable

__all__ = ["MAX_BACKOFF", "Outage"]

log = logging.getLogger("mongoq.worker")

#: The longest wait between two tries while the server is lost (seconds).
MAX_BACKOFF = 30.0


def describe(error: BaseException) -> str:
    """A driver error in one short line: an unreachable server as `ServerUnavailable` says it."""
    if isinstance(error, ServerSelectionTimeoutError):
        return str(server_unavailable(error))
    return one_line(f"{type(error).__name__}: {error}", 200)


class Outage:
    """Counts a loop's failed commands against the time since its server was lost."""

    def __init__(
        self,
        name: str,
        clock: Clock,
        *,
        poll_interval: float,
        give_up_after: float | None,
        on_back: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self._clock = clock
        self._poll_interval = poll_interval
        self._give_up_after = give_up_after
        self._on_back = on_back  # the loop's naps cut short: claim again at once
        self._since: datetime | None = None  # when the first failed command of the outage began
        self._last: datetime | None = None  # when the latest failed command began
        self._failures = 0

    @property
    def lost(self) -> bool:
        """Whether the last command that reached for the server failed to."""
        return self._since is not None

    def failed(self, error: BaseException, doing: str, started: datetime) -> float:
        """Note that `doing`, sent at `started`, failed with `error`; returns the seconds to
        wait before trying again: the poll interval, or as long as the server has been lost so
        far (so doubling), at most `MAX_BACKOFF`, the same for every slot of the loop. Raises
        `ServerUnavailable` once the server has been lost `give_up_after`."""
        if not isinstance(error, ConnectionFailure):
            log.warning("%s: %s failed (%s); retrying after %.1fs", self.name, doing, error,
                        self._poll_interval)  # fmt: skip
            return self._poll_interval
        if self._since is None:
            self._since = started
            log.warning(
                "%s: lost the server: %s; retrying with backoff until it is back",
                self.name, describe(error),
                extra={"mongoq_loop": self.name, "mongoq_event": "server_lost"},
            )  # fmt: skip
        else:
            log.debug("%s: %s failed again (%s)", self.name, doing, describe(error))
            if self._last is not None and (started - self._last).total_seconds() > 2 * MAX_BACKOFF:
                # Nothing was tried for longer than a retry ever waits (every slot busy with
                # its handler): the server may well have been back meanwhile. Giving up counts
                # from this failure, never across an unknown stretch.
                self._since = started
        self._last = max(started, self._last or started)
        self._failures += 1
        lost_for = (self._clock.now() - self._since).total_seconds()
        left = MAX_BACKOFF
        if self._give_up_after is not None:
            if lost_for >= self._give_up_after:
                raise self._giving_up(error, lost_for) from None
            left = self._give_up_after - lost_for
        return min(max(self._poll_interval, lost_for), MAX_BACKOFF, left)

    def succeeded(self, started: datetime) -> None:
        """Note a command sent at `started` that reached the server: the end of the outage, if
        one was on and the command was sent after it began (one sent before proves nothing)."""
        if self._since is None or started < self._since:
            return
        lost_for = (self._clock.now() - self._since).total_seconds()
        log.warning(
            "%s: the server is back after %.1f s (%d failed tries)",
            self.name, lost_for, self._failures,
            extra={"mongoq_loop": self.name, "mongoq_event": "server_back",
                   "mongoq_seconds": round(lost_for, 3)},
        )  # fmt: skip
        self._since, self._last, self._failures = None, None, 0
        self._on_back()

    def _giving_up(self, error: BaseException, lost_for: float) -> ServerUnavailable:
        base = server_unavailable(error) if isinstance(error, ServerSelectionTimeoutError) else None
        log.error(
            "%s: giving up: no server for %.1f s (give_up_after=%g)",
            self.name, lost_for, self._give_up_after,
            extra={"mongoq_loop": self.name, "mongoq_event": "server_given_up"},
        )  # fmt: skip
        return ServerUnavailable(
            f"{self.name}: no server for {lost_for:g} s, gave up (give_up_after="
            f"{self._give_up_after:g}); last: {describe(error)}",
            hosts=base.hosts if base else (),
            waited=lost_for,
            driver_error=error,
        )
