"""`Jobs`: the task functions of an application, their queues, and the one worker that runs
them all (`run`, and ``mongoq worker module:attribute``).

Each queue is an `AsyncTaskQueue` named by the functions declared on it; a worker claims, from
each queue it serves, only the tasks of functions it knows (`AsyncTaskQueue.claim`'s
`functions`), so a task whose function no running worker knows (a deploy in progress, a typo)
is never run and never charged an attempt: it waits, counted pending, until a worker that
knows it starts. Owns no collections (its queues own theirs).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, overload

from mongoq._validation import (
    check_async_handler,
    check_function_name,
    check_int,
    check_name,
    check_timeout,
)
from mongoq.clock import Clock
from mongoq.errors import InvalidInput, MongoqError
from mongoq.jobs.functions import Deferral, TaskFunction
from mongoq.jobs.tracing import TracerProviderLike, Tracing, check_tracer_provider
from mongoq.runtime.loop import RunOptions, WorkerHost
from mongoq.tasks import AsyncTaskQueue, TaskRunSummary
from mongoq.tasks.models import TaskId
from mongoq.tasks.schedules import check_timing

__all__ = ["Jobs"]

log = logging.getLogger("mongoq.jobs")

P = ParamSpec("P")
R = TypeVar("R")

#: The queue of a task function declared without one.
DEFAULT_QUEUE = "default"


class Jobs(WorkerHost):
    """The task functions of an application.

    ``jobs = mongoq.Jobs(db)``, then ``@jobs.task(queue="emails")`` on ``async def`` functions;
    ``await send_email.defer(to=...)`` puts a task, ``await jobs.run()`` (or ``mongoq worker
    app:jobs``) runs every function's tasks. `db` may come later (`use`), for a module that
    declares its functions before it connects. `queue_options` are every queue's
    `AsyncTaskQueue` options (``lease_ttl``, ``max_attempts``, ``backoff_base``...);
    `configure_queue` sets one queue's.

    `tracer_provider` is the OpenTelemetry ``TracerProvider`` of its spans (the ``otel``
    extra): a PRODUCER span for each defer, whose context the task carries, and a CONSUMER
    span for each call, continuing its trace. None: OpenTelemetry's global provider, looked up
    when first used; without an SDK configured there, nothing is traced nor stored.

    ``Jobs(db, like=jobs)`` is a `Jobs` with the task functions, periodic schedules, queue
    options and tracer provider of `jobs`, on `db`: one declaration serving several databases,
    or the blocking facade's ``mongoq_sync.Jobs(db, like=jobs)``, which defers and waits from
    plain threads. Its `defer` and `wait` take the function: ``await tenant.defer(send_email,
    to=...)``."""

    def __init__(
        self,
        db: Any = None,
        *,
        like: Jobs | None = None,
        clock: Clock | None = None,
        tracer_provider: TracerProviderLike | None = None,
        **queue_options: Any,
    ):
        super().__init__()
        _check_queue_options("queue_options", queue_options)
        if like is not None and not isinstance(like, Jobs):
            raise InvalidInput("like", f"must be a mongoq.Jobs, got {type(like).__name__}")
        provider = check_tracer_provider("tracer_provider", tracer_provider)
        if provider is None and like is not None:
            provider = like.tracing.provider
        self.tracing: Tracing = Tracing(provider)
        self.db = db
        self.clock: Clock | None = clock if clock is not None or like is None else like.clock
        # The declarations are shared with `like` (functions declared later show in both);
        # the queues are this database's own.
        self.functions: dict[str, TaskFunction[Any, Any]] = like.functions if like else {}
        self._periodic: dict[str, dict[str, Any]] = like._periodic if like else {}
        self._defaults: dict[str, Any] = {**(like._defaults if like else {}), **queue_options}
        self._options: dict[str, dict[str, Any]] = dict(like._options) if like else {}
        self._queues: dict[str, AsyncTaskQueue] = {}

    def use(self, db: Any) -> Jobs:
        """Work on `db` from now on (the queues are built anew on it); returns this."""
        self.db = db
        self._queues.clear()
        return self

    def configure_queue(self, name: str, **options: Any) -> None:
        """The `AsyncTaskQueue` options of queue `name` (over the ones given to `Jobs`)."""
        _check_queue_options("options", options)
        self._options[check_name("name", name)] = dict(options)
        self._queues.pop(name, None)

    def queue(self, name: str) -> AsyncTaskQueue:
        """The task queue `name` on this `Jobs`' database."""
        queue = self._queues.get(name)
        if queue is None:
            if self.db is None:
                raise InvalidInput("db", "no database yet: Jobs(db), or jobs.use(db) first")
            options = {**self._defaults, **self._options.get(name, {})}
            if self.clock is not None:
                options.setdefault("clock", self.clock)
            queue = self._queues[name] = AsyncTaskQueue(self.db, name, **options)
        return queue

    async def defer(
        self, function: TaskFunction[P, R] | Deferral[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> TaskId:
        """Put, in this `Jobs`' database, a task that calls `function` (one of its task
        functions, or one with `options`) with these arguments; returns the task's id.
        ``jobs.defer(f, ...)`` is ``f.defer(...)`` on another database (a `Jobs` `like` the
        function's own)."""
        deferral = function if isinstance(function, Deferral) else Deferral(function)
        self._own(deferral.function)
        return await deferral.put(self, args, kwargs)

    async def wait(
        self,
        function: TaskFunction[P, R],
        task_id: TaskId,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> R:
        """The result of `function`'s task `task_id` once it finished (`AsyncTaskQueue.wait`,
        `timeout` seconds at most); a task that failed or was cancelled raises `MongoqError`
        with its last error."""
        task = await self.queue(self._own(function).queue).wait(task_id, timeout=timeout)
        if task.status != "done":
            error = (task.error or "").strip().splitlines()
            last = f": {error[-1]}" if error else ""
            if task.status == "cancelled":
                when = "before it ran" if not task.attempts else f"after {task.attempts} attempt(s)"
                raise MongoqError(f"task {task_id!r} was cancelled {when}{last}")
            raise MongoqError(f"task {task_id!r} ended {task.status}{last}")
        result: R = task.result
        return result

    def _own(self, function: Any) -> TaskFunction[Any, Any]:
        if isinstance(function, TaskFunction) and self.functions.get(function.name) is function:
            return function
        raise InvalidInput("function", f"must be a task function of this Jobs: {function!r}")

    def functions_of(self, queue: str) -> list[str]:
        """The names of the task functions declared on `queue`, sorted."""
        return sorted(f.name for f in self.functions.values() if f.queue == queue)

    @property
    def queues(self) -> list[str]:
        """The queues of the declared task functions, by name."""
        return sorted({function.queue for function in self.functions.values()})

    @overload
    def task(self, function: Callable[P, Awaitable[R]], /) -> TaskFunction[P, R]: ...

    @overload
    def task(
        self,
        *,
        name: str | None = None,
        queue: str = DEFAULT_QUEUE,
        timeout: float | None = None,
        retry_on: tuple[type[BaseException], ...] | None = None,
        max_attempts: int | None = None,
    ) -> Callable[[Callable[P, Awaitable[R]]], TaskFunction[P, R]]: ...

    # mypy cannot match a ParamSpec bound only in the second overload's return type to the
    # implementation's parameter; the overloads are what callers see.
    def task(  # type: ignore[misc]
        self,
        function: Callable[P, Awaitable[R]] | None = None,
        /,
        *,
        name: str | None = None,
        queue: str = DEFAULT_QUEUE,
        timeout: float | None = None,
        retry_on: tuple[type[BaseException], ...] | None = None,
        max_attempts: int | None = None,
    ) -> TaskFunction[P, R] | Callable[[Callable[P, Awaitable[R]]], TaskFunction[P, R]]:
        """Declare an ``async def`` function a task function (``@jobs.task`` or
        ``@jobs.task(queue="emails", timeout=30, retry_on=(SMTPError,))``).

        - `name` is stored on each of its tasks (default: the function's qualified name, without
          its module); a worker runs the tasks whose name it knows, so pass the old one when
          renaming the function;
        - `timeout` (seconds of the queue's clock) cancels a call that runs longer: the attempt
          fails with `HandlerTimeout`;
        - `retry_on`: only these exceptions retry (with the queue's backoff); any other fails
          the task at once. Without it every exception but `PermanentError` retries;
        - `max_attempts`: after this many attempts a failure is final, even if the queue
          allows more (the queue's own `max_attempts`, counted at claim, still bounds a task
          that crashes its worker)."""
        check_name("queue", queue)
        limit = check_timeout("timeout", timeout)
        if retry_on is not None and (
            not isinstance(retry_on, tuple)
            or not all(isinstance(k, type) and issubclass(k, BaseException) for k in retry_on)
        ):
            raise InvalidInput("retry_on", "must be a tuple of exception classes, or None")
        if max_attempts is not None:
            check_int("max_attempts", max_attempts, low=1)

        def declare(target: Callable[P, Awaitable[R]]) -> TaskFunction[P, R]:
            if not callable(target):
                raise InvalidInput("function", f"must be an async function, got {target!r}")
            check_async_handler("function", target)
            label = name if name is not None else _default_name(target)
            check_function_name("name", label)
            if label in self.functions:
                raise InvalidInput("name", f"a task function {label!r} is declared already")
            declared = TaskFunction(
                self, target, name=label, queue=queue, timeout=limit, retry_on=retry_on,
                max_attempts=max_attempts,
            )  # fmt: skip
            self.functions[label] = declared
            return declared

        return declare(function) if function is not None else declare

    def periodic(
        self,
        *,
        cron: str | None = None,
        every: float | None = None,
        timezone: str = "UTC",
        queue: str = DEFAULT_QUEUE,
        name: str | None = None,
        missed: Literal["once", "skip"] = "once",
        grace: float = 60.0,
        timeout: float | None = None,
        retry_on: tuple[type[BaseException], ...] | None = None,
        max_attempts: int | None = None,
    ) -> Callable[[Callable[[], Awaitable[R]]], TaskFunction[[], R]]:
        """Declare an ``async def`` function of no arguments a task function called at every
        tick of `cron` (in `timezone`; the ``cron`` extra) or every `every` seconds: one task a
        tick whatever the number of workers (`AsyncTaskQueue.schedule`, ticked by every
        worker's `run`; `missed` and `grace` as there). `setup()` defines the schedule, named
        after the function. The other options are `task`'s."""
        check_timing(cron, every, timezone, missed, grace)  # where it is declared

        def declare(target: Callable[[], Awaitable[R]]) -> TaskFunction[[], R]:
            declared = self.task(
                name=name, queue=queue, timeout=timeout, retry_on=retry_on,
                max_attempts=max_attempts,
            )(target)  # fmt: skip
            self._periodic[declared.name] = {
                "cron": cron, "every": every, "timezone": timezone, "missed": missed,
                "grace": grace,
            }  # fmt: skip
            return declared

        return declare

    async def setup(self, queues: Sequence[str] | None = None) -> None:
        """Every queue's `setup()` (its indexes) and the schedules of the periodic functions:
        once at deploy time, or when a worker starts; idempotent."""
        chosen = queues if queues is not None else self.queues
        for name in chosen:
            await self.queue(name).setup()
        for function, options in self._periodic.items():
            declared = self.functions[function]
            if declared.queue in chosen:
                await self.queue(declared.queue).schedule(
                    function, payload={"args": [], "kwargs": {}}, function=function, **options
                )

    async def run(
        self,
        *,
        queues: Sequence[str] | None = None,
        concurrency: int = 1,
        batch_size: int = 1,
        poll_interval: float = 1.0,
        stop_when_empty: bool = False,
        stop_when_drained: bool = False,
        handle_signals: bool = False,
        give_up_after: float | None = None,
        worker_id: str | None = None,
    ) -> TaskRunSummary:
        """Run the tasks of every declared task function (of `queues` only, when given) with
        one budget of `concurrency` slots over all the queues. Each claim starts at the queue
        after the one claimed from last, so a flooded queue does not hold back a quiet one
        beyond one claim round. The rest is `AsyncTaskQueue.run`'s: leases and heartbeats,
        `batch_size`, wake-ups, `stop_when_empty` / `stop_when_drained`, `stop()` and
        `handle_signals`, `give_up_after`; a function's `timeout` is its handler time limit.
        Returns the totals over every queue."""
        from mongoq.jobs.worker import JobsWorker

        options = RunOptions.checked(
            concurrency=concurrency, poll_interval=poll_interval, stop_when_empty=stop_when_empty,
            stop_when_drained=stop_when_drained, give_up_after=give_up_after,
        )  # fmt: skip
        worker = JobsWorker(
            self, self._chosen(queues), batch_size=batch_size, worker_id=self._worker(worker_id)
        )
        loop = options.loop(worker.sources, name=worker.name)
        lease = min(queue.lease_ttl for queue in worker.queues)
        await self._run_loop(loop, handle_signals=handle_signals, lease=lease)
        return worker.summary

    def _chosen(self, queues: Sequence[str] | None) -> list[str]:
        known = self.queues
        if not known:
            raise InvalidInput("functions", "no task function is declared: @jobs.task first")
        if queues is None:
            return known
        if isinstance(queues, str):
            raise InvalidInput("queues", "must be a list of queue names, not one string")
        unknown = sorted(set(queues) - set(known))
        if unknown or not queues:
            raise InvalidInput(
                "queues", f"must name queues of declared functions ({', '.join(known)}); "
                f"got {', '.join(unknown) or 'none'}",
            )  # fmt: skip
        return sorted(set(queues))


def _check_queue_options(field: str, options: dict[str, Any]) -> None:
    """Options `AsyncTaskQueue` takes: a misspelt one is said here, not at the first defer."""
    known = set(inspect.signature(AsyncTaskQueue.__init__).parameters) - {"self", "db", "name"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidInput(field, f"{', '.join(unknown)}: not an option of AsyncTaskQueue "
                                  f"({', '.join(sorted(known))})")  # fmt: skip


def _default_name(function: Callable[..., Any]) -> str:
    # Not the module's path: a producer run as a script (``__main__``) and a worker that
    # imports the module must name the function alike.
    return str(getattr(function, "__qualname__", None) or getattr(function, "__name__", ""))
