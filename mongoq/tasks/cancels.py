"""Telling a running task's holder at once that its task was cancelled or removed, instead of at
its next renewal (a third of a lease later: five minutes at the default lease).

- In the same process, `cancel` and `remove` notify the task's key (`HeldWork.stop_key`),
  which every open lease of the task listens to (`mongoq.runtime.wakeups`); so does a change
  event of a task's end that a `wait` of this process hears (`changes.TASKS_ENDED`).
- On a replica set, a run loop's change stream (`changes.TASKS_DUE_OR_STOPPED`, the one that
  wakes it for new work) brings a cancel or a removal from any process, and notifies the key.
- Where there is none, `tell_cancelled` (the run loop's ``holders`` service) reads every
  poll interval which of the tasks this queue instance has held for at least that long were
  cancelled: one read a poll, only while such tasks run (a task shorter than a poll costs
  nothing; its settle is refused anyway, the task being cancelled). A task cancelled within
  its first poll interval is found at the end of its second at the latest.

Told, the lease renews at once (`KeepAlive.renew_now`); the renewal finds the task gone and
cancels the handler (`mongoq.runtime.handler`). `HeldWork` is what a queue instance holds (its
open leases, its runs' batches) and the keys it is told through: the one place that state
lives. Reads the queue's collection (``{name}``, see
`mongoq.tasks.schema`); owns none.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from mongoq.clock import Clock
from mongoq.runtime import wakeups
from mongoq.tasks.models import Task, TaskId

if TYPE_CHECKING:
    from mongoq.tasks.settles import TaskLease

__all__ = ["HeldWork", "tell_cancelled"]

log = logging.getLogger("mongoq.tasks")


class HeldWork:
    """What one queue instance holds now, and how its holders are told to renew at once: the
    open `leased` blocks (by lease token), the batches its runs hold (since when), and the
    stop keys they listen under (`base`: the queue's ``tasks.stop`` key)."""

    def __init__(self, base: wakeups.Key) -> None:
        self._base = base
        self._leases: dict[str, TaskLease] = {}
        self._batches: dict[int, tuple[list[Task], datetime]] = {}

    def stop_key(self, task_id: TaskId) -> wakeups.Key:
        """What the holders of `task_id` listen under."""
        primitive, database, name = self._base
        return primitive, database, f"{name}\x00{task_id!r}"

    def tell(self, task_ids: Iterable[TaskId]) -> None:
        """Tell this process's holders of `task_ids` to renew now: the tasks may have ended."""
        for task_id in task_ids:
            wakeups.notify(self.stop_key(task_id))

    def add_lease(self, token: str, lease: TaskLease) -> None:
        self._leases[token] = lease

    def lease(self, token: str | None) -> TaskLease | None:
        """The open lease of `token`, if this instance holds one."""
        return self._leases.get(token or "")

    def drop_lease(self, token: str | None) -> None:
        self._leases.pop(token or "", None)

    @contextlib.contextmanager
    def batch(self, tasks: Sequence[Task], since: datetime) -> Iterator[None]:
        """`tasks` held by a run's batch while the block runs."""
        key = id(tasks)
        self._batches[key] = (list(tasks), since)
        try:
            yield
        finally:
            self._batches.pop(key, None)

    def held_since(self, cutoff: datetime) -> list[Task]:
        """The tasks held since `cutoff` or before (a lease's handler started, a batch)."""
        held = [lease.task for lease in list(self._leases.values())
                if lease.held_since is not None and lease.held_since <= cutoff]  # fmt: skip
        held += [task for tasks, since in list(self._batches.values()) if since <= cutoff
                 for task in tasks]  # fmt: skip
        return held


async def tell_cancelled(
    held: HeldWork,
    clock: Clock,
    cancelled_of: Callable[[Sequence[Task]], Awaitable[set[TaskId]]],
    held_for: float,
) -> None:
    """One round of the run loop's ``holders`` service (every poll interval): which of the
    tasks held for `held_for` seconds or more were cancelled (one read, `cancelled_of`, only
    when some are), their holders told. A read that fails goes to the loop's backoff; the
    renewal still finds out, later."""
    tasks = held.held_since(clock.now() - timedelta(seconds=held_for))
    if tasks:
        held.tell(await cancelled_of(tasks))
