"""`JobsWorker`: one `WorkerLoop` over several task queues, running the tasks of the task
functions a `Jobs` declares. Each queue is a source of work (`AsyncTaskQueue.source`) that
claims only the functions the worker knows and keeps the worker's presence while it runs; the
loop rotates its claims over them (each starts at the queue after the last one claimed from).
Owns no collections.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any

from mongoq._validation import (
    MAX_BATCH,
    check_int,
)
from mongoq.errors import HandlerTimeout, PermanentError
from mongoq.runtime.handler import call_handler
from mongoq.tasks import Task, TaskRunSummary

if TYPE_CHECKING:
    from mongoq.clock import Clock
    from mongoq.jobs.functions import TaskFunction
    from mongoq.jobs.registry import Jobs

__all__ = ["JobsWorker"]

log = logging.getLogger("mongoq.jobs")


class JobsWorker:
    """One run of a `Jobs`' task functions over the queues `names`."""

    def __init__(self, jobs: Jobs, names: list[str], *, batch_size: int, worker_id: str) -> None:
        self.jobs = jobs
        self.batch_size = check_int("batch_size", batch_size, low=1, high=MAX_BATCH)
        self.worker_id = worker_id
        self.queues = [jobs.queue(name) for name in names]
        self.name = f"jobs:{','.join(queue.name for queue in self.queues)}"
        self.sources = [
            queue.source(self._call, worker_id=worker_id, batch_size=self.batch_size,
                         functions=jobs.functions_of(name))
            for queue, name in zip(self.queues, names, strict=True)
        ]  # fmt: skip

    @property
    def summary(self) -> TaskRunSummary:
        """The totals over every queue."""
        totals = TaskRunSummary()
        for source in self.sources:
            for field, count in vars(source.summary).items():
                setattr(totals, field, getattr(totals, field) + count)
        return totals

    async def _call(self, task: Task) -> Any:
        """Run `task` with its task function, under the function's own time limit, in a span
        of the call when tracing (`mongoq.jobs.tracing`)."""
        function = self.jobs.functions.get(task.function or "")
        if function is None:  # claimed by name: only a function removed since the claim
            raise PermanentError(f"no task function {task.function!r} in this worker")
        queue = self.jobs.queue(function.queue)
        return await self.jobs.tracing.process(
            task, function.name, queue.name, max_attempts=queue.max_attempts,
            worker=self.worker_id, call=partial(self._limited, function, task, queue.clock),
        )  # fmt: skip

    @staticmethod
    async def _limited(function: TaskFunction[Any, Any], task: Task, clock: Clock) -> Any:
        """`function`'s run of `task` under its time limit; a timeout goes through the
        function's retry policy as any failure does."""
        try:
            return await call_handler(partial(function.run, task), clock=clock,
                                      limit=function.timeout,
                                      name=f"task {task.id!r} ({function.name})")  # fmt: skip
        except HandlerTimeout as timeout:  # raised outside the call: the policy applies here
            final = function.final(timeout, task)
            if final is timeout:
                raise
            raise final from timeout
