"""The outbox's claim: which due deliveries an owner gets, and the lane writes that record it.

`Claimer` is the algorithm `AsyncOutbox.claim` runs, one object per `AsyncOutbox` instance,
built from the collections, the clock and the settings it needs. A claim is four steps:

1. **prepare** (`_prepare`): the lane view (`mongoq.outbox.lanes`, read again when it may be
   behind), lanes left with deliveries listed taken over and what ran there charged, parked
   keys that may be first moved back (`mongoq.outbox.parking`), and what runs in the owner's
   lanes reconciled with what this instance handed out;
2. **pick** (`_pick`): the due deliveries of its lanes and the free ones scanned in due order
   (``claim`` / ``ready`` index), a keyed one taken only when it is the head of its key
   (``ordering`` index);
3. **record** (`_record`): the picks' events read, the picks listed on their lanes (free ones
   taken, idle held ones handed back) in one bulk write; only what that write recorded is
   handed out;
4. **park**: the blocked backlogs the scan passed over moved out of the claim index.

It writes ``deliveries`` and, through `LaneStore`, ``lanes``, and reads ``events`` (layout and
every filter and update: `mongoq.outbox.schema`).

A claim that takes all it asked for costs, unkeyed, the scan, the events read and the lane
write; the lane view is read again when the owner's last claim came up short (a free lane
another instance handed back is then seen at once), after a lane write of this instance failed,
and at least every `VIEW_TTL` seconds; unparking runs on the claims that read it, on the first
claim of a handler set, and after a parking or a settle of a key with parked deliveries.

Per-key order: a keyed delivery is claimed only when it is the lowest pending sequence of its
handler and key and no delivery of them runs. All deliveries of a key share a lane and only the
lane's holder claims from it, so what runs is what the holder's lanes list.

What runs: an entry of a held lane whose delivery still has the listed generation and that this
instance handed out and has not seen settled. The owner's next claim frees any other such entry
(a claim whose reply was lost, a settle that failed) by moving its generation on, no attempt
charged, so nothing stays listed as running with nobody running it.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from logging import Logger
from typing import Any

import bson
from pymongo.errors import OperationFailure

from mongoq import _driver
from mongoq._validation import MAX_BATCH
from mongoq.clock import Clock, stored_instant
from mongoq.outbox import schema
from mongoq.outbox.faults import delivery_fault, event_fault, head_fault, kind, whole
from mongoq.outbox.lanes import Lane, LaneStore, LaneView
from mongoq.outbox.models import LANES, Delivery, Entry, parse_token
from mongoq.outbox.parking import PARK_THRESHOLD, Parking
from mongoq.outbox.quarantine import Quarantine, Unusable
from mongoq.runtime.report import error_text

__all__ = ["Claimer"]

#: A server merges at most 200 sorted index ranges (``internalQueryMaxScansToExplode``) and
#: beyond that sorts the whole due backlog: a claim's first page names at most this many lanes
#: (a range each), a later page, whose ``(due_at, _id)`` bound is two ranges a lane, half.
FIRST_PAGE_LANES = 200
LATER_PAGE_LANES = 100
#: Seconds (of the clock) a lane view serves claims that take all they ask for.
VIEW_TTL = 1.0
#: Lanes left with deliveries listed that one claim takes over (and charges) at most.
STALE_LANES_PER_CLAIM = 32


def _entry(pick: Mapping[str, Any]) -> Entry:
    """The lane entry of a picked delivery (the claim's projection of it)."""
    return Entry(pick["_id"], int(pick["claims"]), pick["handler"], pick.get("key"))


#: Sets aside the deliveries found unusable (`Quarantine.set_aside` for one claim).
Aside = Callable[[list[Unusable]], Awaitable[Any]]


class _Picking:
    """The picks of one claim, taken from the candidates of its scan in ``(due_at, _id)``
    order: an unkeyed delivery as it comes, a keyed one only when it is the head of its key
    (looked up in waves, one query each, no further than the picks still wanted can reach, so
    that a claim of one does not look up every key of a page) and its key neither runs nor was
    picked already. What it passes over, by key, are the candidates parking considers
    (`waiting`).

    A candidate it cannot use (`delivery_fault`: a hand-edited field) is set aside (`aside`)
    when it would be a key's first or a pick, before the heads are looked up: it holds
    nothing back, its key included."""

    def __init__(
        self,
        limit: int,
        running: list[Entry],
        heads_of: Callable[
            [Mapping[tuple[str, str], Mapping[str, Any]]],
            Awaitable[dict[tuple[str, str], dict[str, Any] | None]],
        ],
        aside: Aside,
    ) -> None:
        self.limit = limit
        self.heads_of = heads_of
        self.aside = aside
        # found unusable: to set aside (`found`), and passed over from then on (`skipped`)
        self.found: list[Unusable] = []
        self.skipped: set[Any] = set()
        self.running_keys = {(e.handler, e.key) for e in running if e.key is not None}
        self.excluded = {e.delivery for e in running}
        self.picks: list[dict[str, Any]] = []
        self.waiting: dict[tuple[str, str], list[Any]] = defaultdict(list)
        self.heads: dict[tuple[str, str], dict[str, Any] | None] = {}
        self.taken_keys: set[tuple[str, str]] = set()

    @property
    def done(self) -> bool:
        return len(self.picks) >= self.limit

    def _blocked(self, hk: tuple[str, str]) -> bool:
        return hk in self.running_keys or hk in self.taken_keys

    def _unknown(self, hk: tuple[str, str] | None) -> bool:
        return hk is not None and hk not in self.heads and not self._blocked(hk)

    @staticmethod
    def _key_of(candidate: Mapping[str, Any]) -> tuple[str, str] | None:
        key = candidate.get("key")
        return None if key is None else (candidate["handler"], key)

    def _unusable(self, candidate: dict[str, Any]) -> bool:
        """Whether `candidate` cannot be used (then noted, to be set aside)."""
        fault = delivery_fault(candidate)
        if fault is not None:
            self.found.append(Unusable.of(candidate, fault))
            self.skipped.add(candidate["_id"])
        return fault is not None

    async def set_aside(self) -> None:
        """Set aside what was found unusable so far."""
        if self.found:
            found, self.found = self.found, []
            await self.aside(found)

    async def _screened(self, candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`candidates` but those whose ``_id`` or ``key`` no claim can hold (an ``_id`` that is
        no ObjectId, a key that is no string, which may not even hash): set aside. Two type
        checks a candidate; the rest is checked on a key's first and on a pick."""
        kept: list[dict[str, Any]] = []
        for candidate in candidates:
            key = candidate.get("key")
            if type(candidate["_id"]) is bson.ObjectId and (key is None or type(key) is str):
                kept.append(candidate)
            else:
                fault = delivery_fault(candidate) or ("key", kind(key))
                self.found.append(Unusable.of(candidate, fault))
        await self.set_aside()
        return kept

    def _wave(self, candidates: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        """The first of `candidates` of each key whose head is not known yet, for as many keys
        as picks are still wanted (key -> that candidate). One that cannot be used is noted
        (`_unusable`): its key's next candidate is looked up instead."""
        wave: dict[tuple[str, str], dict[str, Any]] = {}
        for candidate in candidates:
            if candidate["_id"] in self.skipped:
                continue
            hk = self._key_of(candidate)
            if hk is not None and self._unknown(hk) and hk not in wave:
                if self._unusable(candidate):
                    continue
                wave[hk] = candidate
                if len(wave) == self.limit - len(self.picks):
                    break
        return wave

    async def take(self, candidates: list[dict[str, Any]]) -> None:
        """Pick from `candidates`."""
        candidates = await self._screened(candidates)
        position = 0
        while position < len(candidates) and not self.done:
            wave = self._wave(candidates[position:])
            await self.set_aside()  # before the look-up: what comes first is what remains
            if wave:
                self.heads.update(await self.heads_of(wave))
            for candidate in candidates[position:]:
                if candidate["_id"] in self.skipped:
                    position += 1
                    continue
                hk = self._key_of(candidate)
                if self._unknown(hk):
                    break  # beyond this wave
                position += 1
                if candidate["_id"] in self.excluded:
                    continue
                if hk is not None:
                    head = self.heads.get(hk)
                    if self._blocked(hk) or head is None or head["_id"] != candidate["_id"]:
                        self.waiting[hk].append(candidate["_id"])
                        continue
                if self._unusable(candidate):
                    continue
                if hk is not None:
                    self.taken_keys.add(hk)
                self.picks.append(candidate)
                if self.done:
                    break
        await self.set_aside()


@dataclass
class _Ground:
    """What a claim picks from, as its prepare step left it: the lanes of its handlers the
    owner holds (`held`) or may take (`free`), the owner's lanes of other handlers (`others`),
    what runs in them all (`running`), each handler's first lane ``_id`` (`firsts`), the
    handlers with a lane to pick from (`handlers`), and the lane numbers to scan (None: every
    lane of those handlers is held or free, one scan in due order of them all)."""

    held: dict[int, Lane]
    free: dict[int, Lane]
    others: dict[int, Lane]
    running: list[Entry]
    firsts: dict[str, int]
    handlers: list[str]
    numbers: list[int] | None

    @classmethod
    def of(
        cls, view: LaneView, handlers: list[str], held: dict[int, Lane], free: dict[int, Lane],
        others: dict[int, Lane], running: list[Entry],
    ) -> _Ground:  # fmt: skip
        """The ground of a claim of `handlers` (those with lanes). The lanes of each handler
        are its own: a delivery is the claim's to take when the lane of its handler and number
        (``_id`` its handler's first lane + the number) is held by this owner or free."""
        firsts = {h: view.slots.first_lane(h) or 0 for h in handlers}
        if len(handlers) > 1:
            ours = {i // LANES * LANES for i in (*held, *free)}
            handlers = [h for h in handlers if firsts[h] in ours]  # the others: nothing to take
        elif not (held or free):
            handlers = []
        every = len(held) + len(free) == LANES * len(handlers)
        numbers = None if every else sorted({i % LANES for i in (*held, *free)})
        return cls(held, free, others, running, firsts, handlers, numbers)

    def ours(self, candidate: Mapping[str, Any]) -> bool:
        """Whether `candidate`'s lane (its handler's lane of its number) is held or free: a
        delivery in a lane another owner holds is read when this owner holds or may take
        the same number of another handler, and never picked."""
        lane_id = self.firsts[candidate["handler"]] + candidate["lane_id"]
        return lane_id in self.held or lane_id in self.free


class Claimer:
    """The claim algorithm of one `AsyncOutbox` instance, and what it remembers between
    claims: which claims it handed out and has not seen settled (`issued`) and which it saw end
    (`ended`), one lock per owner (claims of one owner on one instance run one after the
    other), and the owners whose last claim took all it asked for (`filled`)."""

    def __init__(
        self, *, lanes: LaneStore, deliveries: Any, events: Any, clock: Clock, lease_ttl: float,
        log: Logger, quarantine: Quarantine,
    ) -> None:  # fmt: skip
        self.lanes = lanes
        self.quarantine = quarantine
        self.view: LaneView = lanes.view
        self.deliveries = deliveries
        self.events = events
        self.clock = clock
        self.lease_ttl = lease_ttl
        self.log = log
        self.parking = Parking(deliveries, self._heads, log, self._aside)
        self.locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # owner -> {delivery _id: generation} of the claims this instance handed out and has
        # not seen settled: what runs in the owner's lanes (see `_reconcile`).
        self.issued: dict[str, dict[Any, int]] = defaultdict(dict)
        # owner -> the claims (delivery _id, generation) this instance saw end (a settle with a
        # definite outcome): what its lanes still list of them needs no look-up.
        self.ended: dict[str, set[tuple[Any, int]]] = defaultdict(set)
        # owners with a completion in the caller's transaction since their last claim: what
        # they run is looked up (it may have committed)
        self.unsure: set[str] = set()
        # owners whose last claim took all it asked for: their next one trusts a recent view
        self.filled: set[str] = set()
        # owner -> picks its claim in progress dropped because their event could not be
        # handed out (per owner: claims of other owners on this instance run meanwhile)
        self.dropped: dict[str, int] = defaultdict(int)

    async def claim(self, owner: str, handlers: list[str] | None, limit: int) -> list[Delivery]:
        """Claim up to `limit` due deliveries for `owner` (checked already; see
        `AsyncOutbox.claim`), after the owner's claims in progress on this instance."""
        async with self.locks[owner]:
            self.dropped[owner] = 0
            claimed = await self._claim(owner, handlers, limit)
            if len(claimed) < limit and (self.view.failed or self.dropped.pop(owner)):
                # A lane write failed (another instance took a lane first, a requeue came
                # between), or a pick's event could not be handed out (buried or set aside,
                # so that a claim of one would come back empty although more is due): once
                # more, from the lanes as they are now.
                try:
                    claimed += await self._claim(owner, handlers, limit - len(claimed))
                except BaseException:
                    self.forget(claimed)  # never handed out: freed by the next claim
                    raise
            return claimed

    def forget(self, deliveries: Iterable[Delivery], *, ended: bool = False) -> None:
        """Settled, or its outcome unknown: no longer counted as running by this instance; the
        next claim frees it if it was not settled after all (see `_reconcile`). `ended`: the
        settle's outcome is known (it took effect, or the claim had ended already), so the
        claim is no longer pending at its generation and needs no freeing."""
        for delivery in deliveries:
            doc_id, _, _, claims = parse_token(delivery)
            issued = self.issued[delivery.worker_id]
            if issued.get(doc_id) == claims:  # a stale settle leaves a newer claim running
                del issued[doc_id]
            if ended:
                self.ended[delivery.worker_id].add((doc_id, claims))
            self.parking.settled(delivery.handler, delivery.event.key)

    async def relinquish(self, owner: str, now: datetime) -> int:
        """Hand back every lane `owner` holds on this instance (`AsyncOutbox.relinquish`),
        after its claims in progress."""
        async with self.locks[owner]:
            self.ended.pop(owner, None)  # what its lanes list is lost from here on
            return await self.lanes.hand_back_all(owner, now)

    async def _now(self) -> datetime:
        await self.clock.refresh()
        return self.clock.now()

    async def _aside(self, found: list[Unusable], worker: str | None = None) -> list[Any]:
        """Set aside deliveries found unusable (`Quarantine.set_aside`)."""
        return await self.quarantine.set_aside(found, self.clock.now(), worker)

    async def _claim(self, owner: str, handlers: list[str] | None, limit: int) -> list[Delivery]:
        now = await self._now()
        ground = await self._prepare(owner, handlers, now)
        picking = await self._pick(owner, ground, limit, now)
        deliveries = await self._record(owner, now, ground, picking.picks)
        issued = self.issued[owner]
        for delivery in deliveries:
            issued[bson.ObjectId(delivery.id)] = delivery.generation
        try:
            await self.parking.park(picking.waiting, picking.heads, now)
        except BaseException:
            self.forget(deliveries)  # never handed out (a cancellation): freed next
            raise
        if len(deliveries) == limit:
            self.filled.add(owner)
        else:
            self.filled.discard(owner)
        return deliveries

    # ---------------------------------------------------------------------------- prepare

    async def _prepare(self, owner: str, handlers: list[str] | None, now: datetime) -> _Ground:
        """The lanes this claim works from, with what runs in them."""
        view = self.view
        named = handlers if handlers is not None else view.slots.handlers
        read = view.failed or owner not in self.filled
        if read or view.read_due([None, *named], now, VIEW_TTL):
            read = True
            await self.lanes.refresh(owner, handlers, now, VIEW_TTL)
            named = handlers if handlers is not None else view.slots.handlers
        # The handlers with lanes (a name without is no handler's yet: nothing to claim).
        wanted = [h for h in dict.fromkeys(named) if view.slots.first_lane(h) is not None]
        # What this owner runs is decided over all its lanes (`others`: those of handlers this
        # claim does not serve): its records of what it handed out cover them all (see
        # `_reconcile`). Those of them that run nothing are handed back.
        held, free, stale, others = view.split(owner, self.lanes.instance, now, wanted)
        # A lane whose previous holder left deliveries listed (a crash, an expired lease, a
        # graceful stop) is taken over before anything is read from it, and what was running
        # there charged its lost attempt, so the scan sees current generations. Those beyond
        # this claim's share wait for a later claim.
        if stale:
            lease_until = now + timedelta(seconds=self.lease_ttl)
            taken = await self.lanes.take_over(owner, stale[:STALE_LANES_PER_CLAIM], lease_until)
            if taken:
                self.log.info("took over %d lane(s) left with deliveries listed", len(taken))
            held.update(taken)
        # A lost list on any lane this owner holds (also one a claim that failed between a
        # takeover and its charge left): charged now.
        mine = [*held.values(), *others.values()]
        for lane in await self._charge(owner, mine, now):
            (held if lane.id in held else others)[lane.id] = lane
        if read or self.parking.wanted(handlers):
            await self.parking.unpark(handlers)
        running = await self._reconcile(owner, [*held.values(), *others.values()], now, look=read)
        return _Ground.of(view, wanted, held, free, others, running)

    async def _charge(self, owner: str, lanes: list[Lane], now: datetime) -> list[Lane]:
        """`LaneStore.charge` of `lanes`. A lost delivery whose ``attempts`` holds no number (a
        hand edit) makes the server refuse the charge (code 14): those are set aside, and the
        others charged."""
        try:
            return await self.lanes.charge(self.deliveries, lanes, now)
        except OperationFailure as exc:
            if not _driver.type_mismatch(exc):
                raise
        lost = schema.delivery_claimed(e.claim for lane in lanes for e in lane.lost)
        await self.quarantine.set_aside_read(lost, now, owner)
        return await self.lanes.charge(self.deliveries, lanes, now)

    async def _reconcile(
        self, owner: str, held: Iterable[Lane], now: datetime, *, look: bool
    ) -> list[Entry]:
        """What runs in `held` lanes: entries whose delivery still exists at the listed
        generation and that this instance handed out and has not seen settled.

        Any other entry is a claim nobody will settle, unless this instance saw it end: its
        record reached the lane but the claim failed before handing it out (a lost reply), or
        its settle failed. Its generation moves on (`_free`), which frees it and its key at
        once, and any late settle of that claim is refused.

        And `running` is decided after the look-up (`_still_pending`), so a settle that failed
        while it ran is freed, not skipped."""
        issued = self.issued[owner]
        ended = self.ended.pop(owner, set())
        entries = [e for lane in held for e in lane.in_flight if e.claim not in ended]
        if not entries:
            issued.clear()
            return []
        mine = [e for e in entries if issued.get(e.delivery) == e.generation]
        orphaned = [e for e in entries if issued.get(e.delivery) != e.generation]
        current = await self._still_pending(owner, mine, look)
        listed = [e for e in mine if e.claim in current]
        running = [e for e in listed if issued.get(e.delivery) == e.generation]
        orphaned += [e for e in listed if issued.get(e.delivery) != e.generation]
        self.issued[owner] = {e.delivery: e.generation for e in running}
        if orphaned:
            freed = await self._free(orphaned, now)
            if freed:
                self.log.info("freed %d claim(s) that were never handed out or settled", freed)
        return running

    async def _still_pending(
        self, owner: str, mine: list[Entry], look: bool
    ) -> set[tuple[Any, int]]:
        """The claims of `mine` still pending at their generation. Looked up when the claim
        read the lanes (`look`) or a completion in the caller's transaction may have committed
        since: one whose settle went through another `AsyncOutbox` object, or committed in the
        caller's transaction, is gone from the collection, not from this instance's records.
        Between two look-ups such an entry counts as running a little longer, which delays its
        key and never runs anything twice."""
        if not mine or not (look or owner in self.unsure):
            return {e.claim for e in mine}
        self.unsure.discard(owner)
        try:
            docs = await _driver.find_list(
                self.deliveries,
                schema.delivery_pending_by_ids([e.delivery for e in mine]),
                projection={"claims": 1},
            )
        except BaseException:
            self.unsure.add(owner)
            raise
        # (a generation that is no number: not running; the scan sets it aside)
        return {(doc["_id"], int(doc["claims"])) for doc in docs if whole(doc.get("claims"))}

    async def _free(self, entries: list[Entry], now: datetime) -> int:
        """End the claims `entries` list without an attempt: their generation moves on (each
        only if still at the listed one), so they are claimable again and any late settle of
        those claims is refused. Returns how many were still at it."""
        result = await self.deliveries.update_many(
            schema.delivery_claimed(e.claim for e in entries), schema.delivery_freeing(now)
        )
        return int(result.modified_count)

    # ------------------------------------------------------------------------------- pick

    async def _pick(self, owner: str, ground: _Ground, limit: int, now: datetime) -> _Picking:
        """Scan the due deliveries of the claim's lanes, page by page, until `limit` are
        picked or none is left. Every lane of its handlers held or free: one scan in due order
        of them all (``ready``); else a merge of the lanes' ranges (``claim``) of the numbers
        any of them has held or free."""
        picking = _Picking(limit, ground.running, self._heads, partial(self._aside, worker=owner))
        page = min(limit * 2 + PARK_THRESHOLD, MAX_BATCH)
        after: tuple[datetime, Any] | None = None
        while not picking.done and ground.handlers and ground.numbers != []:
            candidates = await self._scan(ground.numbers, ground.handlers, now, after, page)
            await picking.take(
                candidates if ground.numbers is None else list(filter(ground.ours, candidates))
            )
            if len(candidates) < page:
                break
            last = candidates[-1]  # the next page after what was read, kept or not
            after = (last["due_at"], last["_id"])
            page = min(page * 2, MAX_BATCH)  # a long blocked stretch: read further per query
        return picking

    async def _scan(
        self,
        lane_ids: Sequence[int] | None,
        handlers: list[str] | None,
        now: datetime,
        after: tuple[datetime, Any] | None,
        page: int,
    ) -> list[dict[str, Any]]:
        """The next `page` due, ready deliveries of `lane_ids` (None: of every lane) in
        ``(due_at, _id)`` order: one query, or, for more lanes than one query may merge, one
        per `FIRST_PAGE_LANES` (a first page) or `LATER_PAGE_LANES` (merged here)."""
        size = FIRST_PAGE_LANES if after is None else LATER_PAGE_LANES
        chunks: list[Sequence[int] | None] = (
            [None]
            if lane_ids is None
            else [lane_ids[start : start + size] for start in range(0, len(lane_ids), size)]
        )
        reads = [
            _driver.find_list(
                self.deliveries,
                schema.delivery_due(chunk, now, handlers, after),
                sort=schema.DUE_ORDER,
                limit=page,
                projection=schema.CLAIM_PROJECTION,
                hint=schema.READY_INDEX if chunk is None else schema.CLAIM_INDEX,
            )
            for chunk in chunks
        ]
        if len(reads) == 1:
            return await reads[0]
        results = await asyncio.gather(*reads)
        merged = sorted(
            (doc for docs in results for doc in docs),
            key=lambda doc: (stored_instant(doc["due_at"]), doc["_id"]),
        )
        return merged[:page]

    async def _heads(
        self, firsts: Mapping[tuple[str, str], Mapping[str, Any]]
    ) -> dict[tuple[str, str], dict[str, Any] | None]:
        """The lowest pending delivery of each handler and key, given a pending one of each
        (`firsts`: ``{_id, sequence, due_at}``, ``lane`` if not ready): that one, unless
        deliveries of its key with lower sequences are pending (one query for all keys, which
        reads what comes before each: the running head, a retry not due yet), then the lowest
        of those. ``{_id, due_at, lane}`` each.

        A delivery before a candidate that nothing will ever claim or unpark (`head_fault`: a
        due time that is no date, a claim lane of neither kind; a hand edit) would hold its key
        back for good: it is set aside, and the lowest of the others is the head."""
        if not firsts:
            return {}
        heads: dict[tuple[str, str], dict[str, Any] | None] = {
            hk: {"_id": doc["_id"], "due_at": doc.get("due_at"),
                 "lane": doc.get("lane", schema.READY), "sequence": doc.get("sequence")}
            for hk, doc in firsts.items()
        }  # fmt: skip
        ahead = await _driver.find_list(
            self.deliveries,
            schema.deliveries_ahead((h, k, int(doc["sequence"])) for (h, k), doc in firsts.items()),
            projection=schema.HEAD_PROJECTION,
            hint=schema.ORDERING_INDEX,
        )
        stuck: list[Unusable] = []
        for doc in ahead:
            fault = head_fault(doc)
            if fault is not None:
                stuck.append(Unusable.of(doc, fault))
                continue
            hk = (doc["handler"], doc["key"])
            head = heads.get(hk)
            if head is not None and doc["sequence"] < head["sequence"]:
                heads[hk] = doc
        if stuck:
            await self._aside(stuck)
        return heads

    # ----------------------------------------------------------------------------- record

    async def _record(
        self, owner: str, now: datetime, ground: _Ground, picks: list[dict[str, Any]]
    ) -> list[Delivery]:
        """Read the picks' events, then record the picks on their lanes (taking the free ones)
        and hand back held lanes that yield nothing and run nothing, in one bulk write.
        Returns the deliveries whose lane write took effect."""
        events = await self._events_of(picks, now, owner)
        picks = [p for p in picks if p["event_id"] in events]
        lane_of_pick = {p["_id"]: ground.firsts[p["handler"]] + p["lane_id"] for p in picks}
        picked: dict[int, list[Entry]] = defaultdict(list)
        for pick in picks:
            picked[lane_of_pick[pick["_id"]]].append(_entry(pick))
        held = {**ground.held, **ground.others}
        running_ids = {e.delivery for e in ground.running}
        running = {
            lane.id: [e for e in lane.in_flight if e.delivery in running_ids]
            for lane in held.values()
        }
        lease_until = now + timedelta(seconds=self.lease_ttl)
        epochs = await self.lanes.record(
            owner, now, lease_until, held, ground.free, running, picked
        )
        return [
            Delivery.from_documents(
                pick, events[pick["event_id"]], owner, epochs[lane_of_pick[pick["_id"]]]
            )
            for pick in picks
            if lane_of_pick[pick["_id"]] in epochs
        ]

    async def _events_of(
        self, picks: list[dict[str, Any]], now: datetime, owner: str
    ) -> dict[str, Mapping[str, Any]]:
        """The events of `picks` that can be handed out. A delivery whose event is gone (only
        possible when a purge without transactions raced a replayed publish) can never run:
        it is buried; one whose event cannot be handed out (`event_fault`: a hand edit) is set
        aside, the event left as it is."""
        if not picks:
            return {}
        ids = list({p["event_id"] for p in picks})
        docs = await _driver.find_list(self.events, schema.events_by_ids(ids))
        events: dict[str, Mapping[str, Any]] = {doc["_id"]: doc for doc in docs}
        orphans = [p for p in picks if p["event_id"] not in events]
        self.dropped[owner] += len(orphans)
        if orphans:
            self.log.error("%d delivery(ies) without their event; burying them", len(orphans))
            await self.deliveries.update_many(
                schema.delivery_at_generation(_entry(p).claim for p in orphans),
                schema.delivery_burying(error_text("its event is missing"), now, charge=False),
            )
        faults = {i: fault for i, doc in events.items() if (fault := event_fault(doc))}
        if faults:
            self.dropped[owner] += sum(p["event_id"] in faults for p in picks)
            await self._aside([
                Unusable(p, *faults[p["event_id"]], schema.EVENTS)
                for p in picks if p["event_id"] in faults
            ], owner)  # fmt: skip
            events = {i: doc for i, doc in events.items() if i not in faults}
        return events
