"""Telling a running task's holder at once that its task was cancelled or removed, instead of at
its next renewal (a third of a lease later: five minutes at the default lease).

- In the same process, `cancel` and `remove` notify the task's key (`stop_key`), which every
  open lease of the task listens to (`mongoq.runtime.wakeups`); so does a change event of a
  task's end that a `wait` of this process hears (`changes.TASKS_ENDED`).
- On a replica set, a run loop's change stream (`changes.TASKS_DUE_OR_STOPPED`, the one that
  wakes it for new work) brings a cancel or a removal from any process, and notifies the key.
- Where there is none, `tell_cancelled` (the run loop's ``holders`` service) reads every
  poll interval which of the tasks this queue instance has held for at least that long were
  cancelled: one read a poll, only while such tasks run (a task shorter than a poll costs
  nothing; its settle is refused anyway, the task being cancelled). A task cancelled within
  its first poll interval is found at the end of its second at the latest.

Told, the lease renews at once (`KeepAlive.renew_now`); the renewal finds the task gone and
cancels the handler (`mongoq.runtime.handler`). Reads the queue's collection (``{name}``, see
`mongoq.tasks.schema`); owns none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from mongoq.clock import Clock
from mongoq.runtime import wakeups
from mongoq.tasks.models import Task, TaskId

__all__ = ["Held", "stop_key", "tell_cancelled", "tell_holders"]

log = logging.getLogger("mongoq.tasks")


class _Lease(Protocol):
    task: Task

    @property
    def held_since(self) -> Any: ...


@dataclass(eq=False)
class Held:
    """The tasks of a batch a run holds, since when (`TaskBatch.told`)."""

    tasks: list[Task]
    since: datetime


class _Queue(Protocol):
    clock: Clock
    _leases: Any
    _batches: set[Held]
    _stop_base: wakeups.Key

    async def _cancelled_of(self, tasks: Sequence[Task]) -> set[TaskId]: ...


def stop_key(base: wakeups.Key, task_id: TaskId) -> wakeups.Key:
    """What the leases of `task_id` listen under (`base`: the queue's ``tasks.stop`` key)."""
    primitive, database, name = base
    return primitive, database, f"{name}\x00{task_id!r}"


def tell_holders(base: wakeups.Key, task_ids: Iterable[TaskId]) -> None:
    """Tell this process's holders of `task_ids` to renew now: the tasks may have ended."""
    for task_id in task_ids:
        wakeups.notify(stop_key(base, task_id))


async def tell_cancelled(queue: _Queue, held_for: float) -> None:
    """One round of the run loop's ``holders`` service (every poll interval): which of the
    tasks held for `held_for` seconds or more were cancelled (one read, only when some are),
    their holders told. A read that fails goes to the loop's backoff; the renewal still finds
    out, later."""
    cutoff = queue.clock.now() - timedelta(seconds=held_for)
    held = [lease.task for lease in list(queue._leases.values())
            if lease.held_since is not None and lease.held_since <= cutoff]  # fmt: skip
    held += [task for batch in list(queue._batches) if batch.since <= cutoff
             for task in batch.tasks]  # fmt: skip
    if held:
        tell_holders(queue._stop_base, await queue._cancelled_of(held))
