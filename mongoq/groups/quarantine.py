"""Setting aside group documents no worker can use: a field of the wrong type or a missing one,
written by hand, by another program or by a bad restore (``deliveries: "x"``, a lock's
``priority: "2"``, the counter's ``value: "x"``). A message is dead-lettered at its first
encounter, with an error that names the field and what it holds; a lock is repaired from what
its group's messages say (dropped when they are gone); the sequence counter is repaired when its
value survives in another type (``"7"``), else publish refuses with `UnreadableDocument`. Each
with one WARNING (`log_set_aside`) naming the collection, the item and the field, instead of
crashing `run()`, stalling the groups behind it or leaving its group undelivered forever.

Found only when something fails, never looked for on the path of a good message: a stamp or a
publish the server refused for a type mismatch (code 14: ``$add``/``$inc`` of a non-number), a
claimed document `GroupLease.from_documents` cannot read, a burial mark that is no document. The
one exception are locks no claim can see, which no command of a claim meets (a priority outside
the claims' five index points, a due time that is no date): `sweep_locks`, run by
`recover_orphans` (every worker's housekeeping, every ``lease_ttl``), finds them with two index
reads, one of them of a single document on a healthy transport. Every write is fenced on the
document as it was read (`schema.lock_as_read`, `schema.head_as_read`) or on the caller's own
lease, so that a good change made meanwhile is never overwritten (a lock repair so beaten reads
the lock again, with that change, and repairs it: at most three times). Writes the transport's
collections (see `mongoq.groups.schema`); owns none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from typing import Any, Protocol

from bson import Decimal128
from pymongo import ReturnDocument

from mongoq import _driver
from mongoq.errors import UnreadableDocument
from mongoq.groups import schema
from mongoq.groups.models import (
    PRIORITIES,
    Fault,
    GroupId,
    head_fault,
    kind_of,
    lock_faults,
)
from mongoq.runtime.report import Attempt, log_set_aside

__all__ = [
    "ROUNDS",
    "SWEEP_LIMIT",
    "repair_counter",
    "repair_lock",
    "repair_lock_of",
    "seq_value",
    "set_aside_head",
    "set_aside_refused_head",
    "sweep_locks",
]

log = logging.getLogger("mongoq.groups")

#: The unusable locks one sweep repairs at most (more wait for the next sweep).
SWEEP_LIMIT = 100
#: Set-asides one claim makes before it leaves a group (a single claim: refused stamps of one
#: group) or says "nothing" for now (a batched claim: rounds that leased nothing): each round
#: sets at least one document aside, so the bound only keeps a claim finite.
ROUNDS = 100


class _Transport(Protocol):
    """What a set-aside uses of the transport: its prefix and collections, and the burial's
    last two steps."""

    prefix: str
    messages: Any
    locks: Any
    counters: Any
    dead: Any

    async def _finish_burial(self, head: Mapping[str, Any], now: datetime) -> None: ...


def _item(head: Mapping[str, Any]) -> str:
    return f"{head.get('group_id')}/{head.get('_id')}"


def _attempt(transport: _Transport, item: str, worker: str | None = None) -> Attempt:
    return Attempt("groups", transport.prefix, item, None, worker)


async def set_aside_head(
    transport: _Transport, head: Mapping[str, Any], fault: Fault, now: datetime,
    *, token: str | None = None, what: str = "message",
) -> bool:  # fmt: skip
    """Dead-letter the message read as `head` for `fault` (`what` names the document whose
    field it is: the message, or its group's lock), fenced on the stamp `token` the caller
    holds, else on the head as read; False when it changed meanwhile (left alone)."""
    fence = (
        schema.head_buriable(head["_id"], token) if token is not None
        else schema.head_as_read(head)
    )  # fmt: skip
    error = schema.set_aside_error(what, fault)
    marked = await transport.messages.find_one_and_update(
        fence, schema.head_marking_dead(error, now), return_document=ReturnDocument.AFTER
    )
    if marked is None:
        return False
    await transport._finish_burial(marked, now)
    collection = transport.messages if what == "message" else transport.locks
    item = _item(head) if what == "message" else str(head.get("group_id"))
    log_set_aside(log, _attempt(transport, item), collection.name, *fault, "dead")
    return True


async def set_aside_refused_head(
    transport: _Transport, group_id: GroupId, now: datetime, refusal: BaseException
) -> bool:
    """After the server refused to stamp `group_id`'s head for a type mismatch: dead-letter
    that head, read again. False when another live lease holds it (the claim moves on);
    `refusal` raised again when the head is usable after all (the refusal was about something
    else)."""
    docs = await _driver.find_list(
        transport.messages, schema.messages_of(group_id), sort=schema.SEQ_ORDER, limit=1,
        hint=schema.GROUP_HEAD.name,
    )  # fmt: skip
    if not docs:
        return True  # gone meanwhile: the claim reads the group again
    head = docs[0]
    fault = head_fault(head)
    if fault is None:
        raise refusal
    if not schema.head_is_free({**head, "dead": None}, now):
        return False  # another holder's, for now: its lease decides
    await set_aside_head(transport, head, fault, now)
    return True


async def repair_lock(
    transport: _Transport, lock: Mapping[str, Any], now: datetime, *,
    holder: str | None = None, head: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """Repair the lock read as `lock` (fenced on it as read) from what its group's head says
    (`head`, else read now); a lock whose group has no message left is dropped instead. `holder`:
    the caller's lease token, which the lock holds (it keeps it). Returns the lock as repaired;
    None when it was dropped, changed meanwhile or has nothing a repair can fix."""
    faults = [fault for fault in lock_faults(lock) if fault[0] != "_id"]
    if not faults:
        return None
    if head is None:
        docs = await _driver.find_list(
            transport.messages, schema.messages_of(lock["_id"]), sort=schema.SEQ_ORDER,
            limit=1, hint=schema.GROUP_HEAD.name,
        )  # fmt: skip
        head = docs[0] if docs else None
    attempt = _attempt(transport, str(lock["_id"]))
    if head is None and holder is None:
        dropped = await transport.locks.delete_one(schema.lock_as_read(lock))
        if dropped.deleted_count:
            log_set_aside(log, attempt, transport.locks.name, *faults[0], "dropped")
        return None
    repaired: dict[str, Any] | None = await transport.locks.find_one_and_update(
        schema.lock_as_read(lock),
        schema.lock_repairing(lock, head, now, holder=holder is not None),
        return_document=ReturnDocument.AFTER,
    )
    if repaired is not None:
        log_set_aside(log, attempt, transport.locks.name, *faults[0], "repaired")
    return repaired


async def repair_lock_of(
    transport: _Transport, group_id: GroupId, now: datetime, rounds: int = 3
) -> bool:
    """Repair `group_id`'s lock, read again: after the server refused a publish's ready for a
    type mismatch (the message is stored: the repair finds its head), or after a repair whose
    fence a good change beat (a publish, a release: the lock is read with it and repaired
    again, at most `rounds` times). Whether a repair took effect."""
    for _ in range(rounds):
        lock = await transport.locks.find_one(schema.lock_of(group_id))
        if lock is None or all(name == "_id" for name, _ in lock_faults(lock)):
            return False  # gone, or repaired by someone else meanwhile
        if await repair_lock(transport, lock, now) is not None:
            return True
    return False


async def sweep_locks(transport: _Transport, now: datetime) -> int:
    """Repair the locks no claim can see: a priority no claim asks for (`schema.locks_unclaimable`,
    none on a healthy transport) and a due time that is no date (such values sort before
    every date in `schema.CLAIM_ORDER`: the first lock tells whether there are any). Two reads
    on a healthy transport; returns how many locks it repaired (those with nothing left are
    dropped, not counted)."""
    # Not hinted: the sorts are the `CLAIM` index's own order, which no other index gives.
    found = await _driver.find_list(
        transport.locks, schema.locks_unclaimable(), sort=schema.LOCK_REPAIR_ORDER,
        limit=SWEEP_LIMIT,
    )  # fmt: skip
    due = schema.lock_any(PRIORITIES[0])
    first = await _driver.find_list(transport.locks, due, sort=schema.CLAIM_ORDER, limit=1)
    if first and not isinstance(first[0].get("available_at"), datetime):
        found += await _driver.find_list(
            transport.locks, due, sort=schema.CLAIM_ORDER, limit=SWEEP_LIMIT
        )
    repaired = 0
    seen: set[Any] = set()
    for lock in found:
        key = repr(lock["_id"])  # ids of any type, as stored
        if key in seen or not lock_faults(lock):
            continue
        seen.add(key)
        # None: dropped, or a good change came first (then read again and repaired).
        done = await repair_lock(transport, lock, now) is not None
        repaired += done or await repair_lock_of(transport, lock["_id"], now)
    return repaired


# -------------------------------------------------------------------------------- counter


def seq_value(value: Any) -> int | None:
    """The last seq a counter's value says, when it holds a finite number of any type (an int,
    a float, a Decimal128, or text such as ``"7"``; a fraction counts down: the seqs handed
    out are whole); None when it says none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        if isinstance(value, Decimal128):
            number = value.to_decimal()
        elif isinstance(value, float | str):
            number = Decimal(value.strip() if isinstance(value, str) else value)
        else:
            return None
    except (InvalidOperation, ValueError):
        return None
    return int(number.to_integral_value(ROUND_FLOOR)) if number.is_finite() else None


async def repair_counter(transport: _Transport) -> None:
    """After the server refused the sequence allocation for a type mismatch: repair the
    counter when its value survives in another type (``"7"``): to that value, or to the largest
    seq stored (in the messages or the dead letters) when that is larger, fenced on the value
    as read. A value that says no number (``"x"``, null, a document) is reported with
    `UnreadableDocument`: the counter is the only record of the seqs handed out (acked
    messages are gone, and their seqs may be held by whoever published them), so no value
    read from elsewhere is sure never to give a seq twice."""
    counter = await transport.counters.find_one(schema.seq_counter())
    value = None if counter is None else counter.get("value")
    parsed = seq_value(value)
    floor = max([await _largest_seq(transport.messages), await _largest_seq(transport.dead)])
    attempt = _attempt(transport, schema.SEQ_COUNTER)
    found = "nothing" if counter is not None and "value" not in counter else kind_of(value)
    if parsed is None:
        log_set_aside(log, attempt, transport.counters.name, "value", found, "reported")
        raise UnreadableDocument(
            transport.counters.name, schema.SEQ_COUNTER, "value", found,
            f"set it to the last seq handed out: at least {floor}, the largest stored, and "
            "higher if messages with larger seqs were acked (their seqs must never be reused)",
        )  # fmt: skip
    done = await transport.counters.update_one(
        schema.seq_counter_as_read(value), schema.seq_resetting(max(parsed, floor))
    )
    if done.modified_count:
        log_set_aside(log, attempt, transport.counters.name, "value", found, "repaired")


async def _largest_seq(collection: Any) -> int:
    """The largest numeric seq stored in `collection` (its ``_id``), 0 when none is."""
    docs = await _driver.find_list(
        collection, schema.seqs_stored(), sort=schema.LAST_SEQ_ORDER, limit=1,
        projection={"_id": 1},
    )  # fmt: skip
    return int(docs[0]["_id"]) if docs else 0
