"""The group transport's scenario of the run-loop fault campaign: `AsyncGroupTransport.run`
under faults.

One run, all drawn from its seed: one raw embedded database and one `ManualClock`; three worker
slots, each an `AsyncGroupTransport` on its own instrumented view (seeded faults at every
command, then `GroupObserver`) running ``run()`` with a batch size of 1-3, a concurrency of 1-2,
a retry delay, and sometimes a handler time limit. An operator (its own transport on the raw
database: no faults, no observer) publishes 3-6 groups of 2-6 messages up front, and more
messages (to those groups and to new ones) while the workers run. Along the timeline workers
are partitioned, stopped gracefully, hard-cancelled (``_cancel_running``) and crashed, and
some slots restart with a new worker. At the end the faults stop, every worker is asked to
stop, and a fault-free worker with ``stop_when_drained=True`` finishes what is left.

The handler judges each start from the raw documents before its first await (`judge_start`):
the group's lock and the message's head stamp must both carry the lease's token and end after
now; another token ending later is an overlap, anything else a late start. At the same
instant no earlier message of the group may still be stored unless it is on its way to the
dead letters (an order violation). It then sleeps on the clock (sometimes longer than the
lease_ttl), and returns, raises, or raises `PermanentError`. `GroupObserver` records which
lease each deletion of a message removed, and when. The checks after the drain:

- lost: a message published that is still stored, or gone without being acked (deleted
  unmarked) or dead-lettered, or acked under a lease none of whose executions returned;
- order: per group, the acks of messages not dead-lettered come in sequence order, and each
  acked execution started no earlier than the previous message of its group was acked;
- summaries: each worker's ``claimed`` equals the sum of its outcomes (not for a run cut short:
  `engine.check_outcomes`), and the messages its writes acked (deleted unmarked) number between
  its ``acked`` and ``acked + unknown + lost`` (`ack_many` reports an ack it cannot prove as
  lost). About half of the workers share one worker id, ``w`` (`tasks.slot_names`), as the
  slots of one worker do: only the lease's token tells their writes apart.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import anyio

from mongoq import AsyncGroupTransport
from mongoq.groups import GroupLease, NewMessage
from mongoq.testing import Operation, memory_database
from tests.campaign.engine import (
    Crew,
    Execution,
    FaultRates,
    Holding,
    Observer,
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
from tests.campaign.hostile import Runaways, check_runaways
from tests.campaign.tasks import (
    Act,
    Settings,
    draw_disruptions,
    graceful,
    hard_stop,
    slot_names,
    stop_bound,
    wind_down,
)

__all__ = ["HOLDINGS", "PRIMITIVE", "GroupObserver", "GroupShape", "check_run", "judge_start"]

PREFIX = "campaign"
LOCKS, MESSAGES, DEAD = f"{PREFIX}_locks", f"{PREFIX}_messages", f"{PREFIX}_dead"
OUTCOMES = ("acked", "retried", "dead", "released", "lost", "unknown")
#: Clock seconds per step of the driver.
STEP = 0.25
#: Clock seconds the drain may take before it counts as a hang.
DRAIN = 400.0
#: The clock's (and the stored instants') resolution.
TICK = timedelta(milliseconds=1)
DELETES = frozenset({"delete_one", "delete_many", "find_one_and_delete"})


def holder_of(token: str) -> str:
    """The worker a token belongs to: tokens are ``{worker_id}:{uuid}``."""
    return token.split(":", 1)[0]


class GroupHoldings:
    """A group is held by the token on its lock until ``available_at`` (parked by a nack, too:
    nobody else may take it meanwhile), a message by the token stamped on it until
    ``stamp_until``, unless it is marked dead (its fate decided: whoever finds it finishes the
    burial). A lease ends when its instant comes (a claim takes what is due at ``now``), so a
    holding lasts until one tick before it."""

    collections: tuple[str, ...] = (LOCKS, MESSAGES)

    def holding(self, collection: str, doc: Mapping[str, Any]) -> Holding | None:
        if collection == LOCKS:
            token, until = doc.get("token"), instant(doc.get("available_at"))
        elif doc.get("dead") is None:
            token, until = doc.get("token"), instant(doc.get("stamp_until"))
        else:
            return None
        if not token or until is None:
            return None
        return Holding(holder_of(token), token, until - TICK)

    def excused(self, collection: str, doc: Mapping[str, Any]) -> bool:
        return False


HOLDINGS = GroupHoldings()


# --------------------------------------------------------------------------------- observing


@dataclass(frozen=True)
class Deletion:
    """A message a worker's write deleted: under which token, marked dead or not, and when."""

    seq: int
    group: Any
    token: str | None
    dead: bool
    at: datetime
    writer: str


class GroupObserver(Observer):
    """The engine's observer (stale settles, claims), which also records every message a write
    of its worker deletes (`Deletion`) into `deletions`, shared by the run's workers."""

    def __init__(self, run: Run, writer: str, worker_id: str, deletions: list[Deletion]) -> None:
        super().__init__(run, writer, worker_id)
        self.deletions = deletions
        self._stored: dict[int, dict[Any, Mapping[str, Any]]] = {}

    async def before(self, op: Operation) -> None:
        await super().before(op)
        if op.collection == MESSAGES and op.name in DELETES:
            docs = self.run.store.documents(MESSAGES)
            self._stored[id(op)] = {doc["_id"]: dict(doc) for doc in docs}

    async def after(self, op: Operation, error: BaseException | None) -> None:
        await super().after(op, error)
        stored = self._stored.pop(id(op), None)
        if stored is None:
            return
        now, store = self.run.clock.now(), self.run.store
        for seq, doc in stored.items():
            if store.document(MESSAGES, seq) is None:
                self.deletions.append(Deletion(
                    seq, doc.get("group_id"), doc.get("token"), doc.get("dead") is not None,
                    now, self.writer,
                ))  # fmt: skip


def hire(
    crew: Crew, name: str, rates: FaultRates | None, worker_id: str, deletions: list[Deletion]
) -> Worker:
    """`Crew.hire` with a `GroupObserver` as the view's last hook."""
    observer = GroupObserver(crew.run, name, worker_id, deletions)
    return crew.hire(name, rates, worker_id, observer)


# ---------------------------------------------------------------------------------- judging


def _lease_verdict(token: Any, until: datetime | None, mine: str, now: datetime) -> str:
    if token == mine and until is not None and until > now:
        return "live"
    if token and token != mine and until is not None and until > now:
        return "overlap"
    return "late"


def _stamp(doc: Mapping[str, Any] | None, field: str, run: Run) -> str:
    if doc is None:
        return "gone"
    token = doc.get("token")
    who = f"{holder_of(token)} (claim {token.split(':', 1)[1][:6]})" if token else "nobody"
    return f"{who} until {run.at(instant(doc.get(field)))}"


def judge_start(run: Run, lease: GroupLease, worker: str) -> Execution:
    """Record a handler's start (before its first await), judged by the group's lock and the
    head's stamp right now, and check that no earlier message of the group is still stored."""
    now = run.clock.now()
    lock = run.store.document(LOCKS, lease.group_id)
    head = run.store.document(MESSAGES, lease.seq)
    verdicts = {
        _lease_verdict(lock.get("token"), instant(lock.get("available_at")), lease.token, now)
        if lock is not None else "late",
        _lease_verdict(head.get("token"), instant(head.get("stamp_until")), lease.token, now)
        if head is not None and head.get("dead") is None else "late",
    }  # fmt: skip
    verdict = "overlap" if "overlap" in verdicts else "late" if "late" in verdicts else "live"
    execution = Execution(lease.seq, lease.token, worker, now, verdict)
    run.executions.setdefault(lease.seq, []).append(execution)
    what = f"message {lease.seq} of group {lease.group_id!r}"
    if verdict != "live":
        run.violation(
            "overlaps" if verdict == "overlap" else "late_starts",
            f"{'overlap' if verdict == 'overlap' else 'late start'}: {what} started by {worker} "
            f"(claim {lease.token.split(':', 1)[1][:6]}) at {run.at(now)}; the lock: "
            f"{_stamp(lock, 'available_at', run)}, the head: {_stamp(head, 'stamp_until', run)}",
        )
    earlier = sorted(
        doc["_id"] for doc in run.store.documents(MESSAGES)
        if doc.get("group_id") == lease.group_id and doc["_id"] < lease.seq
        and doc.get("dead") is None
    )  # fmt: skip
    if earlier:
        run.violation(
            "order_violations",
            f"order: {what} started by {worker} at {run.at(now)} while earlier message(s) "
            f"{earlier} of its group were still pending",
        )
    return execution


# ---------------------------------------------------------------------------------- drawing


@dataclass(frozen=True)
class GroupShape:
    """What a run looks like."""

    lease_ttl: float
    max_deliveries: int | None
    #: clock seconds of faults before the drain
    end: float
    #: messages of each group published up front
    groups: tuple[int, ...]
    #: messages published while the workers run
    later: int

    @classmethod
    def draw(cls, run: Run) -> GroupShape:
        rng = run.rng
        return cls(
            lease_ttl=rng.choice((5.0, 8.0, 10.0)),
            max_deliveries=rng.randint(3, 6) if rng.random() < 0.7 else None,
            end=round(rng.uniform(60.0, 120.0), 2),
            groups=tuple(rng.randint(2, 6) for _ in range(rng.randint(3, 6))),
            later=rng.randint(6, 20),
        )

    def transport(self, db: Any, run: Run) -> AsyncGroupTransport:
        return AsyncGroupTransport(
            db, PREFIX, lease_ttl=self.lease_ttl, max_deliveries=self.max_deliveries,
            clock=run.clock,
        )  # fmt: skip


# ------------------------------------------------------------------------------------ checks


def check_run(
    run: Run, workers: Iterable[Worker], published: Mapping[int, Any], deletions: list[Deletion]
) -> int:
    """The checks after the drain (see the module docstring); returns the number of messages."""
    stored = {doc["_id"]: doc for doc in run.store.documents(MESSAGES)}
    dead = {doc["_id"]: doc for doc in run.store.documents(DEAD)}
    acked = {d.seq: d for d in deletions if not d.dead}
    for seq, group in sorted(published.items()):
        what = f"message {seq} of group {group!r}"
        if seq in stored:
            doc = stored[seq]
            run.violation(
                "lost",
                f"lost: {what} is still stored (deliveries {doc.get('deliveries')}, stamped by "
                f"{_stamp(doc, 'stamp_until', run)})",
            )
        elif seq in dead:
            continue
        elif seq not in acked:
            run.violation("lost", f"lost: {what} is gone, neither acked nor dead-lettered")
        elif not any(
            e.token == acked[seq].token and e.outcome == "returned"
            for e in run.executions.get(seq, ())
        ):
            run.violation(
                "lost",
                f"lost: {what} was acked at {run.at(acked[seq].at)} by "
                f"{acked[seq].writer}, yet no execution of that claim returned",
            )
    _check_order(run, published, acked, dead)
    _check_summaries(run, list(workers), deletions)
    return len(published)


def _check_order(
    run: Run, published: Mapping[int, Any], acked: Mapping[int, Deletion],
    dead: Mapping[int, Any],
) -> None:  # fmt: skip
    by_group: dict[Any, list[int]] = defaultdict(list)
    for seq, group in sorted(published.items()):
        if seq in acked and seq not in dead:
            by_group[group].append(seq)
    for group, seqs in by_group.items():
        for before, after in itertools.pairwise(seqs):
            first, then = acked[before], acked[after]
            if then.at < first.at:
                run.violation(
                    "order_violations",
                    f"order: group {group!r}'s message {after} was acked at {run.at(then.at)}, "
                    f"before message {before} at {run.at(first.at)}",
                )
            started = [e for e in run.executions.get(after, ()) if e.token == then.token]
            if started and started[0].started < first.at:
                run.violation(
                    "order_violations",
                    f"order: group {group!r}'s message {after} ran (acked) from "
                    f"{run.at(started[0].started)}, before message {before} was acked at "
                    f"{run.at(first.at)}",
                )


def _check_summaries(run: Run, workers: list[Worker], deletions: list[Deletion]) -> None:
    acks: dict[str, int] = defaultdict(int)
    for deletion in deletions:
        if not deletion.dead:
            acks[deletion.writer] += 1
    for worker in workers:
        summary = worker.summary
        if summary is None:  # crashed: its run was cancelled and returned nothing
            continue
        accounted = check_outcomes(run, worker, OUTCOMES)
        slack = max(0, summary.claimed - accounted) if cut_short(worker) else 0
        low, high = summary.acked, summary.acked + summary.unknown + summary.lost + slack
        if not low <= acks[worker.name] <= high:
            run.violation(
                "unexpected_errors",
                f"summary: {worker.name}'s writes acked {acks[worker.name]} message(s), but its "
                f"summary says between {low} and {high}",
            )


# ---------------------------------------------------------------------------------- scenario


class GroupScenario:
    """One run of the group transport's scenario (see the module docstring)."""

    SLOTS = 3

    def __init__(self, seed: int) -> None:
        raw = memory_database()
        self.run = Run(seed, "groups", raw, HOLDINGS)
        self.shape = GroupShape.draw(self.run)
        self.operator = self.shape.transport(raw, self.run)  # no hooks: exempt, fault-free
        self.published: dict[int, Any] = {}
        self.deletions: list[Deletion] = []
        self.slots: list[Worker | None] = [None] * self.SLOTS
        self.generations = [0] * self.SLOTS
        self.runaways = Runaways(self.run)

    async def main(self) -> Report:
        run, shape = self.run, self.shape
        with catching_unexpected_errors(run):
            await self.operator.setup()
            rng = run.rng_for("publish")
            await self.publish([
                NewMessage(f"g{group}", {"n": n}, rng.randint(0, 2))
                for group, count in enumerate(shape.groups) for n in range(count)
            ])  # fmt: skip
            async with anyio.create_task_group() as group:
                crew = Crew(run, group)
                for slot in range(self.SLOTS):
                    self.hire(crew, slot)
                timeline = self.timeline(crew)
                in_time = await drive(run, timeline, end=shape.end, step=STEP)
                completed = await self.drain(crew, in_time)
            items = 0
            if completed:
                items = check_run(run, crew.workers, self.published, self.deletions)
                check_runaways(run, shape.lease_ttl)
                check_stops(run, crew.workers, stop_bound(shape.lease_ttl))
        return run.finish(items)

    async def publish(self, messages: list[NewMessage]) -> None:
        seqs = await self.operator.publish_many(messages)
        self.published.update(zip(seqs, (m.group_id for m in messages), strict=True))

    def hire(self, crew: Crew, slot: int) -> None:
        name, worker_id = slot_names(self.run, slot, self.generations)
        lease = self.shape.lease_ttl
        rates = FaultRates.draw(self.run.rng_for("rates", name), lease)
        worker = hire(crew, name, rates, worker_id, self.deletions)
        settings = Settings.draw(self.run, name, lease)
        retry = self.run.rng_for("retry", name).choice((0.0, 0.5, 1.0, 2.0))
        transport = self.shape.transport(worker.db, self.run)
        graceful(self.run, worker, transport.stop, lease)
        worker.hard_cancel = hard_stop(transport)
        crew.start(worker, partial(
            transport.run, self.handler(worker), worker_id=worker_id, retry_delay=retry,
            **settings.arguments(),
        ))  # fmt: skip
        self.slots[slot] = worker

    def handler(self, worker: Worker) -> Callable[[GroupLease], Awaitable[Any]]:
        run, lease, runaways = self.run, self.shape.lease_ttl, self.runaways

        async def handle(group_lease: GroupLease) -> Any:
            execution = judge_start(run, group_lease, worker.name)
            seq, number = group_lease.seq, len(run.executions[group_lease.seq])
            act = Act.draw(run, seq, number, lease)
            claim = (LOCKS, group_lease.group_id, group_lease.token)
            runaway = runaways.draw(execution, repr(group_lease.group_id), claim, seq, number)
            await runaways.sleep(execution, act.seconds, runaway)
            execution.end(run.clock.now(), "returned" if act.ending == "returns" else "raised")
            return act.finish(worker.name)

        return handle

    def timeline(self, crew: Crew) -> Timeline:
        rng, shape, timeline = self.run.rng_for("timeline"), self.shape, Timeline()
        groups = len(shape.groups)
        for n in range(shape.later):
            # Mostly to the groups published up front, sometimes to a new group.
            group = f"g{rng.randint(0, groups + 1)}"
            message = NewMessage(group, {"late": n}, rng.randint(0, 2))
            timeline.at(rng.uniform(1, shape.end - 5), "publish", partial(self.publish, [message]))
        draw_disruptions(
            self.run, timeline, self.SLOTS, shape.end, shape.lease_ttl,
            lambda kind, slot: partial(self.disrupt, crew, kind, slot),
        )  # fmt: skip
        return timeline

    def disrupt(self, crew: Crew, kind: str, slot: int) -> None:
        crew.disrupt(self.slots[slot], kind, partial(self.hire, crew, slot))

    async def drain(self, crew: Crew, in_time: bool) -> bool:
        """Faults stop, every worker stops, a fault-free worker drains; False on a hang (or
        when the run was already past its real-time bound: not `in_time`)."""
        run = self.run
        if not in_time:
            await wind_down(run, crew)
            return False
        crew.calm_and_stop()  # and the events still ahead (restarts, partitions) are dropped
        drainer = hire(crew, "drain", None, "drain", self.deletions)
        transport = self.shape.transport(drainer.db, run)
        crew.start(drainer, partial(
            transport.run, self.handler(drainer), worker_id="drain", concurrency=2,
            stop_when_drained=True, poll_interval=1.0, retry_delay=0.5,
        ))  # fmt: skip
        finished = await drive(run, Timeline(), end=run.elapsed() + DRAIN, step=STEP,
                               until=crew.all_done)  # fmt: skip
        if not finished:
            await wind_down(run, crew)
        return finished


class _Groups:
    name = "groups"

    def run(self, seed: int) -> Report:
        return run_async(GroupScenario(seed).main)


PRIMITIVE = _Groups()
