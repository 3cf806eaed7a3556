"""The lease holder's calls of `AsyncGroupTransport`, mixed into it: ack, nack, extend (one lease
or many) and dead-letter, and the fenced writes the claims share with them (release a group,
drop an empty one, bury a head). Every one is fenced on the lease's token: a holder that lost
its group changes nothing. They use the transport's collections (see `mongoq.groups.schema`)
and own none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pymongo import DeleteOne, ReturnDocument
from pymongo.errors import OperationFailure

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import check_batch, check_lease_seconds, check_seconds
from mongoq.clock import Clock
from mongoq.groups import schema
from mongoq.groups.models import GroupId, GroupLease, check_lease, kind_of
from mongoq.runtime.report import Attempt, error_text, log_attempt_end, log_set_aside

__all__ = ["GroupSettles"]

log = logging.getLogger("mongoq.groups")


@names_unreachable_server
class GroupSettles:
    """`ack`, `ack_many`, `nack`, `extend`, `extend_many` and `dead_letter` of
    `AsyncGroupTransport`, and the fenced helpers its claims use."""

    # set by the transport's constructor
    prefix: str
    clock: Clock
    lease_ttl: float
    messages: Any
    locks: Any
    dead: Any

    async def _now(self) -> datetime:
        await self.clock.refresh()
        return self.clock.now()

    async def ack(self, lease: GroupLease) -> bool:
        """Remove the head and release the group (round-robin: behind the groups waiting), or
        drop the group if the head was its last message and nothing was published since.

        False, and nothing changed, when the head is no longer this lease's (taken over), or
        is on its way to the dead letters (this lease's `dead_letter` stopped after marking
        it: the next claimer finishes the move).
        """
        check_lease(lease)
        removed = await self.messages.delete_one(schema.message_ackable(lease.seq, lease.token))
        if not removed.deleted_count:
            return False
        now = await self._now()
        # Drop a group whose last message this was. The read catches a message written by a
        # publisher that died before readying the group (it would be orphaned by the drop, and
        # older than the orphan sweep's window); a publish after it bumps the version.
        if (
            lease.was_last
            and await self.messages.find_one(schema.messages_of(lease.group_id), {"_id": 1}) is None
        ):
            dropped = await self.locks.delete_one(
                schema.lock_drained(lease.group_id, lease.token, lease.group_version, lease.seq)
            )
            if dropped.deleted_count:
                return True
        await self._release(lease.group_id, lease.token, now)
        # Had the lock been taken over in between, its new holder stamps the head only after
        # this lease's stamp expired; the ack landed first, and that holder gets the next.
        return True

    async def ack_many(self, leases: Sequence[GroupLease]) -> list[bool]:
        """`ack` for many leases in a fixed number of commands; returns, per lease, whether its
        ack took effect (False, and nothing changed, for a lease no longer held).

        Deletes the heads still stamped with their lease's token and releases the groups: two
        commands for any number of leases. Groups whose last message was acked are checked for
        anything left and dropped (fenced like `ack`): two more. When fewer heads were deleted
        than asked, one or two reads tell which leases were lost.
        """
        leases = check_batch("leases", leases)
        for index, lease in enumerate(leases):
            check_lease(lease, f"leases[{index}]")
        if not leases:
            return []
        pairs = [(lease.seq, lease.token) for lease in leases]
        # Only this lease's holder can remove a head stamped with its token.
        removed = await self.messages.delete_many(schema.messages_ackable(pairs))
        acked = list(leases)
        if removed.deleted_count != len(leases):
            acked = await self._acked_of(leases, removed.deleted_count)
            if not acked:
                return [False] * len(leases)
        now = await self._now()
        last = [lease for lease in acked if lease.was_last]
        dropped = 0
        if last:
            remaining = set(
                await self.messages.distinct(
                    "group_id", schema.messages_of_groups([lease.group_id for lease in last])
                )
            )
            drops = [
                DeleteOne(
                    schema.lock_drained(lease.group_id, lease.token, lease.group_version, lease.seq)
                )
                for lease in last
                if lease.group_id not in remaining
            ]
            if drops:
                dropped = (await self.locks.bulk_write(drops, ordered=False)).deleted_count
        if dropped < len(acked):  # the dropped locks are gone: this releases the rest
            await self.locks.update_many(
                schema.locks_held([(lease.group_id, lease.token) for lease in acked]),
                schema.lock_releasing(now),
            )
        ours = {(lease.seq, lease.token) for lease in acked}
        return [(lease.seq, lease.token) in ours for lease in leases]

    async def _acked_of(self, leases: Sequence[GroupLease], deleted: int) -> list[GroupLease]:
        """Which of `leases` ack_many's delete acked, when it deleted only `deleted` heads.

        A head still there was held by another lease (restamped after ours expired). If as
        many heads are gone as were deleted, the gone ones are ours. Otherwise another holder
        acked some too: of the heads gone, those whose group is still ours were ours to
        delete (no one else could stamp them), and only those are reported acked.
        """
        left = {
            doc["_id"]
            for doc in await _driver.find_list(
                self.messages,
                schema.messages_by_seq([lease.seq for lease in leases]),
                projection={"_id": 1},
            )
        }
        gone = [lease for lease in leases if lease.seq not in left]
        if len(gone) == deleted:
            return gone
        # More gone than deleted: another holder acked some. Ours for sure are those whose
        # group this lease still holds; which of the others were ours cannot be told.
        held = {
            (doc["_id"], doc["token"])
            for doc in await _driver.find_list(
                self.locks,
                schema.locks_held([(lease.group_id, lease.token) for lease in gone]),
                projection={"token": 1},
            )
        }
        return [lease for lease in gone if (lease.group_id, lease.token) in held]

    async def nack(
        self, lease: GroupLease, delay: float = 0, *, error: BaseException | str | None = None
    ) -> bool:
        """Give the head back. `delay` > 0 parks the group until then (keeping the token, so
        the parked holder may still ack); 0 makes it claimable at once, behind the groups
        already waiting. `error` is recorded on the message (a dead letter carries the last
        one). False, and nothing changed, if no longer held."""
        check_lease(lease)
        wait = check_seconds("delay", delay)
        now = await self._now()
        until = now + timedelta(seconds=wait)
        if wait > 0:
            parked = await self.locks.update_one(
                schema.lock_held(lease.group_id, lease.token), schema.lock_parking(until)
            )
            held = parked.matched_count == 1
        else:
            held = await self._release(lease.group_id, lease.token, now)
        if not held:
            return False  # not ours: touch nothing, not even the error
        # Fenced on the head's token; a released head may be stamped by the next claimer.
        await self.messages.update_one(
            schema.message_held(lease.seq, lease.token),
            schema.head_nacking(until if wait > 0 else None, error_text(error)),
        )
        if error is not None:  # a handler's failure, not a lease merely handed back
            attempt = self._attempt(lease.group_id, lease.seq, lease.deliveries, lease.worker_id)
            log_attempt_end(log, attempt, "retried", error, until)
        return True

    async def extend(self, lease: GroupLease, lease_ttl: float | None = None) -> bool:
        """Keep the group for `lease_ttl` (default: the transport's) more seconds from now,
        the head's stamp with it. False if no longer held."""
        check_lease(lease)
        seconds = self.lease_ttl if lease_ttl is None else check_lease_seconds(
            "lease_ttl", lease_ttl
        )  # fmt: skip
        now = await self._now()
        until = now + timedelta(seconds=seconds)
        result = await self.locks.update_one(
            schema.lock_held(lease.group_id, lease.token), schema.lock_extending(until)
        )
        if result.matched_count != 1:
            return False
        await self.messages.update_one(
            schema.message_held(lease.seq, lease.token), schema.head_extending(until)
        )
        return True

    async def extend_many(
        self, leases: Sequence[GroupLease], lease_ttl: float | None = None
    ) -> list[bool]:
        """`extend` for many leases: the locks, a read of which are still held, and the stamps
        of those heads (three commands). Returns, per lease, whether it is still held."""
        leases = check_batch("leases", leases)
        for index, lease in enumerate(leases):
            check_lease(lease, f"leases[{index}]")
        seconds = self.lease_ttl if lease_ttl is None else check_lease_seconds(
            "lease_ttl", lease_ttl
        )  # fmt: skip
        if not leases:
            return []
        now = await self._now()
        until = now + timedelta(seconds=seconds)
        fences = schema.locks_held([(lease.group_id, lease.token) for lease in leases])
        await self.locks.update_many(fences, schema.lock_extending(until))
        held = {
            (doc["_id"], doc["token"])
            for doc in await _driver.find_list(self.locks, fences, projection={"token": 1})
        }
        mine = [lease for lease in leases if (lease.group_id, lease.token) in held]
        if mine:  # as in `extend`: a head is restamped only under a lock still held
            await self.messages.update_many(
                schema.messages_held([(lease.seq, lease.token) for lease in mine]),
                schema.head_extending(until),
            )
        return [(lease.group_id, lease.token) in held for lease in leases]

    async def dead_letter(self, lease: GroupLease, error: BaseException | str | None) -> bool:
        """Move the head to the dead letters now and release the group (a permanent failure).
        False, and nothing changed, if no longer held."""
        check_lease(lease)
        now = await self._now()
        if not await self._bury(lease.seq, lease.token, now, error_text(error) or ""):
            return False
        await self._release(lease.group_id, lease.token, now)
        attempt = self._attempt(lease.group_id, lease.seq, lease.deliveries, lease.worker_id)
        log_attempt_end(log, attempt, "dead", error)
        return True

    async def _release(self, group_id: GroupId, token: str, now: datetime) -> bool:
        """Give the group back, claimable now behind the groups already waiting (round-robin);
        fenced on the lock's token."""
        released = await self.locks.update_one(
            schema.lock_held(group_id, token), schema.lock_releasing(now)
        )
        return bool(released.matched_count == 1)

    async def _unclaim(self, lease: GroupLease) -> bool:
        """Give back a lease whose head never reached the handler: the group is claimable at
        once and the delivery the claim counted is taken back."""
        now = await self._now()
        if not await self._release(lease.group_id, lease.token, now):
            return False
        try:
            await self.messages.update_one(
                schema.message_held(lease.seq, lease.token), schema.head_unstamping()
            )
        except OperationFailure as refusal:
            if not _driver.type_mismatch(refusal):
                raise
            # Its delivery count became no number since the claim (edited by hand): the stamp
            # is still this lease's, so the head is set aside now rather than at the next claim.
            await self._bury(lease.seq, lease.token, now, "unreadable group message: field "
                             "'deliveries' holds no number; set aside")  # fmt: skip
            log_set_aside(
                log, self._attempt(lease.group_id, lease.seq, None, lease.worker_id),
                self.messages.name, "deliveries", "no number", "dead",
            )  # fmt: skip
        return True

    async def _drop_if_empty(
        self, group_id: GroupId, token: str, seen: Mapping[str, Any], now: datetime
    ) -> None:
        """Drop a leased group found empty, fenced on `seen` (its lock as read with the head);
        else give it back."""
        dropped = await self.locks.delete_one(schema.lock_found_empty(group_id, token, seen))
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
            schema.head_buriable(seq, token),
            schema.head_marking_dead(error, now),
            return_document=ReturnDocument.AFTER,
        )
        if marked is None:
            return False
        await self._finish_burial(marked, now)
        return True

    def _attempt(
        self, group_id: GroupId, seq: int, number: int | None, worker: str | None
    ) -> Attempt:
        return Attempt("groups", self.prefix, f"{group_id}/{seq}", number, worker)

    async def _finish_burial(self, head: Mapping[str, Any], now: datetime) -> None:
        """Copy the marked `head` to the dead letters and delete it (both idempotent). A mark
        that is no burial's (a ``dead`` field written by hand) is finished as one, its dead
        letter saying so, with one WARNING."""
        mark = head["dead"]
        if isinstance(mark, Mapping) and isinstance(mark.get("error"), str | None):
            error, dead_at = mark.get("error"), mark.get("at")
        else:
            fault = ("dead", kind_of(mark))
            error, dead_at = schema.set_aside_error("message", fault), now
            log_set_aside(
                log, self._attempt(head["group_id"], head["_id"], None, None),
                self.messages.name, *fault, "dead",
            )  # fmt: skip
        await self.dead.replace_one(
            schema.dead_letter_of(head["_id"]),
            schema.dead_letter_document(head, error, dead_at),
            upsert=True,
        )
        await self.messages.delete_one(schema.head_marked_dead(head["_id"]))
