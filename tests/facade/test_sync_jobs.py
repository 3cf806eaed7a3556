"""Task functions from blocking code: ``mongoq_sync.Jobs(db, like=jobs)`` defers and waits for
the async task functions a `mongoq.Jobs` declares, from any thread, and runs them in its
portal; `mypy --strict` checks a blocking `defer` against the function's signature too."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import mongoq
import mongoq_sync
from mongoq.testing import ManualClock

jobs = mongoq.Jobs(lease_ttl=60, backoff_base=1, backoff_cap=1)


@jobs.task(queue="emails", name="send_email")
async def send_email(to: str, subject: str = "hello") -> str:
    return f"{subject} to {to}"


@jobs.task(queue="reports", name="build_report", retry_on=(ValueError,))
async def build_report(day: int) -> int:
    if day < 0:
        raise LookupError(f"no day {day}")
    return day * 10


def documents(db: mongoq_sync.Database, queue: str) -> dict[Any, dict[str, Any]]:
    raw = db.async_database[queue]
    return {doc["_id"]: doc for doc in db.call(lambda: raw.find({}).to_list(None))}


def test_threads_defer_through_the_facade_and_its_run_calls_the_functions(
    blocking_db: mongoq_sync.Database,
) -> None:
    clock = ManualClock()
    sync_jobs = mongoq_sync.Jobs(blocking_db, like=jobs, clock=clock)
    sync_jobs.setup()
    ids: list[str] = []
    lock = threading.Lock()

    def producer(number: int) -> None:
        task_id = sync_jobs.defer(send_email, f"user{number}@example.com", subject="hi")
        with lock:
            ids.append(task_id)

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = sync_jobs.defer(build_report, day=3)

    stored = documents(blocking_db, "emails")
    assert sorted(stored) == sorted(ids) and len(ids) == 8
    for task_id in ids:
        assert stored[task_id]["function"] == "send_email"
        assert stored[task_id]["payload"]["kwargs"]["subject"] == "hi"
        assert (stored[task_id]["status"], stored[task_id]["attempts"]) == ("pending", 0)
    assert documents(blocking_db, "reports")[report]["payload"] == {
        "args": [], "kwargs": {"day": 3},
    }  # fmt: skip

    summary = sync_jobs.run(concurrency=4, stop_when_empty=True)
    assert (summary.claimed, summary.completed) == (9, 9)
    assert sync_jobs.wait(build_report, report, timeout=5) == 30
    assert sync_jobs.wait(send_email, ids[0], timeout=5).startswith("hi to user")
    finished = documents(blocking_db, "emails")
    assert all((doc["status"], doc["attempts"]) == ("done", 1) for doc in finished.values())
    queue = sync_jobs.queue("reports")
    assert isinstance(queue, mongoq_sync.TaskQueue) and queue.get(report) is not None


def test_deferral_options_and_a_failed_task_through_the_facade(
    blocking_db: mongoq_sync.Database,
) -> None:
    clock = ManualClock()
    sync_jobs = mongoq_sync.Jobs(blocking_db, like=jobs, clock=clock)
    sync_jobs.setup()
    task_id = sync_jobs.defer(
        send_email.options(task_id="welcome-42", priority=3, delay=60), "ada@example.com"
    )
    doomed = sync_jobs.defer(build_report, -1)  # LookupError is not retried: fails at once

    assert task_id == "welcome-42"
    stored = documents(blocking_db, "emails")["welcome-42"]
    assert stored["priority"] == 3
    assert sync_jobs.queue("emails").get("welcome-42").lease_until == clock.now() + timedelta(
        seconds=60
    )
    sync_jobs.run(stop_when_empty=True)
    assert documents(blocking_db, "emails")["welcome-42"]["status"] == "pending"  # not due yet
    with pytest.raises(mongoq_sync.MongoqError, match=r"ended failed: .*no day -1"):
        sync_jobs.wait(build_report, doomed, timeout=5)
    assert documents(blocking_db, "reports")[doomed]["attempts"] == 1


def test_a_call_that_does_not_fit_is_refused_before_any_write(
    blocking_db: mongoq_sync.Database,
) -> None:
    sync_jobs = mongoq_sync.Jobs(blocking_db, like=jobs)
    with pytest.raises(mongoq_sync.InvalidInput, match=r"^send_email\(to=\)"):
        sync_jobs.defer(send_email, to=object())  # type: ignore[arg-type]
    elsewhere = mongoq.Jobs()

    @elsewhere.task(queue="emails", name="send_email")
    async def lookalike(to: str) -> str:
        return to

    with pytest.raises(mongoq_sync.InvalidInput, match=r"^function: must be a task function"):
        sync_jobs.defer(lookalike, to="x")
    assert documents(blocking_db, "emails") == {}


USER_CODE = """\
import mongoq
import mongoq_sync

jobs = mongoq.Jobs()


@jobs.task(queue="emails")
async def send_email(to: str, subject: str) -> int:
    return len(to)


def view(db: mongoq_sync.Database) -> int:
    producer = mongoq_sync.Jobs(db, like=jobs)
    task_id: mongoq_sync.TaskId = producer.defer(send_email, to="a@b.c", subject="hi")
    producer.defer(send_email.options(task_id="welcome-42"), "a@b.c", "hi")
    producer.defer(send_email, to="a@b.c", subjet="hi")
    producer.defer(send_email, to=42, subject="hi")
    result: int = producer.wait(send_email, task_id)
    return result
"""


def test_mypy_checks_a_blocking_defer_against_the_functions_signature(tmp_path: Path) -> None:
    """Run in a folder of its own, so that mypy finds mongoq through the install, as a user's
    type checker does."""
    (tmp_path / "views.py").write_text(USER_CODE)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         "views.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 1 and len(errors) == 2, result.stdout + result.stderr
    lines = USER_CODE.splitlines()
    wrong_name = 1 + next(n for n, line in enumerate(lines) if "subjet=" in line)
    wrong_type = 1 + next(n for n, line in enumerate(lines) if "to=42" in line)
    assert f"views.py:{wrong_name}:" in errors[0]
    assert 'Unexpected keyword argument "subjet"' in errors[0]
    assert f"views.py:{wrong_type}:" in errors[1] and '"int"' in errors[1] and '"str"' in errors[1]


def test_an_argument_named_like_the_facades_own_options_is_the_functions(
    blocking_db: mongoq_sync.Database,
) -> None:
    """`handle_signals` is an option of the facade's `run`, not of every call: a task function
    may take an argument of that name, stored as given (and no signal handler installed)."""
    local = mongoq.Jobs()

    @local.task(queue="ops", name="restart")
    async def restart(service: str, handle_signals: bool) -> None:
        return None

    sync_jobs = mongoq_sync.Jobs(blocking_db, like=local)
    done: list[str] = []
    # From another thread: a signal handler, were one installed, would have to be the main's.
    thread = threading.Thread(
        target=lambda: done.append(sync_jobs.defer(restart, "api", handle_signals=True))
    )
    thread.start()
    thread.join()
    assert len(done) == 1
    assert documents(blocking_db, "ops")[done[0]]["payload"]["kwargs"] == {
        "service": "api", "handle_signals": True,
    }  # fmt: skip
