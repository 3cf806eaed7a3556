"""Bad input: every rejected call raises `InvalidInput` (a `ValueError`) naming the field, before
anything is written."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import mongomock
import pymongo
import pytest

from mongoq import AsyncTaskQueue, InvalidInput, NewTask, Task
from mongoq.testing import CommandCounter, ManualClock, instrument
from tests.support.helpers import (
    QUEUE,
    SIXTEEN_MIB,
    claim_one,
    encoded,
    new_queue,
    read,
    read_all,
    rejects,
)


@pytest.fixture
async def queue(db: Any, clock: ManualClock, counter: CommandCounter) -> AsyncTaskQueue:
    """A queue holding one pending task, "existing" (an injected filter would match it)."""
    queue = await new_queue(instrument(db, counter), clock)
    await queue.put("existing", {"keep": True}, revision="r1")
    counter.reset()
    return queue


@pytest.fixture
def counter() -> CommandCounter:
    return CommandCounter()


#: `nothing_written`: asserts when called that the rejected call wrote nothing.
Check = Callable[[], Awaitable[None]]


async def stored_bytes(db: Any) -> dict[Any, bytes]:
    """Every stored task as BSON: equal bytes mean the same fields, values and field order."""
    return {task_id: encoded(doc) for task_id, doc in (await read_all(db)).items()}


async def assert_nothing_written(
    db: Any, counter: CommandCounter, before: dict[Any, bytes]
) -> None:
    """No command was sent since `before` was read, and every stored task is as it was."""
    assert counter.total == 0, counter.counts
    assert await stored_bytes(db) == before


@pytest.fixture
async def nothing_written(db: Any, queue: AsyncTaskQueue, counter: CommandCounter) -> Check:
    """The check to call after the rejected call, against what is stored once `queue` is set up."""
    before = await stored_bytes(db)
    return lambda: assert_nothing_written(db, counter, before)


BAD_IDS = {
    "operator-injection": {"$gt": ""},
    "empty": "",
    "bool": True,
    "float": 1.5,
    "none": None,
    "list": ["a"],
    "too-big-int": 2**63,
    "nul": "a\x00b",
    "too-long": "x" * 1025,
}


# -------------------------------------------------------------------------------------- ids


@pytest.mark.parametrize("task_id", list(BAD_IDS.values()), ids=list(BAD_IDS))
async def test_put_rejects_a_bad_task_id(
    queue: AsyncTaskQueue, nothing_written: Check, task_id: Any
) -> None:
    with rejects("task_id") as raised:
        await queue.put(task_id, {"v": 1}, revision="r2")

    assert isinstance(raised.value, ValueError)
    assert raised.value.field == "task_id"
    assert str(raised.value).startswith("task_id: ")
    await nothing_written()


@pytest.mark.parametrize("call", ["get", "requeue", "remove"])
async def test_operator_calls_reject_an_injected_filter_as_id(
    queue: AsyncTaskQueue, nothing_written: Check, call: str
) -> None:
    with rejects("task_id"):
        await getattr(queue, call)({"$gt": ""})

    await nothing_written()


async def test_good_ids_are_accepted(db: Any, queue: AsyncTaskQueue) -> None:
    for task_id in ("a", "x" * 1024, 0, -(2**63), 2**63 - 1, "$not-an-operator", "a.b"):
        assert await queue.put(task_id) == "inserted"
    assert set(await read_all(db)) == {
        "existing",
        "a",
        "x" * 1024,
        0,
        -(2**63),
        2**63 - 1,
        "$not-an-operator",
        "a.b",
    }


# --------------------------------------------------------------------------------- payloads


class NotBson:
    pass


BAD_PAYLOADS = {
    "object": (object(), "payload"),
    "custom-class": ({"nested": NotBson()}, "payload"),
    "set": ({1, 2}, "payload"),
    "oversized": ("x" * (SIXTEEN_MIB + 1), "payload"),
    "dollar-key": ({"$set": {"status": "done"}}, "payload.$set"),
    "dotted-key": ({"a.b": 1}, "payload.a.b"),
    "nested-dollar-key": ({"outer": {"$where": "1"}}, "payload.outer.$where"),
    "dollar-key-in-list": ([{"ok": 1}, {"$x": 1}], "payload[1].$x"),
    "int-key": ({1: "a"}, "payload"),
}


@pytest.mark.parametrize(("payload", "field"), list(BAD_PAYLOADS.values()), ids=list(BAD_PAYLOADS))
async def test_put_rejects_a_bad_payload(
    queue: AsyncTaskQueue, nothing_written: Check, payload: Any, field: str
) -> None:
    with rejects("payload") as raised:
        await queue.put("new", payload)
    with rejects("payload"):
        await queue.put("existing", payload, revision="r2")

    assert raised.value.field == field
    await nothing_written()


async def test_a_payload_just_under_the_limit_is_accepted(db: Any, queue: AsyncTaskQueue) -> None:
    payload = "x" * (SIXTEEN_MIB - 128 * 1024)

    assert await queue.put("big", payload) == "inserted"

    assert (await read(db, "big") or {})["payload"] == payload


# ----------------------------------------------------------------------- other put arguments

BAD_ARGUMENTS = {
    "negative-delay": ({"delay": -1}, "delay"),
    "nan-delay": ({"delay": math.nan}, "delay"),
    "infinite-delay": ({"delay": math.inf}, "delay"),
    "string-delay": ({"delay": "5"}, "delay"),
    "bool-delay": ({"delay": True}, "delay"),
    "string-priority": ({"priority": "high"}, "priority"),
    "float-priority": ({"priority": 1.5}, "priority"),
    "bool-priority": ({"priority": True}, "priority"),
    "none-priority": ({"priority": None}, "priority"),
    "huge-priority": ({"priority": 2**31}, "priority"),
    "bool-revision": ({"revision": True}, "revision"),
    "float-revision": ({"revision": 1.5}, "revision"),
    "dict-revision": ({"revision": {"$gt": ""}}, "revision"),
}


@pytest.mark.parametrize(("kwargs", "field"), list(BAD_ARGUMENTS.values()), ids=list(BAD_ARGUMENTS))
async def test_put_rejects_bad_arguments(
    queue: AsyncTaskQueue, nothing_written: Check, kwargs: dict[str, Any], field: str
) -> None:
    with rejects(field) as raised:
        await queue.put("existing", {"v": 2}, **kwargs)
    with rejects(field):
        await queue.put("new", **kwargs)

    assert raised.value.field == field
    await nothing_written()


# --------------------------------------------------------------------------------- put_many


@pytest.mark.parametrize(
    ("batch", "field"),
    [
        ([NewTask("a"), NewTask("b"), NewTask("a", revision=2)], "tasks[2].task_id"),
        ([NewTask("a"), {"task_id": "b"}], "tasks[1]"),
        ([NewTask("a"), "b"], "tasks[1]"),
        ([NewTask("a"), NewTask("b"), NewTask("c", object())], "tasks[2].payload"),
        ([NewTask("a"), NewTask({"$gt": ""})], "tasks[1].task_id"),
        ([NewTask("a"), NewTask("b", delay=-1)], "tasks[1].delay"),
        ([NewTask("existing", revision="r2"), NewTask("b", priority="x")], "tasks[1].priority"),
    ],
    ids=["duplicate-id", "dict-item", "str-item", "bad-payload", "bad-id", "bad-delay", "bad-prio"],
)
async def test_put_many_writes_nothing_of_a_batch_with_a_bad_item(
    queue: AsyncTaskQueue, nothing_written: Check, batch: list[Any], field: str
) -> None:
    with rejects(field) as raised:
        await queue.put_many(batch)

    assert raised.value.field == field
    await nothing_written()


async def test_put_many_names_the_first_of_two_duplicates(db: Any, queue: AsyncTaskQueue) -> None:
    with pytest.raises(InvalidInput, match=r"repeats tasks\[0\]\.task_id"):
        await queue.put_many([NewTask("a"), NewTask("b"), NewTask("a")])
    assert set(await read_all(db)) == {"existing"}


# ------------------------------------------------------------------------- consumer calls

BAD_WORKER_IDS = {
    "empty": "",
    "blank": "   ",
    "int": 7,
    "dict": {"$gt": ""},
    "zero": 0,
    # Stored on every task it holds: unbounded, it could take a document past 16 MiB.
    "too long": "w" * 1025,
}


@pytest.mark.parametrize("worker_id", list(BAD_WORKER_IDS.values()), ids=list(BAD_WORKER_IDS))
async def test_claim_rejects_a_bad_worker_id(
    queue: AsyncTaskQueue, nothing_written: Check, worker_id: Any
) -> None:
    with rejects("worker_id"):
        await queue.claim(worker_id)

    await nothing_written()


async def test_settles_reject_a_task_that_was_not_claimed(
    db: Any, queue: AsyncTaskQueue, counter: CommandCounter
) -> None:
    unclaimed = await queue.get("existing")
    assert unclaimed is not None
    forged = Task(id={"$gt": ""}, payload=None, status="processing", attempts=1)  # type: ignore[arg-type]
    before = await stored_bytes(db)
    counter.reset()

    for task in (unclaimed, forged, {"_id": "existing"}):
        for settle in (queue.complete, queue.fail, queue.release_for_retry, queue.heartbeat):
            with rejects("task"):
                await settle(task)  # type: ignore[arg-type]
        with rejects("task"):
            queue.leased(task)  # type: ignore[arg-type]

    await assert_nothing_written(db, counter, before)


async def test_complete_rejects_a_result_that_cannot_be_stored(
    db: Any, queue: AsyncTaskQueue, counter: CommandCounter
) -> None:
    task = await claim_one(queue, expect="existing")
    before = await stored_bytes(db)
    counter.reset()

    with rejects("result"):
        await queue.complete(task, {"$set": 1})
    with rejects("result"):
        await queue.complete(task, object())

    await assert_nothing_written(db, counter, before)
    assert await queue.complete(task, {"fine": 1})


@pytest.mark.parametrize("delay", [-1, math.nan, "5"])
async def test_release_not_an_attempt_rejects_a_bad_delay(
    db: Any, queue: AsyncTaskQueue, counter: CommandCounter, delay: Any
) -> None:
    task = await claim_one(queue, expect="existing")
    before = await stored_bytes(db)
    counter.reset()

    with rejects("delay"):
        await queue.release_not_an_attempt(task, delay)

    await assert_nothing_written(db, counter, before)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": 1.5}, "concurrency"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"poll_interval": -1}, "poll_interval"),
        ({"worker_id": "  "}, "worker_id"),
        ({"worker_id": 5}, "worker_id"),
    ],
)
async def test_run_rejects_bad_arguments_before_claiming(
    queue: AsyncTaskQueue, nothing_written: Check, kwargs: dict[str, Any], field: str
) -> None:
    async def handler(task: Task) -> None:
        raise AssertionError("nothing may be claimed")

    with rejects(field):
        await queue.run(handler, stop_when_empty=True, **kwargs)

    await nothing_written()


# ----------------------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"max_attempts": -1}, "max_attempts"),
        ({"max_attempts": 2.0}, "max_attempts"),
        ({"max_attempts": True}, "max_attempts"),
        ({"lease_ttl": 0}, "lease_ttl"),
        ({"lease_ttl": -5}, "lease_ttl"),
        ({"lease_ttl": math.nan}, "lease_ttl"),
        ({"lease_ttl": "30"}, "lease_ttl"),
        ({"backoff_base": -1}, "backoff_base"),
        ({"backoff_cap": math.inf}, "backoff_cap"),
        ({"tombstone_ttl": 0}, "tombstone_ttl"),
    ],
)
async def test_constructor_rejects_bad_options(
    db: Any, clock: ManualClock, kwargs: dict[str, Any], field: str
) -> None:
    with rejects(field):
        AsyncTaskQueue(db, QUEUE, clock=clock, **kwargs)
    assert await read_all(db) == {}


@pytest.mark.parametrize("name", ["", "a$b", "system.tasks", "a\x00b", 5, None])
async def test_constructor_rejects_a_bad_collection_name(
    db: Any, clock: ManualClock, name: Any
) -> None:
    with rejects("name"):
        AsyncTaskQueue(db, name, clock=clock)
    assert await read_all(db) == {}


NOT_ASYNC = ["object", "none", "uri", "pymongo-blocking", "mongomock-blocking"]


@pytest.mark.parametrize("kind", NOT_ASYNC)
async def test_constructor_rejects_a_database_that_is_not_async(
    db: Any, clock: ManualClock, kind: str
) -> None:
    blocking_client = None
    if kind == "pymongo-blocking":
        blocking_client = pymongo.MongoClient("mongodb://localhost:1", connect=False)
        not_async: Any = blocking_client["x"]
    elif kind == "mongomock-blocking":
        not_async = mongomock.MongoClient()["x"]
    else:
        not_async = {"object": object(), "none": None, "uri": "mongodb://localhost"}[kind]

    try:
        with rejects("db") as raised:
            AsyncTaskQueue(not_async, QUEUE, clock=clock)
    finally:
        if blocking_client is not None:
            blocking_client.close()

    assert isinstance(raised.value, ValueError)
    assert await read_all(db) == {}
    if kind == "mongomock-blocking":
        assert not_async[QUEUE].count_documents({}) == 0


async def test_run_fails_a_task_whose_result_cannot_be_stored(
    db: Any, queue: AsyncTaskQueue
) -> None:
    async def handler(task: Task) -> Any:
        return {"$set": {"status": "done"}}

    summary = await queue.run(handler, stop_when_empty=True, worker_id="w")

    assert (summary.claimed, summary.failed, summary.completed) == (1, 1, 0)
    doc = await read(db, "existing")
    assert doc is not None
    assert (doc["status"], doc["result"]) == ("failed", None)
    assert "result.$set" in doc["error"]
