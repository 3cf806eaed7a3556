"""Tools for testing code built on mongoq (ours and yours).

- `ManualClock` (defined in `mongoq.clock`, re-exported here): time that moves only when the
  test says so; workers' sleeps (poll intervals, heartbeats) wake when the clock is advanced
  past their deadline.
- `memory_database()`: a fresh embedded in-memory database (mongomock-motor).
- `interleaving_database(seed)`: the same, but every command yields to the event loop before
  and after it runs (a seeded number of times, optionally after a short real delay), as over a
  network: concurrent workers interleave at command boundaries, as they do on a server.
- `latency_database(seed)`: the same again, with a real, seeded round trip around every
  command (a delay before it applies and another before its reply returns, as over a
  network): code that waits for "nothing left to run" instead of a condition fails here as it
  would against a server.
- `instrument(db, *hooks)`: a database wrapper through which every collection command passes; the
  hooks see each command before and after it runs. Three hooks ship here:
  `FaultInjector` (fail a chosen command before it applies, or after it applied as if the reply
  was lost, or pause it until the test releases it), `CommandCounter` (how many commands ran),
  and `Interleaving` (run several actors so that their commands execute in an exact order).

Each server command is atomic, so a multi-command algorithm is correct only if it is correct for
every order of its commands against other workers' commands and for a crash between any two of
them; these tools force those orders and crashes. Owns no collections.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.lowlevel
from pymongo.errors import AutoReconnect, NetworkTimeout, OperationFailure

from mongoq import _driver
from mongoq.clock import ManualClock

__all__ = [
    "CommandCounter",
    "FaultInjector",
    "Hook",
    "InstrumentedDatabase",
    "Interleaving",
    "ManualClock",
    "Operation",
    "Pause",
    "all_interleavings",
    "Yielding",
    "instrument",
    "interleaving_database",
    "latency_database",
    "memory_database",
    "settle",
]


async def settle(rounds: int = 50, *, limit: int = 100_000) -> None:
    """Let every runnable task run until it blocks (the embedded backend never does real I/O).

    Yields to the event loop until nothing else is ready to run for `rounds` yields in a row
    (at most `limit` yields): commands that yield between each other (`interleaving_database`)
    then settle as fully as commands that never yield. It does not wait for I/O: a coroutine
    waiting for a server's reply (or for `latency_database`'s round trip) is not ready to run,
    so this returns in the middle of it. Where a test waits for something to happen, wait for
    that condition instead (a document's state, an event, a counter), with a bound."""
    loop = asyncio.get_running_loop()
    # asyncio keeps the callbacks ready to run in `_ready`; another loop implementation may
    # not, and then a fixed number of yields is the best there is.
    ready = getattr(loop, "_ready", None)
    quiet = 0
    for _ in range(limit):
        await anyio.lowlevel.checkpoint()
        quiet = quiet + 1 if ready is None or not ready else 0
        if quiet >= rounds:
            return


def memory_database(name: str = "mongoq") -> Any:
    """A fresh, empty embedded in-memory database."""
    return _driver.connect(_driver.MEMORY_SCHEME, name)


def interleaving_database(
    name: str = "mongoq", *, seed: int = 0, max_yields: int = 3, max_delay: float = 0.0
) -> InstrumentedDatabase:
    """A fresh embedded database whose commands interleave as over a network (see `Yielding`).

    Code that is correct on `memory_database()` only because its commands never overlap with
    another worker's fails here the way it would on a server. The whole mongoq suite runs on
    both.
    """
    return instrument(
        memory_database(name), Yielding(seed=seed, max_yields=max_yields, max_delay=max_delay)
    )


def latency_database(
    name: str = "mongoq", *, seed: int = 0, min_delay: float = 0.0002, max_delay: float = 0.002
) -> InstrumentedDatabase:
    """A fresh embedded database whose every command takes a real, seeded round trip: a delay
    of `min_delay` to `max_delay` seconds before it applies and another before its reply
    returns (see `Yielding`). A coroutine waiting for a reply is parked on a timer, not ready
    to run, exactly as one waiting on a socket is; `settle()` returns in the middle of it."""
    return instrument(
        memory_database(name),
        Yielding(seed=seed, max_yields=3, min_delay=min_delay, max_delay=max_delay),
    )


# ------------------------------------------------------------------------------ instrumentation


#: documents in a cursor's first batch when the command names no batch size (the server's)
_FIRST_BATCH = 101


@dataclass
class Operation:
    """One collection command on its way to the server."""

    collection: str
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    actor: str | None
    #: cursor methods chained on a find or aggregate (``("hint", ("claim",))``...), in order
    chain: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    #: documents a find or aggregate returned (set once it ran)
    returned: int | None = None

    @property
    def getmores(self) -> int:
        """The getMore commands a server needs to return what this read returned: its first
        batch holds ``batch_size`` documents (101 by default), later ones ``batch_size`` or, by
        default, up to 16 MiB (one, for the small documents mongoq reads); a cursor a limit has
        not closed is read to its end, an empty batch when the last one was full."""
        if self.returned is None:
            return 0
        chained = dict(self.chain)
        size = (chained.get("batch_size") or (None,))[0] or self.kwargs.get("batch_size")
        limit = (chained.get("limit") or (None,))[0] or self.kwargs.get("limit") or 0
        closed = bool(limit) and self.returned >= limit
        first = size or _FIRST_BATCH
        if self.returned < first:
            return 0
        rest = self.returned - first
        later = (-(-rest // size) if size else min(rest, 1)) if rest else 0
        full = rest == 0 or (size is not None and rest % size == 0)
        return later + (0 if closed or not full else 1)

    @property
    def filter(self) -> Any:
        """The command's filter (first positional argument), if it has one."""
        return self.args[0] if self.args else self.kwargs.get("filter")


class Hook(Protocol):
    async def before(self, op: Operation) -> None: ...

    async def after(self, op: Operation, error: BaseException | None) -> None: ...


_ACTOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("mongoq_actor", default=None)

_COMMANDS = frozenset(
    {
        "bulk_write", "count_documents", "create_index", "create_indexes", "delete_many",
        "delete_one", "distinct", "drop", "drop_index", "estimated_document_count", "find_one",
        "find_one_and_delete", "find_one_and_replace", "find_one_and_update", "index_information",
        "insert_many", "insert_one", "replace_one", "update_many", "update_one",
    }
)  # fmt: skip


#: cursor methods that return the cursor: recorded, then applied when the command runs
_CURSOR_CHAIN = frozenset({"batch_size", "hint", "limit", "skip", "sort"})


class InstrumentedDatabase:
    """A database whose collection commands pass through hooks; see `instrument`."""

    mongoq_wrapper = True

    def __init__(self, db: Any, hooks: Sequence[Hook]) -> None:
        self.mongoq_delegate = db
        self.hooks = list(hooks)

    def __getitem__(self, name: str) -> _InstrumentedCollection:
        return _InstrumentedCollection(self, self.mongoq_delegate[name], name)

    def get_collection(self, name: str, **kwargs: Any) -> _InstrumentedCollection:
        return _InstrumentedCollection(
            self, self.mongoq_delegate.get_collection(name, **kwargs), name
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mongoq_delegate, name)

    async def command(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("$cmd", "command", self.mongoq_delegate.command, args, kwargs)

    async def _call(
        self, collection: str, name: str, method: Callable[..., Any], args: Any, kwargs: Any,
        chain: tuple[tuple[str, tuple[Any, ...]], ...] = (),
    ) -> Any:  # fmt: skip
        op = Operation(collection, name, tuple(args), dict(kwargs), _ACTOR.get(), chain)
        entered: list[Hook] = []
        error: BaseException | None = None
        try:
            # A hook that raises in `before` (an injected fault) still lets the hooks before it
            # see the end of the command, so an `Interleaving` moves on to the next turn.
            for hook in self.hooks:
                await hook.before(op)
                entered.append(hook)
            result = method(*args, **kwargs)
            result = await result if hasattr(result, "__await__") else result
            if name in ("find", "aggregate") and isinstance(result, list):
                op.returned = len(result)
            return result
        except BaseException as exc:
            error = exc
            raise
        finally:
            for hook in reversed(entered):
                await hook.after(op, error)


class _InstrumentedCollection:
    def __init__(self, db: InstrumentedDatabase, collection: Any, name: str) -> None:
        self._db = db
        self._collection = collection
        self.name = name

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._collection, name)
        if name not in _COMMANDS:
            return attr

        async def command(*args: Any, **kwargs: Any) -> Any:
            return await self._db._call(self.name, name, attr, args, kwargs)

        return command

    def find(self, *args: Any, **kwargs: Any) -> _InstrumentedCursor:
        return _InstrumentedCursor(self, "find", self._collection.find, args, kwargs)

    def aggregate(self, *args: Any, **kwargs: Any) -> _InstrumentedCursor:
        return _InstrumentedCursor(self, "aggregate", self._collection.aggregate, args, kwargs)


class _InstrumentedCursor:
    """A deferred cursor: the command runs (and passes the hooks) when the result is read."""

    def __init__(
        self, collection: _InstrumentedCollection, name: str, open: Callable[..., Any],
        args: Any, kwargs: Any,
    ) -> None:  # fmt: skip
        self._collection = collection
        self._name = name
        self._open = open
        self._args = args
        self._kwargs = kwargs
        self._chain: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        if name not in _CURSOR_CHAIN:
            raise AttributeError(name)

        def chain(*args: Any) -> _InstrumentedCursor:
            self._chain.append((name, args))
            return self

        return chain

    def __await__(self) -> Any:  # PyMongo async awaits `aggregate(...)` for its cursor
        async def itself() -> _InstrumentedCursor:
            return self

        return itself().__await__()

    async def to_list(self, length: int | None = None) -> list[Any]:
        async def read(*args: Any, **kwargs: Any) -> list[Any]:
            cursor = self._open(*args, **kwargs)
            if hasattr(cursor, "__await__"):
                cursor = await cursor
            for method, chained in self._chain:
                cursor = getattr(cursor, method)(*chained)
            return list(await cursor.to_list(length))

        return list(
            await self._collection._db._call(
                self._collection.name, self._name, read, self._args, self._kwargs,
                tuple(self._chain),
            )
        )  # fmt: skip


def instrument(db: Any, *hooks: Hook) -> InstrumentedDatabase:
    """Wrap `db` so that every collection command passes through `hooks`, in order."""
    return InstrumentedDatabase(db, hooks)


# ----------------------------------------------------------------------------------- counting


class CommandCounter:
    """Counts commands by ``collection.name``, and the getMores a server would need to return
    what a read returned (``collection.getMore``, see `Operation.getmores`); use with
    `instrument`."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.operations: list[Operation] = []
        self.record = False

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()
        self.operations.clear()

    async def before(self, op: Operation) -> None:
        self.counts[f"{op.collection}.{op.name}"] += 1
        if self.record:
            self.operations.append(op)

    async def after(self, op: Operation, error: BaseException | None) -> None:
        if error is None and op.getmores:
            self.counts[f"{op.collection}.getMore"] += op.getmores


# ------------------------------------------------------------------------------- yielding


class Yielding:
    """Makes every command yield to the event loop before and after it runs; use with
    `instrument` (or `interleaving_database`).

    The embedded backend runs each command synchronously, so concurrent coroutines never
    overlap between commands; over a network every command is a suspension point. Before and
    after each command this yields between 1 and `max_yields` times (seeded, so a failing order
    repeats), and with `max_delay` > 0 also sleeps a random real delay of `min_delay` to
    `max_delay` seconds (`latency_database`, benchmarks).
    """

    def __init__(
        self, *, seed: int = 0, max_yields: int = 3, min_delay: float = 0.0, max_delay: float = 0.0
    ) -> None:
        if max_yields < 1 or min_delay < 0 or max_delay < min_delay:
            raise ValueError("max_yields must be at least 1, and 0 <= min_delay <= max_delay")
        self._random = random.Random(seed)
        self.max_yields = max_yields
        self.min_delay = min_delay
        self.max_delay = max_delay

    async def _yield(self) -> None:
        if self.max_delay:
            await anyio.sleep(self._random.uniform(self.min_delay, self.max_delay))
        for _ in range(self._random.randint(1, self.max_yields)):
            await anyio.lowlevel.checkpoint()

    async def before(self, op: Operation) -> None:
        await self._yield()

    async def after(self, op: Operation, error: BaseException | None) -> None:
        await self._yield()


# ------------------------------------------------------------------------------------- faults


@dataclass
class _Rule:
    when: str  # "before" | "after" | "pause" | "reply"
    name: str
    collection: str | None
    times: int
    error: BaseException | None
    match: Callable[[Operation], bool] | None
    pause: Pause | None = None

    def applies(self, op: Operation) -> bool:
        return (
            self.times > 0
            and op.name == self.name
            and (self.collection is None or op.collection == self.collection)
            and (self.match is None or self.match(op))
        )


@dataclass
class Pause:
    """A command held before it runs until the test calls `release()`."""

    reached: anyio.Event = field(default_factory=anyio.Event)
    _go: anyio.Event = field(default_factory=anyio.Event)

    def release(self) -> None:
        self._go.set()


class FaultInjector:
    """Makes chosen commands fail or wait; use with `instrument`.

    - `fail_before`: the command raises without being applied (a connection that broke first);
    - `fail_after`: the command is applied, then raises as if its reply was lost (also a reply
      that carried a server error, such as a bulk insert's duplicate keys);
    - `pause_before`: the command waits until the test releases it (`Pause.reached` tells when
      it got there), so the test can run other commands in between;
    - `pause_after`: the command is applied, and its reply waits until the test releases it (a
      reply held up in the network: the caller learns late what the server did long before);
    - `yield_between=True`: every command first yields to the event loop, so concurrent workers
      interleave command by command instead of running to completion one after another.
    `triggered` lists every operation a rule fired on.
    """

    def __init__(self, *, yield_between: bool = False) -> None:
        self.yield_between = yield_between
        self._rules: list[_Rule] = []
        self.triggered: list[Operation] = []

    def fail_before(
        self, name: str, *, collection: str | None = None, times: int = 1,
        error: BaseException | None = None, match: Callable[[Operation], bool] | None = None,
    ) -> None:  # fmt: skip
        self._rules.append(_Rule("before", name, collection, times, error, match))

    def fail_after(
        self, name: str, *, collection: str | None = None, times: int = 1,
        error: BaseException | None = None, match: Callable[[Operation], bool] | None = None,
    ) -> None:  # fmt: skip
        self._rules.append(_Rule("after", name, collection, times, error, match))

    def pause_before(
        self, name: str, *, collection: str | None = None,
        match: Callable[[Operation], bool] | None = None,
    ) -> Pause:  # fmt: skip
        pause = Pause()
        self._rules.append(_Rule("pause", name, collection, 1, None, match, pause))
        return pause

    def pause_after(
        self, name: str, *, collection: str | None = None,
        match: Callable[[Operation], bool] | None = None,
    ) -> Pause:  # fmt: skip
        pause = Pause()
        self._rules.append(_Rule("reply", name, collection, 1, None, match, pause))
        return pause

    def clear(self) -> None:
        self._rules.clear()

    def _take(self, when: str, op: Operation) -> _Rule | None:
        for rule in self._rules:
            if rule.when == when and rule.applies(op):
                rule.times -= 1
                self.triggered.append(op)
                return rule
        return None

    async def before(self, op: Operation) -> None:
        if self.yield_between:
            await anyio.lowlevel.checkpoint()
        rule = self._take("pause", op)
        if rule is not None and rule.pause is not None:
            rule.pause.reached.set()
            await rule.pause._go.wait()
        rule = self._take("before", op)
        if rule is not None:
            raise rule.error or AutoReconnect(
                f"injected: connection lost before {op.collection}.{op.name}"
            )

    async def after(self, op: Operation, error: BaseException | None) -> None:
        # A command the server answered with an error (a duplicate key in a bulk insert) ran
        # there too: its reply can be lost like any other. One that never reached it cannot.
        if error is not None and not isinstance(error, OperationFailure):
            return
        held = self._take("reply", op)
        if held is not None and held.pause is not None:
            held.pause.reached.set()
            await held.pause._go.wait()
        rule = self._take("after", op)
        if rule is not None:
            raise rule.error or NetworkTimeout(
                f"injected: reply lost after {op.collection}.{op.name} was applied"
            )


# ------------------------------------------------------------------------------- interleaving


def all_interleavings(counts: Mapping[str, int]) -> Iterator[list[str]]:
    """Every distinct order of `counts[a]` commands of each actor `a`.

    ``all_interleavings({"A": 2, "B": 1})`` yields AAB, ABA, BAA (as lists).
    """
    names = sorted(counts)

    def extend(prefix: list[str], left: dict[str, int]) -> Iterator[list[str]]:
        if not any(left.values()):
            yield list(prefix)
            return
        for name in names:
            if left[name]:
                left[name] -= 1
                prefix.append(name)
                yield from extend(prefix, left)
                prefix.pop()
                left[name] += 1

    yield from extend([], {name: counts[name] for name in names})


class Interleaving:
    """Runs actors so that their commands execute in exactly the given order.

    ``order`` names the actor whose command runs next, e.g. ``["A", "B", "A"]``. An actor waits
    before each command until it is its turn; turns of an actor that has finished are skipped,
    and once the order is used up every actor runs freely. `trace` records what ran, in order.
    Use as the first hook of `instrument` (so that an injected fault still ends the turn), then
    ``await interleaving.run({"A": fn_a, "B": fn_b})``. Tasks an actor starts (a lease's
    heartbeat) act as that actor.
    """

    def __init__(self, order: Sequence[str]) -> None:
        self.order = list(order)
        self.trace: list[tuple[str, str, str]] = []
        self._position = 0
        self._finished: set[str] = set()
        self._actors: set[str] = set()
        self._changed = anyio.Event()

    def _turn(self) -> str | None:
        while self._position < len(self.order) and self.order[self._position] in self._finished:
            self._position += 1
        return self.order[self._position] if self._position < len(self.order) else None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def before(self, op: Operation) -> None:
        if op.actor not in self._actors:
            return
        while (turn := self._turn()) is not None and turn != op.actor:
            await self._changed.wait()
        self.trace.append((op.actor, op.collection, op.name))

    async def after(self, op: Operation, error: BaseException | None) -> None:
        if op.actor not in self._actors:
            return
        if self._turn() == op.actor:
            self._position += 1
        self._notify()

    async def run(self, actors: Mapping[str, Callable[[], Awaitable[Any]]]) -> dict[str, Any]:
        """Run every actor to its end; returns each one's result or the exception it raised."""
        self._actors = set(actors)
        results: dict[str, Any] = {}

        async def play(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
            _ACTOR.set(name)
            try:
                results[name] = await fn()
            except Exception as exc:
                results[name] = exc
            finally:
                self._finished.add(name)
                self._notify()

        async with anyio.create_task_group() as group:
            for name, fn in actors.items():
                group.start_soon(play, name, fn)
        return results
