"""Task functions and the worker that runs them: `Jobs` declares ``async def`` functions as
tasks (``@jobs.task``), `TaskFunction.defer` enqueues a call (typed from the function's
signature), `Jobs.run` and ``mongoq worker`` run every declared function's tasks. Built on
`AsyncTaskQueue`: a call is a task document naming its function. Owns no collections."""

from __future__ import annotations

from mongoq.jobs.functions import Deferral, TaskFunction
from mongoq.jobs.registry import Jobs

__all__ = ["Deferral", "Jobs", "TaskFunction"]
