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
from datetime import datetime
from typing import Any

import bson
from bson.errors import BSONError

from mongoq.errors import InvalidInput

#: The server's hard limit on a document.
MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
#: What a payload may take of it, leaving room for the bookkeeping fields around it.
MAX_PAYLOAD_BYTES = MAX_DOCUMENT_BYTES - 64 * 1024
MAX_ID_LENGTH = 1024
#: The largest batch a batched call takes (a bulk write's natural size).
MAX_BATCH = 1000
#: Durations beyond ten years are mistakes (and overflow date arithmetic near year 9999).
MAX_SECONDS = 10 * 365 * 24 * 3600
#: What a stored integer may be (BSON's int64).
INT64_RANGE = (-(2**63), 2**63 - 1)


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


def check_name(field: str, value: Any) -> str:
    """A collection name or prefix chosen by the user."""
    if not isinstance(value, str) or not value:
        raise InvalidInput(field, f"must be a non-empty string, got {value!r}")
    if "$" in value or "\x00" in value or value.startswith("system."):
        raise InvalidInput(field, "must not contain '$' or NUL, nor start with 'system.'")
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
    return value


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


def check_field_name(field: str, key: Any) -> str:
    """A field name inside a user value: a string neither starting with ``$`` nor containing
    ``.`` (the server gives those meaning in queries and updates; refused, not escaped)."""
    if not isinstance(key, str):
        raise InvalidInput(field, f"field names must be strings, got {_kind(key)}")
    if key.startswith("$") or "." in key:
        raise InvalidInput(f"{field}.{key}", "field names may not start with '$' or contain '.'")
    return key


#: Values that hold no field names, told by their exact type (a subclass takes the long way):
#: every put and completion checks its value, most of which are (or are made of) these.
_LEAVES = frozenset({str, int, float, bool, type(None), bytes, datetime})
#: What `check_payload` finds for None (a completion without a result), without encoding it.
_NONE_SIZE = len(bson.encode({"v": None}))


def _check_field_names(field: str, value: Any) -> None:
    if type(value) in _LEAVES:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            check_field_name(field, key)
            if type(item) not in _LEAVES:
                _check_field_names(f"{field}.{key}", item)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if type(item) not in _LEAVES:
                _check_field_names(f"{field}[{index}]", item)


def check_payload(field: str, value: Any, *, limit: int = MAX_PAYLOAD_BYTES) -> int:
    """A user value to store: BSON-encodable, with plain field names, and small enough.

    Returns its encoded size. Field names starting with ``$`` or containing ``.`` are refused
    rather than escaped: the server treats them specially in updates and queries.
    """
    if value is None:
        size = _NONE_SIZE
    else:
        _check_field_names(field, value)
        try:
            size = len(bson.encode({"v": value}))
        except (BSONError, TypeError, OverflowError, ValueError) as exc:
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


def check_window(since: Any, until: Any) -> tuple[datetime, datetime | None]:
    """``[since, until)``: timezone-aware instants, `until` (None: open) not before `since`."""
    for field, value in (("since", since), ("until", until)):
        if value is None and field == "until":
            continue
        if not isinstance(value, datetime) or value.tzinfo is None:
            raise InvalidInput(field, "must be a timezone-aware datetime")
    if until is not None and until < since:
        raise InvalidInput("until", "must not be before since")
    return since, until
