"""Lane documents: who may claim which deliveries.

Collection ``<prefix>lanes`` holds 256 small documents a handler, one per lane number ``n``
(0-255) of that handler: ``_id`` ``slot * 256 + n``, where the handler's slot is its place in
the ``slots`` document::

    {_id, handler, n, owner, instance, lease_until, epoch, rev, requeued, write,
     in_flight: [entry], lost: [entry]}

with ``entry = {"d": delivery _id, "g": claim generation, "h": handler, "k": key}`` (``k`` left
out for unkeyed deliveries). A delivery of lane number n (`mongoq.outbox.models.lane_of`) is
claimed through its handler's lane n only. A worker (``owner``, on one `AsyncOutbox`
instance: ``instance``) holding a lane under a live lease is the only one that claims from it;
``in_flight`` lists what it claimed, each with the delivery's claim generation at the time. An
entry is *running* while the lane is held and the delivery still exists with that generation:
a completion deletes the delivery, and a retry, release, burial or lost-lease charge moves its
generation on, so none of them has to write the lane. Taking a lane over increments ``epoch``
and moves the previous owner's ``in_flight`` to ``lost``; `charge_lost` then charges each lost
delivery one attempt, fenced on the generation it was listed with, so charging twice charges
once. ``rev`` moves on with every write to the lane: a takeover pins the ``rev`` it read, so it
applies only to the state it judged free. ``requeued`` counts the `AsyncOutbox.requeue` calls
of deliveries in the lane (missing: 0): a holder's write listing new picks is fenced on the
count it knew before it read their keys' heads, so a requeue in between (a dead delivery that
may now come first) makes it fail and nothing it picked is handed out. ``write`` is the id of
the claim that last listed or took the lane: a claim whose bulk write matched fewer lanes than
it wrote reads them back and counts as its own only those carrying its id.

Two more documents: ``{_id: "slots", handlers: [slot 0's handler, slot 1's, ...], adopted}``
numbers the handlers (a handler's slot never changes; `seed_lanes`), and ``{_id: "requeues",
value}`` counts every requeue for processes of earlier versions, which read it around their
claims. An earlier version's lanes (``_id`` 0-255 without ``n``) were shared by every handler;
`adopt_shared_lanes` makes them slot 0's and moves what they list to each handler's own lanes.

An `AsyncOutbox` instance does not read the lanes on every claim: its `LaneView` reads the
lanes of a claim's handlers now and then (an ``_id`` range a handler) and is kept current by
its own writes. What it holds it knows exactly, since every write to a held lane is its own or
moves the epoch its writes are fenced on; what another instance did since the last read it
learns from a write that fails, or from the next read.

Every write here names its lane's ``_id`` (no secondary index); the filters and updates are in
`mongoq.outbox.schema`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pymongo import UpdateMany, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError

from mongoq import _driver
from mongoq.clock import stored_instant
from mongoq.outbox import schema
from mongoq.outbox.models import LANES
from mongoq.outbox.schema import REQUEUES

__all__ = [
    "REQUEUES", "Entry", "Lane", "LaneView", "Slots", "adopt_shared_lanes", "charge_lost",
    "read_lanes", "read_slots", "seed_lanes",
]  # fmt: skip

#: Lane documents one read returns in its first batch (256 a handler).
READ_BATCH = 100_000
log = logging.getLogger("mongoq.outbox.lanes")

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


@dataclass(frozen=True)
class Slots:
    """The handlers with lanes, in slot order (handler ``handlers[s]``'s lanes are ``s * 256``
    to ``s * 256 + 255``), and whether no lane of an earlier version is left."""

    handlers: tuple[str, ...] = ()
    adopted: bool = False

    @classmethod
    def from_document(cls, doc: Mapping[str, Any] | None) -> Slots:
        if doc is None:
            return cls()
        return cls(tuple(doc.get("handlers") or ()), bool(doc.get("adopted")))

    def first_lane(self, handler: str) -> int | None:
        """The ``_id`` of `handler`'s lane 0 (None: it has no lanes)."""
        try:
            return self.handlers.index(handler) * LANES
        except ValueError:
            return None

    def newer(self, read: Slots) -> Slots:
        """These slots, or `read` if it is as new (a late reply of an older read never takes
        a handler or the adoption back: handlers are only ever added, ``adopted`` only set)."""
        if len(read.handlers) < len(self.handlers) or (self.adopted and not read.adopted):
            return replace(read, handlers=self.handlers, adopted=self.adopted or read.adopted)
        return read

    def ranges(self, handlers: Iterable[str]) -> list[tuple[int, int]]:
        """The ``_id`` ranges of the lanes of those of `handlers` that have lanes."""
        firsts = (self.first_lane(h) for h in dict.fromkeys(handlers))
        return [(first, first + LANES) for first in firsts if first is not None]


def _within(lane_id: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether `lane_id` is in one of the ``[first, end)`` `ranges`."""
    return any(lo <= lane_id < hi for lo, hi in ranges)


@dataclass
class LaneView:
    """What one `AsyncOutbox` instance knows of the lanes: every lane as last read or as its
    own writes left it, which handler has which lanes, when each handler's were read, and
    whether a write of its own failed since (the view is then wrong somewhere and is read
    again before the next claim, with the lanes that write was for).

    Claims of several owners on the instance update it concurrently, so a read never
    overwrites a lane updated after the read was sent (`mark` before sending it), by an own
    write or by a read sent later: a holder's view of its own lanes stays its last write, which
    its next write builds on."""

    lanes: dict[int, Lane] = field(default_factory=dict)
    #: which handler has which lanes, as last read
    slots: Slots = field(default_factory=Slots)
    #: handler -> when its lanes were last read (None: the slots)
    read_at: dict[str | None, datetime] = field(default_factory=dict)
    failed: bool = False
    #: lanes a write of this instance that failed, or matched fewer, may have left otherwise
    #: than the view has them
    unsure: set[int] = field(default_factory=set)
    _tick: int = 0
    _stamps: dict[int, int] = field(default_factory=dict)

    def read_due(self, handlers: Iterable[str | None], now: datetime, ttl: float) -> bool:
        """Whether the lanes of `handlers` were read `ttl` seconds ago or more (or never, or
        the clock went back)."""
        for handler in handlers:
            read_at = self.read_at.get(handler, NEVER)
            if read_at > now or (now - read_at).total_seconds() >= ttl:
                return True
        return False

    def outside(self, ranges: Sequence[tuple[int, int]], owner: str, instance: str) -> list[int]:
        """The lanes outside `ranges` that a read for `owner` must include: those the view has
        as held by it on `instance`, and the `unsure` ones."""
        ids = set(self.unsure)
        ids.update(i for i, lane in self.lanes.items() if lane.held_by(owner, instance))
        return sorted(i for i in ids if not _within(i, ranges))

    def drop_adopted(self, returned: set[int]) -> None:
        """Forget the shared lanes a read that asked for every one of them did not return:
        adopted since (a lane that is a handler's stays one), possibly into a handler's lanes
        this view does not read, where its old copy would block its number for good."""
        for lane_id in [i for i, lane in self.lanes.items() if lane.handler is None]:
            if lane_id not in returned:
                del self.lanes[lane_id]
                self._stamps.pop(lane_id, None)

    def shared(self) -> bool:
        """Whether this view has lanes of an earlier version, shared among all handlers."""
        return not self.slots.adopted and any(lane.handler is None for lane in self.lanes.values())

    def split(
        self, owner: str, instance: str, now: datetime, handlers: Iterable[str]
    ) -> tuple[dict[int, Lane], dict[int, Lane], list[Lane], dict[int, Lane]]:
        """The lanes of `handlers` `owner` holds on `instance`, the free ones with nothing
        listed, and the free ones left with deliveries listed (to take over first), as this
        view has them; and the lanes of other handlers `owner` holds on `instance`."""
        held: dict[int, Lane] = {}
        free: dict[int, Lane] = {}
        stale: list[Lane] = []
        others: dict[int, Lane] = {}
        wanted = set(handlers)
        # The numbers of lanes an earlier version shared that are not adopted yet: no lane of
        # those numbers is taken (what the shared lane lists is not in the handler's yet).
        blocked = () if self.slots.adopted else {
            lane.number for lane in (self.lanes.get(n) for n in range(LANES))
            if lane is not None and lane.handler is None
        }  # fmt: skip
        for lane_id, lane in self.lanes.items():  # one pass: this runs on every claim
            if lane.handler not in wanted:
                if lane.handler is not None and lane.held_by(owner, instance):
                    others[lane_id] = lane
            elif lane.held_by(owner, instance):
                held[lane_id] = lane
            elif blocked and lane.number in blocked:
                continue
            elif lane.owner is None or lane.lease_until <= now:  # free
                if lane.in_flight or lane.lost:
                    stale.append(lane)
                else:
                    free[lane_id] = lane
        return held, free, stale, others

    async def refresh(
        self, collection: Any, owner: str, instance: str, handlers: Sequence[str] | None,
        now: datetime, ttl: float,
    ) -> None:  # fmt: skip
        """Read the lanes a claim of `owner` (on `instance`) and `handlers` works from: those
        handlers' lanes (every lane for None) and the slots; beside them, by ``_id``, the lanes
        the owner holds of other handlers and those a failed write left the view `unsure` of
        (what its reconcile and hand-backs work from must not stay as it last wrote or read
        them), and the shared lanes until they are adopted. A handler whose slot the view does
        not know has the slots read first (at most once `ttl` seconds)."""
        named = handlers if handlers is not None else self.slots.handlers
        self.failed = False
        since = self.mark()
        try:
            unknown = handlers is not None and any(
                self.slots.first_lane(h) is None for h in handlers
            )
            if unknown and self.read_due([None], now, ttl):
                self.slots = await read_slots(collection)
                self.read_at[None] = now
            ranges = None if handlers is None else self.slots.ranges(handlers)
            # the handlers whose lanes this read covers (a name without a slot: it has none)
            sent = [h for h in named if self.slots.first_lane(h) is not None]
            pending = set(self.unsure)
            extra = [] if ranges is None else self.outside(ranges, owner, instance)
            shared = not self.slots.adopted
            lanes, slots = await read_lanes(collection, ranges, extra, shared=shared)
        except BaseException:
            self.failed = True
            raise
        # Read now: the slots, and the lanes of the handlers whose slots were known (a handler
        # given one since is read by the next claim).
        known = slots.handlers if handlers is None else [
            *sent, *(h for h in named if slots.first_lane(h) is None)
        ]  # fmt: skip
        self.update(lanes, read_since=since)
        if shared:  # a shared lane this read did not return was adopted (for good)
            self.drop_adopted({lane.id for lane in lanes})
        self.unsure -= pending if ranges is None else {
            i for i in pending if i in extra or _within(i, ranges)
        }  # fmt: skip
        self.slots = self.slots.newer(slots)
        self.read_at.update(dict.fromkeys([None, *known], now))

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


async def read_slots(collection: Any) -> Slots:
    """Which handler has which lanes (one read)."""
    return Slots.from_document(await collection.find_one(schema.slots_document()))


async def seed_lanes(
    db: Any, collection: Any, handlers: Iterable[str], now: datetime, *, every: bool = False
) -> Slots:
    """Give each of `handlers` a slot and its 256 lanes, where it has none yet, create any
    lane missing from a slot it has (with `every`, from every handler's slot), then adopt the
    lanes an earlier version shared among all handlers (`adopt_shared_lanes`); idempotent,
    safe to race. The first handler ever given a slot has slot 0: lanes 0-255, the earlier
    version's lane ids."""
    slots = await _give_slots(collection, handlers, every=every)
    if not slots.adopted:
        slots = await adopt_shared_lanes(db, collection, slots, now)
    return slots


async def _give_slots(collection: Any, handlers: Iterable[str], *, every: bool = False) -> Slots:
    """A slot for each of `handlers` without one, and every lane of theirs (with `every`: of
    every handler with a slot) not there yet."""
    slots = await read_slots(collection)
    wanted = list(dict.fromkeys([*(slots.handlers if every else ()), *handlers]))
    missing = [h for h in wanted if slots.first_lane(h) is None]
    if missing:
        with contextlib.suppress(DuplicateKeyError):  # two first set-ups at once
            await collection.update_one(
                schema.slots_document(), schema.slots_creating(), upsert=True
            )
        for handler in missing:  # a set-up that gave it one meanwhile: no match, no harm
            await collection.update_one(schema.slot_not_given(handler), schema.slot_giving(handler))
        slots = await read_slots(collection)
    ranges = slots.ranges(wanted)
    if not ranges:
        return slots
    # Only what is missing: a seeding that failed half-way is finished by the next one, and
    # slot 0's ids may be lanes an earlier version shared (adopted, never overwritten). A lane
    # another seeding inserts meanwhile is refused as a duplicate: there already.
    present = {
        doc["_id"]
        for doc in await _driver.find_list(
            collection,
            schema.lanes_in(ranges),
            projection={"_id": 1},
            batch_size=READ_BATCH,
        )
    }
    seeds = [
        lane_document(lane_id, slots.handlers[lo // LANES])
        for lo, hi in ranges
        for lane_id in range(lo, hi)
        if lane_id not in present
    ]
    if seeds:
        try:
            await collection.insert_many(seeds, ordered=False)
        except BulkWriteError as exc:  # another seeding wrote some first
            if not _driver.only_duplicates(exc):
                raise
    return slots


async def adopt_shared_lanes(
    db: Any, collection: Any, slots: Slots, now: datetime, *, quiet: bool = False
) -> Slots:
    """Lanes 0-255 of an earlier version, shared among all handlers, become slot 0's: what
    each listed moves, by handler, to the ``lost`` of that handler's lane of the same number
    (first; charged by the next holder, fenced on generation, so a repeated adoption charges
    once), and the lane itself becomes slot 0's handler's, unowned, its epoch moved on. A
    shared lane held under a live lease (a dispatcher of the earlier version still running)
    is left until its lease expires: until then no handler's lane of its number is claimed
    (`LaneView.split`). Once none is left, the slots record it and claims stop looking.
    `quiet`: held lanes are logged at debug level (a claim's retry, once a second), not as a
    warning (`setup`). Returns the slots."""
    for _ in range(8):  # an earlier version's write to a shared lane in between: again
        docs = await _driver.find_list(collection, schema.lanes_shared(), batch_size=READ_BATCH)
        shared = [Lane.from_document(doc) for doc in docs]
        if not shared:
            await collection.update_one(schema.slots_document(), schema.slots_adopted())
            return replace(slots, adopted=True)
        due = [lane for lane in shared if lane.owner is None or lane.lease_until <= now]
        if not due:
            break
        listed = sorted({e.handler for lane in due for e in lane.in_flight + lane.lost})
        slots = await _give_slots(collection, listed)
        if not slots.handlers:
            return slots  # no handler has lanes yet: nothing to adopt them
        first = slots.handlers[0]
        moves: dict[int, list[Entry]] = defaultdict(list)
        for lane in due:
            for entry in lane.in_flight + lane.lost:
                lane_id = slots.first_lane(entry.handler)
                if entry.handler != first and lane_id is not None:
                    moves[lane_id + lane.number].append(entry)
        if moves:
            await collection.bulk_write([
                _driver.update_by_id(db, schema.lane_by_id(lane_id), schema.lane_losing(entries))
                for lane_id, entries in moves.items()
            ], ordered=False)  # fmt: skip
        # The next round reads what is left: none (recorded), held ones, or a lane whose
        # adoption an earlier version's write moved on (its rev) meanwhile.
        await collection.bulk_write([
            _driver.update_by_id(
                db, schema.lane_as_read(lane.id, lane.rev or 0),
                schema.lane_adopting(first, lane.number, [
                    e for e in lane.in_flight + lane.lost if e.handler == first
                ]),
            )
            for lane in due
        ], ordered=False)  # fmt: skip
    live = [lane.id for lane in shared if lane.owner is not None and lane.lease_until > now]
    if live:
        log.log(
            logging.DEBUG if quiet else logging.WARNING,
            "%d outbox lane(s) of an earlier version are held under a live lease: stop its "
            "dispatchers; the lanes are adopted once their leases expire", len(live),
            extra={"lanes": live[:16], "collection": getattr(collection, "name", None)},
        )  # fmt: skip
    return slots


async def read_lanes(
    collection: Any,
    ranges: Sequence[tuple[int, int]] | None = None,
    ids: Sequence[int] = (),
    *,
    shared: bool = True,
) -> tuple[list[Lane], Slots]:
    """The lanes of the ``_id`` `ranges` and `ids` (None: every lane), with those an earlier
    version shared if `shared`, and the slots; one round trip."""
    query = schema.lanes_all() if ranges is None else schema.lanes_read(ranges, ids, shared)
    # A batch larger than there are: a first batch the documents fill exactly leaves the
    # cursor open on a server, and draining it would be a getMore.
    docs = await _driver.find_list(collection, query, batch_size=READ_BATCH)
    slots = next((Slots.from_document(d) for d in docs if d["_id"] == schema.SLOTS), Slots())
    return [Lane.from_document(doc) for doc in docs if isinstance(doc["_id"], int)], slots


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
