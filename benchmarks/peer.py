"""Side by side with `mongo-taskqueue` (PyPI ``mongo-taskqueue``, module ``mongotq``): the same
task lifecycle, N tasks put and then claimed and completed, on the same backend in the same run.

mongo-taskqueue is synchronous (pymongo). Its lifecycle costs one command per step: ``append``
is an ``insert_one``, ``next`` a sorted ``find_one_and_update``, ``on_success`` an
``update_one`` by ``_id``: 3 commands per task. Its batch forms are ``append_many`` (one
``insert_many``) and ``next_many(n)``, which calls ``next`` n times; there is no batched
completion, so at best it spends about 2 commands per task.

mongoq runs the lifecycle unbatched (put, claim, complete) and batched (``put_many``,
``claim_many`` and ``complete_many`` in batches of 100). Both sides count their commands with a
wrapper around the collection (mongoq: `mongoq.testing.instrument`; mongo-taskqueue: the
`CountingCollection` here), so commands per task mean the same on both. The ratios are mongoq's
tasks/s over mongo-taskqueue's: unbatched against its unbatched lifecycle, batched against its
batch forms.

On the embedded backend mongo-taskqueue runs on a synchronous ``mongomock.MongoClient()`` (the
engine under mongoq's embedded backend); with ``--uri`` on a ``pymongo.MongoClient``, with the
indexes its ``create_index()`` declares (mongomock's ``create_index`` does not take its
arguments, and indexes change nothing there: mongomock scans every document anyway).
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.harness import Result, counted_database
from mongoq import AsyncTaskQueue, NewTask
from mongoq.testing import ManualClock

PEER = "mongo-taskqueue"
BATCH = 100

#: The collection methods that send a command to the server.
_COMMANDS = frozenset(
    {
        "aggregate", "bulk_write", "count_documents", "create_index", "delete_many",
        "delete_one", "distinct", "estimated_document_count", "find", "find_one",
        "find_one_and_delete", "find_one_and_replace", "find_one_and_update", "insert_many",
        "insert_one", "replace_one", "update_many", "update_one",
    }
)  # fmt: skip


def peer_installed() -> bool:
    return importlib.util.find_spec("mongotq") is not None


class CountingCollection:
    """A synchronous collection that counts the commands sent through it (the peer's side of
    `mongoq.testing.CommandCounter`). A ``find`` counts once, however many batches it reads.

    Documents to insert are handed over as plain dicts: mongo-taskqueue inserts its `Task`
    mapping objects, which BSON encodes like any mapping on a server, but which mongomock would
    store as they are and then never match in a filter.
    """

    def __init__(self, collection: Any) -> None:
        self._collection = collection
        self.commands = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._collection, name)
        if name not in _COMMANDS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.commands += 1
            if name == "insert_one":
                args, kwargs = _plain_document(args, kwargs, "document")
            elif name == "insert_many":
                args, kwargs = _plain_documents(args, kwargs)
            return attr(*args, **kwargs)

        return counted


def _plain(document: Any) -> Any:
    return dict(document) if isinstance(document, Mapping) else document


def _plain_document(args: tuple[Any, ...], kwargs: dict[str, Any], key: str) -> Any:
    if args:
        return (_plain(args[0]), *args[1:]), kwargs
    return args, kwargs | {key: _plain(kwargs[key])}


def _plain_documents(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if args:
        return ([_plain(doc) for doc in args[0]], *args[1:]), kwargs
    return args, kwargs | {"documents": [_plain(doc) for doc in kwargs["documents"]]}


@dataclass(frozen=True)
class Ratio:
    """mongoq's tasks/s over mongo-taskqueue's, unbatched and batched."""

    backend: str
    tasks: int
    unbatched: float
    batched: float
    #: mongoq batched against mongo-taskqueue's plain lifecycle, for reference
    batched_vs_unbatched: float

    def line(self) -> str:
        return (
            f"{'peer: mongoq / ' + PEER + ' tasks/s':<50} {self.backend:<8} {self.tasks:>7} items  "
            f"unbatched {self.unbatched:.2f}x  batched {self.batched:.2f}x "
            f"(vs its unbatched: {self.batched_vs_unbatched:.2f}x)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": f"peer: mongoq / {PEER} tasks/s"} | asdict(self)


@dataclass(frozen=True)
class Skipped:
    scenario: str
    reason: str

    def line(self) -> str:
        return f"{self.scenario:<50} skipped: {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"skipped": True}


# --------------------------------------------------------------------------- mongo-taskqueue


class _PeerDatabase:
    """A fresh synchronous database for mongo-taskqueue on the benchmark's backend."""

    def __init__(self, uri: str | None) -> None:
        self.uri = uri
        self.name = f"mongoq_bench_peer_{uuid.uuid4().hex[:8]}"
        if uri:
            import pymongo

            self.client: Any = pymongo.MongoClient(uri)
        else:
            import mongomock

            self.client = mongomock.MongoClient()
        self.database = self.client[self.name]

    @property
    def backend(self) -> str:
        return "pymongo" if self.uri else "memory"

    def queue(self, collection: str) -> tuple[Any, CountingCollection]:
        import mongotq

        queue = mongotq.TaskQueue(
            database=self.name, collection=collection, host=self.uri or "unused", tag="bench"
        )
        # `database` and `collection` are cached properties: the benchmark brings the client
        # (and the counting wrapper) instead of letting the queue build its own.
        queue.__dict__["database"] = self.database
        counted = CountingCollection(self.database[collection])
        queue.__dict__["collection"] = counted
        if self.uri:
            queue.create_index()
        return queue, counted

    def close(self) -> None:
        if self.uri:
            self.client.drop_database(self.name)
        self.client.close()


def _peer_run(uri: str | None, scenario: str, tasks: int, run: Callable[[Any, int], int]) -> Result:
    database = _PeerDatabase(uri)
    try:
        queue, counted = database.queue("peer_tasks")
        counted.commands = 0
        started = time.perf_counter()
        done = run(queue, tasks)
        seconds = time.perf_counter() - started
        assert done == tasks, f"{PEER} completed {done} of {tasks} tasks"
        return Result(scenario, database.backend, tasks, seconds, counted.commands)
    finally:
        database.close()


def _peer_single(queue: Any, tasks: int) -> int:
    for number in range(tasks):
        queue.append({"n": number})
    done = 0
    while (task := queue.next()) is not None:
        queue.on_success(task)
        done += 1
    return done


def _peer_batched(queue: Any, tasks: int) -> int:
    for start in range(0, tasks, BATCH):
        queue.append_many({"n": number} for number in range(start, min(start + BATCH, tasks)))
    done = 0
    while batch := queue.next_many(BATCH):
        for task in batch:
            queue.on_success(task)
        done += len(batch)
    return done


# ------------------------------------------------------------------------------------- mongoq


async def _mongoq_single(uri: str | None, tasks: int) -> Result:
    async with counted_database(uri) as bench:
        queue = AsyncTaskQueue(bench.db, "peer_tasks", clock=ManualClock())
        await queue.setup()
        bench.start()
        for number in range(tasks):
            await queue.put(f"t{number}", {"n": number})
        done = 0
        while (task := await queue.claim("bench")) is not None:
            assert await queue.complete(task)
            done += 1
        assert done == tasks
        return bench.stop("peer: mongoq put + claim + complete", tasks)


async def _mongoq_batched(uri: str | None, tasks: int) -> Result:
    async with counted_database(uri) as bench:
        queue = AsyncTaskQueue(bench.db, "peer_tasks", clock=ManualClock())
        await queue.setup()
        bench.start()
        for start in range(0, tasks, BATCH):
            await queue.put_many(
                NewTask(f"t{number}", {"n": number})
                for number in range(start, min(start + BATCH, tasks))
            )
        done = 0
        while batch := await queue.claim_many(BATCH, "bench"):
            assert all(await queue.complete_many(batch))
            done += len(batch)
        assert done == tasks
        return bench.stop(f"peer: mongoq put/claim/complete_many({BATCH})", tasks)


# ---------------------------------------------------------------------------------- scenario


async def side_by_side(uri: str | None, tasks: int) -> list[Result | Ratio | Skipped]:
    if not peer_installed():
        return [
            Skipped(
                f"peer: {PEER}",
                f"{PEER} is not installed (pip install 'mongoq-queue[bench]'); "
                "side-by-side skipped",
            )
        ]
    peer_single = _peer_run(uri, f"peer: {PEER} append + next + on_success", tasks, _peer_single)
    ours_single = await _mongoq_single(uri, tasks)
    peer_batched = _peer_run(
        uri, f"peer: {PEER} append_many/next_many({BATCH})", tasks, _peer_batched
    )
    ours_batched = await _mongoq_batched(uri, tasks)
    ratio = Ratio(
        backend=ours_single.backend,
        tasks=tasks,
        unbatched=ours_single.per_second / peer_single.per_second,
        batched=ours_batched.per_second / peer_batched.per_second,
        batched_vs_unbatched=ours_batched.per_second / peer_single.per_second,
    )
    return [peer_single, ours_single, peer_batched, ours_batched, ratio]


def scenarios(tasks: int) -> list[tuple[str, Callable[[str | None], object]]]:
    return [(f"side by side with {PEER}", lambda uri: side_by_side(uri, tasks))]
