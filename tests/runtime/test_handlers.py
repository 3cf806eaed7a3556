"""Handlers are checked where they are given, before anything is claimed.

A plain function given to the async API used to run, side effects and all, before awaiting its
result raised `TypeError`; the item was retried and the side effects repeated up to the attempt
limit. A coroutine function given to `mongoq_sync` stored ``<coroutine ...>`` as the failure.
Both are now refused with `InvalidInput` naming the handler, and the database is unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

import mongoq_sync
from mongoq import InvalidInput, OutboxDispatcher
from mongoq.testing import ManualClock
from tests.support.group_helpers import messages, new_transport
from tests.support.helpers import new_queue, read
from tests.support.outbox_helpers import deliveries, event, new_outbox

calls: list[Any] = []


def blocking(item: Any, *context: Any) -> str:
    calls.append(item)
    return "done"


async def asynchronous(item: Any, *context: Any) -> str:
    calls.append(item)
    return "done"


class AsyncCallable:
    async def __call__(self, item: Any) -> str:
        calls.append(item)
        return "done"


class Derived(AsyncCallable):
    pass


@pytest.fixture(autouse=True)
def no_calls() -> None:
    calls.clear()


NOT_ASYNC = [blocking, lambda item: asynchronous(item), functools.partial(blocking), "handler"]
NOT_ASYNC_IDS = ["function", "lambda-returning-a-coroutine", "partial", "not-callable"]


@pytest.mark.parametrize("handler", NOT_ASYNC, ids=NOT_ASYNC_IDS)
async def test_run_refuses_a_handler_that_is_not_async_before_claiming(
    db: Any, clock: ManualClock, handler: Any
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t", {"n": 1})
    transport = await new_transport(db, clock)
    await transport.publish("g", {"n": 1})

    for run in (queue.run, transport.run):
        for batch_size in (1, 4):
            with pytest.raises(InvalidInput, match=r"^handler: ") as caught:
                await run(handler, stop_when_empty=True, batch_size=batch_size)
            assert caught.value.field == "handler"

    assert calls == []
    doc = await read(db, "t")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc.get("worker_id")) == ("pending", 0, None)
    stored = list((await messages(db)).values())
    assert [(m["group_id"], m["deliveries"], m["token"]) for m in stored] == [("g", 0, None)]


@pytest.mark.parametrize("handler", NOT_ASYNC, ids=NOT_ASYNC_IDS)
async def test_the_dispatcher_refuses_a_handler_that_is_not_async(
    db: Any, clock: ManualClock, handler: Any
) -> None:
    outbox = await new_outbox(db, clock, subscriptions={"*": ["good", "bad"]})
    await outbox.publish([event(1)], session=None)

    with pytest.raises(InvalidInput, match=r"^handlers\['bad'\]: "):
        OutboxDispatcher(outbox, {"good": asynchronous, "bad": handler})

    assert calls == []
    assert sorted((d["handler"], d["status"], d["attempts"]) for d in await deliveries(db)) == [
        ("bad", "pending", 0),
        ("good", "pending", 0),
    ]


@pytest.mark.parametrize(
    "handler",
    [asynchronous, functools.partial(asynchronous), AsyncCallable(), Derived()],
    ids=["async-def", "partial-of-async", "async-call", "inherited-async-call"],
)
async def test_async_handlers_of_every_shape_are_accepted(
    db: Any, clock: ManualClock, handler: Any
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t", {"n": 1})

    summary = await queue.run(handler, stop_when_empty=True)

    assert summary.completed == 1
    assert [task.id for task in calls] == ["t"]
    doc = await read(db, "t")
    assert doc is not None
    assert (doc["status"], doc["result"]) == ("done", "done")


def test_the_sync_facade_refuses_a_coroutine_function() -> None:
    db = mongoq_sync.connect()
    try:
        queue = mongoq_sync.TaskQueue(db, "handlers")
        queue.setup()
        queue.put("t", {"n": 1})
        for handler in (asynchronous, AsyncCallable()):
            with pytest.raises(InvalidInput, match=r"^handler: must be a plain function"):
                queue.run(handler, stop_when_empty=True)  # type: ignore[arg-type]
        transport = mongoq_sync.GroupTransport(db, "handlers")
        with pytest.raises(InvalidInput, match=r"^handler: must be a plain function"):
            transport.run(asynchronous, stop_when_empty=True)  # type: ignore[arg-type]
        outbox = mongoq_sync.Outbox(db, "handlers_", subscriptions={"*": ["h"]})
        with pytest.raises(InvalidInput, match=r"^handlers\['h'\]: must be a plain function"):
            mongoq_sync.OutboxDispatcher(outbox, {"h": asynchronous})

        task = queue.get("t")
        assert task is not None
        assert (task.status, task.attempts, calls) == ("pending", 0, [])
        # and a blocking handler still runs
        assert queue.run(blocking, stop_when_empty=True).completed == 1
        done = queue.get("t")
        assert done is not None and (done.status, done.result) == ("done", "done")
    finally:
        db.close()
