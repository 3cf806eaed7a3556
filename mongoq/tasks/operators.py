"""The task queue's operator calls, mixed into `AsyncTaskQueue`: one task by id, listings
with a cursor, requeue (one or every failed task), remove, purge of finished tasks, the
clean-up after crashed workers, and the stats. They read and write the queue's collection (see
`mongoq.tasks.schema`) through its filters, and `stats` reads which task functions the running
workers announce (`mongoq.tasks.presence`); they own no collection.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Protocol

import anyio
from pymongo import ReturnDocument

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import (
    check_batch,
    check_id,
    check_int,
    check_interval,
    check_seconds,
    check_timeout,
    check_window,
    id_token,
    parse_id_token,
)
from mongoq.clock import Clock, stored_instant, to_millis
from mongoq.errors import InvalidInput, NotFound
from mongoq.runtime import changes, wakeups
from mongoq.tasks import cancels, quarantine, schema
from mongoq.tasks.models import (
    CANCELLED,
    DONE,
    FAILED,
    PROCESSING,
    STATUSES,
    TOMBSTONE,
    ReclaimResult,
    Task,
    TaskId,
    TaskPage,
    TaskStats,
    TaskStatus,
    read_task,
)
from mongoq.tasks.presence import Presence

__all__ = ["TaskOperators"]

log = logging.getLogger("mongoq.tasks")

#: The statuses `wait` returns on: a task in one of them changes no more by itself.
FINISHED = frozenset({DONE, FAILED, CANCELLED, TOMBSTONE})
#: The most tasks one `list_tasks` page returns.
MAX_PAGE = 1000
#: The due tasks read, at most (the oldest), to count those waiting for a task function no
#: worker runs: with more due, the counts are lower bounds.
UNKNOWN_READ = 1000


class _Queue(Protocol):
    """What the operator calls use of the queue they are mixed into."""

    collection: Any
    db: Any
    max_attempts: int
    name: str
    clock: Clock
    _presence: Presence
    _held: cancels.HeldWork

    async def _now(self) -> datetime: ...

    async def _due_by_function(self, now: datetime) -> dict[str, int]: ...

    async def _due_not_of(
        self, now: datetime, functions: Iterable[str]
    ) -> tuple[dict[str, int], bool]: ...

    def _finished(self, task_ids: Iterable[TaskId]) -> None: ...

    def _finished_key(self, task_id: TaskId) -> wakeups.Key: ...

    def _route_end(self, event: Mapping[str, Any]) -> None: ...


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_CURSOR = re.compile(r"(-?[0-9]{1,16}):(.*)", re.ASCII | re.DOTALL)
_PROBLEM = "must be the `next` of an earlier page"


def _cursor(task: Task) -> str:
    """``<ms>:<i|s>:<id>``: the listed task's ``updated_at`` in whole milliseconds since the
    epoch (integer arithmetic: a float would be off by one for some instants) and its id."""
    assert task.updated_at is not None
    at = (to_millis(task.updated_at) - _EPOCH) // timedelta(milliseconds=1)
    return f"{at}:{id_token(task.id)}"


def _parse_cursor(cursor: Any) -> tuple[datetime, TaskId]:
    match = _CURSOR.fullmatch(cursor) if isinstance(cursor, str) else None
    if match is None:
        raise InvalidInput("after", _PROBLEM)
    millis, token = match.groups()
    try:
        at = _EPOCH + timedelta(milliseconds=int(millis))
    except OverflowError:
        raise InvalidInput("after", _PROBLEM) from None
    return at, parse_id_token("after", token, _PROBLEM)


@names_unreachable_server
class TaskOperators:
    """`list_tasks`, `get`, `requeue`, `requeue_failed`, `remove`, `purge`, `reclaim_expired`,
    `count_finished` and `stats` of `AsyncTaskQueue`."""

    async def list_tasks(
        self: _Queue,
        status: TaskStatus | None = None,
        *,
        limit: int = 100,
        after: str | None = None,
        payloads: bool = True,
    ) -> TaskPage:
        """Tasks in `status` (every status when None), least recently changed first, the id
        breaking ties; at most `limit` (up to 1,000) a page. Pass the page's `next` as `after`
        for the following page: the order is stable, so a task is listed once unless it changes
        between two pages (then it moves to the end). One indexed query a page. With
        `payloads=False` the page reads neither payloads nor results (both None in it): a
        listing of many tasks whose payloads are large stays small. A task whose stored fields
        have the wrong type is listed with `Task.unreadable` saying which."""
        statuses = STATUSES if status is None else (_check_status("status", status),)
        check_int("limit", limit, low=1, high=MAX_PAGE)
        cursor = None if after is None else _parse_cursor(after)
        docs = await _driver.find_list(
            self.collection, schema.tasks_listed(statuses, cursor), sort=schema.LIST_ORDER,
            limit=limit + 1, hint=schema.STATUS_UPDATED.name,
            projection=None if payloads else dict(schema.WITHOUT_PAYLOADS),
        )  # fmt: skip
        tasks = [read_task(doc) for doc in docs[:limit]]
        more = len(docs) > limit
        return TaskPage(tasks, _cursor(tasks[-1]) if more else None)

    async def requeue_failed(self: _Queue, task_ids: Iterable[TaskId] | None = None) -> int:
        """Operator: put every ``failed`` task (or those of `task_ids` that are failed) back to
        pending with fresh attempts, due now; returns how many (one command)."""
        ids = None
        if task_ids is not None:
            ids = [
                check_id(f"task_ids[{i}]", t)
                for i, t in enumerate(check_batch("task_ids", task_ids))
            ]
        now = await self._now()
        result = await self.collection.update_many(
            schema.tasks_failed(ids), schema.task_requeuing(now)
        )
        if result.modified_count:
            log.info("requeued %d failed task(s)", result.modified_count)
        return int(result.modified_count)

    async def cancel(self: _Queue, task_id: TaskId) -> bool:
        """End a pending or running task ``cancelled`` (one command); False, and no change, if
        the task is finished already or does not exist.

        A running task is cancelled in the database at once, and its holder is told: at once
        in this process, by its worker's change stream on a replica set, and within a poll
        interval of its worker otherwise (two, for a task cancelled in its first;
        `mongoq.tasks.cancels`); its renewal then finds the task gone, its handler is
        cancelled, and no settle of that claim takes effect any more. A handler that finishes
        before that finds its completion refused (the task stays cancelled). A put with a new
        revision makes a cancelled task pending again, as for a done or failed one.
        """
        task_id = check_id("task_id", task_id)
        now = await self._now()
        before = await self.collection.find_one_and_update(
            schema.task_cancellable(task_id), schema.task_cancelling(now),
            projection={"status": 1}, return_document=ReturnDocument.BEFORE,
        )  # fmt: skip
        if before is None:
            return False
        self._finished([task_id])
        running = before.get("status") == PROCESSING
        if running:
            self._held.tell([task_id])
        log.info(
            "cancelled task %r%s", task_id, " (running: its holder is told)" if running else "",
            extra={"mongoq_primitive": "tasks", "mongoq_queue": self.name,
                   "mongoq_item": str(task_id), "mongoq_outcome": "cancelled"},
        )  # fmt: skip
        return True

    async def purge(self: _Queue, status: TaskStatus, older_than: float) -> int:
        """Operator: delete the tasks in a finished `status` (``done``, ``failed``,
        ``cancelled``, ``tombstone``) that last changed more than `older_than` seconds ago;
        returns how many.
        For retention without a command, set `retain_done` / `retain_failed` on the queue."""
        if status not in schema.PURGEABLE:
            raise InvalidInput("status", f"must be one of {', '.join(schema.PURGEABLE)} (finished)")
        seconds = check_seconds("older_than", older_than)
        now = await self._now()
        result = await self.collection.delete_many(
            schema.tasks_purgeable(status, now - timedelta(seconds=seconds))
        )
        if result.deleted_count:
            log.info("purged %d %s task(s)", result.deleted_count, status)
        return int(result.deleted_count)

    async def reclaim_expired(self: _Queue) -> ReclaimResult:
        """Clean up after crashed workers (two commands, in this order).

        First bury expired tasks whose attempts are used up (``failed``), then return the other
        expired ones to pending. Burying first means an exhausted task is never, even briefly,
        pending. Claims take expired tasks over by themselves; this keeps the queue's state and
        statistics honest when no worker is claiming. An expired task whose ``attempts`` is no
        number (a hand edit), which no claim can take over, is buried too, with an error that
        says so (and one read more, only then, names it in the log).
        """
        now = await self._now()
        buried = await self.collection.update_many(
            schema.task_expired_exhausted(now, self.max_attempts), schema.task_burying(now)
        )
        requeued = await self.collection.update_many(
            schema.task_expired_retryable(now, self.max_attempts), schema.task_reclaiming(now)
        )
        if buried.modified_count:  # given up: the attempts ran out with crashed workers
            count = buried.modified_count - await quarantine.log_buried(self, now)
            fields = {"mongoq_primitive": "tasks", "mongoq_queue": self.name,
                      "mongoq_outcome": "failed", "mongoq_count": count}  # fmt: skip
            if count:
                log.warning("%d task(s) failed: their lease expired on the last attempt", count,
                            extra=fields)  # fmt: skip
        if requeued.modified_count:
            log.info("requeued %d task(s) whose lease expired", requeued.modified_count)
        return ReclaimResult(buried.modified_count, requeued.modified_count)

    async def get(self: _Queue, task_id: TaskId) -> Task | None:
        """The task's current document, or None."""
        doc = await self.collection.find_one(schema.task_by_id(check_id("task_id", task_id)))
        return None if doc is None else read_task(doc)

    async def requeue(self: _Queue, task_id: TaskId) -> bool:
        """Operator: put a ``failed`` task back to pending with fresh attempts."""
        now = await self._now()
        result = await self.collection.update_one(
            schema.task_failed(check_id("task_id", task_id)), schema.task_requeuing(now)
        )
        return bool(result.matched_count == 1)

    async def remove(self: _Queue, task_id: TaskId) -> bool:
        """Tombstone a task: it is never claimed again (a holder loses it) and the TTL index
        deletes it after `tombstone_ttl`. A put with a new revision revives it."""
        now = await self._now()
        task_id = check_id("task_id", task_id)
        result = await self.collection.update_one(
            schema.task_removable(task_id), schema.task_removing(now)
        )
        if result.matched_count != 1:
            return False
        self._finished([task_id])
        self._held.tell([task_id])
        return True

    def _route_end(self: _Queue, event: Mapping[str, Any]) -> None:
        """A change stream's event of a task's end: tell this process's waits for it."""
        key = event.get("documentKey") or {}
        if "_id" in key:
            self._finished([key["_id"]])
            self._held.tell([key["_id"]])  # (a holder's own end: no-op)

    # The timeout runs on the queue's clock (a test's ManualClock), which anyio's cannot do.
    async def wait(
        self: _Queue,
        task_id: TaskId,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
        poll_interval: float = 1.0,
    ) -> Task:
        """The task once it has finished (``done``, ``failed``, ``cancelled``, or removed:
        ``tombstone``); `TimeoutError` if it has not within `timeout` seconds of the queue's
        clock (None: no limit). `NotFound` at once for a task the queue does not have (never
        put, or its document deleted: a purge, an expired tombstone), and at the next read for
        one deleted meanwhile: it can never finish. Put the task before waiting for it.

        One read, then one more each time the task's end is heard of: at once from a worker
        of this process, through a change stream on a replica set (one per queue and process,
        shared by every wait: streams hold a pooled connection each), and at every
        `poll_interval` seconds otherwise: never a tight poll."""
        task_id = check_id("task_id", task_id)
        limit = check_timeout("timeout", timeout)
        poll = check_interval("poll_interval", poll_interval)
        now = await self._now()
        deadline = None if limit is None else now + timedelta(seconds=limit)
        ended = anyio.Event()

        def wake() -> None:
            ended.set()

        finished: Task | None = None
        missing = False
        async with anyio.create_task_group() as group:
            # On a replica set the ends of this queue's tasks in any process come through one
            # change stream this process shares among its waits (told by task id).
            group.start_soon(partial(
                changes.share, wakeups.key_of("tasks.ended", self.db, self.name), self.collection,
                changes.TASKS_ENDED, self._route_end, clock=self.clock, retry=poll,
                name=f"waits on {self.name}",
            ))  # fmt: skip
            with wakeups.listen(self._finished_key(task_id), wake):
                while True:
                    ended = anyio.Event()  # before the read: an end told during it counts
                    doc = await self.collection.find_one(schema.task_by_id(task_id))
                    if doc is None:
                        missing = True
                        break
                    task = read_task(doc)
                    if task.status in FINISHED:
                        finished = task
                        break
                    now = await self._now()
                    if deadline is not None and now >= deadline:
                        break
                    until = now + timedelta(seconds=poll)
                    await wakeups.sleep_until_woken(
                        self.clock, until if deadline is None else min(until, deadline), ended
                    )
            group.cancel_scope.cancel()  # its part in the stream
        # Raised out here: inside, the task group would wrap them.
        if missing:
            raise NotFound(f"no task {task_id!r} in the queue {self.name!r}")
        if finished is None:
            raise TimeoutError(f"task {task_id!r} did not finish within {limit} s")
        return finished

    async def count_finished(self: _Queue, since: datetime, until: datetime | None = None) -> int:
        """How many tasks finished (done, failed or cancelled) at or after `since` and
        before `until` (None: up to now) and are still stored: a throughput that a purge or
        a retention TTL of older tasks leaves alone (one indexed count; the dashboard's
        chart, whose consecutive windows ``[since, until)`` count each task once)."""
        since, until = check_window(since, until)
        return int(
            await self.collection.count_documents(schema.tasks_finished_between(since, until))
        )

    async def stats(self: _Queue) -> TaskStats:
        """Counts per status, due, expired, the oldest due age, and the due tasks waiting for a
        task function no running worker runs (`TaskStats`): ten indexed commands (a count per
        status, due, expired, the oldest due task, the live workers' functions), and one
        aggregation of the `UNKNOWN_READ` oldest due tasks at most when some are due and a
        worker is live."""
        now = await self._now()
        count = self.collection.count_documents
        counts: dict[str, int] = {
            status: await count(schema.task_in_status(status)) for status in STATUSES
        }
        due = await count(schema.task_due(now))
        expired = await count(schema.task_expired(now))
        oldest = await _driver.find_list(
            self.collection,
            schema.task_due(now),
            sort=schema.DUE_ORDER,
            limit=1,
            projection={"lease_until": 1},
        )
        oldest_due = stored_instant(oldest[0]["lease_until"]) if oldest else None
        age = (now - oldest_due).total_seconds() if oldest_due is not None else None
        # Read whether or not anything is due: the cost stays the same whatever the queue holds.
        known = await self._presence.functions(now)
        unknown: dict[str, int] = {}
        if known is not None and due:
            unknown, _ = await self._due_not_of(now, known)
        return TaskStats(counts, due, expired, age, unknown)

    async def _due_not_of(
        self: _Queue, now: datetime, functions: Iterable[str]
    ) -> tuple[dict[str, int], bool]:
        """The due tasks none of `functions` runs, by task function (``""``: plain tasks),
        counted among the `UNKNOWN_READ` oldest due; and whether more were due than read (the
        counts are then lower bounds)."""
        counts = await self._due_by_function(now)
        runs = set(functions)
        waiting = {name: n for name, n in counts.items() if name not in runs}
        return waiting, sum(counts.values()) >= UNKNOWN_READ

    async def _due_by_function(self: _Queue, now: datetime) -> dict[str, int]:
        """The oldest due tasks, `UNKNOWN_READ` at most, counted by task function (``""``:
        plain tasks): one aggregation over the ``status_lease`` range, in its order. Read
        whatever their function, then filtered: a filter on the function would be applied
        past the index, reading every due task of a busy queue to find a few. The tasks no
        worker claims are the oldest due ones, so the first read finds them."""
        rows = await _driver.aggregate_list(
            self.collection,
            [{"$match": schema.task_due(now)}, {"$sort": dict(schema.DUE_ORDER)},
             {"$limit": UNKNOWN_READ}, {"$group": {"_id": "$function", "n": {"$sum": 1}}}],
            hint=schema.STATUS_LEASE.name,
        )  # fmt: skip
        return {row["_id"] or "": int(row["n"]) for row in rows}


def _check_status(field: str, status: Any) -> TaskStatus:
    if status not in STATUSES:
        raise InvalidInput(field, f"must be one of {', '.join(STATUSES)}, got {status!r}")
    return status  # type: ignore[no-any-return]
