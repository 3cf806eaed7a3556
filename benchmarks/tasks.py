"""Task-queue benchmarks: the lifecycle (put, claim, complete) and claim cost against backlog.

Targets: at most 3 commands per task unbatched; commands per claim constant as the
backlog grows. Timings on the embedded backend measure mongomock, which scans every document
on every query; only a real server (``--uri``) says anything about index use.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import anyio

from benchmarks.harness import ReplayedDatabase, Result, counted_database
from mongoq import AsyncTaskQueue, Jobs, NewTask, Task, _driver
from mongoq.clock import SystemClock
from mongoq.testing import ManualClock


async def _queue(db: object) -> AsyncTaskQueue:
    queue = AsyncTaskQueue(db, "bench_tasks", clock=ManualClock())
    await queue.setup()
    return queue


async def _drain(queue: AsyncTaskQueue) -> int:
    done = 0
    while (task := await queue.claim("bench")) is not None:
        await queue.complete(task)
        done += 1
    return done


async def _put_in_batches(queue: AsyncTaskQueue, tasks: int, size: int = 100) -> None:
    for start in range(0, tasks, size):
        await queue.put_many(
            NewTask(f"t{number}", {"n": number})
            for number in range(start, min(start + size, tasks))
        )


async def lifecycle_single(uri: str | None, tasks: int) -> Result:
    """put, claim and complete, one command each."""
    async with counted_database(uri) as bench:
        queue = await _queue(bench.db)
        bench.start()
        for number in range(tasks):
            await queue.put(f"t{number}", {"n": number})
        assert await _drain(queue) == tasks
        return bench.stop("tasks: put + claim + complete", tasks)


async def lifecycle_put_many(uri: str | None, tasks: int) -> Result:
    """put_many in batches of 100, then claim and complete one by one."""
    async with counted_database(uri) as bench:
        queue = await _queue(bench.db)
        bench.start()
        await _put_in_batches(queue, tasks)
        assert await _drain(queue) == tasks
        return bench.stop("tasks: put_many(100) + claim + complete", tasks)


async def lifecycle_batched(uri: str | None, tasks: int) -> Result:
    """put_many, claim_many and complete_many in batches of 100."""
    async with counted_database(uri) as bench:
        queue = await _queue(bench.db)
        bench.start()
        await _put_in_batches(queue, tasks)
        done = 0
        while batch := await queue.claim_many(100, "bench"):
            done += sum(await queue.complete_many(batch))
        assert done == tasks
        return bench.stop("tasks: put/claim/complete_many(100)", tasks)


async def claim_cost(uri: str | None, backlog: int, claims: int = 20) -> Result:
    """Commands (and time) per claim+complete with `backlog` tasks waiting."""
    async with counted_database(uri) as bench:
        queue = await _queue(bench.db)
        for start in range(0, backlog, 1000):
            await queue.put_many(
                NewTask(f"t{number}") for number in range(start, min(start + 1000, backlog))
            )
        claims = min(claims, backlog)
        bench.start()
        for _ in range(claims):
            task = await queue.claim("bench")
            assert task is not None
            await queue.complete(task)
        result = bench.stop(f"tasks: claim + complete, backlog {backlog}", claims)
        return await bench.examined(result, lambda: queue.claim("bench"))


async def lifecycle_cpu(uri: str | None, tasks: int = 300) -> Result:
    """mongoq's own time per put, claim and complete of one task, the commands left out
    (`Stopwatch`): what the library itself costs a task's lifecycle, whichever backend."""
    async with counted_database(uri) as bench:
        queue = await _queue(bench.db)
        for number in range(5):  # warm: the first calls build what later ones reuse
            await queue.put(f"w{number}", {"n": number})
            task = await queue.claim("bench")
            assert task is not None
            await queue.complete(task)
        bench.start()
        for number in range(tasks):
            await queue.put(f"t{number}", {"n": number})
            task = await queue.claim("bench")
            assert task is not None
            await queue.complete(task)
        return bench.stop("tasks: mongoq's own time per put+claim+complete", tasks, own=True)


async def lifecycle_cpu_replayed(tasks: int = 2000) -> Result:
    """mongoq's own time per put, claim and complete of one task with the commands
    short-circuited: one lifecycle's replies recorded on the embedded backend answer every
    later lifecycle (`ReplayedDatabase`), so what is timed is the library alone."""
    raw = _driver.connect(_driver.MEMORY_SCHEME, f"mongoq_bench_{uuid.uuid4().hex[:8]}")
    queue = await _queue(raw)
    replayed = ReplayedDatabase(raw)
    queue = AsyncTaskQueue(replayed, "bench_tasks", clock=ManualClock())
    await _lifecycle(queue, "recorded")
    replayed.replay()
    for number in range(50):  # warm
        await _lifecycle(queue, f"w{number}")
    started = time.perf_counter()
    for number in range(tasks):
        await _lifecycle(queue, f"t{number}")
    seconds = time.perf_counter() - started
    return Result(
        "tasks: own time per put+claim+complete, replayed", "memory", tasks, seconds,
        3 * tasks, own_ms=seconds * 1000 / tasks,
    )  # fmt: skip


async def _lifecycle(queue: AsyncTaskQueue, task_id: str) -> None:
    await queue.put(task_id, {"n": 1})
    task = await queue.claim("bench")
    assert task is not None
    await queue.complete(task)


async def wake_up(uri: str | None, puts: int = 20) -> Result:
    """From a put to its handler's start, an idle worker of 8 slots polling every
    second in the same process, on the wall clock; the commands per task (claims included)."""
    async with counted_database(uri) as bench:
        queue = AsyncTaskQueue(bench.db, "bench_wake", clock=SystemClock())
        await queue.setup()
        started: dict[str, float] = {}
        arrived = anyio.Event()

        async def handler(task: Task) -> None:
            started[str(task.id)] = time.perf_counter()
            arrived.set()

        latencies: list[float] = []
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, concurrency=8, poll_interval=1.0))
            await anyio.sleep(0.05)  # every slot idle
            bench.start()
            for number in range(puts):
                arrived = anyio.Event()
                put_at = time.perf_counter()
                await queue.put(f"t{number}")
                with anyio.fail_after(5):
                    await arrived.wait()
                latencies.append((started[f"t{number}"] - put_at) * 1000)
                await anyio.sleep(0.01)  # idle again before the next put
            result = bench.stop("tasks: put to handler start, idle worker of 8", puts)
            queue.stop()
        return replace(result, latency_ms=(statistics.median(latencies), max(latencies)))


async def run_drain(uri: str | None, tasks: int) -> Result:
    """put, then `run(handler)` drains: the loop's claims and completions, housekeeping in."""
    async with counted_database(uri) as bench:
        queue = await _queue(bench.db)
        bench.start()
        for number in range(tasks):
            await queue.put(f"t{number}", {"n": number})
        summary = await queue.run(_nothing, stop_when_empty=True)
        assert summary.completed == tasks
        return bench.stop("tasks: put + run(handler)", tasks)


async def jobs_drain(
    uri: str | None, tasks: int, functions: int, queues: int, *, traced: bool = False
) -> Result:
    """defer calls of `functions` task functions spread over `queues` queues, then one
    `Jobs.run` drains them all: what a claim naming several functions costs. `traced`: with
    an OpenTelemetry SDK provider recording every span (in memory), what tracing costs."""
    async with counted_database(uri) as bench:
        jobs = Jobs(bench.db, clock=ManualClock(), tracer_provider=_recording_provider(traced))
        declared = [
            jobs.task(name=f"f{n}", queue=f"bench_jobs_{n % queues}")(_nothing_with)
            for n in range(functions)
        ]
        await jobs.setup()
        bench.start()
        for number in range(tasks):
            await declared[number % functions].defer(number)
        summary = await jobs.run(concurrency=1, stop_when_empty=True)
        assert summary.completed == tasks
        label = f"jobs: defer + worker, {functions} function(s), {queues} queue(s)"
        return bench.stop("jobs: defer + worker, traced (SDK)" if traced else label, tasks)


def _recording_provider(traced: bool) -> Any:
    """An OpenTelemetry SDK provider keeping every span in memory (None: not `traced`)."""
    if not traced:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    return provider


async def _nothing(task: Task) -> None:
    return None


async def _nothing_with(n: int) -> None:
    return None


def scenarios(tasks: int, backlogs: list[int]) -> list[tuple[str, Callable[[str | None], object]]]:
    runs: list[tuple[str, Callable[[str | None], object]]] = [
        ("wake-up", wake_up),
        ("lifecycle single", lambda uri: lifecycle_single(uri, tasks)),
        ("lifecycle put_many", lambda uri: lifecycle_put_many(uri, tasks)),
        ("lifecycle batched", lambda uri: lifecycle_batched(uri, tasks)),
        ("run drain", lambda uri: run_drain(uri, tasks)),
        ("jobs one function", lambda uri: jobs_drain(uri, tasks, 1, 1)),
        ("jobs three functions", lambda uri: jobs_drain(uri, tasks, 3, 2)),
        ("jobs traced", lambda uri: jobs_drain(uri, tasks, 1, 1, traced=True)),
        ("lifecycle own time", lambda uri: lifecycle_cpu(uri)),
        ("lifecycle own time, replayed", lambda uri: lifecycle_cpu_replayed()),
    ]
    for backlog in backlogs:
        runs.append(
            (f"claim cost {backlog}", lambda uri, backlog=backlog: claim_cost(uri, backlog))
        )
    return runs
