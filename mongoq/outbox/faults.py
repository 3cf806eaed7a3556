"""What makes a stored document of the outbox unusable: a field of a type mongoq never writes
(by hand, by another program, by a bad restore). Each check names the first such field and what
it holds (`Fault`, said by `describe`: ``field 'attempts' holds a string ('x')``); values only,
no I/O. `mongoq.outbox.quarantine` sets aside what they find; `mongoq.outbox.models` reads
tolerantly with them. Owns no collections; the documents are `mongoq.outbox.schema`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from decimal import ROUND_FLOOR, Decimal
from typing import Any, TypeGuard

import bson

from mongoq.outbox import schema

__all__ = [
    "Fault", "counter_value", "delivery_fault", "describe", "entry_fault", "event_fault",
    "head_fault", "info_fault", "is_text", "kind", "lane_faults", "slots_fault", "whole",
]  # fmt: skip

#: A field that cannot be used, and what it holds (``("attempts", "a string ('x')")``).
Fault = tuple[str, str]
#: How many lanes a handler has (`mongoq.outbox.models.LANES`; not imported: models imports
#: this module).
_LANES = 256
_NAMES: tuple[tuple[type, str], ...] = (
    (bool, "a bool"), (int, "an int"), (float, "a float"), (str, "a string"),
    (dict, "a document"), (list, "an array"), (datetime, "a date"),
    (bson.ObjectId, "an ObjectId"), (bson.Decimal128, "a Decimal128"),
)  # fmt: skip
#: A sequence is a 64-bit int in BSON.
_INT64 = 2**63
#: Beyond this a double's ``$inc`` by a few can round the increment away.
_EXACT_DOUBLE = 2**53


def kind(value: Any) -> str:
    """`value` as an error text names it: its type, and a short sample (``a string ('x')``,
    ``null``, ``a document``)."""
    if value is None:
        return "null"
    name = next((n for t, n in _NAMES if isinstance(value, t)), type(value).__name__)
    if isinstance(value, dict | list | datetime | bson.ObjectId):
        return name
    return f"{name} ({value!r:.40})"


def describe(fault: Fault) -> str:
    """The text of a fault: ``field 'attempts' holds a string ('x')``."""
    return f"field {fault[0]!r} holds {fault[1]}"


def _found(doc: Mapping[str, Any], name: str) -> Fault:
    return name, kind(doc[name]) if name in doc else "nothing"


def whole(value: Any, low: int = 0, high: int | None = None) -> TypeGuard[int | float]:
    """Whether `value` is a whole number in ``[low, high)`` (a double such as a shell writes,
    ``3.0``, is one; a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and not value.is_integer():
        return False
    return value >= low and (high is None or value < high)


def counter_value(value: Any) -> int | None:
    """The last sequence a key's counter says (its ``value`` after a publish's ``$inc``): a
    number of any BSON type (a double such as a shell writes, a Decimal128; a fraction counts
    down: sequences are whole); None when it says none to trust: no number, NaN, an infinity, a
    double beyond 2**53 (an ``$inc`` of it may round the increment away: a sequence twice),
    beyond a 64-bit int."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= _EXACT_DOUBLE:
            return None
        number = Decimal(value)
    elif isinstance(value, bson.Decimal128):
        number = value.to_decimal()
        if not number.is_finite():
            return None
    else:
        return None
    last = int(number.to_integral_value(ROUND_FLOOR))
    return last if -_INT64 <= last < _INT64 else None


def is_text(value: Any) -> bool:
    """A non-empty string."""
    return isinstance(value, str) and bool(value)


def _optional(value: Any, kind_: type | tuple[type, ...]) -> bool:
    return value is None or isinstance(value, kind_)


def delivery_fault(doc: Mapping[str, Any]) -> Fault | None:
    """The first field that makes a pending delivery unusable by a claim or a settle (read
    whole, or with `schema.CLAIM_PROJECTION`); None when each has the type mongoq writes."""
    if not isinstance(doc.get("_id"), bson.ObjectId):
        return _found(doc, "_id")
    if doc.get("status") != schema.PENDING:
        return _found(doc, "status")
    if not is_text(doc.get("event_id")):
        return _found(doc, "event_id")
    if not is_text(doc.get("handler")):
        return _found(doc, "handler")
    if not whole(doc.get("lane_id"), 0, _LANES):
        return _found(doc, "lane_id")
    for name in ("attempts", "claims"):
        if not whole(doc.get(name)):
            return _found(doc, name)
    key = doc.get("key")
    if not _optional(key, str):
        return _found(doc, "key")
    sequence = doc.get("sequence")
    if (key is not None or sequence is not None) and not whole(sequence, -(2**63)):
        return _found(doc, "sequence")  # a keyed delivery's place in its key
    if "due_at" in doc and not isinstance(doc["due_at"], datetime):
        return _found(doc, "due_at")
    return None


def head_fault(doc: Mapping[str, Any]) -> Fault | None:
    """What makes a pending delivery before a key's candidate (`schema.HEAD_PROJECTION`) a head
    nothing will ever claim or unpark (a due time no claim scans, a claim lane of neither
    kind), which would hold its key back for good; None for a usable one."""
    if not isinstance(doc.get("due_at"), datetime):
        return _found(doc, "due_at")
    if doc.get("lane") not in (schema.READY, schema.PARKED):
        return _found(doc, "lane")
    return None


def event_fault(doc: Mapping[str, Any]) -> Fault | None:
    """The first field that makes an event unusable for a claim to hand out or a completion to
    record itself on; None when each has the type mongoq writes."""
    if not is_text(doc.get("type")):
        return _found(doc, "type")
    if not _optional(doc.get("headers"), Mapping):
        return _found(doc, "headers")
    for name in ("key", "correlation_id", "causation_id"):
        if not _optional(doc.get(name), str):
            return _found(doc, name)
    for name in ("created_at", "completed_at"):
        if not _optional(doc.get(name), datetime):
            return _found(doc, name)
    for name in ("handlers", "finished"):  # a completion and a burial add to them
        if name in doc and not isinstance(doc[name], list):
            return _found(doc, name)
    return None


_INFO_STATUSES = (schema.PENDING, schema.DEAD, schema.COMPLETED)


def info_fault(doc: Mapping[str, Any]) -> Fault | None:
    """The first field a listing cannot show of a delivery or a completion record (its
    ``status`` set); None when it can show them all."""
    if doc.get("status") not in _INFO_STATUSES:
        return _found(doc, "status")
    for name in ("event_id", "event_type", "handler"):
        if not is_text(doc.get(name)):
            return _found(doc, name)
    if not whole(doc.get("attempts")):
        return _found(doc, "attempts")
    if not _optional(doc.get("key"), str):
        return _found(doc, "key")
    if doc.get("sequence") is not None and not whole(doc["sequence"], -(2**63)):
        return _found(doc, "sequence")
    for name in ("due_at", "created_at", "updated_at", "completed_at"):
        if not _optional(doc.get(name), datetime):
            return _found(doc, name)
    if not _optional(doc.get("last_error"), str):
        return _found(doc, "last_error")
    return None


def entry_fault(entry: Any) -> bool:
    """Whether a lane's entry (``{d, g, h, k?}``) cannot be read (``d``: a delivery's
    ``_id``, which a claim hands out only as an ObjectId)."""
    return (
        not isinstance(entry, Mapping)
        or not isinstance(entry.get("d"), bson.ObjectId)
        or not whole(entry.get("g"))
        or not is_text(entry.get("h"))
        or not _optional(entry.get("k"), str)
    )


def lane_faults(doc: Mapping[str, Any]) -> dict[str, str]:
    """Every field of a lane document that cannot be read, and what it holds (empty when the
    lane is usable)."""
    faults: dict[str, str] = {}

    def check(name: str, usable: bool) -> None:
        if not usable:
            faults[name] = _found(doc, name)[1]

    check("handler", is_text(doc.get("handler")))
    check("n", whole(doc.get("n"), 0, _LANES) and doc.get("n") == doc["_id"] % _LANES)
    for name in ("owner", "instance", "write"):
        check(name, _optional(doc.get(name), str))
    check("lease_until", _optional(doc.get("lease_until"), datetime))
    for name in ("epoch", "rev", "requeued"):
        check(name, whole(doc.get(name)))
    for name in ("in_flight", "lost"):
        entries = doc.get(name)
        check(name, isinstance(entries, list) and not any(map(entry_fault, entries)))
    return faults


def slots_fault(doc: Mapping[str, Any]) -> Fault | None:
    """What makes the slots document unreadable (its ``handlers``, a list of names); None when
    it is readable."""
    handlers = doc.get("handlers")
    if not isinstance(handlers, list) or not all(is_text(h) for h in handlers):
        return _found(doc, "handlers")
    return None


# =========================================================== the filters and the updates
