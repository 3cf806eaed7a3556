"""`AsyncGroupTransport`: per-group FIFO messages, one consumer per group (seed 000).

Collections (names start with ``{prefix}``):

- ``{prefix}_messages``: one document per message, ``{_id: seq, group_id, event, priority,
  published_at, deliveries, token, stamp_until, last_error, dead}``; ``seq`` is a global
  monotonic number, so a group's head is its smallest stored ``_id`` (a concurrent publisher's
  smaller ``seq`` may be stored after a larger one was delivered: publishes that overlap have
  no order). ``token`` / ``stamp_until`` are
  the lease that holds the head and until when; ``deliveries`` counts the deliveries; ``dead``
  marks a head on its way to the dead letters.
- ``{prefix}_locks``: one document per active group, the ready-index and the lease in one,
  ``{_id: group_id, available_at, token, priority, version, last_seq, parked}``.
  ``available_at`` is when the group is next claimable: the epoch for a group never claimed,
  ``now`` after an ack or an immediate nack (round-robin: behind never-claimed groups and groups
  already waiting), ``now + visibility`` while in flight, ``now + delay`` while parked.
  ``priority`` (0-4) is fixed by the first publish. ``version`` counts the publishes that readied
  the group and ``last_seq`` is the largest seq they readied: together they fence the drop of a
  drained group.
- ``{prefix}_counters``: ``{_id: "seq", value}``, the sequence allocator (``$inc n``).
- ``{prefix}_dead``: dead letters, ``{_id: seq, group_id, event, priority, published_at,
  deliveries, error, dead_at}``.

Queries and the indexes that serve them:

- claim: locks ``{priority: {$in: [floor..4]}, available_at <= now}`` sorted by
  ``available_at`` -> ``claim`` ``{priority: 1, available_at: 1}`` (hinted): at most five index
  ranges merged in ``available_at`` order, so the floor never scans lower groups;
- a group's head: messages ``{group_id}`` sorted by ``_id`` -> ``group_head``
  ``{group_id: 1, _id: 1}`` (hinted); ack / nack / extend / dead-lettering: by ``_id``;
- stats: ``claim`` for the ready and waiting counts, ``parked`` ``{parked: 1, available_at: 1}``
  for the parked count, ``_id`` for the oldest message, collection metadata for the totals;
  dead letters by group -> ``group`` ``{group_id: 1, _id: 1}`` on ``{prefix}_dead``;
- `recover_orphans`: messages by ``published_at`` in a sliding window -> ``published``
  ``{published_at: 1}``.

Differences from the seed, and why:

- The seed's ack checks "more messages?" and then deletes the lock; a publish landing between
  the two strands its message with no lock. Here the ack deletes the head (fenced on the token
  the claim stamped on it) and then either drops the lock, if the head was the group's last
  message when claimed and no other message is there, with a delete fenced on the lock's token,
  ``version`` and ``last_seq`` (any publish since bumps ``version``), or releases it. A group
  a claim finds empty is dropped with the same ``version`` fence. Every interleaving of a
  publish with these drops keeps the message reachable (tests/test_groups_races.py runs them).
- The claim stamps its token on the head and counts the delivery (``find_one_and_update``
  instead of the seed's ``find_one``: same cost), which fences the ack's delete atomically and
  gives ``max_deliveries``. The stamp itself is fenced: a head stamped by a lease that is still
  live (``stamp_until``) is not restamped, so a claimer that stalled past its lock lease cannot
  take the head from the group's new holder.
- Dead-lettering marks the head (fenced on the token) before copying it to ``{prefix}_dead`` and
  deleting it; whoever next finds a marked head finishes the move, so a crash midway neither
  loses nor duplicates it.
- A publisher that dies (or is cancelled) between writing its message and readying its group
  leaves an orphan; `recover_orphans`, run by workers every ``visibility``, readies such groups.
- Events are stored as BSON (validated like task payloads) and handed back as published.
- Instants are datetimes from the injected `Clock` (the seed used float epochs).

Cost per message, unbatched: publish 3 (allocate, insert, ready), claim 2, ack 2 (3 for the
last message of a group: the drop is preceded by a check that nothing else is there).
``publish_many`` spends 3 commands per batch.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
from pymongo import DeleteOne, ReturnDocument

from mongoq import _driver
from mongoq._validation import (
    MAX_BATCH,
    check_batch,
    check_id,
    check_int,
    check_name,
    check_payload,
    check_seconds,
)
from mongoq.clock import Clock, ServerClock, stored_instant
from mongoq.errors import InvalidInput, PermanentError
from mongoq.runtime.candidates import take_candidates
from mongoq.runtime.keepalive import KeepAlive
from mongoq.runtime.loop import WorkerHost, WorkerLoop, error_text

__all__ = [
    "AsyncGroupTransport",
    "DeadLetter",
    "GroupLease",
    "GroupRunSummary",
    "GroupStats",
    "NewMessage",
]

log = logging.getLogger("mongoq.groups")

#: `available_at` of a group nobody has claimed yet: sorts before every real instant.
NEVER_CLAIMED = datetime(1970, 1, 1, tzinfo=UTC)
PRIORITIES = (0, 4)
ALL_PRIORITIES = range(PRIORITIES[0], PRIORITIES[1] + 1)
CLAIM_INDEX = "claim"
HEAD_INDEX = "group_head"
SEQ_COUNTER = "seq"
GroupId = str | int
#: `_take_head`'s answer when the head belongs to another live lease.
_REFUSED = object()


@dataclass(frozen=True)
class NewMessage:
    """One message for `AsyncGroupTransport.publish_many`."""

    group_id: GroupId
    event: Any
    priority: int = 0


@dataclass(frozen=True)
class GroupLease:
    """A claimed group and its head message. `event` is what the publisher passed (as BSON
    round-trips it: tuples come back as lists, datetimes as naive UTC to the millisecond)."""

    seq: int
    group_id: GroupId
    event: Any
    token: str
    worker_id: str
    deliveries: int
    priority: int
    lease_until: datetime
    #: the group's publish count when claimed, and whether this head was its last message:
    #: what lets `ack` drop a drained group safely
    group_version: int | None = field(default=None, repr=False)
    was_last: bool = field(default=False, repr=False)


@dataclass(frozen=True)
class DeadLetter:
    seq: int
    group_id: GroupId
    event: Any
    priority: int
    deliveries: int
    error: str | None
    published_at: datetime | None
    dead_at: datetime | None


@dataclass(frozen=True)
class GroupStats:
    """Groups by state, messages waiting, dead letters, and the age in seconds of the oldest
    message not yet acked (None when there is none): the "something is stuck" signal."""

    ready: int
    in_flight: int
    parked: int
    messages: int
    dead: int
    oldest_message_age: float | None


@dataclass
class GroupRunSummary:
    claimed: int = 0
    acked: int = 0
    retried: int = 0
    dead: int = 0
    #: leases given back unused (a stopped batch), their delivery not counted
    released: int = 0
    lost: int = 0
    #: settles that raised a driver error: applied or not, the lease expiry recovers the group
    unknown: int = 0


class AsyncGroupTransport(WorkerHost):
    """Per-group FIFO over MongoDB (see the module docstring for the layout).

    Guarantees: a group has at most one live holder (the claim is one atomic sorted
    ``find_one_and_update``); one message of a group at a time, the next only after the
    previous was acked or dead-lettered, the head being the smallest ``seq`` stored; if
    ``publish(a)`` returned before ``publish(b)`` was called (or ``a`` precedes ``b`` in one
    `publish_many`), ``a`` is delivered first. Concurrent publishes to one group have no order:
    allocating a ``seq`` and inserting the message are two commands, so a later ``seq`` can be
    stored, and delivered, before an earlier one. Every ack/nack/extend is fenced on the lease
    token, so a holder that lost the group changes nothing and gets ``False``; a consumer that
    dies leaves its group claimable again after `visibility` with the same head. Delivery is at
    least once. Without `max_deliveries`, a head that always fails blocks its group (FIFO): set it
    to move such heads to the dead letters.
    """

    def __init__(
        self,
        db: Any,
        prefix: str = "mongoq",
        *,
        visibility: float = 30,
        max_deliveries: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__()
        _driver.backend_of(db)
        self.prefix = check_name("prefix", prefix)
        self.visibility = check_seconds("visibility", visibility, positive=True)
        if max_deliveries is not None:
            check_int("max_deliveries", max_deliveries, low=1)
        self.max_deliveries = max_deliveries
        self.clock: Clock = clock if clock is not None else ServerClock(db)
        self.db = db
        self.messages = _driver.collection(db, f"{prefix}_messages")
        self.locks = _driver.collection(db, f"{prefix}_locks")
        self.counters = _driver.collection(db, f"{prefix}_counters")
        self.dead = _driver.collection(db, f"{prefix}_dead")
        self._recovered_until: datetime | None = None

    async def ensure_indexes(self) -> None:
        """Create the indexes every query needs; idempotent."""
        await self.locks.create_index([("priority", 1), ("available_at", 1)], name=CLAIM_INDEX)
        await self.locks.create_index([("parked", 1), ("available_at", 1)], name="parked")
        await self.messages.create_index([("group_id", 1), ("_id", 1)], name=HEAD_INDEX)
        await self.messages.create_index([("published_at", 1)], name="published")
        await self.dead.create_index([("group_id", 1), ("_id", 1)], name="group")

    async def _now(self) -> datetime:
        await self.clock.refresh()
        return self.clock.now()

    # ---------------------------------------------------------------------------- publish

    @staticmethod
    def _check_message(message: NewMessage, prefix: str = "") -> NewMessage:
        group_id = check_id(f"{prefix}group_id", message.group_id)
        check_payload(f"{prefix}event", message.event)
        check_int(f"{prefix}priority", message.priority, low=PRIORITIES[0], high=PRIORITIES[1])
        return NewMessage(group_id, message.event, message.priority)

    async def _allocate(self, count: int) -> int:
        """Reserve `count` consecutive sequence numbers; returns the first."""
        counter = await self.counters.find_one_and_update(
            {"_id": SEQ_COUNTER},
            {"$inc": {"value": count}},
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )
        return int(counter["value"]) - count + 1

    @staticmethod
    def _message_document(seq: int, message: NewMessage, now: datetime) -> dict[str, Any]:
        return {
            "_id": seq,
            "group_id": message.group_id,
            "event": message.event,
            "priority": message.priority,
            "published_at": now,
            "deliveries": 0,
            "token": None,
            "stamp_until": None,
            "last_error": None,
            "dead": None,
        }

    @staticmethod
    def _ready(priority: int, last_seq: int) -> dict[str, Any]:
        """The upsert that readies a group only if it is new (never pulls an in-flight or
        parked group's available_at back; the first publish fixes the priority), and records
        the publish in ``version`` / ``last_seq`` so that a concurrent drop of the group fails."""
        return {
            "$setOnInsert": {
                "available_at": NEVER_CLAIMED,
                "token": None,
                "priority": priority,
                "parked": False,
            },
            "$inc": {"version": 1},
            "$max": {"last_seq": last_seq},
        }

    async def publish(self, group_id: GroupId, event: Any, *, priority: int = 0) -> int:
        """Append `event` to `group_id`'s FIFO; returns its sequence number (3 commands).

        The message is written before its group is readied, so a claimer never finds a ready
        group whose message is not there yet. A publish whose reply is lost may have applied:
        publishing again can deliver the event twice (delivery is at least once).
        """
        message = self._check_message(NewMessage(group_id, event, priority))
        now = await self._now()
        seq = await self._allocate(1)
        # Shielded: a cancellation (a request timeout) between the two writes would leave the
        # message without a ready group until `recover_orphans` finds it.
        with anyio.CancelScope(shield=True):
            await self.messages.insert_one(self._message_document(seq, message, now))
            await self.locks.update_one(
                {"_id": message.group_id}, self._ready(priority, seq), upsert=True
            )
        return seq

    async def publish_many(self, messages: Iterable[NewMessage]) -> list[int]:
        """Publish a batch in 3 commands whatever its size; returns the sequence numbers.

        Order within the batch is the FIFO order for each group. A group new to the transport
        takes the priority of its first message in the batch.
        """
        checked: list[NewMessage] = []
        for index, message in enumerate(messages):
            if not isinstance(message, NewMessage):
                raise InvalidInput(
                    f"messages[{index}]", f"must be a NewMessage, got {type(message).__name__}"
                )
            checked.append(self._check_message(message, f"messages[{index}]."))
        if not checked:
            return []
        now = await self._now()
        first = await self._allocate(len(checked))
        seqs = list(range(first, first + len(checked)))
        groups: dict[GroupId, tuple[int, int]] = {}  # group -> (priority, last seq)
        for seq, message in zip(seqs, checked, strict=True):
            priority = groups.get(message.group_id, (message.priority, 0))[0]
            groups[message.group_id] = (priority, seq)
        with anyio.CancelScope(shield=True):  # as in `publish`
            await self.messages.insert_many(
                [self._message_document(seq, m, now) for seq, m in zip(seqs, checked, strict=True)]
            )
            await self.locks.bulk_write(
                [
                    _driver.update_by_id(
                        self.db, {"_id": group}, self._ready(priority, last), upsert=True
                    )
                    for group, (priority, last) in groups.items()
                ],
                ordered=False,
            )
        return seqs

    # ------------------------------------------------------------------------------ claim

    async def claim(
        self, worker_id: str | None = None, *, min_priority: int = 0
    ) -> GroupLease | None:
        """Lease the due group that has waited longest at or above `min_priority`, with its head.

        Two commands: the lease (one atomic sorted ``find_one_and_update``, so concurrent
        claimers get distinct groups) and the head (stamped with the lease's token, its
        delivery counted). A group found empty is dropped and the claim goes on; a head
        delivered more than `max_deliveries` times is dead-lettered and the next one taken.
        """
        worker = self._worker(worker_id)
        check_int("min_priority", min_priority, low=PRIORITIES[0], high=PRIORITIES[1])
        floor = list(ALL_PRIORITIES)[min_priority:]
        refused: list[GroupId] = []  # groups whose head another live lease holds
        while True:
            now = await self._now()
            token = f"{worker}:{uuid.uuid4().hex}"
            lease_until = now + timedelta(seconds=self.visibility)
            due: dict[str, Any] = {"priority": {"$in": floor}, "available_at": {"$lte": now}}
            if refused:
                due["_id"] = {"$nin": refused}
            with _driver.index_required(self.locks, CLAIM_INDEX):
                lock = await self.locks.find_one_and_update(
                    due,
                    {"$set": {"token": token, "available_at": lease_until, "parked": False}},
                    sort=[("available_at", 1)],
                    hint=CLAIM_INDEX,
                    return_document=ReturnDocument.AFTER,
                )
            if lock is None:
                return None
            head = await self._take_head(lock["_id"], token, now, lease_until)
            if head is _REFUSED:
                # Another lease holds the head: ours is stale, or the holder is between the two
                # writes of a nack. Give our lease back (a no-op if it is stale) and move on to
                # other groups; this call does not come back to it (no spinning on it).
                await self._release(lock["_id"], token, now)
                refused.append(lock["_id"])
                continue
            if head is None:
                await self._drop_if_empty(lock["_id"], token, lock.get("version"), now)
                continue
            return GroupLease(
                seq=head["_id"],
                group_id=lock["_id"],
                event=head.get("event"),
                token=token,
                worker_id=worker,
                deliveries=int(head["deliveries"]),
                priority=int(lock.get("priority", 0)),
                lease_until=lease_until,
                group_version=lock.get("version"),
                was_last=head["_id"] == lock.get("last_seq"),
            )

    async def claim_many(
        self, n: int, worker_id: str | None = None, *, min_priority: int = 0
    ) -> list[GroupLease]:
        """Lease up to `n` distinct due groups with their heads, in a fixed number of commands.

        Reads the `n` groups that waited longest, leases those still due with one conditional
        ``update_many`` under a fresh token, reads back what it leased, reads their heads in one
        aggregation, and stamps them with one conditional ``update_many`` (the same stamp fence
        as `claim`): five commands for any `n`. When other claimers leased every candidate
        first, it reads the next ones (two more commands a round): it returns nothing only
        when no group is due. Groups leased by someone else in between are
        not returned; a group whose head cannot be stamped, is empty, or must go to the dead
        letters is settled the way `claim` would and released or dropped (a few more commands,
        for those groups only).
        """
        check_int("n", n, low=1, high=MAX_BATCH)
        worker = self._worker(worker_id)
        check_int("min_priority", min_priority, low=PRIORITIES[0], high=PRIORITIES[1])
        now = await self._now()
        due: dict[str, Any] = {
            "priority": {"$in": list(ALL_PRIORITIES)[min_priority:]},
            "available_at": {"$lte": now},
        }
        token = f"{worker}:{uuid.uuid4().hex}"
        lease_until = now + timedelta(seconds=self.visibility)
        order = await take_candidates(
            self.locks,
            due,
            {"$set": {"token": token, "available_at": lease_until, "parked": False}},
            sort=[("available_at", 1)],
            n=n,
            hint=CLAIM_INDEX,
        )
        if not order:
            return []
        locks = {
            doc["_id"]: doc
            for doc in await _driver.find_list(self.locks, {"_id": {"$in": order}, "token": token})
        }
        heads = {
            row["_id"]: row["head"]
            for row in await _driver.aggregate_list(
                self.messages,
                [
                    {"$match": {"group_id": {"$in": list(locks)}}},
                    {"$sort": {"group_id": 1, "_id": 1}},
                    {"$group": {"_id": "$group_id", "head": {"$first": "$$ROOT"}}},
                ],
                hint=HEAD_INDEX,  # a DISTINCT_SCAN: one key per group, not its whole backlog
            )
        }
        free = [
            head["_id"]
            for head in heads.values()
            if head.get("dead") is None
            and (
                head.get("token") is None
                or (stored_instant(head.get("stamp_until")) or NEVER_CLAIMED) <= now
            )
        ]
        if free:
            stamped = await self.messages.update_many(
                {
                    "_id": {"$in": free},
                    "dead": None,
                    "$or": [{"token": None}, {"stamp_until": {"$lte": now}}],
                },
                {"$set": {"token": token, "stamp_until": lease_until}, "$inc": {"deliveries": 1}},
            )
            if stamped.modified_count != len(free):  # raced: ask which ones are ours
                ours = await _driver.find_list(
                    self.messages, {"_id": {"$in": free}, "token": token}, projection={"_id": 1}
                )
                free = [doc["_id"] for doc in ours]
        stamped_ids = set(free)
        leases: list[GroupLease] = []
        for group_id in order:
            try:
                lease = await self._lease_from_batch(
                    group_id, locks, heads, stamped_ids, token, worker, now, lease_until
                )
            except _driver.DRIVER_ERRORS:
                # One group's follow-up failed: its lease expires by itself; the others stand.
                log.warning("claim_many: settling group %r failed", group_id, exc_info=True)
                continue
            if lease is not None:
                leases.append(lease)
        return leases

    async def _lease_from_batch(
        self,
        group_id: GroupId,
        locks: Mapping[GroupId, Any],
        heads: Mapping[GroupId, Any],
        stamped_ids: set[int],
        token: str,
        worker: str,
        now: datetime,
        lease_until: datetime,
    ) -> GroupLease | None:
        """The lease `claim_many` got on one group, or None after settling it as `claim`
        would (an empty group dropped, a marked head moved on, an over-limit head buried)."""
        lock = locks.get(group_id)
        if lock is None:
            return None  # leased by someone else in between
        head = heads.get(group_id)
        if head is None:
            await self._drop_if_empty(group_id, token, lock.get("version"), now)
            return None
        if head["_id"] not in stamped_ids:
            if head.get("dead") is not None:  # someone's burial stopped midway: finish it
                await self._finish_burial(head)
            # Held by another live stamp, or changed since it was read: give it back.
            await self._release(group_id, token, now)
            return None
        deliveries = int(head.get("deliveries", 0)) + 1
        if self.max_deliveries is not None and deliveries > self.max_deliveries:
            error = head.get("last_error") or f"not acked after {self.max_deliveries} deliveries"
            await self._bury(head["_id"], token, now, error)
            await self._release(group_id, token, now)
            return None
        return GroupLease(
            seq=head["_id"],
            group_id=group_id,
            event=head.get("event"),
            token=token,
            worker_id=worker,
            deliveries=deliveries,
            priority=int(lock.get("priority", 0)),
            lease_until=lease_until,
            group_version=lock.get("version"),
            was_last=head["_id"] == lock.get("last_seq"),
        )

    async def ack_many(self, leases: Sequence[GroupLease]) -> list[bool]:
        """`ack` for many leases in a fixed number of commands; returns, per lease, whether its
        ack took effect (False, and nothing changed, for a lease no longer held).

        Reads which heads still carry their lease's token, deletes those, checks which of the
        groups whose last message they were have nothing left, drops those (fenced like `ack`)
        and releases the others: five commands for any number of leases.
        """
        leases = check_batch("leases", leases)
        for lease in leases:
            self._check_lease(lease)
        if not leases:
            return []
        held = await _driver.find_list(
            self.messages,
            _driver.owned_by([(lease.seq, lease.token) for lease in leases]),
            projection={"token": 1},
        )
        ours: set[tuple[int, str]] = {(doc["_id"], doc["token"]) for doc in held}
        acked = [lease for lease in leases if (lease.seq, lease.token) in ours]
        if not acked:
            return [False] * len(leases)

        # Only this lease's holder can remove a head stamped with its token.
        removed = await self.messages.delete_many(
            _driver.owned_by([(lease.seq, lease.token) for lease in acked])
        )
        if removed.deleted_count != len(acked):
            # A lease expired between the read and the delete and its head was restamped: it is
            # still there, under another token. If as many heads are gone as were deleted, the
            # gone ones are ours; otherwise a new holder also acked one in that instant and
            # which is which cannot be told: none of them is reported as acked by this call.
            left = {
                doc["_id"]
                for doc in await _driver.find_list(
                    self.messages,
                    {"_id": {"$in": [lease.seq for lease in acked]}},
                    projection={"_id": 1},
                )
            }
            gone = [lease for lease in acked if lease.seq not in left]
            acked = gone if len(gone) == removed.deleted_count else []
            ours = {(lease.seq, lease.token) for lease in acked}
            if not acked:
                return [False] * len(leases)
        now = await self._now()
        last = [lease for lease in acked if lease.was_last]
        if last:
            remaining = set(
                await self.messages.distinct(
                    "group_id", {"group_id": {"$in": [lease.group_id for lease in last]}}
                )
            )
            drops = [
                DeleteOne(
                    {
                        "_id": lease.group_id,
                        "token": lease.token,
                        "version": lease.group_version,
                        "last_seq": lease.seq,
                    }
                )
                for lease in last
                if lease.group_id not in remaining
            ]
            if drops:
                await self.locks.bulk_write(drops, ordered=False)
        await self.locks.update_many(  # the dropped locks are gone: this releases the rest
            _driver.owned_by([(lease.group_id, lease.token) for lease in acked]),
            {"$set": {"available_at": now, "token": None, "parked": False}},
        )
        return [(lease.seq, lease.token) in ours for lease in leases]

    async def _take_head(
        self, group_id: GroupId, token: str, now: datetime, lease_until: datetime
    ) -> Any:
        """Stamp and return the group's head; None if the group is empty, `_REFUSED` if the
        head is stamped by another lease that is still live. Heads marked dead are moved on,
        and heads past `max_deliveries` are dead-lettered, before the next one is taken."""
        free = {
            "$or": [
                {"$eq": [{"$ifNull": ["$token", None]}, None]},
                {"$lte": [{"$ifNull": ["$stamp_until", NEVER_CLAIMED]}, now]},
            ]
        }
        stamp = [
            {
                "$set": {
                    "token": {"$cond": [free, {"$literal": token}, "$token"]},
                    "stamp_until": {"$cond": [free, lease_until, "$stamp_until"]},
                    "deliveries": {
                        "$cond": [
                            free,
                            {"$add": [{"$ifNull": ["$deliveries", 0]}, 1]},
                            "$deliveries",
                        ]
                    },
                }
            }
        ]
        while True:
            with _driver.index_required(self.messages, HEAD_INDEX):
                head = await self.messages.find_one_and_update(
                    {"group_id": group_id},
                    stamp,
                    sort=[("_id", 1)],
                    hint=HEAD_INDEX,
                    return_document=ReturnDocument.AFTER,
                )
            if head is None:
                return None
            if head.get("token") != token:
                return _REFUSED
            if head.get("dead") is not None:  # someone's burial stopped midway: finish it
                await self._finish_burial(head)
                continue
            if self.max_deliveries is None or head["deliveries"] <= self.max_deliveries:
                return head
            error = head.get("last_error") or f"not acked after {self.max_deliveries} deliveries"
            if not await self._bury(head["_id"], token, now, error):
                return _REFUSED

    async def _drop_if_empty(
        self, group_id: GroupId, token: str, version: int | None, now: datetime
    ) -> None:
        dropped = await self.locks.delete_one({"_id": group_id, "token": token, "version": version})
        if dropped.deleted_count:
            return
        # A publish counted itself since this claim read the lock: its message was written
        # before that, so the group is not empty. Give it back, claimable at once.
        await self._release(group_id, token, now)

    async def _bury(self, seq: int, token: str, now: datetime, error: str) -> bool:
        """Move the head `seq` to the dead letters; False if `token` does not hold it.

        The mark (fenced on the token) is the commit point; copying and deleting after it are
        idempotent, and a claim that finds a marked head finishes them.
        """
        marked = await self.messages.find_one_and_update(
            {"_id": seq, "token": token, "dead": None},
            {"$set": {"dead": {"error": error, "at": now}}},
            return_document=ReturnDocument.AFTER,
        )
        if marked is None:
            return False
        await self._finish_burial(marked)
        log.warning("message %d of group %r moved to the dead letters: %s",
                    seq, marked["group_id"], error.splitlines()[-1] if error else "")  # fmt: skip
        return True

    async def _finish_burial(self, head: Mapping[str, Any]) -> None:
        mark = head["dead"]
        await self.dead.replace_one(
            {"_id": head["_id"]},
            {
                "group_id": head["group_id"],
                "event": head.get("event"),
                "priority": head.get("priority", 0),
                "published_at": head.get("published_at"),
                "deliveries": head.get("deliveries", 0),
                "error": mark.get("error"),
                "dead_at": mark.get("at"),
            },
            upsert=True,
        )
        await self.messages.delete_one({"_id": head["_id"], "dead": {"$ne": None}})

    async def _unclaim(self, lease: GroupLease) -> bool:
        """Give back a lease whose head never reached the handler: the group is claimable at
        once and the delivery the claim counted is taken back."""
        if not await self._release(lease.group_id, lease.token, await self._now()):
            return False
        await self.messages.update_one(
            {"_id": lease.seq, "token": lease.token},
            {"$set": {"token": None, "stamp_until": None}, "$inc": {"deliveries": -1}},
        )
        return True

    async def _release(self, group_id: GroupId, token: str, now: datetime) -> bool:
        """Give the group back, claimable now behind the groups already waiting (round-robin);
        fenced on the lock's token."""
        released = await self.locks.update_one(
            {"_id": group_id, "token": token},
            {"$set": {"available_at": now, "token": None, "parked": False}},
        )
        return bool(released.matched_count == 1)

    @staticmethod
    def _check_lease(lease: GroupLease) -> None:
        if not isinstance(lease, GroupLease):
            raise InvalidInput("lease", "must be a GroupLease returned by claim()")

    async def ack(self, lease: GroupLease) -> bool:
        """Remove the head and release the group (round-robin: behind the groups waiting), or
        drop the group if the head was its last message and nothing was published since.

        False, and nothing changed, when the head is no longer this lease's (taken over).
        """
        self._check_lease(lease)
        removed = await self.messages.delete_one({"_id": lease.seq, "token": lease.token})
        if not removed.deleted_count:
            return False
        now = await self._now()
        # Drop a group whose last message this was. The read catches a message written by a
        # publisher that died before readying the group (it would be orphaned by the drop, and
        # older than the orphan sweep's window); a publish after it bumps the version.
        if (
            lease.was_last
            and await self.messages.find_one({"group_id": lease.group_id}, {"_id": 1}) is None
        ):
            dropped = await self.locks.delete_one(
                {
                    "_id": lease.group_id,
                    "token": lease.token,
                    "version": lease.group_version,
                    "last_seq": lease.seq,
                }
            )
            if dropped.deleted_count:
                return True
        await self._release(lease.group_id, lease.token, now)
        # Had the lock been taken over in between, its new holder stamps the head only after
        # this lease's stamp expired; the ack landed first, and that holder gets the next.
        return True

    async def nack(
        self, lease: GroupLease, delay: float = 0, *, error: BaseException | str | None = None
    ) -> bool:
        """Give the head back. `delay` > 0 parks the group until then (keeping the token, so
        the parked holder may still ack); 0 makes it claimable at once, behind the groups
        already waiting. `error` is recorded on the message (a dead letter carries the last
        one). False, and nothing changed, if no longer held."""
        self._check_lease(lease)
        wait = check_seconds("delay", delay)
        now = await self._now()
        until = now + timedelta(seconds=wait)
        if wait > 0:
            parked = await self.locks.update_one(
                {"_id": lease.group_id, "token": lease.token},
                {"$set": {"available_at": until, "parked": True}},
            )
            held = parked.matched_count == 1
        else:
            held = await self._release(lease.group_id, lease.token, now)
        if not held:
            return False  # not ours: touch nothing, not even the error
        # Fenced on the head's token; a released head may be stamped by the next claimer.
        head: dict[str, Any] = {"stamp_until": until} if wait > 0 else {
            "token": None,
            "stamp_until": None,
        }  # fmt: skip
        if error is not None:
            head["last_error"] = error_text(error)
        await self.messages.update_one({"_id": lease.seq, "token": lease.token}, {"$set": head})
        return True

    async def extend(self, lease: GroupLease, visibility: float | None = None) -> bool:
        """Keep the group for `visibility` (default: the transport's) more seconds from now,
        the head's stamp with it. False if no longer held."""
        self._check_lease(lease)
        seconds = self.visibility if visibility is None else check_seconds(
            "visibility", visibility, positive=True
        )  # fmt: skip
        now = await self._now()
        until = now + timedelta(seconds=seconds)
        result = await self.locks.update_one(
            {"_id": lease.group_id, "token": lease.token},
            {"$set": {"available_at": until, "parked": False}},
        )
        if result.matched_count != 1:
            return False
        await self.messages.update_one(
            {"_id": lease.seq, "token": lease.token}, {"$set": {"stamp_until": until}}
        )
        return True

    async def extend_many(
        self, leases: Sequence[GroupLease], visibility: float | None = None
    ) -> list[bool]:
        """`extend` for many leases: the locks, a read of which are still held, and the stamps
        of those heads (three commands). Returns, per lease, whether it is still held."""
        leases = check_batch("leases", leases)
        for lease in leases:
            self._check_lease(lease)
        seconds = self.visibility if visibility is None else check_seconds(
            "visibility", visibility, positive=True
        )  # fmt: skip
        if not leases:
            return []
        now = await self._now()
        until = now + timedelta(seconds=seconds)
        fences = _driver.owned_by([(lease.group_id, lease.token) for lease in leases])
        await self.locks.update_many(fences, {"$set": {"available_at": until, "parked": False}})
        held = {
            (doc["_id"], doc["token"])
            for doc in await _driver.find_list(self.locks, fences, projection={"token": 1})
        }
        mine = [lease for lease in leases if (lease.group_id, lease.token) in held]
        if mine:  # as in `extend`: a head is restamped only under a lock still held
            await self.messages.update_many(
                _driver.owned_by([(lease.seq, lease.token) for lease in mine]),
                {"$set": {"stamp_until": until}},
            )
        return [(lease.group_id, lease.token) in held for lease in leases]

    async def dead_letter(self, lease: GroupLease, error: BaseException | str | None) -> bool:
        """Move the head to the dead letters now and release the group (a permanent failure).
        False, and nothing changed, if no longer held."""
        self._check_lease(lease)
        now = await self._now()
        if not await self._bury(lease.seq, lease.token, now, error_text(error) or ""):
            return False
        await self._release(lease.group_id, lease.token, now)
        return True

    # --------------------------------------------------------------------------- operators

    async def dead_letters(
        self, *, group_id: GroupId | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters, oldest first, optionally of one group."""
        check_int("limit", limit, low=1)
        query: dict[str, Any] = {}
        if group_id is not None:
            query["group_id"] = check_id("group_id", group_id)
        docs = await _driver.find_list(self.dead, query, sort=[("_id", 1)], limit=limit)
        return [
            DeadLetter(
                seq=doc["_id"],
                group_id=doc["group_id"],
                event=doc.get("event"),
                priority=int(doc.get("priority", 0)),
                deliveries=int(doc.get("deliveries", 0)),
                error=doc.get("error"),
                published_at=stored_instant(doc.get("published_at")),
                dead_at=stored_instant(doc.get("dead_at")),
            )
            for doc in docs
        ]

    async def redrive(
        self, seqs: Iterable[int] | None = None, *, group_id: GroupId | None = None,
        limit: int = 1000,
    ) -> int:  # fmt: skip
        """Publish dead letters again, at the tail of their groups, and remove them from the
        dead letters; returns how many. Select by `seqs`, or by `group_id`, or the oldest
        `limit`. A redrive interrupted midway may publish a message twice (at least once)."""
        check_int("limit", limit, low=1)
        query: dict[str, Any] = {}
        if seqs is not None:
            wanted = [check_int(f"seqs[{i}]", seq, low=1) for i, seq in enumerate(seqs)]
            query["_id"] = {"$in": wanted}
        if group_id is not None:
            query["group_id"] = check_id("group_id", group_id)
        docs = await _driver.find_list(self.dead, query, sort=[("_id", 1)], limit=limit)
        if not docs:
            return 0
        await self.publish_many(
            NewMessage(doc["group_id"], doc.get("event"), int(doc.get("priority", 0)))
            for doc in docs
        )
        await self.dead.delete_many({"_id": {"$in": [doc["_id"] for doc in docs]}})
        log.info("redrove %d dead letter(s)", len(docs))
        return len(docs)

    async def recover_orphans(self, *, older_than: float | None = None) -> int:
        """Ready the groups of messages whose publisher died before readying the group.

        Looks at messages older than `older_than` seconds (default: `visibility`) whose group
        has no lock document; returns how many groups it readied. One aggregation and, if any,
        one bulk upsert. After its first run, a transport looks only at the messages published
        since the previous run (less a margin of `visibility`), through the ``published`` index.
        """
        seconds = self.visibility if older_than is None else check_seconds("older_than", older_than)
        now = await self._now()
        cutoff = now - timedelta(seconds=seconds)
        window: dict[str, Any] = {"$lt": cutoff}
        if self._recovered_until is not None:
            window["$gte"] = self._recovered_until - timedelta(seconds=self.visibility)
        orphans = await _driver.aggregate_list(
            self.messages,
            [
                {"$match": {"published_at": window}},
                {"$sort": {"_id": 1}},
                {
                    "$group": {
                        "_id": "$group_id",
                        "priority": {"$first": "$priority"},
                        "last_seq": {"$last": "$_id"},
                    }
                },
                {
                    "$lookup": {
                        "from": self.locks.name,
                        "localField": "_id",
                        "foreignField": "_id",
                        "as": "lock",
                    }
                },
                {"$match": {"lock": {"$size": 0}}},
            ],
        )
        self._recovered_until = cutoff
        if not orphans:
            return 0
        await self.locks.bulk_write(
            [
                _driver.update_by_id(
                    self.db, {"_id": doc["_id"]},
                    self._ready(int(doc.get("priority") or 0), int(doc.get("last_seq") or 0)),
                    upsert=True,
                )
                for doc in orphans
            ],
            ordered=False,
        )  # fmt: skip
        log.warning("readied %d orphaned group(s)", len(orphans))
        return len(orphans)

    async def stats(self) -> GroupStats:
        """Groups ready / in flight / parked, messages, dead letters, oldest message age
        (six commands; the message and dead-letter totals come from collection metadata)."""
        now = await self._now()
        every = {"$in": list(ALL_PRIORITIES)}  # so the counts walk the `claim` index
        ready = await self.locks.count_documents({"priority": every, "available_at": {"$lte": now}})
        waiting = await self.locks.count_documents(
            {"priority": every, "available_at": {"$gt": now}}
        )
        parked = await self.locks.count_documents({"parked": True, "available_at": {"$gt": now}})
        in_flight = waiting - parked
        messages = await self.messages.estimated_document_count()
        dead = await self.dead.estimated_document_count()
        oldest = await _driver.find_list(
            self.messages, {}, sort=[("_id", 1)], limit=1, projection={"published_at": 1}
        )
        published = stored_instant(oldest[0].get("published_at")) if oldest else None
        age = (now - published).total_seconds() if published is not None else None
        return GroupStats(ready, in_flight, parked, messages, dead, age)

    # ------------------------------------------------------------------------------ worker

    async def run(
        self,
        handler: Callable[[GroupLease], Awaitable[Any]],
        *,
        worker_id: str | None = None,
        concurrency: int = 1,
        min_priority: int = 0,
        stop_when_empty: bool = False,
        poll_interval: float = 1.0,
        retry_delay: float = 1.0,
        batch_size: int = 1,
        handle_signals: bool = False,
    ) -> GroupRunSummary:
        """Claim groups and process their heads with `handler` until stopped.

        The lease is extended every ``visibility / 3`` while the handler runs. A clean return
        acks; `PermanentError` dead-letters the head; any other exception nacks with
        `retry_delay` and records the error; a cancellation nacks without an error. Orphaned
        groups are readied every ``visibility`` (and when idle). `stop()` stops gracefully.

        With `batch_size` > 1 each slot leases up to that many groups at once (`claim_many`),
        runs their heads one after another under one renewal (`extend_many`), and acks the
        successful ones together (`ack_many`): a few commands per batch instead of four per
        message. A worker that crashes mid-batch costs every head of the batch a delivery:
        size `max_deliveries` with that in mind.
        """
        check_int("concurrency", concurrency, low=1)
        check_int("min_priority", min_priority, low=PRIORITIES[0], high=PRIORITIES[1])
        check_int("batch_size", batch_size, low=1, high=MAX_BATCH)
        poll = check_seconds("poll_interval", poll_interval, positive=True)
        retry = check_seconds("retry_delay", retry_delay)
        worker = self._worker(worker_id)
        summary = GroupRunSummary()

        async def claim() -> list[GroupLease] | None:
            if batch_size == 1:
                lease = await self.claim(worker, min_priority=min_priority)
                leases = [] if lease is None else [lease]
            else:
                leases = await self.claim_many(batch_size, worker, min_priority=min_priority)
            summary.claimed += len(leases)
            return leases or None

        async def extend(leases: list[GroupLease]) -> list[bool]:
            if len(leases) == 1:
                return [await self.extend(leases[0])]
            return await self.extend_many(leases)

        async def ack(leases: list[GroupLease]) -> list[bool]:
            return [await self.ack(leases[0])] if len(leases) == 1 else await self.ack_many(leases)

        def count(outcome: str, n: int = 1) -> None:
            setattr(summary, outcome, getattr(summary, outcome) + n)

        async def process(leases: list[GroupLease]) -> None:
            unsettled = list(leases)  # held by this slot: renewals cover them
            handled: list[GroupLease] = []
            confirmed = [leases[0].lease_until]  # every lease of the batch holds until then

            async def renew() -> bool | None:
                if not unsettled:
                    return None
                renewing = list(unsettled)
                held = await extend(renewing)
                for lease, ok in zip(renewing, held, strict=True):
                    if not ok:  # taken over: never start (or settle) it here
                        unsettled.remove(lease)
                        count("lost")
                if all(held):
                    confirmed[0] = self.clock.now() + timedelta(seconds=self.visibility)
                return any(held)

            async def still_held(lease: GroupLease) -> bool:
                if lease not in unsettled:
                    return False
                if self.clock.now() < confirmed[0] or (await extend([lease]))[0]:
                    return True
                unsettled.remove(lease)
                count("lost")
                return False

            async def settle(lease: GroupLease, failure: Exception) -> None:
                if lease not in unsettled:  # a renewal found it lost (and counted it) meanwhile
                    return
                unsettled.remove(lease)
                with anyio.CancelScope(shield=True):  # as the final settles below
                    try:
                        if isinstance(failure, PermanentError):
                            outcome = "dead" if await self.dead_letter(lease, failure) else "lost"
                        else:
                            held = await self.nack(lease, retry, error=failure)
                            outcome = "retried" if held else "lost"
                    except _driver.DRIVER_ERRORS:
                        outcome = "unknown"
                        log.warning("settling group %r failed; its lease will expire",
                                    lease.group_id, exc_info=True)  # fmt: skip
                count(outcome)

            interval = self.visibility / 3
            keepalive = KeepAlive(
                clock=self.clock,
                interval=interval,
                renew=renew,
                first_at=leases[0].lease_until - timedelta(seconds=2 * interval),
                name=f"{len(leases)} group(s)",
            )
            current: GroupLease | None = None
            try:
                async with keepalive:
                    for current in leases:
                        if not await still_held(current):
                            continue  # taken over meanwhile: never run it twice at once
                        try:
                            await handler(current)
                        except Exception as exc:
                            await settle(current, exc)
                        else:
                            handled.append(current)  # a cancellation after this still acks
                    current = None
            finally:
                # Shielded, so a cancelled worker still settles what it holds; bounded, so a
                # dead server cannot hold the shutdown longer than the lease would have lasted.
                with anyio.move_on_after(self.visibility, shield=True):
                    try:
                        # Leave out what a renewal already found lost (and counted).
                        handled = [lease for lease in handled if lease in unsettled]
                        if handled:
                            acked = await ack(handled)
                            count("acked", sum(acked))
                            count("lost", len(acked) - sum(acked))
                            for lease in handled:
                                unsettled.remove(lease)
                        for lease in list(unsettled):
                            unsettled.remove(lease)
                            if lease is current:  # cut short: that delivery counts
                                count("retried" if await self.nack(lease, retry) else "lost")
                            else:  # never handed to the handler: not a delivery
                                count("released" if await self._unclaim(lease) else "lost")
                    except _driver.DRIVER_ERRORS:
                        count("unknown", len(unsettled))
                        log.warning("settling %d group(s) failed; their leases will expire",
                                    len(unsettled), exc_info=True)  # fmt: skip

        loop: WorkerLoop[list[GroupLease]] = WorkerLoop(
            claim=claim,
            process=process,
            clock=self.clock,
            concurrency=concurrency,
            poll_interval=poll,
            stop_when_empty=stop_when_empty,
            housekeeping=self.recover_orphans,
            housekeeping_interval=self.visibility,
            name=f"groups:{self.prefix}",
        )
        await self._run_loop(loop, handle_signals=handle_signals)
        return summary
