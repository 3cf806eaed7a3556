"""`put(..., run_at=)` (issue 15): a task first claimable at an instant rather than after a
delay. Each test reads the stored task back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from mongoq import InvalidInput, NewTask
from mongoq.testing import ManualClock
from tests.support.helpers import claim_one, later, new_queue, read, utc


async def test_a_task_put_to_run_at_an_instant_is_claimable_from_then_on(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    at = later(clock, 90)
    assert await queue.put("t1", {"n": 1}, run_at=at) == "inserted"
    stored = await read(db, "t1")
    assert stored is not None and (stored["status"], utc(stored["lease_until"])) == ("pending", at)
    clock.advance(89.999)
    assert await queue.claim("w") is None
    clock.advance(0.001)
    assert (await claim_one(queue, "w", expect="t1")).payload == {"n": 1}


async def test_run_at_in_the_past_is_due_at_once_and_any_time_zone_means_the_same_instant(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("past", run_at=later(clock, -3600))
    # Due at once, stored as now: it does not jump ahead of tasks already waiting.
    assert utc((await read(db, "past") or {})["lease_until"]) == clock.now()
    plus_two = later(clock, 30).astimezone(timezone(timedelta(hours=2)))
    assert plus_two.utcoffset() == timedelta(hours=2)
    await queue.put_many([NewTask("zoned", run_at=plus_two)])
    assert utc((await read(db, "zoned") or {})["lease_until"]) == later(clock, 30)
    await claim_one(queue, "w", expect="past")
    assert await queue.claim("w") is None
    clock.advance(30)
    await claim_one(queue, "w", expect="zoned")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"run_at": datetime(2030, 1, 1)}, "timezone-aware"),  # naive: which zone?
        ({"run_at": "2030-01-01T00:00:00Z"}, "timezone-aware"),
        ({"run_at": datetime(2030, 1, 1, tzinfo=UTC), "delay": 5}, "not both"),
        ({"run_at": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=2)))}, "out of range"),
    ],
)
async def test_a_bad_run_at_is_refused_naming_the_field_before_anything_is_written(
    db: Any, clock: ManualClock, options: dict[str, Any], message: str
) -> None:
    queue = await new_queue(db, clock)
    with pytest.raises(InvalidInput, match=message) as put_error:
        await queue.put("t1", **options)
    assert put_error.value.field == "run_at"
    with pytest.raises(InvalidInput, match=message) as many_error:
        await queue.put_many([NewTask("t2", **options)])
    assert many_error.value.field == "tasks[0].run_at"
    assert await read(db, "t1") is None and await read(db, "t2") is None
