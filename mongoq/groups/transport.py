"""`AsyncGroupTransport`: per-group FIFO messages, one consumer per group.

Here: the constructor, publish, the claims (one group, or a batch) and the run loop. The lease
holder's calls (ack, nack, extend, dead-letter) are mixed in from `mongoq.groups.settles`, the
operator calls (dead letters, redrive, orphans, stats) from `mongoq.groups.operators`. The
collections (``{prefix}_messages``, ``_locks``, ``_counters``, ``_dead``), their documents and
indexes, and every filter and update sent are in `mongoq.groups.schema`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

import anyio
from pymongo import ReturnDocument
from pymongo.errors import BulkWriteError, OperationFailure

from mongoq import _driver, registry
from mongoq._indexes import create_schema_indexes
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import (
    MAX_BATCH,
    check_async_handler,
    check_int,
    check_lease_seconds,
    check_name,
    check_seconds,
    check_timeout,
)
from mongoq.clock import Clock, ServerClock, stored_instant
from mongoq.groups import quarantine, schema
from mongoq.groups.models import (
    READ_ERRORS,
    GroupId,
    GroupLease,
    GroupRunSummary,
    NewMessage,
    check_priority,
    checked_message,
    checked_messages,
    count_of,
    head_fault,
    lock_fault,
    new_lease_token,
)
from mongoq.groups.operators import GroupOperators
from mongoq.groups.settles import GroupSettles
from mongoq.groups.source import GroupSource
from mongoq.runtime import wakeups
from mongoq.runtime.candidates import take_candidates
from mongoq.runtime.loop import RunOptions, WorkerHost
from mongoq.runtime.report import log_attempt_end

__all__ = ["AsyncGroupTransport"]

log = logging.getLogger("mongoq.groups")

#: `_take_head`'s answer when the head belongs to another live lease.
_REFUSED = object()
#: `_lease_from_batch`'s answer when it set a document aside (the batch is claimed again).
_SET_ASIDE = object()


@names_unreachable_server
class AsyncGroupTransport(GroupSettles, GroupOperators, WorkerHost):
    """Per-group FIFO over MongoDB (see `mongoq.groups.schema` for the layout).

    Guarantees: a group has at most one live holder (the claim is one atomic sorted
    ``find_one_and_update``); one message of a group at a time, the next only after the
    previous was acked or dead-lettered, the head being the smallest ``seq`` stored; if
    ``publish(a)`` returned before ``publish(b)`` was called (or ``a`` precedes ``b`` in one
    `publish_many`), ``a`` is delivered first. Concurrent publishes to one group have no order:
    allocating a ``seq`` and inserting the message are two commands, so a later ``seq`` can be
    stored, and delivered, before an earlier one. Every ack/nack/extend is fenced on the lease
    token, so a holder that lost the group changes nothing and gets ``False``; a consumer that
    dies leaves its group claimable again after `lease_ttl` with the same head. Delivery is at
    least once. Without `max_deliveries`, a head that always fails blocks its group (FIFO): set it
    to move such heads to the dead letters.
    """

    def __init__(
        self,
        db: Any,
        prefix: str = "mongoq",
        *,
        lease_ttl: float = 30,
        max_deliveries: int | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__()
        _driver.backend_of(db)
        self.prefix = check_name("prefix", prefix, prefix=True)
        self.lease_ttl = check_lease_seconds("lease_ttl", lease_ttl)
        if max_deliveries is not None:
            check_int("max_deliveries", max_deliveries, low=1)
        self.max_deliveries = max_deliveries
        self.clock: Clock = clock if clock is not None else ServerClock(db)
        self.db = db
        self.messages = self._collection(schema.MESSAGES)
        self.locks = self._collection(schema.LOCKS)
        self.counters = self._collection(schema.COUNTERS)
        self.dead = self._collection(schema.DEAD)
        self._recovered_until: datetime | None = None
        self._wake_key = wakeups.key_of("groups", db, self.prefix)

    def _collection(self, name: str) -> Any:
        return _driver.collection(self.db, f"{self.prefix}_{name}")

    async def setup(self) -> None:
        """Create the indexes every query needs, and record the transport in the database's
        registry (`mongoq.registry`); idempotent. `InvalidInput`, before anything is written, if
        a collection of it is another registered primitive's."""
        await registry.check_collections(self.db, "groups", self.prefix)
        await create_schema_indexes(self.db, schema.INDEXES, self._collection)
        await registry.register(self.db, "groups", self.prefix, self.clock.now())

    # ---------------------------------------------------------------------------- publish

    async def _allocate(self, count: int) -> int:
        """Reserve `count` consecutive sequence numbers; returns the first. A counter whose
        value is no number is repaired, or reported with `UnreadableDocument`, before anything
        is written (`quarantine.repair_counter`)."""
        try:
            counter = await self._reserve(count)
        except OperationFailure as refusal:
            if not _driver.type_mismatch(refusal):
                raise
            await quarantine.repair_counter(self)
            counter = await self._reserve(count)  # refused again: raised as the server says
        value = quarantine.seq_value(counter["value"])  # a Decimal128 or a float counts too
        if value is None:  # an $inc the server applied, to NaN or an infinity: reported
            await quarantine.repair_counter(self)
            raise AssertionError("repair_counter raises for a value that says no seq")
        return value - count + 1

    async def _reserve(self, count: int) -> Any:
        return await self.counters.find_one_and_update(
            schema.seq_counter(),
            schema.seq_reserving(count),
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )

    async def publish(self, group_id: GroupId, event: Any, *, priority: int = 0) -> int:
        """Append `event` to `group_id`'s FIFO; returns its sequence number (3 commands). This
        process's workers of the transport claim at once.

        The message is written before its group is readied, so a claimer never finds a ready
        group whose message is not there yet. A publish whose reply is lost may have applied:
        publishing again can deliver the event twice (delivery is at least once).
        """
        message = checked_message(NewMessage(group_id, event, priority))
        now = await self._now()
        seq = await self._allocate(1)
        # Shielded: a cancellation (a request timeout) between the two writes would leave the
        # message without a ready group until `recover_orphans` finds it.
        with anyio.CancelScope(shield=True):
            await self.messages.insert_one(schema.message_document(seq, message, now))
            await self._ready({message.group_id: (priority, seq)}, now, bulk=False)
        wakeups.notify(self._wake_key)
        return seq

    async def publish_many(self, messages: Iterable[NewMessage]) -> list[int]:
        """Publish a batch in 3 commands whatever its size; returns the sequence numbers.

        Order within the batch is the FIFO order for each group. A group new to the transport
        takes the priority of its first message in the batch.
        """
        checked = checked_messages(messages)
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
                [schema.message_document(s, m, now) for s, m in zip(seqs, checked, strict=True)]
            )
            await self._ready(groups, now, bulk=True)
        wakeups.notify(self._wake_key)
        return seqs

    async def _ready(
        self, groups: Mapping[GroupId, tuple[int, int]], now: datetime, *, bulk: bool
    ) -> None:
        """Ready each group of `groups` (group -> its priority, its last seq published): one
        upsert, or with `bulk` one unordered bulk of them. A lock whose fences hold no number
        (the server refuses the ``$inc``) is repaired (`quarantine.repair_lock_of`) and
        readied again."""
        try:
            if not bulk:
                ((group, (priority, last)),) = groups.items()
                await self.locks.update_one(
                    schema.lock_of(group), schema.lock_readying(priority, last), upsert=True
                )
            else:
                await self.locks.bulk_write(
                    [
                        _driver.update_by_id(
                            self.db, schema.lock_of(group), schema.lock_readying(priority, last),
                            upsert=True,
                        )
                        for group, (priority, last) in groups.items()
                    ],
                    ordered=False,
                )  # fmt: skip
        except OperationFailure as refusal:
            refused = _refused_groups(refusal, list(groups))
            if not refused:
                raise
            for group in refused:
                await quarantine.repair_lock_of(self, group, now)
            for group in refused:  # refused again: raised as the server says
                priority, last = groups[group]
                await self.locks.update_one(
                    schema.lock_of(group), schema.lock_readying(priority, last), upsert=True
                )

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
        check_priority("min_priority", min_priority)
        refused: list[GroupId] = []  # groups whose head another live lease holds
        while True:
            now = await self._now()
            token = new_lease_token(worker)
            lease_until = now + timedelta(seconds=self.lease_ttl)
            with _driver.index_required(self.locks, schema.CLAIM.name):
                lock = await self.locks.find_one_and_update(
                    schema.lock_due(min_priority, now, refused),
                    schema.lock_leasing(token, lease_until),
                    sort=schema.CLAIM_ORDER,
                    hint=schema.CLAIM.name,
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
                await self._drop_if_empty(lock["_id"], token, lock, now)
                continue
            try:
                deliveries = int(head["deliveries"])
                return GroupLease.from_documents(lock, head, token, worker, lease_until, deliveries)
            except READ_ERRORS:  # a document no lease can carry: set it aside, claim on
                lease = await self._set_aside_claimed(lock, head, token, worker, now, lease_until)
                if isinstance(lease, GroupLease):
                    return lease
                if lease is None:  # the set-aside changed nothing (the document changed
                    refused.append(lock["_id"])  # meanwhile): not met again in this call

    async def claim_many(
        self, n: int, worker_id: str | None = None, *, min_priority: int = 0
    ) -> list[GroupLease]:
        """Lease up to `n` distinct due groups with their heads, in a fixed number of commands.

        Reads the `n` groups that waited longest with their heads (one aggregation, a
        ``$lookup`` of each head), leases those still due with one conditional ``update_many``
        under a fresh token, and stamps their heads with one conditional ``update_many`` (the
        same stamp fence as `claim`): three commands for any `n`. When another claimer leased
        some candidates in between, it reads back which it leased (one more); when one leased
        every candidate first, it reads the next ones and their heads (three more a round): it
        returns nothing only when no group is due. A group whose head cannot be stamped, is
        empty, or must go to the dead letters is settled the way `claim` would and released or
        dropped (a few more commands, for those groups only). A batch that had to set aside a
        document no lease can carry (`mongoq.groups.quarantine`), and leased nothing else, is
        claimed again.
        """
        check_int("n", n, low=1, high=MAX_BATCH)
        worker = self._worker(worker_id)
        check_priority("min_priority", min_priority)
        for _ in range(quarantine.ROUNDS):
            leases, set_aside = await self._claim_batch(n, worker, min_priority)
            if leases or not set_aside:
                return leases
        return []

    async def _claim_batch(
        self, n: int, worker: str, min_priority: int
    ) -> tuple[list[GroupLease], bool]:
        """One round of `claim_many`: its leases, and whether it set a document aside."""
        now = await self._now()
        token = new_lease_token(worker)
        lease_until = now + timedelta(seconds=self.lease_ttl)
        candidates = await take_candidates(
            self.locks,
            schema.lock_due(min_priority, now),
            schema.lock_leasing(token, lease_until),
            sort=schema.CLAIM_ORDER,
            n=n,
            hint=schema.CLAIM.name,
            joined=schema.lock_head_joined(f"{self.prefix}_{schema.MESSAGES}"),
        )
        order = [candidate["_id"] for candidate in candidates.docs]
        if not order:
            return [], False
        # Read before the lease, a lock's version and last seq may be older than now: the
        # fences on them (`lock_drained`, `lock_found_empty`) then fail and release instead.
        locks = (
            {doc["_id"]: doc for doc in candidates.docs}
            if candidates.all_taken
            else {
                doc["_id"]: doc
                for doc in await _driver.find_list(self.locks, schema.locks_leased(order, token))
            }
        )
        heads, seen = await self._heads_of_candidates(candidates.docs, locks)
        free = [head for head in heads.values() if schema.head_is_free(head, now)]
        stamped_ids, set_aside = await self._stamp_heads(free, token, now, lease_until)
        leases: list[GroupLease] = []
        for group_id in order:
            try:
                lease = await self._lease_from_batch(
                    group_id, locks, seen, heads, stamped_ids, token, worker, now, lease_until
                )
            except _driver.DRIVER_ERRORS:
                # One group's follow-up failed: its lease expires by itself; the others stand.
                log.warning("claim_many: settling group %r failed", group_id, exc_info=True)
                continue
            if lease is _SET_ASIDE:
                set_aside = True
            elif lease is not None:
                leases.append(lease)
        return leases, set_aside

    async def _stamp_heads(
        self, free: list[dict[str, Any]], token: str, now: datetime, lease_until: datetime
    ) -> tuple[set[Any], bool]:
        """claim_many's stamp of the `free` heads it read: the seqs it stamped, and whether it
        set heads aside: when the server refused the stamp for a head whose delivery count is
        no number (it stops there: some heads may be stamped), those heads are dead-lettered
        and the others read back."""
        stamped_ids = {head["_id"] for head in free}
        if not free:
            return stamped_ids, False
        set_aside = False
        try:
            stamped = await self.messages.update_many(
                schema.heads_free(free, now), schema.heads_stamping(token, lease_until)
            )
            if stamped.modified_count == len(free):
                return stamped_ids, False
        except OperationFailure as refusal:
            unusable = [(head, head_fault(head)) for head in free]
            if not _driver.type_mismatch(refusal) or not any(fault for _, fault in unusable):
                raise
            for head, fault in unusable:
                if fault is not None:
                    set_aside |= await quarantine.set_aside_head(self, head, fault, now)
        # Raced, or refused part-way: ask which ones are ours.
        ours = await _driver.find_list(
            self.messages, schema.heads_stamped(list(stamped_ids), token), projection={"_id": 1}
        )
        return {doc["_id"] for doc in ours}, set_aside

    async def _heads_of_candidates(
        self, candidates: list[dict[str, Any]], locks: Mapping[GroupId, Any]
    ) -> tuple[dict[GroupId, Any], Mapping[GroupId, Any]]:
        """The heads of the leased groups `locks`, and the lock documents they were read
        with: as the first round's read joined them (a head changed since is not stamped:
        `heads_free` takes it only as read), else read now, after the locks were."""
        if candidates and "head" in candidates[0]:
            joined = {doc["_id"]: doc for doc in candidates if doc["_id"] in locks}
            heads = {group: doc["head"][0] for group, doc in joined.items() if doc["head"]}
            return heads, joined
        rows = await _driver.aggregate_list(
            self.messages, schema.heads_of(locks), hint=schema.GROUP_HEAD.name
        )
        return {row["_id"]: row["head"] for row in rows}, locks

    async def _lease_from_batch(
        self,
        group_id: GroupId,
        locks: Mapping[GroupId, Any],
        seen: Mapping[GroupId, Any],
        heads: Mapping[GroupId, Any],
        stamped_ids: set[int],
        token: str,
        worker: str,
        now: datetime,
        lease_until: datetime,
    ) -> Any:
        """The lease `claim_many` got on one group, or None after settling it as `claim`
        would (an empty group dropped, a marked head moved on, an over-limit head buried), or
        `_SET_ASIDE` after setting aside a document no lease can carry."""
        lock = locks.get(group_id)
        if lock is None:
            return None  # leased by someone else in between
        head = heads.get(group_id)
        if head is None:  # empty when read, with the lock as `seen` then
            await self._drop_if_empty(group_id, token, seen[group_id], now)
            return None
        if head["_id"] not in stamped_ids:
            if head.get("dead") is not None:  # someone's burial stopped midway: finish it
                # from the head as it is now (the read may be older than a finished burial)
                marked = await self.messages.find_one(schema.head_marked_dead(head["_id"]))
                if marked is not None:
                    await self._finish_burial(marked, now)
            # Held by another live stamp, changed since it was read, or set aside: give it back.
            await self._release(group_id, token, now)
            return None
        # As stamped: the count read, one more (none yet counts as 0, as the stamp counts it; a
        # count that is no number stays as read, for the set-aside below to name).
        count = count_of(head.get("deliveries") or 0)
        counted = head.get("deliveries") if count is None else count + 1
        stamped = {**head, "token": token, "deliveries": counted}
        if self.max_deliveries is not None and _spent(stamped, self.max_deliveries):
            await self._bury_spent(stamped, token, now)
            await self._release(group_id, token, now)
            return None
        try:
            return GroupLease.from_documents(
                lock, stamped, token, worker, lease_until, stamped["deliveries"]
            )
        except READ_ERRORS:
            # The lock as the lease left it (it may have been read before the lease).
            leased = {**lock, **schema.lock_leasing(token, lease_until)["$set"]}
            return await self._set_aside_claimed(leased, stamped, token, worker, now, lease_until)

    async def _set_aside_claimed(
        self, lock: Mapping[str, Any], head: Mapping[str, Any], token: str, worker: str,
        now: datetime, lease_until: datetime,
    ) -> Any:  # fmt: skip
        """A claim leased `lock` and stamped `head` (its delivery counted), and no lease can
        carry what they hold: a head of the wrong shape is dead-lettered, a lock repaired (the
        lease then stands, with the repaired lock: returned), a lock whose group id no lease
        can carry costs its head (the claims move on through the group to its end, where the
        lock is dropped). The group is released otherwise; `_SET_ASIDE` when a set-aside took
        effect, None when none could (the document changed meanwhile)."""
        fault = head_fault(head)
        broken = lock_fault(lock)
        if fault is None and broken is not None and broken[0] != "_id":
            repaired = await quarantine.repair_lock(self, lock, now, holder=token, head=head)
            if repaired is not None:
                try:
                    return GroupLease.from_documents(
                        repaired, head, token, worker, lease_until, head["deliveries"]
                    )
                except READ_ERRORS:
                    pass  # nothing a check names: released, as a claim that raced
            await self._release(lock["_id"], token, now)
            return None if repaired is None else _SET_ASIDE
        what = "message"
        if fault is None:  # the lock's group id, or something no check names: the head goes
            fault = broken or ("document", "a value mongoq cannot read")
            what = "lock" if broken is not None else "message"
        done = await quarantine.set_aside_head(self, head, fault, now, token=token, what=what)
        await self._release(lock["_id"], token, now)
        return _SET_ASIDE if done else None

    async def _take_head(
        self, group_id: GroupId, token: str, now: datetime, lease_until: datetime
    ) -> Any:
        """Stamp and return the group's head; None if the group is empty, `_REFUSED` if the
        head is stamped by another lease that is still live. Heads marked dead are moved on,
        and heads past `max_deliveries` are dead-lettered, before the next one is taken."""
        stamp = schema.head_stamping(token, now, lease_until)
        refusals = 0  # bounded: a head changing under every set-aside never keeps a claim
        while True:
            try:
                with _driver.index_required(self.messages, schema.GROUP_HEAD.name):
                    head = await self.messages.find_one_and_update(
                        schema.messages_of(group_id),
                        stamp,
                        sort=schema.SEQ_ORDER,
                        hint=schema.GROUP_HEAD.name,
                        return_document=ReturnDocument.AFTER,
                    )
            except OperationFailure as refusal:
                if not _driver.type_mismatch(refusal):
                    raise
                # The head's delivery count is no number: dead-letter it, take the next one.
                refusals += 1
                if refusals > quarantine.ROUNDS or not await quarantine.set_aside_refused_head(
                    self, group_id, now, refusal
                ):
                    return _REFUSED
                continue
            if head is None:
                return None
            if head.get("token") != token:
                return _REFUSED
            if head.get("dead") is not None:  # someone's burial stopped midway: finish it
                await self._finish_burial(head, now)
                continue
            if self.max_deliveries is None or not _spent(head, self.max_deliveries):
                return head  # (a count that is no number: the lease construction sets it aside)
            if not await self._bury_spent(head, token, now):
                return _REFUSED

    async def _bury_spent(self, head: Mapping[str, Any], token: str, now: datetime) -> bool:
        """Dead-letter a head whose deliveries are spent (the claim that found it holds it)."""
        assert self.max_deliveries is not None
        error = schema.burial_error(head, self.max_deliveries)
        if not await self._bury(head["_id"], token, now, error):
            return False
        attempt = self._attempt(head["group_id"], head["_id"], self.max_deliveries, None)
        log_attempt_end(log, attempt, "dead", error)
        return True

    # ------------------------------------------------------------------------------ worker

    async def run(
        self,
        handler: Callable[[GroupLease], Awaitable[Any]],
        *,
        worker_id: str | None = None,
        concurrency: int = 1,
        min_priority: int = 0,
        stop_when_empty: bool = False,
        stop_when_drained: bool = False,
        poll_interval: float = 1.0,
        retry_delay: float = 1.0,
        batch_size: int = 1,
        handler_timeout: float | None = None,
        handle_signals: bool = False,
        give_up_after: float | None = None,
    ) -> GroupRunSummary:
        """Claim groups and process their heads with `handler` until stopped.

        The lease is extended every ``lease_ttl / 3`` while the handler runs. A clean return
        acks; `PermanentError` dead-letters the head; any other exception nacks with
        `retry_delay` and records the error; a cancellation (a second signal) nacks it with
        "worker stopped". Orphaned groups are readied every ``lease_ttl`` (and when idle).
        `stop()` stops gracefully. `handler_timeout` (seconds of the transport's clock) cancels
        a handler that runs longer: the head is nacked with ``HandlerTimeout: timed out after
        N s`` (a delivery spent). A handler whose group a renewal finds taken over is cancelled
        and counted `lost`. `stop_when_empty` returns as soon as no group is claimable *now*
        (parked groups wait for a later run); `stop_when_drained` only when no message is left
        at all, sleeping on the transport's clock until the next group is due meanwhile.

        With `batch_size` > 1 each slot leases up to that many groups at once (`claim_many`),
        runs their heads one after another under one renewal (`extend_many`), and acks the
        successful ones together (`ack_many`): a few commands per batch instead of four per
        message. A worker that crashes mid-batch costs every head of the batch a delivery:
        size `max_deliveries` with that in mind.

        A claim that cannot reach the server is retried with a growing backoff (the poll
        interval, doubled each time, at most 30 s); one warning says the server is lost and one
        that it is back. With `give_up_after` (seconds) the call raises `ServerUnavailable` once
        the server has been gone that long; by default it waits for the server forever.
        """
        options = RunOptions.checked(
            concurrency=concurrency, poll_interval=poll_interval, stop_when_empty=stop_when_empty,
            stop_when_drained=stop_when_drained, give_up_after=give_up_after,
        )  # fmt: skip
        source = self.source(
            handler, worker_id=worker_id, min_priority=min_priority, retry_delay=retry_delay,
            batch_size=batch_size, handler_timeout=handler_timeout,
        )  # fmt: skip
        await self._run_loop(options.loop([source]), handle_signals=handle_signals)
        return source.summary

    def source(
        self,
        handler: Callable[[GroupLease], Awaitable[Any]],
        *,
        worker_id: str | None = None,
        min_priority: int = 0,
        retry_delay: float = 1.0,
        batch_size: int = 1,
        handler_timeout: float | None = None,
    ) -> GroupSource:
        """This transport as a source of work for a `mongoq.runtime.loop.WorkerLoop`: what
        `run` runs. The options are `run`'s."""
        check_async_handler("handler", handler)
        return GroupSource(
            self, handler, worker_id=self._worker(worker_id),
            min_priority=check_priority("min_priority", min_priority),
            retry_delay=check_seconds("retry_delay", retry_delay),
            batch_size=check_int("batch_size", batch_size, low=1, high=MAX_BATCH),
            handler_timeout=check_timeout("handler_timeout", handler_timeout),
        )  # fmt: skip

    async def _next_due(self, floor: int) -> datetime | None:
        """When the next group is claimable; None when no message is left (of any priority:
        with `min_priority`, a drained run also waits for others to take the lower ones)."""
        left = await _driver.find_list(
            self.messages, schema.message_any(), sort=schema.SEQ_ORDER, limit=1,
            projection={"_id": 1},
        )  # fmt: skip
        if not left:
            return None
        locks = await _driver.find_list(
            self.locks, schema.lock_any(floor), sort=schema.CLAIM_ORDER, limit=1,
            projection={"available_at": 1}, hint=schema.CLAIM.name,
        )  # fmt: skip
        # (A due time that is no date: the sweep of the housekeeping repairs it.)
        due = stored_instant(locks[0].get("available_at")) if locks else None
        # Messages without a group are orphans, which housekeeping readies (every lease_ttl).
        return due or self.clock.now() + timedelta(seconds=self.lease_ttl)


def _refused_groups(refusal: OperationFailure, groups: list[GroupId]) -> list[GroupId]:
    """The groups of `_ready`'s upserts that `refusal` refused for a type mismatch; none when
    it refused anything for another reason (then it is raised as it is)."""
    if not isinstance(refusal, BulkWriteError):
        return groups if _driver.type_mismatch(refusal) else []
    errors = (refusal.details or {}).get("writeErrors") or []
    if not errors or any(e.get("code") not in _driver.TYPE_MISMATCH_CODES for e in errors):
        return []
    return [groups[e["index"]] for e in errors]


def _spent(head: Mapping[str, Any], max_deliveries: int) -> bool:
    """Whether `head` was delivered more than `max_deliveries` times (a count that is no
    number is not spent: the claim sets the head aside when it builds the lease)."""
    count = count_of(head.get("deliveries") or 0)
    return count is not None and count > max_deliveries
