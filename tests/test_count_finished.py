"""`count_finished(since, until)` of the task queue and the outbox: the items finished in the
window ``[since, until)`` that are still stored, which the dashboard's throughput chart reads
(consecutive windows count each item once; a purge of older items does not move them)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from mongoq import AsyncTaskQueue, InvalidInput, NewTask
from mongoq.outbox import AsyncOutbox, Event
from mongoq.testing import ManualClock


async def finish(queue: AsyncTaskQueue, how: str) -> None:
    task = await queue.claim("w")
    assert task is not None
    if how == "done":
        await queue.complete(task)
    elif how == "failed":
        await queue.fail(task, "no")
    else:
        await queue.cancel(task.id)


async def test_tasks_finished_in_a_window_are_counted_once_whatever_ended_them(
    db: Any, clock: ManualClock
) -> None:
    queue = AsyncTaskQueue(db, "jobs", clock=clock, max_attempts=1)
    await queue.setup()
    await queue.put_many([NewTask(f"t{n}") for n in range(5)])
    start = clock.now()
    await finish(queue, "done")
    await finish(queue, "failed")
    clock.advance(10)
    middle = clock.now()
    await finish(queue, "cancelled")  # at `middle`: in the second window, not the first
    await finish(queue, "done")
    clock.advance(10)
    end = clock.now()

    assert await queue.count_finished(start, middle) == 2
    assert await queue.count_finished(middle, end) == 2
    assert await queue.count_finished(start) == 4  # up to now
    assert await queue.count_finished(end) == 0
    await queue.purge("done", 15)  # the first window's done task, 20 s old
    assert await queue.count_finished(middle, end) == 2  # the later window is untouched
    statuses = sorted(d["status"] for d in await db["jobs"].find({}).to_list(None))
    assert statuses == ["cancelled", "done", "failed", "pending"]


async def test_an_outbox_counts_completions_and_burials_with_its_history_only(
    odb: Any, clock: ManualClock
) -> None:
    outbox = AsyncOutbox(odb, "ob_", subscriptions={"t": ["h"]}, clock=clock,
                         completion_history=True)  # fmt: skip
    await outbox.setup()
    await outbox.publish([Event(id=f"e{n}", type="t") for n in range(3)], session=None)
    start = clock.now()
    first, second, third = await outbox.claim("w", limit=3)
    assert await outbox.complete(first)
    assert await outbox.bury(second, error="no")
    clock.advance(5)
    assert await outbox.complete(third)
    clock.advance(5)

    assert await outbox.count_finished(start, start + timedelta(seconds=5)) == 2
    assert await outbox.count_finished(start + timedelta(seconds=5)) == 1
    assert await odb["ob_completed_deliveries"].count_documents({}) == 2
    without = AsyncOutbox(odb, "ob_", subscriptions={"t": ["h"]}, clock=clock)
    assert await without.count_finished(start) is None  # no record of a completion to count


@pytest.mark.parametrize(
    ("since", "until", "field"),
    [
        (datetime(2026, 1, 1), None, "since"),  # naive
        ("2026-01-01", None, "since"),
        (datetime(2026, 1, 2).astimezone(), datetime(2026, 1, 1).astimezone(), "until"),
    ],
)
async def test_a_window_must_be_aware_and_in_order(
    db: Any, since: Any, until: Any, field: str
) -> None:
    queue = AsyncTaskQueue(db, "jobs")
    with pytest.raises(InvalidInput) as error:
        await queue.count_finished(since, until)
    assert error.value.field == field
