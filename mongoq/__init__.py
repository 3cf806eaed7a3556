"""mongoq: durable work queues on MongoDB, asyncio-first.

Public surface: `connect` (with `close` and `supports_transactions`), `AsyncTaskQueue`,
`AsyncGroupTransport` and `AsyncOutbox` with its `OutboxDispatcher` (and their result types), the
clocks, the errors.
Testing tools are in `mongoq.testing`; the blocking facade is the separate `mongoq_sync` package.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, cast

from mongoq import _driver
from mongoq._version import __version__ as __version__
from mongoq.clock import Clock, ServerClock, SystemClock
from mongoq.errors import (
    HandlerAbandoned,
    HandlerTimeout,
    IndexesMissing,
    InvalidInput,
    LeaseLost,
    MongoqError,
    NotFound,
    PermanentError,
    ServerUnavailable,
    UnreadableDocument,
)
from mongoq.groups import (
    AsyncGroupTransport,
    DeadLetter,
    GroupInfo,
    GroupLease,
    GroupPage,
    GroupRunSummary,
    GroupStats,
    NewMessage,
)
from mongoq.jobs import Jobs, TaskFunction
from mongoq.outbox import (
    AsyncOutbox,
    Delivery,
    DeliveryContext,
    DeliveryInfo,
    Event,
    OutboxDispatcher,
    OutboxRunSummary,
    OutboxStats,
    PublishResult,
    PurgeResult,
)
from mongoq.tasks import (
    AsyncTaskQueue,
    NewTask,
    PutManyResult,
    ReclaimResult,
    Schedule,
    Task,
    TaskLease,
    TaskPage,
    TaskRunSummary,
    TaskStats,
)

__all__ = [
    "AsyncGroupTransport",
    "AsyncOutbox",
    "AsyncTaskQueue",
    "Clock",
    "Database",
    "DeadLetter",
    "Delivery",
    "DeliveryContext",
    "DeliveryInfo",
    "OutboxRunSummary",
    "Event",
    "GroupInfo",
    "GroupLease",
    "GroupPage",
    "GroupRunSummary",
    "GroupStats",
    "HandlerAbandoned",
    "HandlerTimeout",
    "IndexesMissing",
    "InvalidInput",
    "Jobs",
    "LeaseLost",
    "MongoqError",
    "NewMessage",
    "NewTask",
    "TaskFunction",
    "NotFound",
    "OutboxDispatcher",
    "OutboxStats",
    "PermanentError",
    "ServerUnavailable",
    "UnreadableDocument",
    "PublishResult",
    "PurgeResult",
    "PutManyResult",
    "ReclaimResult",
    "TaskRunSummary",
    "Schedule",
    "ServerClock",
    "SystemClock",
    "Task",
    "TaskLease",
    "TaskPage",
    "TaskStats",
    "close",
    "connect",
    "supports_transactions",
]


class Database(Protocol):
    """What `connect` returns: an async database handle of PyMongo async, Motor or the embedded
    backend, for the primitives. Its collections are the driver's own objects (typed `Any`:
    their APIs differ in details, which mongoq handles; see `mongoq._driver`)."""

    @property
    def name(self) -> str: ...

    @property
    def client(self) -> Any: ...

    def __getitem__(self, name: str) -> Any: ...

    def __getattr__(self, name: str) -> Any: ...


def connect(
    uri: str | None = None,
    database: str = "mongoq",
    *,
    driver: Literal["pymongo", "motor"] = "pymongo",
    timeout: float | None = _driver.DEFAULT_TIMEOUT,
) -> Database:
    """An async database handle for the primitives. Returns at once: the first call that
    needs the server connects.

    - `uri` absent and ``MONGOQ_URI`` unset, or ``"memory://"``: the embedded in-memory backend
      (no server needed; data lives as long as the process). ``MONGOQ_URI``, when set, is the
      URI of a call that gives none;
    - ``mongodb://`` / ``mongodb+srv://``: PyMongo's native async client (recommended), or Motor
      with ``driver="motor"``.

    `timeout` is how many seconds the first call waits for the server before it raises
    `ServerUnavailable`, naming the hosts and the wait (default 5; each call is a first one
    until one reaches the server). Later calls keep the driver's server selection timeout
    (``serverSelectionTimeoutMS``, 30 s unless the URI says otherwise), which rides out a
    replica set's election; past it they raise `ServerUnavailable` too. None: the first call
    waits as long as later ones. Clients are created with PyMongo's defaults (dates read back
    naive UTC on every backend). Every primitive also accepts a database you built yourself
    with either driver (no first-call bound then).
    """
    return cast(Database, _driver.connect(uri, database, driver=driver, timeout=timeout))


async def close(db: Any) -> None:
    """Close the client behind `db` (any driver's database handle, or `connect`'s)."""
    await _driver.close(db)


async def supports_transactions(db: Any) -> bool:
    """Whether `db` runs multi-document transactions, which `publish(..., session=s)` needs: a
    replica set (one node is enough) or a sharded cluster does; a standalone server and the
    embedded backend do not. Asked of the server once per client."""
    return await _driver.supports_transactions(db)
