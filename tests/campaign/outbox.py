"""The outbox's scenario of the run-loop fault campaign: `OutboxDispatcher.run` and
``run_once`` under faults.

One run, all drawn from its seed: one raw embedded database and one `ManualClock`; an operator's
`AsyncOutbox` (on the raw database: no faults, no observer) sets the outbox up with two
handlers, ``billing`` and ``shipping``, subscribed to three event types, and publishes
(``session=None``: the embedded backend has no transactions) 4-8 events up front and a few more
while the dispatchers run, keyed (2-4 keys, several events each) or not. Three worker slots,
each an `OutboxDispatcher` on its own `AsyncOutbox` on its own instrumented view (seeded faults
at every command, then `OutboxObserver`), with a concurrency of 1-3, 3-6 attempts, sometimes a
handler time limit; most run ``run()``, some call ``run_once()`` in a loop. About half of them
share one owner name, ``w`` (`tasks.slot_names`: lanes are held per owner and instance). Along the
timeline dispatchers are partitioned (`draw_partitions` adds 1-3 partitions a slot to the task
scenario's draws, up to twice the lease, and `draw_rates` holds a partition's replies up to
three leases: a claim is answered after its lanes' lease ended in about a third of the runs,
and now and then another dispatcher has taken the lane over meanwhile; a dispatcher whose
handlers run renews all its lanes, those of a late claim too, which mostly keeps them from
being taken over), stopped gracefully, hard-cancelled and crashed, and some slots
restart with a new dispatcher. At the end the faults stop, every dispatcher stops, and a
fault-free one with ``stop_when_drained=True`` finishes what is left.

The handler judges each start from the raw lane and delivery documents before its first await
(`tests.campaign.outbox_leases.judge_start`: overlaps, late starts, and per key order), sleeps
on the clock (sometimes longer than the lease), and returns, raises, or raises `PermanentError`.
`OutboxObserver` judges every write against the live holdings around it (stale settles) and
records every delivery a write deletes. The checks after the drain:

- lost: an event's delivery to a subscribed handler still pending, never stored, or deleted
  (completed) at a claim generation none of whose executions returned;
- order: per handler and key, completions come in sequence order (dead letters aside), and each
  completed execution started no earlier than the previous delivery of its key completed;
- summaries: each dispatcher's ``claimed`` equals the sum of its outcomes (not for a run cut
  short: `engine.check_outcomes`), and the deliveries its writes completed number between its
  ``completed`` and ``completed + lost`` (a batch completion reports what it cannot prove as
  lost) plus what it claimed and counted nowhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio

from mongoq import _driver
from mongoq.outbox import AsyncOutbox, DeliveryContext, Event, OutboxDispatcher, OutboxRunSummary
from mongoq.testing import memory_database
from tests.campaign.engine import (
    Crew,
    FaultRates,
    Report,
    Run,
    Store,
    Timeline,
    Worker,
    catching_unexpected_errors,
    check_outcomes,
    check_stops,
    drive,
    instant,
    run_async,
)
from tests.campaign.hostile import Runaways, check_runaways
from tests.campaign.outbox_leases import (
    DELIVERIES,
    PREFIX,
    Completion,
    OutboxHoldings,
    OutboxObserver,
    hire,
    item_of,
    judge_start,
)
from tests.campaign.tasks import (
    Act,
    draw_disruptions,
    graceful,
    hard_stop,
    slot_names,
    stop_bound,
    wind_down,
)

__all__ = [
    "PRIMITIVE", "DispatchSettings", "OutboxScenario", "OutboxShape", "check_run",
    "draw_partitions",
]  # fmt: skip

SUBSCRIPTIONS = {"placed": ["billing", "shipping"], "paid": ["billing"], "moved": ["shipping"]}
HANDLERS = ("billing", "shipping")
OUTCOMES = ("completed", "retried", "buried", "released", "lost", "unknown")
#: Clock seconds per step of the driver.
STEP = 0.25
#: Clock seconds the drain may take before it counts as a hang.
DRAIN = 400.0


def generation_of(token: str | None) -> int | None:
    """The claim generation of a lease token (its last part)."""
    return None if not token else int(token.rsplit(":", 1)[1])


# ---------------------------------------------------------------------------------- drawing


@dataclass(frozen=True)
class OutboxShape:
    """What a run looks like."""

    lease: float
    #: clock seconds of faults before the drain
    end: float
    upfront: int
    later: int
    keys: int

    @classmethod
    def draw(cls, run: Run) -> OutboxShape:
        rng = run.rng
        return cls(
            lease=rng.choice((5.0, 8.0, 10.0)),
            end=round(rng.uniform(30.0, 50.0), 2),
            upfront=rng.randint(4, 8),
            later=rng.randint(2, 5),
            keys=rng.randint(2, 4),
        )

    def outbox(self, db: Any, run: Run) -> AsyncOutbox:
        return AsyncOutbox(db, PREFIX, subscriptions=SUBSCRIPTIONS, lease_ttl=self.lease,
                           clock=run.clock)  # fmt: skip

    def event(self, run: Run, number: int) -> Event:
        rng = run.rng_for("event", number)
        key = f"k{rng.randrange(self.keys)}" if rng.random() < 0.6 else None
        return Event(f"e{number}", rng.choice(list(SUBSCRIPTIONS)), {"n": number}, key=key)


@dataclass(frozen=True)
class DispatchSettings:
    """One dispatcher's arguments, and whether it runs ``run()`` or ``run_once()`` in a loop."""

    concurrency: int
    max_attempts: int
    handler_timeout: float | None
    poll_interval: float
    once: bool

    @classmethod
    def draw(cls, run: Run, name: str, lease: float) -> DispatchSettings:
        rng = run.rng_for("settings", name)
        return cls(
            concurrency=rng.randint(1, 3),
            max_attempts=rng.randint(3, 6),
            handler_timeout=round(lease * rng.uniform(1.5, 3), 2) if rng.random() < 0.3 else None,
            poll_interval=rng.choice((2.0, 3.0, 5.0)),
            once=rng.random() < 0.3,
        )

    def dispatcher(
        self, outbox: AsyncOutbox, handler: Callable[..., Awaitable[Any]], owner: str
    ) -> OutboxDispatcher:
        return OutboxDispatcher(
            outbox, dict.fromkeys(HANDLERS, handler), max_attempts=self.max_attempts,
            backoff=backoff,
        )  # fmt: skip

    def run_options(self, owner: str) -> dict[str, Any]:
        """What `run` (and, but for the poll interval, `run_once`) is given."""
        return {
            "worker_id": owner,
            "concurrency": self.concurrency,
            "poll_interval": self.poll_interval,
            "handler_timeout": self.handler_timeout,
        }


def backoff(attempt: int) -> float:
    """Seconds before a retry: short, and drawn from no random stream."""
    return min(0.5 * 2.0 ** (attempt - 1), 8.0)


def draw_rates(run: Run, name: str, lease: float) -> FaultRates:
    """The engine's fault rates, with replies held longer after a partition (up to three
    leases): a claim answered after its lanes' lease ended leaves the others time to take a
    lane over before the answer comes."""
    rates = FaultRates.draw(run.rng_for("rates", name), lease)
    late = run.rng_for("reply delay", name).uniform(0.5, 3.0)
    return dataclasses.replace(rates, reply_delay=lease * late)


def draw_partitions(
    run: Run, timeline: Timeline, slots: int, end: float, lease: float,
    act: Callable[[str, int], Callable[[], Any]],
) -> None:  # fmt: skip
    """More and longer partitions than `tasks.draw_disruptions` draws: 1-3 a slot, each
    outlasting the lease now and then, so that claims are answered after their lease ended."""
    rng = run.rng_for("partitions")
    for slot in range(slots):
        for _ in range(rng.randint(1, 3)):
            at, seconds = rng.uniform(3, end - 8), round(rng.uniform(0.5, 2.0) * lease, 2)
            timeline.at(at, f"partition {slot} {seconds}s", act(f"partition {seconds}", slot))


# ------------------------------------------------------------------------------------ checks


def check_run(
    run: Run, workers: Iterable[Worker], expected: Iterable[str], completions: list[Completion]
) -> int:
    """The checks after the drain (see the module docstring); `expected` names every delivery
    the publishes asked for (`item_of`). Returns the number of deliveries."""
    stored = {item_of(doc): doc for doc in run.store.documents(DELIVERIES)}
    completed = {c.item: c for c in completions}
    items = sorted(set(expected))
    for item in items:
        doc, completion = stored.get(item), completed.get(item)
        if doc is not None and doc.get("status") != "dead":
            run.violation(
                "lost",
                f"lost: {item} is still {doc.get('status')} (attempts {doc.get('attempts')}, "
                f"generation {doc.get('claims', 0)}, due {run.at(instant(doc.get('due_at')))})",
            )
        elif doc is None and completion is None:
            run.violation("lost", f"lost: {item} was never stored, or went without completing")
        elif completion is not None and not any(
            generation_of(e.token) == completion.generation and e.outcome == "returned"
            for e in run.executions.get(item, ())
        ):
            run.violation(
                "lost",
                f"lost: {item} was completed at {run.at(completion.at)} by "
                f"{completion.writer} at generation {completion.generation}, yet no execution "
                "of that claim returned",
            )
    _check_order(run, completions, stored)
    _check_summaries(run, list(workers), completions)
    return len(items)


def _check_order(
    run: Run, completions: list[Completion], stored: Mapping[str, Mapping[str, Any]]
) -> None:
    by_key: dict[tuple[str, str], list[Completion]] = defaultdict(list)
    for completion in completions:
        if completion.key is not None and completion.item not in stored:
            by_key[(completion.handler, completion.key)].append(completion)
    for (_, key), done in sorted(by_key.items()):
        done.sort(key=lambda c: c.sequence or 0)
        for first, then in itertools.pairwise(done):
            if then.at < first.at:
                run.violation(
                    "order_violations",
                    f"order: {then.item} (key {key!r}, sequence {then.sequence}) completed at "
                    f"{run.at(then.at)}, before {first.item} (sequence {first.sequence}) at "
                    f"{run.at(first.at)}",
                )
            started = [
                e for e in run.executions.get(then.item, ())
                if generation_of(e.token) == then.generation
            ]  # fmt: skip
            if started and started[0].started < first.at:
                run.violation(
                    "order_violations",
                    f"order: {then.item} (key {key!r}) ran (completed) from "
                    f"{run.at(started[0].started)}, before {first.item} completed at "
                    f"{run.at(first.at)}",
                )


def _check_summaries(run: Run, workers: list[Worker], completions: list[Completion]) -> None:
    done: dict[str, int] = defaultdict(int)
    for completion in completions:
        done[completion.writer] += 1
    for worker in workers:
        summary: OutboxRunSummary | None = worker.summary
        if summary is None:  # crashed: its run was cancelled and returned nothing
            continue
        accounted = check_outcomes(run, worker, OUTCOMES)
        # Claimed, yet counted nowhere (a run cut short): any of them may have completed.
        slack = max(0, summary.claimed - accounted)
        low = summary.completed
        high = summary.completed + summary.lost + summary.unknown + slack
        if not low <= done[worker.name] <= high:
            run.violation(
                "unexpected_errors",
                f"summary: {worker.name}'s writes completed {done[worker.name]} deliveries, but "
                f"its summary says between {low} and {high}",
            )


# ---------------------------------------------------------------------------------- scenario


class OutboxScenario:
    """One run of the outbox's scenario (see the module docstring)."""

    SLOTS = 3

    def __init__(self, seed: int) -> None:
        raw = memory_database()
        self.run = Run(seed, "outbox", raw, OutboxHoldings(Store(raw)))
        self.shape = OutboxShape.draw(self.run)
        self.operator = self.shape.outbox(raw, self.run)  # no hooks: exempt, fault-free
        self.expected: list[str] = []
        self.completions: list[Completion] = []
        self.slots: list[Worker | None] = [None] * self.SLOTS
        self.generations = [0] * self.SLOTS
        self.events = itertools.count()
        self.runaways = Runaways(self.run)

    async def main(self) -> Report:
        run, shape = self.run, self.shape
        with catching_unexpected_errors(run):
            await self.operator.setup()
            await self.publish(shape.upfront)
            async with anyio.create_task_group() as group:
                crew = Crew(run, group)
                for slot in range(self.SLOTS):
                    self.hire(crew, slot)
                timeline = self.timeline(crew)
                in_time = await drive(run, timeline, end=shape.end, step=STEP)
                completed = await self.drain(crew, in_time)
            items = 0
            if completed:
                items = check_run(run, crew.workers, self.expected, self.completions)
                check_runaways(run, shape.lease)
                check_stops(run, crew.workers, stop_bound(shape.lease))
        return run.finish(items)

    async def publish(self, count: int) -> None:
        events = [self.shape.event(self.run, next(self.events)) for _ in range(count)]
        await self.operator.publish(events, session=None)
        for event in events:
            self.expected += [f"{event.id}/{h}" for h in self.operator.handlers_for(event.type)]

    def hire(self, crew: Crew, slot: int) -> None:
        name, owner = slot_names(self.run, slot, self.generations)
        lease = self.shape.lease
        worker = hire(crew, name, draw_rates(self.run, name, lease), owner, self.completions)
        settings = DispatchSettings.draw(self.run, name, lease)
        self.start(crew, worker, owner, settings)
        self.slots[slot] = worker

    def start(self, crew: Crew, worker: Worker, owner: str, settings: DispatchSettings) -> None:
        outbox = self.shape.outbox(worker.db, self.run)
        assert isinstance(worker.observer, OutboxObserver)
        worker.observer.instance = outbox.instance
        dispatcher = settings.dispatcher(outbox, self.handler(worker, outbox.instance), owner)
        if settings.once:  # (a stop's grace cuts a `run` short; `run_once` in a loop has none)
            worker.stop = dispatcher.stop
            scope = anyio.CancelScope()  # now: a hard cancel may come before `once` runs
            worker.hard_cancel = scope.cancel
            crew.start(worker, partial(self.once, dispatcher, settings.run_options(owner), scope))
        else:
            graceful(self.run, worker, dispatcher.stop, self.shape.lease)
            worker.hard_cancel = hard_stop(dispatcher)
            crew.start(worker, partial(dispatcher.run, **settings.run_options(owner)))

    async def once(
        self, dispatcher: OutboxDispatcher, options: dict[str, Any], scope: anyio.CancelScope
    ) -> OutboxRunSummary:
        """``run_once()`` in a loop until stopped (or hard-cancelled: `scope` cancelled), then
        the lanes handed back, as a caller of ``run_once`` does."""
        poll = options.pop("poll_interval")
        with scope:
            while not dispatcher.stopping:
                if not (await dispatcher.run_once(**options)).claimed:
                    await self.run.clock.sleep(poll)
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(*_driver.DRIVER_ERRORS):  # else their leases expire
                await dispatcher.outbox.relinquish(options["worker_id"])
        return dispatcher.summary

    def handler(self, worker: Worker, instance: str) -> Callable[..., Awaitable[Any]]:
        run, lease, runaways = self.run, self.shape.lease, self.runaways

        async def handle(event: Event, context: DeliveryContext) -> Any:
            execution = judge_start(run, context.delivery, worker.name, instance)
            item, number = execution.item, len(run.executions[execution.item])
            act = Act.draw(run, item, number, lease)
            # The lease is the lane's, which its other deliveries keep renewed: not judged.
            runaway = runaways.draw(execution, context.delivery.id, None, item, number)
            await runaways.sleep(execution, act.seconds, runaway)
            execution.end(run.clock.now(), "returned" if act.ending == "returns" else "raised")
            return act.finish(worker.name)

        return handle

    def timeline(self, crew: Crew) -> Timeline:
        rng, shape, timeline = self.run.rng_for("timeline"), self.shape, Timeline()
        for _ in range(shape.later):
            timeline.at(rng.uniform(1, shape.end - 5), "publish",
                        partial(self.publish, rng.randint(1, 2)))  # fmt: skip
        act = lambda kind, slot: partial(self.disrupt, crew, kind, slot)  # noqa: E731
        draw_disruptions(self.run, timeline, self.SLOTS, shape.end, shape.lease, act)
        draw_partitions(self.run, timeline, self.SLOTS, shape.end, shape.lease, act)
        return timeline

    def disrupt(self, crew: Crew, kind: str, slot: int) -> None:
        crew.disrupt(self.slots[slot], kind, partial(self.hire, crew, slot))

    async def drain(self, crew: Crew, in_time: bool) -> bool:
        """Faults stop, every dispatcher stops, a fault-free one drains; False on a hang (or
        when the run was already past its real-time bound: not `in_time`)."""
        run = self.run
        if not in_time:
            await wind_down(run, crew)
            return False
        crew.calm_and_stop()  # and the events still ahead (restarts, partitions) are dropped
        drainer = hire(crew, "drain", None, "drain", self.completions)
        outbox = self.shape.outbox(drainer.db, run)
        assert isinstance(drainer.observer, OutboxObserver)
        drainer.observer.instance = outbox.instance
        dispatcher = OutboxDispatcher(
            outbox, dict.fromkeys(HANDLERS, self.handler(drainer, outbox.instance)),
            max_attempts=6, backoff=backoff,
        )  # fmt: skip
        crew.start(drainer, partial(
            dispatcher.run, worker_id="drain", concurrency=2, poll_interval=1.0,
            stop_when_drained=True,
        ))  # fmt: skip
        finished = await drive(run, Timeline(), end=run.elapsed() + DRAIN, step=STEP,
                               until=crew.all_done)  # fmt: skip
        if not finished:
            await wind_down(run, crew)
        return finished


class _Outbox:
    name = "outbox"

    def run(self, seed: int) -> Report:
        return run_async(OutboxScenario(seed).main)


PRIMITIVE = _Outbox()
