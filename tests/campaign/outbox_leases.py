"""How the outbox's campaign (`tests.campaign.outbox`) reads leases from the raw documents:
who holds a lane or a delivery (`OutboxHoldings`), which writes change what another dispatcher
holds (`OutboxObserver`, which also records every delivery a write deletes: `Completion`), and
how a handler's start is judged (`judge_start`).

A lane is held by its ``owner`` on one `AsyncOutbox` (its ``instance``) until ``lease_until``.
A delivery is held while its document is pending at claim generation ``g`` and the lane of its
handler and number lists it at ``g`` under an owner, until the lane's ``lease_until``; the lease
token is ``<lane number>:<lane epoch>:<g>``. A start is live when the lane is held by the
dispatcher's instance at the token's epoch, its lease ending after now, listing the delivery at
the token's generation, which the delivery still has; an overlap when the lane is held under a
live lease by another instance or epoch; late otherwise. For a keyed delivery, no delivery of
its handler and key with a lower sequence may be pending at that instant, and no other one held
(order violations).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import bson

from mongoq.outbox import Delivery
from mongoq.outbox.models import LANES as LANE_COUNT
from mongoq.testing import Operation
from tests.campaign.engine import (
    WRITES,
    Crew,
    Execution,
    FaultRates,
    Holding,
    Observer,
    Run,
    Store,
    Worker,
    instant,
)

__all__ = [
    "DELIVERIES", "LANES", "PREFIX", "Completion", "OutboxHoldings", "OutboxObserver", "hire",
    "item_of", "judge_start", "mentions", "pins",
]  # fmt: skip

PREFIX = "campaign_"
LANES, DELIVERIES = f"{PREFIX}lanes", f"{PREFIX}deliveries"
#: The clock's (and the stored instants') resolution.
TICK = timedelta(milliseconds=1)
DELETES = frozenset({"delete_one", "delete_many", "find_one_and_delete"})


def item_of(doc: Mapping[str, Any]) -> str:
    """A delivery's name in this campaign, the same in every run of a seed (its ``_id`` is an
    ObjectId, which is not): ``<event id>/<handler>``."""
    return f"{doc.get('event_id')}/{doc.get('handler')}"


class OutboxHoldings:
    """A lane is held by its ``owner`` until its ``lease_until``; a delivery by its lane's owner
    while pending at the generation its lane lists it with (see the module docstring). A lease
    ends when its instant comes (a claim takes a lane whose lease ends at ``now``), so a holding
    lasts until one tick before it. Reads the documents through `store`."""

    collections: tuple[str, ...] = (LANES, DELIVERIES)

    def __init__(self, store: Store) -> None:
        self.store = store

    def lane(self, handler: str, number: int) -> Mapping[str, Any] | None:
        """The lane document of `handler`'s lane `number`."""
        slots = self.store.document(LANES, "slots")
        handlers = list(slots.get("handlers") or ()) if slots is not None else []
        if handler not in handlers:
            return None
        found: Mapping[str, Any] | None = self.store.document(
            LANES, handlers.index(handler) * LANE_COUNT + number
        )
        return found

    def holding(self, collection: str, doc: Mapping[str, Any]) -> Holding | None:
        if collection == LANES:  # (most lanes are free: that is looked at first)
            if doc.get("owner") is None or not isinstance(doc["_id"], int):
                return None
            until = instant(doc.get("lease_until"))
            token = f"{doc.get('instance')}#{doc.get('epoch')}"
            return None if until is None else Holding(doc["owner"], token, until - TICK)
        if doc.get("status") != "pending":
            return None
        lane = self.lane(doc["handler"], int(doc["lane_id"]))
        if lane is None or lane.get("owner") is None:
            return None
        generation = int(doc.get("claims", 0))
        if not any(
            e.get("d") == doc["_id"] and int(e.get("g", 0)) == generation
            for e in lane.get("in_flight") or ()
        ):
            return None
        until = instant(lane.get("lease_until"))
        token = f"{doc['lane_id']}:{lane.get('epoch')}:{generation}"
        return None if until is None else Holding(lane["owner"], token, until - TICK)

    def instance(self, doc: Mapping[str, Any]) -> str | None:
        """The `AsyncOutbox.instance` holding a lane document, or a delivery's lane."""
        if "lane_id" in doc:
            lane = self.lane(doc["handler"], int(doc["lane_id"]))
            return None if lane is None else lane.get("instance")
        return doc.get("instance")

    def excused(self, collection: str, doc: Mapping[str, Any]) -> bool:
        return False


# --------------------------------------------------------------------------------- observing


def _names(value: Any, doc_id: Any) -> bool:
    return bool(value == doc_id or (isinstance(value, Mapping) and doc_id in value.get("$in", ())))


def mentions(value: Any, text: str | None) -> bool:
    """Whether `text` appears as a value anywhere in a command's arguments (filters, bulk
    operations)."""
    if isinstance(value, str):
        return text is not None and value == text
    if isinstance(value, Mapping):
        return any(mentions(item, text) for item in value.values())
    if isinstance(value, list | tuple):
        return any(mentions(item, text) for item in value)
    bulk_filter = getattr(value, "_filter", None)  # pymongo's UpdateOne, DeleteMany, ...
    return bulk_filter is not None and mentions(bulk_filter, text)


def pins(value: Any, doc_id: Any, field: str, expected: Any) -> bool:
    """Whether a command's arguments hold a filter on `doc_id` (by ``_id``, or ``$in``) that
    also requires `field` to equal `expected`: a write fenced on that state of the document."""
    if isinstance(value, Mapping):
        if value.get(field) == expected and _names(value.get("_id"), doc_id):
            return True
        return any(pins(item, doc_id, field, expected) for item in value.values())
    if isinstance(value, list | tuple):
        return any(pins(item, doc_id, field, expected) for item in value)
    bulk_filter = getattr(value, "_filter", None)  # pymongo's UpdateOne, DeleteMany, ...
    return bulk_filter is not None and pins(bulk_filter, doc_id, field, expected)


@dataclass(frozen=True)
class Completion:
    """A delivery a write deleted: which, at which claim generation, when, by whom."""

    item: str
    handler: str
    key: str | None
    sequence: int | None
    generation: int
    at: datetime
    writer: str


class OutboxObserver(Observer):
    """Reads the lanes and deliveries around every write of one dispatcher (the last hook of
    its view). A write that changes a document held under a live lease (ending at or after now)
    is a stale settle accepted unless it is the holder's and fenced on what it holds: a lane
    write naming the lane's instance (every holder's fence does) or, by its owner, its epoch;
    a delivery write by its lane's owner pinning its current generation. Records the deliveries
    its writes delete (`Completion`) into `completions`, shared by the run's dispatchers, and
    counts `claims`: entries its lane writes added to the lanes it holds."""

    def __init__(
        self, run: Run, writer: str, worker_id: str, completions: list[Completion]
    ) -> None:
        super().__init__(run, writer, worker_id)
        assert isinstance(run.holdings, OutboxHoldings)
        self.holdings: OutboxHoldings = run.holdings
        self.completions: list[Completion] = completions
        #: the `AsyncOutbox.instance` of the dispatcher (set once it exists)
        self.instance: str | None = None
        self._around: dict[int, tuple[datetime, dict[Any, Any], dict[Any, Any], set[Any]]] = {}

    def _listed(self) -> set[tuple[Any, Any, int]]:
        return {
            (lane["_id"], entry.get("d"), int(entry.get("g", 0)))
            for lane in self.run.store.documents(LANES)
            if lane.get("instance") == self.instance
            for entry in lane.get("in_flight") or ()
        }

    async def before(self, op: Operation) -> None:
        if op.name not in WRITES or op.collection not in (LANES, DELIVERIES):
            return
        now, store = self.run.clock.now(), self.run.store
        live: dict[Any, Any] = {}
        for doc in store.documents(op.collection):
            held = self.holdings.holding(op.collection, doc)
            if held is not None and held.until >= now:
                live[doc["_id"]] = (held, copy.deepcopy(dict(doc)), self.holdings.instance(doc))
        stored: dict[Any, Any] = {}
        if op.collection == DELIVERIES and op.name in DELETES:
            stored = {doc["_id"]: dict(doc) for doc in store.documents(DELIVERIES)}
        listed = self._listed() if op.collection == LANES else set()
        self._around[id(op)] = (now, live, stored, listed)

    def _fenced(
        self, op: Operation, doc_id: Any, before: Mapping[str, Any], holder: str | None
    ) -> bool:
        """Whether the write that changed `before` (held by the instance `holder`) is that
        holder's, fenced on what it holds."""
        arguments = (op.args, op.kwargs)
        if holder is None:
            return False
        if op.collection == LANES:
            return mentions(arguments, holder) or (
                holder == self.instance and pins(arguments, doc_id, "epoch", before["epoch"])
            )
        return holder == self.instance and pins(
            arguments, doc_id, "claims", before.get("claims", 0)
        )

    async def after(self, op: Operation, error: BaseException | None) -> None:
        around = self._around.pop(id(op), None)
        if around is None:
            return
        now, live, stored, listed = around
        store = self.run.store
        for doc_id, (held, before, holder) in live.items():
            current = store.document(op.collection, doc_id)
            if current is not None and dict(current) == before:
                continue
            if not self._fenced(op, doc_id, before, holder):
                self.run.violation(
                    "stale_settles",
                    f"stale settle: {self.writer}'s {op.collection}.{op.name} at "
                    f"{self.run.at(now)} changed {_describe(op.collection, before)}, "
                    f"{held.describe(self.run)}, to {_now_state(op.collection, current)}",
                )
        for doc_id, doc in stored.items():
            if store.document(DELIVERIES, doc_id) is None:
                self.completions.append(Completion(
                    item_of(doc), doc["handler"], doc.get("key"), doc.get("sequence"),
                    int(doc.get("claims", 0)), self.run.clock.now(), self.writer,
                ))  # fmt: skip
        if op.collection == LANES:
            self.claims += len(self._listed() - listed)


def _describe(collection: str, doc: Mapping[str, Any]) -> str:
    if collection == LANES:
        return f"lane {doc.get('handler')}/{doc.get('n')} (epoch {doc.get('epoch')})"
    return f"delivery {item_of(doc)} (generation {doc.get('claims', 0)})"


def _now_state(collection: str, doc: Mapping[str, Any] | None) -> str:
    if doc is None:
        return "nothing (deleted)"
    if collection == LANES:
        return f"owner {doc.get('owner')}, epoch {doc.get('epoch')}"
    return f"{doc.get('status')} at generation {doc.get('claims', 0)}"


def hire(
    crew: Crew, name: str, rates: FaultRates | None, owner: str, completions: list[Completion]
) -> Worker:
    """`Crew.hire` with an `OutboxObserver` as the view's last hook."""
    return crew.hire(name, rates, owner, OutboxObserver(crew.run, name, owner, completions))


# ---------------------------------------------------------------------------------- judging


def _lane_state(run: Run, lane: Mapping[str, Any]) -> str:
    if not lane:
        return "lane is missing"
    listed = ", ".join(f"g{e.get('g', 0)}" for e in lane.get("in_flight") or ())
    return (
        f"lane held by {lane.get('owner')} ({str(lane.get('instance'))[:6]}) at epoch "
        f"{lane.get('epoch')} until "
        f"{run.at(instant(lane.get('lease_until')))} listing [{listed}]"
    )


def judge_start(run: Run, delivery: Delivery, worker: str, instance: str) -> Execution:
    """Record a handler's start (before its first await) by `worker` (on the `AsyncOutbox`
    `instance`), judged by the lane and the delivery documents right now, and check its key's
    order (see the module docstring)."""
    now = run.clock.now()
    doc_id, generation = bson.ObjectId(delivery.id), delivery.generation
    epoch = int(delivery.lease_token.split(":")[1])
    doc = run.store.document(DELIVERIES, doc_id)
    assert isinstance(run.holdings, OutboxHoldings)
    lane = run.holdings.lane(delivery.handler, delivery.lane_id) or {}
    until = instant(lane.get("lease_until"))
    live = lane.get("owner") is not None and until is not None and until > now
    ours = lane.get("instance") == instance and lane.get("epoch") == epoch
    listed = any(e.get("d") == doc_id and e.get("g") == generation
                 for e in lane.get("in_flight") or ())  # fmt: skip
    current = doc is not None and doc.get("status") == "pending"
    current = current and doc is not None and int(doc.get("claims", 0)) == generation
    verdict = "live" if live and ours and listed and current else "overlap" if live and not ours \
        else "late"  # fmt: skip
    item = f"{delivery.event.id}/{delivery.handler}"
    execution = Execution(item, delivery.lease_token, worker, now, verdict)
    run.executions.setdefault(item, []).append(execution)
    if verdict != "live":
        state = "gone" if doc is None else f"{doc.get('status')} at g{doc.get('claims', 0)}"
        run.violation(
            "overlaps" if verdict == "overlap" else "late_starts",
            f"{'overlap' if verdict == 'overlap' else 'late start'}: {item} started by {worker} "
            f"(claim {delivery.lease_token}) at {run.at(now)}; the {_lane_state(run, lane)}; "
            f"the delivery {state}",
        )
    if delivery.event.key is not None:
        what = f"{item} (started by {worker} at {run.at(now)})"
        _check_key_at_start(run, run.holdings, doc_id, delivery, what)
    return execution


def _check_key_at_start(
    run: Run, holdings: OutboxHoldings, doc_id: Any, delivery: Delivery, what: str
) -> None:
    now, key, sequence = run.clock.now(), delivery.event.key, delivery.sequence or 0
    earlier, held = [], []
    for doc in run.store.documents(DELIVERIES):
        if doc["_id"] == doc_id or doc.get("handler") != delivery.handler or doc.get("key") != key:
            continue
        if doc.get("status") == "pending" and (doc.get("sequence") or 0) < sequence:
            earlier.append(item_of(doc))
        holding = holdings.holding(DELIVERIES, doc)
        if holding is not None and holding.until >= now:
            held.append(f"{item_of(doc)} by {holding.holder}")
    if earlier:
        run.violation(
            "order_violations",
            f"order: {what} while earlier deliveries of key {key!r} were pending: {earlier}",
        )
    if held:
        run.violation(
            "order_violations", f"order: {what} while {held} of key {key!r} ran under a lease"
        )
