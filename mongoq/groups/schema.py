"""The group transport's storage: its four collections' documents, their indexes (`INDEXES`),
and every filter and update `AsyncGroupTransport` sends, as named functions, each beside the
index that serves it. No I/O.

Collections (names start with ``{prefix}_``):

- ``messages``: one document per message, ``{_id: seq, group_id, event, priority,
  published_at, deliveries, token, stamp_until, last_error, dead}``; ``seq`` is a global
  monotonic number, so a group's head is its smallest stored ``_id`` (a concurrent publisher's
  smaller ``seq`` may be stored after a larger one was delivered: publishes that overlap have
  no order). ``token`` / ``stamp_until`` are the lease that holds the head and until when;
  ``deliveries`` counts the deliveries; ``dead`` (``{error, at}``) marks a head on its way to
  the dead letters.
- ``locks``: one document per active group, the ready-index and the lease in one,
  ``{_id: group_id, available_at, token, priority, version, last_seq, parked}``.
  ``available_at`` is when the group is next claimable: the epoch for a group never claimed,
  ``now`` after an ack or an immediate nack (round-robin: behind never-claimed groups and groups
  already waiting), ``now + lease_ttl`` while in flight, ``now + delay`` while parked.
  ``priority`` (0-4) is fixed by the first publish. ``version`` counts the publishes that readied
  the group and ``last_seq`` is the largest seq they readied: together they fence the drop of a
  drained group.
- ``counters``: ``{_id: "seq", value}``, the sequence allocator (``$inc n``).
- ``dead``: dead letters, ``{_id: seq, group_id, event, priority, published_at, deliveries,
  error, dead_at}``.

Queries by ``_id`` (the settles, the sequence allocator, the set-asides' fences) need no
declared index. A document of the wrong shape (written by hand, by another program) is set
aside by `mongoq.groups.quarantine` with the filters and updates under "set aside" below: each
fenced on the document as it was read (``$eq`` on every field it rewrites), so that a good change
made meanwhile is never overwritten, and a stored value that looks like an operator is never
taken for one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

from mongoq import _driver
from mongoq._collections import COUNTERS as COUNTERS
from mongoq._collections import DEAD as DEAD
from mongoq._collections import LOCKS as LOCKS
from mongoq._collections import MESSAGES as MESSAGES
from mongoq._indexes import IndexSpec
from mongoq.clock import stored_instant
from mongoq.groups.models import (
    ALL_PRIORITIES,
    NEVER_CLAIMED,
    GroupId,
    NewMessage,
    count_of,
    lock_faults,
    priority_of,
)

#: ``_id`` of the sequence allocator's document in ``counters``.
SEQ_COUNTER = "seq"
Filter = dict[str, Any]
Update = dict[str, Any]
Sort = list[tuple[str, int]]


# ---------------------------------------------------------------------------------- publish


def seq_counter() -> Filter:
    """The sequence allocator (``find_one_and_update``, upserted); by ``_id``."""
    return {"_id": SEQ_COUNTER}


def seq_reserving(count: int) -> Update:
    """publish's allocation (on `seq_counter`): the counter after it holds the last seq."""
    return {"$inc": {"value": count}}


def message_document(seq: int, message: NewMessage, now: datetime) -> dict[str, Any]:
    """publish / publish_many's insert: a message not yet delivered."""
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


def lock_of(group_id: GroupId) -> Filter:
    """A group's lock, for the ready upsert of publish and `recover_orphans`; by ``_id``."""
    return {"_id": group_id}


def lock_readying(priority: int, last_seq: int) -> Update:
    """publish's and `recover_orphans`' ready upsert (on `lock_of`, by ``_id``)."""
    # Only a new group is readied: an in-flight or parked group's available_at is never pulled
    # back, and the first publish fixes the priority. ``version`` / ``last_seq`` record the
    # publish, so that a concurrent drop of the group (`lock_drained`, `lock_found_empty`) fails.
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


# ------------------------------------------------------------------------------------ claim

#: Serves the claims (hinted) and the ready / waiting counts of `stats`: the ``$in`` over the
#: priorities makes at most five index ranges merged in ``available_at`` order, so a claim's
#: floor never scans lower groups.
CLAIM = IndexSpec("claim", (("priority", 1), ("available_at", 1)))
#: Longest-waiting first: round-robin among the due groups.
CLAIM_ORDER: Sort = [("available_at", 1)]


def lock_due(floor: int, now: datetime, refused: Sequence[GroupId] = ()) -> Filter:
    """Groups due at or above priority `floor`: claim, claim_many, `stats`' ready; `CLAIM`."""
    due: Filter = {
        "priority": {"$in": [p for p in ALL_PRIORITIES if p >= floor]},
        "available_at": {"$lte": now},
    }
    if refused:
        due["_id"] = {"$nin": list(refused)}
    return due


def lock_any(floor: int) -> Filter:
    """Every group at or above priority `floor`, in `CLAIM_ORDER` the one due first whatever
    its state: when ``run(stop_when_drained=True)`` wakes next; and (floor 0) the sweep for due
    times no claim can compare: BSON sorts null, numbers, strings, documents, arrays and bools
    before every date, so such locks come first; `CLAIM`."""
    return {"priority": {"$in": [p for p in ALL_PRIORITIES if p >= floor]}}


def lock_leasing(token: str, lease_until: datetime) -> Update:
    """The claim's lease on a due group (it is no longer due until `lease_until`); `CLAIM`."""
    return {"$set": {"token": token, "available_at": lease_until, "parked": False}}


def lock_head_joined(messages: str) -> list[dict[str, Any]]:
    """claim_many's first read, after `lock_due`: each candidate lock with its head, ``head``
    being ``[]`` (an empty group) or ``[message]``; the ``$lookup`` walks `GROUP_HEAD` (the
    group's equality, then its smallest seq: one index key a lock). `messages`: the
    collection's full name."""
    head = [{"$sort": {"_id": 1}}, {"$limit": 1}]
    return [
        {
            "$lookup": {
                "from": messages, "localField": "_id", "foreignField": "group_id",
                "pipeline": head, "as": "head",
            }
        }
    ]  # fmt: skip


def locks_leased(group_ids: Sequence[GroupId], token: str) -> Filter:
    """claim_many's read-back of the candidates its lease took; by ``_id``."""
    return {"_id": {"$in": list(group_ids)}, "token": token}


def lock_waiting(now: datetime) -> Filter:
    """`stats`: groups not claimable yet (in flight or parked); `CLAIM`."""
    return {"priority": {"$in": list(ALL_PRIORITIES)}, "available_at": {"$gt": now}}


#: Serves `stats`' parked count.
PARKED = IndexSpec("parked", (("parked", 1), ("available_at", 1)))


def lock_parked(now: datetime) -> Filter:
    """`stats`: groups a nack parked that are still waiting; `PARKED`."""
    return {"parked": True, "available_at": {"$gt": now}}


def locks_listed(state: str | None, now: datetime, after: GroupId | None) -> Filter:
    """`list_groups`: the groups in `state` (every group when None) after the group `after`,
    in group id order (`LOCK_LIST_ORDER`); by ``_id``, the state tested on each lock (the
    locks hold only groups with messages). Ids are strings or ints, compared by a server
    only within their own type (numbers first): after an int id, every string id follows."""
    listed: Filter = {}
    if state == "ready":
        listed["available_at"] = {"$lte": now}
    elif state == "parked":
        listed.update(parked=True, available_at={"$gt": now})
    elif state == "in_flight":
        listed.update(parked={"$ne": True}, available_at={"$gt": now})
    if after is None:
        return listed
    later = _driver.ids_after(after)
    return {"$and": [listed, later]} if listed else later


#: `list_groups`' order: by group id, a stable order for its cursor.
LOCK_LIST_ORDER: Sort = [("_id", 1)]


def lock_state(lock: Mapping[str, Any], now: datetime) -> str:
    """`list_groups`: which of `GROUP_STATES` a lock is in (no query)."""
    available = stored_instant(lock.get("available_at")) or NEVER_CLAIMED
    if available <= now:
        return "ready"
    return "parked" if lock.get("parked") else "in_flight"


# ------------------------------------------------------------------------------------ heads

#: Serves a group's head (hinted: the claim's stamp and claim_many's heads) and the "anything
#: left in these groups?" reads of ack / ack_many.
GROUP_HEAD = IndexSpec("group_head", (("group_id", 1), ("_id", 1)))
#: Oldest first: a group's head is its smallest ``seq``; also `stats`' oldest message.
SEQ_ORDER: Sort = [("_id", 1)]


def message_any() -> Filter:
    """Any message (`SEQ_ORDER`, limit 1): is anything left for ``stop_when_drained``; ``_id``."""
    return {}


def messages_of(group_id: GroupId) -> Filter:
    """A group's messages: claim's head (`SEQ_ORDER`), ack's "anything left?"; `GROUP_HEAD`."""
    return {"group_id": group_id}


def messages_of_groups(group_ids: Collection[GroupId]) -> Filter:
    """ack_many's "which of these groups have messages left?" (``distinct``); `GROUP_HEAD`."""
    return {"group_id": {"$in": list(group_ids)}}


def head_stamping(token: str, now: datetime, lease_until: datetime) -> list[Update]:
    """claim's stamp on the head `messages_of` finds (a pipeline update); `GROUP_HEAD`."""
    # Only a head no live lease holds takes `token` and counts the delivery: a claimer that
    # stalled past its lock lease cannot take the head from the group's new holder (it reads
    # back the other token).
    free = {
        "$or": [
            {"$eq": [{"$ifNull": ["$token", None]}, None]},
            {"$lte": [{"$ifNull": ["$stamp_until", NEVER_CLAIMED]}, now]},
        ]
    }
    return [
        {
            "$set": {
                "token": {"$cond": [free, {"$literal": token}, "$token"]},
                "stamp_until": {"$cond": [free, lease_until, "$stamp_until"]},
                "deliveries": {
                    "$cond": [free, {"$add": [{"$ifNull": ["$deliveries", 0]}, 1]}, "$deliveries"]
                },
            }
        }
    ]


def heads_of(group_ids: Collection[GroupId]) -> list[dict[str, Any]]:
    """claim_many's heads, a row ``{_id: group_id, head}`` per group; `GROUP_HEAD`."""
    # Hinted, the $sort + $group $first is a DISTINCT_SCAN: one key per group, not its backlog.
    return [
        {"$match": {"group_id": {"$in": list(group_ids)}}},
        {"$sort": {"group_id": 1, "_id": 1}},
        {"$group": {"_id": "$group_id", "head": {"$first": "$$ROOT"}}},
    ]


def head_summaries_of(group_ids: Collection[GroupId]) -> list[dict[str, Any]]:
    """`list_groups`' heads: a row ``{_id: group_id, seq, published_at, deliveries,
    last_error}`` per group, without the events; `GROUP_HEAD` (hinted: a DISTINCT_SCAN)."""
    return [
        {"$match": {"group_id": {"$in": list(group_ids)}}},
        {"$sort": {"group_id": 1, "_id": 1}},
        {
            "$group": {
                "_id": "$group_id",
                "seq": {"$first": "$_id"},
                "published_at": {"$first": "$published_at"},
                "deliveries": {"$first": "$deliveries"},
                "last_error": {"$first": "$last_error"},
            }
        },
    ]


def head_is_free(head: Mapping[str, Any], now: datetime) -> bool:
    """claim_many: whether `heads_free` would take `head` as read (no query)."""
    return head.get("dead") is None and (
        head.get("token") is None
        or (stored_instant(head.get("stamp_until")) or NEVER_CLAIMED) <= now
    )


def heads_free(heads: Sequence[Mapping[str, Any]], now: datetime) -> Filter:
    """claim_many's stamp of the heads it read, `head_stamping`'s fence; by ``_id``."""
    # Each head exactly as read (its token and delivery count): the read comes before the
    # lease, and a head un-stamped, nacked or restamped since would be counted wrong. With
    # ``$eq``: a stored value is compared, never taken for an operator; a delivery count that
    # is missing matches as null (both count as 0, as in `head_stamping`).
    as_read = [
        {"_id": h["_id"], "token": {"$eq": h.get("token")},
         "deliveries": {"$eq": h.get("deliveries")}}
        for h in heads
    ]  # fmt: skip
    # A stamp's end that is no date counts as passed, as `head_is_free` and `head_stamping`
    # (which compares across types: such values sort before dates) have it.
    ended = {"stamp_until": {"$not": {"$gt": now}}}
    return {
        "_id": {"$in": [h["_id"] for h in heads]},
        "dead": None,
        "$and": [{"$or": as_read}, {"$or": [{"token": None}, ended]}],
    }


def heads_stamping(token: str, lease_until: datetime) -> list[Update]:
    """claim_many's stamp (on `heads_free`, by ``_id``, a pipeline update): token, its end, one
    more delivery, counted as `head_stamping` counts it (no count yet is 0; a count that is no
    number makes the server refuse the update: the head is then set aside)."""
    return [
        {
            "$set": {
                "token": {"$literal": token},
                "stamp_until": lease_until,
                "deliveries": {"$add": [{"$ifNull": ["$deliveries", 0]}, 1]},
            }
        }
    ]


def heads_stamped(seqs: Sequence[int], token: str) -> Filter:
    """claim_many, when its stamp raced: which of `seqs` carry its token; by ``_id``."""
    return {"_id": {"$in": list(seqs)}, "token": token}


# ---------------------------------------------------------------------------------- settles
# By ``_id``: each fenced on the lease's token (a holder that lost the group changes nothing).


def message_held(seq: int, token: str) -> Filter:
    """A head still stamped by the lease: ack's delete, nack/extend/unclaim; by ``_id``."""
    return {"_id": seq, "token": token}


def messages_held(pairs: Sequence[tuple[int, str]]) -> Filter:
    """Heads ``(seq, token)`` still stamped by their leases: ack_many, extend_many; ``_id``."""
    return _driver.owned_by(pairs)


def message_ackable(seq: int, token: str) -> Filter:
    """ack's delete: a head still stamped by the lease and not on its way to the dead letters
    (a dead-lettering of the same lease that stopped after its mark decided its fate); ``_id``."""
    return {**message_held(seq, token), "dead": None}


def messages_ackable(pairs: Sequence[tuple[int, str]]) -> Filter:
    """ack_many's delete: `message_ackable` for each ``(seq, token)``; by ``_id``."""
    return {**messages_held(pairs), "dead": None}


def messages_by_seq(seqs: Sequence[int]) -> Filter:
    """ack_many, when its delete raced: which of these heads are still there; by ``_id``."""
    return {"_id": {"$in": list(seqs)}}


def lock_held(group_id: GroupId, token: str) -> Filter:
    """A group still leased under `token`: release, nack's park, extend; by ``_id``."""
    return {"_id": group_id, "token": token}


def locks_held(pairs: Sequence[tuple[GroupId, str]]) -> Filter:
    """Groups ``(group_id, token)`` still leased: ack_many's release, extend_many; ``_id``."""
    return _driver.owned_by(pairs)


def lock_releasing(now: datetime) -> Update:
    """release (on `lock_held` / `locks_held`): claimable now, behind those waiting."""
    return {"$set": {"available_at": now, "token": None, "parked": False}}


def lock_parking(until: datetime) -> Update:
    """nack with a delay (on `lock_held`): the group waits, its holder keeps the token."""
    return {"$set": {"available_at": until, "parked": True}}


def lock_extending(until: datetime) -> Update:
    """extend / extend_many (on `lock_held` / `locks_held`): leased until `until`, never less
    (two renewals of one holder in flight may apply in either order)."""
    return {"$max": {"available_at": until}, "$set": {"parked": False}}


def lock_drained(group_id: GroupId, token: str, version: int | None, last_seq: int) -> Filter:
    """ack / ack_many's drop of a group whose last message was acked; by ``_id``."""
    # Fails if the lease was lost or anything was published since the claim (``version``,
    # ``last_seq``): the drop then strands no message.
    return {"_id": group_id, "token": token, "version": version, "last_seq": last_seq}


def lock_found_empty(group_id: GroupId, token: str, seen: Mapping[str, Any]) -> Filter:
    """A claim's drop of a group it found empty, `seen` being the lock as read before (or
    with) the head (the drop-if-empty fence); by ``_id``."""
    # Fails if a publish counted itself (``version``) since that read. The last seq too, for
    # claim_many, which reads the lock before its lease: a lock dropped and made again
    # meanwhile starts its version over, not its last seq. ``$eq``: the values come from the
    # database, and a stored document must never act as an operator.
    return {
        "_id": group_id,
        "token": token,
        "version": {"$eq": seen.get("version")},
        "last_seq": {"$eq": seen.get("last_seq")},
    }


def head_nacking(parked_until: datetime | None, error: str | None) -> Update:
    """nack's head (on `message_held`): stamp kept while parked, else cleared; the error."""
    # The error is kept on the message: a dead letter carries the last one.
    head: dict[str, Any] = (
        {"stamp_until": parked_until}
        if parked_until is not None
        else {"token": None, "stamp_until": None}
    )
    if error is not None:
        head["last_error"] = error
    return {"$set": head}


def head_extending(until: datetime) -> Update:
    """extend / extend_many (on `message_held` / `messages_held`): the stamp's new end, never
    earlier than it was."""
    return {"$max": {"stamp_until": until}}


def head_unstamping() -> Update:
    """unclaim (on `message_held`): stamp cleared, the delivery it counted taken back."""
    return {"$set": {"token": None, "stamp_until": None}, "$inc": {"deliveries": -1}}


# ----------------------------------------------------------------------------- dead letters


def burial_error(head: Mapping[str, Any], max_deliveries: int) -> str:
    """The error a head buried after `max_deliveries` carries: its last one (no query)."""
    last = head.get("last_error")
    return (
        last if isinstance(last, str) and last else f"not acked after {max_deliveries} deliveries"
    )


def head_buriable(seq: int, token: str) -> Filter:
    """A burial's mark, on a head this token holds and not marked yet; by ``_id``."""
    return {"_id": seq, "token": token, "dead": None}


def head_marking_dead(error: str, now: datetime) -> Update:
    """A burial's mark (on `head_buriable`): its commit point; whoever finds it finishes it."""
    return {"$set": {"dead": {"error": error, "at": now}}}


def dead_letter_of(seq: int) -> Filter:
    """A burial's copy to the dead letters (a ``replace_one`` upsert: idempotent); by ``_id``."""
    return {"_id": seq}


def dead_letter_document(
    head: Mapping[str, Any], error: str | None, dead_at: Any
) -> dict[str, Any]:
    """A burial's copy (replacing `dead_letter_of`): the dead letter of a marked head, with its
    mark's `error` and time. A priority or a delivery count that is no number is copied as 0,
    a publish time that is no date as null: a dead letter always reads back (`DeadLetter`)."""
    published = head.get("published_at")
    return {
        "group_id": head["group_id"],
        "event": head.get("event"),
        "priority": priority_of(head.get("priority")) or 0,
        "published_at": published if isinstance(published, datetime) else None,
        "deliveries": count_of(head.get("deliveries")) or 0,
        "error": error,
        "dead_at": dead_at,
    }


def head_marked_dead(seq: int) -> Filter:
    """A burial's delete of the head, once copied; claim_many's re-read of a marked head it
    read before its lease, before finishing the burial; by ``_id``."""
    return {"_id": seq, "dead": {"$ne": None}}


#: Serves the dead letters of a group, oldest first.
DEAD_GROUP = IndexSpec("group", (("group_id", 1), ("_id", 1)))


def dead_letters_selected(seqs: Sequence[int] | None, group_id: GroupId | None) -> Filter:
    """dead_letters / redrive's selection, redrive's delete; ``_id`` or `DEAD_GROUP`."""
    # Sorted by `SEQ_ORDER`: by ``_id`` when `seqs` are given, else one group's (`DEAD_GROUP`)
    # or all in the ``_id`` order.
    query: Filter = {}
    if seqs is not None:
        query["_id"] = {"$in": list(seqs)}
    if group_id is not None:
        query["group_id"] = group_id
    return query


# ---------------------------------------------------------------------------------- orphans

#: Serves `recover_orphans`' sliding window.
PUBLISHED = IndexSpec("published", (("published_at", 1),))


def orphan_groups(before: datetime, since: datetime | None, locks: str) -> list[dict[str, Any]]:
    """`recover_orphans`' aggregation: `PUBLISHED`, then the locks' ``_id`` ($lookup)."""
    # The groups of the messages published in ``[since, before)`` that have no lock, with their
    # first priority and last seq.
    window: dict[str, Any] = {"$lt": before}
    if since is not None:
        window["$gte"] = since
    return [
        {"$match": {"published_at": window}},
        {"$sort": {"_id": 1}},
        {
            "$group": {
                "_id": "$group_id",
                "priority": {"$first": "$priority"},
                "last_seq": {"$last": "$_id"},
            }
        },
        {"$lookup": {"from": locks, "localField": "_id", "foreignField": "_id", "as": "lock"}},
        {"$match": {"lock": {"$size": 0}}},
    ]


def orphan_readying(orphan: Mapping[str, Any]) -> Update:
    """`recover_orphans`' upsert (on `lock_of`): `lock_readying` for a row of `orphan_groups`
    (a priority that is no claim's readies at 0; a last seq that is no int counts as 0: the
    drop of the group then waits for a claim that finds it empty)."""
    last = orphan.get("last_seq")
    last_seq = last if isinstance(last, int) and not isinstance(last, bool) else 0
    return lock_readying(priority_of(orphan.get("priority")) or 0, last_seq)


# ------------------------------------------------------------------------------------ stats
# Besides `lock_due` (ready), `lock_waiting` and `lock_parked`; the totals come from metadata.


def messages_all() -> Filter:
    """`stats`' oldest message: every message, sorted by `SEQ_ORDER` (the ``_id`` index)."""
    return {}


# -------------------------------------------------------------------------------- set aside
# What `mongoq.groups.quarantine` sends for a document no claim, settle or publish can use.

#: The sweep's order for `locks_unclaimable`: the `CLAIM` index's own.
LOCK_REPAIR_ORDER: Sort = list(CLAIM.keys)


def locks_unclaimable() -> Filter:
    """Locks whose priority no claim asks for (a string, null, missing, out of range, a
    fraction): `recover_orphans`' sweep, sorted by `LOCK_REPAIR_ORDER`; `CLAIM`, whose ranges
    outside the claims' five points it walks (none on a healthy transport)."""
    return {"priority": {"$nin": list(ALL_PRIORITIES)}}


def _as_read(doc: Mapping[str, Any], fields: Sequence[str]) -> Filter:
    """A fence on `doc` as read: its ``_id``, and each of `fields` equal to what was read (or
    still missing); ``$eq`` so that a stored value never acts as an operator."""
    fence: Filter = {"_id": {"$eq": doc["_id"]}}
    for name in fields:
        fence[name] = {"$eq": doc[name]} if name in doc else {"$exists": False}
    return fence


#: The fields of a lock a repair reads and may rewrite.
_LOCK_STATE = ("priority", "available_at", "token", "version", "last_seq", "parked")


def lock_as_read(lock: Mapping[str, Any]) -> Filter:
    """A lock's repair or drop, fenced on the lock as read (a publish, a claim or a settle
    since then changed one of its fields: the lock is left to them); by ``_id``."""
    return _as_read(lock, _LOCK_STATE)


def lock_repairing(
    lock: Mapping[str, Any], head: Mapping[str, Any] | None, now: datetime, *, holder: bool
) -> Update:
    """A repair of `lock` (on `lock_as_read`) from what its head `head` says: a priority no
    claim asks for becomes the head's (else 0); a due time that is no date becomes now, or the
    end of the head's live stamp (its holder is not taken over); fences of the wrong type are
    reset and, unless the caller is the lease `holder` that read them, the token cleared with
    them: a lease taken before the damage carries fences nothing can check any more (its
    head's stamp keeps the head its own until it ends). A group id cannot be repaired."""
    head = head or {}
    fixes: dict[str, Any] = {}
    for name, _ in lock_faults(lock):
        if name == "priority":
            fixes["priority"] = priority_of(head.get("priority")) or 0
        elif name == "available_at":
            fixes.update(available_at=_stamp_end(head, now), parked=False)
        elif name == "version":
            fixes["version"] = 0
        elif name == "last_seq":
            # The head's seq, or 0: never above the group's last, so the drop of a group whose
            # last message is acked still reads what is left first (`ack`).
            seq = head.get("_id")
            fixes["last_seq"] = seq if isinstance(seq, int) and not isinstance(seq, bool) else 0
        elif name in ("token", "parked"):
            fixes[name] = None if name == "token" else False
    if not holder and ("version" in fixes or "last_seq" in fixes):
        fixes["token"] = None
    return {"$set": fixes}


def _stamp_end(head: Mapping[str, Any], now: datetime) -> datetime:
    """When a group whose due time was lost is claimable: now, or when its head's live stamp
    ends."""
    until = stored_instant(head.get("stamp_until"))
    held = isinstance(head.get("token"), str)
    return until if held and until is not None and until > now else now


#: The fields of a message a set-aside reads: the ones a claim's stamp depends on.
_HEAD_STATE = ("token", "stamp_until", "deliveries", "dead")


def head_as_read(head: Mapping[str, Any]) -> Filter:
    """A set-aside's mark of a head the caller does not hold (its stamp was refused), fenced on
    the head as read (restamped, nacked or marked since: left alone); by ``_id``."""
    return _as_read(head, _HEAD_STATE)


def set_aside_error(what: str, fault: tuple[str, str]) -> str:
    """The error a set-aside document's dead letter carries: ``unreadable group message: field
    'deliveries' holds a string ('x'); set aside``."""
    return f"unreadable group {what}: field {fault[0]!r} holds {fault[1]}; set aside"


#: The largest seq of a collection first: its numeric ``_id`` s, by ``_id``.
LAST_SEQ_ORDER: Sort = [("_id", -1)]


def seqs_stored() -> Filter:
    """Messages or dead letters with a numeric seq (`LAST_SEQ_ORDER`, limit 1: the largest a
    counter repair must stay above); by ``_id``."""
    return {"_id": {"$type": "number"}}


def seq_counter_as_read(value: Any) -> Filter:
    """A counter repair, fenced on the value as read (another repair won: left alone); ``_id``."""
    return {"_id": SEQ_COUNTER, "value": {"$eq": value}}


def seq_resetting(value: int) -> Update:
    """A counter repair (on `seq_counter_as_read`): the last seq handed out, as a number."""
    return {"$set": {"value": value}}


#: Every declared index, in the order `AsyncGroupTransport.setup` creates them.
#: Per collection (the name after ``{prefix}_``), in creation order.
INDEXES: dict[str, tuple[IndexSpec, ...]] = {
    LOCKS: (CLAIM, PARKED),
    MESSAGES: (GROUP_HEAD, PUBLISHED),
    DEAD: (DEAD_GROUP,),
}
