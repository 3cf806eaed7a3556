"""What every benchmark shares: a counted database, a timer, and the result line.

Commands are counted by wrapping the database with `mongoq.testing.instrument` and a
`CommandCounter`: every collection command the library issues passes through it, and so do the
getMores a server would add to return what a read returned. mongoq's own time per call is that
call's time less the time spent inside the commands (`Stopwatch`): the backend's work is left
out, whichever backend, and what remains is the library's (and the event loop's). On a real
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
from mongoq.testing import CommandCounter, InstrumentedDatabase, Operation, instrument


@dataclass(frozen=True)
class Result:
    scenario: str
    backend: str
    items: int
    seconds: float
    commands: int
    #: documents the server examines for one claim (``explain``); real servers only
    docs_examined: int | None = None
    #: milliseconds of mongoq's own time per item, commands left out (`Stopwatch`)
    own_ms: float | None = None
    #: milliseconds from a put to its handler's start: (median, max)
    latency_ms: tuple[float, float] | None = None

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
        own = "" if self.own_ms is None else f"  {self.own_ms:.3f} ms own/item"
        if self.latency_ms is not None:
            own += f"  start after {self.latency_ms[0]:.1f} ms (max {self.latency_ms[1]:.1f})"
        return (
            f"{self.scenario:<50} {self.backend:<8} {self.items:>7} items  "
            f"{rate}  {self.commands_per_item:>6.2f} commands/item{examined}{own}"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "per_second": self.per_second,
            "commands_per_item": self.commands_per_item,
        }


class Stopwatch:
    """A hook (`mongoq.testing.instrument`) adding up the time spent inside commands, so that
    what a call took less `inside` is the caller's own time: the commands short-circuited."""

    def __init__(self) -> None:
        self.inside = 0.0
        self._entered: dict[int, float] = {}

    async def before(self, op: Operation) -> None:
        self._entered[id(op)] = time.perf_counter()

    async def after(self, op: Operation, error: BaseException | None) -> None:
        self.inside += time.perf_counter() - self._entered.pop(id(op))


@dataclass
class Bench:
    db: Any
    counter: CommandCounter
    backend: str
    raw: Any = None
    server: ServerCommandCounter | None = None
    started: float = 0.0
    stopwatch: Stopwatch | None = None

    def start(self) -> None:
        self.counter.reset()
        if self.server is not None:
            self.server.reset()
        if self.stopwatch is not None:
            self.stopwatch.inside = 0.0
        self.started = time.perf_counter()

    def stop(self, scenario: str, items: int, *, own: bool = False) -> Result:
        """The result since `start`; with `own`, also mongoq's own time per item."""
        seconds = time.perf_counter() - self.started
        commands = self.server.total if self.server is not None else self.counter.total
        own_ms = None
        if own and self.stopwatch is not None and items:
            own_ms = (seconds - self.stopwatch.inside) * 1000 / items
        return Result(scenario, self.backend, items, seconds, commands, own_ms=own_ms)

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
    stopwatch = Stopwatch()
    backend = _driver.backend_of(raw).value
    try:
        # The stopwatch first: what it times is the command and the other hooks (test tools),
        # so that what is left is mongoq's own.
        yield Bench(
            instrument(raw, stopwatch, counter), counter, backend, raw, server, 0.0, stopwatch
        )
    finally:
        if uri:
            await raw.client.drop_database(name)
            await _driver.close(raw)


class ReplayedDatabase(InstrumentedDatabase):
    """The commands short-circuited: the replies of one recorded pass answer every later pass,
    in order, without running anything. Timing a replayed pass times mongoq alone (and this
    thin wrapper), with no backend's work in between to blur it; a scenario whose every pass
    sends the same commands, in the same order, is what it can replay."""

    def __init__(self, db: Any) -> None:
        super().__init__(db, ())
        self.replies: list[Any] = []
        self.replaying = False
        self._next = 0

    def replay(self) -> None:
        """From now on, answer with the recorded replies, starting with the first."""
        self.replaying, self._next = True, 0

    async def _call(
        self, collection: str, name: str, method: Callable[..., Any], args: Any, kwargs: Any,
        chain: tuple[tuple[str, tuple[Any, ...]], ...] = (),
    ) -> Any:  # fmt: skip
        if not self.replaying:
            reply = await super()._call(collection, name, method, args, kwargs, chain)
            self.replies.append(reply)
            return reply
        reply = self.replies[self._next % len(self.replies)]
        self._next += 1
        return reply
