"""`AsyncTaskQueue`: a task *is* a state document, claimed by one atomic `find_one_and_update`,
leased, retried; and `TaskLease`, the holder's side of a claimed task. The queue owns one
collection, ``{name}``, one document per task: its layout, its indexes and every filter and
update sent here are in `mongoq.tasks.schema`.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import anyio
from pymongo import ReturnDocument

from mongoq import _driver, registry
from mongoq._indexes import create_indexes
from mongoq._validation import (
    MAX_BATCH,
    check_async_handler,
    check_batch,
    check_int,
    check_name,
    check_seconds,
    check_stop_when,
    check_timeout,
)
from mongoq.clock import Clock, ServerClock, stored_instant
from mongoq.errors import InvalidInput, LeaseLost, PermanentError
from mongoq.runtime import changes, wakeups
from mongoq.runtime import lease as leases
from mongoq.runtime.batch import run_batch
from mongoq.runtime.candidates import take_candidates
from mongoq.runtime.events import Tally, report_start_delay
from mongoq.runtime.handler import call_handler
from mongoq.runtime.keepalive import KeepAlive
from mongoq.runtime.loop import WORKER_STOPPED, WorkerHost, WorkerLoop
from mongoq.runtime.report import Attempt, error_text, log_attempt_end
from mongoq.tasks import schema
from mongoq.tasks.batch import TaskBatch
from mongoq.tasks.models import (
    NewTask,
    PutManyResult,
    PutOutcome,
    RunSummary,
    Task,
    TaskId,
    check_new_task,
    check_new_tasks,
    check_result,
)
from mongoq.tasks.operators import TaskOperators
from mongoq.tasks.schedules import Scheduler, TaskSchedules

__all__ = ["AsyncTaskQueue", "TaskLease"]

log = logging.getLogger("mongoq.tasks")

NOT_AN_ATTEMPT_DELAY = 5.0


def _retention(field: str, seconds: float | None) -> int | None:
    """A retention setting: None (keep forever) or whole seconds, at least one."""
    return None if seconds is None else max(1, int(check_seconds(field, seconds, positive=True)))


def _fence(task: Task) -> dict[str, Any]:
    """`task`'s fence (`schema.task_held`); refuses anything `claim` did not return."""
    if not isinstance(task, Task) or task.lease_token is None or task.worker_id is None:
        raise InvalidInput("task", "must be a Task returned by claim()")
    return schema.task_held(task)


@dataclass(eq=False)
class TaskLease:
    """The holder's side of a claimed task inside ``async with queue.leased(task)``.

    `lost` turns True when a heartbeat finds the task taken over (or removed); from then on
    nothing the holder does changes the task. `outcome` says how the lease ended: completed,
    retried, released, failed, lost, or unknown (a settle whose reply was lost).
    """

    queue: AsyncTaskQueue
    task: Task
    outcome: str | None = None
    #: a renewal found the task cancelled (`AsyncTaskQueue.cancel`); `lost` is True too
    cancelled: bool = False
    _keepalive: KeepAlive | None = field(default=None, repr=False)
    _abandoned: bool = field(default=False, repr=False)

    @property
    def lost(self) -> bool:
        return self._keepalive is not None and self._keepalive.lost

    @property
    def heartbeats(self) -> int:
        return 0 if self._keepalive is None else self._keepalive.renewals

    @property
    def settled(self) -> bool:
        return self.outcome not in (None, "unknown")

    async def heartbeat(self) -> bool:
        """Extend the lease now (the background heartbeat does this by itself)."""
        return await self.queue.heartbeat(self.task)

    async def complete(self, result: Any = None) -> bool:
        """Mark the task ``done`` with `result`; False if it is no longer held."""
        return await self.queue.complete(self.task, result)

    async def release_for_retry(self, error: BaseException | str | None = None) -> bool:
        """Back to pending after a backoff (failed once attempts are used up)."""
        return await self.queue.release_for_retry(self.task, error)

    async def release_not_an_attempt(self, delay: float | None = None) -> bool:
        """Back to pending without counting this claim as an attempt."""
        return await self.queue.release_not_an_attempt(self.task, delay)

    async def fail(self, error: BaseException | str | None = None) -> bool:
        """Mark the task ``failed`` now."""
        return await self.queue.fail(self.task, error)

    def _guard(self) -> anyio.CancelScope | None:
        """A scope the heartbeat cancels if it finds the task lost (inside the block)."""
        return None if self._keepalive is None else self._keepalive.guard()

    async def _renew(self) -> bool | None:
        if self.settled:
            return None
        held = await self.queue.heartbeat(self.task)
        if not held and not self.settled:
            # Lost: taken over, or cancelled (one read, only then, tells which).
            self.cancelled = await self.queue._is_cancelled(self.task)
        return None if self.settled else held

    def _abandon(self) -> None:
        """A settle went unanswered: the exit settles nothing more (it would complete the task
        without its result); the lease expires and the task runs again."""
        self.outcome = "unknown"
        self._abandoned = True

    async def _settle_on_exit(self, exc: BaseException | None) -> None:
        """What the exit of the block does when it left the task unsettled (see `leased`)."""
        if self.settled or self._abandoned:
            return
        lost = LeaseLost(
            f"task {self.task.id!r} was cancelled; the block's outcome was not recorded"
            if self.cancelled
            else f"task {self.task.id!r} is no longer held (taken over, removed, or re-put with "
            "a new revision); the block's outcome was not recorded"
        )
        if self.lost:
            if self.outcome != "unknown":  # a settle without an answer may have applied
                self.outcome = "cancelled" if self.cancelled else "lost"
            if exc is None:
                raise lost
            return
        if exc is None:
            if not await self.queue.complete(self.task):
                raise lost
            return
        try:
            if isinstance(exc, PermanentError):
                await self.queue.fail(self.task, exc)
            elif isinstance(exc, anyio.get_cancelled_exc_class()):
                # Counted and retried like a failure, but its traceback says nothing of the task.
                await self.queue.release_for_retry(self.task, WORKER_STOPPED)
            else:  # any other exception: counted, retried with backoff
                await self.queue.release_for_retry(self.task, exc)
        except _driver.DRIVER_ERRORS as settle_error:
            # The block's own exception is what the caller needs to see; the lease expiring
            # makes the task claimable again.
            log.warning("could not release %r after %r: %s", self.task.id, exc, settle_error)

    async def __aenter__(self) -> TaskLease:
        interval = self.queue.lease_ttl / 3
        expires = self.task.lease_until or self.queue.clock.now()
        self._keepalive = KeepAlive(
            clock=self.queue.clock,
            interval=interval,
            renew=self._renew,
            first_at=expires - timedelta(seconds=2 * interval),
            name=f"task {self.task.id!r}",
        )
        await self._keepalive.__aenter__()
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            assert self._keepalive is not None
            await self._keepalive.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self._settle_on_exit(exc)
                finally:
                    self.queue._leases.pop(self.task.lease_token or "", None)


class AsyncTaskQueue(TaskOperators, TaskSchedules, WorkerHost):
    """A durable task queue in one MongoDB collection (its layout: `mongoq.tasks.schema`).

    Guarantees: a task has at most one live holder (claims are one atomic command; every settle
    is fenced on the claim's token); a holder that lost its task changes nothing and is told
    (``False`` or `LeaseLost`); a crash at any point leaves every task claimable again after at
    most one `lease_ttl`; a task that fails or crashes `max_attempts` times ends ``failed``.
    Delivery is at least once: handlers must be idempotent.
    """

    def __init__(
        self,
        db: Any,
        name: str,
        *,
        max_attempts: int = 5,
        lease_ttl: float = 900,
        backoff_base: float = 60,
        backoff_cap: float = 3600,
        tombstone_ttl: float = 30 * 24 * 3600,
        retain_done: float | None = None,
        retain_failed: float | None = None,
        retain_cancelled: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__()
        _driver.backend_of(db)
        self.name = check_name("name", name)
        if self.name == registry.REGISTRY:
            raise InvalidInput("name", f"{registry.REGISTRY!r} is mongoq's registry of queues")
        self.max_attempts = check_int("max_attempts", max_attempts, low=1)
        self.lease_ttl = check_seconds("lease_ttl", lease_ttl, positive=True)
        self.backoff_base = check_seconds("backoff_base", backoff_base)
        self.backoff_cap = check_seconds("backoff_cap", backoff_cap)
        self.tombstone_ttl = int(check_seconds("tombstone_ttl", tombstone_ttl, positive=True))
        self.retain_done = _retention("retain_done", retain_done)
        self.retain_failed = _retention("retain_failed", retain_failed)
        self.retain_cancelled = _retention("retain_cancelled", retain_cancelled)
        self.clock: Clock = clock if clock is not None else ServerClock(db)
        self.db = db
        self.collection = _driver.collection(db, name)
        self._leases: dict[str, TaskLease] = {}
        self._wake_key = wakeups.key_of("tasks", db, name)
        self._scheduler = Scheduler(self)

    # ------------------------------------------------------------------------------ set-up

    async def ensure_indexes(self) -> None:
        """Create the indexes every query needs, and the retention TTL indexes `retain_done` /
        `retain_failed` / `retain_cancelled` ask for (changing the expiry of one that exists);
        idempotent. A queue without a retention setting leaves that index alone, so a
        producer's set-up does not undo the workers'. The settings are the collection's: to
        stop a retention, drop its index (``await queue.collection.drop_index("retain_done")``).
        The queue is recorded in the database's registry (`mongoq.registry`).
        """
        expiries = {
            schema.TOMBSTONE_TTL.name: self.tombstone_ttl,
            schema.RETAIN_DONE.name: self.retain_done,
            schema.RETAIN_FAILED.name: self.retain_failed,
            schema.RETAIN_CANCELLED.name: self.retain_cancelled,
        }
        await create_indexes(self.db, self.collection, schema.INDEXES, expiries=expiries)
        await create_indexes(self.db, self._scheduler.collection, (schema.SCHEDULE_DUE,))
        await registry.register(self.db, "tasks", self.name, self.clock.now())

    async def _now(self) -> datetime:
        await self.clock.refresh()
        return self.clock.now()

    # ---------------------------------------------------------------------------- producer

    async def put(
        self,
        task_id: TaskId,
        payload: Any = None,
        *,
        revision: str | int | None = None,
        priority: int = 0,
        delay: float = 0,
        run_at: datetime | None = None,
    ) -> PutOutcome:
        """Add a task, idempotently (one command).

        - A new id is inserted ``pending``, due after `delay` seconds, or at `run_at` (a
          timezone-aware datetime; one in the past is due at once; not both).
        - Replaying a put of an existing task with the same `revision` (or with none) changes
          nothing.
        - A put with a different `revision` replaces payload and priority and makes a pending,
          done, failed or removed task pending again with fresh attempts; a task being
          processed stays with its holder, whose settle then returns it to pending for the new
          revision instead of completing it.
        Higher `priority` is claimed first. Returns ``"inserted"``, ``"updated"`` or
        ``"unchanged"``. A task due now wakes this process's workers of the queue at once.
        """
        spec = check_new_task(NewTask(task_id, payload, revision, priority, delay, run_at))
        now = await self._now()
        result = await self.collection.update_one(
            schema.task_by_id(spec.task_id), schema.task_putting(spec, now), upsert=True
        )
        outcome: PutOutcome = (
            "inserted"
            if result.upserted_id is not None
            else "updated"
            if result.modified_count
            else "unchanged"
        )
        if outcome != "unchanged" and spec.due(now) <= now:
            wakeups.notify(self._wake_key)
        return outcome

    async def put_many(self, tasks: Iterable[NewTask]) -> PutManyResult:
        """`put` for many tasks in one round trip (one unordered bulk write)."""
        checked = check_new_tasks("tasks", tasks)
        if not checked:
            return PutManyResult(0, 0, 0)
        now = await self._now()
        ops = [
            _driver.update_by_id(
                self.db,
                schema.task_by_id(spec.task_id),
                schema.task_putting(spec, now),
                upsert=True,
            )
            for spec in checked
        ]
        result = await self.collection.bulk_write(ops, ordered=False)
        inserted, updated = result.upserted_count, result.modified_count
        if inserted + updated and any(spec.due(now) <= now for spec in checked):
            wakeups.notify(self._wake_key)
        return PutManyResult(inserted, updated, len(checked) - inserted - updated)

    # ---------------------------------------------------------------------------- consumer

    async def claim(self, worker_id: str | None = None) -> Task | None:
        """Take the most urgent due task, atomically (one command); None when nothing is due.

        Due means: pending and past its not-before time, or processing with an expired lease and
        attempts to spare (a crashed holder's task is taken over). Highest priority first, then
        the one due longest. The claim counts an attempt. Needs `ensure_indexes()` to have run
        once (the claim names its index).
        """
        worker = self._worker(worker_id)
        now = await self._now()
        claiming = schema.task_claiming(worker, uuid.uuid4().hex, now, self.lease_ttl)
        with _driver.index_required(self.collection, schema.CLAIM_INDEX):
            # As it was: when it fell due is in it; the claimed task follows from the update.
            before = await self.collection.find_one_and_update(
                schema.task_claimable(now, self.max_attempts),
                claiming,
                sort=schema.CLAIM_ORDER,
                hint=schema.CLAIM_INDEX,
                return_document=ReturnDocument.BEFORE,
            )
        if before is None:
            return None
        report_start_delay("tasks", self.name, stored_instant(before.get("lease_until")), now)
        task = Task.from_document(schema.task_as_claimed(before, claiming))
        log.debug("claimed %r (attempt %d) for %s", task.id, task.attempts, worker)
        return task

    async def claim_many(self, n: int, worker_id: str | None = None) -> list[Task]:
        """Claim up to `n` due tasks in two commands (three when another claimer took some of
        the candidates first), in claim order.

        Reads the `n` most urgent candidates (the claim's index range), claims those still
        claimable with one conditional ``update_many`` stamped with a fresh token, and, only
        when that took fewer than it read, reads back what the token took: a candidate another
        worker claimed in between is simply not returned. When other claimers took every
        candidate first, it reads the next ones (two more commands a round), so it returns
        nothing only when nothing is due. Each task is then held exactly as if `claim` had
        returned it.
        """
        check_int("n", n, low=1, high=MAX_BATCH)
        worker = self._worker(worker_id)
        now = await self._now()
        token = uuid.uuid4().hex
        claiming = schema.task_claiming(worker, token, now, self.lease_ttl)
        candidates = await take_candidates(
            self.collection,
            schema.task_claimable(now, self.max_attempts),
            claiming,
            sort=schema.CLAIM_ORDER,
            n=n,
            hint=schema.CLAIM_INDEX,
            fields=("lease_until",),
            whole_first=True,  # when the update took them all, they need no reading back
        )
        if not candidates.docs:
            return []
        ids = [candidate["_id"] for candidate in candidates.docs]
        if candidates.all_taken:
            # A put between the read and the update may have changed one (still due, so
            # taken): its holder then runs the old revision, whose settle misses (fenced on
            # the revision) and requeues the new one, as for a put under any holder.
            docs = [schema.task_as_claimed(doc, claiming) for doc in candidates.docs]
        else:
            docs = await _driver.find_list(self.collection, schema.tasks_claimed(ids, token))
        order = {task_id: index for index, task_id in enumerate(ids)}
        tasks = sorted((Task.from_document(doc) for doc in docs), key=lambda t: order[t.id])
        due = {c["_id"]: stored_instant(c.get("lease_until")) for c in candidates.docs}
        for task in tasks:
            report_start_delay("tasks", self.name, due[task.id], now)
        log.debug("claimed %d task(s) for %s", len(tasks), worker)
        return tasks

    async def complete_many(
        self, tasks: Sequence[Task], results: Sequence[Any] | None = None
    ) -> list[bool]:
        """`complete` for many tasks: one bulk write, plus one read when some did not take
        effect (to tell which) and one write for those whose revision changed. Returns, per
        task, whether it is now done by this call; a task no longer held is left unchanged
        (one whose revision changed goes back to pending, as with `complete`)."""
        tasks = check_batch("tasks", tasks)
        values = [None] * len(tasks) if results is None else list(results)
        if len(values) != len(tasks):
            raise InvalidInput("results", "must have one result per task")
        for index, (task, result) in enumerate(zip(tasks, values, strict=True)):
            _fence(task)
            check_result(f"results[{index}]", task, result)
        if not tasks:
            return []
        now = await self._now()
        outcome = await self.collection.bulk_write(
            [
                _driver.update_by_id(
                    self.db, schema.task_held_at_revision(task), schema.task_completing(result, now)
                )
                for task, result in zip(tasks, values, strict=True)
            ],
            ordered=False,
        )
        done = [True] * len(tasks)
        if outcome.matched_count != len(tasks):
            settled = await _driver.find_list(
                self.collection,
                schema.tasks_done([task.id for task in tasks]),
                projection={"lease_token": 1},
            )
            by = {(doc["_id"], doc.get("lease_token")) for doc in settled}
            done = [(task.id, task.lease_token) in by for task in tasks]
            # As in `_settle`: a task still held whose revision changed needs a fresh run.
            requeue = [
                _driver.update_by_id(self.db, schema.task_held(task), schema.task_requeuing(now))
                for task, ok in zip(tasks, done, strict=True)
                if not ok
            ]
            if requeue:
                await self.collection.bulk_write(requeue, ordered=False)
        for task, ok in zip(tasks, done, strict=True):
            lease = self._leases.get(task.lease_token or "")
            if lease is not None:
                lease.outcome = "completed" if ok else "lost"
        self._finished(task.id for task, ok in zip(tasks, done, strict=True) if ok)
        return done

    async def heartbeat_many(self, tasks: Sequence[Task]) -> list[bool]:
        """Extend the leases of `tasks` (one command, plus one read when some are no longer
        held, to tell which); returns, per task, whether it is still held."""
        tasks = check_batch("tasks", tasks)
        for task in tasks:
            _fence(task)
        if not tasks:
            return []
        held_by = schema.tasks_held(tasks)
        now = await self._now()
        extended = await self.collection.update_many(
            held_by, schema.task_extending(now, self.lease_ttl)
        )
        if extended.matched_count == len(tasks):
            return [True] * len(tasks)
        held = await _driver.find_list(self.collection, held_by, projection={"lease_token": 1})
        still = {(doc["_id"], doc.get("lease_token")) for doc in held}
        return [(task.id, task.lease_token) in still for task in tasks]

    async def _settle(self, task: Task, outcome: str, update: Any, now: datetime) -> bool:
        """Apply a holder's final write, fenced on its lease and the revision it claimed."""
        fence = _fence(task)
        lease = self._leases.get(task.lease_token or "")
        try:
            result = await self.collection.update_one(schema.task_held_at_revision(task), update)
        except _driver.DRIVER_ERRORS as error:
            if _driver.too_large(error):  # refused, nothing written: a fact, not an unknown
                # Only a completion writes a user value beside the payload; any other settle
                # writes an error text.
                field = "result" if outcome == "completed" else "error"
                raise InvalidInput(field, f"the server refused the document: {error}") from error
            # Applied or not, nobody can tell. The lease stays unsettled, so the exit of
            # `leased` still releases the task: harmless if this write applied (the release
            # then matches nothing), the fastest recovery if it did not.
            if lease is not None:
                lease.outcome = "unknown"
            raise
        took_effect = bool(result.matched_count == 1)
        if not took_effect:
            # Either the lease is gone (then this matches nothing either) or a put changed the
            # revision under the holder: that work is stale, the new revision needs a fresh run.
            requeued = await self.collection.update_one(fence, schema.task_requeuing(now))
            if requeued.matched_count:
                log.info("task %r changed revision while processing; requeued", task.id)
            elif lease is not None and await self._is_cancelled(task):
                lease.cancelled = True
                log.info("task %r: %s ignored, the task was cancelled", task.id, outcome)
            else:
                log.info("task %r: %s ignored, the lease was lost", task.id, outcome)
        if lease is not None and (took_effect or lease.outcome != "unknown"):
            missed = "cancelled" if lease.cancelled else "lost"
            lease.outcome = outcome if took_effect else missed
        if took_effect and outcome in ("completed", "failed"):
            self._finished([task.id])
        return took_effect

    def _finished_key(self, task_id: TaskId) -> wakeups.Key:
        """What `wait` for `task_id` listens under: its end, in this process."""
        return wakeups.key_of("tasks.finished", self.db, f"{self.name}\x00{task_id!r}")

    def _route_end(self, event: Mapping[str, Any]) -> None:
        """A change stream's event of a task's end: tell this process's waits for it."""
        key = event.get("documentKey") or {}
        if "_id" in key:
            self._finished([key["_id"]])

    def _finished(self, task_ids: Iterable[TaskId]) -> None:
        """Tell this process's `wait`s that these tasks ended."""
        for task_id in task_ids:
            wakeups.notify(self._finished_key(task_id))

    async def _cancelled_of(self, tasks: Sequence[Task]) -> set[TaskId]:
        """Which of `tasks` (whose holder lost them) were cancelled: one read."""
        docs = await _driver.find_list(
            self.collection, schema.tasks_cancelled([task.id for task in tasks]),
            projection={"_id": 1},
        )  # fmt: skip
        return {doc["_id"] for doc in docs}

    async def _is_cancelled(self, task: Task) -> bool:
        """Whether `task` (whose holder's renewal missed) was cancelled, rather than lost."""
        return task.id in await self._cancelled_of([task])

    async def heartbeat(self, task: Task) -> bool:
        """Extend the lease by `lease_ttl` from now; False when the task is no longer held."""
        fence = _fence(task)
        now = await self._now()
        result = await self.collection.update_one(fence, schema.task_extending(now, self.lease_ttl))
        return bool(result.matched_count == 1)

    async def complete(self, task: Task, result: Any = None) -> bool:
        """Mark the task ``done`` with `result`; False (and no change) if no longer held."""
        _fence(task)
        check_result("result", task, result)
        now = await self._now()
        return await self._settle(task, "completed", schema.task_completing(result, now), now)

    def backoff(self, attempts: int) -> float:
        """Seconds before retry number `attempts`: ``min(base * 2^(attempts-1), cap)`` times a
        uniform jitter in [1.0, 1.5) that keeps failed tasks from retrying in lockstep."""
        exponent = min(max(attempts - 1, 0), 64)
        return min(self.backoff_base * 2.0**exponent, self.backoff_cap) * random.uniform(1.0, 1.5)

    async def release_for_retry(self, task: Task, error: BaseException | str | None = None) -> bool:
        """Return the task to pending after a transient error, due after `backoff`.

        A task whose attempts are used up is failed instead: no task is left pending and
        unclaimable. False (and no change) if no longer held.
        """
        _fence(task)
        if task.attempts >= self.max_attempts:
            return await self.fail(task, error)
        now = await self._now()
        due = now + timedelta(seconds=self.backoff(task.attempts))
        update = schema.task_retrying(now, due, error_text(error))
        if not await self._settle(task, "retried", update, now):
            return False
        self._report(task, "retried", error, due)
        return True

    async def release_not_an_attempt(self, task: Task, delay: float | None = None) -> bool:
        """Return the task to pending without counting this claim as an attempt.

        For work that stopped through no fault of the task (a shutdown, a revision race). It is
        due again after `delay` seconds (default 5: not in a hot loop). False if no longer held.
        """
        _fence(task)
        wait = NOT_AN_ATTEMPT_DELAY if delay is None else check_seconds("delay", delay)
        now = await self._now()
        update = schema.task_releasing(now, now + timedelta(seconds=wait))
        return await self._settle(task, "released", update, now)

    async def fail(self, task: Task, error: BaseException | str | None = None) -> bool:
        """Mark the task ``failed`` (terminal until an operator `requeue`s it)."""
        _fence(task)
        now = await self._now()
        if not await self._settle(task, "failed", schema.task_failing(now, error_text(error)), now):
            return False
        self._report(task, "failed", error)
        return True

    def _report(
        self,
        task: Task,
        outcome: str,
        error: BaseException | str | None,
        due: datetime | None = None,
    ) -> None:
        attempt = Attempt("tasks", self.name, repr(task.id), task.attempts, task.worker_id)
        log_attempt_end(log, attempt, outcome, error, due)

    def leased(self, task: Task) -> TaskLease:
        """``async with queue.leased(task) as lease:`` holds `task` while the block runs.

        A heartbeat extends the lease every ``lease_ttl / 3``. If a heartbeat finds the task
        taken over, `lease.lost` turns True and the heartbeat stops (it never revives the task).
        Unless the block settled the task itself (through `lease` or the queue), the exit does:
        clean exit -> `complete` (raising `LeaseLost` if that no longer takes effect);
        `PermanentError` -> `fail`; any other exception, cancellation included ->
        `release_for_retry` (which fails the task once its attempts are used up). The exception
        propagates.
        """
        _fence(task)
        assert task.lease_token is not None
        lease = TaskLease(self, task)
        self._leases[task.lease_token] = lease
        return lease

    # ------------------------------------------------------------------------------ worker

    async def run(
        self,
        handler: Callable[[Task], Awaitable[Any]],
        *,
        concurrency: int = 1,
        stop_when_empty: bool = False,
        stop_when_drained: bool = False,
        poll_interval: float = 1.0,
        worker_id: str | None = None,
        batch_size: int = 1,
        handler_timeout: float | None = None,
        handle_signals: bool = False,
        schedules: bool = True,
    ) -> RunSummary:
        """Claim and process tasks with `handler` until stopped.

        Each task runs inside `leased`: its return value is the task's result (a result that
        cannot be stored fails the task); a `PermanentError` fails it; another exception
        releases it for retry. A handler starts only while its lease is known to hold with a
        third of it left (a lease is dated from before the claim or renewal was sent); with
        less, the task is renewed first, and one whose lease cannot be shown live is not
        started: given back without counting an attempt, unless another worker took it over.
        Expired leases are reclaimed every ``lease_ttl / 3``, and when nothing is due (at
        most that often); then the loop sleeps `poll_interval`.
        `stop_when_empty` returns as soon as nothing is due *now*: tasks waiting out a retry
        backoff or a delay are left for a later run. `stop_when_drained` returns only when no
        task is left pending or processing at all, sleeping (on the queue's clock) until the
        next one is due meanwhile: for scripts and tests that must see everything finish.
        `stop()` (or, with `handle_signals`, SIGTERM/SIGINT) stops gracefully: in-flight tasks
        finish; cancelling the call (or a second signal) releases them for retry, recorded as
        "worker stopped" and counted.

        `handler_timeout` (seconds of the queue's clock) cancels a handler that runs longer:
        the attempt counts as failed, with the error ``HandlerTimeout: timed out after N s``.
        A handler whose task a heartbeat finds lost (taken over after a stall, removed) is
        cancelled too, and counted `lost`: its result could not be recorded, and another worker
        may be running the task. (A re-put with a new revision does not stop the holder: its
        settle misses, and the new revision runs afresh.) A task cancelled while it runs
        (`cancel`) is stopped the same way and counted `cancelled`.

        With `schedules` (the default) the loop also ticks the queue's schedules (`schedule`):
        one read at each next tick and at least every minute, a put and a write a tick.

        With `batch_size` > 1 each slot claims up to that many tasks at once (`claim_many`),
        runs them one after another under one heartbeat (`heartbeat_many`), and completes the
        successful ones together (`complete_many`): a few commands per batch instead of three
        per task, for short tasks whose latency matters less than throughput. A worker that
        crashes mid-batch costs every task of the batch an attempt (the claim counts them):
        size `max_attempts` with that in mind.
        """
        check_async_handler("handler", handler)
        check_stop_when(stop_when_empty, stop_when_drained)
        check_int("concurrency", concurrency, low=1)
        check_int("batch_size", batch_size, low=1, high=MAX_BATCH)
        poll = check_seconds("poll_interval", poll_interval, positive=True)
        limit = check_timeout("handler_timeout", handler_timeout)
        worker = self._worker(worker_id)
        summary = RunSummary()
        tally = Tally(summary, "tasks", self.name)

        holder = TaskBatch(self, handler)
        steps: tuple[Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]] = (
            self._single_steps(holder, tally, worker, limit)
            if batch_size == 1
            else self._batch_steps(holder, tally, worker, batch_size, limit)
        )
        loop: WorkerLoop[Any] = WorkerLoop(
            claim=steps[0],
            process=steps[1],
            clock=self.clock,
            concurrency=concurrency,
            poll_interval=poll,
            stop_when_empty=stop_when_empty,
            housekeeping=self.reclaim_expired,
            housekeeping_interval=self.lease_ttl / 3,
            name=f"tasks:{self.name}",
            next_due=self._next_due if stop_when_drained else None,
            wake_key=self._wake_key,
            background=[partial(self._scheduler.run, poll)] if schedules else [],
            changes=(self.collection, changes.TASKS_DUE),
        )
        await self._run_loop(loop, handle_signals=handle_signals)
        return summary

    async def _next_due(self) -> datetime | None:
        """When the next task left becomes claimable (a pending task's due time, a processing
        one's lease expiry); None when no task is pending or processing. One query, so that a
        task moving between the two states is never missed between two reads."""
        docs = await _driver.find_list(
            self.collection, schema.tasks_unfinished(), sort=schema.DUE_ORDER, limit=1,
            projection={"lease_until": 1}, hint=schema.STATUS_LEASE.name,
        )  # fmt: skip
        return stored_instant(docs[0]["lease_until"]) if docs else None

    def _single_steps(
        self, holder: TaskBatch, tally: Tally, worker: str, limit: float | None
    ) -> tuple[Callable[[], Awaitable[Task | None]], Callable[[Task], Awaitable[None]]]:
        """The claim and process steps of `run` one task at a time: the handler runs inside
        `leased`, started only under a lease known to be live (`mongoq.runtime.lease`)."""

        async def claim() -> Task | None:
            task = await self.claim(worker)
            if task is not None:
                tally("claimed")
            return task

        async def process(task: Task) -> None:
            liveness = await leases.confirm(
                task.lease_until or self.clock.now(), clock=self.clock, lease=self.lease_ttl,
                renew=partial(self.heartbeat, task), name=f"task {task.id!r}",
            )  # fmt: skip
            if liveness is not leases.Liveness.LIVE:
                tally(await holder.not_started(task, lost=liveness is leases.Liveness.LOST))
                return
            lease = self.leased(task)
            try:
                async with lease:
                    result = await call_handler(
                        partial(holder.handler, task), clock=self.clock, limit=limit,
                        guard=lease._guard(), timed=tally.handler_time,
                    )  # fmt: skip
                    # Finished: a hard stop from here on still records it (as a batch does),
                    # bounded like a batch's final settle.
                    with anyio.move_on_after(self.lease_ttl, shield=True) as bound:
                        try:
                            await lease.complete(result)
                        except InvalidInput as exc:  # a result that cannot be stored: a bug
                            await lease.fail(exc)
                    if bound.cancelled_caught:  # no answer: the lease expires, result untold
                        lease._abandon()
            except LeaseLost:
                pass
            except _driver.DRIVER_ERRORS:
                log.warning("settling %r failed; its lease will expire", task.id, exc_info=True)
            except Exception:
                pass  # settled (and logged) by the lease's exit
            finally:  # a cancellation (a second signal) is counted too
                tally(lease.outcome or "unknown")

        return claim, process

    def _batch_steps(
        self,
        holder: TaskBatch,
        tally: Tally,
        worker: str,
        batch_size: int,
        limit: float | None,
    ) -> tuple[Callable[[], Awaitable[list[Task] | None]], Callable[[list[Task]], Awaitable[None]]]:
        """The claim and process steps of `run` with batches."""

        async def claim() -> list[Task] | None:
            tasks = await self.claim_many(batch_size, worker)
            tally("claimed", len(tasks))
            return tasks or None

        async def process(tasks: list[Task]) -> None:
            await run_batch(
                holder, tasks, clock=self.clock, lease=self.lease_ttl, count=tally,
                describe=lambda task: repr(task.id), logger=log, handler_timeout=limit,
                timed=tally.handler_time,
            )  # fmt: skip

        return claim, process
