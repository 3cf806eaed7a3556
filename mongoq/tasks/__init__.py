"""`AsyncTaskQueue` (seed 001): a task *is* a state document, claimed atomically, leased,
retried. The layout of its collection is in `mongoq.tasks.queue`'s docstring."""

from mongoq.tasks.queue import (
    AsyncTaskQueue,
    NewTask,
    PutManyResult,
    PutOutcome,
    ReclaimResult,
    RunSummary,
    Task,
    TaskLease,
    TaskQueueStats,
    TaskStatus,
)

__all__ = [
    "AsyncTaskQueue",
    "NewTask",
    "PutManyResult",
    "PutOutcome",
    "ReclaimResult",
    "RunSummary",
    "Task",
    "TaskLease",
    "TaskQueueStats",
    "TaskStatus",
]
