"""The outbox's claim: which due deliveries an owner gets, and the lane writes that record it.

`Claimer` is the algorithm `AsyncOutbox.claim` runs, one object per `AsyncOutbox`: from its
view of the lanes (`LaneView`, read again when it may be behind) it takes over lanes left with
deliveries listed (charging what ran there), moves unblocked parked keys back (unpark, when
something may have unblocked), reconciles what its held lanes list with what this instance
handed out, scans the due deliveries of its lanes and the free ones (``claim`` index), looks up
the heads of their keys (``ordering`` index), records the picks on their lanes (taking the free
ones, handing back idle ones), and parks the blocked backlogs it saw. It writes the
``deliveries`` and ``lanes`` collections (layout and every filter and update:
`mongoq.outbox.schema`; the lanes: `mongoq.outbox.lanes`) and reads ``events``.

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
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import bson
from pymongo import UpdateMany, UpdateOne

from mongoq import _driver
from mongoq._validation import MAX_BATCH
from mongoq.clock import stored_instant
from mongoq.errors import InvalidInput
from mongoq.outbox import schema
from mongoq.outbox.lanes import (
    Entry,
    Lane,
    LaneView,
    charge_lost,
)
from mongoq.outbox.models import LANES, Delivery, Event
from mongoq.runtime.report import error_text

if TYPE_CHECKING:
    from mongoq.outbox.store import AsyncOutbox

__all__ = ["Claimer", "parse_token"]

#: A server merges at most 200 sorted index ranges (``internalQueryMaxScansToExplode``) and
#: beyond that sorts the whole due backlog: a claim's first page names at most this many lanes
#: (a range each), a later page, whose ``(due_at, _id)`` bound is two ranges a lane, half.
FIRST_PAGE_LANES = 200
LATER_PAGE_LANES = 100
#: Seconds (of the clock) a lane view serves claims that take all they ask for.
VIEW_TTL = 1.0
#: Waiting deliveries of one key a claim must see behind an unfinished head before parking them.
PARK_THRESHOLD = 32
#: Lanes left with deliveries listed that one claim takes over (and charges) at most.
STALE_LANES_PER_CLAIM = 32
#: Parked keys one claim looks at for a delivery to move back (keep simultaneously backlogged
#: keys in the hundreds).
UNPARK_KEYS_PER_CLAIM = 500


def parse_token(delivery: Any, field: str = "delivery") -> tuple[bson.ObjectId, int, int, int]:
    """(delivery _id, lane, epoch, claim generation) of a `Delivery`; a token this store cannot
    have issued is `InvalidInput` before any database call."""
    if not isinstance(delivery, Delivery):
        raise InvalidInput(field, f"must be a Delivery, got {type(delivery).__name__}")
    try:
        doc_id = bson.ObjectId(delivery.id)
        lane_text, epoch_text, claims_text = delivery.lease_token.split(":")
        lane, epoch, claims = int(lane_text), int(epoch_text), int(claims_text)
    except (bson.errors.InvalidId, TypeError, ValueError, AttributeError):
        raise InvalidInput(f"{field}.lease_token", "is not a token this outbox issued") from None
    if not 0 <= lane < 256 or epoch < 0 or claims < 0:
        raise InvalidInput(f"{field}.lease_token", "is not a token this outbox issued")
    return doc_id, lane, epoch, claims


def _handler_set(handlers: list[str] | None) -> tuple[str, ...] | None:
    """The handlers of a claim as unparking keys its state by (None: every handler)."""
    return None if handlers is None else tuple(sorted(handlers))


class _Picking:
    """The picks of one claim, taken from the candidates of its scan in ``(due_at, _id)``
    order: an unkeyed delivery as it comes, a keyed one only when it is the head of its key
    (looked up in waves, one query each, no further than the picks still wanted can reach, so
    that a claim of one does not look up every key of a page) and its key neither runs nor was
    picked already. What it passes over, by key, are the candidates parking considers
    (`waiting`)."""

    def __init__(
        self,
        limit: int,
        running: list[Entry],
        heads_of: Callable[
            [Mapping[tuple[str, str], Mapping[str, Any]]],
            Awaitable[dict[tuple[str, str], dict[str, Any] | None]],
        ],
    ) -> None:
        self.limit = limit
        self.heads_of = heads_of
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

    async def take(self, candidates: list[dict[str, Any]]) -> tuple[datetime, Any] | None:
        """Pick from `candidates`; returns the ``(due_at, _id)`` of the last one looked at."""
        after = None
        position = 0
        while position < len(candidates) and not self.done:
            wave: dict[tuple[str, str], dict[str, Any]] = {}  # key -> its first candidate
            for candidate in candidates[position:]:
                hk = self._key_of(candidate)
                if hk is not None and self._unknown(hk) and hk not in wave:
                    wave[hk] = candidate
                    if len(wave) == self.limit - len(self.picks):
                        break
            if wave:
                self.heads.update(await self.heads_of(wave))
            for candidate in candidates[position:]:
                hk = self._key_of(candidate)
                if self._unknown(hk):
                    break  # beyond this wave
                position += 1
                after = (candidate["due_at"], candidate["_id"])
                if candidate["_id"] in self.excluded:
                    continue
                if hk is not None:
                    head = self.heads.get(hk)
                    if self._blocked(hk) or head is None or head["_id"] != candidate["_id"]:
                        self.waiting[hk].append(candidate["_id"])
                        continue
                    self.taken_keys.add(hk)
                self.picks.append(candidate)
                if self.done:
                    break
        return after


class Claimer:
    """The claim algorithm of one `AsyncOutbox`, and what it remembers between claims: its lane
    view, which claims this instance handed out and has not seen settled (`issued`) and which it
    saw end (`ended`), one lock per owner (claims of one owner on one instance run one after the
    other), and where unparking goes on and whether it is due.
    """

    def __init__(self, outbox: AsyncOutbox) -> None:
        self.outbox = outbox
        self.db = outbox.db
        self.events = outbox.events
        self.deliveries = outbox.deliveries
        self.lanes = outbox.lanes
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
        # handler set of a claim -> the last parked key its unparking looked at
        self.unpark_after: dict[tuple[str, ...] | None, tuple[str, str]] = {}
        self.view = LaneView()
        # owners whose last claim took all it asked for: their next one trusts a recent view
        self.filled: set[str] = set()
        # keys with parked deliveries, as far as this instance knows: a settle of one of them
        # makes unparking due for its handler (`unpark_due`)
        self.parked_keys: set[tuple[str, str]] = set()
        self.unpark_due: set[str] = set()
        # the handler sets whose parked keys a claim of this instance looked at at least once
        self.looked: set[tuple[str, ...] | None] = set()

    async def claim(self, owner: str, handlers: list[str] | None, limit: int) -> list[Delivery]:
        """Claim up to `limit` due deliveries for `owner` (checked already; see
        `AsyncOutbox.claim`), after the owner's claims in progress on this instance."""
        async with self.locks[owner]:
            claimed = await self._claim(owner, handlers, limit)
            if len(claimed) < limit and self.view.failed:
                # A lane write failed (another instance took a lane first, a requeue came
                # between): once more, from the lanes as they are now.
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
            issued = self.issued[delivery.owner]
            if issued.get(doc_id) == claims:  # a stale settle leaves a newer claim running
                del issued[doc_id]
            if ended:
                self.ended[delivery.owner].add((doc_id, claims))
            if (delivery.handler, delivery.event.key) in self.parked_keys:
                self.unpark_due.add(delivery.handler)  # its followers may be first now

    def _unpark_wanted(self, handlers: list[str] | None) -> bool:
        """Whether a claim of `handlers` should look at the parked keys although it did not
        read the lanes: its first, or one after a settle of a key of theirs with parked
        deliveries (or after a look that had more keys to look at)."""
        if _handler_set(handlers) not in self.looked:
            return True
        if handlers is None:
            return bool(self.unpark_due)
        return not self.unpark_due.isdisjoint(handlers)

    def invalidate(self) -> None:
        """Read the lanes again before the next claim (a write whose outcome is not what the
        view expects, or one outside the claim)."""
        self.view.failed = True

    async def _lane_view(
        self, owner: str, handlers: list[str] | None, now: datetime
    ) -> tuple[LaneView, bool]:
        """The lane view for a claim of `owner` and `handlers`, and whether it was read for it
        (`LaneView.refresh`)."""
        view = self.view
        named = handlers if handlers is not None else view.slots.handlers
        if view.failed or owner not in self.filled or view.read_due([None, *named], now, VIEW_TTL):
            await view.refresh(self.lanes, owner, self.outbox.instance, handlers, now, VIEW_TTL)
            return view, True
        return view, False

    async def _claim(self, owner: str, handlers: list[str] | None, limit: int) -> list[Delivery]:
        now = await self.outbox._now()
        view, read = await self._lane_view(owner, handlers, now)
        # The handlers with lanes (a name without is no handler's yet: nothing to claim).
        named = handlers if handlers is not None else view.slots.handlers
        wanted = [h for h in dict.fromkeys(named) if view.slots.first_lane(h) is not None]
        # What this owner runs is decided over all its lanes (`others`: those of handlers this
        # claim does not serve), its records of what it handed out cover them all: see
        # `_reconcile`. Those of them that run nothing are handed back.
        held, free, stale, others = view.split(owner, self.outbox.instance, now, wanted)
        # A lane whose previous holder left deliveries listed (a crash, an expired lease, a
        # graceful stop) is taken over before anything is read from it: what was running there
        # is charged its lost attempt first, so the scan below sees current generations. Those
        # beyond this claim's share wait for a later claim.
        if stale:
            held.update(await self._take_over(owner, stale[:STALE_LANES_PER_CLAIM], now))
        # A lost list on a lane this owner holds was left by a claim that failed between the
        # takeover and the charge: charge it.
        unpaid = [(lane, lane.epoch) for lane in (*held.values(), *others.values()) if lane.lost]
        if unpaid:
            await charge_lost(self.db, self.deliveries, self.lanes, unpaid, now)
            paid = [replace(lane, lost=[], rev=None) for lane, _ in unpaid]
            for lane in paid:
                (held if lane.id in held else others)[lane.id] = lane
            view.update(paid)
        if read or self._unpark_wanted(handlers):
            await self._unpark(handlers)
        running = await self._reconcile(owner, [*held.values(), *others.values()], now, look=read)

        picking = _Picking(limit, running, self._heads)
        page = min(limit * 2 + PARK_THRESHOLD, MAX_BATCH)
        # The lanes of each handler are its own: a delivery is this claim's to take when the
        # lane of its handler and number (``_id`` its handler's first lane + the number) is
        # held by this owner or free. Every lane of every handler this owner's or free: one
        # scan in due order of them all (``ready``); else a merge of the lanes' ranges
        # (``claim``) of the numbers any of them has held or free.
        firsts = {h: view.slots.first_lane(h) or 0 for h in wanted}
        ours = {i // LANES * LANES for i in (*held, *free)}
        wanted = [h for h in wanted if firsts[h] in ours]  # the others have nothing to take
        every = len(held) + len(free) == LANES * len(wanted)
        lane_ids = None if every else sorted({i % LANES for i in (*held, *free)})
        after: tuple[datetime, Any] | None = None
        while not picking.done and wanted and lane_ids != []:
            candidates = await self._scan(lane_ids, wanted, now, after, page)
            # A delivery in a lane another owner holds for its handler, read because this
            # owner holds or may take the same number for another handler: never picked (and
            # the next page starts after the last one read, kept or not).
            await picking.take(candidates if every else [
                c for c in candidates
                if (i := firsts[c["handler"]] + c["lane_id"]) in held or i in free
            ])  # fmt: skip
            if len(candidates) < page:
                break
            last = candidates[-1]  # the next page after what was read, kept or not
            after = (last["due_at"], last["_id"])
            page = min(page * 2, MAX_BATCH)  # a long blocked stretch: read further per query
        picks, waiting, heads = picking.picks, picking.waiting, picking.heads
        mine = {**held, **others}
        deliveries = await self._record(owner, now, mine, free, running, picks, firsts)
        issued = self.issued[owner]
        for delivery in deliveries:
            issued[bson.ObjectId(delivery.id)] = parse_token(delivery)[3]
        try:
            await self._park(waiting, heads, now)
        except BaseException:
            self.forget(deliveries)  # never handed out (a cancellation): freed next
            raise
        if len(deliveries) == limit:
            self.filled.add(owner)
        else:
            self.filled.discard(owner)
        return deliveries

    async def _take_over(self, owner: str, stale: list[Lane], now: datetime) -> dict[int, Lane]:
        """Take `stale` lanes over and charge what their previous holders left running; returns
        the lanes now held (a lane another claimer took first is left out)."""
        lease_until = now + timedelta(seconds=self.outbox.lease)
        write = uuid.uuid4().hex
        ops = [
            self._take(lane, owner, lease_until, [], lane.lost + lane.in_flight, write)
            for lane in stale
        ]  # fmt: skip
        result = await self._write_lanes(ops, [lane.id for lane in stale])
        expected = {lane.id: lane.epoch + 1 for lane in stale}
        taken = (
            set(expected)
            if result.matched_count == len(ops)
            else await self._confirm(owner, expected, write)
        )
        adopted = {
            lane.id: lane.taken(owner, self.outbox.instance, lease_until, [],
                                lane.lost + lane.in_flight, write)
            for lane in stale
            if lane.id in taken
        }  # fmt: skip
        if adopted:
            self._seen(adopted.values())
            self.outbox.log.info("took over %d lane(s) left with deliveries listed", len(adopted))
            await charge_lost(
                self.db, self.deliveries, self.lanes,
                [(lane, lane.epoch) for lane in adopted.values()], now,
            )  # fmt: skip
            adopted = {i: replace(lane, lost=[]) for i, lane in adopted.items()}
            self._seen(adopted.values())
        return adopted

    def _seen(self, lanes: Iterable[Lane], read_since: int | None = None) -> None:
        """Lanes as a write of this instance left them (or as read back), into the view."""
        self.view.update(list(lanes), read_since)

    async def _write_lanes(self, ops: list[UpdateOne | UpdateMany], ids: list[int]) -> Any:
        """A bulk write of the lanes `ids` (one op each); one that fails or matches fewer
        leaves the view wrong about some of them (a failed one may have been applied), so the
        next claim reads the lanes again, those among them (`LaneView.unsure`) whatever
        handlers it names."""
        try:
            result = await self.lanes.bulk_write(ops, ordered=False)
        except BaseException:
            self.invalidate()
            self.view.unsure.update(ids)
            raise
        if result.matched_count != len(ops):
            self.view.unsure.update(ids)
        return result

    async def _reconcile(
        self, owner: str, held: Iterable[Lane], now: datetime, *, look: bool
    ) -> list[Entry]:
        """What runs in `held` lanes: entries whose delivery still exists at the listed
        generation and that this instance handed out and has not seen settled.

        Any other entry is a claim nobody will settle, unless this instance saw it end: its
        record reached the lane but the claim failed before handing it out (a lost reply), or
        its settle failed. Its generation moves on (no attempt charged, and only if still at
        the listed one), which frees it and its key at once, and any late settle of that claim
        is refused.

        The entries this instance runs are looked up when the claim read the lanes (`look`) or
        a completion in the caller's transaction may have committed since: one whose settle
        went through another `AsyncOutbox` object, or committed in the caller's transaction, is
        gone from the collection, not from this instance's records. Between two look-ups such
        an entry counts as running a little longer, which delays its key and never runs
        anything twice. And `running` is decided after the look-up, so a settle that failed
        while it ran is freed, not skipped."""
        issued = self.issued[owner]
        ended = self.ended.pop(owner, set())
        entries = [e for lane in held for e in lane.in_flight if e.claim not in ended]
        if not entries:
            issued.clear()
            return []
        mine = [e for e in entries if issued.get(e.delivery) == e.generation]
        orphaned = [e for e in entries if issued.get(e.delivery) != e.generation]
        current: set[tuple[Any, int]] = {e.claim for e in mine}
        if mine and (look or owner in self.unsure):
            self.unsure.discard(owner)
            try:
                current = {
                    (doc["_id"], int(doc["claims"]))
                    for doc in await _driver.find_list(
                        self.deliveries,
                        schema.delivery_pending_by_ids([e.delivery for e in mine]),
                        projection={"claims": 1},
                    )
                }
            except BaseException:
                self.unsure.add(owner)
                raise
        listed = [e for e in mine if e.claim in current]
        running = [e for e in listed if issued.get(e.delivery) == e.generation]
        orphaned += [e for e in listed if issued.get(e.delivery) != e.generation]
        self.issued[owner] = {e.delivery: e.generation for e in running}
        if orphaned:
            freed = await self._free(orphaned, now)
            if freed:
                self.outbox.log.info(
                    "freed %d claim(s) that were never handed out or settled", freed
                )
        return running

    async def _free(self, entries: list[Entry], now: datetime) -> int:
        """End the claims `entries` list without an attempt: their generation moves on (each
        only if still at the listed one), so they are claimable again and any late settle of
        those claims is refused. Returns how many were still at it."""
        result = await self.deliveries.update_many(
            schema.delivery_claimed(e.claim for e in entries), schema.delivery_freeing(now)
        )
        return int(result.modified_count)

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
        of those. ``{_id, due_at, lane}`` each."""
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
        for doc in ahead:
            hk = (doc["handler"], doc["key"])
            head = heads.get(hk)
            if head is not None and doc["sequence"] < head["sequence"]:
                heads[hk] = doc
        return heads

    async def _record(
        self,
        owner: str,
        now: datetime,
        held: dict[int, Lane],
        free: dict[int, Lane],
        running: list[Entry],
        picks: list[dict[str, Any]],
        firsts: Mapping[str, int],
    ) -> list[Delivery]:
        """Read the picks' events, then record the picks on their lanes (taking the free ones),
        and hand back held lanes that yield nothing and run nothing. Returns the deliveries
        whose lane write took effect. `firsts`: the ``_id`` of each handler's lane 0."""
        events = await self._events_of(picks, now)
        picks = [p for p in picks if p["event_id"] in events]
        lane_of_pick = {p["_id"]: firsts[p["handler"]] + p["lane_id"] for p in picks}
        by_lane: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for pick in picks:
            by_lane[lane_of_pick[pick["_id"]]].append(pick)
        running_by_lane: dict[Any, list[Entry]] = defaultdict(list)
        running_ids = {e.delivery for e in running}
        for lane in held.values():
            running_by_lane[lane.id] = [e for e in lane.in_flight if e.delivery in running_ids]
        lease_until = now + timedelta(seconds=self.outbox.lease)
        instance = self.outbox.instance
        write = uuid.uuid4().hex  # what proves a lane write of this claim, read back
        ops: list[UpdateOne | UpdateMany] = []
        targets: list[int] = []  # the lane of each op
        expected: dict[int, int] = {}  # lane -> its epoch once written
        after: list[Lane] = []  # the lanes once every write took effect
        for lane in held.values():
            entries = running_by_lane[lane.id] + [self._entry(p) for p in by_lane[lane.id]]
            if not entries:
                fence = lane.fence(owner, instance)
                ops.append(_driver.update_by_id(self.db, fence, schema.lane_handing_back(now, [])))
                targets.append(lane.id)
                after.append(lane.handed_back(now))
            elif by_lane[lane.id] or len(entries) != len(lane.in_flight):
                # New picks are listed only if no requeue in the lane came between.
                fence = (lane.listing_fence if by_lane[lane.id] else lane.fence)(owner, instance)
                update = schema.lane_listing(entries, lease_until, write)
                ops.append(_driver.update_by_id(self.db, fence, update))
                targets.append(lane.id)
                expected[lane.id] = lane.epoch
                after.append(lane.listing(entries, lease_until, write))
        for lane_id, lane_picks in by_lane.items():
            if lane_id in held:
                continue
            # A free lane with nothing listed (stale ones were taken over above).
            lane = free[lane_id]
            entries = [self._entry(p) for p in lane_picks]
            ops.append(self._take(lane, owner, lease_until, entries, [], write))
            targets.append(lane_id)
            expected[lane_id] = lane.epoch + 1
            after.append(lane.taken(owner, instance, lease_until, entries, [], write))
        written = set(expected)
        if ops:
            result = await self._write_lanes(ops, targets)
            if result.matched_count != len(ops):
                written = await self._confirm(owner, expected, write)
            else:
                self._seen(after)
        return [
            self._delivery(
                pick, events[pick["event_id"]], owner, expected[lane_of_pick[pick["_id"]]]
            )
            for pick in picks
            if lane_of_pick[pick["_id"]] in written
        ]

    def _take(
        self,
        lane: Lane,
        owner: str,
        lease_until: datetime,
        in_flight: list[Entry],
        lost: list[Entry],
        write: str,
    ) -> UpdateOne | UpdateMany:
        """The write that takes `lane` over for `owner`, as read (see `Lane.take_filter`)."""
        return _driver.update_by_id(
            self.db,
            lane.take_filter(),
            schema.lane_takeover(owner, self.outbox.instance, lease_until, in_flight, lost, write),
        )

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
        docs = await _driver.find_list(self.lanes, schema.lanes_by_ids(expected))
        read = [Lane.from_document(doc) for doc in docs]
        mine = [
            lane for lane in read
            if lane.held_by(owner, self.outbox.instance) and lane.epoch == expected[lane.id]
            and lane.write == write
        ]  # fmt: skip
        self._seen(mine)
        self._seen([lane for lane in read if lane not in mine], read_since=since)
        self.view.unsure.difference_update(expected)
        return {lane.id for lane in mine}

    @staticmethod
    def _entry(pick: Mapping[str, Any]) -> Entry:
        return Entry(pick["_id"], int(pick["claims"]), pick["handler"], pick.get("key"))

    async def _events_of(
        self, picks: list[dict[str, Any]], now: datetime
    ) -> dict[str, Mapping[str, Any]]:
        """The events of `picks`. A delivery whose event is gone (only possible when a purge
        without transactions raced a replayed publish) can never run: it is buried."""
        if not picks:
            return {}
        ids = list({p["event_id"] for p in picks})
        docs = await _driver.find_list(self.events, schema.events_by_ids(ids))
        events: dict[str, Mapping[str, Any]] = {doc["_id"]: doc for doc in docs}
        orphans = [p for p in picks if p["event_id"] not in events]
        if orphans:
            self.outbox.log.error(
                "%d delivery(ies) without their event; burying them", len(orphans)
            )
            await self.deliveries.update_many(
                schema.delivery_at_generation(self._entry(p).claim for p in orphans),
                schema.delivery_burying(error_text("its event is missing"), now, charge=False),
            )
        return events

    def _delivery(
        self, pick: Mapping[str, Any], event_doc: Mapping[str, Any], owner: str, epoch: int
    ) -> Delivery:
        event = Event(
            id=event_doc["_id"],
            type=event_doc["type"],
            payload=event_doc.get("payload"),
            key=event_doc.get("key"),
            headers=event_doc.get("headers") or {},
            correlation_id=event_doc.get("correlation_id"),
            causation_id=event_doc.get("causation_id"),
            created_at=stored_instant(event_doc.get("created_at")),
        )
        claims = int(pick["claims"])
        return Delivery(
            id=str(pick["_id"]),
            event=event,
            handler=pick["handler"],
            attempt=int(pick["attempts"]) + 1,
            lease_token=f"{pick['lane_id']}:{epoch}:{claims}",
            owner=owner,
            sequence=pick.get("sequence"),
            due_at=stored_instant(pick.get("due_at")),
        )

    async def _park(
        self,
        waiting: Mapping[tuple[str, str], list[Any]],
        heads: Mapping[tuple[str, str], dict[str, Any] | None],
        now: datetime,
    ) -> None:
        """Move blocked backlogs out of the claim index, so that later claims do not scan them:
        the waiting deliveries of a key when there are `PARK_THRESHOLD` or more, or when its
        head is not due yet (they cannot run before it anyway). Best effort: a failure is
        logged, never fails the claim, and leaves them ready (scanned, but correct)."""
        parked: list[Any] = []
        for hk, ids in waiting.items():
            head = heads.get(hk)
            not_due = head is not None and (stored_instant(head.get("due_at")) or now) > now
            if len(ids) >= PARK_THRESHOLD or not_due:
                parked += ids
                self.parked_keys.add(hk)
                # A head that finished while its followers were being parked settled before
                # its key was known here: the next claim looks.
                self.unpark_due.add(hk[0])
        if not parked:
            return
        try:
            result = await self.deliveries.update_many(
                schema.delivery_parkable(parked), schema.delivery_parking()
            )
        except _driver.DRIVER_ERRORS as exc:
            self.outbox.log.warning("parking %d blocked deliveries failed (%s)", len(parked), exc)
            return
        self.outbox.log.debug("parked %d blocked deliveries", result.modified_count)

    async def _unpark(self, handlers: list[str] | None) -> None:
        """Level-triggered: each parked key whose lowest pending delivery is parked (nothing
        unfinished before it) gets that delivery back in the claim index. It looks at the
        current state only, so a crash while parking, or a head finishing while its followers
        were being parked, delays a key until a later claim but never strands it. It runs when
        the claim read the lane view, or when a settle made it due (`forget`)."""
        cursor = _handler_set(handlers)
        # Each look goes on after the last key the previous one (for the same handlers) looked
        # at, wrapping around, so every parked key is looked at however many there are. The
        # aggregation is a distinct scan of the parked keys (one index seek a key), then one
        # query reads what comes before each key's lowest parked delivery.
        groups = await _driver.aggregate_list(
            self.deliveries,
            schema.delivery_parked_keys(
                handlers, self.unpark_after.get(cursor), UNPARK_KEYS_PER_CLAIM
            ),
            hint=schema.PARKED_INDEX,
        )
        pairs = [(str(g["h"]), str(g["k"])) for g in groups]
        whole = cursor not in self.unpark_after and len(pairs) < UNPARK_KEYS_PER_CLAIM
        self.looked.add(cursor)
        if handlers is None:
            self.unpark_due.clear()
        else:
            self.unpark_due.difference_update(handlers)
        if len(pairs) == UNPARK_KEYS_PER_CLAIM:
            self.unpark_after[cursor] = pairs[-1]
            # more keys to look at: the next claim goes on
            self.unpark_due.update(handlers if handlers is not None else {h for h, _ in pairs})
        else:
            self.unpark_after.pop(cursor, None)
        # The keys with parked deliveries, which a settle makes worth unparking: all of them
        # (of these handlers) when this look saw every one.
        if whole:
            self.parked_keys = {
                hk for hk in self.parked_keys if handlers is not None and hk[0] not in handlers
            }
        self.parked_keys.update(pairs)
        if not pairs:
            return
        lowest = {
            (str(g["h"]), str(g["k"])):
                {"_id": g["d"], "sequence": g["s"], "due_at": g.get("t"), "lane": schema.PARKED}
            for g in groups
        }  # fmt: skip
        heads = await self._heads(lowest)
        ready = [
            h["_id"] for h in heads.values() if h is not None and h.get("lane") == schema.PARKED
        ]
        if ready:
            await self.deliveries.update_many(
                schema.delivery_unparkable(ready), schema.delivery_unparking()
            )
