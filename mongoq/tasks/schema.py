"""The task queue's storage: the layout of its collections, their indexes, and every filter
and update `AsyncTaskQueue` sends, each a named function beside the index that serves it. No
I/O. The tasks' collection comes first; the schedules' (``{name}_schedules``) and the running
workers' (``{name}_workers``) are at the end.

Collection ``{name}``, one document per task::

    {_id: task_id, payload, revision, priority,
     status: "pending" | "processing" | "done" | "failed" | "cancelled" | "tombstone",
     attempts,          # claims so far, counted at claim; capped by max_attempts
     lease_until,       # processing: the lease's end; pending: "not before" (when it is due)
     worker_id, lease_token,   # the holder while processing (token is unique per claim);
                               # on a done task, the claim that completed it
     error,             # last error text, the last 2,000 characters
     result, created_at, updated_at}

Invariants the queries rest on:

- Only pending and processing tasks carry a ``lease_until`` (it is null in every other state),
  and a pending task always carries its due time there: the claim is one range of the ``claim``
  index, already in claim order, whose first key examined is the answer.
- Every path that makes a task pending leaves it with attempts to spare (a retry of an
  exhausted task fails it instead), so a pending task is always claimable; ``attempts < max``
  guards only the take-over of an expired lease. Exhausted expired leases, which the claim
  skips, are buried by `reclaim_expired`.
- Every holder's write is fenced on ``status: processing``, ``worker_id`` and the claim's
  ``lease_token`` (the slots of one worker share a worker id, and a worker may re-claim a task
  it lost), and a settle on the ``revision`` it claimed too: a put of a new revision under a
  holder makes the holder's settle miss, and the task is then requeued for the new revision.
- Tombstones are deleted by the *partial* TTL index ``tombstone_ttl`` (a bare TTL index on
  ``updated_at`` would empty the queue), and, when the queue sets `retain_done` /
  `retain_failed` / `retain_cancelled`, finished tasks by the index of that name (the same key,
  other partial filters: MongoDB 5.0+); the embedded backend cannot honour the partial filter
  and gets no TTL index (see `_driver.create_partial_ttl_index`).

Every time is the injected clock's (`mongoq.clock`), passed in as ``now``, never ``$$NOW``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from mongoq import _driver
from mongoq._collections import SCHEDULES_SUFFIX, WORKERS_SUFFIX
from mongoq._indexes import IndexSpec
from mongoq.clock import to_millis
from mongoq.tasks.models import (
    CANCELLED,
    DONE,
    FAILED,
    PENDING,
    PROCESSING,
    TOMBSTONE,
    NewTask,
    Task,
    TaskId,
    TaskStatus,
)

__all__ = [
    "CLAIM",
    "CLAIM_INDEX",
    "CLAIM_ORDER",
    "DUE_ORDER",
    "EXPIRED_ON_LAST_ATTEMPT",
    "INDEXES",
    "IndexSpec",
    "LIST_ORDER",
    "PURGEABLE",
    "RETAIN_CANCELLED",
    "RETAIN_DONE",
    "RETAIN_FAILED",
    "SCHEDULES_SUFFIX",
    "STATUS_LEASE",
    "STATUS_UPDATED",
    "TOMBSTONE_TTL",
    "UNUSABLE_EXPIRED",
    "UNUSABLE_PRIORITY_EXPIRED",
    "WITHOUT_PAYLOADS",
    "WORKERS_SUFFIX",
    "WORKER_EXPIRY",
    "WORKER_EXPIRY_SLACK",
    "task_as_claimed",
    "task_burying",
    "task_by_id",
    "task_cancellable",
    "task_cancelling",
    "task_claimable",
    "task_claiming",
    "task_completing",
    "task_due",
    "task_expired",
    "task_expired_exhausted",
    "task_expired_retryable",
    "task_extending",
    "task_failed",
    "task_failing",
    "task_fields_as_read",
    "task_held",
    "task_held_at_revision",
    "task_in_status",
    "task_pending_fields",
    "task_putting",
    "task_reclaiming",
    "task_releasing",
    "task_removable",
    "task_removing",
    "task_requeuing",
    "task_retrying",
    "task_setting_aside",
    "task_taken_by",
    "task_unchanged",
    "tasks_buried_unusable",
    "tasks_cancelled",
    "tasks_claimed",
    "tasks_done",
    "tasks_failed",
    "tasks_finished_between",
    "tasks_held",
    "tasks_listed",
    "tasks_purgeable",
    "tasks_unfinished",
    "worker_announcing",
    "worker_by_id",
    "workers_live",
]


# ------------------------------------------------------------------------- the claim index

CLAIM_INDEX = "claim"
CLAIM = IndexSpec(CLAIM_INDEX, (("priority", -1), ("lease_until", 1)))
#: Highest priority first, then the task due longest.
CLAIM_ORDER = list(CLAIM.keys)


def task_claimable(
    now: datetime, max_attempts: int, functions: Sequence[str] | None = None
) -> dict[str, Any]:
    """The due tasks: `claim`, `claim_many` (sorted by `CLAIM_ORDER`, hinted to ``claim``).
    With `functions`, only the tasks of these task functions: the index range is the same,
    and a due task of another function is read and passed over (never claimed)."""
    if functions is not None:
        return {**task_claimable(now, max_attempts), "function": {"$in": list(functions)}}
    return {
        "lease_until": {"$lte": now},
        "$or": [
            {"status": PENDING},
            {
                "status": PROCESSING,
                "lease_until": {"$lt": now},  # a lease ending at `now` still holds
                "attempts": {"$lt": max_attempts},
            },
        ],
    }


def task_claiming(worker: str, token: str, now: datetime, lease_ttl: float) -> dict[str, Any]:
    """The claim of a `task_claimable` task by `worker`'s claim `token`; counts an attempt."""
    return {
        "$set": {
            "status": PROCESSING,
            "worker_id": worker,
            "lease_token": token,
            "lease_until": now + timedelta(seconds=lease_ttl),
            "updated_at": now,
        },
        "$inc": {"attempts": 1},
    }


def task_taken_by(token: str, lease_until: datetime) -> dict[str, Any]:
    """The tasks one claim stamped (its `token`, the lease end it wrote): `claim_many`'s read
    back after the server refused its update part-way for a malformed document
    (``status_lease``: one equality range)."""
    return {"status": PROCESSING, "lease_until": lease_until, "lease_token": token}


def task_as_claimed(before: Mapping[str, Any], claiming: Mapping[str, Any]) -> dict[str, Any]:
    """The document `task_claiming`'s update `claiming` makes of `before` (no query): the
    claim asks for the document as it was, to read when the task fell due, and derives the
    claimed one from the update itself rather than a second description of it."""
    if not _CLAIM_OPERATORS.issuperset(claiming):
        raise ValueError(f"task_as_claimed cannot apply {sorted(claiming)}")
    after = dict(before)
    for name, value in claiming.get("$set", {}).items():
        after[name] = to_millis(value) if isinstance(value, datetime) else value  # as stored
    for name, step in claiming.get("$inc", {}).items():
        after[name] = after.get(name, 0) + step
    return after


#: The update operators `task_as_claimed` applies.
_CLAIM_OPERATORS = frozenset({"$set", "$inc"})


# ------------------------------------------------------------------- the status_lease index

STATUS_LEASE = IndexSpec("status_lease", (("status", 1), ("lease_until", 1)))
#: The task due longest first.
DUE_ORDER = [("lease_until", 1)]
EXPIRED_ON_LAST_ATTEMPT = "lease expired on the last attempt (worker crashed or stalled)"


def task_in_status(status: TaskStatus) -> dict[str, Any]:
    """The tasks in `status`: `stats`' counts (``status_lease``)."""
    return {"status": status}


def task_due(now: datetime) -> dict[str, Any]:
    """The pending tasks due at `now`: `stats`' due count, oldest due and count of the oldest
    due by task function, a `Jobs` worker's count of those it does not run
    (``status_lease``)."""
    return {"status": PENDING, "lease_until": {"$lte": now}}


def tasks_unfinished(functions: Sequence[str] | None = None) -> dict[str, Any]:
    """The pending and processing tasks (of `functions` only, when given), the first by
    `DUE_ORDER`: when a drained `run` wakes next (``status_lease``, one range per status,
    merged)."""
    if functions is not None:
        return {"status": {"$in": [PENDING, PROCESSING]}, "function": {"$in": list(functions)}}
    return {"status": {"$in": [PENDING, PROCESSING]}}


def task_expired(now: datetime) -> dict[str, Any]:
    """The tasks whose lease ran out: `stats`' expired count (``status_lease``)."""
    return {"status": PROCESSING, "lease_until": {"$lt": now}}


def task_expired_exhausted(now: datetime, max_attempts: int) -> dict[str, Any]:
    """Expired on their last attempt, or with attempts that are no number (a hand edit,
    missing: no claim can take them over, nor a requeue count them): `reclaim_expired` buries
    them (``status_lease``)."""
    no_number = {"attempts": {"$not": {"$type": "number"}}}
    nan = {"attempts": dict(_NAN)}  # a number no comparison with max_attempts matches
    return {**task_expired(now), "$or": [{"attempts": {"$gte": max_attempts}}, no_number, nan]}


def task_expired_retryable(now: datetime, max_attempts: int) -> dict[str, Any]:
    """Expired with attempts to spare: `reclaim_expired` requeues them (``status_lease``)."""
    return {**task_expired(now), "attempts": {"$lt": max_attempts}}


#: NaN, the one number below -infinity (and equal to nothing, in the embedded backend).
_NAN = MappingProxyType({"$type": "number", "$not": {"$gte": float("-inf")}})
#: The error of a task `reclaim_expired` buried because its attempts are no number.
UNUSABLE_EXPIRED = (
    "unreadable task document: field 'attempts' holds no number; set aside when its lease expired"
)
#: The same for a task whose priority is no number (its claim could not read it, and the
#: set-aside's write did not go through).
UNUSABLE_PRIORITY_EXPIRED = UNUSABLE_EXPIRED.replace("'attempts'", "'priority'")


def task_burying(now: datetime) -> list[dict[str, Any]]:
    """`reclaim_expired`'s end of a `task_expired_exhausted` task: failed, with the error that
    says which of the two it was (a pipeline: one command for both)."""
    counted = _is_count("$attempts")
    ranked = _is_count({"$ifNull": ["$priority", 0]})
    last = {"$cond": [ranked, EXPIRED_ON_LAST_ATTEMPT, UNUSABLE_PRIORITY_EXPIRED]}
    error = {"$cond": [counted, last, UNUSABLE_EXPIRED]}
    return [{"$set": {**task_failing(now, None)["$set"], "error": error}}]


def _is_count(value: Any) -> dict[str, Any]:
    """Whether `value` (an expression) is a number other than NaN (the one below -inf)."""
    return {"$and": [{"$isNumber": value}, {"$gte": [value, float("-inf")]}]}


def tasks_buried_unusable(now: datetime) -> dict[str, Any]:
    """The tasks a `task_burying` at `now` set aside for a field no claim can use:
    `reclaim_expired`'s read of which, only when it buried some (``status_updated``: one
    equality range)."""
    return {
        "status": FAILED,
        "updated_at": now,
        "error": {"$in": [UNUSABLE_EXPIRED, UNUSABLE_PRIORITY_EXPIRED]},
    }


def task_reclaiming(now: datetime) -> dict[str, Any]:
    """`reclaim_expired`'s return of a `task_expired_retryable` task: due now, attempts kept."""
    return {"$set": task_pending_fields(now, now, None)}


# ------------------------------------------------------------------ the tombstone_ttl index

TOMBSTONE_TTL = IndexSpec(
    "tombstone_ttl",
    (("updated_at", 1),),
    partial=MappingProxyType({"status": TOMBSTONE}),
    ttl=True,
)


def task_removable(task_id: TaskId) -> dict[str, Any]:
    """The task unless already a tombstone: `remove` (``_id``)."""
    return {"_id": task_id, "status": {"$ne": TOMBSTONE}}


def task_removing(now: datetime) -> dict[str, Any]:
    """`remove`: a tombstone, never claimed again, which ``tombstone_ttl`` deletes in time."""
    return {
        "$set": {
            "status": TOMBSTONE,
            "lease_until": None,
            "lease_token": None,
            "updated_at": now,
        }
    }


# ----------------------------------------------------------------- the status_updated index

STATUS_UPDATED = IndexSpec("status_updated", (("status", 1), ("updated_at", 1), ("_id", 1)))
#: The listing's order: least recently changed first, the id breaking ties (a stable order).
LIST_ORDER = [("updated_at", 1), ("_id", 1)]
#: A listing's projection without the user's values (`list_tasks(payloads=False)`): each is
#: up to 16 MiB; every other field is small.
WITHOUT_PAYLOADS = MappingProxyType({"payload": 0, "result": 0})
#: The states an operator may purge: finished ones, never work still to do.
PURGEABLE: tuple[TaskStatus, ...] = (DONE, FAILED, CANCELLED, TOMBSTONE)


def tasks_listed(
    statuses: Sequence[TaskStatus], after: tuple[datetime, TaskId] | None
) -> dict[str, Any]:
    """`list_tasks`: the tasks in `statuses` after the cursor `after` (the last listed task's
    ``updated_at`` and id) in `LIST_ORDER`; ``status_updated`` (one range per status, merged).

    Ids are strings or ints, and a server compares an id only with ids of its own type
    (numbers sort before strings): after an int id, every string id of the same instant
    follows too."""
    listed: dict[str, Any] = {"status": {"$in": list(statuses)}}
    if after is None:
        return listed
    at, last = after
    listed["$or"] = [{"updated_at": {"$gt": at}}, {"updated_at": at, **_driver.ids_after(last)}]
    return listed


def tasks_purgeable(status: TaskStatus, before: datetime) -> dict[str, Any]:
    """`purge`: the tasks in a finished `status` last changed before `before`;
    ``status_updated``."""
    return {"status": status, "updated_at": {"$lt": before}}


def tasks_finished_between(since: datetime, until: datetime | None) -> dict[str, Any]:
    """`count_finished`: the done, failed and cancelled tasks last changed at or after
    `since` and before `until`; ``status_updated`` (a range per status)."""
    return {
        "status": {"$in": [DONE, FAILED, CANCELLED]},
        "updated_at": _driver.within(since, until),
    }


def tasks_failed(task_ids: Sequence[TaskId] | None) -> dict[str, Any]:
    """`requeue_failed`: the failed tasks (of `task_ids`, if given); ``status_updated`` (or
    ``_id``)."""
    failed: dict[str, Any] = {"status": FAILED}
    if task_ids is not None:
        failed["_id"] = {"$in": list(task_ids)}
    return failed


# ------------------------------------------------------- the retain_done / retain_failed TTLs

#: Finished tasks are deleted this long after they finished, when the queue's `retain_done` /
#: `retain_failed` is set (partial TTL indexes, like ``tombstone_ttl``).
RETAIN_DONE = IndexSpec(
    "retain_done", (("updated_at", 1),), partial=MappingProxyType({"status": DONE}), ttl=True
)
RETAIN_FAILED = IndexSpec(
    "retain_failed", (("updated_at", 1),), partial=MappingProxyType({"status": FAILED}), ttl=True
)
RETAIN_CANCELLED = IndexSpec(
    "retain_cancelled", (("updated_at", 1),), partial=MappingProxyType({"status": CANCELLED}),
    ttl=True,
)  # fmt: skip


INDEXES: tuple[IndexSpec, ...] = (
    CLAIM,
    STATUS_LEASE,
    STATUS_UPDATED,
    TOMBSTONE_TTL,
    RETAIN_DONE,
    RETAIN_FAILED,
    RETAIN_CANCELLED,
)

# ------------------------------------------------------------------ by _id (always indexed)


def task_by_id(task_id: TaskId) -> dict[str, Any]:
    """One task: `put`, `put_many`, `get`."""
    return {"_id": task_id}


def _when(condition: Any, new: Any, current: str) -> dict[str, Any]:
    """`new` where `condition` holds, else the field `current` (``"$name"``) as it is."""
    return {"$cond": [condition, new, current]}


def task_putting(spec: NewTask, now: datetime) -> list[dict[str, Any]]:
    """The pipeline of an idempotent put (see `AsyncTaskQueue.put`), upserted on `task_by_id`.
    User values go through ``$literal``: a string such as ``"$x"`` would otherwise read a
    field."""
    # Fields are read through $ifNull: comparisons with a missing field differ between
    # the server and the embedded backend; with null they agree.
    status = {"$ifNull": ["$status", None]}
    is_new = {"$eq": [status, None]}
    if spec.revision is None:
        fresh: Any = is_new
    else:
        stored_revision = {"$ifNull": ["$revision", None]}
        fresh = {"$or": [is_new, {"$ne": [stored_revision, {"$literal": spec.revision}]}]}
    reset = {"$and": [fresh, {"$ne": [status, PROCESSING]}]}
    due = spec.due(now)
    return [
        {
            "$set": {
                "payload": _when(fresh, {"$literal": spec.payload}, "$payload"),
                "revision": _when(fresh, {"$literal": spec.revision}, "$revision"),
                "priority": _when(fresh, spec.priority, "$priority"),
                "status": _when(reset, PENDING, "$status"),
                # Fresh attempts for a new revision even while it is processing: should
                # the holder crash, the takeover runs the new revision with all its tries.
                "attempts": _when(fresh, 0, "$attempts"),
                "lease_until": _when(reset, due, "$lease_until"),
                "worker_id": _when(reset, None, "$worker_id"),
                "lease_token": _when(reset, None, "$lease_token"),
                "error": _when(reset, None, "$error"),
                "result": _when(reset, None, "$result"),
                "created_at": {"$ifNull": ["$created_at", now]},
                "updated_at": _when(fresh, now, "$updated_at"),
                # A task function's name, set (or cleared, by a plain put) with the payload it
                # reads: a fresh put never leaves the call of one beside the payload of another.
                "function": _when(fresh, {"$literal": spec.function}, "$function"),
            }
        }
    ]


def tasks_claimed(ids: Sequence[TaskId], token: str) -> dict[str, Any]:
    """Which of the candidates `ids` the claim `token` took: `claim_many`'s read back."""
    return {"_id": {"$in": list(ids)}, "lease_token": token}


def task_held(task: Task) -> dict[str, Any]:
    """The fence: `task` still held by the claim that returned it (`heartbeat`, the requeue of
    a settle that missed)."""
    return {
        "_id": task.id,
        "status": PROCESSING,
        "worker_id": task.worker_id,
        "lease_token": task.lease_token,
    }


def task_held_at_revision(task: Task) -> dict[str, Any]:
    """`task_held`, and at the revision it claimed: every settle (`complete`, `complete_many`,
    `release_for_retry`, `release_not_an_attempt`, `fail`)."""
    fence = task_held(task)
    fence["revision"] = task.revision
    return fence


def tasks_held(tasks: Sequence[Task]) -> dict[str, Any]:
    """Those of `tasks` still held: `heartbeat_many`'s update and its read of which are."""
    # The token names the claim, and with it the worker: one `$in` per claim.
    return {
        "status": PROCESSING,
        **_driver.owned_by([(task.id, task.lease_token) for task in tasks], "lease_token"),
    }


def tasks_done(ids: Sequence[TaskId]) -> dict[str, Any]:
    """Those of `ids` that are done: `complete_many`'s read of which it completed."""
    return {"_id": {"$in": list(ids)}, "status": DONE}


def task_cancellable(task_id: TaskId) -> dict[str, Any]:
    """The task if pending or processing: `cancel`; by ``_id``."""
    return {"_id": task_id, "status": {"$in": [PENDING, PROCESSING]}}


def task_cancelling(now: datetime) -> dict[str, Any]:
    """Cancelled (on `task_cancellable`), terminal: its holder, if any, no longer matches any
    fence (its next renewal finds out, and its handler is cancelled)."""
    return {
        "$set": {"status": CANCELLED, "lease_until": None, "lease_token": None, "updated_at": now}
    }


def tasks_cancelled(task_ids: Sequence[TaskId]) -> dict[str, Any]:
    """Those of `task_ids` cancelled: a holder (or a batch) telling a cancel from a loss; by
    ``_id``."""
    return {"_id": {"$in": list(task_ids)}, "status": CANCELLED}


def task_unchanged(doc: Mapping[str, Any], due: Mapping[str, Any]) -> dict[str, Any]:
    """A set-aside's fence: the task read as `doc`, still matching `due` (the filter it was
    read by), still holding the lease token it was read with; by ``_id``. A task that changed
    meanwhile (put again, claimed) is left alone."""
    return {**due, "_id": doc["_id"], "lease_token": doc.get("lease_token")}


def task_fields_as_read(doc: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """A set-aside's fence on `fields` as `doc` held them (missing ones still missing): a put
    that rewrote the task meanwhile (a new revision, fields made right) makes it match
    nothing. A NaN, which equals nothing in the embedded backend, is matched as the only number
    below every other."""
    fence: dict[str, Any] = {}
    for name in fields:
        if name not in doc:
            fence[name] = {"$exists": False}
        elif isinstance(doc[name], float) and doc[name] != doc[name]:
            fence[name] = dict(_NAN)
        else:
            fence[name] = {"$eq": doc[name]}
    return fence


def task_setting_aside(now: datetime, error: str) -> dict[str, Any]:
    """A task document no worker can use, failed with `error` (which names the field): its
    other fields are left as they were, for whoever looks."""
    return task_failing(now, error)


def task_failed(task_id: TaskId) -> dict[str, Any]:
    """The task if failed: `requeue`."""
    return {"_id": task_id, "status": FAILED}


def task_pending_fields(now: datetime, due: datetime, attempts: int | None) -> dict[str, Any]:
    """The fields of a pending task due at `due`, with `attempts` reset unless None."""
    fields: dict[str, Any] = {
        "status": PENDING,
        "lease_until": due,
        "worker_id": None,
        "lease_token": None,
        "updated_at": now,
    }
    if attempts is not None:
        fields["attempts"] = attempts
    return fields


def task_requeuing(now: datetime) -> dict[str, Any]:
    """Pending now with fresh attempts: `requeue` of a `task_failed` task; a `task_held` task
    whose revision changed under its holder (after a settle that missed)."""
    return {"$set": task_pending_fields(now, now, 0)}


def task_extending(now: datetime, lease_ttl: float) -> dict[str, Any]:
    """A renewed lease, `lease_ttl` from `now`: `heartbeat`, `heartbeat_many`."""
    # `$max`: two renewals of one holder in flight at once (a batch's and one item's) may
    # apply in either order; the older one must not move the lease back.
    return {
        "$max": {"lease_until": now + timedelta(seconds=lease_ttl)},
        "$set": {"updated_at": now},
    }


def task_completing(result: Any, now: datetime) -> dict[str, Any]:
    """Done with `result`: `complete`, `complete_many`."""
    # The token stays: it tells which claim completed the task (see `complete_many`), and
    # every settle requires ``processing``, so it fences nothing any more.
    return {"$set": {"status": DONE, "result": result, "lease_until": None, "updated_at": now}}


def task_retrying(now: datetime, due: datetime, error: str | None) -> dict[str, Any]:
    """Pending again at `due`, the attempt counted: `release_for_retry`."""
    return {"$set": task_pending_fields(now, due, None) | {"error": error}}


def task_releasing(now: datetime, due: datetime) -> list[dict[str, Any]]:
    """Pending again at `due`, the attempt given back: `release_not_an_attempt`."""
    fields = task_pending_fields(now, due, None)
    # Never below 0: a revision reset may have zeroed the count since this claim.
    fields["attempts"] = {"$max": [{"$subtract": ["$attempts", 1]}, 0]}
    return [{"$set": fields}]


def task_failing(now: datetime, error: str | None) -> dict[str, Any]:
    """Failed with `error`, until an operator requeues it: `fail`, `reclaim_expired`."""
    return {
        "$set": {
            "status": FAILED,
            "error": error,
            "lease_until": None,
            "lease_token": None,
            "updated_at": now,
        }
    }


# -------------------------------------------------------------------------------- schedules
# Collection ``{name}_schedules``, one document per schedule (`mongoq.tasks.schedules`):
# ``{_id: schedule name, cron?, every?, timezone, payload, priority, missed, grace, spec
# (a digest of what defines it), anchor (the first tick, for `every`), next_at (the next tick
# not put yet), last_tick, created_at, updated_at}``.

#: Serves the ticker's read of the due schedules and of the next one, in `SCHEDULE_ORDER`.
SCHEDULE_DUE = IndexSpec("next_at", (("next_at", 1),))
SCHEDULE_ORDER = [("next_at", 1)]


def schedule_by_name(name: str) -> dict[str, Any]:
    """One schedule: its listing, its removal; by ``_id``."""
    return {"_id": name}


def schedule_redefined(name: str, spec: str) -> dict[str, Any]:
    """`schedule`'s upsert: the schedule unless it is defined so already (its ``spec``); by
    ``_id`` (an unchanged one makes the upsert a duplicate key: nothing changes)."""
    return {"_id": name, "spec": {"$ne": spec}}


def schedule_defining(
    fields: Mapping[str, Any], next_at: datetime, now: datetime
) -> dict[str, Any]:
    """`schedule`'s update (on `schedule_redefined`): the definition, its first tick."""
    return {
        "$set": {**fields, "anchor": next_at, "next_at": next_at, "updated_at": now},
        "$setOnInsert": {"created_at": now, "last_tick": None},
    }


def schedules_by_next() -> dict[str, Any]:
    """Every schedule, in `SCHEDULE_ORDER`: the ticker's read (the due ones and the next one
    after them), `schedules`; ``next_at``."""
    return {}


def schedule_at(name: str, next_at: datetime) -> dict[str, Any]:
    """A tick's advance, fenced on the next tick it read (another ticker that advanced first
    makes it match nothing); by ``_id``."""
    return {"_id": name, "next_at": next_at}


def schedule_advancing(
    next_at: datetime, last_tick: datetime | None, now: datetime
) -> dict[str, Any]:
    """A tick's advance (on `schedule_at`): the next tick, and the one just put, if any."""
    fields: dict[str, Any] = {"next_at": next_at, "updated_at": now}
    if last_tick is not None:
        fields["last_tick"] = last_tick
    return {"$set": fields}


# ---------------------------------------------------------------------------------- workers
# Collection ``{name}_workers``, one document per running `Jobs` worker of the queue
# (`mongoq.tasks.presence`): ``{_id: worker id, functions: [the task functions it runs, sorted],
# seen: its last announcement, expires: when it counts as gone unless it announces again}``.
# A worker announces itself when it starts and at each housekeeping round, and deletes its
# document when its run ends; a killed worker's document counts no more from ``expires`` on.

#: Deletes, an hour after its ``expires``, the presence of a worker that could not withdraw it
#: (killed): TTL. Only clean-up: readers filter on ``expires`` themselves (served by this
#: index), and the hour keeps the server's wall clock, which TTL goes by, from deleting a live
#: worker's presence when the queue's clock runs behind it.
WORKER_EXPIRY = IndexSpec("expires", (("expires", 1),), ttl=True, whole=True)
#: The hour: seconds after ``expires`` the TTL index deletes a presence.
WORKER_EXPIRY_SLACK = 3600


def worker_by_id(worker_id: str) -> dict[str, Any]:
    """One worker's presence: its announcement (upserted) and its withdrawal; by ``_id``."""
    return {"_id": worker_id}


def worker_announcing(functions: Sequence[str], now: datetime, expires: datetime) -> dict[str, Any]:
    """An announcement (upserted on `worker_by_id`): the task functions the worker runs, and
    until when it counts as running without announcing again."""
    return {"$set": {"functions": sorted(functions), "seen": now, "expires": expires}}


def workers_live(now: datetime) -> dict[str, Any]:
    """The presences not expired at `now`: `stats`' read of the task functions some running
    worker runs (``expires``)."""
    return {"expires": {"$gt": now}}
