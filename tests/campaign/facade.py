"""The facade's scenario of the run-loop fault campaign: `mongoq_sync.TaskQueue.run` under faults.

The task queue's scenario (`tests.campaign.tasks`), smaller, through the blocking facade: one
``mongoq_sync.connect()`` (its portal thread runs the async core), one `ManualClock`, two worker
slots, each a `mongoq_sync.TaskQueue` built on its own instrumented view (`ViewDatabase`: faults,
then the observer) whose blocking ``run()`` runs in a thread of its own, with a plain-function
handler that the facade runs in worker threads. The same partitions, stops (the facade's
``stop()``), hard cancels and crashes (the loop's ``_cancel_running``, what a second signal
does), restarts, operator puts and cancels, the same drain and the same checks.

Time moves only at quiet points (`_quiet`): the portal's loop has nothing ready to run and every
handler thread that has started is asleep on the clock. The driver's thread acts (an event, a
step of the clock) only there, and advances the clock inside the loop, so that every sleeper
due wakes before any of them runs; handler threads woken at one instant go back to their
handlers one at a time, in a fixed order, each once the previous one is asleep again or done.
Each handler reads the raw document at its start inside the portal's loop, atomic with the
loop's commands. A seed's run thus repeats, threads and all.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio

import mongoq_sync
from mongoq import NewTask, Task
from mongoq._portal import Portal
from mongoq.testing import settle
from tests.campaign.engine import (
    FaultRates,
    Report,
    Run,
    Timeline,
    Worker,
    catching_unexpected_errors,
    new_worker,
    repeatable,
)
from tests.campaign.tasks import (
    HOLDINGS,
    QUEUE,
    SCHEDULE,
    STEP,
    Act,
    Settings,
    Shape,
    check_run,
    draw_disruptions,
    slot_names,
)

__all__ = ["PRIMITIVE", "ViewDatabase"]

#: Clock seconds the drain may take before it counts as a hang.
DRAIN = 400.0
#: Real seconds the driver waits for the threads to park before it calls the run hung.
QUIET_BOUND = 5.0


class ViewDatabase(mongoq_sync.Database):
    """A blocking handle on an instrumented view of `base`'s async database, sharing `base`'s
    portal: what a facade worker's `mongoq_sync.TaskQueue` is built on (the facade hands a
    queue the `async_database` of the handle it is given)."""

    def __init__(self, base: mongoq_sync.Database, view: Any) -> None:  # no portal of its own
        self._base = base
        self._view = view

    def _ensure(self) -> Portal:
        return self._base._ensure()

    @property
    def async_database(self) -> Any:
        return self._view

    def close(self) -> None:
        return None


def _busy_threads() -> int:
    """Handler calls handed to a worker thread whose result the loop has not taken back yet:
    the running loop's tasks suspended in anyio's ``run_sync_in_worker_thread``. Counted from
    the tasks, not from anyio's pool: a pool thread is tied to the portal call that started it
    (each blocking call is a root task there) and leaves the pool's books when that call ends,
    even while it still runs another worker's handler."""
    count = 0
    for task in asyncio.all_tasks():
        coroutine: Any = task.get_coro()
        while coroutine is not None:
            frame = getattr(coroutine, "cr_frame", None)
            if frame is not None and frame.f_code.co_name == "run_sync_in_worker_thread":
                count += 1
                break
            coroutine = getattr(coroutine, "cr_await", None)
    return count


class FacadeScenario:
    """One run of the facade's scenario (see the module docstring)."""

    SLOTS = 2

    def __init__(self, seed: int, database: mongoq_sync.Database) -> None:
        self.database = database
        self.run = Run(seed, "facade", database.async_database, HOLDINGS)
        self.shape = Shape.draw(self.run, tasks=(4, 10), end=(40.0, 70.0))
        self.operator = self.queue(database)  # the plain handle: no hooks, exempt, fault-free
        self.put: list[str] = []
        self.workers: list[Worker] = []
        self.slots: list[Worker | None] = [None] * self.SLOTS
        self.generations = [0] * self.SLOTS
        self.parked = 0  # handler threads asleep on the clock
        #: handler threads woken, waiting for their turn, by key
        self.turns: list[tuple[tuple[str, int], anyio.Event]] = []

    def queue(self, db: mongoq_sync.Database) -> mongoq_sync.TaskQueue:
        shape = self.shape
        return mongoq_sync.TaskQueue(
            db, QUEUE, clock=self.run.clock, lease_ttl=shape.lease,
            max_attempts=shape.max_attempts, backoff_base=shape.backoff_base,
            backoff_cap=shape.backoff_base * 8,
        )  # fmt: skip

    def main(self) -> Report:
        run, shape = self.run, self.shape
        with catching_unexpected_errors(run):
            self.operator.setup()
            self.put_tasks([f"t{n}" for n in range(shape.upfront)])
            first = None
            if shape.every is not None:
                first = self.operator.schedule(SCHEDULE, every=shape.every).next_at
            for slot in range(self.SLOTS):
                self.hire(slot)
                self.quiesce()
            in_time = self.drive(self.timeline(), end=shape.end)
            drained = run.clock.now()
            completed = in_time and self.drain()
            if not completed:
                self.wind_down()
            schedule = (first, drained) if first is not None else None
            items = 0
            if completed:
                items = self.database.call(check_run, run, self.workers, self.put, shape, schedule)
        return run.finish(items)

    # ------------------------------------------------------------------------------ time

    async def _quiet(self) -> bool:
        """Whether time may move: the loop has nothing ready, and every handler thread that
        runs is asleep on the clock. Threads woken at one instant go back to their handlers
        one at a time, the next only when this holds again (`nap`), so that what they do
        next comes in the same order in every run of the seed, not the OS scheduler's."""
        await settle(3)
        if _busy_threads() > self.parked + len(self.turns):
            return False  # a handler thread is running
        if self.turns:
            self.turns.pop(0)[1].set()
            return False
        return True

    async def nap(self, seconds: float, key: tuple[str, int]) -> None:
        """A handler thread's sleep on the clock, then its turn (see `_quiet`)."""
        self.parked += 1
        try:
            await self.run.clock.sleep(seconds)
        finally:
            self.parked -= 1
        turn = anyio.Event()
        bisect.insort(self.turns, (key, turn), key=lambda entry: entry[0])
        await turn.wait()

    def quiesce(self) -> bool:
        bound = time.monotonic() + QUIET_BOUND
        while not self.database.call(self._quiet):
            if time.monotonic() > bound:
                return False
            time.sleep(0.0002)
        return True

    def drive(
        self, timeline: Timeline, *, end: float, until: Callable[[], bool] | None = None
    ) -> bool:
        """`engine.drive` for a loop in another thread (the same answer). The events of a step
        run at the quiet point before it (up to one step early), each followed by a quiet
        point: nothing else runs while the driver's thread acts."""
        run = self.run
        while until is None or not until():
            if run.elapsed() >= end:
                return until is None
            if time.monotonic() > run.deadline or not self.quiesce():
                return False
            for event in timeline.due(run.elapsed() + STEP):
                event.act()
                if not self.quiesce():
                    return False
            # In the loop: every sleeper due is woken in one go, before any of them runs.
            self.database.call(run.clock.advance, STEP)
        return True

    # --------------------------------------------------------------------------- workers

    def hire(self, slot: int | None, rates: FaultRates | None = None, **arguments: Any) -> Worker:
        """Start a worker in `slot` (its faults and settings drawn), or the drainer (None)."""
        name = worker_id = "drain"
        if slot is not None:
            name, worker_id = slot_names(self.run, slot, self.generations)
            rates = FaultRates.draw(self.run.rng_for("rates", name), self.shape.lease)
            arguments = Settings.draw(self.run, name, self.shape.lease, batch=2).arguments()
        worker = new_worker(self.run, name, rates, worker_id)
        self.workers.append(worker)
        queue = self.queue(ViewDatabase(self.database, worker.db))
        loop = queue._target()  # the async queue in the portal
        worker.stop = queue.stop
        worker.hard_cancel = partial(self.database.call, loop._cancel_running)
        handler = self.handler(worker)

        def main() -> None:
            try:
                worker.summary = queue.run(handler, worker_id=worker_id, **arguments)
            except Exception as exc:
                self.run.violation("unexpected_errors", f"{name}'s run() raised {exc!r}")
            finally:
                worker.done = True

        threading.Thread(target=main, name=f"campaign {name}", daemon=True).start()
        bound = time.monotonic() + QUIET_BOUND  # until its loop runs (then a stop reaches it)
        while worker.faults.commands == 0 and not worker.done and time.monotonic() < bound:
            time.sleep(0.0002)
        if slot is not None:
            self.slots[slot] = worker
        return worker

    def handler(self, worker: Worker) -> Callable[[Task], Any]:
        run, lease = self.run, self.shape.lease

        def start(task: Task) -> tuple[Any, int]:  # in the portal's loop
            execution = run.start(QUEUE, task.id, task.lease_token, worker.name)
            return execution, len(run.executions[task.id])

        def handle(task: Task) -> Any:
            execution, number = self.database.call(start, task)
            act = Act.draw(run, task.id, number, lease)
            try:
                self.database.call(self.nap, act.seconds, (str(task.id), number))
            except BaseException:
                execution.end(run.clock.now(), "cancelled")
                raise
            execution.end(run.clock.now(), "returned" if act.ending == "returns" else "raised")
            return act.finish(worker.name)

        return handle

    # -------------------------------------------------------------------------- timeline

    def put_tasks(self, ids: list[str]) -> None:
        self.operator.put_many([NewTask(task_id, {"n": task_id}) for task_id in ids])
        self.put.extend(ids)

    def timeline(self) -> Timeline:
        rng, shape, timeline = self.run.rng_for("timeline"), self.shape, Timeline()
        for n in range(shape.later):
            timeline.at(rng.uniform(1, shape.end - 5), "put", partial(self.put_tasks, [f"late{n}"]))
        for n in range(rng.choice((0, 1, 2))):
            timeline.at(rng.uniform(2, shape.end - 5), "cancel", partial(self.cancel_one, n))
        draw_disruptions(
            self.run, timeline, self.SLOTS, shape.end, shape.lease,
            lambda kind, slot: partial(self.disrupt, kind, slot),
        )  # fmt: skip
        return timeline

    def cancel_one(self, number: int) -> None:
        self.operator.cancel(self.run.rng_for("cancel", number).choice(sorted(self.put)))

    def disrupt(self, kind: str, slot: int) -> None:
        worker = self.slots[slot]
        if worker is None:
            return
        if kind.startswith("partition"):
            self.database.call(worker.faults.partition, float(kind.split()[1]))
        elif kind == "restart":
            if worker.fate != "running" or worker.done:
                self.hire(slot)
        elif not worker.done and worker.fate in ("running", "stopped"):
            if kind == "crash":
                worker.fate = "crashed"
                self.database.call(worker.faults.crash)
                worker.hard_cancel()
            elif kind == "cancel":
                worker.fate = "cancelled"
                worker.hard_cancel()
            elif worker.fate == "running":
                worker.fate = "stopped"
                worker.stop()

    # ----------------------------------------------------------------------------- drain

    def drain(self) -> bool:
        """Faults stop, every worker stops, a fault-free worker drains; False on a hang."""

        def calm() -> None:
            for worker in self.workers:
                worker.faults.enabled = False

        self.database.call(calm)
        for worker in list(self.workers):
            if not worker.done and worker.fate == "running":
                worker.fate = "stopped"
                worker.stop()
        self.hire(None, None, concurrency=2, stop_when_drained=True, poll_interval=1.0)
        timeline = Timeline()
        if self.shape.every is not None:  # once the drainer has ticked once
            timeline.at(self.run.elapsed() + STEP, "unschedule",
                        partial(self.operator.unschedule, SCHEDULE))  # fmt: skip
        until = lambda: all(worker.done for worker in self.workers)  # noqa: E731
        return self.drive(timeline, end=self.run.elapsed() + DRAIN, until=until)

    def wind_down(self) -> None:
        """A run that did not finish: say so, cancel every worker, move time on (bounded)."""
        waiting = [worker.name for worker in self.workers if not worker.done]
        late = time.monotonic() > self.run.deadline
        bound = "real-time bound" if late else "drain's clock bound (or a thread never parked)"
        self.run.violation(
            "unexpected_errors",
            f"hang: the run passed its {bound} at {self.run.at(self.run.clock.now())}; still "
            f"running: {', '.join(waiting) or 'none'}",
        )
        for worker in self.workers:
            if not worker.done:
                worker.hard_cancel()
        deadline = time.monotonic() + QUIET_BOUND
        while not all(w.done for w in self.workers) and time.monotonic() < deadline:
            self.database.call(self._quiet)  # hands out the turns of woken handlers
            self.database.call(self.run.clock.advance, 10)
            time.sleep(0.001)


class _Facade:
    name = "facade"

    def run(self, seed: int) -> Report:
        with repeatable():
            database = mongoq_sync.connect()
            try:
                return FacadeScenario(seed, database).main()
            finally:
                database.close()


PRIMITIVE = _Facade()
