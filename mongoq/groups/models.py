"""The group transport's public dataclasses and constants, how each is read from its stored
documents, and the checks of what a caller hands in: what `AsyncGroupTransport` takes and gives
back; and what makes a stored document unusable (`message_fault`, `lock_fault`,
`dead_letter_fault`). No I/O; the documents are in `mongoq.groups.schema`."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from mongoq._validation import check_id, check_int, check_payload
from mongoq.clock import stored_instant
from mongoq.errors import InvalidInput

GroupId = str | int
#: `available_at` of a group nobody has claimed yet: sorts before every real instant.
NEVER_CLAIMED = datetime(1970, 1, 1, tzinfo=UTC)
#: The lowest and the highest priority.
PRIORITIES = (0, 4)
ALL_PRIORITIES = range(PRIORITIES[0], PRIORITIES[1] + 1)


@dataclass(frozen=True)
class NewMessage:
    """One message for `AsyncGroupTransport.publish_many`."""

    group_id: GroupId
    event: Any
    priority: int = 0

    @classmethod
    def from_dead_letter(cls, doc: Mapping[str, Any]) -> NewMessage:
        """What `redrive` publishes again for a stored dead letter (priority 0 when its own
        cannot be read: a dead letter edited by hand)."""
        return cls(doc["group_id"], doc.get("event"), priority_of(doc.get("priority")) or 0)


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

    @classmethod
    def from_documents(
        cls, lock: Mapping[str, Any], head: Mapping[str, Any], token: str, worker: str,
        lease_until: datetime, deliveries: int,
    ) -> GroupLease:  # fmt: skip
        """The lease of a claim: the lock it leased, the head it stamped, the lease's token,
        worker and end, and the head's delivery count. Raises one of `READ_ERRORS` when a
        document holds a field no lease may carry (`lock_fault`, `head_fault` say which):
        every lease a claim returns passes `check_lease`."""
        priority = priority_of(lock.get("priority"))
        if priority is None:  # a bool or a fraction some backend's $in let through
            raise TypeError("the lock's priority is no claim's")
        lease = cls(
            seq=head["_id"],
            group_id=lock["_id"],
            event=head.get("event"),
            token=token,
            worker_id=worker,
            deliveries=deliveries,
            priority=priority,
            lease_until=lease_until,
            group_version=lock.get("version"),
            was_last=head["_id"] == lock.get("last_seq"),
        )
        if lease_fault(lease) is not None:
            raise TypeError("a stored document holds a field of the wrong type")
        return lease


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
    #: Why the stored dead letter cannot be read as one (a field of the wrong type, edited by
    #: hand), e.g. ``"field 'priority' holds a string ('x')"``; None for every one mongoq wrote.
    #: The fields it names read as 0 or None.
    unreadable: str | None = None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> DeadLetter:
        """A stored dead letter, whatever it holds (never an exception: one bad document never
        breaks a listing)."""
        fault = dead_letter_fault(doc)
        error = doc.get("error")
        return cls(
            seq=doc.get("_id"),  # type: ignore[arg-type]  # as stored: `unreadable` says so
            group_id=doc.get("group_id"),  # type: ignore[arg-type]
            event=doc.get("event"),
            priority=priority_of(doc.get("priority")) or 0,
            deliveries=count_of(doc.get("deliveries")) or 0,
            error=error if isinstance(error, str) else None,
            published_at=stored_instant(doc.get("published_at")),
            dead_at=stored_instant(doc.get("dead_at")),
            unreadable=None if fault is None else describe_fault(fault),
        )


#: The states `list_groups` tells apart: claimable now, held by a live lease, waiting out a
#: nack's delay.
GROUP_STATES = ("ready", "in_flight", "parked")


@dataclass(frozen=True)
class GroupInfo:
    """A group as `list_groups` shows it: its state, when it is next claimable, and its head
    (the message its consumer is on or will take next: seq, when it was published, how long
    ago in seconds, deliveries so far, last error). The head fields are None for a group whose
    messages are all gone (its lock is dropped at the next claim)."""

    group_id: GroupId
    state: str
    priority: int
    available_at: datetime | None
    head_seq: int | None
    head_published_at: datetime | None
    head_age: float | None
    head_deliveries: int | None
    head_error: str | None
    #: Why the group's lock or its head cannot be used as stored (a field of the wrong type,
    #: written by hand or by another program), e.g. ``"lock: field 'priority' holds a string
    #: ('x')"`` or ``"head 12: field 'deliveries' holds ..."``; None for every group mongoq
    #: wrote. Workers set such a document aside when they meet it: a lock is repaired, a head
    #: dead-lettered. The fields it names read as 0 or None here.
    unreadable: str | None = None


@dataclass(frozen=True)
class GroupPage:
    """One page of `list_groups`, and the cursor that continues after it (None on the last)."""

    groups: list[GroupInfo]
    next: str | None


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
    """What a `run` loop did: one count per claimed head, by how its lease ended."""

    #: heads claimed (each is counted once more below)
    claimed: int = 0
    #: handled and acked: the message is gone and the group moves to its next one
    acked: int = 0
    #: nacked (the handler raised or was cut short): the head stays and is delivered again
    #: after the retry delay; past `max_deliveries`, the claim that would deliver it again
    #: moves it to the dead letters instead
    retried: int = 0
    #: moved to the dead letters at once: the handler raised `PermanentError`
    dead: int = 0
    #: leases given back unused (a stopped batch), their delivery not counted
    released: int = 0
    #: settles refused because another consumer took the group over meanwhile
    lost: int = 0
    #: settles that raised a driver error: applied or not, the lease expiry recovers the group
    unknown: int = 0


def new_lease_token(worker: str) -> str:
    """A claim's lease token: ``<worker>:<uuid4 hex>``, unique per claim, naming its worker."""
    return f"{worker}:{uuid.uuid4().hex}"


def check_priority(name: str, priority: int) -> int:
    return check_int(name, priority, low=PRIORITIES[0], high=PRIORITIES[1])


def checked_message(message: NewMessage, prefix: str = "") -> NewMessage:
    """`message` with its group id as checked (the fields named after `prefix` in errors)."""
    group_id = check_id(f"{prefix}group_id", message.group_id)
    check_payload(f"{prefix}event", message.event)
    check_priority(f"{prefix}priority", message.priority)
    return NewMessage(group_id, message.event, message.priority)


def checked_messages(messages: Iterable[NewMessage]) -> list[NewMessage]:
    """The messages of a `publish_many`, each checked (errors name ``messages[i]``)."""
    checked: list[NewMessage] = []
    for index, message in enumerate(messages):
        if not isinstance(message, NewMessage):
            raise InvalidInput(
                f"messages[{index}]", f"must be a NewMessage, got {type(message).__name__}"
            )
        checked.append(checked_message(message, f"messages[{index}]."))
    return checked


def check_lease(lease: GroupLease, name: str = "lease") -> None:
    """`lease` is a `GroupLease` whose every field has the type a claim gives it: a lease built
    by hand with an operator for its token, seq or group id (``{"$ne": None}``) would settle
    whatever the filter then matches. `InvalidInput` names the field (``lease.token``)."""
    if not isinstance(lease, GroupLease):
        raise InvalidInput(name, "must be a GroupLease returned by claim()")
    fault = lease_fault(lease)
    if fault is not None:
        field_name, wanted = fault
        found = type(getattr(lease, field_name)).__name__
        raise InvalidInput(f"{name}.{field_name}", f"must be {wanted}, got {found}")


# ------------------------------------------------------------------------ unusable documents

#: What reading a stored document as a lease or a listing row raises for a field of the wrong
#: type (`head_fault`, `lock_fault` then say which).
READ_ERRORS = (KeyError, TypeError, ValueError, OverflowError, AttributeError)

#: A fault: the field and what it holds, e.g. ``("deliveries", "a string ('x')")``.
Fault = tuple[str, str]


def kind_of(value: Any) -> str:
    """`value` as an error text names it: its type, and a short sample."""
    if value is None:
        return "null"
    names = {str: "a string", bool: "a bool", dict: "a document", list: "an array",
             float: "a float", int: "an int", datetime: "a date"}  # fmt: skip
    name = next((n for kind, n in names.items() if isinstance(value, kind)), type(value).__name__)
    return f"{name} ({value!r:.40})"


def describe_fault(fault: Fault) -> str:
    """The text of a fault: ``field 'deliveries' holds a string ('x')``."""
    return f"field {fault[0]!r} holds {fault[1]}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def priority_of(value: Any) -> int | None:
    """A stored priority a claim asks for (an integral number from 0 to 4), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if value in ALL_PRIORITIES else None


def count_of(value: Any) -> int | None:
    """A stored delivery count (a finite number; a fraction counts down), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if math.isfinite(value) else None


def _check_fields(
    doc: Mapping[str, Any], checks: Mapping[str, Callable[[Any], bool]], optional: frozenset[str]
) -> Fault | None:
    """The first field of `checks` (name -> predicate) that `doc` holds with a value the
    predicate refuses, or lacks while it is not `optional`."""
    for name, valid in checks.items():
        if name not in doc:
            if name not in optional:
                return name, "nothing"
        elif not valid(doc[name]):
            return name, kind_of(doc[name])
    return None


def _is_group_id(value: Any) -> bool:
    return isinstance(value, str) or _is_int(value)


def _is_text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _is_mark(value: Any) -> bool:
    return value is None or (isinstance(value, Mapping) and _is_text(value.get("error")))


def _is_instant(value: Any) -> bool:
    return value is None or isinstance(value, datetime)


def _is_count(value: Any) -> bool:
    return value is None or count_of(value) is not None


# The order is the order of blame: the fields a claim's commands or its lease need come first.
_MESSAGE_FIELDS: dict[str, Callable[[Any], bool]] = {
    "_id": _is_int, "group_id": _is_group_id, "deliveries": _is_count, "dead": _is_mark,
    "token": _is_text, "stamp_until": _is_instant, "last_error": _is_text,
    "priority": lambda value: priority_of(value) is not None, "published_at": _is_instant,
}  # fmt: skip
_MESSAGE_OPTIONAL = frozenset(_MESSAGE_FIELDS) - {"_id", "group_id"}
_LOCK_FIELDS: dict[str, Callable[[Any], bool]] = {
    "_id": _is_group_id, "priority": lambda value: priority_of(value) is not None,
    "available_at": lambda value: isinstance(value, datetime), "token": _is_text,
    "version": lambda value: value is None or _is_int(value),
    "last_seq": lambda value: value is None or _is_int(value),
    "parked": lambda value: value is None or isinstance(value, bool),
}  # fmt: skip
_LOCK_OPTIONAL = frozenset({"token", "version", "last_seq", "parked"})
_DEAD_FIELDS: dict[str, Callable[[Any], bool]] = {
    "_id": lambda value: _is_int(value) or isinstance(value, str), "group_id": _is_group_id,
    "priority": lambda value: priority_of(value) is not None, "deliveries": _is_count,
    "error": _is_text, "published_at": _is_instant, "dead_at": _is_instant,
}  # fmt: skip
_DEAD_OPTIONAL = frozenset(_DEAD_FIELDS) - {"_id", "group_id"}


def message_fault(doc: Mapping[str, Any]) -> Fault | None:
    """The first field of a stored message that makes it unusable, and what it holds; None when
    every field has a type mongoq writes (a missing delivery count, or null, reads as 0).
    Checked only after a read or a write failed, and for listings: never on the path of a good
    message."""
    return _check_fields(doc, _MESSAGE_FIELDS, _MESSAGE_OPTIONAL)


#: The fields of a message a claim's stamp and its lease need: what `head_fault` checks.
_HEAD_FIELDS = {name: _MESSAGE_FIELDS[name] for name in ("_id", "deliveries")}


def head_fault(doc: Mapping[str, Any]) -> Fault | None:
    """`message_fault` of the fields a claim needs (the seq, the delivery count): what makes the
    server refuse a stamp, or a lease impossible to build. A message whose other fields are
    wrong is still delivered (its dead letter, should it come to one, reads them as 0/None)."""
    return _check_fields(doc, _HEAD_FIELDS, _MESSAGE_OPTIONAL)


def lock_fault(doc: Mapping[str, Any]) -> Fault | None:
    """The first field of a stored lock that no claim can use, and what it holds: a priority no
    claim asks for, a due time that is no date, fences (``version``, ``last_seq``) or a token
    of the wrong type; None for a lock mongoq wrote."""
    return _check_fields(doc, _LOCK_FIELDS, _LOCK_OPTIONAL)


def lock_faults(doc: Mapping[str, Any]) -> list[Fault]:
    """Every field `lock_fault` would name, in its order: what a repair rewrites."""
    return [
        (name, "nothing" if name not in doc else kind_of(doc[name]))
        for name, valid in _LOCK_FIELDS.items()
        if (name not in doc and name not in _LOCK_OPTIONAL)
        or (name in doc and not valid(doc[name]))
    ]


def dead_letter_fault(doc: Mapping[str, Any]) -> Fault | None:
    """The first field of a stored dead letter that cannot be read as one, and what it holds."""
    return _check_fields(doc, _DEAD_FIELDS, _DEAD_OPTIONAL)


#: What each field of a lease must be (`lease_fault`): the type a claim gives it.
_LEASE_FIELDS: dict[str, tuple[Any, str]] = {
    "seq": (_is_int, "an int"),
    "group_id": (_is_group_id, "a string or an int"),
    "token": (lambda value: isinstance(value, str) and bool(value), "a non-empty string"),
    "worker_id": (lambda value: isinstance(value, str), "a string"),
    "deliveries": (_is_int, "an int"),
    "priority": (_is_int, "an int"),
    "lease_until": (lambda value: isinstance(value, datetime), "a datetime"),
    "group_version": (lambda value: value is None or _is_int(value), "an int or None"),
    "was_last": (lambda value: isinstance(value, bool), "a bool"),
}


def lease_fault(lease: GroupLease) -> tuple[str, str] | None:
    """The first field of `lease` whose type no claim gives it, and what it must be."""
    # Every settle checks its lease: the types a claim gives, tested at once first.
    version, group = lease.group_version, type(lease.group_id)
    if (
        type(lease.seq) is int and (group is str or group is int) and type(lease.token) is str
        and lease.token and type(lease.worker_id) is str and type(lease.deliveries) is int
        and type(lease.priority) is int and type(lease.was_last) is bool
        and (version is None or type(version) is int) and isinstance(lease.lease_until, datetime)
    ):  # fmt: skip
        return None
    for name, (valid, wanted) in _LEASE_FIELDS.items():
        if not valid(getattr(lease, name)):
            return name, wanted
    return None
