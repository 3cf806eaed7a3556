"""`watching`: notices an event loop blocked past a bound and says once which handler ran.

A handler that blocks its event loop (``time.sleep`` in an ``async def``, a CPU-bound loop, a
blocking driver call) stops every heartbeat of that loop: its own lease, and every other slot's,
run out while nothing can renew them, and the tasks run again elsewhere (or in this worker)
with nothing saying why. A run loop runs inside `watching(bound)`: a ticker task of the event
loop notes the wall-clock time every fraction of `bound`, and a thread of its own checks that
note; when it is older than `bound` (a third of the shortest lease: past it, renewals are late)
the thread logs one WARNING naming the handler running in the loop at that moment
(`mongoq.runtime.handler.running`), once per stall. The loop's own clock is not used: a blocked
loop is a fact of wall time. Owns no collections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio

from mongoq.runtime import handler

__all__ = ["Stall", "watching"]

log = logging.getLogger("mongoq.worker")


@dataclass(eq=False)
class Stall:
    """What the watchdog thread knows: when the loop last ticked, and whether the current stall
    was said already. `check` is its whole judgement (tested with a given time)."""

    bound: float
    name: str
    beat: float = field(default_factory=time.monotonic)
    said: bool = False

    def tick(self, now: float) -> None:
        self.beat = now
        self.said = False

    def check(self, now: float, running: Callable[[], str | None]) -> str | None:
        """The warning to log at `now`, once per stall: None while the loop ticks in time."""
        blocked = now - self.beat
        if self.said or blocked <= self.bound:
            return None
        self.said = True
        what = running() or "no handler (mongoq's own code, or another task of the loop)"
        return (
            f"{self.name}: the event loop has been blocked for {blocked:.1f} s (more than "
            f"{self.bound:g} s, a third of the lease: renewals are late) while running {what}; "
            "a handler must not block (use anyio.to_thread.run_sync for blocking calls)"
        )


def _running_in(loop: asyncio.AbstractEventLoop) -> Callable[[], str | None]:
    def running() -> str | None:
        task = asyncio.current_task(loop)  # read from the thread: a dict look-up
        return None if task is None else handler.running.get(task)

    return running


@contextlib.asynccontextmanager
async def watching(bound: float, name: str) -> AsyncIterator[Stall]:
    """While the block runs, watch this event loop for stalls past `bound` seconds."""
    stall = Stall(bound, name)
    stop = threading.Event()
    running = _running_in(asyncio.get_running_loop())
    step = bound / 4

    def watch() -> None:
        while not stop.wait(step):
            warning = stall.check(time.monotonic(), running)
            if warning is not None:
                log.warning(warning, extra={"mongoq_worker_loop": name, "mongoq_blocked": bound})

    async def ticker() -> None:
        while True:
            stall.tick(time.monotonic())
            await asyncio.sleep(step)

    # A task of its own, not a task group: what the block raises comes out as it is.
    ticking = asyncio.get_running_loop().create_task(ticker())
    thread = threading.Thread(target=watch, name=f"mongoq watchdog {name}", daemon=True)
    thread.start()
    try:
        yield stall
    finally:
        stop.set()
        ticking.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({ticking})
