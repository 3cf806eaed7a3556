"""`mongoq_sync`'s ``run(handle_signals=True)``: the portal's loop runs in another thread, which
signals never reach, so the calling (main) thread takes SIGTERM for the call: the first stops
the run gracefully, a second stops it at once (an async handler in flight is cancelled and
records "worker stopped": tests/runtime/test_stopping.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import mongoq_sync
from mongoq import Task, TaskRunSummary
from mongoq.testing import ManualClock


def not_handled(signum: int, frame: object) -> None:
    raise AssertionError(f"signal {signum} reached the test's own handler")


@pytest.fixture
def queue() -> Iterator[mongoq_sync.TaskQueue]:
    database = mongoq_sync.connect()
    queue = mongoq_sync.TaskQueue(database, "signals", clock=ManualClock(), backoff_base=10)
    queue.setup()
    queue.put("t1")
    queue.put("t2")
    # Never the default around these tests: a broken feature must fail a test, not end pytest.
    previous = signal.signal(signal.SIGTERM, not_handled)
    try:
        yield queue
    finally:
        signal.signal(signal.SIGTERM, previous)
        database.close()


def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (in a handler's worker thread) until the main thread has acted on a signal."""
    for _ in range(100_000):
        if condition():
            return
        time.sleep(0)
    raise AssertionError(f"never: {what}")


def loops(queue: mongoq_sync.TaskQueue) -> list[Any]:
    return list(queue._target()._loops)


def test_a_first_signal_lets_the_running_task_finish_and_claims_nothing_more(
    queue: mongoq_sync.TaskQueue,
) -> None:
    def handler(task: Task) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        until(lambda: all(loop.stopping for loop in loops(queue)), "the graceful stop")
        return f"done {task.id}"

    summary = queue.run(handler, handle_signals=True)

    assert summary == TaskRunSummary(claimed=1, completed=1)
    done, left = queue.get("t1"), queue.get("t2")
    assert done is not None and (done.status, done.result) == ("done", "done t1")
    assert left is not None and (left.status, left.attempts) == ("pending", 0)
    assert signal.getsignal(signal.SIGTERM) is not_handled  # given back after the run


def test_a_second_signal_stops_the_run_at_once_and_a_finished_handler_is_still_recorded(
    queue: mongoq_sync.TaskQueue,
) -> None:
    """A blocking handler cannot be interrupted in its thread: it finishes, and its result is
    recorded (shielded, as a batch's finished items are); nothing more is claimed."""

    def handler(task: Task) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        until(lambda: all(loop.stopping for loop in loops(queue)), "the graceful stop")
        os.kill(os.getpid(), signal.SIGTERM)
        until(lambda: all(loop._scope.cancel_called for loop in loops(queue)), "the hard stop")
        return "finished under the hard stop"

    summary = queue.run(handler, handle_signals=True)

    assert summary == TaskRunSummary(claimed=1, completed=1)
    done, left = queue.get("t1"), queue.get("t2")
    assert done is not None
    assert (done.status, done.result) == ("done", "finished under the hard stop")
    assert left is not None and (left.status, left.attempts) == ("pending", 0)


def test_a_blocking_handler_past_its_time_limit_runs_to_its_end_and_still_times_out() -> None:
    """A thread cannot be interrupted: past `handler_timeout` the handler is still waited for,
    and then its attempt counts as timed out (its result discarded), as an async handler's
    would (the facade's docstring says so)."""
    clock = ManualClock()
    with mongoq_sync.connect() as database:
        queue = mongoq_sync.TaskQueue(database, "limits", clock=clock, backoff_base=10)
        queue.setup()
        queue.put("t1")
        finished: list[str] = []

        def slow(task: Task) -> str:
            clock.advance(60)  # well past the limit, on the queue's clock
            finished.append(task.id)
            return "finished late"

        summary = queue.run(slow, stop_when_empty=True, handler_timeout=5)

        assert summary == TaskRunSummary(claimed=1, retried=1)
        assert finished == ["t1"]
        late = queue.get("t1")
        assert late is not None
        assert (late.status, late.attempts, late.result) == ("pending", 1, None)
        assert late.error is not None and late.error.endswith("timed out after 5 s")


def test_a_blocking_handler_that_outlasts_its_grace_is_abandoned_and_the_run_goes_on() -> None:
    """A thread cannot be cancelled: past its time limit and the grace after it, the run stops
    waiting for it (counted lost, its task left to its lease) and claims the next task."""
    import threading

    from mongoq.runtime.handler import GRACE

    clock = ManualClock()
    with mongoq_sync.connect() as database:
        queue = mongoq_sync.TaskQueue(database, "abandon", clock=clock)
        queue.setup()
        queue.put("stuck")
        queue.put("next", delay=1)
        release, started, ran = threading.Event(), threading.Event(), []

        def handler(task: Task) -> str:
            ran.append(task.id)
            if task.id == "stuck":
                started.set()
                release.wait(30)  # a call that cannot be interrupted
            return "ok"

        summaries: list[TaskRunSummary] = []
        worker = threading.Thread(
            target=lambda: summaries.append(queue.run(handler, handler_timeout=5, poll_interval=1))
        )
        worker.start()
        try:
            assert started.wait(10)
            time.sleep(0.05)  # (the portal's loop sleeps on the clock for the limit)
            clock.advance(5)
            time.sleep(0.05)
            clock.advance(GRACE)
            deadline = time.monotonic() + 10
            while ran != ["stuck", "next"] and time.monotonic() < deadline:
                clock.advance(1)
                time.sleep(0.01)
            assert ran == ["stuck", "next"]
        finally:
            queue.stop()
            release.set()
            worker.join(10)
        (summary,) = summaries
        assert (summary.lost, summary.completed) == (1, 1)
        stuck = queue.get("stuck")
        assert stuck is not None and stuck.status == "processing"
