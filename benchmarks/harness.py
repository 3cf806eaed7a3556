"""What every benchmark shares: a counted database, a timer, and the result line.

Commands are counted by wrapping the database with `mongoq.testing.instrument` and a
`CommandCounter`: every collection command the library issues passes through it, on the
embedded backend and on a real server alike.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

from mongoq import _driver
from mongoq.testing import CommandCounter, instrument


@dataclass(frozen=True)
class Result:
    scenario: str
    backend: str
    items: int
    seconds: float
    commands: int

    @property
    def per_second(self) -> float:
        return self.items / self.seconds if self.seconds else float("inf")

    @property
    def commands_per_item(self) -> float:
        return self.commands / self.items if self.items else 0.0

    def line(self) -> str:
        if self.per_second >= 10:
            rate = f"{self.per_second:>10.0f} /s"
        else:  # slow items read better as a latency
            rate = f"{1000 / self.per_second:>7.0f} ms/it" if self.per_second else " " * 13
        return (
            f"{self.scenario:<50} {self.backend:<8} {self.items:>7} items  "
            f"{rate}  {self.commands_per_item:>6.2f} commands/item"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "per_second": self.per_second,
            "commands_per_item": self.commands_per_item,
        }


@dataclass
class Bench:
    db: Any
    counter: CommandCounter
    backend: str
    started: float = 0.0

    def start(self) -> None:
        self.counter.reset()
        self.started = time.perf_counter()

    def stop(self, scenario: str, items: int) -> Result:
        seconds = time.perf_counter() - self.started
        return Result(scenario, self.backend, items, seconds, self.counter.total)


@asynccontextmanager
async def counted_database(uri: str | None) -> AsyncIterator[Bench]:
    """A fresh database (dropped afterwards on a real server) with a command counter."""
    name = f"mongoq_bench_{uuid.uuid4().hex[:8]}"
    raw = _driver.connect(uri or _driver.MEMORY_SCHEME, name)
    counter = CommandCounter()
    backend = _driver.backend_of(raw).value
    try:
        yield Bench(instrument(raw, counter), counter, backend)
    finally:
        if uri:
            await raw.client.drop_database(name)
            await _driver.close(raw)
