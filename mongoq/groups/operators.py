"""The group transport's operator calls, mixed into `AsyncGroupTransport`: the dead letters and
their redrive, the recovery of orphaned groups, and the stats. They read and write the
transport's collections (see `mongoq.groups.schema`) through its filters; they own none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol

from mongoq import _driver
from mongoq._unreachable import names_unreachable_server
from mongoq._validation import check_id, check_int, check_seconds, id_token, parse_id_token
from mongoq.clock import stored_instant
from mongoq.errors import InvalidInput
from mongoq.groups import quarantine, schema
from mongoq.groups.models import (
    GROUP_STATES,
    PRIORITIES,
    DeadLetter,
    GroupId,
    GroupInfo,
    GroupPage,
    GroupStats,
    NewMessage,
    count_of,
    describe_fault,
    kind_of,
    lock_fault,
    message_fault,
    priority_of,
)
from mongoq.runtime.report import Attempt, log_set_aside

__all__ = ["GroupOperators"]

log = logging.getLogger("mongoq.groups")


class _Transport(Protocol):
    """What the operator calls use of the transport they are mixed into."""

    db: Any
    prefix: str
    messages: Any
    locks: Any
    counters: Any
    dead: Any
    lease_ttl: float
    _recovered_until: datetime | None

    async def _now(self) -> datetime: ...

    async def publish_many(self, messages: Iterable[NewMessage]) -> list[int]: ...

    async def _finish_burial(self, head: Mapping[str, Any], now: datetime) -> None: ...


@names_unreachable_server
class GroupOperators:
    """`list_groups`, `dead_letters`, `redrive`, `recover_orphans` and `stats` of
    `AsyncGroupTransport`."""

    #: where the previous `recover_orphans` window ended (set by the transport's constructor)
    _recovered_until: datetime | None

    async def dead_letters(
        self: _Transport, *, group_id: GroupId | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead letters, oldest first, optionally of one group."""
        check_int("limit", limit, low=1)
        group = None if group_id is None else check_id("group_id", group_id)
        docs = await _driver.find_list(
            self.dead, schema.dead_letters_selected(None, group), sort=schema.SEQ_ORDER, limit=limit
        )
        return [DeadLetter.from_document(doc) for doc in docs]

    async def redrive(
        self: _Transport, seqs: Iterable[int] | None = None, *, group_id: GroupId | None = None,
        limit: int = 1000,
    ) -> int:  # fmt: skip
        """Publish dead letters again, at the tail of their groups, and remove them from the
        dead letters; returns how many. Select by `seqs`, or by `group_id`, or the oldest
        `limit`. A redrive interrupted midway may publish a message twice (at least once)."""
        check_int("limit", limit, low=1)
        wanted = None
        if seqs is not None:
            wanted = [check_int(f"seqs[{i}]", seq, low=1) for i, seq in enumerate(seqs)]
        group = None if group_id is None else check_id("group_id", group_id)
        docs = await _driver.find_list(
            self.dead,
            schema.dead_letters_selected(wanted, group),
            sort=schema.SEQ_ORDER,
            limit=limit,
        )
        docs = [doc for doc in docs if _redrivable(self, doc)]
        if not docs:
            return 0
        await self.publish_many(NewMessage.from_dead_letter(doc) for doc in docs)
        await self.dead.delete_many(
            schema.dead_letters_selected([doc["_id"] for doc in docs], None)
        )
        log.info("redrove %d dead letter(s)", len(docs))
        return len(docs)

    async def recover_orphans(self: _Transport, *, older_than: float | None = None) -> int:
        """Ready the groups of messages whose publisher died before readying the group, and
        the groups whose lock no claim can see (a priority or a due time of the wrong type,
        written by hand or by another program: repaired from the group's head, one WARNING
        each; see `mongoq.groups.quarantine`).

        Looks at messages older than `older_than` seconds (default: `lease_ttl`) whose group
        has no lock document; returns how many groups it readied. One aggregation and, if any,
        one bulk upsert; then two index reads of the locks no claim can see (none, and one
        lock, on a healthy transport). After its first run, a transport looks only at the
        messages published since the previous run (less a margin of `lease_ttl`), through the
        ``published`` index.
        """
        seconds = self.lease_ttl if older_than is None else check_seconds("older_than", older_than)
        now = await self._now()
        cutoff = now - timedelta(seconds=seconds)
        since = None
        if self._recovered_until is not None:
            since = self._recovered_until - timedelta(seconds=self.lease_ttl)
        orphans = await _driver.aggregate_list(
            self.messages, schema.orphan_groups(cutoff, since, self.locks.name)
        )
        self._recovered_until = cutoff
        repaired = await quarantine.sweep_locks(self, now)
        if not orphans:
            return repaired
        await self.locks.bulk_write(
            [
                _driver.update_by_id(
                    self.db, schema.lock_of(doc["_id"]), schema.orphan_readying(doc), upsert=True
                )
                for doc in orphans
            ],
            ordered=False,
        )
        log.warning("readied %d orphaned group(s)", len(orphans))
        return len(orphans) + repaired

    async def list_groups(
        self: _Transport,
        state: str | None = None,
        *,
        limit: int = 100,
        after: str | None = None,
    ) -> GroupPage:
        """Groups with messages, in group id order: those in `state` (``ready``, ``in_flight``,
        ``parked``; every one when None), at most `limit` (up to 1,000) a page, each with its
        head. Pass the page's `next` as `after` for the following page. Two commands a page:
        the locks in id order (the state tested on each; parked ones from their own index),
        the heads of the page's groups."""
        if state is not None and state not in GROUP_STATES:
            raise InvalidInput("state", f"must be None or one of {', '.join(GROUP_STATES)}")
        check_int("limit", limit, low=1, high=MAX_PAGE)
        last = None if after is None else _parse_cursor(after)
        now = await self._now()
        # Parked groups are few (waiting out a nack): their index's range, sorted in memory,
        # rather than every lock in id order.
        locks = await _driver.find_list(
            self.locks, schema.locks_listed(state, now, last), sort=schema.LOCK_LIST_ORDER,
            limit=limit + 1, hint=schema.PARKED.name if state == "parked" else None,
        )  # fmt: skip
        page = locks[:limit]
        heads: dict[Any, dict[str, Any]] = {}
        if page:
            rows = await _driver.aggregate_list(
                self.messages, schema.head_summaries_of([lock["_id"] for lock in page]),
                hint=schema.GROUP_HEAD.name,
            )  # fmt: skip
            heads = {row["_id"]: row for row in rows}
        groups = [_group_info(lock, heads.get(lock["_id"]), now) for lock in page]
        more = len(locks) > limit
        return GroupPage(groups, id_token(page[-1]["_id"]) if more else None)

    async def stats(self: _Transport) -> GroupStats:
        """Groups ready / in flight / parked, messages, dead letters, oldest message age
        (six commands; the message and dead-letter totals come from collection metadata)."""
        now = await self._now()
        ready = await self.locks.count_documents(schema.lock_due(PRIORITIES[0], now))
        waiting = await self.locks.count_documents(schema.lock_waiting(now))
        parked = await self.locks.count_documents(schema.lock_parked(now))
        in_flight = waiting - parked
        messages = await self.messages.estimated_document_count()
        dead = await self.dead.estimated_document_count()
        oldest = await _driver.find_list(
            self.messages,
            schema.messages_all(),
            sort=schema.SEQ_ORDER,
            limit=1,
            projection={"published_at": 1},
        )
        published = stored_instant(oldest[0].get("published_at")) if oldest else None
        age = (now - published).total_seconds() if published is not None else None
        return GroupStats(ready, in_flight, parked, messages, dead, age)


#: The most groups one `list_groups` page returns.
MAX_PAGE = 1000


def _parse_cursor(cursor: Any) -> GroupId:
    problem = "must be the `next` of an earlier page"
    if not isinstance(cursor, str):
        raise InvalidInput("after", problem)
    return parse_id_token("after", cursor, problem)


def _group_info(
    lock: Mapping[str, Any], head: Mapping[str, Any] | None, now: datetime
) -> GroupInfo:
    """A listing's row, whatever the lock and its head hold (never an exception: one bad
    document never breaks a page); `unreadable` names what no claim can use."""
    published = stored_instant(head.get("published_at")) if head else None
    error = head.get("last_error") if head else None
    return GroupInfo(
        group_id=lock["_id"],
        state=schema.lock_state(lock, now),
        priority=priority_of(lock.get("priority")) or 0,
        available_at=stored_instant(lock.get("available_at")),
        head_seq=head.get("seq") if head else None,
        head_published_at=published,
        head_age=(now - published).total_seconds() if published is not None else None,
        head_deliveries=(count_of(head.get("deliveries") or 0) or 0) if head else None,
        head_error=error if isinstance(error, str) else None,
        unreadable=_unreadable(lock, head),
    )


def _unreadable(lock: Mapping[str, Any], head: Mapping[str, Any] | None) -> str | None:
    """What `GroupInfo.unreadable` says of a lock and its head summary (`head_summaries_of`)."""
    fault = lock_fault(lock)
    if fault is not None:
        return f"lock: {describe_fault(fault)}"
    if head is None:
        return None
    # The row of `head_summaries_of` as the message's own fields.
    fields = {"_id": head.get("seq"), "group_id": lock["_id"]}
    fields.update((name, head[name]) for name in ("deliveries", "last_error", "published_at")
                  if name in head)  # fmt: skip
    fault = message_fault(fields)
    return None if fault is None else f"head {head.get('seq')!r}: {describe_fault(fault)}"


def _redrivable(transport: _Transport, doc: Mapping[str, Any]) -> bool:
    """Whether a dead letter can be published again: its group id is one (a dead letter edited
    by hand may hold anything: it is left where it is, with one WARNING)."""
    try:
        check_id("group_id", doc.get("group_id"))
        return True
    except InvalidInput:
        fault = ("group_id", kind_of(doc.get("group_id")) if "group_id" in doc else "nothing")
    attempt = Attempt("groups", transport.prefix, f"{doc.get('group_id')}/{doc.get('_id')}",
                      None, None)  # fmt: skip
    log_set_aside(log, attempt, transport.dead.name, *fault, "reported")
    return False
