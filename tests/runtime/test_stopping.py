"""A second signal cancels in-flight work: the item cut short records "worker stopped" (not a
`CancelledError` traceback that says nothing of the item) and `run` counts it."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import anyio
import pytest

from mongoq import InvalidInput, Task, TaskRunSummary
from mongoq.runtime.loop import WORKER_STOPPED
from mongoq.testing import ManualClock, settle
from tests.support.helpers import Sleeper, in_background, new_queue, read, wait_for


async def test_a_task_cut_short_by_a_second_signal_records_worker_stopped_and_is_counted(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t", {"n": 1})
    started: list[Task] = []
    summaries: list[TaskRunSummary] = []

    async def handler(task: Task) -> None:
        started.append(task)
        await anyio.sleep_forever()

    async def worker() -> None:
        summaries.append(await queue.run(handler, handle_signals=True, worker_id="w"))

    def stopping() -> bool:
        return any("stopping after" in record.getMessage() for record in caplog.records)

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # never the default: exit
    try:
        with caplog.at_level(logging.INFO, logger="mongoq"):
            async with anyio.create_task_group() as group:
                group.start_soon(worker)
                await wait_for(lambda: len(started) == 1, "the handler to start")
                os.kill(os.getpid(), signal.SIGTERM)  # graceful: the handler goes on
                await wait_for(stopping, "the first signal")
                os.kill(os.getpid(), signal.SIGTERM)  # hard: the handler is cancelled
    finally:
        signal.signal(signal.SIGTERM, previous)

    (summary,) = summaries
    assert summary == TaskRunSummary(claimed=1, retried=1)
    doc = await read(db, "t")
    assert doc is not None
    assert (doc["status"], doc["attempts"], doc["error"], doc["lease_token"]) == (
        "pending", 1, WORKER_STOPPED, None,
    )  # fmt: skip
    [report] = [r for r in caplog.records if hasattr(r, "mongoq_outcome")]
    assert (report.levelno, report.mongoq_error) == (logging.INFO, WORKER_STOPPED)


async def test_a_stop_with_a_grace_cancels_what_still_runs_after_it(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t")
    sleeper = Sleeper()

    async def stop_with_grace() -> None:
        queue.stop(grace=10)
        await settle(5)
        clock.advance(9)  # within the grace: it runs on
        await settle(5)
        assert sleeper.seen == ["started"]

    summary = await in_background(
        clock, queue.run(sleeper), started=lambda: sleeper.seen, then=stop_with_grace, advance=1
    )

    assert sleeper.seen == ["started", "cancelled"]
    assert (summary.retried, summary.completed) == (1, 0)
    doc = await read(db, "t")
    assert doc is not None and (doc["status"], doc["error"]) == ("pending", WORKER_STOPPED)


async def test_a_stop_with_a_grace_given_before_the_run_applies_to_it(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    queue.stop(grace=5)  # holds until a run returns: this one claims nothing
    assert await queue.run(Sleeper()) == TaskRunSummary()
    with pytest.raises(InvalidInput):
        queue.stop(grace=-1)
