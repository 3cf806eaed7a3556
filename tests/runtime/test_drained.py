"""`run(stop_when_empty=True)` stops when nothing is due *now*; `run(stop_when_drained=True)`
waits (on the primitive's clock) for delayed retries and stops only when nothing is left."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from mongoq import GroupLease, InvalidInput, OutboxDispatcher, Task
from mongoq.runtime.events import Tally
from mongoq.runtime.loop import WorkerLoop
from mongoq.testing import ManualClock, settle
from tests.support.group_helpers import dead, messages, new_transport
from tests.support.helpers import in_background, napping, new_queue, read
from tests.support.outbox_helpers import deliveries, event, new_outbox


async def drive(
    clock: ManualClock, run: Awaitable[Any], step: float, quiet: Callable[[], bool]
) -> Any:
    """Await `run` while moving the clock `step` seconds whenever it waits on the clock only
    (`quiet`), never on a command's reply."""
    return await in_background(clock, run, advance=step, quiet=quiet)


def dispatcher_napping(dispatcher: OutboxDispatcher) -> bool:
    return napping(dispatcher)


def fails_first(times: int) -> Any:
    calls: list[Any] = []

    async def handler(item: Any, *context: Any) -> str:
        calls.append(item)
        if len(calls) <= times:
            raise ValueError(f"transient {len(calls)}")
        return "ok"

    handler.calls = calls  # type: ignore[attr-defined]
    return handler


async def test_a_task_queue_drains_through_its_retries(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock, backoff_base=10, backoff_cap=10)
    await queue.put("t", {"n": 1})
    handler = fails_first(2)

    early = await queue.run(handler, stop_when_empty=True)
    doc = await read(db, "t")
    assert doc is not None and (early.retried, doc["status"]) == (1, "pending")

    summary = await drive(
        clock, queue.run(handler, stop_when_drained=True), step=5, quiet=lambda: napping(queue)
    )

    assert (summary.retried, summary.completed) == (1, 1)
    doc = await read(db, "t")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["result"]) == ("done", 3, "ok")
    assert [task.id for task in handler.calls] == ["t", "t", "t"]


async def test_a_drained_run_on_an_empty_queue_returns_at_once(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    await queue.put("done-already", None)
    await queue.run(fails_first(0), stop_when_empty=True)

    summary = await queue.run(fails_first(0), stop_when_drained=True, concurrency=3)

    assert summary.claimed == 0
    doc = await read(db, "done-already")
    assert doc is not None and doc["status"] == "done"


async def test_a_group_transport_drains_through_parked_groups(db: Any, clock: ManualClock) -> None:
    transport = await new_transport(db, clock)
    for n in range(3):
        await transport.publish("g", n)
    await transport.publish("h", 0)
    handled: list[tuple[Any, Any]] = []

    async def handler(lease: GroupLease) -> str:
        handled.append((lease.group_id, lease.event))
        if handled.count(("g", 0)) == 1 and (lease.group_id, lease.event) == ("g", 0):
            raise ValueError("transient")  # g's head fails once, whichever slot runs first
        return "ok"

    summary = await drive(
        clock,
        transport.run(handler, stop_when_drained=True, retry_delay=10, concurrency=2),
        step=5,
        quiet=lambda: napping(transport),
    )

    assert (summary.retried, summary.acked) == (1, 4)
    assert await messages(db) == {}
    assert await dead(db) == {}
    assert sorted(handled) == [("g", 0), ("g", 0), ("g", 1), ("g", 2), ("h", 0)]
    assert [e for g, e in handled if g == "g"] == [0, 0, 1, 2]  # FIFO through the retry


async def test_a_dispatcher_drains_through_its_backoff(db: Any, clock: ManualClock) -> None:
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})
    await outbox.publish([event(1), event(2)], session=None)
    handler = fails_first(1)
    dispatcher = OutboxDispatcher(outbox, {"h": handler}, backoff=lambda a: 10)

    summary = await drive(
        clock, dispatcher.run(stop_when_drained=True), step=5,
        quiet=lambda: dispatcher_napping(dispatcher),
    )  # fmt: skip

    assert (summary.retried, summary.completed) == (1, 2)
    assert await deliveries(db) == []


async def test_both_ways_to_stop_at_once_are_refused(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t", None)
    transport = await new_transport(db, clock)

    async def handle(item: Task | GroupLease) -> None:
        raise AssertionError("nothing may run")

    with pytest.raises(InvalidInput, match=r"^stop_when_drained: choose one"):
        await queue.run(handle, stop_when_empty=True, stop_when_drained=True)
    with pytest.raises(InvalidInput, match=r"^stop_when_drained: choose one"):
        await transport.run(handle, stop_when_empty=True, stop_when_drained=True)
    with pytest.raises(InvalidInput, match=r"^stop_when_empty: must be a bool"):
        await queue.run(handle, stop_when_empty="yes")
    doc = await read(db, "t")
    assert doc is not None and (doc["status"], doc["attempts"]) == ("pending", 0)


# ------------------------------------------------------- the loop's drain rule, without a database


class Loop:
    """A WorkerLoop over a fake source: `items` are claimed in turn, each processed until its
    gate opens; `due` is what "what is left" answers."""

    fills = False
    wake_key = None
    changes = None
    services = ()
    name = "fake"

    def __init__(self, clock: ManualClock, items: list[str], due: Any, concurrency: int) -> None:
        self.clock = clock
        self.tally = Tally(object(), "fake", "fake")
        self.items = list(items)
        self.due = due
        self.claims = 0
        self.asked = 0
        self.gates = {item: anyio.Event() for item in items}
        self.processed: list[str] = []
        self.comes_back: dict[str, list[str]] = {}
        self.loop = WorkerLoop([self], concurrency=concurrency, stop_when_drained=True)

    async def claim(self, limit: int) -> list[str]:
        self.claims += 1
        return [self.items.pop(0)] if self.items else []

    async def process(self, item: str) -> None:
        await self.gates[item].wait()
        self.processed.append(item)
        self.items += self.comes_back.pop(item, [])  # e.g. a retry, due at once

    async def next_due(self) -> Any:
        self.asked += 1
        return self.due


async def test_a_drained_loop_polls_rather_than_spins_when_something_is_due_it_cannot_claim(
    clock: ManualClock,
) -> None:
    """Something due now that this worker cannot claim (below its priority, an expired last
    attempt awaiting housekeeping, taken by another worker): it waits a poll, never spins."""
    fake = Loop(clock, [], due=clock.now(), concurrency=2)
    async with anyio.create_task_group() as group:
        group.start_soon(fake.loop.run)
        await settle()
        first = fake.claims
        await settle()
        assert fake.claims == first == 2  # one claim per slot, then each naps a poll
        clock.advance(1)  # the poll interval
        await settle()
        assert fake.claims == 4
        group.cancel_scope.cancel()


async def test_a_drained_loop_does_not_stop_while_another_slot_still_works(
    clock: ManualClock,
) -> None:
    """Nothing left while another slot's item is in flight is not the end: that item may
    come back (a retry the reading of what is left missed). The loop stops only once nothing
    is in flight either, so the retry is run."""
    fake = Loop(clock, ["a"], due=None, concurrency=2)
    fake.comes_back["a"] = ["a-again"]
    fake.gates["a-again"] = anyio.Event()
    fake.gates["a-again"].set()
    returned: list[bool] = []

    async def run() -> None:
        await fake.loop.run()
        returned.append(True)

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        await settle()
        assert (fake.claims, fake.asked, returned) == (2, 1, [])  # a in flight: no stop
        fake.gates["a"].set()
        await settle()  # a done: its slot claims nothing, asks, and stops the loop
        clock.advance(1)
        await settle()
        assert returned == [True]
    assert fake.processed == ["a", "a-again"]
