"""The task queue's scenario of the run-loop fault campaign: `AsyncTaskQueue.run` under faults.

One run, all drawn from its seed: one raw embedded database and one `ManualClock`; three worker
slots, each an `AsyncTaskQueue` on its own instrumented view (`engine.Crew`: seeded faults at
every command, then the observer) running ``run()`` with a batch size of 1-3 (3 most often), a
concurrency of 1-2 and sometimes a handler time limit, under its own worker id or, half of the
time, under one id every such worker shares (as the slots of one worker do: then only the
claim's token tells their writes apart); 10-30 tasks put up front and as many while running, a
schedule (``every``) on some runs, and an operator (its own view, no faults) cancelling a task
now and then and, in three runs of five, hand-editing 1-4 task documents (`poison`: most often
pending or processing ones) into shapes no worker can use (``attempts`` or ``priority`` set to
a string, null, a bool, NaN or a document: `hostile.SHAPES`). Along the timeline workers are
partitioned (a partition waits, up to 20 s, for its worker to hold a lease), stopped
gracefully, hard-cancelled (``_cancel_running``, what a second signal does) and crashed, and
some slots restart with a new worker. At the end the faults stop, every worker is asked to
stop, and a fault-free worker with ``stop_when_drained=True`` finishes what is left.

The handler records each start (judged by `engine.Run.start`), sleeps on the clock (a quarter
of the time longer than the lease), and returns, raises, or raises `PermanentError`; in three
runs of four a share of its executions are runaways (`hostile.Runaways`): cancelled, they
swallow it and go on for a while, or for good. The checks after the drain, the first three
shared with the facade's scenario:

- lost: a task put that is not ``done``, ``failed`` or ``cancelled``, or a ``done`` task none
  of whose executions returned;
- order: every task of the schedule is one of its ticks, put no earlier than its tick, and the
  latest tick before the drain was put (``missed="once"`` promises it);
- summaries: each worker's ``claimed`` equals the sum of its outcomes (not for a run cut short:
  `engine.check_outcomes`), and the number of ``done`` tasks lies between the summaries'
  ``completed`` and ``completed + unknown`` plus what crashed workers claimed (an unexpected
  error when not);
- poisoned documents (`check_poisoned`): none ran again but under the claim holding it at the
  edit; each one finished then was left as it was, each other one ended failed (set aside
  with an error naming the field, and at most one WARNING naming it and the field, if it was
  pending; or by its holder), done by its holder, or cancelled by the operator, never pending
  or processing; no good task was set aside;
- runaways (`hostile.check_runaways`): abandoned on time, their leases no longer renewed, no
  busy loop; and a hard-cancelled or crashed worker's run ends within `stop_bound`
  (`engine.check_stops`), whatever its handlers do.

A worker that sends `faults.SPIN` commands while the clock stands still (a claim meeting the
same refused document again and again) is a busy loop: counted, and the run cut short.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import anyio

from mongoq import AsyncTaskQueue, NewTask, PermanentError, Task
from mongoq.runtime.loop import WorkerHost
from mongoq.tasks.models import tick_task_id
from mongoq.testing import memory_database, settle
from tests.campaign.engine import (
    Crew,
    FaultRates,
    Holding,
    Report,
    Run,
    Timeline,
    Worker,
    catching_unexpected_errors,
    check_outcomes,
    check_stops,
    cut_short,
    drive,
    instant,
    run_async,
)
from tests.campaign.hostile import GRACE, SHAPES, Runaways, check_runaways

__all__ = [
    "HOLDINGS", "PRIMITIVE", "Act", "Poisoning", "Settings", "Shape", "check_poisoned",
    "check_run", "draw_disruptions", "graceful", "hard_stop", "slot_names", "stop_bound",
]  # fmt: skip

QUEUE = "campaign"
SCHEDULE = "pulse"
TERMINAL = frozenset({"done", "failed", "cancelled"})
OUTCOMES = ("completed", "retried", "failed", "released", "lost", "cancelled", "unknown")
#: Clock seconds per step of the driver.
STEP = 0.25
#: Clock seconds the drain may take before it counts as a hang.
DRAIN = 400.0
#: Seconds a partition waits, one at a time, for its worker to hold a lease.
PARTITION_WAIT = 20
#: What the error of a task set aside (or buried for its attempts) begins with.
UNREADABLE = "unreadable task document"


class TaskHoldings:
    """A task is held while ``processing``, by ``worker_id`` under ``lease_token`` until
    ``lease_until``; a start on a ``cancelled`` task is excused (its holder learns of the
    cancel at its next renewal)."""

    collections: tuple[str, ...] = (QUEUE,)

    def holding(self, collection: str, doc: Mapping[str, Any]) -> Holding | None:
        token, until = doc.get("lease_token"), instant(doc.get("lease_until"))
        if doc.get("status") != "processing" or not token or until is None:
            return None
        return Holding(doc.get("worker_id"), token, until)

    def excused(self, collection: str, doc: Mapping[str, Any]) -> bool:
        return doc.get("status") == "cancelled"


HOLDINGS = TaskHoldings()


# ---------------------------------------------------------------------------------- drawing


@dataclass(frozen=True)
class Shape:
    """What a run looks like."""

    lease: float
    max_attempts: int
    backoff_base: float
    #: clock seconds of faults before the drain
    end: float
    upfront: int
    later: int
    #: the schedule's period in seconds, or None: no schedule
    every: int | None

    @classmethod
    def draw(cls, run: Run, *, tasks: tuple[int, int], end: tuple[float, float]) -> Shape:
        rng = run.rng
        return cls(
            lease=rng.choice((5.0, 8.0, 10.0)),
            max_attempts=rng.randint(3, 6),
            backoff_base=rng.choice((0.5, 1.0, 2.0)),
            end=round(rng.uniform(*end), 2),
            upfront=rng.randint(*tasks),
            later=rng.randint(tasks[0], tasks[1]),
            every=rng.randint(4, 15) if rng.random() < 0.4 else None,
        )

    def queue(self, db: Any, run: Run) -> AsyncTaskQueue:
        return AsyncTaskQueue(
            db, QUEUE, clock=run.clock, lease_ttl=self.lease, max_attempts=self.max_attempts,
            backoff_base=self.backoff_base, backoff_cap=self.backoff_base * 8,
        )  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """One worker's ``run()`` arguments."""

    batch_size: int
    concurrency: int
    handler_timeout: float | None
    poll_interval: float

    @classmethod
    def draw(cls, run: Run, name: str, lease: float, *, batch: int = 3) -> Settings:
        rng = run.rng_for("settings", name)
        return cls(
            batch_size=rng.choice((1, *range(2, batch + 1), batch)),  # the largest most often
            concurrency=rng.randint(1, 2),
            handler_timeout=round(lease * rng.uniform(1.5, 3), 2) if rng.random() < 0.3 else None,
            poll_interval=rng.choice((0.5, 1.0, 2.0)),
        )

    def arguments(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size, "concurrency": self.concurrency,
            "handler_timeout": self.handler_timeout, "poll_interval": self.poll_interval,
        }  # fmt: skip


@dataclass(frozen=True)
class Act:
    """What one handler call does: sleep `seconds` of clock time, then end (``returns``,
    ``raises`` a transient error, or raises ``permanent``ly)."""

    seconds: float
    ending: str

    @classmethod
    def draw(cls, run: Run, task_id: Any, number: int, lease: float) -> Act:
        rng = run.rng_for("handler", task_id, number)
        kind = rng.random()
        share = rng.uniform(1.0, 2.5) if kind < 0.25 else rng.uniform(0, 0.7)
        seconds = round(lease * share, 3)
        roll = rng.random()
        ending = "raises" if roll < 0.12 else "permanent" if roll < 0.17 else "returns"
        return cls(seconds, ending)

    def finish(self, worker: str) -> Any:
        if self.ending == "raises":
            raise RuntimeError("campaign: a transient failure")
        if self.ending == "permanent":
            raise PermanentError("campaign: a permanent failure")
        return {"by": worker}


def draw_disruptions(
    run: Run, timeline: Timeline, slots: int, end: float, lease: float,
    act: Callable[[str, int], Callable[[], Any]],
) -> None:  # fmt: skip
    """Partitions, crashes, stops and hard cancels of `slots` worker slots along `timeline`,
    some followed by a restart; ``act(kind, slot)`` makes each event's action."""
    rng = run.rng_for("disruptions")
    for slot in range(slots):
        for _ in range(rng.choice((1, 2, 3))):
            at, seconds = rng.uniform(3, end - 8), round(rng.uniform(1, 2.2 * lease), 2)
            timeline.at(at, f"partition {slot} {seconds}s", act(f"partition {seconds}", slot))
        for kind in ("crash", "stop", "cancel"):
            if rng.random() < 0.25:
                at = rng.uniform(5, end - 8)
                timeline.at(at, f"{kind} {slot}", act(kind, slot))
                if rng.random() < 0.7:
                    timeline.at(at + rng.uniform(0.5, 2 * lease), f"restart {slot}",
                                act("restart", slot))  # fmt: skip


def stop_bound(lease: float) -> float:
    """Clock seconds a hard-cancelled or crashed worker's run may take to end, from then (or
    from its stop's grace running out, or the end of its partitions: `engine.check_stops`):
    its handlers' grace, then settles each bounded by the lease (the most seen in 200 seeds:
    the grace and 0.8 leases for a task queue, 1.1 for a group transport, 1.7 for a
    dispatcher)."""
    return GRACE + 3 * lease


def graceful(run: Run, worker: Worker, stop: Callable[..., None], lease: float) -> None:
    """`worker`'s graceful stop: `stop` (a primitive's ``stop(grace=None)``), half of the
    time with a grace of a fifth of the lease to two leases (drawn from its name): then what
    still runs that long after the stop is cancelled, and the stop ends in bounded time."""
    rng = run.rng_for("stop grace", worker.name)
    worker.stop_grace = round(lease * rng.uniform(0.2, 2.0), 2) if rng.random() < 0.5 else None
    worker.stop = partial(stop, worker.stop_grace)


def hard_stop(host: WorkerHost) -> Callable[[], None]:
    """A worker's hard cancel, as a second signal gives it: the first signal's `stop` (which
    holds for a ``run`` that has not started its loop yet: it returns at once), then
    ``_cancel_running`` (which reaches only the loops running now). Alone, a hard cancel that
    comes before the worker's ``run`` registered its loop (hired by a restart at the same step)
    would be lost, and that run would go on for good."""

    def cancel() -> None:
        host.stop()
        host._cancel_running()

    return cancel


def slot_names(run: Run, slot: int, generations: list[int]) -> tuple[str, str]:
    """The name of a slot's next worker (``w<slot>.<generation>``) and the worker id it runs
    under: its name, or half of the time the id ``w`` that every such worker shares, as the
    slots of one worker do (and a host restarting under a configured id while its old process
    finishes): then only the claim's token tells their writes apart."""
    name = f"w{slot}.{generations[slot]}"
    generations[slot] += 1
    shared = run.rng_for("worker id", name).random() < 0.5
    return name, "w" if shared else name


# ---------------------------------------------------------------------------------- poisoning


@dataclass(frozen=True)
class Poisoning:
    """An operator's hand edit of a task document into a shape no worker can use: which task,
    which field set to what, when, and the task as it was then (its status, the claim holding
    it, its executions so far, when it last changed)."""

    task_id: str
    field: str
    value: Any
    at: datetime
    status: str
    token: str | None
    runs: int
    updated_at: Any

    def describe(self, run: Run) -> str:
        return (
            f"poisoned {self.task_id!r} ({self.field} set to {self.value!r} at "
            f"{run.at(self.at)}, while {self.status})"
        )


def poison(run: Run, number: int, put: Sequence[str], poisoned: list[Poisoning]) -> None:
    """Poisoning `number` of the run: a hand edit (`hostile.SHAPES`) of one of the tasks `put`,
    most often one pending or processing now, never one already poisoned."""
    rng = run.rng_for("poison", number)
    field, value = rng.choice(SHAPES)
    want = rng.choice(("pending", "processing", "processing", "any"))
    spared = {p.task_id for p in poisoned}
    docs = [d for d in (run.store.document(QUEUE, i) for i in sorted(put) if i not in spared) if d]
    chosen = [d for d in docs if d.get("status") == want] or docs
    if not chosen:
        return
    doc = rng.choice(chosen)
    status, token = doc.get("status"), doc.get("lease_token")
    poisoned.append(Poisoning(
        doc["_id"], field, value, run.clock.now(), str(status),
        token if status == "processing" else None, len(run.executions.get(doc["_id"], ())),
        doc.get("updated_at"),
    ))  # fmt: skip
    run.store.edit(QUEUE, doc["_id"], {field: value})


def check_poisoned(
    run: Run, docs: Mapping[Any, Mapping[str, Any]], poisoned: Sequence[Poisoning],
    cancels: Mapping[str, list[datetime]],
) -> None:  # fmt: skip
    """Every poisoned task ended as a hand edit allows (`_poison_problem`), set aside with at
    most one WARNING naming it and the field when its error says so (none when the set-aside's
    reply was lost); no good task was set aside. `cancels` holds when the operator cancelled
    each task."""
    named = {p.task_id: p for p in poisoned}
    asides = [f for _, f in run.set_aside if f.get("mongoq_collection") == QUEUE]
    for fields in asides:
        if fields.get("mongoq_item") not in {str(task_id) for task_id in named}:
            run.violation(
                "set_aside",
                f"good task set aside: {fields.get('mongoq_item')!r} "
                f"({fields.get('mongoq_error')})",
            )
    for task_id, doc in docs.items():
        if task_id not in named and UNREADABLE in str(doc.get("error") or ""):
            run.violation(
                "set_aside", f"good task set aside: {task_id!r} failed with {doc.get('error')!r}"
            )
    for task_id, poisoning in named.items():
        lines = [f for f in asides if f.get("mongoq_item") == str(task_id)]
        problem = _poison_problem(run, poisoning, docs.get(task_id), cancels, lines)
        if problem is not None:
            run.violation("set_aside", f"{poisoning.describe(run)}: {problem}")


def _poison_problem(
    run: Run, poisoning: Poisoning, doc: Mapping[str, Any] | None,
    cancels: Mapping[str, list[datetime]], lines: list[dict[str, Any]],
) -> str | None:  # fmt: skip
    """What is wrong with how a poisoned task ended, or None. Not run again by any claim but
    the one holding it at the edit; finished then: left as it was; else ended, not pending or
    processing: failed (by its set-aside, naming the field, if pending at the edit; by its
    holder's own verdict too if processing), done by the claim that held it, or cancelled by
    the operator after the edit."""
    later = run.executions.get(poisoning.task_id, [])[poisoning.runs :]
    stranger = next((e for e in later if e.token != poisoning.token), None)
    if stranger is not None:
        return (
            f"run after it was poisoned by {stranger.worker} (claim "
            f"{(stranger.token or '?')[:6]}) at {run.at(stranger.started)}"
        )
    if doc is None:
        return "gone"
    status, error = doc.get("status"), str(doc.get("error") or "")
    if poisoning.status in TERMINAL:
        if status != poisoning.status or doc.get("updated_at") != poisoning.updated_at:
            return f"changed after it was poisoned, finished: now {status} ({error!r})"
        return None
    if status not in TERMINAL:
        return f"ended {_task_state(run, doc)}"
    if status == "cancelled":
        cancelled = any(at >= poisoning.at for at in cancels.get(poisoning.task_id, ()))
        return None if cancelled else "cancelled, yet the operator did not cancel it"
    if status == "done":
        held = poisoning.token is not None and doc.get("lease_token") == poisoning.token
        returned = any(
            e.token == poisoning.token and e.outcome == "returned"
            for e in run.executions.get(poisoning.task_id, ())
        )
        return None if held and returned else "done, yet not by the claim that held it"
    if UNREADABLE in error:
        if f"field {poisoning.field!r}" not in error:
            return f"set aside with an error naming another field: {error!r}"
        # One WARNING, or none when the set-aside's reply was lost (its writer never knew).
        if len(lines) > 1 or any(line.get("mongoq_field") != poisoning.field for line in lines):
            fields = [line.get("mongoq_field") for line in lines]
            return f"set aside with {len(lines)} WARNINGs naming it (fields {fields})"
    elif poisoning.status == "pending":
        return f"failed with {error!r}, which names no field"
    return None


# ------------------------------------------------------------------------------------ checks


def check_run(
    run: Run, workers: Iterable[Worker], put: Iterable[Any], shape: Shape,
    schedule: tuple[datetime, datetime] | None, *, poisoned: Sequence[Poisoning] = (),
    cancels: Mapping[str, list[datetime]] | None = None,
) -> int:  # fmt: skip
    """The checks after the drain (see the module docstring); returns the number of tasks.
    `schedule` is (first tick, when the drain started), None without a schedule; `poisoned`
    the tasks an operator edited into shapes no worker can use (`check_poisoned`), and
    `cancels` when the operator cancelled each task."""
    docs = {doc["_id"]: doc for doc in run.store.documents(QUEUE)}
    spoiled = {p.task_id for p in poisoned}
    for task_id in put:
        if task_id not in docs:
            run.violation("lost", f"lost: task {task_id!r} was put and is not stored")
    for task_id, doc in docs.items():
        if doc.get("status") not in TERMINAL:
            if task_id not in spoiled:  # (a poisoned one's end is `check_poisoned`'s)
                run.violation("lost", f"lost: task {task_id!r} ended {_task_state(run, doc)}")
        elif doc.get("status") == "done" and not run.ended_normally(task_id):
            run.violation("lost", f"lost: task {task_id!r} is done, yet no execution returned")
    if schedule is not None and shape.every is not None:
        _check_ticks(run, docs, schedule, shape.every)
    check_poisoned(run, docs, poisoned, cancels or {})
    _check_summaries(run, list(workers), sum(d.get("status") == "done" for d in docs.values()))
    return len(docs)


def _task_state(run: Run, doc: Mapping[str, Any]) -> str:
    return (
        f"{doc.get('status')} (attempts {doc.get('attempts')}, lease until "
        f"{run.at(instant(doc.get('lease_until')))}, worker {doc.get('worker_id')})"
    )


def _check_ticks(
    run: Run, docs: Mapping[Any, Mapping[str, Any]], schedule: tuple[datetime, datetime],
    every: int,
) -> None:  # fmt: skip
    first, drained = schedule
    period = timedelta(seconds=every)
    grid: dict[str, datetime] = {}
    tick = first
    while tick <= run.clock.now():
        grid[tick_task_id(SCHEDULE, tick)] = tick
        tick += period
    ticks = {i: d for i, d in docs.items() if isinstance(i, str) and i.startswith(f"{SCHEDULE}@")}
    for task_id, doc in sorted(ticks.items()):
        created = instant(doc.get("created_at"))
        if task_id not in grid:
            run.violation("order_violations", f"order: {task_id!r} is not a tick of the schedule")
        elif created is not None and created < grid[task_id]:
            run.violation(
                "order_violations",
                f"order: {task_id!r} was put at {run.at(created)}, before its tick",
            )
    if drained >= first:
        latest = first + ((drained - first) // period) * period
        if tick_task_id(SCHEDULE, latest) not in ticks:
            run.violation(
                "order_violations",
                f"order: the latest tick before the drain ({run.at(latest)}) was never put "
                f"(ticks put: {', '.join(run.at(grid[t]) for t in sorted(ticks) if t in grid)})",
            )


def _check_summaries(run: Run, workers: list[Worker], done: int) -> None:
    low = high = 0
    for worker in workers:
        summary = worker.summary
        if summary is None:  # crashed: its run was cancelled and returned nothing
            high += worker.observer.claims
            continue
        accounted = check_outcomes(run, worker, OUTCOMES)
        low += summary.completed
        high += summary.completed + summary.unknown
        if cut_short(worker):
            high += max(0, summary.claimed - accounted, worker.observer.claims - accounted)
    if not low <= done <= high:
        run.violation(
            "unexpected_errors",
            f"summary: {done} task(s) done, but the summaries say between {low} and {high}",
        )


# ---------------------------------------------------------------------------------- scenario


class TaskScenario:
    """One run of the task queue's scenario (see the module docstring)."""

    SLOTS = 3

    def __init__(self, seed: int) -> None:
        raw = memory_database()
        self.run = Run(seed, "tasks", raw, HOLDINGS)
        self.shape = Shape.draw(self.run, tasks=(10, 30), end=(60.0, 120.0))
        self.operator = self.shape.queue(raw, self.run)  # no hooks: exempt, fault-free
        self.put: list[str] = []
        self.slots: list[Worker | None] = [None] * self.SLOTS
        self.generations = [0] * self.SLOTS
        self.schedule: tuple[datetime, datetime] | None = None
        self.timeline_ = Timeline()
        self.runaways = Runaways(self.run)
        self.poisoned: list[Poisoning] = []
        #: when the operator cancelled each task
        self.cancels: dict[str, list[datetime]] = {}

    async def main(self) -> Report:
        run, shape = self.run, self.shape
        with catching_unexpected_errors(run):
            await self.operator.setup()
            await self.put_tasks([f"t{n}" for n in range(shape.upfront)])
            first = None
            if shape.every is not None:
                first = (await self.operator.schedule(SCHEDULE, every=shape.every)).next_at
            async with anyio.create_task_group() as group:
                crew = Crew(run, group)
                for slot in range(self.SLOTS):
                    self.hire(crew, slot)
                timeline = self.timeline(crew)
                in_time = await drive(run, timeline, end=shape.end, step=STEP)
                drained = run.clock.now()
                completed = await self.drain(crew, in_time)
            if first is not None:
                self.schedule = (first, drained)
            items = 0
            if completed:
                items = check_run(
                    run, crew.workers, self.put, shape, self.schedule, poisoned=self.poisoned,
                    cancels=self.cancels,
                )  # fmt: skip
                check_runaways(run, shape.lease)
                check_stops(run, crew.workers, stop_bound(shape.lease))
        return run.finish(items)

    async def put_tasks(self, ids: list[str]) -> None:
        await self.operator.put_many([NewTask(task_id, {"n": task_id}) for task_id in ids])
        self.put.extend(ids)

    def hire(self, crew: Crew, slot: int) -> None:
        name, worker_id = slot_names(self.run, slot, self.generations)
        worker = crew.hire(
            name, FaultRates.draw(self.run.rng_for("rates", name), self.shape.lease), worker_id
        )
        settings = Settings.draw(self.run, name, self.shape.lease)
        queue = self.shape.queue(worker.db, self.run)
        graceful(self.run, worker, queue.stop, self.shape.lease)
        worker.hard_cancel = hard_stop(queue)
        crew.start(worker, partial(
            queue.run, self.handler(worker), worker_id=worker_id, **settings.arguments()
        ))  # fmt: skip
        self.slots[slot] = worker

    def handler(self, worker: Worker) -> Callable[[Task], Awaitable[Any]]:
        run, lease, runaways = self.run, self.shape.lease, self.runaways

        async def handle(task: Task) -> Any:
            execution = run.start(QUEUE, task.id, task.lease_token, worker.name)
            number = len(run.executions[task.id])
            act = Act.draw(run, task.id, number, lease)
            claim = (QUEUE, task.id, task.lease_token or "")
            runaway = runaways.draw(execution, repr(task.id), claim, task.id, number)
            await runaways.sleep(execution, act.seconds, runaway)
            execution.end(run.clock.now(), "returned" if act.ending == "returns" else "raised")
            return act.finish(worker.name)

        return handle

    def timeline(self, crew: Crew) -> Timeline:
        rng, shape, timeline = self.run.rng_for("timeline"), self.shape, Timeline()
        self.timeline_ = timeline
        for n in range(shape.later):
            timeline.at(rng.uniform(1, shape.end - 5), "put", partial(self.put_tasks, [f"late{n}"]))
        for n in range(rng.choice((0, 1, 2, 3))):
            timeline.at(rng.uniform(2, shape.end - 5), "cancel", partial(self.cancel_one, n))
        spoil = self.run.rng_for("poisonings")  # drawn apart: the draws above stay the seed's
        for n in range(spoil.choice((0, 0, 1, 2, 4))):
            timeline.at(spoil.uniform(2, shape.end - 5), "poison",
                        partial(poison, self.run, n, self.put, self.poisoned))  # fmt: skip
        draw_disruptions(
            self.run, timeline, self.SLOTS, shape.end, shape.lease,
            lambda kind, slot: partial(self.disrupt, crew, kind, slot),
        )  # fmt: skip
        return timeline

    async def cancel_one(self, number: int) -> None:
        task_id = self.run.rng_for("cancel", number).choice(sorted(self.put))
        self.cancels.setdefault(task_id, []).append(self.run.clock.now())
        await self.operator.cancel(task_id)

    def disrupt(self, crew: Crew, kind: str, slot: int, tries: int = 0) -> None:
        worker = self.slots[slot]
        waits = kind.startswith("partition") and tries < PARTITION_WAIT
        if worker is not None and waits and not crew.holding(worker, QUEUE):
            # A partition while the worker holds nothing shows little: wait for work.
            again = partial(self.disrupt, crew, kind, slot, tries + 1)
            self.timeline_.at(self.run.elapsed() + 1.0, kind, again)
            return
        crew.disrupt(worker, kind, partial(self.hire, crew, slot))

    async def drain(self, crew: Crew, in_time: bool) -> bool:
        """Faults stop, every worker stops, a fault-free worker drains; False on a hang (or
        when the run was already past its real-time bound: not `in_time`)."""
        run = self.run
        if not in_time:
            await wind_down(run, crew)
            return False
        crew.calm_and_stop()  # and the events still ahead (restarts, partitions) are dropped
        timeline = Timeline()
        drainer = crew.hire("drain", None)
        queue = self.shape.queue(drainer.db, run)
        crew.start(drainer, partial(
            queue.run, self.handler(drainer), worker_id="drain", concurrency=2,
            stop_when_drained=True, poll_interval=1.0,
        ))  # fmt: skip
        if self.shape.every is not None:  # once the drainer has ticked once
            timeline.at(run.elapsed() + STEP, "unschedule", partial(self.operator.unschedule,
                                                                    SCHEDULE))  # fmt: skip
        finished = await drive(run, timeline, end=run.elapsed() + DRAIN, step=STEP,
                               until=crew.all_done)  # fmt: skip
        if not finished:
            await wind_down(run, crew)
        return finished


async def wind_down(run: Run, crew: Crew) -> None:
    """A run that did not finish: say so, cancel every worker, and move time on until their
    tasks end (shielded settles wait on the clock)."""
    waiting = [w.name for w in crew.workers if not w.done]
    going = [r for r in run.runaways if r.ended is None]
    check_runaways(run, None)  # a handler not abandoned may be why
    run.end_runaways()  # ... and must not hold the run
    bound = "drain's clock bound"
    if time.monotonic() > run.deadline:
        bound = "real-time bound" if run.cut_short is None else f"bound ({run.cut_short})"
    also = f"; {len(going)} runaway(s) still going, e.g. {going[0].describe(run)}" if going else ""
    run.violation(
        "unexpected_errors",
        f"hang: the run passed its {bound} at {run.at(run.clock.now())}; still running: "
        f"{', '.join(waiting) or 'none'}{also}",
    )
    crew.abort()
    for _ in range(1000):
        if crew.all_done():
            return
        await settle(3)
        run.clock.advance(10)


class _Tasks:
    name = "tasks"

    def run(self, seed: int) -> Report:
        return run_async(TaskScenario(seed).main)


PRIMITIVE = _Tasks()
