"""The ``mongoq demo`` job: a task queue put through crashes, retries and stale writers.

It runs on simulated time (a `ManualClock` that jumps to the next due instant), so leases,
backoffs and reclaims that would take hours play out in seconds, against the embedded backend by
default or a real server with ``--uri`` (in a collection of its own, dropped at the end).

Each round: a "crasher" claims a few tasks and dies (drops them without a word), a "zombie"
claims one and stalls, zombies of earlier rounds wake up and try to complete what they held, and
then a pool of well-behaved workers drains everything due. Handlers fail transiently at random,
a few tasks are poison (fail every time) and a few fail permanently. At the end the demo checks
the invariants and prints them; it exits non-zero if one does not hold. Owns the collection
``demo_tasks_<random>`` (and the ``_schedules`` and ``_workers`` ones its set-up makes).

Progress comes as it happens, not only per round: the first round alone drains most tasks (all
are due at once), which on the embedded backend takes seconds of wall time. So a ticker beside
the work prints a line a second (tasks put, then done, retried, failed and to go, counted as the
handlers settle them, at no command's cost), and a line as each round ends (the queue's own
counts). The workers claim in batches (`DemoConfig.batch_size`): the embedded backend scans the
whole collection for each claim, so a claim a task was most of the demo's time.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio

from mongoq import _driver, registry
from mongoq.clock import ManualClock, to_millis
from mongoq.errors import PermanentError
from mongoq.tasks import AsyncTaskQueue, NewTask, Task
from mongoq.tasks import schema as task_schema

__all__ = ["DEMO_DATABASE", "DemoConfig", "DemoReport", "demo_queue_name", "drop_demo", "run_demo"]


#: The database the demo runs in, whatever ``--database`` says: never an operator's own.
DEMO_DATABASE = "mongoq_demo"
#: Rounds a zombie stalls: past its lease (two rounds) and the round that takes the task over.
ZOMBIE_STALL_ROUNDS = 4
#: Seconds of wall time between two progress lines.
PROGRESS_INTERVAL = 1.0
#: Tasks put per command: on the embedded backend a put scans the collection, so a command of
#: a few hundred takes seconds; between two of these the progress ticker gets its turn.
PUT_CHUNK = 50


class TransientError(Exception):
    """What a flaky dependency raises: worth a retry."""


@dataclass(frozen=True)
class DemoConfig:
    uri: str | None = None
    tasks: int = 1000
    workers: int = 8
    #: tasks a worker claims at once (`AsyncTaskQueue.run`'s `batch_size`; 1: a claim a task)
    batch_size: int = 16
    transient_rate: float = 0.15
    poison_rate: float = 0.005
    permanent_rate: float = 0.005
    crashes_per_round: int = 4
    crash_rounds: int = 3
    seed: int = 7
    max_attempts: int = 4
    lease_ttl: float = 60.0
    #: seconds of wall time to pause between rounds (``demo --dashboard``: a chart that moves)
    round_pause: float = 0.0


@dataclass
class DemoReport:
    statuses: Counter[str] = field(default_factory=Counter)
    rounds: int = 0
    handler_runs: int = 0
    transient_errors: int = 0
    abandoned_by_crashes: int = 0
    zombie_writes_rejected: int = 0
    zombie_writes_accepted: int = 0
    zombie_fencing_errors: int = 0
    concurrent_violations: int = 0
    simulated_seconds: float = 0.0
    wall_seconds: float = 0.0
    checks: list[tuple[str, bool]] = field(default_factory=list)
    #: the collection the demo's queue lives in
    queue: str = ""

    @property
    def ok(self) -> bool:
        return all(passed for _, passed in self.checks)


@dataclass
class _Tally:
    """What the progress lines say between two reads of the queue: counted by the demo's own
    code as tasks are put and handled, so a line costs no command; each round's end sets
    `done` and `failed` to the queue's counts (tasks a reclaim failed are only seen there)."""

    total: int
    started: float
    progress: Callable[[str], None]
    round: int = 0
    put: int = 0
    done: int = 0
    retried: int = 0
    failed: int = 0
    last: str = ""

    def say(self, text: str) -> None:
        """A progress line: `text` after the wall time the demo has run."""
        self.last = text
        self.progress(f"{time.perf_counter() - self.started:6.1f} s  {text}")

    def tell(self) -> None:
        """What is put, or where the draining stands; not when the line before said just
        that (the ticker and the end of the put can meet)."""
        if not self.round:
            text = f"put {self.put:6d} of {self.total}"
        else:
            left = self.total - self.done - self.failed
            text = (
                f"round {self.round:<3d}{self.done:6d} done {self.retried:5d} retried "
                f"{self.failed:4d} failed {left:6d} to go"
            )
        if text != self.last:
            self.say(text)


def _every(seconds: float) -> Callable[[], Awaitable[None]]:
    """A tick on a grid of wall time, `seconds` after the first call and every `seconds`
    after that: a line the busy event loop lets out late does not push the later ones back
    (after a stall the grid starts again)."""
    due: float | None = None

    async def tick() -> None:
        nonlocal due
        now = anyio.current_time()
        due = max((now if due is None else due) + seconds, now)
        await anyio.sleep(due - now)

    return tick


async def run_demo(
    config: DemoConfig,
    progress: Callable[[str], None] = lambda line: None,
    *,
    db: Any = None,
    clock: ManualClock | None = None,
    name: str | None = None,
    tick: Callable[[], Awaitable[None]] | None = None,
) -> DemoReport:
    """Run the demo; `progress` receives a line at the start, one each time `tick` returns
    (by default every `PROGRESS_INTERVAL` seconds of wall time) and one as each round ends.
    With `db` (and its `clock`: ``demo --dashboard`` shows both) the caller owns the queue's
    collection and drops it with `drop_demo` (`name`, from `demo_queue_name`, lets it do so
    even when the demo is stopped midway); otherwise the demo connects to `config.uri` and
    drops it at the end."""
    rng = random.Random(config.seed)
    started = time.perf_counter()
    clock = clock if clock is not None else ManualClock()
    owned = db is None
    db = _driver.connect(config.uri, DEMO_DATABASE) if owned else db
    name = name if name is not None else demo_queue_name()
    queue = AsyncTaskQueue(
        db, name, clock=clock, lease_ttl=config.lease_ttl, max_attempts=config.max_attempts,
        backoff_base=5, backoff_cap=120,
    )  # fmt: skip
    report = DemoReport(queue=name)
    tally = _Tally(config.tasks, started, progress)
    claims = "a task" if config.batch_size == 1 else f"up to {config.batch_size} tasks"
    progress(
        f"putting {config.tasks} tasks into {name}; {config.workers} workers drain them, "
        f"{claims} a claim (a line a second, and one a round)"
    )

    wait = tick if tick is not None else _every(PROGRESS_INTERVAL)

    async def ticker() -> None:
        while True:
            await wait()
            tally.tell()

    try:
        await _beside(lambda: _play(queue, clock, config, rng, report, tally), ticker)
        await _check(queue, config, report)
    finally:
        report.wall_seconds = time.perf_counter() - started
        if owned and config.uri is not None:
            await drop_demo(db, name)
    return report


def demo_queue_name() -> str:
    """A fresh name for the demo's queue (a collection of its own)."""
    return f"demo_tasks_{uuid.uuid4().hex[:8]}"


async def drop_demo(db: Any, name: str) -> None:
    """Drop the demo queue's collections and its registration (a server outlives the demo)."""
    for suffix in ("", task_schema.SCHEDULES_SUFFIX, task_schema.WORKERS_SUFFIX):
        await _driver.collection(db, f"{name}{suffix}").drop()  # its set-up made each
    await registry.unregister(db, "tasks", name)


def _fate(task_id: str, config: DemoConfig) -> str:
    """Poison and permanent tasks are fixed by id, so every run of one seed agrees."""
    roll = random.Random(f"{config.seed}:{task_id}").random()
    if roll < config.poison_rate:
        return "poison"
    if roll < config.poison_rate + config.permanent_rate:
        return "permanent"
    return "ok"


async def _beside(
    work: Callable[[], Awaitable[None]], ticker: Callable[[], Awaitable[None]]
) -> None:
    """Run `work` with `ticker` beside it until `work` ends. The first error of either stops
    both and is raised as itself, not in an exception group: the CLI tells a connection
    failure or a closed pipe by its class."""
    failures: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def guarded(call: Callable[[], Awaitable[None]]) -> None:
            try:
                await call()
            except Exception as error:
                failures.append(error)
            group.cancel_scope.cancel()

        group.start_soon(guarded, ticker)
        await guarded(work)
    if failures:
        raise failures[0]


async def _put(
    queue: AsyncTaskQueue, config: DemoConfig, rng: random.Random, tally: _Tally
) -> None:
    ids = [f"task-{number:05d}" for number in range(config.tasks)]
    for start in range(0, len(ids), PUT_CHUNK):
        result = await queue.put_many(
            NewTask(task_id, {"n": int(task_id[5:])}, priority=rng.choice((0, 0, 0, 1, 2)))
            for task_id in ids[start : start + PUT_CHUNK]
        )
        tally.put += result.inserted
        # The embedded backend's commands never yield: without this the ticker would wait
        # for the whole put.
        await anyio.lowlevel.checkpoint()


def _handler(
    config: DemoConfig, rng: random.Random, report: DemoReport, tally: _Tally
) -> Callable[[Task], Awaitable[dict[str, Any]]]:
    """The well-behaved workers' handler: flaky, with the tasks' fixed fates; it counts what
    it does for the report and the progress lines."""
    active: set[Any] = set()

    async def handler(task: Task) -> dict[str, Any]:
        report.handler_runs += 1
        if task.id in active:
            report.concurrent_violations += 1
        active.add(task.id)
        last_try = task.attempts >= config.max_attempts  # a failure now fails the task
        try:
            await anyio.lowlevel.checkpoint()  # let the other workers interleave
            fate = _fate(str(task.id), config)
            if fate == "permanent":
                tally.failed += 1
                raise PermanentError("malformed input")
            flaky = fate != "poison" and rng.random() < config.transient_rate
            if fate == "poison" or flaky:
                report.transient_errors += flaky
                tally.failed += last_try
                tally.retried += not last_try
                raise TransientError("upstream timed out" if flaky else "poison: fails every time")
            tally.done += 1
            return {"doubled": task.payload["n"] * 2, "by": "worker"}
        finally:
            active.discard(task.id)

    return handler


async def _play(
    queue: AsyncTaskQueue,
    clock: ManualClock,
    config: DemoConfig,
    rng: random.Random,
    report: DemoReport,
    tally: _Tally,
) -> None:
    await queue.setup()
    await _put(queue, config, rng, tally)
    tally.tell()
    began = clock.now()
    handler = _handler(config, rng, report, tally)
    zombies: list[tuple[int, Task]] = []  # (round it wakes up in, the task it holds)
    while True:
        report.rounds += 1
        tally.round = report.rounds
        zombies = await _wake_zombies(queue, zombies, config, report)
        if report.rounds <= config.crash_rounds:  # a bad deploy: workers die mid-task
            zombies += await _crash(queue, config, report)
        await queue.run(
            handler, concurrency=config.workers, batch_size=config.batch_size,
            stop_when_empty=True,
        )  # fmt: skip
        await queue.reclaim_expired()
        stats = await queue.stats()
        tally.done, tally.failed = stats.counts["done"], stats.counts["failed"]
        elapsed = (clock.now() - began).total_seconds()
        tally.say(
            f"round {report.rounds:<3d}ends at simulated t=+{elapsed:.0f} s: "
            + "  ".join(f"{status} {count}" for status, count in stats.counts.items() if count)
        )
        if not stats.counts["pending"] and not stats.counts["processing"] and not zombies:
            break
        # Jump at least half a lease: far enough for crashed leases to expire within two
        # rounds, coarse enough that jittered backoffs are drained in a few rounds.
        next_due = await _next_due(queue)
        step = config.lease_ttl / 2
        if next_due is not None:
            step = max(step, (next_due - clock.now()).total_seconds())
        clock.advance(step)
        if config.round_pause:
            await anyio.sleep(config.round_pause)
    report.simulated_seconds = (clock.now() - began).total_seconds()


async def _wake_zombies(
    queue: AsyncTaskQueue, zombies: list[tuple[int, Task]], config: DemoConfig, report: DemoReport
) -> list[tuple[int, Task]]:
    """The stalled workers whose round came settle what they hold (mostly past their lease:
    their writes are fenced); returns those still asleep."""
    for wake, stale in zombies:
        if wake > report.rounds:
            continue
        current = await queue.get(stale.id)
        still_theirs = current is not None and current.lease_token == stale.lease_token
        if await _zombie_settles(queue, stale, config):
            report.zombie_writes_accepted += 1
            report.zombie_fencing_errors += not still_theirs
        else:
            report.zombie_writes_rejected += 1
            report.zombie_fencing_errors += still_theirs
    return [(wake, task) for wake, task in zombies if wake > report.rounds]


async def _crash(
    queue: AsyncTaskQueue, config: DemoConfig, report: DemoReport
) -> list[tuple[int, Task]]:
    """A round of a bad deploy: one worker stalls holding a task (returned, with the round it
    wakes up in), others die holding theirs."""
    stalled = await queue.claim("zombie")
    for _ in range(config.crashes_per_round):
        if await queue.claim("crasher") is not None:
            report.abandoned_by_crashes += 1
    return [] if stalled is None else [(report.rounds + ZOMBIE_STALL_ROUNDS, stalled)]


async def _zombie_settles(queue: AsyncTaskQueue, task: Task, config: DemoConfig) -> bool:
    """A stalled worker wakes up and reports what its handler would have: fenced like any."""
    fate = _fate(str(task.id), config)
    if fate == "poison":
        return await queue.release_for_retry(task, TransientError("poison: fails every time"))
    if fate == "permanent":
        return await queue.fail(task, PermanentError("malformed input"))
    return await queue.complete(task, {"doubled": task.payload["n"] * 2, "by": "zombie"})


async def _next_due(queue: AsyncTaskQueue) -> datetime | None:
    docs = await _driver.find_list(
        queue.collection,
        {"status": {"$in": ["pending", "processing"]}},
        sort=[("lease_until", 1)],
        limit=1,
        projection={"lease_until": 1},
    )
    return to_millis(docs[0]["lease_until"]) if docs else None


async def _check(queue: AsyncTaskQueue, config: DemoConfig, report: DemoReport) -> None:
    docs = await _driver.find_list(queue.collection, {})
    by_id = {doc["_id"]: doc for doc in docs}
    report.statuses.update(doc["status"] for doc in docs)
    expected = {f"task-{number:05d}" for number in range(config.tasks)}
    fates = {task_id: _fate(task_id, config) for task_id in expected}

    def check(label: str, passed: bool) -> None:
        report.checks.append((label, passed))

    check("no task lost: every task put is in the queue", set(by_id) == expected)
    check(
        "every task ended done or failed",
        all(doc["status"] in ("done", "failed") for doc in docs),
    )
    check(
        "no task processed by two workers at once",
        report.concurrent_violations == 0,
    )
    check(
        "every done task holds its own correct result",
        all(
            doc["result"]["doubled"] == doc["payload"]["n"] * 2
            for doc in docs
            if doc["status"] == "done"
        ),
    )
    check(
        "poison and permanently failing tasks ended failed, never done",
        all(by_id[t]["status"] == "failed" for t, fate in fates.items() if fate != "ok"),
    )
    check(
        "no task claimed more than max_attempts times",
        all(doc["attempts"] <= config.max_attempts for doc in docs),
    )
    check(
        "a stalled worker's write took effect exactly when it still held the lease",
        report.zombie_fencing_errors == 0,
    )
