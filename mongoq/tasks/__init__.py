"""`AsyncTaskQueue` (seed 001): a task *is* a state document, claimed atomically, leased,
retried. Its values are in `mongoq.tasks.models`, the layout of its collection and every query
it sends in `mongoq.tasks.schema`, the algorithm in `mongoq.tasks.queue`."""

from mongoq.tasks.models import (
    NewTask,
    PutManyResult,
    PutOutcome,
    ReclaimResult,
    RunSummary,
    Schedule,
    Task,
    TaskPage,
    TaskQueueStats,
    TaskStatus,
)
from mongoq.tasks.queue import AsyncTaskQueue, TaskLease

__all__ = [
    "AsyncTaskQueue",
    "NewTask",
    "PutManyResult",
    "PutOutcome",
    "ReclaimResult",
    "RunSummary",
    "Schedule",
    "Task",
    "TaskLease",
    "TaskPage",
    "TaskQueueStats",
    "TaskStatus",
]
