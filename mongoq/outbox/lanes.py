"""Lane documents: who may claim which deliveries.

Collection ``<prefix>lanes`` holds 256 small documents, one per lane (``_id`` 0-255)::

    {_id, owner, instance, lease_until, epoch, rev, requeued, write, in_flight: [entry],
     lost: [entry]}

with ``entry = {"d": delivery _id, "g": claim generation, "h": handler, "k": key}`` (``k`` left
out for unkeyed deliveries). A worker (``owner``, on one `AsyncOutbox` instance: ``instance``)
holding a lane under a live lease is the only one that claims from it; ``in_flight`` lists what
it claimed, each with the delivery's claim generation at the time. An entry is *running* while
the lane is held and the delivery still exists with that generation: a completion deletes the
delivery, and a retry, release, burial or lost-lease charge moves its generation on, so none of
them has to write the lane. Taking a lane over increments ``epoch`` and moves the previous
owner's ``in_flight`` to ``lost``; `charge_lost` then charges each lost delivery one attempt,
fenced on the generation it was listed with, so charging twice charges once. ``rev`` moves on
with every write to the lane: a takeover pins the ``rev`` it read, so it applies only to the
state it judged free. ``requeued`` counts the `AsyncOutbox.requeue` calls of deliveries in the
lane (missing: 0): a holder's write listing new picks is fenced on the count it knew before it
read their keys' heads, so a requeue in between (a dead delivery that may now come first)
makes it fail and nothing it picked is handed out. ``write`` is the id of the claim that last
listed or took the lane: a claim whose bulk write matched fewer lanes than it wrote reads them
back and counts as its own only those carrying its id.

One more document, ``{_id: "requeues", value}``, counts every requeue for processes of earlier
versions, which read it around their claims.

An `AsyncOutbox` instance does not read the lanes on every claim: its `LaneView` is read whole
now and then (256 small documents) and kept current by its own writes. What it holds it knows
exactly, since every write to a held lane is its own or moves the epoch its writes are fenced
on; what another instance did since the last read it learns from a write that fails, or from
the next read.

Every write here is a conditional update of one lane by ``_id`` (no secondary index); the
filters and updates are in `mongoq.outbox.schema`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pymongo import ReturnDocument, UpdateMany, UpdateOne
from pymongo.errors import DuplicateKeyError

from mongoq import _driver
from mongoq.clock import stored_instant
from mongoq.outbox import schema
from mongoq.outbox.models import LANES
from mongoq.outbox.schema import REQUEUES

__all__ = [
    "REQUEUES", "Entry", "Lane", "LaneView", "adopt_shared_lanes", "charge_lost", "read_lanes",
    "read_slots", "seed_lanes",
]  # fmt: skip

#: Lane documents one read returns in its first batch (256 a handler).
READ_BATCH = 100_000
#: A lane nobody ever held: its lease expired long ago.
NEVER = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Entry:
    """One delivery listed by a lane: claimed by the lane's owner at generation `generation`."""

    delivery: Any
    generation: int
    handler: str
    key: str | None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Entry:
        return cls(doc["d"], int(doc.get("g", 0)), doc.get("h", ""), doc.get("k"))

    @property
    def claim(self) -> tuple[Any, int]:
        """(delivery _id, generation): the claim this entry lists."""
        return self.delivery, self.generation

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"d": self.delivery, "g": self.generation, "h": self.handler}
        if self.key is not None:
            doc["k"] = self.key
        return doc


@dataclass(frozen=True)
class Lane:
    """A lane document as read, or as this instance last wrote it. ``rev`` is None when it is
    not known (after a hand-back: the holder's renewals had moved it on meanwhile)."""

    id: int
    owner: str | None
    instance: str | None
    lease_until: datetime
    epoch: int
    rev: int | None = 0
    #: the handler whose deliveries of lane `number` this lane holds (None: a lane of an
    #: earlier version, shared by every handler, until `setup` adopts it)
    handler: str | None = None
    number: int = 0
    in_flight: list[Entry] = field(default_factory=list)
    lost: list[Entry] = field(default_factory=list)
    requeued: int = 0
    #: the id of the claim that last listed or took the lane (what a read-back proves)
    write: str | None = None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Lane:
        return cls(
            id=int(doc["_id"]),
            owner=doc.get("owner"),
            instance=doc.get("instance"),
            lease_until=stored_instant(doc.get("lease_until")) or NEVER,
            epoch=int(doc.get("epoch", 0)),
            rev=int(doc.get("rev", 0)),
            in_flight=[Entry.from_document(e) for e in doc.get("in_flight") or ()],
            lost=[Entry.from_document(e) for e in doc.get("lost") or ()],
            requeued=int(doc.get("requeued", 0)),
            write=doc.get("write"),
            handler=doc.get("handler"),
            number=int(doc.get("n", int(doc["_id"]) % LANES)),
        )

    @property
    def pair(self) -> tuple[str | None, int]:
        """(handler, lane number): which deliveries this lane holds."""
        return self.handler, self.number

    def held_by(self, owner: str, instance: str) -> bool:
        """Held by this owner on this instance; an expired lease nobody took over is still
        honoured (its next write renews it)."""
        return self.owner == owner and self.instance == instance

    def fence(self, owner: str, instance: str) -> dict[str, Any]:
        """The filter of a write by this lane's holder: it still holds the lane it read."""
        return schema.lane_held(self.id, self.epoch, owner, instance)

    def listing_fence(self, owner: str, instance: str) -> dict[str, Any]:
        """The filter of a holder's write listing new picks: it still holds the lane, and no
        requeue happened in it since this view of it."""
        return schema.lane_held(self.id, self.epoch, owner, instance, self.requeued)

    def take_filter(self) -> dict[str, Any]:
        """The filter of a takeover: the lane is exactly as read (judged free then); any write
        in between (a renewal, a hand-back, another take, a requeue) moves ``rev`` on and the
        take fails. A lane this instance handed back (``rev`` unknown) is taken as it was left:
        unowned at the same epoch (only a take moves it) and with no requeue since."""
        if self.rev is None:
            return schema.lane_as_left(self.id, self.epoch, self.requeued)
        return schema.lane_as_read(self.id, self.rev)

    def listing(self, in_flight: list[Entry], lease_until: datetime, write: str) -> Lane:
        """This lane once its holder's `schema.lane_listing` took effect."""
        return replace(self, in_flight=in_flight, lease_until=lease_until, rev=None, write=write)

    def taken(
        self, owner: str, instance: str, lease_until: datetime, in_flight: list[Entry],
        lost: list[Entry], write: str,
    ) -> Lane:  # fmt: skip
        """This lane once a `schema.lane_takeover` by `owner` took effect (its ``rev`` is not
        known: the holder's renewals move it on)."""
        return replace(self, owner=owner, instance=instance, lease_until=lease_until,
                       epoch=self.epoch + 1, rev=None, in_flight=in_flight, lost=lost,
                       write=write)  # fmt: skip

    def handed_back(self, now: datetime) -> Lane:
        """This lane once its holder's `schema.lane_handing_back` (nothing lost) took effect."""
        return replace(self, owner=None, instance=None, lease_until=now, rev=None,
                       in_flight=[], lost=[])  # fmt: skip


@dataclass
class LaneView:
    """What one `AsyncOutbox` instance knows of the lanes: every lane as last read or as its
    own writes left it, when it was read, and whether a write of its own failed since (the
    view is then wrong somewhere and is read again before the next claim).

    Claims of several owners on the instance update it concurrently, so a read never
    overwrites a lane updated after the read was sent (`mark` before sending it), by an own
    write or by a read sent later: a holder's view of its own lanes stays its last write, which
    its next write builds on."""

    lanes: dict[int, Lane] = field(default_factory=dict)
    read_at: datetime = NEVER
    failed: bool = False
    _tick: int = 0
    _stamps: dict[int, int] = field(default_factory=dict)
    _handlers: set[str] = field(default_factory=set)

    def handlers(self) -> set[str]:
        """The handlers this view has lanes of."""
        return set(self._handlers)

    def split(
        self, owner: str, instance: str, now: datetime, handlers: Sequence[str] | None = None
    ) -> tuple[dict[int, Lane], dict[int, Lane], list[Lane]]:
        """The lanes of `handlers` (None: of every handler) `owner` holds on `instance`, the
        free ones with nothing listed, and the free ones left with deliveries listed (to take
        over first), as this view has them."""
        held: dict[int, Lane] = {}
        free: dict[int, Lane] = {}
        stale: list[Lane] = []
        wanted = None if handlers is None else set(handlers)
        for lane_id, lane in self.lanes.items():  # one pass: this runs on every claim
            if wanted is not None and lane.handler not in wanted:
                continue
            if lane.held_by(owner, instance):
                held[lane_id] = lane
            elif lane.owner is None or lane.lease_until <= now:  # free
                if lane.in_flight or lane.lost:
                    stale.append(lane)
                else:
                    free[lane_id] = lane
        return held, free, stale

    def mark(self) -> int:
        """The mark to give `update` with what a read sent now returns: later than every
        update so far and every earlier mark."""
        self._tick += 1
        return self._tick

    def update(self, lanes: Sequence[Lane], read_since: int | None = None) -> None:
        """Lanes as this instance's own writes left them, or (`read_since`: the `mark` taken
        before the read was sent) as read. A read applies to a lane only if it was sent after
        what the view has of it: after the own write, or after the read, that set it."""
        for lane in lanes:
            if read_since is None:
                self._tick += 1
                stamp = self._tick
            elif read_since < self._stamps.get(lane.id, 0):
                continue  # the view has something newer than this read
            else:
                stamp = read_since
            self.lanes[lane.id] = lane
            self._stamps[lane.id] = stamp
            if lane.handler is not None:
                self._handlers.add(lane.handler)


def lane_document(lane_id: int, handler: str) -> dict[str, Any]:
    return {
        "_id": lane_id,
        "handler": handler,
        "n": lane_id % LANES,
        "owner": None,
        "instance": None,
        "lease_until": NEVER,
        "epoch": 0,
        "rev": 0,
        "requeued": 0,
        "in_flight": [],
        "lost": [],
    }


async def read_slots(collection: Any) -> dict[str, int]:
    """Every handler's slot: its lanes are ``slot * 256 + n`` (one read)."""
    docs = await _driver.find_list(collection, schema.slots_all())
    return {doc["handler"]: int(doc["slot"]) for doc in docs}


async def seed_lanes(db: Any, collection: Any, handlers: Sequence[str]) -> dict[str, int]:
    """Give each of `handlers` a slot and its 256 lanes, where it has none yet (idempotent,
    safe to race), then adopt the lanes an earlier version shared among all handlers
    (`adopt_shared_lanes`); returns every handler's slot. The first handler ever given one
    gets slot 0: lanes 0-255, the earlier version's lane ids."""
    slots = await _give_slots(db, collection, handlers)
    first = next((h for h, slot in slots.items() if slot == 0), None)
    if first is not None:
        slots = await adopt_shared_lanes(db, collection, first, slots)
    return slots


async def _give_slots(db: Any, collection: Any, handlers: Iterable[str]) -> dict[str, int]:
    """A slot, and its lanes, for each of `handlers` without one; every handler's slot."""
    slots = await read_slots(collection)
    for handler in dict.fromkeys(handlers):
        if handler in slots:
            continue
        counted = await collection.find_one_and_update(
            schema.slot_counter(), schema.slot_counting(), upsert=True,
            return_document=ReturnDocument.AFTER,
        )  # fmt: skip
        # Another process may have given it one first: a slot number wasted, no harm.
        with contextlib.suppress(DuplicateKeyError):
            await collection.insert_one(schema.slot_document(handler, int(counted["next"]) - 1))
        slots = await read_slots(collection)
        first = slots[handler] * LANES
        # Upserts that create only what is missing: slot 0's ids may be shared lanes.
        await collection.bulk_write([
            _driver.update_by_id(db, schema.lane_by_id(lane_id),
                                 schema.lane_seeding(lane_document(lane_id, handler)),
                                 upsert=True)
            for lane_id in range(first, first + LANES)
        ], ordered=False)  # fmt: skip
    return slots


async def adopt_shared_lanes(
    db: Any, collection: Any, first: str, slots: dict[str, int]
) -> dict[str, int]:
    """Lanes 0-255 become `first`'s (slot 0). A lane an earlier version shared among all
    handlers is adopted: what it listed moves, by handler, to the ``lost`` of that handler's
    lane of the same number (charged by its next holder, fenced on generation, so a repeated
    adoption charges once), and the lane is left unowned. A dispatcher of the earlier
    version still running loses what it ran (it runs again): stop those before the first
    `setup` of this version. Returns every handler's slot."""
    for _ in range(8):  # a write to a shared lane in between: read it again
        docs = await _driver.find_list(collection, schema.lanes_shared())
        shared = [Lane.from_document(doc) for doc in docs]
        if not shared:
            break
        listed = {e.handler for lane in shared for e in lane.in_flight + lane.lost}
        slots = await _give_slots(db, collection, sorted(listed - {first}))
        moves: dict[int, list[Entry]] = {}
        for lane in shared:
            for entry in lane.in_flight + lane.lost:
                if entry.handler != first:
                    moves.setdefault(slots[entry.handler] * LANES + lane.number, []).append(entry)
        if moves:
            await collection.bulk_write([
                _driver.update_by_id(db, schema.lane_by_id(lane_id),
                                     schema.lane_losing(entries))
                for lane_id, entries in moves.items()
            ], ordered=False)  # fmt: skip
        await collection.bulk_write([
            _driver.update_by_id(
                db, schema.lane_as_read(lane.id, lane.rev or 0),
                schema.lane_adopting(first, lane.number, [
                    e for e in lane.in_flight + lane.lost if e.handler == first
                ]),
            )
            for lane in shared
        ], ordered=False)  # fmt: skip
    return slots


async def read_lanes(collection: Any) -> list[Lane]:
    """Every handler's lanes, in one round trip."""
    # A batch larger than there are: a first batch the documents fill exactly leaves the
    # cursor open on a server, and draining it would be a getMore.
    docs = await _driver.find_list(collection, schema.lanes_all(), batch_size=READ_BATCH)
    return [Lane.from_document(doc) for doc in docs]


async def charge_lost(
    db: Any, deliveries: Any, lanes: Any, taken: Sequence[tuple[Lane, int]], now: datetime
) -> None:
    """Charge one attempt to every delivery the previous owners of `taken` (lane, epoch after
    the take) still had running, then clear the lanes' ``lost`` lists.

    The charge is fenced on the generation each delivery was listed with and moves it on, so a
    charge repeated after a failure between the two writes, or a delayed one, charges nothing
    twice; a delivery that finished or was retried meanwhile is not charged at all.
    """
    entries = [entry for lane, _ in taken for entry in lane.lost]
    if entries:
        await deliveries.update_many(
            schema.delivery_claimed(e.claim for e in entries), schema.delivery_charging(now)
        )
    clear: list[UpdateOne | UpdateMany] = [
        _driver.update_by_id(db, schema.lane_at_epoch(lane.id, epoch), schema.lane_clearing_lost())
        for lane, epoch in taken
        if lane.lost
    ]
    if clear:
        await lanes.bulk_write(clear, ordered=False)
