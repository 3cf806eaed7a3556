"""The task queue's values: a task as a snapshot of its document (`Task`), a task as a producer
writes it (`NewTask`), the result types of the producer, operator and worker calls, the
statuses; the validation of what goes into a task document (`new_task`, `check_new_task`,
`check_new_tasks`, `check_result`); and what makes a stored document unusable (`task_fault`,
`read_task`). Owns no collections; the layout of the one the queue owns is in
`mongoq.tasks.schema`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import bson

from mongoq._validation import (
    MAX_DOCUMENT_BYTES,
    MAX_PAYLOAD_BYTES,
    check_function_name,
    check_id,
    check_int,
    check_payload,
    check_seconds,
)
from mongoq.clock import stored_instant, to_millis
from mongoq.errors import InvalidInput

TaskStatus = Literal["pending", "processing", "done", "failed", "cancelled", "tombstone"]
PENDING: TaskStatus = "pending"
PROCESSING: TaskStatus = "processing"
DONE: TaskStatus = "done"
FAILED: TaskStatus = "failed"
#: terminal: `AsyncTaskQueue.cancel` ended it, pending or running
CANCELLED: TaskStatus = "cancelled"
TOMBSTONE: TaskStatus = "tombstone"
STATUSES: tuple[TaskStatus, ...] = (PENDING, PROCESSING, DONE, FAILED, CANCELLED, TOMBSTONE)

PutOutcome = Literal["inserted", "updated", "unchanged"]

TaskId = str | int


@dataclass(frozen=True)
class Task:
    """A snapshot of a task document; `claim` returns one with the lease fields set.

    `error` is the last error recorded for the task; it is kept (for reference) when the task is
    retried, requeued or completed later.
    """

    id: TaskId
    payload: Any
    status: TaskStatus
    attempts: int
    priority: int = 0
    revision: str | int | None = None
    lease_until: datetime | None = None
    worker_id: str | None = None
    lease_token: str | None = None
    error: str | None = None
    result: Any = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    #: The task function that runs it (`mongoq.Jobs`); None for a task of `run(handler)`.
    function: str | None = None
    #: Why the stored document cannot be used as a task (a field of the wrong type, written by
    #: hand or by another program), e.g. ``"field 'attempts' holds a string ('x')"``; None for
    #: every document mongoq wrote. Listings show such a task with this set (`read_task`).
    unreadable: str | None = None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Task:
        """The task of a stored document; raises one of `READ_ERRORS` for a document that is
        not one (`task_fault` then says which field)."""
        get = doc.get  # every claim reads one: positional, in the order of the fields
        attempts, priority = get("attempts", 0), get("priority", 0)
        return cls(
            doc["_id"],
            get("payload"),
            doc["status"],
            attempts if type(attempts) is int else _whole("attempts", attempts),
            priority if type(priority) is int else _whole("priority", priority),
            get("revision"),
            stored_instant(get("lease_until")),
            get("worker_id"),
            get("lease_token"),
            get("error"),
            get("result"),
            stored_instant(get("created_at")),
            stored_instant(get("updated_at")),
            get("function"),
        )

    def document(self, result: Any = None) -> dict[str, Any]:
        """The stored form of this task with `result` (what a completion leaves)."""
        return {
            "_id": self.id,
            "payload": self.payload,
            "revision": self.revision,
            "priority": self.priority,
            "status": DONE,
            "attempts": self.attempts,
            "lease_until": self.lease_until,
            "worker_id": self.worker_id,
            "lease_token": self.lease_token,
            "error": self.error,
            "result": result,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "function": self.function,
        }


def new_lease_token() -> str:
    """A claim's lease token: a random (version 4) UUID's 32 hex digits, as
    ``uuid.uuid4().hex`` writes it, without building the `uuid.UUID` (one a claim)."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # the RFC 4122 variant
    return raw.hex()


#: What `Task.from_document` raises for a document that is not a task's.
READ_ERRORS = (KeyError, TypeError, ValueError, OverflowError, AttributeError)
_INSTANTS = ("lease_until", "created_at", "updated_at")
_TEXTS = ("worker_id", "lease_token", "error", "function")


def _number(value: Any) -> bool:
    """A count or a priority as mongoq stores one: an int, or a finite float."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """`value` as an error text names it: its type, and a short sample."""
    names: dict[type, str] = {
        str: "a string", type(None): "null", bool: "a bool", int: "an int", dict: "a document",
        list: "an array", float: "a float", datetime: "a date",
    }  # fmt: skip
    name = next((n for kind, n in names.items() if isinstance(value, kind)), type(value).__name__)
    return f"{name} ({value!r:.40})" if value is not None else name


def _whole(field: str, value: Any) -> int:
    """A count or a priority stored as another number than an int (a shell's double, an
    Int64) as an int; ValueError for what is no number (a bool, a text, NaN: `task_fault`)."""
    if not _number(value):
        raise ValueError(f"{field} holds no number")
    return int(value)


def task_fault(doc: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of `doc` that makes it unusable as a task, and what it holds (``("attempts",
    "a string ('x')")``); None when every field has a type mongoq writes. Checked only after a
    read or a write failed: never on the path of a good task."""
    if "_id" not in doc:
        return "_id", "nothing"
    if doc.get("status") not in STATUSES:
        return "status", _kind(doc.get("status")) if "status" in doc else "nothing"
    for name in ("attempts", "priority"):
        if name in doc and not _number(doc[name]):
            return name, _kind(doc[name])
    for name in _INSTANTS:
        if doc.get(name) is not None and not isinstance(doc[name], datetime):
            return name, _kind(doc[name])
    if doc["status"] in (PENDING, PROCESSING) and doc.get("lease_until") is None:
        # Its due time, or its lease's end: without it no claim and no reclaim ever meets it.
        return "lease_until", _kind(doc["lease_until"]) if "lease_until" in doc else "nothing"
    for name in _TEXTS:
        if doc.get(name) is not None and not isinstance(doc[name], str):
            return name, _kind(doc[name])
    revision = doc.get("revision")
    if revision is not None and (isinstance(revision, bool) or not isinstance(revision, str | int)):
        return "revision", _kind(revision)
    return None


def describe_fault(fault: tuple[str, str]) -> str:
    """The text of a `task_fault`: ``field 'attempts' holds a string ('x')``."""
    return f"field {fault[0]!r} holds {fault[1]}"


def read_task(doc: Mapping[str, Any]) -> Task:
    """The task of a stored document for a listing or a page: `Task.from_document`, or, for a
    document that is not a task's, a `Task` of its readable fields with `unreadable` saying
    which field is wrong and `status` as stored (never an exception: one bad document never
    breaks a listing)."""
    fault = task_fault(doc)
    if fault is None:
        try:
            return Task.from_document(doc)
        except READ_ERRORS:
            fault = ("document", "a value mongoq cannot read")
    status = doc.get("status")
    return Task(
        doc.get("_id"),  # type: ignore[arg-type]  # whatever it is: the listing shows it
        doc.get("payload"),
        status if isinstance(status, str) else repr(status),  # type: ignore[arg-type]
        int(doc["attempts"]) if _number(doc.get("attempts")) else 0,
        int(doc["priority"]) if _number(doc.get("priority")) else 0,
        revision=doc.get("revision"),
        lease_until=stored_instant(doc.get("lease_until")),
        error=doc.get("error") if isinstance(doc.get("error"), str) else None,
        created_at=stored_instant(doc.get("created_at")),
        updated_at=stored_instant(doc.get("updated_at")),
        unreadable=describe_fault(fault),
    )


#: A result this small always fits: a put leaves the task document this much room (the
#: payload limit), well above the bookkeeping fields and a 2,000-character error.
_RESULT_ALWAYS_FITS = 32 * 1024


def check_result(field: str, task: Task, result: Any) -> None:
    """`result` is storable on `task`'s document: BSON-encodable, and the document with it stays
    within the server's 16 MiB (a server refuses the completion otherwise: code 17419)."""
    size = check_payload(field, result)
    if size <= _RESULT_ALWAYS_FITS:
        return
    stored = len(bson.encode(task.document(result)))
    if stored > MAX_DOCUMENT_BYTES:
        raise InvalidInput(
            field,
            f"encodes to {size} bytes; with the task's payload the document would take {stored} "
            f"bytes, over the server's limit of {MAX_DOCUMENT_BYTES} (16 MiB): store large "
            "results elsewhere (GridFS, object storage) and return a reference",
        )


@dataclass(frozen=True)
class NewTask:
    """One task for `AsyncTaskQueue.put_many`; the fields mean what `put`'s arguments mean."""

    task_id: TaskId
    payload: Any = None
    revision: str | int | None = None
    priority: int = 0
    delay: float = 0.0
    run_at: datetime | None = None
    function: str | None = None

    def due(self, now: datetime) -> datetime:
        """When the task is first claimable, put at `now`: `run_at`, else `now` + `delay`. A
        `run_at` in the past is `now`: due at once, behind the tasks already waiting."""
        if self.run_at is not None:
            return max(to_millis(self.run_at), now)
        return now + timedelta(seconds=self.delay) if self.delay else now


def check_new_task(spec: NewTask, prefix: str = "") -> NewTask:
    """`spec` checked (its fields named with `prefix`), with its delay as a float."""
    return new_task(
        spec.task_id, spec.payload, spec.revision, spec.priority, spec.delay, spec.run_at, prefix,
        function=spec.function,
    )  # fmt: skip


def new_task(
    task_id: Any,
    payload: Any,
    revision: Any,
    priority: Any,
    delay: Any,
    run_at: Any,
    prefix: str = "",
    *,
    function: Any = None,
) -> NewTask:
    """The `NewTask` of these fields (a put's arguments), each checked and named with
    `prefix`: an id, a storable payload and revision (within the payload limit together), a
    32-bit priority, and a delay in seconds (made a float) or a timezone-aware `run_at`, not
    both."""
    task_id = check_id(f"{prefix}task_id", task_id)
    size = check_payload(f"{prefix}payload", payload)
    if revision is not None:
        if isinstance(revision, bool) or not isinstance(revision, str | int):
            raise InvalidInput(f"{prefix}revision", "must be a string, an int or None")
        size += check_payload(f"{prefix}revision", revision)
        if size > MAX_PAYLOAD_BYTES:
            raise InvalidInput(
                f"{prefix}revision",
                f"payload and revision encode to {size} bytes together; the limit is "
                f"{MAX_PAYLOAD_BYTES}",
            )
    check_int(f"{prefix}priority", priority, low=-(2**31), high=2**31 - 1)
    delay = check_seconds(f"{prefix}delay", delay)
    if run_at is not None:
        if not isinstance(run_at, datetime) or run_at.utcoffset() is None:
            raise InvalidInput(f"{prefix}run_at", "must be a timezone-aware datetime or None")
        try:
            to_millis(run_at).astimezone(UTC)
        except OverflowError:
            raise InvalidInput(f"{prefix}run_at", "is out of range") from None
        if delay:
            raise InvalidInput(f"{prefix}run_at", "give a delay or a run_at, not both")
    if function is not None:
        function = check_function_name(f"{prefix}function", function)
    return NewTask(task_id, payload, revision, priority, delay, run_at, function)


def check_new_tasks(field: str, tasks: Iterable[NewTask]) -> list[NewTask]:
    """`tasks` checked as `check_new_task` does, each a `NewTask`, no id twice."""
    checked: list[NewTask] = []
    seen: dict[TaskId, int] = {}
    for index, spec in enumerate(list(tasks)):
        if not isinstance(spec, NewTask):
            raise InvalidInput(f"{field}[{index}]", f"must be a NewTask, got {type(spec).__name__}")
        spec = check_new_task(spec, f"{field}[{index}].")
        if spec.task_id in seen:
            raise InvalidInput(
                f"{field}[{index}].task_id", f"repeats {field}[{seen[spec.task_id]}].task_id"
            )
        seen[spec.task_id] = index
        checked.append(spec)
    return checked


@dataclass(frozen=True)
class PutManyResult:
    inserted: int
    updated: int
    unchanged: int


@dataclass(frozen=True)
class ReclaimResult:
    """What `reclaim_expired` did: tasks buried (attempts used up) and requeued."""

    failed: int
    requeued: int


@dataclass(frozen=True)
class TaskStats:
    """Counts per status, plus the signals an operator watches.

    `due` of the pending tasks are claimable now; `expired` processing tasks have a lease that
    ran out (their worker is gone or stuck); `oldest_due_age` is how long the oldest claimable
    task has waited, in seconds (None when none is due): the "queue is stuck" signal.

    `unknown_functions` counts the due tasks, by task function name, that no running `Jobs`
    worker of the queue runs (a misspelt name, a function not deployed yet): they wait,
    uncharged, for a worker that knows them. Plain tasks (put without a function, for
    `run(handler)`) are counted under ``""``: no `Jobs` worker runs them. "Running" is what
    the workers announce (`mongoq.tasks.presence`); a plain `run` announces nothing, so with
    no `Jobs` worker live the mapping is empty, and `oldest_due_age` is the signal. It counts
    among the 1,000 oldest due tasks: with more due, the counts are lower bounds (the tasks no
    worker claims are the oldest due ones, so they are found first).
    """

    counts: dict[str, int]
    due: int
    expired: int
    oldest_due_age: float | None
    unknown_functions: dict[str, int]


@dataclass(frozen=True)
class TaskPage:
    """One page of `list_tasks`: the tasks, and the cursor that continues after them (None on
    the last page). The cursor is a short text (``<ms>:<i|s>:<id>``), fit for a command line."""

    tasks: list[Task]
    next: str | None


@dataclass
class TaskRunSummary:
    """What a `run` loop did, by outcome."""

    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    lost: int = 0
    #: tasks cancelled while their handler ran (`AsyncTaskQueue.cancel`)
    cancelled: int = 0
    #: settles whose reply was lost: the task is settled or its lease will expire
    unknown: int = 0


#: What a schedule does with the ticks it missed (its workers were down): ``"once"`` runs the
#: latest of them once; ``"skip"`` runs none that is older than the schedule's `grace`.
MissedTicks = Literal["once", "skip"]


@dataclass(frozen=True)
class Schedule:
    """A periodic task of a queue (`AsyncTaskQueue.schedule`): each tick puts the task
    ``"<name>@<tick, UTC, ISO 8601>"`` with `payload` and `priority`, once whatever the number
    of workers ticking. `cron` (in `timezone`) or `every` (seconds from the first tick) says
    when; `next_at` is the next tick not yet put, `last_tick` the last one put."""

    name: str
    cron: str | None
    every: float | None
    timezone: str
    payload: Any
    priority: int
    missed: MissedTicks
    grace: float
    next_at: datetime
    last_tick: datetime | None
    #: The task function its tasks call (`mongoq.Jobs.periodic`); None for a plain schedule.
    function: str | None = None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Schedule:
        next_at = stored_instant(doc.get("next_at"))
        assert next_at is not None
        return cls(
            name=doc["_id"],
            cron=doc.get("cron"),
            every=doc.get("every"),
            timezone=doc.get("timezone", "UTC"),
            payload=doc.get("payload"),
            priority=int(doc.get("priority", 0)),
            missed=doc.get("missed", "once"),
            grace=float(doc.get("grace", 60.0)),
            next_at=next_at,
            last_tick=stored_instant(doc.get("last_tick")),
            function=doc.get("function"),
        )


def tick_task_id(name: str, tick: datetime) -> str:
    """The id of the task a schedule's tick puts, the same in every process:
    ``name@2026-12-01T10:00:00Z`` (milliseconds shown only when the tick has some)."""
    at = to_millis(tick).astimezone(UTC)
    millis = f".{at.microsecond // 1000:03d}" if at.microsecond else ""
    return f"{name}@{at:%Y-%m-%dT%H:%M:%S}{millis}Z"
