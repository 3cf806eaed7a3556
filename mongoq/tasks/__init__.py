"""The task queue, `AsyncTaskQueue`: a task *is* a state document, claimed atomically, leased,
retried. It owns the collections ``{name}`` (one document per task), ``{name}_schedules`` and
``{name}_workers`` (the running `Jobs` workers' presences); their layout and every query sent
are in `mongoq.tasks.schema`, the values in `mongoq.tasks.models`. The face (set-up, puts,
claims, run) is `mongoq.tasks.queue`; the lease holder's calls and `TaskLease` are in
`mongoq.tasks.settles`, the operator calls in `mongoq.tasks.operators`, the schedules in
`mongoq.tasks.schedules`, the workers' presences in `mongoq.tasks.presence`, and the setting
aside of documents no worker can use in `mongoq.tasks.quarantine`."""

from mongoq.tasks.models import (
    NewTask,
    PutManyResult,
    PutOutcome,
    ReclaimResult,
    Schedule,
    Task,
    TaskPage,
    TaskRunSummary,
    TaskStats,
    TaskStatus,
)
from mongoq.tasks.queue import AsyncTaskQueue
from mongoq.tasks.settles import TaskLease

__all__ = [
    "AsyncTaskQueue",
    "NewTask",
    "PutManyResult",
    "PutOutcome",
    "ReclaimResult",
    "TaskRunSummary",
    "Schedule",
    "Task",
    "TaskLease",
    "TaskPage",
    "TaskStats",
    "TaskStatus",
]
