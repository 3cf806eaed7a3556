"""The pytest plugin: fixtures for testing an application's task functions (`mongoq.Jobs`).

pytest loads it by its ``pytest11`` entry point (``mongoq``) wherever mongoq is installed; an
environment that installed mongoq without the entry point loads it with
``-p mongoq.pytest_plugin``. Its fixtures are all named ``mongoq_*``, so none shadows one of
the suite that loads it (a ``db`` or ``clock`` of its own):

- `mongoq_db`: a fresh, empty embedded in-memory database for each test. A suite that wants a
  server overrides the fixture in its own ``conftest.py``.
- `mongoq_clock`: a `ManualClock` for each test.
- `mongoq_jobs`: a `JobsHarness` on those two. ``await mongoq_jobs.bind(app.jobs)`` points an
  application's `Jobs` at them and creates its queues' indexes, and the test's teardown
  points the `Jobs` back; ``await mongoq_jobs.run_until_idle()`` runs its task functions,
  moving the clock to each next due time (retries after their backoff, delayed deferrals),
  until none of their tasks is left, within a bounded number of rounds and of seconds.

Every fixture is synchronous and hands out objects whose methods are async, so the plugin
needs no async test plugin of its own. A test that awaits them needs one: pytest-asyncio, or
anyio's (``@pytest.mark.anyio``), which comes with mongoq's own dependency on anyio.
Owns no collections (its database's queues own theirs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from mongoq import _driver
from mongoq._validation import check_int, check_seconds
from mongoq.clock import ManualClock
from mongoq.errors import InvalidInput
from mongoq.tasks import Task, TaskRunSummary
from mongoq.tasks import schema as task_schema
from mongoq.tasks.models import PROCESSING, read_task

if TYPE_CHECKING:
    from mongoq.clock import Clock
    from mongoq.jobs import Jobs

__all__ = ["JobsHarness", "JobsNotIdle", "JobsRun"]

#: Unfinished tasks a `JobsNotIdle` message lists (the rest are counted, not listed).
LISTED = 10
#: A lease ending at an instant still holds then (`AsyncTaskQueue.claim`): a processing task
#: is taken over only once the clock is past its lease, by the smallest step a stored instant
#: has.
PAST_A_LEASE = timedelta(milliseconds=1)


@dataclass(frozen=True)
class JobsRun:
    """What `JobsHarness.run_until_idle` did: the run totals over every round and bound `Jobs`,
    how many rounds it took, how far it moved the clock, and the unfinished tasks it left (none,
    unless ``advance_clock=False`` left tasks that are due later)."""

    summary: TaskRunSummary
    rounds: int
    advanced: timedelta
    pending: list[Task] = field(default_factory=list)


class JobsNotIdle(AssertionError):
    """`JobsHarness.run_until_idle` gave up with tasks unfinished: its rounds or its seconds
    ran out. An `AssertionError`, so pytest reports the test as failed, with the message:
    why it gave up and which tasks are left. `pending` holds them (up to `LISTED`)."""

    def __init__(self, message: str, pending: list[Task]) -> None:
        super().__init__(message)
        self.pending = pending


class JobsHarness:
    """The `Jobs` of one test, bound to its database and clock (the `mongoq_jobs` fixture)."""

    def __init__(self, db: Any, clock: ManualClock) -> None:
        self.db = db
        self.clock = clock
        # Each bound `Jobs`, with the database and clock it had: `unbind` puts them back.
        self._bound: list[tuple[Jobs, Any, Clock | None]] = []

    @property
    def bound(self) -> list[Jobs]:
        """The `Jobs` bound so far, in the order they were bound."""
        return [jobs for jobs, _, _ in self._bound]

    async def bind(self, jobs: Jobs) -> Jobs:
        """Point `jobs` at this test's database and clock and create its queues' indexes
        (`Jobs.setup`); returns it. Binding it again only runs `setup` again."""
        if not any(jobs is known for known in self.bound):
            self._bound.append((jobs, jobs.db, jobs.clock))
            jobs.clock = self.clock
            # After the clock: `use` drops the queues built so far, and each is built anew,
            # on this database, with this clock.
            jobs.use(self.db)
        await jobs.setup()
        return jobs

    def unbind(self) -> None:
        """Give every bound `Jobs` back the database and clock it had (the fixture's
        teardown): a module-level `Jobs` leaves no test's database to the next one."""
        while self._bound:
            jobs, db, clock = self._bound.pop()
            jobs.clock = clock
            jobs.use(db)

    async def run_until_idle(
        self,
        *,
        max_rounds: int = 50,
        timeout: float = 30.0,  # noqa: ASYNC109 (seconds of real time for the whole call)
        advance_clock: bool = True,
        concurrency: int = 1,
    ) -> JobsRun:
        """Run the task functions of every bound `Jobs` until none of their tasks is left.

        Each round runs, one bound `Jobs` after the other, every task that is due
        (``run(stop_when_empty=True)``), then moves the clock to the next instant a task is
        due (a retry's backoff, a deferral's `delay` or `run_at`; a lease that ran out). With
        ``advance_clock=False`` it stops there instead, and returns the tasks due later in
        `JobsRun.pending`. `concurrency` is each run's (one: the tasks run in the order they
        are claimed, the same on every run).

        It cannot hang: after `max_rounds` rounds, or `timeout` seconds of real time (a task
        function awaiting what never comes, such as a sleep on the manual clock, is cancelled
        then; its round's totals are not counted), it raises `JobsNotIdle` naming the tasks
        still unfinished. Tasks of functions no bound `Jobs` declares are not run, and not
        waited for."""
        check_int("max_rounds", max_rounds, low=1)
        check_seconds("timeout", timeout, positive=True)
        if not self._bound:
            raise InvalidInput("jobs", "none is bound: await mongoq_jobs.bind(jobs) first")
        summary = TaskRunSummary()
        started = self.clock.now()
        rounds = 0
        with anyio.move_on_after(timeout) as scope:
            while rounds < max_rounds:
                rounds += 1
                for jobs in self.bound:
                    _add(summary, await jobs.run(concurrency=concurrency, stop_when_empty=True))
                due = await self._next_due()
                if due is None:
                    return JobsRun(summary, rounds, self.clock.now() - started)
                if due > self.clock.now():
                    if not advance_clock:
                        pending = await self._unfinished(None)
                        return JobsRun(summary, rounds, self.clock.now() - started, pending)
                    if rounds < max_rounds:  # (after the last, the report says when it is due)
                        self.clock.set(due)
        why = f"gave up after {max_rounds} rounds (max_rounds)"
        if scope.cancelled_caught:
            why = (
                f"gave up after {timeout:g} s of real time (timeout), in round {rounds}: a task "
                "function may await what never comes (a sleep on the manual clock, an event)"
            )
        pending = await self._unfinished(LISTED + 1)
        raise JobsNotIdle(self._describe(why, summary, started, pending), pending[:LISTED])

    async def _unfinished(self, limit: int | None) -> list[Task]:
        """The pending and processing tasks of the bound `Jobs`' functions, soonest due first
        (at most `limit`)."""
        tasks: list[Task] = []
        for jobs in self.bound:
            for name in jobs.queues:
                functions = jobs.functions_of(name)
                docs = await _driver.find_list(
                    jobs.queue(name).collection, task_schema.tasks_unfinished(functions),
                    sort=task_schema.DUE_ORDER, limit=limit or 0,
                    hint=task_schema.STATUS_LEASE.name,
                )  # fmt: skip
                tasks.extend(read_task(doc) for doc in docs)
        tasks.sort(key=self._due)
        return tasks if limit is None else tasks[:limit]

    async def _next_due(self) -> datetime | None:
        """When the clock must be for the next unfinished task to be claimable; None when no
        task is left."""
        # The soonest of each queue is enough: every other is due later in its queue.
        return min((self._due(task) for task in await self._unfinished(1)), default=None)

    def _due(self, task: Task) -> datetime:
        due = task.lease_until or self.clock.now()
        return due + PAST_A_LEASE if task.status == PROCESSING else due

    def _describe(
        self, why: str, summary: TaskRunSummary, started: datetime, pending: list[Task]
    ) -> str:
        moved = (self.clock.now() - started).total_seconds()
        ran = ", ".join(
            f"{getattr(summary, counter)} {counter}"
            for counter in ("claimed", "completed", "retried", "failed")
        )
        lines = [
            f"run_until_idle {why}, the clock moved {moved:g} s: {ran}",
            f"{len(pending) if len(pending) <= LISTED else f'over {LISTED}'} task(s) unfinished"
            + (":" if pending else " (all finished as it gave up)"),
        ]
        lines.extend(f"  {self._line(task)}" for task in pending[:LISTED])
        return "\n".join(lines)

    def _line(self, task: Task) -> str:
        due = (self._due(task) - self.clock.now()).total_seconds()
        when = f"due in {due:g} s" if due > 0 else "due now"
        error = (task.error or "").strip().splitlines()
        last = f"; last error: {error[-1]}" if error else ""
        queues = {f.name: f.queue for jobs in self.bound for f in jobs.functions.values()}
        return (
            f"{queues.get(task.function or '', '?')}: {task.function}() task {task.id!r}: "
            f"{task.status}, {task.attempts} attempt(s), {when}{last}"
        )


def _add(total: TaskRunSummary, run: TaskRunSummary) -> None:
    for counter in dataclasses.fields(TaskRunSummary):
        setattr(total, counter.name, getattr(total, counter.name) + getattr(run, counter.name))


@pytest.fixture
def mongoq_db() -> Any:
    """A fresh, empty embedded in-memory database (the ``embedded`` extra). For a server,
    override this fixture in your ``conftest.py``."""
    # What `mongoq.testing.memory_database` does: the library does not import its test tools.
    return _driver.connect(_driver.MEMORY_SCHEME, "mongoq_test")


@pytest.fixture
def mongoq_clock() -> ManualClock:
    """A `ManualClock`: time moves only when the test (or `run_until_idle`) moves it."""
    return ManualClock()


@pytest.fixture
def mongoq_jobs(mongoq_db: Any, mongoq_clock: ManualClock) -> Iterator[JobsHarness]:
    """A `JobsHarness` on `mongoq_db` and `mongoq_clock`; every `Jobs` it bound gets its own
    database and clock back after the test."""
    harness = JobsHarness(mongoq_db, mongoq_clock)
    try:
        yield harness
    finally:
        harness.unbind()
