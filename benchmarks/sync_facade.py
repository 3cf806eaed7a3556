"""The blocking facade's overhead per call: the same cheap call (`TaskQueue.get` of a missing
task) timed through `mongoq_sync` and straight on the async core, on the embedded backend.

Target: under 100 microseconds per call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import mongoq_sync
from mongoq import AsyncTaskQueue
from mongoq.testing import ManualClock, memory_database


def _async_seconds(calls: int) -> float:
    async def run() -> float:
        queue = AsyncTaskQueue(memory_database(), "bench", clock=ManualClock())
        started = time.perf_counter()
        for _ in range(calls):
            await queue.get("missing")
        return time.perf_counter() - started

    return asyncio.run(run())


def _sync_seconds(calls: int) -> float:
    with mongoq_sync.connect() as db:
        queue = mongoq_sync.TaskQueue(db, "bench", clock=ManualClock())
        queue.get("warm-up")
        started = time.perf_counter()
        for _ in range(calls):
            queue.get("missing")
        return time.perf_counter() - started


@dataclass(frozen=True)
class Overhead:
    calls: int
    direct_seconds: float
    facade_seconds: float

    @property
    def micros_per_call(self) -> float:
        return (self.facade_seconds - self.direct_seconds) / self.calls * 1e6

    def line(self) -> str:
        return (
            f"{'sync facade: overhead per call':<50} {'memory':<8} {self.calls:>7} calls  "
            f"{self.micros_per_call:>8.1f} us/call over the async core"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"micros_per_call": self.micros_per_call}


def overhead(calls: int) -> Overhead:
    return Overhead(calls, _async_seconds(calls), _sync_seconds(calls))


def scenarios(calls: int = 2000) -> list[tuple[str, Callable[[str | None], object]]]:
    async def run(uri: str | None) -> Overhead:
        # The portal thread runs its own loop, so this cannot nest in the caller's; the
        # harness runs each scenario in its own asyncio.run, hence a thread here.
        return await asyncio.to_thread(overhead, calls)

    return [("sync facade overhead", run)]
