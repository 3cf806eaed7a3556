"""mongoq: durable work queues on MongoDB, asyncio-first.

Public surface: `connect`, `AsyncTaskQueue`, `AsyncGroupTransport` and `AsyncOutbox` with its
`OutboxDispatcher` (and their result types), the clocks, the errors.
Testing tools are in `mongoq.testing`; the blocking facade is the separate `mongoq_sync` package.
"""

from __future__ import annotations

from typing import Any

from mongoq import _driver
from mongoq.clock import Clock, ServerClock, SystemClock
from mongoq.errors import IndexesMissing, InvalidInput, LeaseLost, MongoqError, PermanentError
from mongoq.groups import (
    AsyncGroupTransport,
    DeadLetter,
    GroupLease,
    GroupRunSummary,
    GroupStats,
    NewMessage,
)
from mongoq.outbox import (
    AsyncOutbox,
    Delivery,
    DeliveryContext,
    DeliveryInfo,
    DispatchSummary,
    Event,
    OutboxDispatcher,
    OutboxStatistics,
    PublishResult,
    PurgeResult,
)
from mongoq.tasks import (
    AsyncTaskQueue,
    NewTask,
    PutManyResult,
    ReclaimResult,
    RunSummary,
    Task,
    TaskLease,
    TaskQueueStats,
)

__all__ = [
    "AsyncGroupTransport",
    "AsyncOutbox",
    "AsyncTaskQueue",
    "Clock",
    "DeadLetter",
    "Delivery",
    "DeliveryContext",
    "DeliveryInfo",
    "DispatchSummary",
    "Event",
    "GroupLease",
    "GroupRunSummary",
    "GroupStats",
    "IndexesMissing",
    "InvalidInput",
    "LeaseLost",
    "MongoqError",
    "NewMessage",
    "NewTask",
    "OutboxDispatcher",
    "OutboxStatistics",
    "PermanentError",
    "PublishResult",
    "PurgeResult",
    "PutManyResult",
    "ReclaimResult",
    "RunSummary",
    "ServerClock",
    "SystemClock",
    "Task",
    "TaskLease",
    "TaskQueueStats",
    "connect",
]

__version__ = "0.1.0"


def connect(uri: str | None = None, database: str = "mongoq", *, driver: str = "pymongo") -> Any:
    """An async database handle for the primitives.

    - `uri` absent (and ``MONGOQ_URI`` unset) or ``"memory://"``: the embedded in-memory backend
      (no server needed; data lives as long as the process);
    - ``mongodb://`` / ``mongodb+srv://``: PyMongo's native async client (recommended), or Motor
      with ``driver="motor"``.
    Clients are created with PyMongo's defaults (dates read back naive UTC on every backend).
    Every primitive also accepts a database you built yourself with either driver.
    """
    return _driver.connect(uri, database, driver=driver)
