"""The lease holder's calls of `AsyncTaskQueue`, mixed into it (`TaskSettles`): renew a lease
(one task or many), complete (one or many), release for a retry or without counting an attempt,
fail, and the backoff a retry waits out; and `TaskLease`, the holder's side of
``async with queue.leased(task)``. Every write is fenced on the claim's lease token, and a
settle on the revision it claimed too: a holder that lost its task changes nothing. They use
the queue's collection (see `mongoq.tasks.schema`) and own none.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

import anyio

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import check_batch, check_seconds
from mongoq.clock import Clock
from mongoq.errors import HandlerAbandoned, InvalidInput, LeaseLost, PermanentError
from mongoq.runtime import wakeups
from mongoq.runtime.keepalive import KeepAlive
from mongoq.runtime.loop import WORKER_STOPPED
from mongoq.runtime.report import Attempt, error_text, log_attempt_end
from mongoq.tasks import cancels, schema
from mongoq.tasks.models import Task, TaskId, check_result

if TYPE_CHECKING:
    from mongoq.tasks.queue import AsyncTaskQueue

__all__ = ["TaskLease", "TaskSettles"]

log = logging.getLogger("mongoq.tasks")

#: Seconds before a task released without counting an attempt is due again, by default.
NOT_AN_ATTEMPT_DELAY = 5.0


def _claimed(task: Task) -> Task:
    """`task`, refused unless it is one `claim` returned: its lease fields set, and every field
    a fence is built from of the type a claim gives it (a document such as ``{"$ne": None}``
    in a hand-built `Task` would match another holder's task: operator injection)."""
    if not isinstance(task, Task) or task.lease_token is None or task.worker_id is None:
        raise InvalidInput("task", "must be a Task returned by claim()")
    if not isinstance(task.lease_token, str) or not isinstance(task.worker_id, str):
        raise InvalidInput("task", "its lease_token and worker_id must be strings, as claim() sets")
    # Any value a stored id can be (another program's ObjectId too), but no document or array,
    # which a filter would read as operators or as a match of any element.
    if isinstance(task.id, Mapping | list | tuple) or isinstance(task.revision, Mapping | list):
        raise InvalidInput("task", "its id and revision must be plain values, as claim() sets")
    return task


def _fence(task: Task) -> dict[str, Any]:
    """`task`'s fence (`schema.task_held`); refuses anything `claim` did not return."""
    return schema.task_held(_claimed(task))


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
    #: when the block was entered (the queue's clock): `mongoq.tasks.cancels` polls for the
    #: tasks held longer than a poll interval
    held_since: datetime | None = field(default=None, repr=False)
    _listening: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

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

    def _record(self, outcome: str | None) -> None:
        """A settle through the queue ended: `outcome` if it took effect; None if it missed,
        the lease then lost (or cancelled), unless a settle whose reply was lost may have
        applied (``unknown`` stays)."""
        if outcome is not None:
            self.outcome = outcome
        elif self.outcome != "unknown":
            self.outcome = "cancelled" if self.cancelled else "lost"

    def _lost_error(self) -> LeaseLost:
        """What the exit raises when the block's outcome could not be recorded."""
        return LeaseLost(
            f"task {self.task.id!r} was cancelled; the block's outcome was not recorded"
            if self.cancelled
            else f"task {self.task.id!r} is no longer held (taken over, removed, or re-put with "
            "a new revision); the block's outcome was not recorded"
        )

    async def _settle_on_exit(self, exc: BaseException | None) -> None:
        """What the exit of the block does when it left the task unsettled (see `leased`)."""
        if self.settled or self._abandoned:
            return
        if isinstance(exc, HandlerAbandoned):  # still running: settling would run it twice
            self.outcome = "lost"
            self._abandoned = True
            return
        if self.lost:
            if self.outcome != "unknown":  # a settle without an answer may have applied
                self.outcome = "cancelled" if self.cancelled else "lost"
            if exc is None:
                raise self._lost_error()
            return
        if exc is None:
            if not await self.queue.complete(self.task):
                raise self._lost_error()
            return
        try:
            await self._settle_failure(exc)
        except _driver.DRIVER_ERRORS as settle_error:
            # The block's own exception is what the caller needs to see; the lease expiring
            # makes the task claimable again.
            log.warning("could not release %r after %r: %s", self.task.id, exc, settle_error)

    async def _settle_failure(self, exc: BaseException) -> None:
        """The settle of a block that raised `exc`."""
        if isinstance(exc, PermanentError):
            await self.queue.fail(self.task, exc)
        elif isinstance(exc, anyio.get_cancelled_exc_class()):
            # Counted and retried like a failure, but its traceback says nothing of the task.
            await self.queue.release_for_retry(self.task, WORKER_STOPPED)
        else:  # any other exception: counted, retried with backoff
            await self.queue.release_for_retry(self.task, exc)

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
        self.held_since = self.queue.clock.now()
        # Told at once of a cancel or a removal (this process, a change stream, a poll).
        keepalive = self._keepalive
        stop = self.queue._held.stop_key(self.task.id)
        self._listening.enter_context(wakeups.listen(stop, keepalive.renew_now))
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._listening.close()
        try:
            assert self._keepalive is not None
            await self._keepalive.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self._settle_on_exit(exc)
                finally:
                    self.queue._held.drop_lease(self.task.lease_token)


@names_unreachable_server
class TaskSettles:
    """`leased`, `heartbeat`, `heartbeat_many`, `complete`, `complete_many`,
    `release_for_retry`, `release_not_an_attempt`, `fail` and `backoff` of `AsyncTaskQueue`,
    and the look-ups they share (was a lost task cancelled; which waits to wake)."""

    # set by the queue's constructor
    name: str
    db: Any
    collection: Any
    clock: Clock
    max_attempts: int
    lease_ttl: float
    backoff_base: float
    backoff_cap: float
    #: what this instance holds (the open `leased` blocks, a run's batches) and its stop keys
    _held: cancels.HeldWork
    #: `wakeups.key_of("tasks.finished", db, name)`: the ends of this queue's tasks
    _finished_base: wakeups.Key

    if TYPE_CHECKING:

        async def _now(self) -> datetime: ...

    # ------------------------------------------------------------------------------ leases

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
        _claimed(task)
        assert task.lease_token is not None
        lease = TaskLease(cast("AsyncTaskQueue", self), task)  # mixed into it
        self._held.add_lease(task.lease_token, lease)
        return lease

    async def heartbeat(self, task: Task) -> bool:
        """Extend the lease by `lease_ttl` from now; False when the task is no longer held."""
        fence = _fence(task)
        now = await self._now()
        result = await self.collection.update_one(fence, schema.task_extending(now, self.lease_ttl))
        return bool(result.matched_count == 1)

    async def heartbeat_many(self, tasks: Sequence[Task]) -> list[bool]:
        """Extend the leases of `tasks` (one command, plus one read when some are no longer
        held, to tell which); returns, per task, whether it is still held."""
        tasks = check_batch("tasks", tasks)
        for task in tasks:
            _claimed(task)
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

    # ----------------------------------------------------------------------------- settles

    async def complete(self, task: Task, result: Any = None) -> bool:
        """Mark the task ``done`` with `result`; False (and no change) if no longer held."""
        check_result("result", _claimed(task), result)
        now = await self._now()
        return await self._settle(task, "completed", schema.task_completing(result, now), now)

    async def complete_many(
        self, tasks: Sequence[Task], results: Sequence[Any] | None = None
    ) -> list[bool]:
        """`complete` for many tasks: one bulk write, plus one read when some did not take
        effect (to tell which) and one write for those whose revision changed. Returns, per
        task, whether it is now done by this call; a task no longer held is left unchanged
        (one whose revision changed goes back to pending, as with `complete`)."""
        tasks, values = _completions(tasks, results)
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
            done = await self._completed_of(tasks, now)
        for task, ok in zip(tasks, done, strict=True):
            lease = self._held.lease(task.lease_token)
            if lease is not None:
                lease.outcome = "completed" if ok else "lost"
        self._finished(task.id for task, ok in zip(tasks, done, strict=True) if ok)
        return done

    async def _completed_of(self, tasks: Sequence[Task], now: datetime) -> list[bool]:
        """After a `complete_many` that did not take effect on every task: which of `tasks` it
        completed (one read), the others still held at a changed revision requeued (one write,
        as in `_settle`: their work is stale, the new revision needs a fresh run)."""
        settled = await _driver.find_list(
            self.collection,
            schema.tasks_done([task.id for task in tasks]),
            projection={"lease_token": 1},
        )
        by = {(doc["_id"], doc.get("lease_token")) for doc in settled}
        done = [(task.id, task.lease_token) in by for task in tasks]
        requeue = [
            _driver.update_by_id(self.db, schema.task_held(task), schema.task_requeuing(now))
            for task, ok in zip(tasks, done, strict=True)
            if not ok
        ]
        if requeue:
            await self.collection.bulk_write(requeue, ordered=False)
        return done

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
        _claimed(task)
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
        _claimed(task)
        wait = NOT_AN_ATTEMPT_DELAY if delay is None else check_seconds("delay", delay)
        now = await self._now()
        update = schema.task_releasing(now, now + timedelta(seconds=wait))
        return await self._settle(task, "released", update, now)

    async def fail(self, task: Task, error: BaseException | str | None = None) -> bool:
        """Mark the task ``failed`` (terminal until an operator `requeue`s it)."""
        _claimed(task)
        now = await self._now()
        if not await self._settle(task, "failed", schema.task_failing(now, error_text(error)), now):
            return False
        self._report(task, "failed", error)
        return True

    async def _settle(self, task: Task, outcome: str, update: Any, now: datetime) -> bool:
        """Apply a holder's final write, fenced on its lease and the revision it claimed (the
        caller checked `task`); whether it took effect."""
        lease = self._held.lease(task.lease_token)
        try:
            result = await self.collection.update_one(schema.task_held_at_revision(task), update)
        except _driver.DRIVER_ERRORS as error:
            _settle_failed(error, outcome, lease)
            raise
        took_effect = bool(result.matched_count == 1)
        if not took_effect:
            await self._settle_missed(task, outcome, lease, now)
        if lease is not None:
            lease._record(outcome if took_effect else None)
        if took_effect and outcome in _ENDS:
            wakeups.notify(self._finished_key(task.id))
        return took_effect

    async def _settle_missed(
        self, task: Task, outcome: str, lease: TaskLease | None, now: datetime
    ) -> None:
        """A settle that matched nothing: either the lease is gone (then this matches nothing
        either) or a put changed the revision under the holder: that work is stale, the new
        revision needs a fresh run. A lost lease learns whether the task was cancelled."""
        requeued = await self.collection.update_one(
            schema.task_held(task), schema.task_requeuing(now)
        )
        if requeued.matched_count:
            log.info("task %r changed revision while processing; requeued", task.id)
        elif lease is not None and await self._is_cancelled(task):
            lease.cancelled = True
            log.info("task %r: %s ignored, the task was cancelled", task.id, outcome)
        else:
            log.info("task %r: %s ignored, the lease was lost", task.id, outcome)

    def _report(
        self,
        task: Task,
        outcome: str,
        error: BaseException | str | None,
        due: datetime | None = None,
    ) -> None:
        attempt = Attempt("tasks", self.name, str(task.id), task.attempts, task.worker_id)
        log_attempt_end(log, attempt, outcome, error, due)

    # ---------------------------------------------------------------------------- look-ups

    def _finished_key(self, task_id: TaskId) -> wakeups.Key:
        """What `wait` for `task_id` listens under: its end, in this process."""
        primitive, database, name = self._finished_base
        return primitive, database, f"{name}\x00{task_id!r}"

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


#: The settles that end a task (those a `wait` returns on).
_ENDS = frozenset({"completed", "failed"})


def _settle_failed(error: BaseException, outcome: str, lease: TaskLease | None) -> None:
    """A settle's write failed with `error`. A refusal of the document is a fact, nothing was
    written: `InvalidInput`. Anything else leaves the write applied or not, nobody can tell:
    `lease` stays unsettled (``unknown``), so the exit of `leased` still releases the task,
    harmless if the write applied (the release then matches nothing), the fastest recovery
    if it did not; the caller re-raises `error`."""
    if _driver.too_large(error):
        # Only a completion writes a user value beside the payload; any other settle writes an
        # error text.
        field = "result" if outcome == "completed" else "error"
        raise InvalidInput(field, f"the server refused the document: {error}") from error
    if lease is not None:
        lease.outcome = "unknown"


def _completions(
    tasks: Sequence[Task], results: Sequence[Any] | None
) -> tuple[list[Task], list[Any]]:
    """`complete_many`'s arguments checked: the tasks (each one `claim` returned) and their
    results, one each (None for all when `results` is None), each storable on its task."""
    tasks = check_batch("tasks", tasks)
    values = [None] * len(tasks) if results is None else list(results)
    if len(values) != len(tasks):
        raise InvalidInput("results", "must have one result per task")
    for index, (task, result) in enumerate(zip(tasks, values, strict=True)):
        check_result(f"results[{index}]", _claimed(task), result)
    return tasks, values
