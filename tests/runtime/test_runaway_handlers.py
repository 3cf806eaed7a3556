"""A handler that swallows its cancellation (a bare ``except:`` around an ``await``) is cancelled
once, given `GRACE` seconds of the clock, then abandoned: its lease is no longer renewed, its
slot is free for the next item, it is counted lost, one WARNING names it, and nothing delivers
the cancellation again in a loop (the busy spin a cancel scope around it would make). The same
in the task queue, the group transport and the outbox's dispatcher."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

import mongoq
from mongoq import OutboxDispatcher, Task
from mongoq.runtime.handler import GRACE
from mongoq.testing import ManualClock, settle
from tests.support.group_helpers import PREFIX, new_transport
from tests.support.helpers import LEASE_TTL, new_queue, read, wait_for
from tests.support.outbox_helpers import deliveries, event, new_outbox

TIMEOUT = 2.0


class Swallower:
    """Runs the first item it gets until `release` is set, swallowing every cancellation (and
    counting them); any later item returns at once."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.cancellations = 0
        self.items: list[Any] = []

    async def __call__(self, item: Any, *context: Any) -> str:
        self.items.append(item)
        if len(self.items) > 1:
            return "ok"
        while not self.release.is_set():
            try:
                await self.release.wait()
            except BaseException:  # the careless handler under test
                self.cancellations += 1
        return "late"


def _abandoned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]


async def _abandon(clock: ManualClock, swallower: Swallower) -> None:
    """Past the time limit (one cancellation, swallowed), then past the grace."""
    await wait_for(lambda: len(swallower.items) == 1, "the runaway handler to start")
    clock.advance(TIMEOUT)
    await wait_for(lambda: swallower.cancellations == 1, "the cancellation to reach it")
    clock.advance(GRACE)


async def test_a_task_handler_that_ignores_its_cancellation_is_abandoned_and_frees_its_slot(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("runaway")
    await queue.put("next", delay=1)
    swallower = Swallower()
    claimed_until: list[Any] = []
    caplog.set_level(logging.WARNING, "mongoq")

    async with anyio.create_task_group() as group:
        results: list[Any] = []

        async def run() -> None:
            results.append(await queue.run(swallower, handler_timeout=TIMEOUT, poll_interval=1))

        group.start_soon(run)
        await wait_for(lambda: len(swallower.items) == 1, "the runaway handler to start")
        claimed_until.append((await read(db, "runaway") or {})["lease_until"])
        await _abandon(clock, swallower)
        await wait_for(lambda: len(swallower.items) == 2, "the next task to start")
        # Past when its first renewal was due: an abandoned handler's lease is not renewed.
        clock.advance(LEASE_TTL / 3)
        await settle(20)
        queue.stop()
    (summary,) = results

    assert swallower.cancellations == 1  # delivered once: no busy loop
    assert (summary.lost, summary.completed, summary.retried) == (1, 1, 0)
    runaway = await read(db, "runaway")
    assert runaway is not None
    assert (runaway["status"], runaway["lease_until"]) == ("processing", claimed_until[0])
    assert (await read(db, "next") or {})["status"] == "done"
    (line,) = _abandoned(caplog)
    assert "task 'runaway'" in line
    swallower.release.set()
    await settle(5)


@pytest.mark.parametrize("batch_size", [1, 2])
async def test_a_group_handler_that_ignores_its_cancellation_is_abandoned(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture, batch_size: int
) -> None:
    transport = await new_transport(db, clock)
    await transport.publish("runaway", {"n": 1})
    await transport.publish("other", {"n": 2})
    swallower = Swallower()
    caplog.set_level(logging.WARNING, "mongoq")

    async with anyio.create_task_group() as group:
        results: list[Any] = []

        async def run() -> None:
            results.append(await transport.run(
                swallower, handler_timeout=TIMEOUT, batch_size=batch_size, poll_interval=1,
            ))  # fmt: skip

        group.start_soon(run)
        await _abandon(clock, swallower)
        await wait_for(lambda: len(swallower.items) == 2, "the other group to be delivered")
        await settle(20)
        transport.stop()
    (summary,) = results

    assert swallower.cancellations == 1
    assert (summary.lost, summary.acked) == (1, 1)
    assert await db[f"{PREFIX}_messages"].count_documents({"group_id": "other"}) == 0
    assert await db[f"{PREFIX}_messages"].count_documents({"group_id": "runaway"}) == 1
    assert len(_abandoned(caplog)) == 1
    swallower.release.set()
    await settle(5)


async def test_a_delivery_whose_handler_ignores_its_cancellation_is_abandoned_and_retried(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = await new_outbox(db, clock, subscriptions={"*": ["h"]})
    await outbox.publish([event(1)], session=None)
    swallower = Swallower()
    dispatcher = OutboxDispatcher(outbox, {"h": swallower}, backoff=lambda attempt: 60)
    caplog.set_level(logging.WARNING, "mongoq")

    async with anyio.create_task_group() as group:
        results: list[Any] = []

        async def run() -> None:
            results.append(await dispatcher.run(handler_timeout=TIMEOUT))

        group.start_soon(run)
        await _abandon(clock, swallower)

        async def rescheduled() -> bool:
            [stored] = await deliveries(db)
            return bool(stored["status"] == "pending")

        for _ in range(200):
            if await rescheduled():
                break
            await settle(5)
        dispatcher.stop()
    (summary,) = results

    assert swallower.cancellations == 1
    assert summary.lost == 1
    [stored] = await deliveries(db)
    assert (stored["status"], stored["attempts"]) == ("pending", 1)
    assert "HandlerAbandoned" in stored["last_error"]
    assert len(_abandoned(caplog)) == 1
    swallower.release.set()
    await settle(5)


async def test_a_handler_that_ends_within_the_grace_is_not_abandoned(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock, max_attempts=3)
    await queue.put("slow")

    started: list[str] = []

    async def slow_to_stop(task: Task) -> None:
        started.append(str(task.id))
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            clock.advance(GRACE / 2)  # cleaning up, then gone: within the grace
            raise

    async with anyio.create_task_group() as group:
        results: list[Any] = []

        async def run() -> None:
            results.append(await queue.run(slow_to_stop, handler_timeout=TIMEOUT,
                                           stop_when_empty=True))  # fmt: skip

        group.start_soon(run)
        await wait_for(lambda: bool(started), "the handler to start")
        await settle(5)  # (its time limit sleeps on the clock from before the handler starts)
        clock.advance(TIMEOUT)
        await wait_for(lambda: bool(results), "the run to return")
    (summary,) = results
    assert (summary.retried, summary.lost) == (1, 0)
    doc = await read(db, "slow")
    assert doc is not None and doc["status"] == "pending"
    assert doc["error"].endswith("HandlerTimeout: timed out after 2 s")


async def test_a_task_function_with_its_own_time_limit_is_abandoned_with_one_warning(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Two supervisors nest (the function's time limit inside its run loop's lease): a hard
    stop reaches both, and only the inner one says it abandoned the call."""
    jobs = mongoq.Jobs(db, clock=clock)
    swallower = Swallower()

    @jobs.task(queue="nested", timeout=600)
    async def swallow() -> None:
        await swallower(None)

    await jobs.setup()
    await swallow.defer()
    caplog.set_level(logging.WARNING, "mongoq")

    async with anyio.create_task_group() as group:
        group.start_soon(jobs.run)
        await wait_for(lambda: len(swallower.items) == 1, "the call to start")
        jobs._cancel_running()  # a hard stop (a second signal)
        await wait_for(lambda: swallower.cancellations >= 1, "the cancellation to reach it")
        for _ in range(4):  # past both graces
            await settle(10)
            clock.advance(GRACE)
    assert len(_abandoned(caplog)) == 1
    swallower.release.set()
    await settle(5)
