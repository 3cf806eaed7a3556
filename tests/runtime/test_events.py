"""The run loops report every outcome they count, and each handler's duration on the
primitive's clock, to the observers of `mongoq.runtime.events` (what `mongoq.metrics` hears)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from mongoq import OutboxDispatcher
from mongoq.runtime import events
from mongoq.testing import ManualClock
from tests.support.group_helpers import new_transport
from tests.support.helpers import new_queue
from tests.support.outbox_helpers import event, new_outbox


@pytest.fixture
def heard() -> Iterator[list[events.RunEvent]]:
    seen: list[events.RunEvent] = []
    stop = events.subscribe(seen.append)
    yield seen
    stop()


def handler_for(clock: ManualClock) -> Any:
    async def handler(item: Any, *context: Any) -> None:
        clock.advance(2)  # every handler runs 2 s of the clock
        if getattr(item, "id", getattr(item, "event", None)) in ("bad", {"n": "bad"}):
            raise ValueError("bad")

    return handler


def outcomes(heard: list[events.RunEvent]) -> Counter[tuple[str, str, str]]:
    counted: Counter[tuple[str, str, str]] = Counter()
    for e in heard:
        if not e.outcome.endswith("_seconds") and not e.service:
            counted[(e.primitive, e.queue, e.outcome)] += e.count
    return counted


def durations(heard: list[events.RunEvent]) -> list[float]:
    return [e.seconds for e in heard if e.outcome == "handler_seconds"]


def delays(heard: list[events.RunEvent]) -> list[tuple[str, float]]:
    return [(e.primitive, e.seconds) for e in heard if e.outcome == "start_delay_seconds"]


@pytest.mark.parametrize("batch_size", [1, 2])
async def test_a_task_run_reports_what_its_summary_counts(
    db: Any, clock: ManualClock, heard: list[events.RunEvent], batch_size: int
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("good", 1)
    await queue.put("bad", 2)

    summary = await queue.run(handler_for(clock), stop_when_empty=True, batch_size=batch_size)

    assert (summary.claimed, summary.completed, summary.retried) == (2, 1, 1)
    assert outcomes(heard) == Counter(
        {("tasks", queue.name, "claimed"): 2, ("tasks", queue.name, "completed"): 1,
         ("tasks", queue.name, "retried"): 1}
    )  # fmt: skip
    assert durations(heard) == [2.0, 2.0]
    # Both due when put; one at a time, the second waits out the first's 2 s handler.
    assert delays(heard) == ([("tasks", 0.0), ("tasks", 2.0)] if batch_size == 1
                             else [("tasks", 0.0), ("tasks", 0.0)])  # fmt: skip
    assert (await queue.get("good")).status == "done"  # type: ignore[union-attr]


async def test_a_group_run_and_a_dispatcher_report_too(
    db: Any, clock: ManualClock, heard: list[events.RunEvent]
) -> None:
    transport = await new_transport(db, clock)
    await transport.publish("g", {"n": "good"})
    await transport.publish("h", {"n": "bad"})
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})
    await outbox.publish([event(1)], session=None)

    await transport.run(handler_for(clock), stop_when_empty=True, retry_delay=10)
    await OutboxDispatcher(outbox, {"h": handler_for(clock)}).run(stop_when_empty=True)

    assert outcomes(heard) == Counter(
        {("groups", transport.prefix, "claimed"): 2, ("groups", transport.prefix, "acked"): 1,
         ("groups", transport.prefix, "retried"): 1, ("outbox", outbox.prefix, "claimed"): 1,
         ("outbox", outbox.prefix, "completed"): 1}
    )  # fmt: skip
    assert durations(heard) == [2.0, 2.0, 2.0]
    # The outbox's event was due when published; claimed after the groups' two 2 s handlers.
    assert [d for d in delays(heard) if d[0] == "outbox"] == [("outbox", 4.0)]


async def test_an_observer_that_raises_does_not_stop_the_run(db: Any, clock: ManualClock) -> None:
    def broken(event: events.RunEvent) -> None:
        raise RuntimeError("observer bug")

    stop = events.subscribe(broken)
    try:
        queue = await new_queue(db, clock)
        await queue.put("good", 1)
        summary = await queue.run(handler_for(clock), stop_when_empty=True)
    finally:
        stop()
    assert summary.completed == 1
    assert (await queue.get("good")).status == "done"  # type: ignore[union-attr]
