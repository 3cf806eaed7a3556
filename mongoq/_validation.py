"""Argument checks shared by every primitive; each failure is an `InvalidInput` naming the field.

Checks run before anything is written, so a rejected call changes nothing. Ids must be plain
strings or ints: a dict such as ``{"$gt": ""}`` in an ``_id`` filter would be operator injection.
Owns no collections.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

import bson
from bson.decimal128 import Decimal128
from bson.errors import BSONError

from mongoq.errors import InvalidInput

#: The server's hard limit on a document.
MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
#: What a payload may take of it, leaving room for the bookkeeping fields around it.
MAX_PAYLOAD_BYTES = MAX_DOCUMENT_BYTES - 64 * 1024
MAX_ID_LENGTH = 1024
#: The largest batch a batched call takes (a bulk write's natural size).
MAX_BATCH = 1000
#: The most slots one run loop keeps: each is a task of the event loop, and a server's
#: connection pool serves far fewer commands at once.
MAX_CONCURRENCY = 1000
#: Durations beyond ten years are mistakes (and overflow date arithmetic near year 9999).
MAX_SECONDS = 10 * 365 * 24 * 3600
#: What a stored integer may be (BSON's int64).
INT64_RANGE = (-(2**63), 2**63 - 1)
#: How deep a stored value may nest (each mapping or list a level). MongoDB documents support
#: at most 100 levels (a server refuses to store one past 180); a payload sits a few levels
#: down in the documents and updates that carry it. Bounding it also makes a value that
#: contains itself an `InvalidInput`, not a `RecursionError`.
MAX_NESTING = 90
#: The longest queue name or prefix, in UTF-8 bytes. A namespace ``<db>.<collection>`` is at
#: most 255 bytes (MongoDB 4.4 and later), a database name at most 63, and the longest suffix
#: a primitive appends 20 (the outbox's ``completed_deliveries``): 63 + 1 + 128 + 20 fits, so
#: no name that passes here is refused for its length by any database.
MAX_NAME_BYTES = 128
#: A lease must outlast a renewal's round trip: its holder renews at a third of it, dated from
#: when the renewal was sent, so a 0.5 s lease leaves about 0.33 s for the reply and a busy
#: event loop (round trips in a data centre take milliseconds). Much shorter ones expire under
#: their holder and the work runs several times at once. A lease longer than a week holds
#: crashed work back for longer than anyone waits for it.
LEASE_SECONDS = (0.5, 7 * 24 * 3600.0)
#: A poll or housekeeping interval: below 10 ms a loop spends its time polling; above an hour
#: it is a mistake (an idle worker would not notice new work for longer than that).
INTERVAL_SECONDS = (0.01, 3600.0)


def _kind(value: Any) -> str:
    return type(value).__name__


def check_id(field: str, value: Any) -> str | int:
    """A document id: a non-empty string of at most 1024 characters, or a 64-bit int."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidInput(field, f"must be a non-empty string or an int, got {_kind(value)}")
    if isinstance(value, int):
        if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
            raise InvalidInput(field, "must fit in a signed 64-bit integer")
        return value
    if not value:
        raise InvalidInput(field, "must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidInput(field, f"must be at most {MAX_ID_LENGTH} characters")
    if "\x00" in value:
        raise InvalidInput(field, "must not contain NUL characters")
    return value


def check_name(field: str, value: Any, *, prefix: bool = False) -> str:
    """A collection name, or with `prefix` the start of collection names, chosen by the user:
    what the server takes as one (no ``$`` or NUL, no ``system.`` start, no leading ``.``, no
    ``..``, no trailing ``.`` unless a suffix follows), printable (it is shown in log lines),
    and at most `MAX_NAME_BYTES` bytes, so that no database refuses its namespace."""
    if not isinstance(value, str) or not value:
        raise InvalidInput(field, f"must be a non-empty string, got {value!r}")
    if "$" in value or "\x00" in value or value.startswith("system."):
        raise InvalidInput(field, "must not contain '$' or NUL, nor start with 'system.'")
    if value.startswith(".") or ".." in value or (value.endswith(".") and not prefix):
        where = "start" if prefix else "start or end"  # a suffix follows a prefix's end
        raise InvalidInput(field, f"must not {where} with '.' nor contain '..', got {value!r}")
    if not value.isprintable():
        raise InvalidInput(field, f"must not contain line breaks or control characters, "
                                  f"got {value!r}")  # fmt: skip
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidInput(field, "must be valid Unicode (no lone surrogates)") from None
    if size > MAX_NAME_BYTES:
        raise InvalidInput(field, f"must be at most {MAX_NAME_BYTES} bytes in UTF-8, got {size}")
    return value


def check_function_name(field: str, value: Any) -> str:
    """A task function's name (`mongoq.Jobs`): a non-empty string of at most 200 characters,
    without NUL."""
    if not isinstance(value, str) or not value or len(value) > 200 or "\x00" in value:
        raise InvalidInput(field, f"must be a non-empty string of at most 200 characters, "
                                  f"got {value!r}")  # fmt: skip
    return value


def check_functions(field: str, value: Any) -> list[str] | None:
    """None (every task), or a collection of task function names (not one string), sorted."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidInput(field, f"must be a collection of task function names, got {value!r}")
    names = {check_function_name(f"{field}[]", name) for name in value}
    if not names:
        raise InvalidInput(field, "must name at least one task function (None: every task)")
    return sorted(names)


def check_worker_id(field: str, value: Any) -> str:
    """A worker's name, stored on what it holds: bounded like an id, so a document's
    bookkeeping fields stay far below the room a payload leaves them."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(field, "must be a non-empty string")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidInput(field, f"must be at most {MAX_ID_LENGTH} characters")
    if not value.isprintable():  # shown as is in log lines: a line break would forge one
        raise InvalidInput(field, f"must not contain line breaks or control characters, "
                                  f"got {value!r}")  # fmt: skip
    return value


def check_concurrency(value: Any) -> int:
    """A run's `concurrency`: its slots, from 1 to `MAX_CONCURRENCY`, the same for every
    primitive and `Jobs`."""
    return check_int("concurrency", value, low=1, high=MAX_CONCURRENCY)


def check_int(field: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field, f"must be an int, got {_kind(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = (
            f"between {low} and {high}"
            if low is not None and high is not None
            else (f"at least {low}" if low is not None else f"at most {high}")
        )
        raise InvalidInput(field, f"must be {bounds}, got {value}")
    return value


def check_seconds(field: str, value: Any, *, positive: bool = False) -> float:
    """A duration in seconds: a finite number, >= 0 (or > 0 when `positive`), <= ten years."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(field, f"must be a number of seconds, got {_kind(value)}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0) or value > MAX_SECONDS:
        raise InvalidInput(
            field, f"must be {'>' if positive else '>='} 0 and at most {MAX_SECONDS}, got {value}"
        )
    return float(value)


def _check_between(field: str, value: Any, bounds: tuple[float, float], what: str) -> float:
    seconds = check_seconds(field, value, positive=True)
    low, high = bounds
    if not low <= seconds <= high:
        raise InvalidInput(field, f"must be from {low:g} to {high:g} seconds ({what}), "
                                  f"got {value!r}")  # fmt: skip
    return seconds


def check_lease_seconds(field: str, value: Any) -> float:
    """A lease's length: from 0.5 s to 7 days (`LEASE_SECONDS`)."""
    return _check_between(field, value, LEASE_SECONDS, "a lease must outlast its renewal")


def check_interval(field: str, value: Any) -> float:
    """A poll or housekeeping interval: from 10 ms to an hour (`INTERVAL_SECONDS`)."""
    return _check_between(field, value, INTERVAL_SECONDS, "a poll interval")


def check_field_name(field: str, key: Any) -> str:
    """A field name inside a user value: a string neither starting with ``$`` nor containing
    ``.`` (the server gives those meaning in queries and updates; refused, not escaped)."""
    if not isinstance(key, str):
        raise InvalidInput(field, f"field names must be strings, got {_kind(key)}")
    if key.startswith("$") or "." in key:
        raise InvalidInput(f"{field}.{key}", "field names may not start with '$' or contain '.'")
    return key


#: Values that hold no field names nor numbers to check, told by their exact type (a subclass
#: takes the long way): every put and completion checks its value, most of which are (or are
#: made of) these and floats.
_INERT = frozenset({str, int, bool, type(None), bytes, datetime})
#: What `check_payload` finds for None (a completion without a result), without encoding it.
_NONE_SIZE = len(bson.encode({"v": None}))
#: As the outbox says it (`mongoq.outbox.models.normalize`): one refusal in every primitive.
_NOT_FINITE = "must be a finite number (JSON has no NaN or infinity)"
_TOO_DEEP = f"nests deeper than {MAX_NESTING} levels (or contains itself)"


class _TooDeep(Exception):
    """Raised out of the walk of a value nested past `MAX_NESTING`; `check_payload` names the
    field the value was given as (the path to the depth would be 90 names long)."""


def _check_leaf(field: str, value: Any) -> None:
    """A value that holds no field names: a float (or a subclass: NumPy's) must be finite, as
    must a Decimal128; the rest is BSON's to encode or refuse."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(field, _NOT_FINITE)
    elif isinstance(value, Decimal128) and not value.to_decimal().is_finite():
        raise InvalidInput(field, _NOT_FINITE)


def _check_items(field: str, value: Any, depth: int) -> None:
    """The field names and numbers of a value whose exact type is not `_INERT`, `depth` levels
    down. Recursive, as deep as `MAX_NESTING` at most."""
    if isinstance(value, Mapping):
        if depth > MAX_NESTING:
            raise _TooDeep
        for key, item in value.items():
            check_field_name(field, key)
            kind = type(item)
            if kind in _INERT:
                continue
            if kind is float:
                if item - item:  # NaN (truthy) for NaN and infinities, 0.0 otherwise
                    raise InvalidInput(f"{field}.{key}", _NOT_FINITE)
            else:
                _check_items(f"{field}.{key}", item, depth + 1)
    elif isinstance(value, list | tuple):
        if depth > MAX_NESTING:
            raise _TooDeep
        for index, item in enumerate(value):
            kind = type(item)
            if kind in _INERT:
                continue
            if kind is float:
                if item - item:
                    raise InvalidInput(f"{field}[{index}]", _NOT_FINITE)
            else:
                _check_items(f"{field}[{index}]", item, depth + 1)
    else:
        _check_leaf(field, value)


def _check_depth(value: Any, depth: int) -> None:
    if isinstance(value, Mapping):
        items: Iterable[Any] = value.values()
    elif isinstance(value, list | tuple):
        items = value
    else:
        return
    if depth > MAX_NESTING:
        raise _TooDeep
    for item in items:
        if type(item) not in _INERT:
            _check_depth(item, depth + 1)


def check_nesting(field: str, value: Any) -> None:
    """`InvalidInput` naming `field` if `value` nests deeper than `MAX_NESTING` levels or
    contains itself: for a value transformed (the outbox's JSON normalization) before
    `check_payload`, which checks the same, sees it."""
    try:
        _check_depth(value, 1)
    except _TooDeep:
        raise InvalidInput(field, _TOO_DEEP) from None


def check_payload(field: str, value: Any, *, limit: int = MAX_PAYLOAD_BYTES) -> int:
    """A user value to store: BSON-encodable, with plain field names, finite numbers, nested at
    most `MAX_NESTING` levels, and small enough.

    Returns its encoded size. Field names starting with ``$`` or containing ``.`` are refused
    rather than escaped: the server treats them specially in updates and queries. NaN and
    infinity are refused in every primitive, as the outbox (which stores JSON) must.
    """
    if value is None:
        size = _NONE_SIZE
    else:
        if type(value) not in _INERT:
            try:
                _check_items(field, value, 1)
            except _TooDeep:
                raise InvalidInput(field, _TOO_DEEP) from None
        try:
            size = len(bson.encode({"v": value}))
        except (BSONError, TypeError, OverflowError, ValueError, RecursionError) as exc:
            raise InvalidInput(field, f"is not BSON-encodable: {exc}") from None
    if size > limit:
        raise InvalidInput(field, f"encodes to {size} bytes; the limit is {limit}")
    return size


def check_batch(field: str, items: Iterable[Any]) -> list[Any]:
    """A batch argument as a list, refused when larger than `MAX_BATCH`."""
    if isinstance(items, str | bytes | Mapping):
        raise InvalidInput(field, f"must be a list, got {_kind(items)}")
    try:
        batch = list(items)
    except TypeError:
        raise InvalidInput(field, f"must be an iterable, got {_kind(items)}") from None
    if len(batch) > MAX_BATCH:
        raise InvalidInput(field, f"at most {MAX_BATCH} per call, got {len(batch)}")
    return batch


def _is_coroutine_function(value: Any) -> bool:
    """``async def`` functions, partials of them, and objects whose ``__call__`` is one."""
    while isinstance(value, functools.partial):
        value = value.func
    call = (
        None if inspect.isroutine(value) else inspect.getattr_static(type(value), "__call__", None)
    )
    return inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(call)


def check_async_handler(field: str, handler: Any) -> Any:
    """A handler given to the async API must be a coroutine function. A plain function would
    run, side effects and all, before awaiting its result failed: the item would be retried and
    the side effects repeated up to the attempt limit."""
    if not callable(handler):
        raise InvalidInput(field, f"must be an async function, got {_kind(handler)}")
    if not _is_coroutine_function(handler):
        raise InvalidInput(
            field,
            "must be an async function (async def); for a blocking function use mongoq_sync, "
            "or call it with anyio.to_thread.run_sync inside an async handler",
        )
    return handler


def check_blocking_handler(field: str, handler: Any) -> Any:
    """A handler given to `mongoq_sync` runs in a worker thread: a coroutine function there
    would return a coroutine nobody awaits, stored as the failure."""
    if not callable(handler):
        raise InvalidInput(field, f"must be a function, got {_kind(handler)}")
    if _is_coroutine_function(handler):
        raise InvalidInput(
            field, "must be a plain function: mongoq_sync runs handlers in threads; give an "
            "async handler to the async API (mongoq) instead",
        )  # fmt: skip
    return handler


def check_stop_when(stop_when_empty: Any, stop_when_drained: Any) -> None:
    """`run`'s two ways to stop by itself are exclusive: one says "nothing due now", the other
    "nothing left"."""
    for field, value in (("stop_when_empty", stop_when_empty),
                         ("stop_when_drained", stop_when_drained)):  # fmt: skip
        if not isinstance(value, bool):
            raise InvalidInput(field, f"must be a bool, got {_kind(value)}")
    if stop_when_empty and stop_when_drained:
        raise InvalidInput("stop_when_drained", "choose one of stop_when_empty and this")


def check_timeout(field: str, value: Any) -> float | None:
    """None (no limit) or a positive number of seconds."""
    return None if value is None else check_seconds(field, value, positive=True)


def id_token(value: str | int) -> str:
    """An id as a listing cursor writes it: ``i:<int>`` or ``s:<string>`` (the type kept)."""
    return f"{'i' if isinstance(value, int) else 's'}:{value}"


def parse_id_token(field: str, token: str, problem: str) -> str | int:
    """The id an `id_token` wrote; `InvalidInput` naming `field` for anything else."""
    kind, _, raw = token.partition(":")
    if kind not in ("i", "s") or not _:
        raise InvalidInput(field, problem)
    try:
        value: str | int = int(raw) if kind == "i" else raw
    except ValueError:
        raise InvalidInput(field, problem) from None
    return check_id(field, value)


def check_instant(field: str, value: Any, *, optional: bool = True) -> datetime | None:
    """A timezone-aware datetime (or None, when `optional`). A naive one is refused in every
    primitive rather than read as UTC: ``datetime.now()`` is local time, and guessing would
    shift a cutoff or a due time by the machine's UTC offset."""
    if value is None and optional:
        return None
    if not isinstance(value, datetime) or value.utcoffset() is None:
        allowed = "None or " if optional else ""
        raise InvalidInput(
            field, f"must be {allowed}a timezone-aware datetime (datetime.now(UTC), not "
            f"datetime.now()), got {value!r}",
        )  # fmt: skip
    try:
        value.astimezone(UTC)
    except OverflowError:  # near datetime.min/max, an offset takes it out of range
        raise InvalidInput(field, "is out of range") from None
    return value


def check_window(since: Any, until: Any) -> tuple[datetime, datetime | None]:
    """``[since, until)``: timezone-aware instants, `until` (None: open) not before `since`."""
    start = cast(datetime, check_instant("since", since, optional=False))
    end = check_instant("until", until)
    if end is not None and end < start:
        raise InvalidInput("until", "must not be before since")
    return start, end
