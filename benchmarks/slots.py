"""Slots busy under interleaving: `run(concurrency=8, batch_size=10)` over 400 due items.

On the embedded backend the database is `mongoq.testing.interleaving_database` with real
sub-millisecond delays around every command, as over a network (on plain mongomock no two
claims ever overlap, which hides claim collisions); with ``--uri`` it is the server itself.
Each handler takes 10 ms. Reported: the most slots running a handler at once, items per second,
and commands per item.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from mongoq import (
    AsyncGroupTransport,
    AsyncTaskQueue,
    GroupLease,
    NewMessage,
    NewTask,
    Task,
    _driver,
)
from mongoq.testing import CommandCounter, ManualClock, Yielding, instrument

ITEMS = 400
SLOTS = 8
BATCH = 10
#: Real delay around each command at most (seconds): a fast network round trip.
DELAY = 0.0005
WORK = 0.01


@dataclass(frozen=True)
class SlotsResult:
    scenario: str
    backend: str
    items: int
    seconds: float
    commands: int
    busy: int

    def line(self) -> str:
        rate = self.items / self.seconds if self.seconds else float("inf")
        return (
            f"{self.scenario:<50} {self.backend:<8} {self.items:>7} items  {rate:>10.0f} /s  "
            f"{self.commands / self.items:>6.2f} commands/item  {self.busy}/{SLOTS} slots busy"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Busy:
    def __init__(self) -> None:
        self.now = 0
        self.most = 0

    async def work(self) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(WORK)
        finally:
            self.now -= 1


#: Sets a primitive up with `ITEMS` due items; returns the run to time (items it finished).
Prepare = Callable[[Any, ManualClock, _Busy], Awaitable[Callable[[], Awaitable[int]]]]


async def _tasks(db: Any, clock: ManualClock, busy: _Busy) -> Callable[[], Awaitable[int]]:
    queue = AsyncTaskQueue(db, "bench_slots", clock=clock)
    await queue.setup()
    await queue.put_many(NewTask(f"t{i}", i) for i in range(ITEMS))

    async def handle(task: Task) -> None:
        await busy.work()

    async def run() -> int:
        summary = await queue.run(handle, concurrency=SLOTS, batch_size=BATCH, stop_when_empty=True)
        return summary.completed

    return run


async def _groups(db: Any, clock: ManualClock, busy: _Busy) -> Callable[[], Awaitable[int]]:
    transport = AsyncGroupTransport(db, "bench_slots", clock=clock)
    await transport.setup()
    await transport.publish_many(NewMessage(f"g{i}", i) for i in range(ITEMS))

    async def handle(lease: GroupLease) -> None:
        await busy.work()

    async def run() -> int:
        summary = await transport.run(
            handle, concurrency=SLOTS, batch_size=BATCH, stop_when_empty=True
        )
        return summary.acked

    return run


async def _measure(uri: str | None, scenario: str, prepare: Prepare) -> SlotsResult:
    name = f"mongoq_bench_{uuid.uuid4().hex[:8]}"
    raw = _driver.connect(uri or _driver.MEMORY_SCHEME, name)
    counter = CommandCounter()
    hooks: list[Any] = [counter] if uri else [Yielding(seed=1, max_delay=DELAY), counter]
    busy = _Busy()
    try:
        run = await prepare(instrument(raw, *hooks), ManualClock(), busy)
        counter.reset()
        started = time.perf_counter()
        done = await run()
        seconds = time.perf_counter() - started
    finally:
        if uri:
            await raw.client.drop_database(name)
            await _driver.close(raw)
    backend = "server" if uri else "interleaved"
    return SlotsResult(scenario, backend, done, seconds, counter.total, busy.most)


def scenarios() -> list[tuple[str, Callable[[str | None], object]]]:
    return [
        (
            "slots busy: tasks",
            lambda uri: _measure(uri, f"tasks: run({SLOTS} slots, batch {BATCH})", _tasks),
        ),
        (
            "slots busy: groups",
            lambda uri: _measure(uri, f"groups: run({SLOTS} slots, batch {BATCH})", _groups),
        ),
    ]
