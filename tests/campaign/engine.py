"""The run-loop fault campaign's machinery, shared by every primitive's scenario module.

A scenario module (``tasks.py``, ``facade.py``, ``groups.py``, ``outbox.py``) has a top-level
``PRIMITIVE = ...``: an object with a ``name`` (the module's) and ``run(seed) -> Report``, one
seeded run of that primitive's run loops under faults, checked from outside the library. This
module is what such a run is built from, and knows no primitive:

- `Holdings`: what the scenario module supplies so that documents can be judged: which
  collections hold leases, and how to read "who holds this item, with which token, until when"
  (`Holding`) from a raw document;
- `Run`: one run's world: the seed and its random streams, the `ManualClock` every worker
  shares, synchronous reads of the raw embedded database (`Store`), the counters and findings
  (`Report`), the leases seen, and every handler execution, each start judged against the raw
  document at that instant (`Run.start`): under its own live lease, an overlap (another
  claim's lease live, or another execution still running under a lease last seen live), or a
  late start (its lease ended); and the runaway handlers (``hostile``), ended once the run is
  over (`Run.end_runaways`);
- `Faults` (module ``faults``): seeded faults at every command of one worker;
- `Observer`: a hook that reads the documents around every write of one worker, attributes
  writes to the claim they work for, and counts a change to a document held under a live lease
  by another claim (a stale settle accepted), and the claims each worker's writes made;
- `Crew`: asyncio workers started, stopped, hard-cancelled and crashed, and `check_stops`: a
  hard-cancelled or crashed worker's run ends within a bound; `Timeline` and `drive`: the
  only way time moves (settle, advance a step, run the events that fell due);
- `catching_unexpected_errors`: the ``mongoq`` log records that say "unexpected error", and
  those that say a handler was abandoned or a document set aside (kept for the checks).

The reports live in ``report``, the running of seeds (forked, repeatable) in ``runner``; their
names are re-exported here.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import heapq
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import anyio
import anyio.abc

from mongoq import _driver
from mongoq.clock import stored_instant
from mongoq.testing import ManualClock, Operation, instrument, settle
from tests.campaign.faults import SPIN, FaultRates, Faults
from tests.campaign.report import COUNTERS, KEPT, Finding, Report, error_text
from tests.campaign.runner import (
    Primitive,
    primitives,
    repeatable,
    run_async,
    run_seeds,
    scenario,
    scenario_names,
    seed_library,
    until_caught,
)

__all__ = [
    "COUNTERS",
    "EPOCH",
    "KEPT",
    "REAL_BOUND",
    "WRITES",
    "Crew",
    "Execution",
    "FaultRates",
    "Faults",
    "Finding",
    "Holding",
    "Holdings",
    "Observer",
    "Primitive",
    "Report",
    "Run",
    "Store",
    "Timeline",
    "Worker",
    "catching_unexpected_errors",
    "check_outcomes",
    "check_stops",
    "cut_short",
    "drive",
    "error_text",
    "instant",
    "mentions",
    "new_worker",
    "primitives",
    "repeatable",
    "run_async",
    "run_seeds",
    "scenario",
    "scenario_names",
    "until_caught",
]

#: Every run's clock starts here: tick ids and log lines repeat from one run of a seed to the next.
EPOCH = datetime(2030, 1, 1, tzinfo=UTC)
#: Real seconds a run may take; a run that needs longer is itself a finding.
REAL_BOUND = 20.0
#: Commands that write (the observer reads the documents around them).
WRITES = frozenset(
    {
        "bulk_write", "delete_many", "delete_one", "find_one_and_delete", "find_one_and_replace",
        "find_one_and_update", "insert_many", "insert_one", "replace_one", "update_many",
        "update_one",
    }
)  # fmt: skip


# ---------------------------------------------------------------------------------- holdings


@dataclass(frozen=True)
class Holding:
    """Who holds an item, under which claim, until when."""

    holder: str | None
    token: str
    until: datetime

    def describe(self, run: Run) -> str:
        return f"held by {self.holder} (claim {self.token[:6]}) until {run.at(self.until)}"


class Holdings(Protocol):
    """How a primitive's raw documents say who holds what."""

    #: the collections whose documents carry leases
    collections: tuple[str, ...]

    def holding(self, collection: str, doc: Mapping[str, Any]) -> Holding | None:
        """The lease on `doc`, or None when nobody holds it."""
        ...

    def excused(self, collection: str, doc: Mapping[str, Any]) -> bool:
        """Whether a start on `doc`'s item without a live lease is no violation (an operator
        ended the item: its holder learns it at its next renewal)."""
        ...


def instant(value: Any) -> datetime | None:
    """A stored instant (naive UTC on the embedded backend) as an aware datetime."""
    return stored_instant(value)


class Store:
    """Synchronous reads of the raw embedded database: no await, so a read is atomic with what
    the caller does around it. Documents are the store's own: read them, never change them."""

    def __init__(self, raw_db: Any) -> None:
        # mongomock-motor's database hands out its mongomock database as `delegate` (on a
        # collection, `delegate` would be a sub-collection of that name).
        self._db = _driver.unwrap(raw_db).delegate
        self._collections: dict[str, Any] = {}

    def _documents(self, collection: str) -> Any:
        if collection not in self._collections:
            self._collections[collection] = self._db.get_collection(collection)
        handle = self._collections[collection]
        # mongomock keeps a collection's documents in a dict by _id; reading it copies nothing.
        return getattr(getattr(handle, "_store", None), "_documents", None), handle

    def documents(self, collection: str) -> list[Mapping[str, Any]]:
        docs, handle = self._documents(collection)
        return list(docs.values()) if docs is not None else list(handle.find())

    def document(self, collection: str, doc_id: Any) -> Mapping[str, Any] | None:
        docs, handle = self._documents(collection)
        if docs is not None:
            found: Mapping[str, Any] | None = docs.get(doc_id)
            return found
        result: Mapping[str, Any] | None = handle.find_one({"_id": doc_id})
        return result

    def edit(self, collection: str, doc_id: Any, fields: Mapping[str, Any]) -> None:
        """An operator's hand edit (``$set`` of `fields`), synchronous: atomic with what the
        caller reads around it, and seen by no worker's hooks."""
        self._documents(collection)[1].update_one({"_id": doc_id}, {"$set": dict(fields)})


# --------------------------------------------------------------------------------------- run


@dataclass(eq=False)
class Execution:
    """One handler call: its claim, when it started, how the start was judged, how it ended
    (``returned``, ``raised`` or ``cancelled``)."""

    item: Any
    token: str | None
    worker: str
    started: datetime
    verdict: str
    ended: datetime | None = None
    outcome: str | None = None

    def end(self, at: datetime, outcome: str) -> None:
        self.ended, self.outcome = at, outcome


class Run:
    """One seeded run's world (see the module docstring)."""

    def __init__(self, seed: int, primitive: str, raw_db: Any, holdings: Holdings) -> None:
        self.seed = seed
        self.primitive = primitive
        seed_library(seed)
        self.rng = random.Random(seed)
        self.clock = ManualClock(EPOCH)
        self.raw = raw_db
        self.store = Store(raw_db)
        self.holdings = holdings
        self.report = Report(primitive, runs=1)
        self.executions: dict[Any, list[Execution]] = {}
        #: every lease seen in a document, by (collection, document id, token): its latest
        #: end (by item: the items of one claim, a batch, share its token, and the others are
        #: still renewed when one of them is let go)
        self.held_until: dict[tuple[str, Any, str], datetime] = {}
        #: the handler executions that swallowed their cancellation (`hostile.Runaway`)
        self.runaways: list[Any] = []
        #: the library's WARNINGs that it abandoned a handler: (when, the handler's name)
        self.abandoned: list[tuple[datetime, str]] = []
        #: the library's WARNINGs that it set a document aside: (when, the record's fields)
        self.set_aside: list[tuple[datetime, dict[str, Any]]] = []
        #: set once the run is over: a runaway still going on then ends
        self.over = False
        #: why the run was cut short before its real-time bound (a busy loop), if it was
        self.cut_short: str | None = None
        self.deadline = time.monotonic() + REAL_BOUND
        self._began = time.monotonic()

    def rng_for(self, *key: Any) -> random.Random:
        """A random stream of its own for `key`: draws elsewhere cannot shift it."""
        return random.Random(":".join(map(str, (self.seed, *key))))

    def elapsed(self) -> float:
        return (self.clock.now() - EPOCH).total_seconds()

    def at(self, moment: datetime | None) -> str:
        return "never" if moment is None else f"+{(moment - EPOCH).total_seconds():.2f}s"

    def violation(self, counter: str, text: str) -> None:
        self.report.count(Finding(self.seed, counter, text))

    def spun(self, worker: str, op: Operation) -> None:
        """`worker` sent `faults.SPIN` commands without the clock moving (the last one
        `op`): a busy loop. Counted, and the run cut short (it would spin to its real-time
        bound): the driver's next step ends it as a hang."""
        self.violation(
            "unexpected_errors",
            f"busy loop: {worker} sent {SPIN} commands at {self.at(self.clock.now())} without "
            f"the clock moving (the last {op.collection}.{op.name})",
        )
        self.cut_short = self.cut_short or f"busy loop of {worker}"
        self.deadline = 0.0

    def end_runaways(self) -> None:
        """The run is over: every runaway still going on ends (cancelled, it gives up)."""
        self.over = True
        for runaway in self.runaways:
            if runaway.ended is None and runaway.task is not None:
                runaway.task.cancel()

    def finish(self, items: int) -> Report:
        self.end_runaways()
        self.report.items = items
        self.report.seconds = time.monotonic() - self._began
        return self.report

    def start(
        self, collection: str, doc_id: Any, token: str | None, worker: str, item: Any = None
    ) -> Execution:
        """Record a handler's start of `item` (default: `doc_id`) under claim `token`, judged
        by the raw document `doc_id` right now (call it before the handler's first await):
        under its own live lease; an overlap when another claim's lease on it is live, or when
        another execution of the item still runs under a lease on it last seen live (a stale
        write may have erased it from the document; an abandoned handler runs on, its lease no
        longer renewed, while the other items of its claim may be); late when its lease has
        ended."""
        now = self.clock.now()
        doc = self.store.document(collection, doc_id)
        held = self.holdings.holding(collection, doc) if doc is not None else None
        key = doc_id if item is None else item
        running = [
            other
            for other in self.executions.get(key, ())
            if other.ended is None and other.token != token
            and self.held_until.get((collection, doc_id, other.token or ""), EPOCH) >= now
        ]  # fmt: skip
        if held is not None and held.token != token and held.until >= now:
            verdict, state = "overlap", held.describe(self)
        elif running:
            other = running[0]
            verdict = "overlap"
            state = (
                f"{_describe_doc(held, doc, self)}; {other.worker}'s execution (claim "
                f"{(other.token or '?')[:6]}) runs under a lease seen until "
                f"{self.at(self.held_until[(collection, doc_id, other.token or '')])}"
            )
        elif held is not None and held.token == token and held.until > now:
            verdict, state = "live", ""
        elif doc is not None and self.holdings.excused(collection, doc):
            verdict, state = "excused", ""
        else:
            verdict, state = "late", _describe_doc(held, doc, self)
        execution = Execution(key, token, worker, now, verdict)
        self.executions.setdefault(key, []).append(execution)
        if verdict in ("overlap", "late"):
            self.violation(
                "overlaps" if verdict == "overlap" else "late_starts",
                f"{'overlap' if verdict == 'overlap' else 'late start'}: {key!r} started by "
                f"{worker} (claim {(token or '?')[:6]}) at {self.at(now)}; the document: {state}",
            )
        return execution

    def ended_normally(self, item: Any) -> bool:
        return any(e.outcome == "returned" for e in self.executions.get(item, ()))


def _describe_doc(held: Holding | None, doc: Mapping[str, Any] | None, run: Run) -> str:
    if held is not None:
        return held.describe(run)
    if doc is None:
        return "gone"
    return f"{doc.get('status', '?')}, held by nobody"


# ---------------------------------------------------------------------------------- observer


def mentions(value: Any, token: Any) -> bool:
    """Whether `token` appears anywhere in a command's arguments (filters, updates, bulk
    operations): a write that names a lease's token is fenced on it."""
    if value == token and isinstance(value, str | int):
        return True
    if isinstance(value, Mapping):
        return any(mentions(item, token) for item in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(mentions(item, token) for item in value)
    bulk_filter = getattr(value, "_filter", None)  # pymongo's UpdateOne, UpdateMany, ...
    return bulk_filter is not None and mentions(bulk_filter, token)


#: The claim the current asyncio task works for: set by the observer when it sees that task's
#: write take an item under a new token, inherited by the tasks it starts (a heartbeat's).
_CLAIM: contextvars.ContextVar[str | None] = contextvars.ContextVar("campaign_claim", default=None)


class Observer:
    """Reads the documents around every write of one worker (the last hook of its view, so
    nothing runs between its reads and the write).

    A write takes an item when the item is held afterwards by this worker under a token it was
    not held under before: the observer counts it (`claims`) and from then on attributes the
    writes of the asyncio task that sent it, and of the tasks that task starts, to that claim.
    A write that changes a document held under a live lease (ending at or after now) is a stale
    settle accepted unless it is attributed to that lease's claim or names its token (is fenced
    on it): claims never take a live lease, and a holder's writes come from the task that
    claimed. A write that lost its fence is thus judged by whose claim sent it, not by how its
    filter looks. Every lease seen is remembered by item and token (`Run.held_until`), for the
    overlap check of `Run.start` and the runaways' renewal check."""

    def __init__(self, run: Run, writer: str, worker_id: str | None = None) -> None:
        self.run = run
        self.writer = writer
        #: the id the worker's documents carry (several instances may share one)
        self.worker_id = worker_id or writer
        self.claims = 0
        #: the tokens of the claims this worker's writes made
        self.tokens: set[str] = set()
        self._pending: dict[int, tuple[datetime, str | None, dict[Any, str], dict[Any, Any]]] = {}

    async def before(self, op: Operation) -> None:
        holdings = self.run.holdings
        if op.name not in WRITES or op.collection not in holdings.collections:
            return
        now = self.run.clock.now()
        tokens: dict[Any, str] = {}
        live: dict[Any, Any] = {}
        for doc in self.run.store.documents(op.collection):
            held = holdings.holding(op.collection, doc)
            if held is None:
                continue
            tokens[doc["_id"]] = held.token
            if held.until >= now:
                live[doc["_id"]] = (held, copy.deepcopy(dict(doc)))
        self._pending[id(op)] = (now, _CLAIM.get(), tokens, live)

    async def after(self, op: Operation, error: BaseException | None) -> None:
        entry = self._pending.pop(id(op), None)
        if entry is None:
            return
        now, claim, tokens, live = entry
        holdings, store = self.run.holdings, self.run.store
        for doc in store.documents(op.collection):
            held = holdings.holding(op.collection, doc)
            if held is None:
                continue
            self.run.held_until[(op.collection, doc["_id"], held.token)] = held.until
            if held.holder == self.worker_id and tokens.get(doc["_id"]) != held.token:
                self.claims += 1
                self.tokens.add(held.token)
                _CLAIM.set(held.token)
        for doc_id, (held, before) in live.items():
            current = store.document(op.collection, doc_id)
            if current is not None and dict(current) == before:
                continue
            if held.token == claim or mentions((op.args, op.kwargs), held.token):
                continue
            self.run.violation(
                "stale_settles",
                f"stale settle: {op.collection}.{op.name} of {self.writer} "
                f"({_claim_text(claim)}) at {self.run.at(now)} changed {doc_id!r}, "
                f"{held.describe(self.run)}, to {_state(current)}",
            )


def _claim_text(claim: str | None) -> str:
    return "no claim" if claim is None else f"claim {claim[:6]}"


def _state(doc: Mapping[str, Any] | None) -> str:
    return "nothing (deleted)" if doc is None else str(doc.get("status", "?"))


# -------------------------------------------------------------------------------------- crew


@dataclass(eq=False)
class Worker:
    """One worker instance: its faults, its observer, its view of the database, and how its
    run ended. The scenario sets `stop` and `hard_cancel` (the primitive's own calls)."""

    name: str
    faults: Faults
    observer: Observer
    db: Any
    stop: Callable[[], None] = lambda: None
    hard_cancel: Callable[[], None] = lambda: None
    #: running, stopped (asked to), cancelled (hard), crashed
    fate: str = "running"
    done: bool = False
    #: the grace its graceful stop gives (`stop(grace=)`: what still runs that long after is
    #: cancelled), None for none: the scenario's, with `stop`
    stop_grace: float | None = None
    #: when it was first asked to stop, first hard-cancelled or crashed, and when its run
    #: ended (the clock's)
    stopped_at: datetime | None = None
    hard_at: datetime | None = None
    ended_at: datetime | None = None
    summary: Any = None
    scope: anyio.CancelScope | None = None


def new_worker(
    run: Run,
    name: str,
    rates: FaultRates | None,
    worker_id: str | None = None,
    observer: Observer | None = None,
) -> Worker:
    """A worker `name` with its own view of the raw database: its faults (none when `rates`
    is None), then its observer (a primitive's own, or the engine's); its documents carry
    `worker_id` (default: `name`)."""
    faults = Faults(run, name, rates or FaultRates())
    faults.enabled = rates is not None
    if observer is None:
        observer = Observer(run, name, worker_id)
    return Worker(name, faults, observer, instrument(run.raw, faults, observer))


class Crew:
    """The workers of one run, as asyncio tasks in `group`."""

    def __init__(self, run: Run, group: anyio.abc.TaskGroup) -> None:
        self.run = run
        self.group = group
        self.workers: list[Worker] = []

    def hire(
        self,
        name: str,
        rates: FaultRates | None,
        worker_id: str | None = None,
        observer: Observer | None = None,
    ) -> Worker:
        worker = new_worker(self.run, name, rates, worker_id, observer)
        self.workers.append(worker)
        return worker

    def start(self, worker: Worker, main: Callable[[], Awaitable[Any]]) -> None:
        """Run `main()` (the primitive's ``run``) as `worker`; its summary is kept."""
        self.group.start_soon(self._supervise, worker, main)

    async def _supervise(self, worker: Worker, main: Callable[[], Awaitable[Any]]) -> None:
        try:
            with anyio.CancelScope() as scope:
                worker.scope = scope
                if worker.fate == "crashed":
                    return
                try:
                    worker.summary = await main()
                except Exception as exc:
                    self.run.violation(
                        "unexpected_errors", f"{worker.name}'s run() raised {error_text(exc)}"
                    )
        finally:
            worker.done = True
            worker.ended_at = self.run.clock.now()

    def stop(self, worker: Worker) -> None:
        if worker.fate == "running" and not worker.done:
            worker.fate = "stopped"
            worker.stopped_at = self.run.clock.now()
            worker.stop()

    def cancel(self, worker: Worker) -> None:
        if worker.fate in ("running", "stopped") and not worker.done:
            worker.fate = "cancelled"
            worker.hard_at = worker.hard_at or self.run.clock.now()
            worker.hard_cancel()

    def crash(self, worker: Worker) -> None:
        if worker.fate != "crashed" and not worker.done:
            worker.fate = "crashed"
            worker.hard_at = worker.hard_at or self.run.clock.now()
            worker.faults.crash()
            if worker.scope is not None:
                worker.scope.cancel()

    def disrupt(self, worker: Worker | None, kind: str, rehire: Callable[[], Any]) -> None:
        """Apply one drawn disruption to `worker` (a slot's, None when empty): ``partition S``,
        ``restart`` (`rehire()` once it has ended), ``crash``, ``stop`` or ``cancel``."""
        if worker is None:
            return
        if kind.startswith("partition"):
            worker.faults.partition(float(kind.split()[1]))
        elif kind == "restart":
            if worker.fate != "running" or worker.done:
                rehire()
        else:
            {"crash": self.crash, "stop": self.stop, "cancel": self.cancel}[kind](worker)

    def holding(self, worker: Worker, collection: str) -> bool:
        """Whether `worker` holds an item of `collection` under a lease that has not ended."""
        now, holdings = self.run.clock.now(), self.run.holdings
        for doc in self.run.store.documents(collection):
            held = holdings.holding(collection, doc)
            if held is not None and held.until >= now and held.token in worker.observer.tokens:
                return True
        return False

    def calm(self) -> None:
        """Faults stop (a crashed worker stays crashed)."""
        for worker in self.workers:
            worker.faults.enabled = False

    def calm_and_stop(self) -> None:
        """Before a drain: faults stop, and every worker is asked to stop gracefully."""
        self.calm()
        for worker in list(self.workers):
            self.stop(worker)

    def all_done(self) -> bool:
        return all(worker.done for worker in self.workers)

    def abort(self) -> None:
        for worker in self.workers:
            if worker.scope is not None:
                worker.scope.cancel()


def cut_short(worker: Worker) -> bool:
    """Whether `worker`'s run may have been cut short: crashed, hard-cancelled, or stopped with
    a grace that ran out before its run ended (what still ran was then cancelled, as a hard
    cancel does)."""
    if worker.fate in ("crashed", "cancelled"):
        return True
    if worker.stopped_at is None or worker.stop_grace is None or worker.ended_at is None:
        return False
    return worker.ended_at >= worker.stopped_at + timedelta(seconds=worker.stop_grace)


def check_outcomes(run: Run, worker: Worker, names: Iterable[str]) -> int:
    """The summary check every scenario shares: `worker`'s summary (it has one: its run
    returned) says it ``claimed`` as many items as its outcomes `names` add up to, unless its
    run was cut short (`cut_short`: then it may have claimed some it counted nowhere). Returns
    what they add up to."""
    summary = worker.summary
    outcomes: dict[str, int] = {name: getattr(summary, name) for name in names}
    accounted = sum(outcomes.values())
    if not cut_short(worker) and summary.claimed != accounted:
        run.violation(
            "unexpected_errors",
            f"summary: {worker.name} claimed {summary.claimed} but its outcomes add up to "
            f"{accounted} ({', '.join(f'{k} {v}' for k, v in outcomes.items() if v)})",
        )
    return accounted


def check_stops(run: Run, workers: Iterable[Worker], bound: float) -> None:
    """A worker hard-cancelled or crashed (`Worker.hard_at`) ends its run within `bound`
    seconds of the clock from then, and one stopped with a grace (`Worker.stop_grace`) within
    `bound` of the grace's end, or from the end of its last partition if later (a settle held
    by one waits for it), whatever its handlers do: one that swallows its cancellation is
    abandoned after a grace, the stop does not wait for it. A graceful stop without a grace
    lets its handlers finish: the drain's bound (a hang) is what holds it."""
    for worker in workers:
        since = [worker.hard_at] if worker.hard_at is not None else []
        if worker.stopped_at is not None and worker.stop_grace is not None:
            since.append(worker.stopped_at + timedelta(seconds=worker.stop_grace))
        if not since:
            continue
        start = max(min(since), worker.faults.until or min(since))
        took = None if worker.ended_at is None else (worker.ended_at - start)
        if took is None or took.total_seconds() > bound:
            grace = "" if worker.stop_grace is None else f" with a grace of {worker.stop_grace:g} s"
            run.violation(
                "runaways",
                f"slow stop: {worker.name}, stopped{grace} at {run.at(worker.stopped_at)}, "
                f"hard-cancelled or crashed at {run.at(worker.hard_at)}, its partitions over "
                f"at {run.at(worker.faults.until)}: its run ended at {run.at(worker.ended_at)}, "
                f"more than {bound:g} s after {run.at(start)}",
            )


# ---------------------------------------------------------------------------------- timeline


@dataclass(order=True)
class _Event:
    at: float
    order: int
    label: str = field(compare=False)
    act: Callable[[], Any] = field(compare=False)


class Timeline:
    """Events at clock offsets (seconds after `EPOCH`), run by `drive` when they fall due."""

    def __init__(self) -> None:
        self._events: list[_Event] = []
        self._order = itertools.count()

    def at(self, seconds: float, label: str, act: Callable[[], Any]) -> None:
        heapq.heappush(self._events, _Event(seconds, next(self._order), label, act))

    def due(self, elapsed: float) -> list[_Event]:
        events = []
        while self._events and self._events[0].at <= elapsed:
            events.append(heapq.heappop(self._events))
        return events


async def drive(
    run: Run,
    timeline: Timeline,
    *,
    end: float,
    step: float,
    until: Callable[[], bool] | None = None,
) -> bool:
    """Move time: settle, advance the clock by `step`, run the events due, until `until()`
    holds or the clock reaches `end` (seconds after `EPOCH`). True when the drive ended as
    asked: `until()` held, or, without `until`, the clock reached `end`; False when `until()`
    never held by `end`, or the run passed its real-time bound (`REAL_BOUND`): a hang, for
    the caller to describe."""
    while until is None or not until():
        if run.elapsed() >= end:
            return until is None
        if time.monotonic() > run.deadline:
            return False
        await settle(3)
        run.clock.advance(step)
        for event in timeline.due(run.elapsed()):
            outcome = event.act()
            if isinstance(outcome, Awaitable):
                await outcome
    return True


# ------------------------------------------------------------------------------------ logging


class _Catcher(logging.Handler):
    def __init__(self, run: Run) -> None:
        super().__init__(logging.WARNING)
        self.run = run

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        now = self.run.clock.now()
        handler = getattr(record, "mongoq_handler", None)
        if isinstance(handler, str) and "abandoned" in message:
            self.run.abandoned.append((now, handler))
        if getattr(record, "mongoq_field", None) is not None:
            fields = {k: v for k, v in vars(record).items() if k.startswith("mongoq_")}
            self.run.set_aside.append((now, fields))
        if "unexpected error" not in message:
            return
        error = record.exc_info[1] if record.exc_info else None
        cause = f": {error_text(error)}" if error is not None else ""
        self.run.violation("unexpected_errors", f"logged by {record.name}: {message}{cause}")


@contextlib.contextmanager
def catching_unexpected_errors(run: Run) -> Iterator[None]:
    """Count the ``mongoq`` records at WARNING or above that say "unexpected error", and keep
    those that say a handler was abandoned (`Run.abandoned`) or a document set aside
    (`Run.set_aside`); the others stay out of the output (faults make many)."""
    logger = logging.getLogger("mongoq")
    catcher = _Catcher(run)
    saved = (logger.level, logger.propagate)
    logger.addHandler(catcher)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(catcher)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
