"""Task functions: an async function declared with `Jobs.task`, deferred by calling its
`defer` with the function's own arguments (typed from its signature), run by a `Jobs` worker.

A deferred call is a task of the function's queue (an `AsyncTaskQueue`) whose document holds
the function's name in ``function`` and the call's arguments in ``payload``
(``{"args": [...], "kwargs": {...}}``, and, when traced, the defer's trace context in
``trace``: `mongoq.jobs.tracing`); nothing of the queue's storage changes meaning.
Owns no collections.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

from mongoq._validation import check_payload
from mongoq.errors import InvalidInput, PermanentError
from mongoq.jobs.tracing import CARRIER
from mongoq.tasks.models import Task, TaskId

if TYPE_CHECKING:
    from mongoq.jobs.registry import Jobs

__all__ = ["Deferral", "TaskFunction", "arguments_of"]

P = ParamSpec("P")
R = TypeVar("R")


def arguments_of(task: Task) -> tuple[list[Any], dict[str, Any]]:
    """The positional and keyword arguments a task function's task was deferred with (beside
    them, the payload may hold its defer's trace context: `mongoq.jobs.tracing.CARRIER`)."""
    payload = task.payload
    if (
        not isinstance(payload, Mapping)
        or set(payload) - {CARRIER} != {"args", "kwargs"}
        or not isinstance(payload.get(CARRIER, {}), Mapping)
        or not isinstance(payload["args"], list)
        or not isinstance(payload["kwargs"], Mapping)
    ):
        raise PermanentError(f"task {task.id!r}: its payload holds no call of {task.function}")
    return list(payload["args"]), dict(payload["kwargs"])


@dataclass(frozen=True)
class Deferral(Generic[P, R]):
    """A task function with the options of one deferral: `TaskFunction.options` returns it."""

    function: TaskFunction[P, R]
    task_id: TaskId | None = None
    revision: str | int | None = None
    priority: int = 0
    delay: float = 0
    run_at: datetime | None = None

    async def defer(self, *args: P.args, **kwargs: P.kwargs) -> TaskId:
        """Put a task that calls the function with these arguments; returns its id (the one
        given, else a new random one). Each argument must be storable (BSON): one that is not
        is refused with `InvalidInput` naming it, before anything is written."""
        return await self.put(self.function.jobs, args, kwargs)

    async def put(self, jobs: Jobs, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TaskId:
        """`defer` on the database of `jobs` (the function's own `Jobs`, or one `like` it)."""
        payload = self.function.encode(args, kwargs)
        task_id = self.task_id if self.task_id is not None else uuid.uuid4().hex
        queue = jobs.queue(self.function.queue)
        put = partial(
            queue.put, task_id, revision=self.revision, priority=self.priority,
            delay=self.delay, run_at=self.run_at, function=self.function.name,
        )  # fmt: skip
        await jobs.tracing.send(queue.name, self.function.name, str(task_id), payload, put)
        return task_id


class TaskFunction(Generic[P, R]):
    """An async function registered as a task: `defer` puts a call of it in its queue, a
    worker (`Jobs.run`, ``mongoq worker``) runs it; calling it directly runs it here."""

    def __init__(
        self,
        jobs: Jobs,
        function: Callable[P, Awaitable[R]],
        *,
        name: str,
        queue: str,
        timeout: float | None,
        retry_on: tuple[type[BaseException], ...] | None,
        max_attempts: int | None,
    ) -> None:
        self.jobs = jobs
        self.function = function
        self.name = name
        self.queue = queue
        self.timeout = timeout
        self.retry_on = retry_on
        self.max_attempts = max_attempts
        self.signature = inspect.signature(function)
        self.__doc__ = function.__doc__
        self.__name__ = getattr(function, "__name__", name)

    def __repr__(self) -> str:
        return f"<task function {self.name!r} of queue {self.queue!r}>"

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the function here and now, as a plain call (no task, no queue)."""
        return await self.function(*args, **kwargs)

    async def defer(self, *args: P.args, **kwargs: P.kwargs) -> TaskId:
        """Put a task that calls the function with these arguments, due now, with a new
        random id; `options` sets the id (idempotent puts), revision, priority and timing."""
        return await Deferral(self).defer(*args, **kwargs)

    def options(
        self,
        *,
        task_id: TaskId | None = None,
        revision: str | int | None = None,
        priority: int = 0,
        delay: float = 0,
        run_at: datetime | None = None,
    ) -> Deferral[P, R]:
        """This function with options for one `defer`: ``f.options(task_id="welcome-42",
        run_at=when).defer(to="a@b.c")``. (They are not `defer`'s own keywords: those are the
        function's, and typed as its.) The options mean what `AsyncTaskQueue.put`'s do."""
        return Deferral(self, task_id, revision, priority, delay, run_at)

    async def wait(self, task_id: TaskId, *, timeout: float | None = None) -> R:  # noqa: ASYNC109
        """The result of the task `task_id` once it finished (`AsyncTaskQueue.wait`); a task
        that failed or was cancelled raises `MongoqError` with its last error."""
        return await self.jobs.wait(self, task_id, timeout=timeout)

    def encode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The stored call: the arguments bound to the signature (`InvalidInput` naming the
        first that does not fit, or is not storable)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise InvalidInput(f"{self.name}()", str(error)) from None
        for parameter, value in bound.arguments.items():
            check_payload(f"{self.name}({parameter}=)", value)
        if any(
            self.signature.parameters[p].kind is inspect.Parameter.VAR_POSITIONAL and v
            for p, v in bound.arguments.items()
        ):  # values for *args: everything before them goes by position too
            return {"args": list(bound.args), "kwargs": dict(bound.kwargs)}
        # By name wherever the signature allows: a task put before its function's parameters
        # were reordered still calls it right.
        positional: list[Any] = []
        named: dict[str, Any] = {}
        for parameter, value in bound.arguments.items():
            kind = self.signature.parameters[parameter].kind
            if kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[parameter] = value
        return {"args": positional, "kwargs": named}

    async def run(self, task: Task) -> R:
        """Run `task`'s call of this function: with `retry_on`, an exception of another kind
        fails the task at once; past its own `max_attempts` a failure is final too."""
        args, kwargs = arguments_of(task)
        try:
            return await self.function(*args, **kwargs)
        except Exception as error:
            final = self.final(error, task)
            if final is error:
                raise  # as it was raised: its own cause kept
            raise final from error

    def final(self, error: Exception, task: Task) -> Exception:
        """`error` as this function's policy has it: a `PermanentError` when it must not be
        retried (not one of `retry_on`, or the task's attempts reached `max_attempts`),
        else `error` itself (retried with the queue's backoff)."""
        if isinstance(error, PermanentError):
            return error
        if self.retry_on is not None and not isinstance(error, self.retry_on):
            return PermanentError(f"{type(error).__name__}: {error}")
        if self.max_attempts is not None and task.attempts >= self.max_attempts:
            return PermanentError(
                f"{type(error).__name__}: {error} (attempt {task.attempts} of {self.max_attempts})"
            )
        return error
