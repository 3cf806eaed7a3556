"""Hostile data in the outbox's collections: the filters and updates that set aside a stored
document `mongoq.outbox.faults` finds unusable, and `Quarantine`, which sends them and logs
each once.

A document written by hand, by another program or by a bad restore may hold a field of a type
mongoq never writes. Whatever meets it first (a claim, a settle, a takeover, the dispatcher
waiting for what is due) sets it aside instead of failing on it again and again:

- a pending delivery becomes a dead letter (``status: "dead"``, out of every pending index),
  its ``last_error`` naming the field and what it holds (``field 'attempts' holds a string
  ('x')``); its other fields are kept for the operator to see, and `AsyncOutbox.requeue` repairs
  the bookkeeping ones (``claims``, ``lane_id``; ``attempts`` is reset anyway);
- a delivery of an event that cannot be handed out (or that refuses its completion record) is
  set aside the same way, the event left as it is;
- a lane document is repaired in place: every field that cannot be read gets a usable value, the
  rest is kept (a live holder keeps its lane), and entries that cannot be read are dropped;
- the slots document is rebuilt from the lanes' ``handler`` fields, or reported if they do not
  say it whole.

Each writes once, fenced on the document's ``_id`` and the state it was read in (a delivery: its
``claims`` and the fields found wrong, still pending; a lane: its ``rev`` and the fields found
wrong), and logs one WARNING through `mongoq.runtime.report.log_set_aside`. A good document
costs no command: the checks are type tests of what a claim reads anyway (every candidate's
``_id`` and key; a key's first, each pick and its event whole), or follow a read or a write
that failed (a server refusing ``$inc`` of a non-number: code 14).

This module is `mongoq.outbox.schema`'s annex for these filters and updates (served by ``_id``;
``schema.py`` is near its size bound).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from logging import Logger
from typing import Any

from mongoq import _driver
from mongoq.outbox import schema
from mongoq.outbox.faults import (
    Fault,
    delivery_fault,
    describe,
    entry_fault,
    is_text,
    lane_faults,
    slots_fault,
    whole,
)
from mongoq.outbox.models import LANES
from mongoq.runtime.report import Attempt, log_set_aside

__all__ = ["SET_ASIDE_PER_READ", "Quarantine", "Unusable"]

#: Unusable documents one read that met them sets aside before it answers anyway.
SET_ASIDE_PER_READ = 16


def _as_read(doc: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A condition matching field `name` as it was in `doc` (missing: still missing). ``$eq``:
    a stored document holding ``$`` keys stays a value, never an operator."""
    return {"$eq": doc[name]} if name in doc else {"$exists": False}


def delivery_as_read(doc: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """A delivery still pending as it was read: its ``_id``, its ``claims`` (when read) and the
    `fields` found wrong: every set-aside of a delivery (``_id``)."""
    query: dict[str, Any] = {"_id": {"$eq": doc["_id"]}}
    if "claims" in doc:
        query["claims"] = _as_read(doc, "claims")
    for name in fields:
        query[name] = _as_read(doc, name)
    query.setdefault("due_at", {"$exists": True})  # (a due time read implies it)
    return query


def delivery_setting_aside(error: str, now: datetime) -> dict[str, Any]:
    """A delivery set aside (`delivery_as_read`): a dead letter, out of every pending index. No
    ``$inc``: its ``claims`` may be what holds no number; a late settle of it is refused
    anyway (every settle needs it pending), and a requeue moves its generation on."""
    return {
        "$set": {"status": schema.DEAD, "last_error": error, "updated_at": now},
        "$unset": {"due_at": "", "lane": ""},
    }


def dead_as_read(event_id: str, handler: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """A dead delivery as `requeue` read it (its ``claims`` and ``lane_id``): a requeue
    repairing its bookkeeping (``event_handler``)."""
    return {
        **schema.delivery_dead(event_id, handler),
        "claims": _as_read(doc, "claims"),
        "lane_id": _as_read(doc, "lane_id"),
    }


def delivery_requeuing_repaired(now: datetime, lane_id: int, claims: int) -> dict[str, Any]:
    """`requeue` of a `dead_as_read` delivery whose ``claims`` or ``lane_id`` could not be used:
    as `schema.delivery_requeuing`, with the lane of its key (or event) and a generation no
    earlier claim can hold (``claims``: the time in milliseconds, beyond any count)."""
    return {
        "$set": {"status": schema.PENDING, "lane": schema.READY, "due_at": now, "attempts": 0,
                 "updated_at": now, "requeue_uncounted": True, "lane_id": lane_id,
                 "claims": claims},
    }  # fmt: skip


def lane_as_read(doc: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """A lane as it was read: its ``_id``, its ``rev`` (every write moves it on) and the
    `fields` found wrong: the repair of a lane (``_id``)."""
    query: dict[str, Any] = {"_id": doc["_id"], "rev": _as_read(doc, "rev")}
    query.update((name, _as_read(doc, name)) for name in fields)
    return query


def lane_repairing(repaired: Mapping[str, Any]) -> dict[str, Any]:
    """A lane's repair (`lane_as_read`): the `repaired` fields set."""
    return {"$set": dict(repaired)}


def slots_as_read(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The slots as read: their rebuilding (``_id``)."""
    return {**schema.slots_document(), "handlers": _as_read(doc, "handlers")}


def slots_rebuilding(handlers: Sequence[str]) -> dict[str, Any]:
    """The slots rebuilt from the lanes (`slots_as_read`)."""
    return {"$set": {"handlers": list(handlers)}}


# ============================================================================ the writes


@dataclass(frozen=True)
class Unusable:
    """A pending delivery as read (`doc`) that cannot be used, because of `field` (holding
    `found`) of the document in `collection` (the deliveries, or its event's); `detail`: what
    the server said, if it refused a write."""

    doc: Mapping[str, Any]
    field: str
    found: str
    collection: str = schema.DELIVERIES
    detail: str = ""

    @classmethod
    def of(cls, doc: Mapping[str, Any], fault: Fault) -> Unusable:
        return cls(doc, fault[0], fault[1])

    @property
    def error(self) -> str:
        """The dead letter's ``last_error``."""
        text = describe((self.field, self.found))
        if self.collection == schema.EVENTS:
            text = f"event {self.doc.get('event_id')!r}: {text}"
        return f"{text} (the server refused: {self.detail})" if self.detail else text


class Quarantine:
    """The set-asides and repairs of one `AsyncOutbox`: each fenced, each logged once."""

    def __init__(self, *, deliveries: Any, lanes: Any, prefix: str, log: Logger) -> None:
        self.deliveries = deliveries
        self.lanes = lanes
        self.prefix = prefix
        self.log = log
        # the deliveries a settle set aside, until the dispatcher counted them (`was_set_aside`)
        self._settled: set[str] = set()
        # (item, field) of what was reported, never to be logged again by this instance
        self._reported: set[tuple[str, str]] = set()

    def remember(self, ids: Iterable[Any]) -> None:
        """Deliveries a settle set aside instead of doing what it was asked."""
        self._settled.update(map(str, ids))

    def was_set_aside(self, delivery_id: str) -> bool:
        """Whether a settle of `delivery_id` set it aside (asked once: forgotten then)."""
        if delivery_id in self._settled:
            self._settled.discard(delivery_id)
            return True
        return False

    def _name(self, collection: str) -> str:
        return f"{self.prefix}{collection}"

    async def set_aside(
        self, found: Iterable[Unusable], now: datetime, worker: str | None
    ) -> list[Any]:
        """Make each delivery of `found` a dead letter, if still pending as read; returns the
        ``_id`` of each one set aside (logged, one WARNING each)."""
        done: list[Any] = []
        for unusable in found:
            doc = unusable.doc
            fields = [unusable.field] if unusable.collection == schema.DELIVERIES else []
            before = await self.deliveries.find_one_and_update(
                delivery_as_read(doc, fields), delivery_setting_aside(unusable.error, now)
            )
            if before is None:
                continue  # settled, set aside or changed meanwhile
            done.append(doc["_id"])
            attempts = before.get("attempts")
            item = f"{before.get('event_id')}/{before.get('handler')}"
            number = int(attempts) + 1 if whole(attempts) else None
            log_set_aside(
                self.log, Attempt("outbox", self.prefix, item, number, worker),
                self._name(unusable.collection), unusable.field, unusable.found, "buried",
            )  # fmt: skip
        return done

    async def set_aside_read(
        self, query: Mapping[str, Any], now: datetime, worker: str | None
    ) -> list[Any]:
        """Read the pending deliveries `query` matches after a write to them was refused, and
        set aside those that cannot be used; returns their ``_id``s."""
        docs = await _driver.find_list(self.deliveries, query)
        found = [Unusable.of(doc, fault) for doc in docs if (fault := delivery_fault(doc))]
        return await self.set_aside(found, now, worker) if found else []

    async def repair_lanes(
        self, docs: Iterable[Mapping[str, Any]], now: datetime, handlers: Sequence[str]
    ) -> tuple[list[dict[str, Any]], list[Any]]:
        """Repair lane documents that cannot be read (`lane_faults`); `handlers` names each
        slot's handler (the slots, as read). Returns each lane as repaired, and the ``_id`` of
        those a write changed meanwhile (to read again). A lane of a slot no handler has is
        reported once, left as it is: no claim reads it."""
        repaired: list[dict[str, Any]] = []
        changed: list[Any] = []
        for doc in docs:
            faults = lane_faults(doc)
            slot = int(doc["_id"]) // LANES
            if not faults:
                continue
            name, found = next(iter(faults.items()))  # one line a lane: its first field
            if slot >= len(handlers):
                attempt = Attempt("outbox", self.prefix, str(doc["_id"]), None, None)
                self._report(attempt, schema.LANES, name, found)
                continue
            fixed = _lane_repair(doc, faults, now, handlers[slot])
            result = await self.lanes.update_one(lane_as_read(doc, faults), lane_repairing(fixed))
            if not result.modified_count:
                changed.append(doc["_id"])
                continue
            repaired.append({**doc, **fixed})
            owner = doc.get("owner") if isinstance(doc.get("owner"), str) else None
            log_set_aside(
                self.log, Attempt("outbox", self.prefix, str(doc["_id"]), None, owner),
                self._name(schema.LANES), name, found, "repaired",
            )  # fmt: skip
        return repaired, changed

    def _report(self, attempt: Attempt, collection: str, field: str, found: str) -> None:
        """Log once (per instance) what can be neither set aside nor repaired: every claim
        meets it again, one line says it."""
        if (attempt.item, field) not in self._reported:
            self._reported.add((attempt.item, field))
            log_set_aside(self.log, attempt, self._name(collection), field, found, "reported")

    async def rebuild_slots(self, doc: Mapping[str, Any]) -> list[str] | None:
        """Rebuild the slots document `doc` (unreadable: `slots_fault`) from the ``handler``
        of each lane (slot ``_id // 256``); None when the lanes do not say every slot's
        handler, one way (then reported: the outbox claims nothing until it is fixed)."""
        fault = slots_fault(doc) or ("handlers", "nothing")
        docs = await _driver.find_list(
            self.lanes, schema.lanes_all(), projection={"handler": 1}, batch_size=100_000
        )
        by_slot: dict[int, set[Any]] = defaultdict(set)
        for lane in docs:
            if whole(lane["_id"]):
                by_slot[int(lane["_id"]) // LANES].add(lane.get("handler"))
        handlers = [
            next(iter(names))
            for names in (by_slot.get(slot, set()) for slot in range(max(by_slot, default=-1) + 1))
            if len(names) == 1 and is_text(next(iter(names)))
        ]
        attempt = Attempt("outbox", self.prefix, schema.SLOTS, None, None)
        collection = self._name(schema.LANES)
        if (
            len(handlers) != len(by_slot)
            or len(set(handlers)) != len(handlers)
            or (by_slot and max(by_slot) + 1 != len(by_slot))
        ):
            self._report(attempt, schema.LANES, *fault)
            return None
        result = await self.lanes.update_one(slots_as_read(doc), slots_rebuilding(handlers))
        if result.modified_count:
            log_set_aside(self.log, attempt, collection, *fault, "repaired")
        return handlers


def _lane_repair(
    doc: Mapping[str, Any], faults: Mapping[str, str], now: datetime, handler: str
) -> dict[str, Any]:
    """The fields that repair a lane: a usable value for each of `faults`. A holder that cannot
    be read gives the lane up (what it lists moves to ``lost``, charged by the next holder); a
    counter that cannot be read starts again beyond any value a reader can hold (the time in
    milliseconds), so that every write fenced on what it read before fails."""
    fixed: dict[str, Any] = {}
    beyond = int(now.timestamp() * 1000)
    lane_id = int(doc["_id"])
    if "handler" in faults:
        fixed["handler"] = handler
    if "n" in faults:
        fixed["n"] = lane_id % LANES
    entries = {
        name: [e for e in doc[name] if not entry_fault(e)]
        if isinstance(doc.get(name), list) else []
        for name in ("in_flight", "lost")
    }  # fmt: skip
    for name in ("in_flight", "lost"):
        if name in faults:
            fixed[name] = entries[name]
    if "owner" in faults or "instance" in faults:
        fixed.update(owner=None, instance=None, in_flight=[],
                     lost=entries["lost"] + entries["in_flight"])  # fmt: skip
    if "lease_until" in faults:
        fixed["lease_until"] = now  # expired: honoured for its holder until taken over
    if "write" in faults:
        fixed["write"] = None
    for name in ("epoch", "rev", "requeued"):
        if name in faults:
            fixed[name] = beyond
    if "rev" not in fixed:  # every repair is a write: a take pinned on the rev read fails
        fixed["rev"] = int(doc["rev"]) + 1
    return fixed
