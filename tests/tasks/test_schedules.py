"""Schedules (issue 15): periodic tasks honoured by any number of workers, one task a tick.

Time moves by `ManualClock`; each test reads the tasks and the schedule documents back. Three
workers tick at once; a ticker that stops between its put and its advance loses no tick and
doubles none; ticks missed while no worker ran follow the schedule's `missed` policy.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import anyio
import pytest

from mongoq import AsyncTaskQueue, InvalidInput, Task
from mongoq.tasks.models import tick_task_id
from mongoq.testing import FaultInjector, ManualClock, instrument, settle
from tests.support.helpers import QUEUE, napping, new_queue, read_all, wait_for

SCHEDULES = f"{QUEUE}_schedules"
#: A Monday, 10:00 UTC, on a whole minute: ticks fall on round instants.
START = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


async def tasks_by_id(db: Any) -> dict[Any, dict[str, Any]]:
    return {task_id: doc for task_id, doc in (await read_all(db)).items()}


async def stored_schedule(db: Any, name: str) -> dict[str, Any]:
    doc = await db[SCHEDULES].find_one({"_id": name})
    assert doc is not None
    return dict(doc)


def at(minutes: float) -> datetime:
    return START + timedelta(minutes=minutes)


async def test_three_workers_put_exactly_one_task_a_tick_and_run_each_once(
    db: Any, clock: ManualClock
) -> None:
    queues = [await new_queue(db, clock) for _ in range(3)]
    await queues[0].schedule("report", every=60, payload={"kind": "report"})
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    async with anyio.create_task_group() as group:
        for queue in queues:
            group.start_soon(partial(queue.run, handler, poll_interval=1))

        def quiet() -> bool:
            return all(napping(queue) for queue in queues)

        await wait_for(quiet, "every worker to nap")
        for _ in range(10 * 60):  # ten minutes, a second at a time
            clock.advance(1)
            await wait_for(quiet, "every worker to nap again")
        await wait_for(lambda: len(ran) >= 10, "the last tick's task to run")
        for queue in queues:
            queue.stop()
    expected = [tick_task_id("report", at(minute)) for minute in range(1, 11)]
    assert expected[0] == "report@2026-11-30T10:01:00Z"
    docs = await tasks_by_id(db)
    assert sorted(docs) == expected
    assert all(doc["status"] == "done" and doc["payload"] == {"kind": "report"}
               for doc in docs.values())  # fmt: skip
    assert sorted(ran) == expected  # each ran once, whichever worker took it
    schedule = await stored_schedule(db, "report")
    assert (schedule["next_at"].replace(tzinfo=UTC), schedule["last_tick"].replace(tzinfo=UTC)) == (
        at(11), at(10),
    )  # fmt: skip


async def test_a_ticker_stopped_between_its_put_and_its_advance_loses_and_doubles_nothing(
    db: Any, clock: ManualClock
) -> None:
    faults = FaultInjector()
    crashing = await new_queue(instrument(db, faults), clock)
    await crashing.schedule("sync", every=60)
    clock.advance(60)
    # The put applies, then the process dies before the schedule moves on.
    faults.fail_before("update_one", collection=SCHEDULES)
    with pytest.raises(Exception, match="injected"):
        await crashing._scheduler.tick()
    assert sorted(await tasks_by_id(db)) == [tick_task_id("sync", at(1))]
    assert (await stored_schedule(db, "sync"))["next_at"].replace(tzinfo=UTC) == at(1)

    restarted = await new_queue(db, clock)  # another process, later
    clock.advance(30)
    assert await restarted._scheduler.tick() == at(2)
    clock.advance(30)
    await restarted._scheduler.tick()
    docs = await tasks_by_id(db)
    assert sorted(docs) == [tick_task_id("sync", at(1)), tick_task_id("sync", at(2))]
    assert all(doc["revision"] is None and doc["attempts"] == 0 for doc in docs.values())


@pytest.mark.parametrize(
    ("missed", "late", "expected"),
    [
        ("once", 45, [10]),  # ten ticks missed: the latest runs, once
        ("skip", 45, []),  # the latest is 45 s old, past its 30 s grace: none runs
        ("skip", 20, [10]),  # within the grace: it runs
    ],
)
async def test_ticks_missed_while_no_worker_ran_follow_the_missed_policy(
    db: Any, clock: ManualClock, missed: str, late: float, expected: list[int]
) -> None:
    queue = await new_queue(db, clock)
    await queue.schedule("digest", every=60, missed=missed, grace=30)  # type: ignore[arg-type]
    clock.advance(10 * 60 + late)  # down for ten minutes and a bit

    assert await queue._scheduler.tick() == at(11)

    assert sorted(await tasks_by_id(db)) == [tick_task_id("digest", at(m)) for m in expected]
    schedule = await stored_schedule(db, "digest")
    assert schedule["next_at"].replace(tzinfo=UTC) == at(11)
    last = schedule["last_tick"]
    assert (last.replace(tzinfo=UTC) if last else None) == (at(10) if expected else None)


async def test_a_cron_schedule_ticks_in_its_time_zone_across_a_change_of_offset(
    db: Any,
) -> None:
    clock = ManualClock(datetime(2026, 3, 28, 12, 0, tzinfo=UTC))  # Paris: UTC+1 until the 29th
    queue = await new_queue(db, clock)
    schedule = await queue.schedule("morning", cron="0 9 * * *", timezone="Europe/Paris")
    assert schedule.next_at == datetime(2026, 3, 29, 7, 0, tzinfo=UTC)  # 09:00 summer time
    clock.set(datetime(2026, 3, 29, 7, 0, tzinfo=UTC))
    assert await queue._scheduler.tick() == datetime(2026, 3, 30, 7, 0, tzinfo=UTC)
    assert sorted(await tasks_by_id(db)) == ["morning@2026-03-29T07:00:00Z"]


async def test_a_schedule_defined_again_keeps_its_next_tick_and_a_changed_one_starts_afresh(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    first = await queue.schedule("s", every=600, payload=1)
    clock.advance(300)
    again = await queue.schedule("s", every=600, payload=1)  # a worker restarting
    assert again.next_at == first.next_at == at(10)
    changed = await queue.schedule("s", every=60, payload=2)
    assert changed.next_at == at(6) and changed.payload == 2
    assert [s.name for s in await queue.schedules()] == ["s"]
    assert await queue.unschedule("s") is True
    assert await queue.unschedule("s") is False
    assert await queue.schedules() == []
    assert await db[SCHEDULES].count_documents({}) == 0


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({}, "cron"),  # neither
        ({"cron": "* * * * *", "every": 60}, "cron"),  # both
        ({"cron": "every day"}, "cron"),
        ({"every": 0}, "every"),
        ({"every": 1 / 3}, "every"),  # not whole milliseconds: ticks would drift
        ({"every": 0.5}, "every"),  # under a second
        ({"every": 60, "missed": "skip", "grace": 0.5}, "grace"),  # shorter than a wake-up
        ({"every": 60, "timezone": "Mars/Olympus"}, "timezone"),
        ({"every": 60, "missed": "all"}, "missed"),
        ({"every": 60, "grace": -1}, "grace"),
        ({"every": 60, "payload": {"$bad": 1}}, "payload"),
        ({"every": 60, "priority": "high"}, "priority"),
    ],
)
async def test_a_bad_schedule_is_refused_naming_the_field_before_anything_is_written(
    db: Any, clock: ManualClock, options: dict[str, Any], field: str
) -> None:
    queue = await new_queue(db, clock)
    with pytest.raises(InvalidInput) as error:
        await queue.schedule("s", **options)
    assert error.value.field.startswith(field)
    with pytest.raises(InvalidInput) as bad_name:
        await queue.schedule("", every=60)
    assert bad_name.value.field == "name"
    assert await db[SCHEDULES].count_documents({}) == 0


@pytest.mark.parametrize("every", [0, 0.5, 0.999, -5])
async def test_an_every_under_the_minimum_is_refused_with_the_minimum_named(
    db: Any, clock: ManualClock, every: float
) -> None:
    queue = await new_queue(db, clock)
    with pytest.raises(InvalidInput) as error:
        await queue.schedule("s", every=every)
    assert (error.value.field, str(error.value)) == (
        "every",
        f"every: must be at least 1 second, got {every!r}",
    )
    with pytest.raises(InvalidInput) as drifting:  # at least a second, but not whole ms
        await queue.schedule("s", every=1.0005)
    assert str(drifting.value) == "every: must be whole milliseconds, got 1.0005"
    assert await queue.schedule("s", every=1)  # the minimum itself is taken
    assert [s.every for s in await queue.schedules()] == [1.0]


def test_the_schedule_docstring_states_the_minimum_every() -> None:
    doc = AsyncTaskQueue.schedule.__doc__ or ""
    assert "at least 1 second" in " ".join(doc.split())


async def test_a_worker_without_schedules_sends_no_schedule_read(
    db: Any, clock: ManualClock
) -> None:
    from mongoq.testing import CommandCounter

    counter = CommandCounter()
    queue = AsyncTaskQueue(instrument(db, counter), QUEUE, clock=clock)
    await queue.setup()
    counter.reset()

    async def handler(task: Task) -> None:
        return None

    async with anyio.create_task_group() as group:
        group.start_soon(partial(queue.run, handler, poll_interval=1, schedules=False))
        await settle()
        clock.advance(120)
        await settle()
        queue.stop()
    assert counter.counts[f"{SCHEDULES}.find"] == 0


async def test_a_schedule_that_cannot_tick_here_is_said_and_the_others_tick_on(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A schedule stored by another host with a time zone this one lacks: its ticker says so,
    leaves it, and ticks the rest; the worker keeps running."""
    queue = await new_queue(db, clock)
    await queue.schedule("good", every=60)
    await queue.schedule("bad", cron="* * * * *")
    await db[SCHEDULES].update_one({"_id": "bad"}, {"$set": {"timezone": "Nowhere/Atlantis"}})
    ran: list[str] = []

    async def handler(task: Task) -> None:
        ran.append(str(task.id))

    with caplog.at_level(logging.ERROR, logger="mongoq.tasks"), anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(partial(queue.run, handler, poll_interval=1))
            await wait_for(lambda: napping(queue), "the worker to nap")
            for _ in range(130):
                clock.advance(1)
                await wait_for(lambda: napping(queue), "the worker to nap again")
            await wait_for(lambda: len(ran) >= 2, "both ticks' tasks to run")
            queue.stop()
    assert ran == [tick_task_id("good", at(1)), tick_task_id("good", at(2))]
    assert any("'bad' cannot tick here" in r.getMessage() for r in caplog.records)
