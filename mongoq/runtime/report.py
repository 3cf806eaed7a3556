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
last line). A record of a failure given up carries the traceback; a retry is one line (the
item's stored error has the traceback).
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = ["ERROR_LIMIT", "GIVEN_UP", "Attempt", "error_line", "error_text", "log_attempt_end"]

#: Outcomes after which the item is not retried by itself.
GIVEN_UP = frozenset({"failed", "dead", "buried"})
#: How much of an error's text is stored: the end, where the exception's own line is.
ERROR_LIMIT = 2000


def error_text(error: BaseException | str | None) -> str | None:
    """The text stored for an error: its traceback (or the string), last 2,000 characters."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception(error)).rstrip()
    else:
        text = str(error)
    return text[-ERROR_LIMIT:]


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
    fields: dict[str, Any] = {
        "mongoq_primitive": attempt.primitive,
        "mongoq_queue": attempt.queue,
        "mongoq_item": attempt.item,
        "mongoq_attempt": attempt.number,
        "mongoq_outcome": outcome,
        "mongoq_next_due": next_due.isoformat() if next_due is not None else None,
        "mongoq_worker": attempt.worker,
        "mongoq_error": line,
    }
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
        # carries the traceback with it.
        exc_info=error if given_up and isinstance(error, Exception) else None,
    )
