"""Helpers shared by the task-queue tests.

Every helper is backend-neutral: the same tests run on the embedded backend and on a real server.
Reads go to the collection directly (not through the queue), so assertions see what is stored.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar

import anyio
import anyio.lowlevel
import bson
import pytest

from mongoq import AsyncTaskQueue, InvalidInput, NewTask, Task
from mongoq.testing import (
    CommandCounter,
    FaultInjector,
    Interleaving,
    ManualClock,
    Operation,
    all_interleavings,
    instrument,
    settle,
)

#: The lease used by the tests' queues: short enough to reason about, heartbeats every 10 s.
LEASE_TTL = 30.0
QUEUE = "tasks"
#: The largest BSON document a server stores.
SIXTEEN_MIB = 16 * 1024 * 1024

#: The actors of a race, by name: each runs its commands in the turns the order gives it.
Actors = dict[str, Callable[[], Awaitable[Any]]]
#: The commands of a race as they ran: (actor, collection, command name).
Trace = list[tuple[str, str, str]]
Subject = TypeVar("Subject")


class Indexed(Protocol):
    async def setup(self) -> Any: ...


IndexedT = TypeVar("IndexedT", bound=Indexed)


async def indexed(
    kind: Callable[..., IndexedT], db: Any, name: str, clock: ManualClock, **options: Any
) -> IndexedT:
    """`kind(db, name, clock=clock, **options)` (a queue or a transport) with its indexes
    created: claims name their index, and a real server refuses a hint to a missing one."""
    subject = kind(db, name, clock=clock, **options)
    await subject.setup()
    return subject


async def new_queue(
    db: Any, clock: ManualClock, name: str = QUEUE, **options: Any
) -> AsyncTaskQueue:
    """A task queue on `db` driven by the test's clock, with the tests' lease, and its indexes."""
    return await indexed(AsyncTaskQueue, db, name, clock, **{"lease_ttl": LEASE_TTL, **options})


async def counted_queue(
    db: Any, clock: ManualClock, **options: Any
) -> tuple[AsyncTaskQueue, CommandCounter]:
    """`new_queue` whose commands a `CommandCounter` counts, from after the index set-up."""
    counter = CommandCounter()
    queue = await new_queue(instrument(db, counter), clock, **options)
    counter.reset()
    return queue, counter


async def faulty_queue(
    db: Any, clock: ManualClock, **options: Any
) -> tuple[AsyncTaskQueue, FaultInjector]:
    """`new_queue` whose commands go through a `FaultInjector` with no rule yet."""
    faults = FaultInjector()
    return await new_queue(instrument(db, faults), clock, **options), faults


async def claim_one(queue: AsyncTaskQueue, worker: str = "w", expect: Any = None) -> Task:
    """Claim a task that must be there (and be `expect`, when given)."""
    task = await queue.claim(worker)
    assert task is not None, "nothing was claimable"
    if expect is not None:
        assert task.id == expect, f"claimed {task.id!r}, expected {expect!r}"
    return task


async def put_and_claim(queue: AsyncTaskQueue, worker: str = "w", payload: Any = None) -> Task:
    """Put t1 and have `worker` claim it."""
    await queue.put("t1", payload)
    return await claim_one(queue, worker, expect="t1")


async def expired_claim(
    queue: AsyncTaskQueue, clock: ManualClock, worker: str = "w", payload: Any = None
) -> Task:
    """Put t1, have `worker` claim it, and let that lease expire: the claim is now stale."""
    task = await put_and_claim(queue, worker, payload)
    clock.advance(LEASE_TTL + 1)
    return task


def later(clock: ManualClock, seconds: float = 0) -> datetime:
    """The clock's instant `seconds` from now (what the queue stores for a due time or lease)."""
    return clock.now() + timedelta(seconds=seconds)


def utc(value: Any) -> Any:
    """`value` with every datetime in it made UTC-aware: backends differ in whether they return
    naive (UTC) or aware datetimes, and the clock's instants are aware."""
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if isinstance(value, dict):
        return {key: utc(item) for key, item in value.items()}
    if isinstance(value, list):
        return [utc(item) for item in value]
    return value


async def read(db: Any, task_id: Any, name: str = QUEUE) -> dict[str, Any] | None:
    """The stored document of a task, read straight from the collection."""
    doc = await db[name].find_one({"_id": task_id})
    return None if doc is None else utc(dict(doc))


async def stored_fields(db: Any, task_id: Any, *fields: str, name: str = QUEUE) -> tuple[Any, ...]:
    """The values of `fields` in the stored document of a task, which must exist."""
    doc = await read(db, task_id, name)
    assert doc is not None, f"no stored task {task_id!r}"
    return tuple(doc[field] for field in fields)


async def assert_completes(db: Any, queue: AsyncTaskQueue, task: Task, result: Any) -> None:
    """The claim `task` still holds its task: completing it stores the task done with `result`."""
    assert await queue.complete(task, result)
    assert await stored_fields(db, task.id, "status", "result") == ("done", result)


async def read_all(db: Any, name: str = QUEUE) -> dict[Any, dict[str, Any]]:
    """Every stored task document, by id."""
    docs = await db[name].find({}).to_list(None)
    return {doc["_id"]: utc(dict(doc)) for doc in docs}


def encoded(doc: dict[str, Any] | None) -> bytes:
    """A document's BSON bytes: equal bytes mean the same fields, values and field order."""
    assert doc is not None
    return bson.encode(doc)


async def wait_for(predicate: Callable[[], bool], what: str, within: float = 20.0) -> None:
    """Let other tasks run until `predicate()` holds, for at most `within` seconds of real time
    (the bound of a command's round trip, never of the primitive's clock).

    On the embedded backend one `settle()` is usually enough; where commands take real time (the
    latency lane, a server), a coroutine waiting for its reply is not ready to run, so this
    also sleeps a moment between checks, letting its reply arrive.
    """
    await settle()
    with anyio.move_on_after(within):
        while not predicate():
            await settle(5)
            if not predicate():
                await anyio.sleep(0.0005)
        return
    raise AssertionError(f"timed out waiting for {what}")


def napping(host: Any) -> bool:
    """Every run loop of `host` (a task queue's, a group transport's, a dispatcher's) is idle:
    nothing in flight, every slot napping on the clock or waiting for another slot's poll, so
    only the clock can move them now."""
    loops = list(host._loops)
    return bool(loops) and all(loop.idle for loop in loops)


async def until(
    read: Callable[[], Awaitable[Any]],
    check: Callable[[Any], bool],
    what: str,
    within: float = 20.0,
) -> Any:
    """Read (`read()`, e.g. a document) until `check` holds for what it returns, for at most
    `timeout` seconds of real time; returns the last reading."""
    await settle()
    with anyio.move_on_after(within):
        while True:
            value = await read()
            if check(value):
                return value
            await anyio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def rejects(field: str) -> Any:
    """`pytest.raises` for an `InvalidInput` whose message starts with the field `field`."""
    return pytest.raises(InvalidInput, match=f"^{re.escape(field)}")


async def every_order(
    db: Any,
    counts: dict[str, int],
    fresh: Callable[[Any, str], Awaitable[Subject]],
    setup: Callable[[Subject], Awaitable[Actors]],
    check: Callable[[Subject, dict[str, Any], Trace], Awaitable[str]],
) -> Counter[str]:
    """For every interleaving of `counts`: `fresh(db, name)` makes the queue or transport under
    test on fresh collections named after `name` (``race{n}``), its commands going through the
    interleaving; `setup` it (its commands run freely) and get the actors, run them in that
    order, then `check(subject, results, trace)`, which asserts and names the outcome. An actor
    with fewer commands than its turns has them skipped; commands beyond its turns run freely
    once the order is used up. Returns the outcomes seen: a race whose orders all end the same
    way did not test much."""
    outcomes: Counter[str] = Counter()
    for number, order in enumerate(all_interleavings(counts)):
        interleaving = Interleaving(order)
        subject = await fresh(instrument(db, interleaving), f"race{number}")
        actors = await setup(subject)
        results = await interleaving.run(actors)
        label = "".join(order)
        errors = {actor: r for actor, r in results.items() if isinstance(r, BaseException)}
        assert not errors, f"order {label}: {errors}"
        assert interleaving.trace[0][0] == order[0], f"order {label}: {interleaving.trace}"
        try:
            outcomes[await check(subject, results, interleaving.trace)] += 1
        except AssertionError as failure:
            raise AssertionError(f"order {label}: {failure}\n{interleaving.trace}") from failure
    return outcomes


async def race(
    db: Any,
    clock: ManualClock,
    counts: dict[str, int],
    setup: Callable[[AsyncTaskQueue], Awaitable[Actors]],
    check: Callable[[AsyncTaskQueue, dict[str, Any]], Awaitable[str]],
) -> Counter[str]:
    """`every_order` on a task queue with a fresh collection (``race{n}``, the queue's `name`)
    per order; `check(queue, results)` asserts the invariants and names the outcome."""

    async def fresh(db: Any, name: str) -> AsyncTaskQueue:
        return await new_queue(db, clock, name=name)

    async def check_results(queue: AsyncTaskQueue, results: dict[str, Any], trace: Trace) -> str:
        return await check(queue, results)

    return await every_order(db, counts, fresh, setup, check_results)


def assert_outcomes(outcomes: Counter[str], orders: int, expected: set[str]) -> None:
    """A race (`race`, `every_order`) ran `orders` orders and saw exactly the outcomes
    `expected`."""
    assert sum(outcomes.values()) == orders
    assert set(outcomes) == expected


def nth(index: int) -> Callable[[Operation], bool]:
    """A fault rule's `match` that picks the `index`-th (from 0) matching command it sees."""
    seen = itertools.count()
    return lambda op: next(seen) == index


class InFlight:
    """A hook counting the commands sent and not answered yet."""

    def __init__(self) -> None:
        self.count = 0

    async def before(self, op: Operation) -> None:
        self.count += 1

    async def after(self, op: Operation, error: BaseException | None) -> None:
        self.count -= 1


def unexpected_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the worker loop logged as escaping a batch's processing."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


class Bookkeeping:
    """A task handler that notices two runs of one task overlapping, counts runs per task, and
    fails the first attempt of the `flaky` tasks."""

    def __init__(self, flaky: set[str]) -> None:
        self.flaky = flaky
        self.in_flight: set[Any] = set()
        self.overlaps: list[Any] = []
        self.runs: Counter[Any] = Counter()

    async def handler(self, task: Task) -> dict[str, Any]:
        if task.id in self.in_flight:
            self.overlaps.append(task.id)
        self.in_flight.add(task.id)
        try:
            for _ in range(3):
                await anyio.lowlevel.checkpoint()  # let the other slots interleave
            self.runs[task.id] += 1
            if task.id in self.flaky and task.attempts == 1:
                raise RuntimeError(f"transient failure of {task.id}")
            return {"attempt": task.attempts}
        finally:
            self.in_flight.discard(task.id)

    def attempts(self, task_id: Any) -> int:
        """The attempts `task_id` takes: two if it is flaky, else one."""
        return 2 if task_id in self.flaky else 1

    async def assert_all_done(self, db: Any, ids: list[Any], name: str = QUEUE) -> None:
        """Exactly the tasks `ids` are stored, each done with the result of the attempt that
        finished it and no lease, having run that many times and never twice at once."""
        assert self.overlaps == []
        assert self.runs == {task_id: self.attempts(task_id) for task_id in ids}
        docs = await read_all(db, name)
        assert sorted(docs) == sorted(ids)
        for task_id, doc in docs.items():
            attempts = self.attempts(task_id)
            assert (doc["status"], doc["attempts"]) == ("done", attempts), task_id
            assert (doc["result"], doc["lease_until"]) == ({"attempt": attempts}, None), task_id


async def flaky_tasks(
    db: Any, clock: ManualClock, count: int
) -> tuple[AsyncTaskQueue, list[str], Bookkeeping]:
    """A queue whose commands all yield first (so slots interleave command by command) with a
    1 to 1.5 s backoff, holding `count` tasks t00, t01... of priorities 0 to 2, and the
    `Bookkeeping` handler that fails the first attempt of every seventh."""
    faults = FaultInjector(yield_between=True)
    queue = await new_queue(instrument(db, faults), clock, backoff_base=1, backoff_cap=1)
    ids = [f"t{i:02}" for i in range(count)]
    await queue.put_many(
        [NewTask(task_id, {"n": task_id}, priority=i % 3) for i, task_id in enumerate(ids)]
    )
    return queue, ids, Bookkeeping(set(ids[::7]))


async def every_page(
    fetch: Callable[[str | None], Awaitable[Any]], items: str, limit: int
) -> list[Any]:
    """Everything a paged listing lists: `fetch(after)` one page, whose `items` attribute
    holds at most `limit` entries and `next` the cursor of the following page."""
    listed: list[Any] = []
    after = None
    for _ in range(100):
        page = await fetch(after)
        entries = getattr(page, items)
        assert len(entries) <= limit
        listed += entries
        if page.next is None:
            return listed
        after = page.next
    raise AssertionError("the pages never ended")


def set_asides(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, str, str]]:
    """(collection, item, field, outcome) of every set-aside WARNING logged
    (`mongoq.runtime.report.log_set_aside`), in order."""
    return [
        (r.mongoq_collection, r.mongoq_item, r.mongoq_field, r.mongoq_outcome)
        for r in caplog.records
        if r.levelno == logging.WARNING and hasattr(r, "mongoq_field")
    ]


class Sleeper:
    """A handler that sleeps until cancelled: `seen` records ``started``, then ``cancelled``."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, item: Any, *context: Any) -> None:
        self.seen.append("started")
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.seen.append("cancelled")
            raise


async def in_background(
    clock: ManualClock,
    run: Awaitable[Any],
    *,
    advance: float,
    started: Callable[[], Any] = lambda: True,
    then: Callable[[], Awaitable[None]] | None = None,
    quiet: Callable[[], bool] | None = None,
) -> Any:
    """Await `run` in the background: once `started()` holds, await `then()`, move the clock
    `advance` seconds and return what `run` returns. With `quiet` (a condition saying the run
    waits on the clock and on nothing else, e.g. every slot napping), the clock moves again
    each time it holds, until the run returns (at most a thousand times)."""
    results: list[Any] = []

    async def go() -> None:
        results.append(await run)

    async with anyio.create_task_group() as group:
        group.start_soon(go)
        await wait_for(lambda: bool(started()) or bool(results), "the handler to start")
        if then is not None:
            await then()
        clock.advance(advance)
        for _ in range(1000 if quiet is not None else 0):
            await wait_for(lambda: bool(results) or quiet(), "the run to wait on the clock")
            if results:
                break
            clock.advance(advance)
        await wait_for(lambda: bool(results), "the run to return")
    return results[0]
