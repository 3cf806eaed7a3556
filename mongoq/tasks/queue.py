"""`AsyncTaskQueue`: a task *is* a state document, claimed by one atomic `find_one_and_update`,
leased, retried.

Here: the constructor, set-up, the producer's puts, the claims (one task, or a batch) and the
run loop. The lease holder's calls (renew, complete, release, fail, `leased`) are mixed in from
`mongoq.tasks.settles`, the operator calls from `mongoq.tasks.operators`, the schedules from
`mongoq.tasks.schedules`, the running workers' presences from `mongoq.tasks.presence`. The queue
owns the collections ``{name}`` (one document per task), ``{name}_schedules`` (one per
schedule) and ``{name}_workers`` (one per running `Jobs` worker): their layout, their indexes
and every filter and update sent are in `mongoq.tasks.schema`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import OperationFailure

from mongoq import _driver, registry
from mongoq._indexes import create_indexes
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import (
    MAX_BATCH,
    check_async_handler,
    check_functions,
    check_int,
    check_lease_seconds,
    check_name,
    check_seconds,
    check_timeout,
)
from mongoq.clock import Clock, ServerClock, stored_instant
from mongoq.errors import InvalidInput
from mongoq.runtime import wakeups
from mongoq.runtime.candidates import take_candidates
from mongoq.runtime.events import report_start_delay
from mongoq.runtime.loop import RunOptions, WorkerHost
from mongoq.tasks import cancels, quarantine, schema
from mongoq.tasks.models import (
    PROCESSING,
    READ_ERRORS,
    NewTask,
    PutManyResult,
    PutOutcome,
    Task,
    TaskId,
    TaskRunSummary,
    check_new_tasks,
    new_lease_token,
    new_task,
)
from mongoq.tasks.operators import TaskOperators
from mongoq.tasks.presence import Presence
from mongoq.tasks.schedules import Scheduler, TaskSchedules
from mongoq.tasks.settles import TaskSettles
from mongoq.tasks.source import TaskSource

__all__ = ["AsyncTaskQueue"]

log = logging.getLogger("mongoq.tasks")


def _retention(field: str, seconds: float | None) -> int | None:
    """A retention setting: None (keep forever) or whole seconds, at least one."""
    return None if seconds is None else max(1, int(check_seconds(field, seconds, positive=True)))


@names_unreachable_server
class AsyncTaskQueue(TaskSettles, TaskOperators, TaskSchedules, WorkerHost):
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
        self.lease_ttl = check_lease_seconds("lease_ttl", lease_ttl)
        self.backoff_base = check_seconds("backoff_base", backoff_base)
        self.backoff_cap = check_seconds("backoff_cap", backoff_cap)
        self.tombstone_ttl = int(check_seconds("tombstone_ttl", tombstone_ttl, positive=True))
        self.retain_done = _retention("retain_done", retain_done)
        self.retain_failed = _retention("retain_failed", retain_failed)
        self.retain_cancelled = _retention("retain_cancelled", retain_cancelled)
        self.clock: Clock = clock if clock is not None else ServerClock(db)
        self.db = db
        self.collection = _driver.collection(db, name)
        self._wake_key = wakeups.key_of("tasks", db, name)
        self._finished_base = wakeups.key_of("tasks.finished", db, name)
        # what this instance holds now, and the stop keys a cancel reaches its holders by
        self._held = cancels.HeldWork(wakeups.key_of("tasks.stop", db, name))
        self._scheduler = Scheduler(self)
        self._presence = Presence(self)

    # ------------------------------------------------------------------------------ set-up

    async def setup(self) -> None:
        """Create the indexes every query needs, and the retention TTL indexes `retain_done` /
        `retain_failed` / `retain_cancelled` ask for (changing the expiry of one that exists);
        idempotent. A queue without a retention setting leaves that index alone, so a
        producer's set-up does not undo the workers'. The settings are the collection's: to
        stop a retention, drop its index (``await queue.collection.drop_index("retain_done")``).
        The queue is recorded in the database's registry (`mongoq.registry`).
        """
        await registry.check_collections(self.db, "tasks", self.name)
        expiries = {
            schema.TOMBSTONE_TTL.name: self.tombstone_ttl,
            schema.RETAIN_DONE.name: self.retain_done,
            schema.RETAIN_FAILED.name: self.retain_failed,
            schema.RETAIN_CANCELLED.name: self.retain_cancelled,
        }
        await create_indexes(self.db, self.collection, schema.INDEXES, expiries=expiries)
        await create_indexes(self.db, self._scheduler.collection, (schema.SCHEDULE_DUE,))
        await create_indexes(
            self.db, self._presence.collection, (schema.WORKER_EXPIRY,),
            expiries={schema.WORKER_EXPIRY.name: schema.WORKER_EXPIRY_SLACK},
        )  # fmt: skip
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
        function: str | None = None,
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
        `function` names the task function that runs it (`mongoq.Jobs`; a worker claims only
        the functions it knows, see `claim`).
        """
        spec = new_task(task_id, payload, revision, priority, delay, run_at, function=function)
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

    async def claim(
        self, worker_id: str | None = None, *, functions: Sequence[str] | None = None
    ) -> Task | None:
        """Take the most urgent due task, atomically (one command); None when nothing is due.

        Due means: pending and past its not-before time, or processing with an expired lease and
        attempts to spare (a crashed holder's task is taken over). Highest priority first, then
        the one due longest. The claim counts an attempt. Needs `setup()` to have run
        once (the claim names its index). With `functions`, only tasks of these task functions
        are claimed: a task of another one is never taken and keeps its attempts.
        """
        worker = self._worker(worker_id)
        names = check_functions("functions", functions)
        for _ in range(quarantine.ROUNDS):
            task, set_aside = await self._claim_once(worker, names)
            if not set_aside:
                return task
        return None

    async def _claim_once(self, worker: str, names: list[str] | None) -> tuple[Task | None, bool]:
        """One claim, and whether what it found was a document no worker can use instead (set
        aside: the caller claims again)."""
        now = await self._now()
        token = new_lease_token()
        claiming = schema.task_claiming(worker, token, now, self.lease_ttl)
        due = schema.task_claimable(now, self.max_attempts, names)
        try:
            with _driver.index_required(self.collection, schema.CLAIM_INDEX):
                # As it was: when it fell due is in it; the claimed task follows from the update.
                before = await self.collection.find_one_and_update(
                    due, claiming, sort=schema.CLAIM_ORDER, hint=schema.CLAIM_INDEX,
                    return_document=ReturnDocument.BEFORE,
                )  # fmt: skip
        except OperationFailure as refusal:
            if not _driver.type_mismatch(refusal):
                raise
            await quarantine.set_aside_first(self, due, now, refusal)
            return None, True
        if before is None:
            return None, False
        readable, _ = await self._readable([schema.task_as_claimed(before, claiming)], now)
        if not readable:  # set aside (or changed meanwhile): claim again
            return None, True
        task = readable[0]
        report_start_delay("tasks", self.name, stored_instant(before.get("lease_until")), now)
        log.debug("claimed %r (attempt %d) for %s", task.id, task.attempts, worker)
        return task, False

    async def claim_many(
        self, n: int, worker_id: str | None = None, *, functions: Sequence[str] | None = None
    ) -> list[Task]:
        """Claim up to `n` due tasks in two commands (three when another claimer took some of
        the candidates first), in claim order.

        Reads the `n` most urgent candidates (the claim's index range), claims those still
        claimable with one conditional ``update_many`` stamped with a fresh token, and, only
        when that took fewer than it read, reads back what the token took: a candidate another
        worker claimed in between is simply not returned. When other claimers took every
        candidate first, it reads the next ones (two more commands a round), so it returns
        nothing only when nothing is due. Each task is then held exactly as if `claim` had
        returned it. `functions` limits it as it limits `claim`.
        """
        check_int("n", n, low=1, high=MAX_BATCH)
        worker = self._worker(worker_id)
        names = check_functions("functions", functions)
        for _ in range(quarantine.ROUNDS):
            tasks = await self._claim_many_once(n, worker, names)
            if tasks is not None:
                return tasks
        return []

    async def _claim_many_once(
        self, n: int, worker: str, names: list[str] | None
    ) -> list[Task] | None:
        """One batched claim; None when it took nothing but set documents no worker can use
        aside (the caller claims again)."""
        now = await self._now()
        token = new_lease_token()
        claiming = schema.task_claiming(worker, token, now, self.lease_ttl)
        due = schema.task_claimable(now, self.max_attempts, names)
        try:
            candidates = await take_candidates(
                self.collection, due, claiming, sort=schema.CLAIM_ORDER, n=n,
                hint=schema.CLAIM_INDEX, fields=("lease_until",),
                whole_first=True,  # when the update took them all, they need no reading back
            )  # fmt: skip
        except OperationFailure as refusal:
            if not _driver.type_mismatch(refusal):
                raise
            # The update stopped at a malformed candidate, having stamped some before it.
            await quarantine.set_aside_candidates(self, due, now, refusal)
            taken = schema.task_taken_by(token, claiming["$set"]["lease_until"])
            docs = await _driver.find_list(self.collection, taken, hint=schema.STATUS_LEASE.name)
            return (await self._readable(docs, now))[0] or None
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
        readable, set_aside = await self._readable(docs, now)
        if set_aside and not readable:
            return None
        tasks = sorted(readable, key=lambda t: order[t.id])
        due_at = {c["_id"]: stored_instant(c.get("lease_until")) for c in candidates.docs}
        for task in tasks:
            report_start_delay("tasks", self.name, due_at[task.id], now)
        log.debug("claimed %d task(s) for %s", len(tasks), worker)
        return tasks

    async def _readable(self, docs: Sequence[Mapping[str, Any]], now: datetime) -> tuple[
        list[Task], int
    ]:  # fmt: skip
        """The tasks of claimed `docs`, and how many of them could not be read as tasks: those
        are set aside (failed, fenced on this claim's token), never run."""
        tasks: list[Task] = []
        set_aside = 0
        for doc in docs:
            try:
                tasks.append(Task.from_document(doc))
            except READ_ERRORS:
                fence = schema.task_unchanged(doc, {"status": PROCESSING})
                set_aside += await quarantine.set_aside(self, doc, fence, now)
        return tasks, set_aside

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
        give_up_after: float | None = None,
    ) -> TaskRunSummary:
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

        A claim that cannot reach the server is retried with a growing backoff (the poll
        interval, doubled each time, at most 30 s); one warning says the server is lost and one
        that it is back. With `give_up_after` (seconds) the call raises `ServerUnavailable` once
        the server has been gone that long; by default it waits for the server forever.
        """
        options = RunOptions.checked(
            concurrency=concurrency, poll_interval=poll_interval, stop_when_empty=stop_when_empty,
            stop_when_drained=stop_when_drained, give_up_after=give_up_after,
        )  # fmt: skip
        source = self.source(
            handler, worker_id=worker_id, batch_size=batch_size,
            handler_timeout=handler_timeout, schedules=schedules,
        )  # fmt: skip
        await self._run_loop(options.loop([source]), handle_signals=handle_signals)
        return source.summary

    def source(
        self,
        handler: Callable[[Task], Awaitable[Any]],
        *,
        worker_id: str | None = None,
        batch_size: int = 1,
        handler_timeout: float | None = None,
        schedules: bool = True,
        functions: Sequence[str] | None = None,
    ) -> TaskSource:
        """This queue as a source of work for a `mongoq.runtime.loop.WorkerLoop`: what `run`
        runs, and what a loop over several queues runs one of per queue (`Jobs.run`). The
        options are `run`'s; with `functions`, it claims only the tasks of those task
        functions, and keeps the worker's presence in ``{name}_workers`` while it runs (read
        by `stats`)."""
        check_async_handler("handler", handler)
        return TaskSource(
            self, handler, worker_id=self._worker(worker_id),
            batch_size=check_int("batch_size", batch_size, low=1, high=MAX_BATCH),
            handler_timeout=check_timeout("handler_timeout", handler_timeout),
            schedules=schedules,
            functions=check_functions("functions", functions),
        )  # fmt: skip

    async def _next_due(self, functions: Sequence[str] | None = None) -> datetime | None:
        """When the next task left (of `functions` only, when given) becomes claimable (a
        pending task's due time, a processing one's lease expiry); None when no task is pending
        or processing. One query, so that a task moving between the two states is never missed
        between two reads. A task whose due time is no date (a hand edit: such values sort
        before every date) is set aside, and the next one read."""
        unfinished = schema.tasks_unfinished(functions)
        for _ in range(quarantine.ROUNDS):
            docs = await _driver.find_list(
                self.collection, unfinished, sort=schema.DUE_ORDER, limit=1,
                projection={"lease_until": 1, "status": 1, "revision": 1, "lease_token": 1},
                hint=schema.STATUS_LEASE.name,
            )  # fmt: skip
            if not docs:
                return None
            due = stored_instant(docs[0].get("lease_until"))
            if due is not None:
                return due
            now = await self._now()
            await quarantine.set_aside(
                self, docs[0], schema.task_unchanged(docs[0], unfinished), now
            )
        return None
