"""How every primitive reports the end of an attempt that did not succeed: the error's text it
stores on the item (`error_text`, the traceback's last `ERROR_LIMIT` characters) and the log
record, one per event, with the same words and the same structured fields whichever primitive
wrote it. Owns no collections.

Levels: a failure that will be retried is INFO (the retry is the system working); a failure
that gives the item up (a task failed, a message dead-lettered, a delivery buried) is WARNING,
so a worker whose items fail shows it with Python's default logging.

Fields (in ``extra``, so a JSON formatter emits them as keys): ``mongoq_primitive``
(``tasks`` / ``groups`` / ``outbox``), ``mongoq_queue`` (the queue's name, the transport's or
outbox's prefix), ``mongoq_item`` (the task id; ``group/seq``; ``event id/handler``),
``mongoq_attempt``, ``mongoq_outcome`` (``retried``, ``failed``, ``dead``, ``buried``),
``mongoq_next_due`` (ISO 8601 UTC, or None), ``mongoq_worker``, ``mongoq_error`` (the error's
last line). A retry is one line (the item's stored error has the traceback). So is a failure
given up by a verdict: the handler's `PermanentError`, a `HandlerTimeout`. A failure given up
on an unexpected exception carries its traceback from the handler's frame on, without the run
loop's frames that called it.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from mongoq.errors import HandlerTimeout, PermanentError

__all__ = [
    "ERROR_LIMIT",
    "GIVEN_UP",
    "Attempt",
    "error_line",
    "error_text",
    "log_attempt_end",
    "log_set_aside",
]

#: Outcomes after which the item is not retried by itself.
GIVEN_UP = frozenset({"failed", "dead", "buried"})
#: How much of an error's text is stored: the end, where the exception's own line is.
ERROR_LIMIT = 2000
#: Errors that end an attempt as a verdict, not a fault: their line says it all.
_VERDICTS = (PermanentError, HandlerTimeout)
#: The packages of the frames that call a handler (the run loops, the facade's worker thread).
_CALLERS = frozenset({"mongoq", "mongoq_sync", "anyio", "asyncio", "concurrent", "threading"})


def error_text(error: BaseException | str | None) -> str | None:
    """The text stored for an error: its traceback from the handler's frame on (the run
    loop's frames that called it say nothing of the item, and would push its own lines out),
    or the string; the last 2,000 characters."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        start = _from_handler(error.__traceback__)
        shown = traceback.TracebackException(type(error), error, start)
        text = "".join(shown.format()).rstrip()
    else:
        text = str(error)
    return text[-ERROR_LIMIT:]


def _from_handler(entry: TracebackType | None) -> TracebackType | None:
    """`entry`'s traceback from its first frame outside the code that calls handlers; whole
    when every frame is mongoq's own (a fault of mongoq's)."""
    start = entry
    while start is not None and _is_caller(start):
        start = start.tb_next
    return start if start is not None else entry


def error_line(error: BaseException | str | None) -> str:
    """The line that says what went wrong: an exception's ``Type: message``, a text's last
    line (a stored traceback ends with it)."""
    if error is None:
        return ""
    if isinstance(error, BaseException):
        text = str(error)
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    lines = error.strip().splitlines()
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class Attempt:
    """Which attempt of which item a record speaks of."""

    #: ``tasks``, ``groups`` or ``outbox``
    primitive: str
    #: the queue's name, the transport's or the outbox's prefix
    queue: str
    #: the task id; ``group/seq``; ``event id/handler``
    item: str
    number: int | None
    worker: str | None


def log_attempt_end(
    logger: logging.Logger,
    attempt: Attempt,
    outcome: str,
    error: BaseException | str | None,
    next_due: datetime | None = None,
) -> None:
    """Log that `attempt` ended in `outcome` (see the module docstring)."""
    line = error_line(error)
    fields = _fields(attempt, outcome, line)
    fields["mongoq_next_due"] = next_due.isoformat() if next_due is not None else None
    where = f"{attempt.primitive}:{attempt.queue} {attempt.item}"
    after = f" after attempt {attempt.number}" if attempt.number is not None else ""
    due = f", due again at {fields['mongoq_next_due']}" if next_due is not None else ""
    given_up = outcome in GIVEN_UP
    logger.log(
        logging.WARNING if given_up else logging.INFO,
        "%s %s%s%s: %s",
        where,
        outcome,
        after,
        due,
        line or "no error recorded",
        extra=fields,
        # A retry is one line (its traceback is stored with the item); a failure given up
        # carries the traceback with it, unless it is a verdict.
        exc_info=_traceback(error) if given_up else None,
    )


def _fields(attempt: Attempt, outcome: str, error: str) -> dict[str, Any]:
    """The structured fields every record of an item's end carries (see the module docstring)."""
    return {
        "mongoq_primitive": attempt.primitive,
        "mongoq_queue": attempt.queue,
        "mongoq_item": attempt.item,
        "mongoq_attempt": attempt.number,
        "mongoq_outcome": outcome,
        "mongoq_worker": attempt.worker,
        "mongoq_error": error,
    }


def _traceback(
    error: BaseException | str | None,
) -> tuple[type[BaseException], BaseException, TracebackType | None] | None:
    """What a record of `error` given up carries: nothing for a verdict (or a text); for an
    exception, its traceback from the first frame outside the code that calls handlers (the
    handler's), or whole when every frame is mongoq's own (a fault of mongoq's)."""
    if not isinstance(error, Exception) or isinstance(error, _VERDICTS):
        return None
    return type(error), error, _from_handler(error.__traceback__)


def _is_caller(entry: TracebackType) -> bool:
    module = entry.tb_frame.f_globals.get("__name__")
    return isinstance(module, str) and module.partition(".")[0] in _CALLERS


def log_set_aside(
    logger: logging.Logger,
    attempt: Attempt,
    collection: str,
    field: str,
    found: str,
    outcome: str,
) -> None:
    """Log, once, that a stored document no run loop can use (a field of the wrong type) was
    set aside (`outcome`: ``failed``, ``dead``, ``buried``, ``repaired``), so that it never holds
    back the items behind it. A WARNING naming the collection, the item and the field, with
    the module's fields and ``mongoq_collection`` and ``mongoq_field``."""
    fields = _fields(attempt, outcome, f"field {field!r} holds {found}")
    fields["mongoq_collection"] = collection
    fields["mongoq_field"] = field
    logger.warning(
        "%s: %r in %s set aside (%s): field %r holds %s",
        f"{attempt.primitive}:{attempt.queue}", attempt.item, collection, outcome, field, found,
        extra=fields,
    )  # fmt: skip
