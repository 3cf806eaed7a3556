"""What every benchmark shares: a counted database, a timer, and the result line.

Commands are counted by wrapping the database with `mongoq.testing.instrument` and a
`CommandCounter`: every collection command the library issues passes through it. On a real
server the count reported is the server's own, from PyMongo's command monitoring
(`benchmarks.server.ServerCommandCounter`: it also sees cursor continuations), and claim-cost
scenarios add the documents one claim examines, from ``explain``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.server import ServerCommandCounter, examined_by
from mongoq import _driver
from mongoq.testing import CommandCounter, instrument


@dataclass(frozen=True)
class Result:
    scenario: str
    backend: str
    items: int
    seconds: float
    commands: int
    #: documents the server examines for one claim (``explain``); real servers only
    docs_examined: int | None = None

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
        examined = "" if self.docs_examined is None else f"  {self.docs_examined} docs/claim"
        return (
            f"{self.scenario:<50} {self.backend:<8} {self.items:>7} items  "
            f"{rate}  {self.commands_per_item:>6.2f} commands/item{examined}"
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
    raw: Any = None
    server: ServerCommandCounter | None = None
    started: float = 0.0

    def start(self) -> None:
        self.counter.reset()
        if self.server is not None:
            self.server.reset()
        self.started = time.perf_counter()

    def stop(self, scenario: str, items: int) -> Result:
        seconds = time.perf_counter() - self.started
        commands = self.server.total if self.server is not None else self.counter.total
        return Result(scenario, self.backend, items, seconds, commands)

    async def examined(self, result: Result, claim: Callable[[], Awaitable[Any]]) -> Result:
        """`result` with the documents one more `claim()` examines (real servers only)."""
        if self.server is None:
            return result
        self.counter.reset()
        self.counter.record = True
        try:
            await claim()
        finally:
            self.counter.record = False
        reads = [op for op in self.counter.operations if op.collection != "$cmd"]
        return replace(result, docs_examined=await examined_by(self.raw, reads))


@asynccontextmanager
async def counted_database(uri: str | None) -> AsyncIterator[Bench]:
    """A fresh database (dropped afterwards on a real server) with a command counter."""
    name = f"mongoq_bench_{uuid.uuid4().hex[:8]}"
    server = ServerCommandCounter(name) if uri else None
    options = {"event_listeners": [server]} if server is not None else None
    raw = _driver.connect(uri or _driver.MEMORY_SCHEME, name, client_options=options)
    counter = CommandCounter()
    backend = _driver.backend_of(raw).value
    try:
        yield Bench(instrument(raw, counter), counter, backend, raw, server)
    finally:
        if uri:
            await raw.client.drop_database(name)
            await _driver.close(raw)
