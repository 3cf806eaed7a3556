"""The tools of `mongoq.testing`: ManualClock, all_interleavings, Interleaving, FaultInjector,
CommandCounter. Each is checked against what a database actually stored."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout, OperationFailure

from mongoq.testing import (
    CommandCounter,
    FaultInjector,
    Interleaving,
    ManualClock,
    all_interleavings,
    instrument,
)
from tests.support.helpers import new_queue, read, read_all, wait_for

LOG = "log"


async def log(db: Any, entry: str) -> None:
    """One command: append `entry` to the log document."""
    await db[LOG].update_one({"_id": "log"}, {"$push": {"entries": entry}}, upsert=True)


async def logged(db: Any) -> list[str]:
    doc = await db[LOG].find_one({"_id": "log"})
    return [] if doc is None else list(doc["entries"])


# ---------------------------------------------------------------------------- ManualClock


async def test_manual_clock_starts_near_wall_clock_time(db: Any, clock: ManualClock) -> None:
    wall = datetime.now(UTC)
    assert abs(clock.now() - wall) < timedelta(minutes=1)
    assert clock.now().year >= 2024
    assert clock.now().microsecond % 1000 == 0  # BSON precision

    queue = await new_queue(db, clock)
    await queue.put("t1")

    doc = await read(db, "t1")
    assert doc is not None and doc["created_at"] == clock.now()
    assert doc["created_at"] > datetime(2000, 1, 1, tzinfo=UTC)


async def test_manual_clock_can_start_at_a_given_instant(db: Any) -> None:
    start = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    clock = ManualClock(start)
    assert clock.now() == start.replace(microsecond=678000)

    await (await new_queue(db, clock)).put("t1", delay=60)

    doc = await read(db, "t1")
    assert doc is not None and doc["lease_until"] == start.replace(microsecond=678000, minute=5)


async def test_advance_wakes_sleepers_in_deadline_order(db: Any, clock: ManualClock) -> None:
    woken: list[float] = []

    async def sleeper(seconds: float) -> None:
        await clock.sleep(seconds)
        woken.append(seconds)
        await log(db, f"woke after {seconds:g}s at +{(clock.now() - start).total_seconds():g}s")

    start = clock.now()
    async with anyio.create_task_group() as group:
        for seconds in (3, 1, 2, 5):
            group.start_soon(sleeper, seconds)
        await wait_for(lambda: clock.sleepers == 4, "four sleepers")
        assert clock.next_wakeup() == start + timedelta(seconds=1)

        clock.advance(0.999)
        await wait_for(lambda: clock.sleepers == 4, "nobody woken early")
        assert woken == []
        clock.advance(0.001)
        await wait_for(lambda: woken == [1], "the 1 s sleeper")
        assert clock.next_wakeup() == start + timedelta(seconds=2)

        clock.advance(2.5)  # passes two deadlines at once: woken in deadline order
        await wait_for(lambda: len(woken) == 3, "the 2 s and 3 s sleepers")
        assert woken == [1, 2, 3]
        assert clock.sleepers == 1

        clock.set(start + timedelta(seconds=5))
        await wait_for(lambda: len(woken) == 4, "the last sleeper")

    assert clock.sleepers == 0 and clock.next_wakeup() is None
    # (Sorted: the two sleepers woken together may reach a real server in either order.)
    assert sorted(await logged(db)) == [
        "woke after 1s at +1s",
        "woke after 2s at +3.5s",
        "woke after 3s at +3.5s",
        "woke after 5s at +5s",
    ]


async def test_a_cancelled_sleep_removes_its_sleeper(db: Any, clock: ManualClock) -> None:
    async def sleeper(seconds: float) -> None:
        await clock.sleep(seconds)
        await log(db, f"woke after {seconds:g}s")

    async with anyio.create_task_group() as outer:
        outer.start_soon(sleeper, 20)
        async with anyio.create_task_group() as doomed:
            doomed.start_soon(sleeper, 10)
            await wait_for(lambda: clock.sleepers == 2, "two sleepers")
            doomed.cancel_scope.cancel()
        assert clock.sleepers == 1
        assert clock.next_wakeup() == clock.now() + timedelta(seconds=20)
        clock.advance(20)

    assert clock.sleepers == 0
    assert await logged(db) == ["woke after 20s"]


async def test_manual_clock_never_goes_backwards(db: Any, clock: ManualClock) -> None:
    now = clock.now()
    with pytest.raises(ValueError):
        clock.advance(-1)
    with pytest.raises(ValueError):
        clock.set(now - timedelta(milliseconds=1))
    assert clock.now() == now

    await (await new_queue(db, clock)).put("t1")
    assert (await read(db, "t1") or {})["created_at"] == now


async def test_a_zero_sleep_does_not_wait_for_the_clock(db: Any, clock: ManualClock) -> None:
    await clock.sleep(0)
    await clock.sleep(-1)
    assert clock.sleepers == 0
    await log(db, "after")
    assert await logged(db) == ["after"]


# ------------------------------------------------------------------ interleavings, in order


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ({"A": 2, "B": 1}, ["AAB", "ABA", "BAA"]),
        ({"A": 1, "B": 1}, ["AB", "BA"]),
        ({"A": 3}, ["AAA"]),
        ({"A": 0, "B": 1}, ["B"]),
    ],
)
async def test_all_interleavings_lists_every_distinct_order(
    db: Any, counts: dict[str, int], expected: list[str]
) -> None:
    orders = ["".join(order) for order in all_interleavings(counts)]
    assert orders == expected
    await log(db, "checked")
    assert await logged(db) == ["checked"]


@pytest.mark.parametrize(
    ("counts", "total"),
    [({"A": 2, "B": 2}, 6), ({"A": 1, "B": 1, "C": 1}, 6), ({"A": 2, "B": 2, "C": 2}, 90)],
)
async def test_all_interleavings_counts(db: Any, counts: dict[str, int], total: int) -> None:
    orders = [tuple(order) for order in all_interleavings(counts)]
    assert len(orders) == total == len(set(orders))
    for order in orders:
        assert {actor: order.count(actor) for actor in counts} == counts
    await log(db, str(total))
    assert await logged(db) == [str(total)]


def logger(db: Any, actor: str, commands: int) -> Callable[[], Awaitable[str]]:
    async def act() -> str:
        for number in range(1, commands + 1):
            await log(db, f"{actor}{number}")
        return actor

    return act


async def test_interleaving_runs_the_commands_in_every_given_order(db: Any) -> None:
    for order in all_interleavings({"A": 2, "B": 2}):
        interleaving = Interleaving(order)
        wrapped = instrument(db, interleaving)
        await db[LOG].delete_many({})

        results = await interleaving.run(
            {"A": logger(wrapped, "A", 2), "B": logger(wrapped, "B", 2)}
        )

        assert results == {"A": "A", "B": "B"}
        assert [actor for actor, _, _ in interleaving.trace] == order
        assert interleaving.trace[0] == (order[0], LOG, "update_one")
        assert [entry[0] for entry in await logged(db)] == order


async def test_interleaving_skips_the_turns_of_an_actor_that_finished(db: Any) -> None:
    interleaving = Interleaving(["B", "A", "B", "B", "A"])  # B has only one command
    wrapped = instrument(db, interleaving)

    results = await interleaving.run({"A": logger(wrapped, "A", 3), "B": logger(wrapped, "B", 1)})

    assert results == {"A": "A", "B": "B"}
    assert await logged(db) == ["B1", "A1", "A2", "A3"]  # A's third runs after the order ends


async def test_interleaving_reports_an_actors_exception_and_runs_the_others(db: Any) -> None:
    interleaving = Interleaving(["A", "B", "A", "B"])
    wrapped = instrument(db, interleaving)

    async def failing() -> None:
        await log(wrapped, "B1")
        raise RuntimeError("B broke")

    results = await interleaving.run({"A": logger(wrapped, "A", 2), "B": failing})

    assert results["A"] == "A"
    assert isinstance(results["B"], RuntimeError)
    assert await logged(db) == ["A1", "B1", "A2"]


async def test_commands_outside_the_actors_are_not_held(db: Any) -> None:
    interleaving = Interleaving(["B", "A"])
    wrapped = instrument(db, interleaving)

    await log(wrapped, "setup")  # before run(): no actor, runs at once

    await interleaving.run({"A": logger(wrapped, "A", 1), "B": logger(wrapped, "B", 1)})
    assert await logged(db) == ["setup", "B1", "A1"]
    assert [actor for actor, _, _ in interleaving.trace] == ["B", "A"]


# ---------------------------------------------------------------------------- FaultInjector


async def test_fail_before_raises_without_applying(db: Any) -> None:
    faults = FaultInjector()
    wrapped = instrument(db, faults)
    faults.fail_before("update_one", collection=LOG, times=2)

    for _ in range(2):
        with pytest.raises(AutoReconnect, match=r"before log\.update_one"):
            await log(wrapped, "lost")
    assert await logged(db) == []

    await log(wrapped, "kept")  # the rule is used up
    assert await logged(db) == ["kept"]
    assert [(op.collection, op.name) for op in faults.triggered] == [(LOG, "update_one")] * 2


async def test_fail_after_applies_then_raises(db: Any) -> None:
    faults = FaultInjector()
    wrapped = instrument(db, faults)
    faults.fail_after("update_one")

    with pytest.raises(NetworkTimeout, match=r"after log\.update_one was applied"):
        await log(wrapped, "applied")

    assert await logged(db) == ["applied"]
    await log(wrapped, "second")
    assert await logged(db) == ["applied", "second"]


async def test_faults_pick_their_command_by_name_collection_and_match(db: Any) -> None:
    faults = FaultInjector()
    wrapped = instrument(db, faults)
    faults.fail_before(
        "insert_one",
        collection="other",
        match=lambda op: op.args[0]["_id"] == "bad",
        error=OperationFailure("custom"),
    )

    await wrapped[LOG].insert_one({"_id": "bad"})  # other collection: untouched by the rule
    await wrapped["other"].insert_one({"_id": "good"})  # not matched
    with pytest.raises(OperationFailure, match="custom"):
        await wrapped["other"].insert_one({"_id": "bad"})

    assert set(await read_all(db, LOG)) == {"bad"}
    assert set(await read_all(db, "other")) == {"good"}
    assert len(faults.triggered) == 1


async def test_pause_before_holds_a_command_until_released(db: Any) -> None:
    faults = FaultInjector()
    wrapped = instrument(db, faults)
    pause = faults.pause_before(
        "update_one", match=lambda op: op.args[1]["$push"]["entries"] == "held"
    )

    async with anyio.create_task_group() as group:
        group.start_soon(log, wrapped, "held")
        await pause.reached.wait()
        assert await logged(db) == []
        await log(wrapped, "overtaking")  # other commands pass meanwhile
        assert await logged(db) == ["overtaking"]
        pause.release()

    assert await logged(db) == ["overtaking", "held"]


async def test_pause_after_applies_a_command_and_holds_its_reply_until_released(db: Any) -> None:
    faults = FaultInjector()
    wrapped = instrument(db, faults)
    pause = faults.pause_after(
        "update_one", match=lambda op: op.args[1]["$push"]["entries"] == "held"
    )
    replied = anyio.Event()

    async def send() -> None:
        await log(wrapped, "held")
        replied.set()

    async with anyio.create_task_group() as group:
        group.start_soon(send)
        await pause.reached.wait()
        assert await logged(db) == ["held"]  # applied on the server...
        assert not replied.is_set()  # ...while its caller still waits for the answer
        await log(wrapped, "after")
        pause.release()

    assert replied.is_set()
    assert await logged(db) == ["held", "after"]


async def test_cleared_faults_fire_no_more(db: Any) -> None:
    faults = FaultInjector()
    wrapped = instrument(db, faults)
    faults.fail_before("update_one")
    faults.clear()

    await log(wrapped, "fine")

    assert await logged(db) == ["fine"]
    assert faults.triggered == []


# --------------------------------------------------------------------------- CommandCounter


async def test_command_counter_counts_by_collection_and_command(db: Any) -> None:
    counter = CommandCounter()
    counter.record = True
    wrapped = instrument(db, counter)

    await log(wrapped, "one")
    await log(wrapped, "two")
    await wrapped["other"].insert_one({"_id": 1})
    await wrapped["other"].find({}).to_list(None)
    await wrapped["other"].find_one({"_id": 1})

    assert counter.counts == {
        "log.update_one": 2,
        "other.insert_one": 1,
        "other.find": 1,
        "other.find_one": 1,
    }
    assert counter.total == 5
    assert [op.name for op in counter.operations] == [
        "update_one",
        "update_one",
        "insert_one",
        "find",
        "find_one",
    ]
    assert counter.operations[2].args == ({"_id": 1},)
    assert await logged(db) == ["one", "two"]

    counter.reset()
    assert counter.total == 0 and counter.operations == []


async def test_hooks_compose_in_order(db: Any) -> None:
    counter = CommandCounter()
    faults = FaultInjector()
    wrapped = instrument(db, counter, faults)
    faults.fail_before("update_one")

    with pytest.raises(AutoReconnect):
        await log(wrapped, "lost")

    assert counter.counts == {"log.update_one": 1}  # counted, then failed by the next hook
    assert await logged(db) == []
