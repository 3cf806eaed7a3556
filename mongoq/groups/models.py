"""The group transport's public dataclasses and constants, how each is read from its stored
documents, and the checks of what a caller hands in: what `AsyncGroupTransport` takes and gives
back. No I/O; the documents are in `mongoq.groups.schema`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
        """What `redrive` publishes again for a stored dead letter."""
        return cls(doc["group_id"], doc.get("event"), int(doc["priority"]))


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
        worker and end, and the head's delivery count."""
        return cls(
            seq=head["_id"],
            group_id=lock["_id"],
            event=head.get("event"),
            token=token,
            worker_id=worker,
            deliveries=deliveries,
            priority=int(lock["priority"]),
            lease_until=lease_until,
            group_version=lock.get("version"),
            was_last=head["_id"] == lock.get("last_seq"),
        )


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

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> DeadLetter:
        """A stored dead letter."""
        return cls(
            seq=doc["_id"],
            group_id=doc["group_id"],
            event=doc.get("event"),
            priority=int(doc["priority"]),
            deliveries=int(doc["deliveries"]),
            error=doc.get("error"),
            published_at=stored_instant(doc.get("published_at")),
            dead_at=stored_instant(doc.get("dead_at")),
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


def check_lease(lease: GroupLease) -> None:
    if not isinstance(lease, GroupLease):
        raise InvalidInput("lease", "must be a GroupLease returned by claim()")
