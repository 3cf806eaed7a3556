"""The watchdog of a run loop's event loop: one WARNING per stall past its bound, naming the
handler running at that moment. Judged with given times (`Stall.check`), never with a real
stall: what it reads of the loop (which handler runs) is tested from inside a handler."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from mongoq import Task
from mongoq.runtime import watchdog
from mongoq.testing import ManualClock
from tests.support.helpers import new_queue


def test_a_stall_past_the_bound_is_said_once_until_the_loop_ticks_again() -> None:
    stall = watchdog.Stall(bound=10.0, name="tasks:q", beat=100.0)
    running = lambda: "task 't1'"  # noqa: E731

    assert stall.check(109.9, running) is None  # within the bound
    warning = stall.check(112.0, running)
    assert warning is not None
    assert "tasks:q" in warning and "12.0 s" in warning and "task 't1'" in warning
    assert stall.check(150.0, running) is None  # the same stall: said once
    stall.tick(151.0)
    assert stall.check(160.0, running) is None
    assert stall.check(162.0, lambda: None) is not None  # a new stall, no handler running


async def test_the_watchdog_reads_which_handler_runs_in_the_loop(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("t1")
    seen: list[str | None] = []

    async def handler(task: Task) -> None:
        # What the watchdog's thread would read now, were this handler blocking the loop.
        seen.append(watchdog._running_in(asyncio.get_running_loop())())

    await queue.run(handler, stop_when_empty=True)

    assert seen == ["task 't1'"]
    assert watchdog._running_in(asyncio.get_running_loop())() is None  # none runs any more


async def test_a_blocked_loop_is_said_by_the_watchdogs_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "mongoq")
    async with watchdog.watching(0.04, "tasks:q"):
        time.sleep(0.3)  # noqa: ASYNC251  # the loop blocked: the subject of the test
    said = [r.getMessage() for r in caplog.records if "blocked" in r.getMessage()]
    assert len(said) == 1 and "tasks:q" in said[0]
