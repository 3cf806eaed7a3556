"""The outbox's values: events as the publisher writes them, deliveries as a claim hands them
out (read from their documents, with the claim's token: its format and parse), the entries a
lane lists (`Entry`), and the result types of the operator calls; plus the two pure functions
the storage layout rests on, `lane_of` (which of the 256 lanes a key lives in) and `normalize`
(the JSON form in which payloads and headers are stored); `check_handler` validates handler
names. Owns no collections (their layout: `mongoq.outbox.schema`).
"""

from __future__ import annotations

import enum
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import bson

from mongoq._validation import (
    MAX_PAYLOAD_BYTES,
    check_field_name,
    check_instant,
    check_nesting,
    check_payload,
)
from mongoq.clock import stored_instant
from mongoq.errors import InvalidInput
from mongoq.outbox.faults import describe, entry_fault, info_fault, whole

#: How many lanes the deliveries are spread over; a worker leases lanes, not deliveries.
LANES = 256
_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def lane_of(text: str) -> int:
    """The lane of an ordering key (or of the event id of an unkeyed event): the 32-bit FNV-1a
    hash of its UTF-8 bytes, modulo 256. Every delivery of a key shares its lane."""
    value = _FNV_OFFSET
    for byte in text.encode("utf-8"):
        value = ((value ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return value % LANES


def normalize(field_name: str, value: Any) -> Any:
    """`value` as JSON would carry it: mappings with string keys, lists, strings, finite
    numbers, booleans and None. Datetimes and dates become ISO-8601 strings, UUIDs and Decimals
    strings, enums their value, tuples lists. Anything else, a non-string key, a key starting
    with ``$`` or containing ``.`` (refused, not escaped: the server gives them meaning in
    queries and updates), and NaN or infinity are `InvalidInput` naming the field."""
    if isinstance(value, enum.Enum):  # first: IntEnum and StrEnum members are ints and strs
        return normalize(field_name, value.value)
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(field_name, "must be a finite number (JSON has no NaN or infinity)")
        return value
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, uuid.UUID | Decimal):
        return str(value)
    if isinstance(value, Mapping):
        normalized: dict[str, Any] = {}
        for key, item in value.items():
            check_field_name(field_name, key)
            normalized[key] = normalize(f"{field_name}.{key}", item)
        return normalized
    if isinstance(value, list | tuple):
        return [normalize(f"{field_name}[{index}]", item) for index, item in enumerate(value)]
    raise InvalidInput(field_name, f"is not JSON-like: {type(value).__name__}")


#: The subscription key of handlers that receive every event type.
SUBSCRIBE_ALL = "*"


def subscribed_handlers(
    subscriptions: Mapping[str, tuple[str, ...]], event_type: str
) -> tuple[str, ...]:
    """The handlers subscribed to `event_type` (its own, then the ``"*"`` ones)."""
    names = subscriptions.get(event_type, ()) + subscriptions.get(SUBSCRIBE_ALL, ())
    return tuple(dict.fromkeys(names))


def check_handler(field_name: str, value: Any) -> str:
    """`value` if it can name a handler (or a subscribed event type): a non-empty string of at
    most 256 characters without NUL; `InvalidInput` naming the field otherwise."""
    if not isinstance(value, str) or not value or len(value) > 256 or "\x00" in value:
        raise InvalidInput(field_name, "must be a non-empty string of at most 256 characters")
    return value


def _optional_text(field_name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 1024 or "\x00" in value:
        raise InvalidInput(field_name, "must be None or a non-empty string of at most 1024 chars")
    return value


@dataclass(frozen=True)
class Event:
    """Something that happened, to be delivered to every handler subscribed to its `type`.

    - `id` is the deduplication key: publishing the same id again (a retried request, a
      redelivered broker message) adds deliveries only for handlers the event never had;
    - `key`, when given, orders the event's deliveries per handler: a delivery of a key runs only
      after every earlier one (by commit order) of the same handler and key finished;
    - `payload` and `headers` are stored JSON-normalized (see `normalize`); a claim hands them
      back in that form;
    - `created_at` is set from the outbox's clock when left out.
    """

    id: str
    type: str
    payload: Any = None
    key: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None
    created_at: datetime | None = None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Event:
        """The event an events document stores."""
        return cls(
            id=doc["_id"],
            type=doc["type"],
            payload=doc.get("payload"),
            key=doc.get("key"),
            headers=doc.get("headers") or {},
            correlation_id=doc.get("correlation_id"),
            causation_id=doc.get("causation_id"),
            created_at=stored_instant(doc.get("created_at")),
        )

    def checked(self, field_name: str = "event") -> Event:
        """This event validated and normalized, or `InvalidInput` naming the field."""
        if not isinstance(self, Event):
            raise InvalidInput(field_name, f"must be an Event, got {type(self).__name__}")
        for name in ("id", "type"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 1024 or "\x00" in value:
                raise InvalidInput(
                    f"{field_name}.{name}", "must be a non-empty string of at most 1024 chars"
                )
        key = _optional_text(f"{field_name}.key", self.key)
        correlation_id = _optional_text(f"{field_name}.correlation_id", self.correlation_id)
        causation_id = _optional_text(f"{field_name}.causation_id", self.causation_id)
        check_instant(f"{field_name}.created_at", self.created_at)
        if not isinstance(self.headers, Mapping):
            raise InvalidInput(f"{field_name}.headers", "must be a mapping")
        check_nesting(f"{field_name}.payload", self.payload)
        check_nesting(f"{field_name}.headers", self.headers)
        payload = normalize(f"{field_name}.payload", self.payload)
        headers = normalize(f"{field_name}.headers", self.headers)
        size = check_payload(f"{field_name}.payload", payload)
        size += check_payload(f"{field_name}.headers", headers, limit=64 * 1024)
        texts = [self.id, self.type, key, correlation_id, causation_id]
        size += len(bson.encode({"t": [text for text in texts if text is not None]}))
        if size > MAX_PAYLOAD_BYTES:
            # The stored event carries all of it, plus its handler list: past this a server
            # refuses the document (17420) and a transactional publish aborts the caller's.
            raise InvalidInput(
                field_name,
                f"payload, headers, id, type and keys encode to {size} bytes together; the "
                f"limit is {MAX_PAYLOAD_BYTES}",
            )
        return Event(
            id=self.id,
            type=self.type,
            payload=payload,
            key=key,
            headers=headers,
            correlation_id=correlation_id,
            causation_id=causation_id,
            created_at=self.created_at,
        )


@dataclass(frozen=True)
class Delivery:
    """One handler's claim of one event, as `AsyncOutbox.claim` hands it out.

    `attempt` counts this run (1 on the first). `lease_token` is ``<lane>:<epoch>:<claims>``:
    the lane's epoch when it was taken and the delivery's claim generation; every settle call is
    fenced on it, so a worker that lost its lane (or whose claim ended) changes nothing.
    """

    id: str
    event: Event
    handler: str
    attempt: int
    lease_token: str
    worker_id: str
    sequence: int | None = None
    #: when it fell due (its first due time, or the retry's)
    due_at: datetime | None = None

    @property
    def lane_id(self) -> int:
        return int(self.lease_token.split(":", 1)[0])

    @property
    def generation(self) -> int:
        """The delivery's claim generation this claim holds (the token's last part)."""
        return int(self.lease_token.rsplit(":", 1)[1])

    @classmethod
    def from_documents(
        cls, delivery: Mapping[str, Any], event: Mapping[str, Any], worker_id: str, epoch: int
    ) -> Delivery:
        """The delivery a claim hands out: its stored document (the claim's projection), its
        event's, the claiming worker and the epoch of the lane it was recorded on."""
        return cls(
            id=str(delivery["_id"]),
            event=Event.from_document(event),
            handler=delivery["handler"],
            attempt=int(delivery["attempts"]) + 1,
            lease_token=lease_token(int(delivery["lane_id"]), epoch, int(delivery["claims"])),
            worker_id=worker_id,
            sequence=delivery.get("sequence"),
            due_at=stored_instant(delivery.get("due_at")),
        )


def lease_token(lane: int, epoch: int, generation: int) -> str:
    """A claim's token: its lane number, the lane's epoch, the delivery's claim generation."""
    return f"{lane}:{epoch}:{generation}"


def parse_token(delivery: Any, field: str = "delivery") -> tuple[bson.ObjectId, int, int, int]:
    """(delivery _id, lane, epoch, claim generation) of a `Delivery`; a token this store cannot
    have issued is `InvalidInput` before any database call."""
    if not isinstance(delivery, Delivery):
        raise InvalidInput(field, f"must be a Delivery, got {type(delivery).__name__}")
    if not isinstance(delivery.id, str) or not bson.ObjectId.is_valid(delivery.id):
        raise InvalidInput(f"{field}.id", "is not the id of a delivery this outbox handed out")
    try:
        lane_text, epoch_text, claims_text = delivery.lease_token.split(":")
        lane, epoch, claims = int(lane_text), int(epoch_text), int(claims_text)
    except (TypeError, ValueError, AttributeError):
        raise InvalidInput(f"{field}.lease_token", "is not a token this outbox issued") from None
    if not 0 <= lane < LANES or epoch < 0 or claims < 0:
        raise InvalidInput(f"{field}.lease_token", "is not a token this outbox issued")
    _check_claim(delivery, field)
    return bson.ObjectId(delivery.id), lane, epoch, claims


def _check_claim(delivery: Delivery, field: str) -> None:
    """The fields of a `Delivery` a settle writes or filters on (a hand-built one may hold
    anything: a dict there would be an operator, or another item's name): `InvalidInput`
    naming the first of the wrong type."""
    if not isinstance(delivery.worker_id, str) or not delivery.worker_id:
        raise InvalidInput(f"{field}.worker_id", "must be a non-empty string")
    check_handler(f"{field}.handler", delivery.handler)
    if isinstance(delivery.attempt, bool) or not isinstance(delivery.attempt, int):
        raise InvalidInput(f"{field}.attempt", "must be an int")
    sequence = delivery.sequence
    if sequence is not None and (isinstance(sequence, bool) or not isinstance(sequence, int)):
        raise InvalidInput(f"{field}.sequence", "must be None or an int")
    event = delivery.event
    if not isinstance(event, Event):
        raise InvalidInput(f"{field}.event", f"must be an Event, got {type(event).__name__}")
    for name in ("id", "type"):
        if not isinstance(getattr(event, name), str) or not getattr(event, name):
            raise InvalidInput(f"{field}.event.{name}", "must be a non-empty string")
    if event.key is not None and not isinstance(event.key, str):
        raise InvalidInput(f"{field}.event.key", "must be None or a string")
    if event.created_at is not None and not isinstance(event.created_at, datetime):
        raise InvalidInput(f"{field}.event.created_at", "must be None or a datetime")


@dataclass(frozen=True)
class PublishResult:
    """What `publish` wrote: events new to the outbox, and deliveries added (a replayed event
    adds deliveries only for handlers it never had)."""

    events_added: int
    deliveries_added: int


@dataclass(frozen=True)
class DeliveryInfo:
    """A delivery as the operator calls list it. `status` is ``pending`` (waiting, delayed or
    running; `running` tells), ``parked`` (a waiting backlog of a blocked key), ``dead`` or
    ``completed`` (completion history only)."""

    id: str
    event_id: str
    event_type: str
    handler: str
    status: str
    attempts: int
    key: str | None
    sequence: int | None
    due_at: datetime | None
    last_error: str | None
    created_at: datetime | None
    updated_at: datetime | None
    running: bool = False
    #: Why the stored document cannot be shown as it is (a field of the wrong type, written by
    #: hand or by another program), e.g. ``"field 'attempts' holds a string ('x')"``; the
    #: fields it cannot show are empty (0, None, ""). None for every document mongoq wrote.
    unreadable: str | None = None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any], running: bool) -> DeliveryInfo:
        """A stored delivery (or completion record, its ``status`` set to ``completed``); one
        that cannot be read whole is shown with `unreadable` saying which field (never an
        exception: one bad document never breaks a listing or a page)."""
        fault = info_fault(doc)
        if fault is not None:
            return _unreadable_info(doc, running, fault)
        status = doc["status"]
        if status == "pending" and doc.get("lane") == "parked":
            status = "parked"
        return cls(
            id=str(doc["_id"]),
            event_id=doc["event_id"],
            event_type=doc["event_type"],
            handler=doc["handler"],
            status=status,
            attempts=int(doc["attempts"]),
            key=doc.get("key"),
            sequence=doc.get("sequence"),
            due_at=stored_instant(doc.get("due_at")),
            last_error=doc.get("last_error"),
            created_at=stored_instant(doc.get("created_at")),
            updated_at=stored_instant(doc.get("updated_at") or doc.get("completed_at")),
            running=running,
        )


def _unreadable_info(doc: Mapping[str, Any], running: bool, fault: tuple[str, str]) -> DeliveryInfo:
    """`DeliveryInfo` of a document `info_fault` finds `fault` in: what can be read of it."""

    def text(name: str) -> str:
        value = doc.get(name)
        return value if isinstance(value, str) else "" if value is None else str(value)

    status = doc.get("status")
    if status not in ("pending", "dead", "completed"):
        status = "pending" if "due_at" in doc else "dead"  # as a claim would take it
    elif status == "pending" and doc.get("lane") == "parked":
        status = "parked"
    key, sequence, error = doc.get("key"), doc.get("sequence"), doc.get("last_error")
    return DeliveryInfo(
        id=str(doc.get("_id")),
        event_id=text("event_id"),
        event_type=text("event_type"),
        handler=text("handler"),
        status=status,
        attempts=int(doc["attempts"]) if whole(doc.get("attempts")) else 0,
        key=key if isinstance(key, str) else None,
        sequence=int(sequence) if whole(sequence, -(2**63)) else None,
        due_at=stored_instant(doc.get("due_at")),
        last_error=error if isinstance(error, str) else None,
        created_at=stored_instant(doc.get("created_at")),
        updated_at=stored_instant(doc.get("updated_at") or doc.get("completed_at")),
        running=running,
        unreadable=describe(fault),
    )


@dataclass(frozen=True)
class OutboxStats:
    """Counts per status (``pending`` includes ``parked`` and running deliveries), how many run
    now, and the due time of the oldest unfinished delivery (None when there is none)."""

    pending: int
    parked: int
    running: int
    dead: int
    completed: int
    oldest_due_at: datetime | None
    lanes_held: int


@dataclass(frozen=True)
class PurgeResult:
    """What `purge` deleted."""

    dead_deliveries: int = 0
    completed_records: int = 0
    events: int = 0


@dataclass
class OutboxRunSummary:
    """What an `OutboxDispatcher` did: deliveries claimed, completed, rescheduled for retry,
    buried as dead letters, released unrun on stop, found lost to another worker, and settled
    with no answer (`unknown`: the settle may have applied; if not, the delivery runs again).
    Every delivery claimed ends in exactly one of the others."""

    claimed: int = 0
    completed: int = 0
    retried: int = 0
    buried: int = 0
    released: int = 0
    lost: int = 0
    unknown: int = 0


@dataclass(frozen=True)
class Entry:
    """One delivery listed by a lane: claimed by the lane's owner at generation `generation`."""

    delivery: Any
    generation: int
    handler: str
    key: str | None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Entry:
        """The entry `doc` lists; ValueError for one that cannot be read (`entry_fault`)."""
        if entry_fault(doc):
            raise ValueError("a lane entry that cannot be read")
        return cls(doc["d"], int(doc["g"]), doc["h"], doc.get("k"))

    @property
    def claim(self) -> tuple[Any, int]:
        """(delivery _id, generation): the claim this entry lists."""
        return self.delivery, self.generation

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"d": self.delivery, "g": self.generation, "h": self.handler}
        if self.key is not None:
            doc["k"] = self.key
        return doc
