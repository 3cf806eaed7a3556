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
and moves the previous owner's ``in_flight`` to ``lost``; `LaneStore.charge` then charges each lost
delivery one attempt, fenced on the generation it was listed with, so charging twice charges
once. ``rev`` moves on with every write to the lane: a takeover pins the ``rev`` it read, so it
applies only to the state it judged free. ``requeued`` counts the `AsyncOutbox.requeue` calls
of deliveries in the lane: a holder's write listing new picks is fenced on the
count it knew before it read their keys' heads, so a requeue in between (a dead delivery that
may now come first) makes it fail and nothing it picked is handed out. ``write`` is the id of
the claim that last listed or took the lane: a claim whose bulk write matched fewer lanes than
it wrote reads them back and counts as its own only those carrying its id.

One more document, ``{_id: "slots", handlers: [slot 0's handler, slot 1's, ...]}``, numbers
the handlers: a handler takes the next slot the first time lanes are seeded for it
(`seed_lanes`), and its slot never changes.

An `AsyncOutbox` instance does not read the lanes on every claim: its `LaneView` reads the
lanes of a claim's handlers now and then (an ``_id`` range a handler) and is kept current by
its own writes. What it holds it knows exactly, since every write to a held lane is its own or
moves the epoch its writes are fenced on; what another instance did since the last read it
learns from a write that fails, or from the next read.

Every write to the lanes goes through `LaneStore` and names its lane's ``_id`` (no secondary
index); the filters and updates are in `mongoq.outbox.schema`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pymongo import UpdateMany, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from mongoq import _driver
from mongoq.clock import stored_instant
from mongoq.outbox import schema
from mongoq.outbox.faults import lane_faults, slots_fault
from mongoq.outbox.models import LANES, Entry
from mongoq.outbox.quarantine import Quarantine

__all__ = ["Lane", "LaneStore", "LaneView", "Slots", "read_lanes", "read_slots", "seed_lanes"]

#: Lane documents one read returns in its first batch (256 a handler).
READ_BATCH = 100_000

#: A lane nobody ever held: its lease expired long ago.
NEVER = datetime(1970, 1, 1, tzinfo=UTC)


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
    #: the handler whose deliveries of lane `number` this lane holds
    handler: str = ""
    number: int = 0
    in_flight: list[Entry] = field(default_factory=list)
    lost: list[Entry] = field(default_factory=list)
    requeued: int = 0
    #: the id of the claim that last listed or took the lane (what a read-back proves)
    write: str | None = None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Lane:
        """The lane `doc` stores; ValueError for one that cannot be read (`lane_faults` says
        why). Strict: a field of another type (a hand edit) would fail every write fenced on
        it, for good, so it is repaired instead (`Quarantine.repair_lanes`)."""
        get = doc.get
        epoch, rev, requeued, number = get("epoch"), get("rev"), get("requeued"), get("n")
        owner, instance, write = get("owner"), get("instance"), get("write")
        lease, handler = get("lease_until"), get("handler")
        # What mongoq writes passes these type checks (one read holds 256 lanes a handler:
        # kept to plain comparisons); anything else is judged field by field.
        if not (
            type(epoch) is int and type(rev) is int and type(requeued) is int
            and epoch >= 0 and rev >= 0 and requeued >= 0 and number == doc["_id"] % LANES
            and (owner is None or type(owner) is str)
            and (instance is None or type(instance) is str)
            and (write is None or type(write) is str) and type(handler) is str and handler
            and (lease is None or isinstance(lease, datetime))
            and type(get("in_flight")) is list and type(get("lost")) is list
        ) and lane_faults(doc):  # fmt: skip
            raise ValueError("a lane document that cannot be read")
        return cls(
            id=int(doc["_id"]),
            owner=owner,
            instance=instance,
            lease_until=stored_instant(lease) or NEVER,
            epoch=int(doc["epoch"]),
            rev=int(doc["rev"]),
            in_flight=[Entry.from_document(e) for e in doc["in_flight"]],
            lost=[Entry.from_document(e) for e in doc["lost"]],
            requeued=int(doc["requeued"]),
            write=write,
            handler=doc["handler"],
            number=int(doc["n"]),
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
        return Lane(self.id, self.owner, self.instance, lease_until, self.epoch, None,
                    self.handler, self.number, in_flight, self.lost, self.requeued,
                    write)  # fmt: skip

    def taken(
        self, owner: str, instance: str, lease_until: datetime, in_flight: list[Entry],
        lost: list[Entry], write: str,
    ) -> Lane:  # fmt: skip
        """This lane once a `schema.lane_takeover` by `owner` took effect (its ``rev`` is not
        known: the holder's renewals move it on)."""
        return Lane(self.id, owner, instance, lease_until, self.epoch + 1, None, self.handler,
                    self.number, in_flight, lost, self.requeued, write)  # fmt: skip

    def handed_back(self, now: datetime) -> Lane:
        """This lane once its holder's `schema.lane_handing_back` (nothing lost) took effect."""
        return Lane(self.id, None, None, now, self.epoch, None, self.handler, self.number, [],
                    [], self.requeued, self.write)  # fmt: skip


@dataclass(frozen=True)
class Slots:
    """The handlers with lanes, in slot order (handler ``handlers[s]``'s lanes are ``s * 256``
    to ``s * 256 + 255``)."""

    handlers: tuple[str, ...] = ()

    @classmethod
    def from_document(cls, doc: Mapping[str, Any] | None) -> Slots:
        """The slots `doc` stores (none: no handler has lanes yet); `UnreadableSlots` for a
        document that cannot be read (`slots_fault`)."""
        if doc is None:
            return cls()
        if slots_fault(doc):
            raise UnreadableSlots(doc)
        return cls(tuple(doc["handlers"]))

    def first_lane(self, handler: str) -> int | None:
        """The ``_id`` of `handler`'s lane 0 (None: it has no lanes)."""
        try:
            return self.handlers.index(handler) * LANES
        except ValueError:
            return None

    def ranges(self, handlers: Iterable[str]) -> list[tuple[int, int]]:
        """The ``_id`` ranges of the lanes of those of `handlers` that have lanes."""
        firsts = (self.first_lane(h) for h in dict.fromkeys(handlers))
        return [(first, first + LANES) for first in firsts if first is not None]


class UnreadableSlots(ValueError):
    """The slots document cannot be read (see `Quarantine.rebuild_slots`)."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        super().__init__("the slots document of the lanes cannot be read")
        self.doc = doc


def _within(lane_id: int, ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether `lane_id` is in one of the ``[first, end)`` `ranges`."""
    return any(lo <= lane_id < hi for lo, hi in ranges)


#: Later than any lease.
FOREVER = datetime.max.replace(tzinfo=UTC)


@dataclass(eq=False)
class _Split:
    """`LaneView.split` for one owner, instance and handler set, as of `since`: valid until
    the first lease of another holder among those lanes expires (`until`), and placed again
    lane by lane as the view changes."""

    owner: str
    instance: str
    handlers: frozenset[str]
    since: datetime
    until: datetime = FOREVER
    held: dict[int, Lane] = field(default_factory=dict)
    free: dict[int, Lane] = field(default_factory=dict)
    stale: dict[int, Lane] = field(default_factory=dict)
    others: dict[int, Lane] = field(default_factory=dict)

    def serves(self, owner: str, instance: str, handlers: frozenset[str], now: datetime) -> bool:
        return (
            self.owner == owner and self.instance == instance and self.handlers == handlers
            and self.since <= now < self.until
        )  # fmt: skip

    def place(self, lane: Lane) -> None:
        """Put `lane` (new, or as it is now) where it belongs. A lane held by another holder
        belongs nowhere until its lease expires, which ends this split's validity."""
        lane_id = lane.id
        for group in (self.held, self.free, self.stale, self.others):
            group.pop(lane_id, None)
        holder = lane.owner
        if holder == self.owner and lane.instance == self.instance:  # `Lane.held_by`
            (self.held if lane.handler in self.handlers else self.others)[lane_id] = lane
        elif lane.handler not in self.handlers:
            return
        elif holder is None or lane.lease_until <= self.since:  # free
            (self.stale if lane.in_flight or lane.lost else self.free)[lane_id] = lane
        elif lane.lease_until < self.until:
            self.until = lane.lease_until


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
    _split: _Split | None = None

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

    def split(
        self, owner: str, instance: str, now: datetime, handlers: Iterable[str]
    ) -> tuple[dict[int, Lane], dict[int, Lane], list[Lane], dict[int, Lane]]:
        """The lanes of `handlers` `owner` holds on `instance`, the free ones with nothing
        listed, and the free ones left with deliveries listed (to take over first), as this
        view has them; and the lanes of other handlers `owner` holds on `instance`.

        Every claim asks, so the last answer is kept (`_Split`) and kept current by `update`:
        held and free stay so as time passes, until the first lease of another holder
        expires."""
        split = self._split
        wanted = frozenset(handlers)
        if split is None or not split.serves(owner, instance, wanted, now):
            split = self._split = _Split(owner, instance, wanted, now)
            for lane in self.lanes.values():  # one pass over the view
                split.place(lane)
        return dict(split.held), dict(split.free), list(split.stale.values()), dict(split.others)

    async def refresh(
        self, collection: Any, owner: str, instance: str, handlers: Sequence[str] | None,
        now: datetime, ttl: float,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Read the lanes a claim of `owner` (on `instance`) and `handlers` works from: those
        handlers' lanes (every lane for None) and the slots; beside them, by ``_id``, the lanes
        the owner holds of other handlers and those a failed write left the view `unsure` of
        (what its reconcile and hand-backs work from must not stay as it last wrote or read
        them). A handler whose slot the view does
        not know has the slots read first (at most once `ttl` seconds). Returns the documents
        read that cannot be read (left out of the view; see `Quarantine`)."""
        named = handlers if handlers is not None else self.slots.handlers
        self.failed = False
        since = self.mark()
        try:
            unknown = handlers is not None and any(
                self.slots.first_lane(h) is None for h in handlers
            )
            if unknown and self.read_due([None], now, ttl):
                # (unreadable: read below with the lanes, and reported from there)
                with contextlib.suppress(UnreadableSlots):
                    self.slots = await read_slots(collection)
                self.read_at[None] = now
            ranges = None if handlers is None else self.slots.ranges(handlers)
            # the handlers whose lanes this read covers (a name without a slot: it has none)
            sent = [h for h in named if self.slots.first_lane(h) is not None]
            pending = set(self.unsure)
            extra = [] if ranges is None else self.outside(ranges, owner, instance)
            lanes, slots, unreadable = await read_lanes(collection, ranges, extra)
        except BaseException:
            self.failed = True
            raise
        # Read now: the slots, and the lanes of the handlers whose slots were known (a handler
        # given one since is read by the next claim).
        known = slots.handlers if handlers is None else [
            *sent, *(h for h in named if slots.first_lane(h) is None)
        ]  # fmt: skip
        self.update(lanes, read_since=since)
        self.unsure -= pending if ranges is None else {
            i for i in pending if i in extra or _within(i, ranges)
        }  # fmt: skip
        if len(slots.handlers) >= len(self.slots.handlers):  # a late reply of an older read
            self.slots = slots  # never takes a handler back: handlers are only ever added
        self.read_at.update(dict.fromkeys([None, *known], now))
        return unreadable

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
            if self._split is not None:
                self._split.place(lane)


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
    """Which handler has which lanes (one read); `UnreadableSlots` if that cannot be read."""
    return Slots.from_document(await collection.find_one(schema.slots_document()))


async def seed_lanes(collection: Any, handlers: Iterable[str], *, every: bool = False) -> Slots:
    """Give each of `handlers` a slot and its 256 lanes, where it has none yet, and create any
    lane missing from a slot it has (with `every`: from every handler's slot); idempotent,
    safe to race. Returns the slots."""
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
    # Only what is missing: a seeding that failed half-way is finished by the next one. A lane
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


async def read_lanes(
    collection: Any, ranges: Sequence[tuple[int, int]] | None = None, ids: Sequence[int] = ()
) -> tuple[list[Lane], Slots, list[dict[str, Any]]]:
    """The lanes of the ``_id`` `ranges` and `ids` (None: every lane), the slots, and the
    documents among them that cannot be read (lanes, the slots: left out of the others; see
    `Quarantine`); one round trip."""
    query = schema.lanes_all() if ranges is None else schema.lanes_read(ranges, ids)
    # A batch larger than there are: a first batch the documents fill exactly leaves the
    # cursor open on a server, and draining it would be a getMore.
    docs = await _driver.find_list(collection, query, batch_size=READ_BATCH)
    lanes: list[Lane] = []
    unreadable: list[dict[str, Any]] = []
    slots = Slots()
    for doc in docs:
        try:
            if isinstance(doc["_id"], int):
                lanes.append(Lane.from_document(doc))
            elif doc["_id"] == schema.SLOTS:
                slots = Slots.from_document(doc)
        except ValueError:
            unreadable.append(doc)
    return lanes, slots, unreadable


@dataclass
class _Plan:
    """The lane writes of one claim: one op a lane, the epoch each lane has once written (the
    lanes whose deliveries the claim hands out) and the lanes as the writes leave them."""

    write: str
    ops: list[UpdateOne | UpdateMany] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    expected: dict[int, int] = field(default_factory=dict)
    after: list[Lane] = field(default_factory=list)

    def add(self, op: UpdateOne | UpdateMany, lane: Lane, epoch: int | None) -> None:
        self.ops.append(op)
        self.targets.append(lane.id)
        self.after.append(lane)
        if epoch is not None:
            self.expected[lane.id] = epoch


class LaneStore:
    """Every write to the lanes collection of one `AsyncOutbox` instance, and its `LaneView`
    (kept current by those writes). A write that fails or matches fewer than it names leaves
    the view wrong about its lanes: they are read again before the next claim."""

    def __init__(
        self, db: Any, collection: Any, instance: str, quarantine: Quarantine | None = None
    ) -> None:
        self.db = db
        self.collection = collection
        self.instance = instance
        self.view = LaneView()
        self._writes = itertools.count()
        #: repairs what cannot be read (None: left out, never repaired)
        self.quarantine = quarantine

    def _plan(self) -> _Plan:
        """A new claim's plan, with an id no other claim of this instance has."""
        return _Plan(f"{self.instance}.{next(self._writes)}")

    def invalidate(self) -> None:
        """Read the lanes again before the next claim."""
        self.view.failed = True

    def seen(self, lanes: Iterable[Lane], read_since: int | None = None) -> None:
        """Lanes as a write of this instance left them (or as read back), into the view."""
        self.view.update(list(lanes), read_since)

    async def seed(self, handlers: Iterable[str], *, every: bool = False) -> Slots:
        """`seed_lanes` on this outbox's lanes (slots that cannot be read rebuilt first)."""
        try:
            return await seed_lanes(self.collection, handlers, every=every)
        except UnreadableSlots as exc:
            await self._rebuild_slots(exc)
        return await seed_lanes(self.collection, handlers, every=every)

    async def _rebuild_slots(self, exc: UnreadableSlots) -> None:
        """Rebuild the slots `exc` could not read, or raise it (reported: they cannot be)."""
        if self.quarantine is None or await self.quarantine.rebuild_slots(exc.doc) is None:
            raise exc

    async def refresh(
        self, owner: str, handlers: Sequence[str] | None, now: datetime, ttl: float
    ) -> None:
        """`LaneView.refresh` for a claim of `owner` on this instance; what it could not read
        is repaired (`Quarantine`) and read again by the next claim."""
        for _ in range(2):  # again once the slots were rebuilt: the lanes they name
            unreadable = await self.view.refresh(
                self.collection, owner, self.instance, handlers, now, ttl
            )
            if not unreadable or not await self.repair(unreadable, now):
                return

    async def repair(self, docs: Sequence[Mapping[str, Any]], now: datetime) -> bool:
        """Repair lane documents (and the slots) that could not be read, and take each lane as
        repaired into the view (a repair keeps what could be read, a holder included); one a
        write changed meanwhile is read again before the next claim. Returns whether the
        slots were rebuilt."""
        if self.quarantine is None:
            self.invalidate()
            return False
        lanes = [doc for doc in docs if doc["_id"] != schema.SLOTS]
        rebuilt = None
        for doc in docs:
            if doc["_id"] == schema.SLOTS:
                rebuilt = await self.quarantine.rebuild_slots(doc)
                if rebuilt is not None and len(rebuilt) >= len(self.view.slots.handlers):
                    self.view.slots = Slots(tuple(rebuilt))
        repaired, changed = await self.quarantine.repair_lanes(lanes, now, self.view.slots.handlers)
        self.seen(Lane.from_document(doc) for doc in repaired if not lane_faults(doc))
        if changed:
            self.invalidate()
            self.view.unsure.update(map(int, changed))
        return rebuilt is not None

    async def _repair_refused(self, query: Mapping[str, Any], now: datetime) -> None:
        """A write to the lanes `query` matches was refused for a field of the wrong type (code
        14): read them, repair what cannot be read."""
        docs = await _driver.find_list(self.collection, query)
        await self.repair([doc for doc in docs if lane_faults(doc)], now)

    async def take_over(
        self, owner: str, stale: list[Lane], lease_until: datetime
    ) -> dict[int, Lane]:
        """Take `stale` lanes over for `owner`, what their previous holders left listed moved
        to ``lost``; returns the lanes now held (a lane another claimer took first is left
        out). Their ``lost`` is charged next (`charge`)."""
        plan = self._plan()
        for lane in stale:
            lost = lane.lost + lane.in_flight
            plan.add(self._take(lane, owner, lease_until, [], lost, plan.write),
                     lane.taken(owner, self.instance, lease_until, [], lost, plan.write),
                     lane.epoch + 1)  # fmt: skip
        taken = await self._apply(owner, plan)
        return {lane.id: lane for lane in plan.after if lane.id in taken}

    async def charge(self, deliveries: Any, taken: Sequence[Lane], now: datetime) -> list[Lane]:
        """Charge one attempt to every delivery the previous holders of `taken` lanes (held by
        this instance) still had running, then clear the lanes' ``lost`` lists; returns the
        lanes as cleared.

        The charge is fenced on the generation each delivery was listed with and moves it on,
        so a charge repeated after a failure between the two writes, or a delayed one, charges
        nothing twice; a delivery that finished or was retried meanwhile is not charged at
        all."""
        unpaid = [lane for lane in taken if lane.lost]
        if not unpaid:
            return []
        await deliveries.update_many(
            schema.delivery_claimed(e.claim for lane in unpaid for e in lane.lost),
            schema.delivery_charging(now),
        )
        try:
            await self.collection.bulk_write([
                _driver.update_by_id(
                    self.db, schema.lane_at_epoch(lane.id, lane.epoch),
                    schema.lane_clearing_lost(),
                )
                for lane in unpaid
            ], ordered=False)  # fmt: skip
        except BaseException:
            self.invalidate()  # (a lane edited meanwhile: read, and repaired, again)
            self.view.unsure.update(lane.id for lane in unpaid)
            raise
        paid = [replace(lane, lost=[], rev=None) for lane in unpaid]
        self.seen(paid)
        return paid

    async def record(
        self,
        owner: str,
        now: datetime,
        lease_until: datetime,
        held: Mapping[int, Lane],
        free: Mapping[int, Lane],
        running: Mapping[int, list[Entry]],
        picked: Mapping[int, list[Entry]],
    ) -> dict[int, int]:
        """Record a claim of `owner`: each held lane lists what still runs there (`running`)
        and its new picks (`picked`), and is handed back if that is nothing; a free lane with
        picks is taken. Returns, for each lane whose write took effect, its epoch once
        written."""
        plan = self._plan()
        for lane in held.values():
            still, new = running.get(lane.id, []), picked.get(lane.id, [])
            self._plan_held(plan, lane, owner, now, lease_until, still, new)
        for lane_id, entries in picked.items():
            if lane_id not in held and entries:
                lane = free[lane_id]  # a free lane with nothing listed (stale ones: taken over)
                plan.add(self._take(lane, owner, lease_until, entries, [], plan.write),
                         lane.taken(owner, self.instance, lease_until, entries, [], plan.write),
                         lane.epoch + 1)  # fmt: skip
        written = await self._apply(owner, plan)
        return {lane_id: plan.expected[lane_id] for lane_id in written}

    def _plan_held(
        self, plan: _Plan, lane: Lane, owner: str, now: datetime, lease_until: datetime,
        running: list[Entry], picked: list[Entry],
    ) -> None:  # fmt: skip
        """The write of a held lane: hand it back (nothing runs or was picked), or list what
        runs there now if that changed (new picks only if no requeue in the lane came
        between)."""
        entries = running + picked
        if not entries:
            fence = lane.fence(owner, self.instance)
            update = schema.lane_handing_back(now, [])
            plan.add(_driver.update_by_id(self.db, fence, update), lane.handed_back(now), None)
        elif picked or len(entries) != len(lane.in_flight):
            fence = (lane.listing_fence if picked else lane.fence)(owner, self.instance)
            update = schema.lane_listing(entries, lease_until, plan.write)
            plan.add(_driver.update_by_id(self.db, fence, update),
                     lane.listing(entries, lease_until, plan.write), lane.epoch)  # fmt: skip

    def _take(
        self, lane: Lane, owner: str, lease_until: datetime, in_flight: list[Entry],
        lost: list[Entry], write: str,
    ) -> UpdateOne | UpdateMany:  # fmt: skip
        """The write that takes `lane` over for `owner`, as read (see `Lane.take_filter`)."""
        return _driver.update_by_id(
            self.db,
            lane.take_filter(),
            schema.lane_takeover(owner, self.instance, lease_until, in_flight, lost, write),
        )

    async def _apply(self, owner: str, plan: _Plan) -> set[int]:
        """Send `plan` (one unordered bulk write); returns the lanes of ``plan.expected``
        whose write took effect."""
        if not plan.ops:
            return set()
        try:
            result = await self.collection.bulk_write(plan.ops, ordered=False)
        except BaseException:
            self.invalidate()
            self.view.unsure.update(plan.targets)  # a failed write may have been applied
            raise
        if result.matched_count != len(plan.ops):
            self.view.unsure.update(plan.targets)
            return await self._confirm(owner, plan.expected, plan.write)
        self.seen(plan.after)
        return set(plan.expected)

    async def _confirm(self, owner: str, expected: dict[int, int], write: str) -> set[int]:
        """Which of the lane writes of claim `write` took effect, read back after its bulk
        write matched fewer (lane -> its epoch once written): those the owner holds at that
        epoch carrying the claim's id, which only the claim's own write sets. The view takes
        them as own writes, the others as read (and is read whole before the next claim:
        another instance wrote somewhere)."""
        self.invalidate()
        if not expected:  # only hand-backs failed: nothing of this claim to prove
            return set()
        since = self.view.mark()
        docs = await _driver.find_list(self.collection, schema.lanes_by_ids(expected))
        read = [Lane.from_document(doc) for doc in docs if not lane_faults(doc)]
        mine = [
            lane for lane in read
            if lane.held_by(owner, self.instance) and lane.epoch == expected[lane.id]
            and lane.write == write
        ]  # fmt: skip
        self.seen(mine)
        self.seen([lane for lane in read if lane not in mine], read_since=since)
        self.view.unsure.difference_update(expected)
        return {lane.id for lane in mine}

    async def renew(self, owner: str, lease_until: datetime, now: datetime) -> int:
        """Renew every lane `owner` holds on this instance until `lease_until` (never
        shortening one); returns how many. An expired lease nobody took over is renewed too;
        a lane taken over is not. One whose counter was edited to hold no number (the
        renewal refused: code 14) is repaired, and the renewal sent again."""
        query, update = schema.lanes_held(owner, self.instance), schema.lane_renewing(lease_until)
        try:
            result = await self.collection.update_many(query, update)
        except OperationFailure as exc:
            if not _driver.type_mismatch(exc):
                raise
            await self._repair_refused(query, now)
            result = await self.collection.update_many(query, update)
        return int(result.matched_count)

    async def hand_back_all(self, owner: str, now: datetime) -> int:
        """Hand back every lane `owner` holds on this instance, what each still lists as
        running moved to ``lost`` (charged by the next holder); returns how many."""
        self.invalidate()
        docs = await _driver.find_list(self.collection, schema.lanes_held(owner, self.instance))
        ops = [
            _driver.update_by_id(
                self.db, lane.fence(owner, self.instance),
                schema.lane_handing_back(now, lane.lost + lane.in_flight),
            )
            # (one that cannot be read is left to expire: the next claim repairs it)
            for lane in map(Lane.from_document, (d for d in docs if not lane_faults(d)))
        ]  # fmt: skip
        if not ops:
            return 0
        result = await self.collection.bulk_write(ops, ordered=False)
        return int(result.matched_count)

    async def count_requeue(self, handler: str, number: int, now: datetime) -> None:
        """Count a requeue in `handler`'s lane `number`: a holder's listing write fenced on the
        count before fails (`Lane.listing_fence`), and so does a take (``rev``). A lane whose
        counters were edited to hold no number (the count refused: code 14) is repaired, and
        counted then."""
        self.invalidate()  # this instance's claims know it at once
        slots = self.view.slots  # a handler's slot never changes
        if slots.first_lane(handler) is None:
            try:
                slots = await read_slots(self.collection)
            except UnreadableSlots as exc:
                await self._rebuild_slots(exc)
                slots = await read_slots(self.collection)
        first = slots.first_lane(handler)
        if first is None:  # a handler without lanes has no claim to fence
            return
        query = schema.lane_by_id(first + number)
        try:
            await self.collection.update_one(query, schema.lane_requeue_counting())
        except OperationFailure as exc:
            if not _driver.type_mismatch(exc):
                raise
            await self._repair_refused(query, now)
            await self.collection.update_one(query, schema.lane_requeue_counting())
