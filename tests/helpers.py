"""Helpers shared by the task-queue tests.

Every helper is backend-neutral: the same tests run on the embedded backend and on a real server.
Reads go to the collection directly (not through the queue), so assertions see what is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import bson

from mongoq import AsyncTaskQueue, Task
from mongoq.testing import ManualClock, settle

#: The lease used by the tests' queues: short enough to reason about, heartbeats every 10 s.
LEASE_TTL = 30.0
QUEUE = "tasks"


async def new_queue(
    db: Any, clock: ManualClock, name: str = QUEUE, **options: Any
) -> AsyncTaskQueue:
    """A task queue on `db` driven by the test's clock, with the tests' lease, and its indexes
    (claims name their index: a real server refuses a hint to a missing one)."""
    options.setdefault("lease_ttl", LEASE_TTL)
    queue = AsyncTaskQueue(db, name, clock=clock, **options)
    await queue.ensure_indexes()
    return queue


async def claim_one(queue: AsyncTaskQueue, worker: str = "w", expect: Any = None) -> Task:
    """Claim a task that must be there (and be `expect`, when given)."""
    task = await queue.claim(worker)
    assert task is not None, "nothing was claimable"
    if expect is not None:
        assert task.id == expect, f"claimed {task.id!r}, expected {expect!r}"
    return task


def later(clock: ManualClock, seconds: float = 0) -> datetime:
    """The clock's instant `seconds` from now (what the queue stores for a due time or lease)."""
    return clock.now() + timedelta(seconds=seconds)


def utc(value: Any) -> Any:
    """`value` with every datetime in it made UTC-aware: backends differ in whether they return
    naive (UTC) or aware datetimes, and the clock's instants are aware."""
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if isinstance(value, dict):
        return {key: utc(item) for key, item in value.items()}
    if isinstance(value, list):
        return [utc(item) for item in value]
    return value


async def read(db: Any, task_id: Any, name: str = QUEUE) -> dict[str, Any] | None:
    """The stored document of a task, read straight from the collection."""
    doc = await db[name].find_one({"_id": task_id})
    return None if doc is None else utc(dict(doc))


async def read_all(db: Any, name: str = QUEUE) -> dict[Any, dict[str, Any]]:
    """Every stored task document, by id."""
    docs = await db[name].find({}).to_list(None)
    return {doc["_id"]: utc(dict(doc)) for doc in docs}


def encoded(doc: dict[str, Any] | None) -> bytes:
    """A document's BSON bytes: equal bytes mean the same fields, values and field order."""
    assert doc is not None
    return bson.encode(doc)


async def wait_for(predicate: Callable[[], bool], what: str, rounds: int = 200_000) -> None:
    """Let other tasks run until `predicate()` holds (no wall-clock wait: only event-loop turns).

    On the embedded backend one `settle()` is enough; against a real server, commands complete
    on I/O, so this keeps yielding until they have.
    """
    await settle()
    for _ in range(rounds):
        if predicate():
            return
        await settle(1)
    raise AssertionError(f"timed out waiting for {what}")
