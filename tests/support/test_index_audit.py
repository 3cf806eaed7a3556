"""Index audit: every query the library issues is served by an index `setup()` declares.

The workload below drives both primitives' whole API on the embedded backend through
``instrument(db, counter)`` with ``counter.record = True``. Every recorded command that selects
documents is then checked against its collection's declared indexes (``index_information()``)
by `served_by`, a deliberately small matcher:

- A filter's *shape* is its equality fields (a literal value, ``None`` included, ``$eq`` or
  ``$in``), its range fields (``$lt``, ``$lte``, ``$gt``, ``$gte``) and its sort. Other
  operators (``$ne``, ``$exists``, ``$expr``...) are residual: tested on the documents an index
  yields, never what picks the index.
- An index serves a shape when its leading keys are equality fields, and then either the sort
  follows in the index's key order (all in its direction or all reversed; sort fields an
  equality pins drop out), or, with no sort, at most one range field follows; and the index
  narrows or orders the scan at all (an empty shape is a collection scan). Every equality field
  must be one of those leading keys, or a key after the ones the walk is bounded or ordered on
  (``handler`` last in the outbox's claim index, after the sort): that one is tested on the
  index entries, no document fetched for it, but it bounds nothing, so it never picks the index.
- A partial index (`Partial`) holds only the documents its ``partialFilterExpression`` matches,
  so it serves a query only if the query implies that filter: each of its conditions is an
  equality the query makes to the same value, or ``$exists: true`` and the query has
  ``$exists: true`` or an equality to a value other than ``None`` on that field (anything else in
  a partial filter is not modelled: never implied). An equality the filter pins needs no key: the
  index holds no other value. An index picked by such a pin alone (no key used, no sort) is one a
  server plans only when hinted (its planner looks only at indexes whose keys the query uses).
- ``_id`` is always indexed and unique: an ``_id`` equality or ``$in`` is served by ``_id``
  whatever else the filter says.
- ``$or``: served if the conjunction outside it is (the ``$or`` then filters that index range,
  as the task claim does by design), or else if every branch, with that conjunction, is (the
  server's OR plan). ``$and`` is flattened.
- A hint must name a declared index, and that index must serve the query.
- Aggregations: their leading ``$match``, and each ``$lookup``'s foreign field. Bulk writes:
  each operation's filter.

Shapes that are unindexed on purpose, or known library problems awaiting a fix, are listed in
`UNINDEXED` with the reason; an entry the workload no longer produces fails the test, so the
list cannot go stale. With ``MONGOQ_TEST_URI`` set, the claim queries are also explained on the
real server and must show no ``COLLSCAN``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from mongoq import (
    AsyncGroupTransport,
    AsyncTaskQueue,
    GroupLease,
    NewMessage,
    NewTask,
    PermanentError,
    Task,
)
from mongoq.outbox import AsyncOutbox, Event
from mongoq.tasks.schema import INDEXES as TASK_INDEXES
from mongoq.testing import CommandCounter, ManualClock, Operation, instrument, memory_database

TASKS = "audit_tasks"
PREFIX = "audit"
MESSAGES, LOCKS, COUNTERS, DEAD = (
    f"{PREFIX}_{kind}" for kind in ("messages", "locks", "counters", "dead")
)
FAR = datetime(2100, 1, 1, tzinfo=UTC)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

Keys = list[tuple[str, int]]

# ------------------------------------------------------------------------------- the matcher

EQUALITY_OPERATORS = frozenset({"$eq", "$in"})  # $in counts as equality: a few point ranges
RANGE_OPERATORS = frozenset({"$lt", "$lte", "$gt", "$gte"})


@dataclass(frozen=True)
class Shape:
    """What an index can use in a query: equality fields, range fields and the sort; and every
    condition of the conjunction by field, against which a partial filter is checked."""

    equality: frozenset[str] = frozenset()
    ranges: frozenset[str] = frozenset()
    sort: tuple[tuple[str, int], ...] = ()
    conditions: tuple[tuple[str, Any], ...] = ()

    def merged(self, other: Shape) -> Shape:
        return Shape(
            self.equality | other.equality,
            self.ranges | other.ranges,
            self.sort,
            self.conditions + other.conditions,
        )


@dataclass(frozen=True)
class Partial:
    """A partial index: its keys and its ``partialFilterExpression``."""

    keys: Keys
    filter: Mapping[str, Any]


#: A declared index: its keys, or a `Partial` one.
Index = Keys | Partial


def _is_operators(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(str(k).startswith("$") for k in value)


def _kind(value: Any) -> str:
    if _is_operators(value):
        if set(value) & EQUALITY_OPERATORS:
            return "equality"
        if set(value) & RANGE_OPERATORS:
            return "range"
        return "residual"
    return "equality"  # a literal (None, a document) is an equality match


def shape_of(
    filter: Mapping[str, Any], sort: Sequence[tuple[str, int]] = ()
) -> tuple[Shape, list[list[Mapping[str, Any]]]]:
    """The shape of a filter's conjunction (``$and`` flattened) and its ``$or`` clauses."""
    equality: set[str] = set()
    ranges: set[str] = set()
    conditions: list[tuple[str, Any]] = []
    clauses: list[list[Mapping[str, Any]]] = []

    def walk(part: Mapping[str, Any]) -> None:
        for key, value in part.items():
            if key == "$and":
                for sub in value:
                    walk(sub)
            elif key == "$or":
                clauses.append(list(value))
            elif key.startswith("$"):
                continue  # $expr, $nor, $comment: residual
            else:
                conditions.append((key, value))
                if (kind := _kind(value)) == "equality":
                    equality.add(key)
                elif kind == "range":
                    ranges.add(key)

    walk(filter)
    shape = Shape(frozenset(equality), frozenset(ranges - equality), tuple(sort), tuple(conditions))
    return shape, clauses


def _single_value(condition: Any) -> tuple[bool, Any]:
    """(True, value) when `condition` is an equality to exactly one value (a literal or $eq)."""
    if not _is_operators(condition):
        return True, condition
    if set(condition) == {"$eq"}:
        return True, condition["$eq"]
    return False, None


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _implies_exists(condition: Any) -> bool:
    """Whether a query condition implies ``$exists: true``: it says so, or it is an equality
    to a value other than None (a missing field matches only null)."""
    if _is_operators(condition) and condition.get("$exists") is True:
        return True
    single, value = _single_value(condition)
    return single and value is not None


def pinned_by(partial: Mapping[str, Any], shape: Shape) -> frozenset[str] | None:
    """If the query implies the partial filter, the fields the filter pins to the one value the
    query's equality gives them (the index holds no other value of them); else None."""
    pinned: set[str] = set()
    parts = list(partial.items())
    while parts:
        field_name, wanted = parts.pop()
        if field_name == "$and":
            parts += [item for sub in wanted for item in sub.items()]
            continue
        if field_name.startswith("$"):
            return None  # $or, $expr... in a partial filter: not modelled, never implied
        have = [condition for name, condition in shape.conditions if name == field_name]
        if _is_operators(wanted) and wanted == {"$exists": True}:
            if not any(_implies_exists(condition) for condition in have):
                return None
            continue
        single, value = _single_value(wanted)
        if not single or not any(
            _single_value(condition)[0] and _same(_single_value(condition)[1], value)
            for condition in have
        ):
            return None  # ranges and other operators in a partial filter: not modelled
        pinned.add(field_name)
    return frozenset(pinned)


def index_serves(
    keys: Keys, shape: Shape, partial: Mapping[str, Any] | None = None, *, hinted: bool = False
) -> bool:
    """Equality fields first, then the sort or one range field, in the index's key order; any
    other equality field pinned by the partial filter, or a key after those."""
    pinned: frozenset[str] = frozenset()
    if partial is not None:
        implied = pinned_by(partial, shape)
        if implied is None:
            return False  # the index may lack documents the query matches: never used
        pinned = implied
    if keys[0][0] == "_id" and "_id" in shape.equality:
        return True  # unique: at most one document per value
    fields = [name for name, _ in keys]
    used = 0
    while used < len(keys) and fields[used] in shape.equality:
        used += 1
    walked = used  # the keys the walk is bounded or ordered on
    sort = [(name, direction) for name, direction in shape.sort if name not in shape.equality]
    if sort:
        following = keys[used : used + len(sort)]
        if [name for name, _ in following] != [name for name, _ in sort]:
            return False  # an in-memory sort of everything the filter matches
        # One walk direction for the whole sort: forwards, or every key backwards.
        if len({d * k for (_, d), (_, k) in zip(sort, following, strict=True)}) != 1:
            return False
        walked += len(sort)
    elif used < len(keys) and fields[used] in shape.ranges:
        walked += 1
    if not shape.equality - pinned - set(fields[:used]) <= set(fields[walked:]):
        return False  # an equality field the index cannot test: more documents examined
    return bool(sort) or walked > 0 or (hinted and bool(pinned))


def served_by(
    indexes: Mapping[str, Index],
    filter: Mapping[str, Any],
    sort: Sequence[tuple[str, int]] = (),
    hint: Any = None,
) -> str | None:
    """The index (or, for an OR plan, the indexes) that serves the query; None if none does."""
    candidates = dict(indexes)
    if hint is not None:
        name = hint if isinstance(hint, str) else _index_named(indexes, _keys(hint))
        if name is None or name not in indexes:
            return None  # a hint must name a declared index (a server refuses the query)
        candidates = {name: indexes[name]}
    hinted = hint is not None

    def serving(shape: Shape) -> str | None:
        for name, index in candidates.items():
            keys, partial = _parts(index)
            if index_serves(keys, shape, partial, hinted=hinted):
                return name
        return None

    shape, clauses = shape_of(filter, sort)
    if (name := serving(shape)) is not None:
        return name
    if not clauses:
        return None
    plan = []
    for clause in clauses:
        for branch in clause:
            branch_shape, nested = shape_of(branch)
            chosen = serving(shape.merged(branch_shape))
            if chosen is None or nested:
                return None  # one unindexed branch scans the collection
            plan.append(chosen)
    return "$or: " + ", ".join(sorted(set(plan)))


def _parts(index: Index) -> tuple[Keys, Mapping[str, Any] | None]:
    if isinstance(index, Partial):
        return index.keys, index.filter
    return index, None


def _keys(spec: Any) -> Keys:
    if isinstance(spec, Mapping):
        return [(str(name), int(direction)) for name, direction in spec.items()]
    return [(str(name), int(direction)) for name, direction in spec]


def _index_named(indexes: Mapping[str, Index], keys: Keys) -> str | None:
    return next((name for name, declared in indexes.items() if _parts(declared)[0] == keys), None)


# ------------------------------------------------------------------ from commands to queries


@dataclass(frozen=True)
class Query:
    collection: str
    command: str
    filter: Mapping[str, Any]
    sort: tuple[tuple[str, int], ...] = ()
    hint: Any = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The filter's top-level fields: how `UNINDEXED` names a shape."""
        return tuple(sorted(self.filter))

    def describe(self) -> str:
        extra = f" sort={list(self.sort)}" if self.sort else ""
        extra += f" hint={self.hint!r}" if self.hint is not None else ""
        return f"{self.collection}.{self.command} {dict(self.filter)!r}{extra}"


#: Recorded commands that select no documents, and why they need no index.
NO_QUERY = {
    "insert_one": "writes a new document",
    "insert_many": "writes new documents",
    "create_index": "set-up",
    "create_indexes": "set-up",
    "index_information": "set-up",
    "estimated_document_count": "reads the collection's metadata, scans nothing",
    "command": "a server command (hello), no collection",
}

#: Recorded commands that select documents: each is audited.
QUERIES = frozenset(
    {
        "find", "find_one", "find_one_and_update", "find_one_and_delete", "find_one_and_replace",
        "update_one", "update_many", "replace_one", "delete_one", "delete_many",
        "count_documents", "distinct", "bulk_write", "aggregate",
    }
)  # fmt: skip

#: Shapes that no declared index serves, by (collection, command, top-level filter fields).
UNINDEXED: dict[tuple[str, str, tuple[str, ...]], str] = {
    (LOCKS, "find", ("available_at", "parked")): (
        "list_groups('parked'): hinted to the parked index's range, then sorted by group id in "
        "memory; parked groups are the few waiting out a nack's delay"
    ),
    (LOCKS, "find", ("$and",)): (
        "list_groups('parked') after a cursor: the same range, the cursor's id tested on it"
    ),
}


def _sort(spec: Any) -> tuple[tuple[str, int], ...]:
    if not spec:
        return ()
    if isinstance(spec, str):
        return ((spec, 1),)
    return tuple(_keys(spec))


class ChainRecorder:
    """An inner database wrapper that notes the cursor methods chained on each ``find`` (the
    instrumentation records a find's arguments, not the ``.hint()`` chained on its cursor).
    The notes are keyed by the find's filter object, the very object the `Operation` holds."""

    mongoq_wrapper = True

    def __init__(self, db: Any) -> None:
        self.mongoq_delegate = db
        self.chains: list[tuple[Any, str, tuple[Any, ...]]] = []

    def __getitem__(self, name: str) -> Any:
        return _RecordingCollection(self, self.mongoq_delegate[name])

    def get_collection(self, name: str, **kwargs: Any) -> Any:
        return _RecordingCollection(self, self.mongoq_delegate.get_collection(name, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.mongoq_delegate, name)

    def chained(self, filter: Any, method: str) -> Any:
        found = [args for key, name, args in self.chains if key is filter and name == method]
        return found[-1][0] if found else None


class _RecordingCollection:
    def __init__(self, recorder: ChainRecorder, collection: Any) -> None:
        self._recorder = recorder
        self._collection = collection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    def find(self, *args: Any, **kwargs: Any) -> Any:
        key = args[0] if args else kwargs.get("filter")
        return _RecordingCursor(self._recorder, key, self._collection.find(*args, **kwargs))


class _RecordingCursor:
    def __init__(self, recorder: ChainRecorder, key: Any, cursor: Any) -> None:
        self._recorder = recorder
        self._key = key
        self._cursor = cursor

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cursor, name)
        if name not in ("hint", "sort"):
            return attr

        def chain(*args: Any) -> _RecordingCursor:
            self._recorder.chains.append((self._key, name, args))
            attr(*args)
            return self

        return chain


def _leading_sort(stages: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, int], ...]:
    """The ``$sort`` an aggregation's stages begin with (after its leading ``$match``), which
    the index that answers the match must give: a server sorts it in memory otherwise."""
    return _sort(list(stages[0]["$sort"].items())) if stages and "$sort" in stages[0] else ()


def queries_of(op: Operation, recorder: ChainRecorder | None = None) -> Iterator[Query]:
    """The document selections one recorded command makes."""
    if op.name == "bulk_write":
        requests = op.args[0] if op.args else op.kwargs["requests"]
        for request in requests:
            if hasattr(request, "_filter"):  # not an InsertOne
                yield Query(
                    op.collection, f"bulk_write:{type(request).__name__}", request._filter,
                    _sort(getattr(request, "_sort", None)), getattr(request, "_hint", None),
                )  # fmt: skip
        return
    if op.name == "aggregate":
        pipeline = list(op.args[0] if op.args else op.kwargs["pipeline"])
        leading = pipeline[0].get("$match", {}) if pipeline else {}
        sort = _leading_sort(pipeline[1:] if "$match" in (pipeline or [{}])[0] else pipeline)
        yield Query(op.collection, "aggregate", leading, sort, hint=op.kwargs.get("hint"))
        for stage in pipeline:
            if "$lookup" in stage and "foreignField" in stage["$lookup"]:
                lookup = stage["$lookup"]
                yield Query(
                    lookup["from"], "aggregate:$lookup", {lookup["foreignField"]: "..."},
                    _leading_sort(lookup.get("pipeline", [])),
                )  # fmt: skip
        return
    if op.name == "distinct":
        filter = op.args[1] if len(op.args) > 1 else op.kwargs.get("filter")
        yield Query(op.collection, op.name, filter or {}, hint=op.kwargs.get("hint"))
        return
    filter = op.filter or {}
    sort = _sort(op.kwargs.get("sort"))
    hint = op.kwargs.get("hint")
    if op.name == "find" and recorder is not None:
        sort = sort or _sort(recorder.chained(op.filter, "sort"))
        hint = hint or recorder.chained(op.filter, "hint")
    yield Query(op.collection, op.name, filter, sort, hint)


async def declared_indexes(db: Any, collections: Sequence[str]) -> dict[str, dict[str, Index]]:
    """Each collection's indexes by name (``_id`` only where none was declared); a partial index
    as a `Partial`, which serves only the queries that imply its filter."""
    declared: dict[str, dict[str, Index]] = {}
    for name in collections:
        info = await db[name].index_information()
        indexes: dict[str, Index] = {"_id_": [("_id", 1)]}
        for index, spec in info.items():
            keys = _keys(spec["key"])
            partial = spec.get("partialFilterExpression")
            indexes[index] = keys if partial is None else Partial(keys, partial)
        declared[name] = indexes
    return declared


@dataclass
class Audit:
    checked: list[tuple[Query, str]] = field(default_factory=list)
    unserved: list[Query] = field(default_factory=list)
    allowed: set[tuple[str, str, tuple[str, ...]]] = field(default_factory=set)


def audit(
    operations: Sequence[Operation],
    indexes: Mapping[str, Mapping[str, Index]],
    recorder: ChainRecorder | None = None,
    unindexed: Mapping[tuple[str, str, tuple[str, ...]], str] | None = None,
) -> Audit:
    """Check every query of `operations`; a shape no index serves is allowed only if listed in
    `unindexed` (by default `UNINDEXED`)."""
    allowed = UNINDEXED if unindexed is None else unindexed
    result = Audit()
    for op in operations:
        if op.name in NO_QUERY:
            continue
        for query in queries_of(op, recorder):
            declared = indexes.get(query.collection, {"_id_": [("_id", 1)]})
            plan = served_by(declared, query.filter, query.sort, query.hint)
            key = (query.collection, query.command, query.fields)
            if plan is not None:
                result.checked.append((query, plan))
            elif key in allowed:
                result.allowed.add(key)
            else:
                result.unserved.append(query)
    return result


# ------------------------------------------------------------------------------ the workload


class StealHeadOnce:
    """A hook: just before `claim_many` stamps the heads it read, another lease stamps
    `group`'s head, so the batch must read back which heads it got (its raced path)."""

    def __init__(self, raw: Any, group: str) -> None:
        self.raw = raw
        self.group = group
        self.armed = False

    async def before(self, op: Operation) -> None:
        stamp = op.collection == MESSAGES and op.name == "update_many" and "$and" in op.filter
        if self.armed and stamp:  # the batched stamp of the heads
            self.armed = False
            await self.raw[MESSAGES].update_one(
                {"group_id": self.group}, {"$set": {"token": "thief", "stamp_until": FAR}}
            )

    async def after(self, op: Operation, error: BaseException | None) -> None:
        return None


async def exercise_tasks(db: Any, clock: ManualClock) -> None:
    queue = AsyncTaskQueue(
        db, TASKS, clock=clock, max_attempts=2, lease_ttl=30, backoff_base=1, backoff_cap=1
    )
    await queue.setup()
    assert await queue.put("a", {"n": 1}) == "inserted"
    await queue.put("cancelled-pending")
    assert await queue.cancel("cancelled-pending")
    assert await queue.put("a", {"n": 1}) == "unchanged"
    assert await queue.put("b", {"n": 2}, revision=1, priority=5) == "inserted"
    await queue.put_many([NewTask(f"m{i}", {"i": i}) for i in range(6)])

    first = await queue.claim("w1")
    assert first is not None and first.id == "b"
    assert await queue.heartbeat(first)
    assert await queue.complete(first, {"ok": True})
    retried = await queue.claim("w1")
    assert retried is not None
    assert await queue.release_for_retry(retried, "transient")

    batch = await queue.claim_many(4, "w2")
    assert len(batch) == 4
    assert await queue.heartbeat_many(batch) == [True] * 4
    assert await queue.release_not_an_attempt(batch[0])
    # One lease no longer held: heartbeat_many reads which ones still are.
    assert await queue.heartbeat_many(batch[:2]) == [False, True]
    assert await queue.fail(batch[1], "permanent")
    # A new revision under the holder: the settle misses, then requeues the new revision.
    await queue.put(batch[2].id, {"v": 2}, revision=2)
    assert not await queue.complete(batch[2])
    await queue.put(batch[3].id, {"v": 2}, revision=2)
    assert await queue.complete_many([batch[3]]) == [False]
    done = await queue.claim_many(2, "w2")
    assert await queue.complete_many(done, ["r1", "r2"]) == [True, True]

    lapsed = await queue.claim("w3")
    assert lapsed is not None
    clock.advance(60)  # its lease runs out
    await queue.reclaim_expired()
    assert await queue.get(lapsed.id) is not None
    assert await queue.requeue(batch[1].id)
    assert await queue.remove("a")
    await queue.stats()
    # A Jobs worker's presence, announced and withdrawn, and the stats' read of the due tasks
    # that wait for a function no running worker runs.
    await queue.put("fn-x", function="unknown")
    await queue._presence.announce("jobs-1", ["known"], 30)
    assert (await queue.stats()).unknown_functions["unknown"] == 1
    await queue._presence.withdraw("jobs-1")

    async def handler(task: Task) -> Any:
        if str(task.id).endswith("1"):
            raise PermanentError("bad input")
        if str(task.id).endswith("2"):
            raise RuntimeError("transient")
        return {"done": task.id}

    await queue.put_many(NewTask(f"r{i}") for i in range(5))
    assert (await queue.run(handler, stop_when_empty=True, worker_id="run1")).claimed
    await queue.put_many(NewTask(f"s{i}") for i in range(5))
    summary = await queue.run(handler, stop_when_empty=True, worker_id="run2", batch_size=3)
    assert summary.claimed and summary.completed

    # The operator's listings, bulk requeue and purge; a drained run's "what is left".
    page = await queue.list_tasks(limit=2)
    assert page.next is not None
    assert (await queue.list_tasks(limit=2, after=page.next)).tasks
    failed = await queue.list_tasks("failed")
    assert failed.tasks
    assert await queue.requeue_failed([failed.tasks[0].id]) == 1
    assert await queue.requeue_failed() >= 1
    clock.advance(10)
    await queue.run(handler, stop_when_drained=True, worker_id="run3")
    # The dashboard's throughput: finished in a window, then up to now.
    since = datetime(2000, 1, 1, tzinfo=UTC)
    assert await queue.count_finished(since, clock.now()) >= 1
    assert await queue.count_finished(since) >= 1
    assert await queue.purge("done", older_than=0) >= 1


async def exercise_groups(db: Any, raw: Any, clock: ManualClock, steal: StealHeadOnce) -> None:
    transport = AsyncGroupTransport(db, PREFIX, clock=clock, lease_ttl=30, max_deliveries=2)
    await transport.setup()

    async def claim(expect: str) -> GroupLease:
        lease = await transport.claim("w")
        assert lease is not None and lease.group_id == expect
        return lease

    # A group's only message: the ack drops the group.
    await transport.publish("solo", {"n": 1})
    lease = await claim("solo")
    assert await transport.extend(lease)
    assert await transport.ack(lease)

    # Nacks (at once, then parked), a head over max_deliveries buried by the claim, a dead
    # letter, and a claim that finds the group empty and drops it.
    await transport.publish("pair", {"n": 1}, priority=1)
    await transport.publish("pair", {"n": 2})
    assert await transport.nack(await claim("pair"), 0, error="transient")
    assert await transport.nack(await claim("pair"), 5)
    clock.advance(6)
    second = await claim("pair")  # the first head went to the dead letters on the way
    assert second.deliveries == 1
    assert await transport.dead_letter(second, "permanent")
    assert await transport.claim("w") is None

    # Batches: a group with more to come, and groups whose last message this is.
    await transport.publish_many(
        [NewMessage("b1", 1), NewMessage("b1", 2), NewMessage("b2", 3), NewMessage("b3", 4)]
    )
    leases = await transport.claim_many(3, "w")
    assert sorted(lease.group_id for lease in leases) == ["b1", "b2", "b3"]
    assert await transport.extend_many(leases) == [True] * 3
    assert await transport.ack_many(leases) == [True] * 3
    assert await transport.ack_many(await transport.claim_many(3, "w")) == [True]

    # claim_many meeting a head another live lease holds (busy: its lock made due by hand), an
    # empty group (ghost), a head over max_deliveries (tired), and a head stamped by someone
    # else between the batch's read and its stamp (fresh): it leases none of them.
    await transport.publish("tired", {"n": 1})
    for _ in range(2):
        assert await transport.nack(await claim("tired"), 0)
    await transport.publish("busy", {"n": 1})
    busy = await claim("busy")
    await raw[LOCKS].update_one({"_id": "busy"}, {"$set": {"available_at": EPOCH}})
    await transport.publish("ghost", {"n": 1})
    await raw[MESSAGES].delete_many({"group_id": "ghost"})
    await transport.publish("fresh", {"n": 1})
    steal.armed = True
    assert await transport.claim_many(10, "w") == []
    assert not steal.armed
    assert await transport.ack(busy)
    # The thief finishes with fresh (a head stamped until 2100 would hold its group that long).
    await raw[MESSAGES].delete_many({"group_id": "fresh"})
    await raw[LOCKS].delete_one({"_id": "fresh"})

    assert await transport.dead_letters()
    assert await transport.dead_letters(group_id="pair")
    seq = (await transport.dead_letters(limit=1))[0].seq
    assert await transport.redrive([seq]) == 1
    assert await transport.redrive(group_id="tired") == 1
    await transport.redrive()

    # An orphan: a message whose group was never readied.
    await transport.publish("orphan", {"n": 1})
    await raw[LOCKS].delete_one({"_id": "orphan"})
    clock.advance(31)
    assert await transport.recover_orphans() == 1
    assert await transport.recover_orphans() == 0  # the sliding window
    await transport.stats()
    # Two parked groups, so that the parked listing's second page is read too.
    for group in ("pk1", "pk2"):
        await transport.publish(group, {"n": 1})
    parked = await raw[LOCKS].update_many(
        {"_id": {"$in": ["pk1", "pk2"]}}, {"$set": {"parked": True, "available_at": FAR}}
    )
    assert parked.modified_count == 2
    for state in (None, "ready", "in_flight", "parked"):
        page = await transport.list_groups(state, limit=1)
        if page.next is not None:
            await transport.list_groups(state, limit=1, after=page.next)
    assert (await transport.list_groups(limit=1, after="i:0")).groups
    await raw[MESSAGES].delete_many({"group_id": {"$in": ["pk1", "pk2"]}})
    await raw[LOCKS].delete_many({"_id": {"$in": ["pk1", "pk2"]}})

    async def handler(lease: GroupLease) -> None:
        if lease.group_id == "r1":
            raise PermanentError("bad")
        if lease.group_id == "r2":
            raise RuntimeError("transient")

    await transport.publish_many(NewMessage(f"r{i}", i) for i in range(4))
    assert (await transport.run(handler, stop_when_empty=True, retry_delay=60)).claimed
    await transport.publish_many(NewMessage(f"q{i}", i) for i in range(4))
    summary = await transport.run(handler, stop_when_empty=True, batch_size=3)
    assert summary.claimed and summary.acked
    clock.advance(60)
    await transport.run(handler, stop_when_drained=True, retry_delay=0)


#: Branches the workload must reach (collection, command, filter fields): the guard that it
#: still drives the conditional queries, not only the common path.
WITNESSES = {
    (TASKS, "update_one", ("_id", "lease_token", "status", "worker_id")),  # heartbeat, requeue
    # complete_many's requeue of a task whose revision changed (UpdateMany on this backend)
    (TASKS, "bulk_write:UpdateMany", ("_id", "lease_token", "status", "worker_id")),
    (TASKS, "find", ("_id", "status")),  # complete_many: which tasks are done
    (TASKS, "update_many", ("_id", "lease_token", "status")),  # heartbeat_many
    # heartbeat_many with a lease no longer held: which still are
    (TASKS, "find", ("_id", "lease_token", "status")),
    (TASKS, "aggregate", ("lease_until", "status")),  # stats: the oldest due, by function
    (f"{TASKS}_workers", "distinct", ("expires",)),  # stats: the live workers' functions
    (MESSAGES, "find", ("_id", "token")),  # claim_many raced: which heads it stamped
    (MESSAGES, "find_one", ("group_id",)),  # ack of a group's last message
    (MESSAGES, "distinct", ("group_id",)),  # ack_many of groups' last messages
    # a claim finding its group empty
    (LOCKS, "delete_one", ("_id", "last_seq", "token", "version")),
    (LOCKS, "bulk_write:DeleteOne", ("_id", "last_seq", "token", "version")),  # ack_many drop
    (DEAD, "replace_one", ("_id",)),  # a burial
    (DEAD, "find", ("group_id",)),
    (DEAD, "find", ("_id",)),
    (MESSAGES, "aggregate", ("published_at",)),  # recover_orphans
    (LOCKS, "aggregate:$lookup", ("_id",)),
}


async def test_every_query_the_library_issues_is_served_by_a_declared_index() -> None:
    raw = memory_database()
    recorder = ChainRecorder(raw)
    counter = CommandCounter()
    counter.record = True
    steal = StealHeadOnce(raw, "fresh")
    db = instrument(recorder, steal, counter)
    clock = ManualClock()

    await exercise_tasks(db, clock)
    await exercise_groups(db, raw, clock, steal)

    indexes = await declared_indexes(
        raw, [TASKS, f"{TASKS}_schedules", f"{TASKS}_workers", MESSAGES, LOCKS, COUNTERS, DEAD]
    )
    result = audit(counter.operations, indexes, recorder)

    names = {op.name for op in counter.operations}
    assert names - NO_QUERY.keys() - QUERIES == set(), "classify these commands"
    seen = {(query.collection, query.command, query.fields) for query, _ in result.checked}
    seen |= result.allowed
    assert WITNESSES - seen == set(), "the workload no longer reaches these queries"
    assert not result.unserved, "queries no declared index serves:\n" + "\n".join(
        query.describe() for query in result.unserved
    )
    assert UNINDEXED.keys() - result.allowed == set(), "stale UNINDEXED entries: remove them"
    # The claims use the index they name.
    plans = {(q.collection, q.command, q.hint): plan for q, plan in result.checked if q.hint}
    assert plans == {
        (TASKS, "find_one_and_update", "claim"): "claim",
        (TASKS, "find", "claim"): "claim",
        (TASKS, "find", "status_lease"): "status_lease",  # a drained run: when is the next due
        # stats (and a Jobs worker's housekeeping): the due tasks of functions not run
        (TASKS, "aggregate", "status_lease"): "status_lease",
        (TASKS, "find", "status_updated"): "status_updated",  # list_tasks
        (f"{TASKS}_schedules", "find", "next_at"): "next_at",  # the schedules' ticker
        (LOCKS, "find_one_and_update", "claim"): "claim",
        (LOCKS, "aggregate", "claim"): "claim",  # claim_many's candidates, with their heads
        (MESSAGES, "find_one_and_update", "group_head"): "group_head",
        (MESSAGES, "aggregate", "group_head"): "group_head",  # claim_many's and list_groups' heads
    }


# ---------------------------------------------------------------------- the matcher's own tests

#: The task queue's declared indexes, less the TTL one (the embedded backend creates none).
INDEXES: dict[str, Keys] = {
    "_id_": [("_id", 1)],
    **{index.name: list(index.keys) for index in TASK_INDEXES if not index.ttl},
}


#: (filter, sort, hint, the index that serves it) against `INDEXES`.
SERVED: list[Any] = [
    ({"_id": "t1", "status": "processing", "worker_id": "w"}, (), None, "_id_"),
    ({"_id": {"$in": [1, 2]}, "lease_token": "x"}, (), None, "_id_"),
    ({"status": "pending"}, (), None, "status_lease"),
    ({"status": "pending", "lease_until": {"$lte": 1}}, (), None, "status_lease"),
    ({"status": {"$in": ["a", "b"]}}, [("lease_until", -1)], None, "status_lease"),
    ({"lease_until": {"$lte": 1}}, [("priority", -1), ("lease_until", 1)], "claim", "claim"),
    ({"lease_until": {"$lte": 1}}, [("priority", 1), ("lease_until", -1)], None, "claim"),
    ({"$or": [{"_id": 1, "token": "a"}, {"_id": 2, "token": "b"}]}, (), None, "$or: _id_"),
    ({"$and": [{"status": "done"}, {"payload": {"$ne": None}}]}, (), None, "status_lease"),
    # An equality on a key after the range (or the sort) is tested in the index scan.
    ({"priority": {"$gte": 1}, "lease_until": 2}, (), None, "claim"),
    ({"lease_until": 2}, [("priority", -1)], None, "claim"),
]

#: (filter, sort, hint) that no index of `INDEXES` serves.
UNSERVED: list[Any] = [
    pytest.param({"payload.n": 1}, (), None, id="unindexed field"),
    pytest.param({}, (), None, id="empty filter: a collection scan"),
    pytest.param({"worker_id": "w"}, (), None, id="field not leading any index"),
    pytest.param({"lease_until": {"$lte": 1}}, (), None, id="range on a second key"),
    pytest.param({"status": "done", "worker_id": "w"}, (), None, id="equality not covered"),
    pytest.param({"status": "done"}, [("priority", -1)], None, id="sort not in the index"),
    pytest.param({}, [("priority", -1), ("lease_until", -1)], None, id="sort in mixed directions"),
    pytest.param({"status": "done"}, (), "nope", id="hint names no index"),
    pytest.param({"status": "done"}, (), "claim", id="hinted index does not serve it"),
    pytest.param({"$or": [{"_id": 1}, {"worker_id": "w"}]}, (), None, id="unindexed branch"),
    pytest.param({"status": {"$ne": "done"}}, (), None, id="$ne picks no index"),
    pytest.param({"lease_until": 5}, (), None, id="equality on a later key alone"),
    pytest.param({"lease_until": 5}, (), "status_lease", id="hinted, a later key alone"),
]

#: The outbox's deliveries indexes (`mongoq.outbox.store`), partial ones included.
PARTIAL_INDEXES: dict[str, Index] = {
    "_id_": [("_id", 1)],
    "claim": Partial(
        [("lane_id", 1), ("due_at", 1), ("_id", 1), ("handler", 1)], {"lane": "ready"}
    ),
    "ordering": Partial(
        [("handler", 1), ("key", 1), ("sequence", 1)],
        {"due_at": {"$exists": True}, "key": {"$exists": True}},
    ),
    "parked": Partial([("handler", 1), ("key", 1), ("sequence", 1)], {"lane": "parked"}),
    "due": Partial([("due_at", 1)], {"due_at": {"$exists": True}}),
    "status_created": [("status", 1), ("created_at", 1)],
}
CLAIM_SCAN = {"lane_id": {"$in": [1, 2]}, "lane": "ready", "due_at": {"$lte": 9}}
BY_DUE = [("due_at", 1), ("_id", 1)]
AFTER = {"$or": [{"due_at": {"$gt": 1}}, {"due_at": 1, "_id": {"$gt": 0}}]}
HEAD = {"handler": "h", "key": "k", "due_at": {"$exists": True}}

#: (filter, sort, hint, the index that serves it) against `PARTIAL_INDEXES`.
PARTIAL_SERVED: list[Any] = [
    pytest.param(CLAIM_SCAN, BY_DUE, "claim", "claim", id="claim scan"),
    pytest.param(CLAIM_SCAN, BY_DUE, None, "claim", id="claim scan unhinted"),
    pytest.param(
        {**CLAIM_SCAN, "handler": {"$in": ["a", "b"]}}, BY_DUE, "claim", "claim",
        id="claim scan, handler filtered on the last key",
    ),
    pytest.param({**CLAIM_SCAN, **AFTER}, BY_DUE, "claim", "claim", id="claim scan, next page"),
    pytest.param(
        {"lane_id": 3, "lane": "ready", "due_at": {"$lte": 9}, "handler": "h"}, (), None,
        "claim", id="handler after the range key",
    ),
    pytest.param({"lane": "ready", "lane_id": 3}, (), None, "claim", id="pinned and a key"),
    pytest.param(HEAD, [("sequence", 1)], "ordering", "ordering", id="head of a key"),
    pytest.param({"lane": "parked"}, (), "parked", "parked", id="hinted: the pin narrows"),
    pytest.param(
        {"lane": "parked", "handler": {"$in": ["h"]}}, (), "parked", "parked",
        id="parked, by handler",
    ),
    pytest.param(
        {"due_at": {"$exists": True}}, [("due_at", 1)], "due", "due", id="oldest due"
    ),
    pytest.param(
        {"due_at": {"$exists": True, "$lte": 5}}, (), None, "due", id="$exists with a range"
    ),
    pytest.param(
        {"$and": [{"lane": "ready"}, {"lane_id": 3}]}, (), None, "claim", id="$and"
    ),
    pytest.param(
        {"lane": "ready", "$or": [{"lane_id": 1}, {"lane_id": 2}]}, (), None, "$or: claim",
        id="$or branches with the pin outside",
    ),
]  # fmt: skip

#: (filter, sort, hint) that no index of `PARTIAL_INDEXES` serves.
PARTIAL_UNSERVED: list[Any] = [
    pytest.param(
        {"lane_id": {"$in": [1]}, "due_at": {"$lte": 9}}, BY_DUE, "claim",
        id="claim scan without the partial's lane",
    ),
    pytest.param({**CLAIM_SCAN, "lane": "parked"}, BY_DUE, "claim", id="another value"),
    pytest.param({**CLAIM_SCAN, "lane": {"$ne": "parked"}}, BY_DUE, "claim", id="$ne"),
    pytest.param({**CLAIM_SCAN, "lane": {"$in": ["ready", "parked"]}}, BY_DUE, None, id="$in"),
    pytest.param(
        {"lane_id": 1, "lane": "ready"}, (), "parked", id="hinted index it does not imply"
    ),
    pytest.param(
        {"handler": "h", "key": "k"}, [("sequence", 1)], "ordering", id="no $exists: true"
    ),
    pytest.param(
        {**HEAD, "key": None}, [("sequence", 1)], "ordering", id="null does not exist"
    ),
    pytest.param(
        {**HEAD, "key": {"$exists": False}}, [("sequence", 1)], None, id="$exists: false"
    ),
    pytest.param({"lane": "parked"}, (), None, id="the pin alone, unhinted: never planned"),
    pytest.param({"lane": "ready", "handler": "h"}, (), None, id="a later key alone"),
    pytest.param({"lane": "ready", "event_id": "e"}, (), "claim", id="a field not a key"),
    pytest.param({"lane": "ready"}, [("_id", 1)], "claim", id="sort past a key"),
    pytest.param({}, [("due_at", 1)], "due", id="sort alone does not imply the filter"),
]  # fmt: skip


def against(indexes: Mapping[str, Index], cases: list[Any]) -> list[Any]:
    """`cases` (tuples or `pytest.param`s) with the indexes to match them against first."""
    params = []
    for case in cases:
        if hasattr(case, "marks"):  # a pytest.param: keep its id
            params.append(pytest.param(indexes, *case.values, id=case.id, marks=case.marks))
        else:
            params.append(pytest.param(indexes, *case))
    return params


@pytest.mark.parametrize(
    ("indexes", "filter", "sort", "hint", "expected"),
    [*against(INDEXES, SERVED), *against(PARTIAL_INDEXES, PARTIAL_SERVED)],
)
def test_the_matcher_accepts_what_an_index_serves(
    indexes: Mapping[str, Index], filter: dict[str, Any], sort: Any, hint: Any, expected: str
) -> None:
    assert served_by(indexes, filter, sort, hint) == expected


@pytest.mark.parametrize(
    ("indexes", "filter", "sort", "hint"),
    [*against(INDEXES, UNSERVED), *against(PARTIAL_INDEXES, PARTIAL_UNSERVED)],
)
def test_the_matcher_rejects_what_no_index_serves(
    indexes: Mapping[str, Index], filter: dict[str, Any], sort: Any, hint: Any
) -> None:
    assert served_by(indexes, filter, sort, hint) is None


async def test_the_audit_reports_a_query_on_an_unindexed_field() -> None:
    raw = memory_database()
    counter = CommandCounter()
    counter.record = True
    db = instrument(ChainRecorder(raw), counter)
    queue = AsyncTaskQueue(db, TASKS, clock=ManualClock())
    await queue.setup()
    await queue.put("a", {"n": 1})
    await db[TASKS].find_one({"payload.n": 1})
    await db[TASKS].count_documents({})
    result = audit(counter.operations, await declared_indexes(raw, [TASKS]))
    assert [query.describe() for query in result.unserved] == [
        f"{TASKS}.find_one {{'payload.n': 1}}",
        f"{TASKS}.count_documents {{}}",
    ]


# ------------------------------------------------------------------- explain on a real server


def _explain_command(op: Operation, recorder: ChainRecorder) -> dict[str, Any]:
    """The server command a recorded claim-path operation sends, to explain."""
    filter = op.filter or {}
    if op.name == "find":
        command: dict[str, Any] = {"find": op.collection, "filter": filter}
        sort = _sort(op.kwargs.get("sort"))
        if sort:
            command["sort"] = dict(sort)
        if op.kwargs.get("limit"):
            command["limit"] = op.kwargs["limit"]
        if (hint := recorder.chained(op.filter, "hint")) is not None:
            command["hint"] = hint
        return command
    if op.name == "find_one_and_update":
        command = {"findAndModify": op.collection, "query": filter, "update": op.args[1]}
        if op.kwargs.get("sort"):
            command["sort"] = dict(_sort(op.kwargs["sort"]))
        if op.kwargs.get("hint") is not None:
            command["hint"] = op.kwargs["hint"]
        return command
    if op.name in ("update_one", "update_many"):
        update = {"q": filter, "u": op.args[1], "multi": op.name == "update_many"}
        return {"update": op.collection, "updates": [update]}
    if op.name == "aggregate":
        command = {"aggregate": op.collection, "pipeline": list(op.args[0]), "cursor": {}}
        if op.kwargs.get("hint") is not None:
            command["hint"] = op.kwargs["hint"]
        return command
    raise AssertionError(f"no explain for {op.collection}.{op.name}")


#: What a plan holds that is not the plan run: the candidates the planner turned down (also
#: a shard's, under a mongos) and their trial runs.
_NOT_RUN = frozenset({"rejectedPlans", "allPlansExecution"})


def plan_mappings(explain: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every mapping of the plan a server runs, outermost first (its stages, their inputs):
    each ``queryPlanner.winningPlan`` (at the top, in an aggregation's ``$cursor`` stage, in a
    sharded aggregation's shards; a mongos lists each shard's under its own), and the other
    stages of an aggregation's pipeline as run, with their statistics (``$lookup``...).

    Never the rest of the reply: a server echoes the explained command under ``command``,
    pipeline included (its ``$lookup`` would count twice), and lists the plans it rejected."""
    for part in _plan_parts(explain):
        yield from _mappings(part)


def _plan_parts(explain: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    planner = explain.get("queryPlanner")
    if isinstance(planner, Mapping) and isinstance(planner.get("winningPlan"), Mapping):
        yield planner["winningPlan"]
    for stage in explain.get("stages") or ():
        cursor = stage.get("$cursor")
        if isinstance(cursor, Mapping):
            yield from _plan_parts(cursor)
        else:
            yield stage
    shards = explain.get("shards")
    if isinstance(shards, Mapping):
        for shard in shards.values():
            if isinstance(shard, Mapping):
                yield from _plan_parts(shard)


def _mappings(plan: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(plan, Mapping):
        yield plan
        for key, value in plan.items():
            if key not in _NOT_RUN:
                yield from _mappings(value)
    elif isinstance(plan, list):
        for value in plan:
            yield from _mappings(value)


def _stages(explain: Mapping[str, Any]) -> Iterator[str]:
    """The names of the stages of the plan an explain output says runs (``COLLSCAN``...)."""
    for node in plan_mappings(explain):
        if isinstance(node.get("stage"), str):
            yield node["stage"]


#: A server's ``explain`` of a find (``queryPlanner``), abridged: the plan it chose, the plans it
#: rejected (another index, sorted in memory), and the command echoed back.
RECORDED_FIND_EXPLAIN: dict[str, Any] = {
    "explainVersion": "1",
    "queryPlanner": {
        "namespace": "mongoq_test.tasks",
        "winningPlan": {
            "stage": "LIMIT",
            "inputStage": {
                "stage": "FETCH", "inputStage": {"stage": "IXSCAN", "indexName": "claim"}
            },
        },
        "rejectedPlans": [
            {
                "stage": "SORT",
                "inputStage": {
                    "stage": "FETCH", "inputStage": {"stage": "IXSCAN", "indexName": "by_status"}
                },
            },
        ],
    },
    "command": {"find": "tasks", "filter": {"status": "pending"}, "limit": 1, "$db": "x"},
    "serverInfo": {"host": "localhost", "port": 27017, "version": "8.0.32"},
    "ok": 1.0,
}  # fmt: skip
#: The same through a mongos: each shard's plans under the winning plan's ``shards``.
RECORDED_SHARDED_EXPLAIN: dict[str, Any] = {
    "queryPlanner": {
        "mongosPlannerVersion": 1,
        "winningPlan": {
            "stage": "SINGLE_SHARD",
            "shards": [
                {
                    "shardName": "s0",
                    "winningPlan": RECORDED_FIND_EXPLAIN["queryPlanner"]["winningPlan"],
                    "rejectedPlans": RECORDED_FIND_EXPLAIN["queryPlanner"]["rejectedPlans"],
                }
            ],
        },
    },
    "command": RECORDED_FIND_EXPLAIN["command"],
    "ok": 1.0,
}


@pytest.mark.parametrize("reply", [RECORDED_FIND_EXPLAIN, RECORDED_SHARDED_EXPLAIN],
                         ids=["replica-set", "sharded"])  # fmt: skip
def test_only_the_winning_plan_is_read_from_an_explain(reply: dict[str, Any]) -> None:
    assert "SORT" not in set(_stages(reply))  # only a rejected plan sorts in memory
    assert {node.get("indexName") for node in plan_mappings(reply)} - {None} == {"claim"}
    assert not any("find" in node or "$db" in node for node in plan_mappings(reply))  # command


def explain_recorders(
    db: Any, request: pytest.FixtureRequest
) -> tuple[ChainRecorder, CommandCounter]:
    """What `collection_scans` needs recorded: the recorder and the counter to wrap `db` in.
    Skips the test on the embedded lanes, which have no explain."""
    if request.node.callspec.params["db"] in ("memory", "interleaved", "latency"):
        pytest.skip("explain needs a real server: set MONGOQ_TEST_URI")
    return ChainRecorder(db), CommandCounter()


async def collection_scans(
    db: Any, recorder: ChainRecorder, operations: Sequence[Operation]
) -> list[str]:
    """Those of `operations` that the server's plan answers with a collection scan."""
    scans = []
    for op in operations:
        plan = await db.command(
            {"explain": _explain_command(op, recorder), "verbosity": "queryPlanner"}
        )
        if "COLLSCAN" in set(_stages(plan)):
            scans.append(f"{op.collection}.{op.name} {op.filter!r}")
    return scans


async def test_claim_queries_do_not_scan_the_collection_on_a_real_server(
    db: Any, request: pytest.FixtureRequest
) -> None:
    recorder, counter = explain_recorders(db, request)
    wrapped = instrument(recorder, counter)
    clock = ManualClock()
    queue = AsyncTaskQueue(wrapped, TASKS, clock=clock)
    transport = AsyncGroupTransport(wrapped, PREFIX, clock=clock)
    await queue.setup()
    await transport.setup()
    # A backlog with settled work beside it, so that a scan would have something to scan.
    await queue.put_many(NewTask(f"t{i}", priority=i % 3) for i in range(200))
    for task in await queue.claim_many(50, "w"):
        await queue.complete(task)
    await transport.publish_many(NewMessage(f"g{i % 40}", i, priority=i % 5) for i in range(200))

    counter.record = True
    assert await queue.claim("w") is not None
    assert await queue.claim_many(10, "w")
    assert await transport.claim("w") is not None
    assert await transport.claim_many(10, "w")
    counter.record = False

    scans = await collection_scans(db, recorder, counter.operations)
    assert len(counter.operations) >= 10
    assert not scans, "claim queries that scan the collection:\n" + "\n".join(scans)


#: The commands of a claim path that select documents by more than ``_id``.
_EXPLAINED = frozenset({"find", "aggregate", "find_one_and_update", "update_one", "update_many"})


async def test_outbox_claim_queries_do_not_scan_the_collection_on_a_real_server(
    db: Any, request: pytest.FixtureRequest
) -> None:
    recorder, counter = explain_recorders(db, request)
    outbox = AsyncOutbox(
        instrument(recorder, counter), subscriptions={"t": ["h", "i"]}, clock=ManualClock()
    )
    await outbox.setup()
    await outbox.publish(
        [Event(id=f"e{n}", type="t", key=f"k{n % 20}" if n % 2 else None) for n in range(200)],
        session=None,
    )
    first = await outbox.claim("w", limit=32)
    assert await outbox.complete_many(first) == [True] * len(first)

    counter.record = True
    assert await outbox.claim("w", limit=32)
    assert await outbox.claim("v", ["h"], limit=8)
    counter.record = False

    queries = [
        op
        for op in counter.operations
        # The 256 lane documents are read whole on purpose (outbox/lanes.py): not a query.
        if op.name in _EXPLAINED and op.collection not in ("$cmd", outbox.lanes.name)
    ]
    scans = await collection_scans(db, recorder, queries)
    assert len(queries) >= 4
    assert not scans, "outbox claim queries that scan the collection:\n" + "\n".join(scans)
