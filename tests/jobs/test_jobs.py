"""Task functions (`mongoq.Jobs`): `defer` stores a call of a named function in its queue,
one worker runs every declared function over several queues, fairly, and a task whose
function no worker knows is never run nor charged an attempt, and shows in the queue's stats
as waiting for an unknown function while a worker is live (its presence)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from pymongo.errors import OperationFailure

from mongoq import InvalidInput, Jobs, MongoqError, PermanentError
from mongoq.clock import stored_instant
from mongoq.testing import FaultInjector, ManualClock, instrument
from tests.support.helpers import napping, until, wait_for

ROOT = Path(__file__).resolve().parents[2]


def new_jobs(db: Any, clock: ManualClock) -> Jobs:
    return Jobs(db, clock=clock, lease_ttl=60, backoff_base=1, backoff_cap=1)


async def documents(db: Any, queue: str) -> dict[Any, dict[str, Any]]:
    return {doc["_id"]: doc for doc in await db[queue].find({}).to_list(None)}


async def test_defer_stores_the_call_and_the_functions_name(db: Any, clock: ManualClock) -> None:
    jobs = new_jobs(db, clock)

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str, subject: str = "hello") -> str:
        return f"{to}: {subject}"

    await jobs.setup()
    task_id = await send_email.defer("ada@example.com", subject="welcome")
    again = await send_email.options(task_id="welcome-42", priority=3).defer(to="bob@example.com")

    stored = await documents(db, "emails")
    assert stored[task_id]["function"] == "send_email"
    assert stored[task_id]["payload"] == {
        "args": [],
        "kwargs": {"to": "ada@example.com", "subject": "welcome"},  # by name: reorderable
    }
    assert stored[task_id]["status"] == "pending" and stored[task_id]["attempts"] == 0
    assert again == "welcome-42"
    assert (stored[again]["payload"], stored[again]["priority"]) == (
        {"args": [], "kwargs": {"to": "bob@example.com"}}, 3,
    )  # fmt: skip
    assert await send_email("direct") == "direct: hello"  # a plain call runs here


async def test_a_call_that_does_not_fit_is_refused_naming_the_argument_before_any_write(
    db: Any, clock: ManualClock
) -> None:
    jobs = new_jobs(db, clock)

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> None:
        return None

    await jobs.setup()
    with pytest.raises(InvalidInput, match=r"^send_email\(to=\)"):
        await send_email.defer(to=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"^send_email\(\): missing a required argument"):
        await send_email.defer(too="x")  # type: ignore[call-arg]
    assert await documents(db, "emails") == {}


def declare_three(jobs: Jobs, ran: list[str]) -> dict[str, Any]:
    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> str:
        ran.append(f"send_email {to}")
        return f"sent to {to}"

    @jobs.task(queue="media", name="resize")
    async def resize(path: str, width: int) -> dict[str, Any]:
        ran.append(f"resize {path}")
        return {"path": path, "width": width}

    @jobs.task(queue="media", name="transcode", retry_on=(OSError,))
    async def transcode(path: str) -> None:
        ran.append(f"transcode {path}")
        raise ValueError(f"cannot transcode {path}")  # not an OSError: failed at once

    return {"send_email": send_email, "resize": resize, "transcode": transcode}


async def test_one_worker_runs_three_functions_of_two_queues(db: Any, clock: ManualClock) -> None:
    jobs, ran = new_jobs(db, clock), list[str]()
    functions = declare_three(jobs, ran)
    await jobs.setup()
    mail = await functions["send_email"].defer("ada@example.com")
    photo = await functions["resize"].defer("/p/1.jpg", width=640)
    video = await functions["transcode"].defer("/v/1.mov")

    summary = await jobs.run(concurrency=4, stop_when_drained=True)

    emails, media = await documents(db, "emails"), await documents(db, "media")
    assert (emails[mail]["status"], emails[mail]["result"]) == ("done", "sent to ada@example.com")
    assert (media[photo]["status"], media[photo]["result"]) == (
        "done", {"path": "/p/1.jpg", "width": 640},
    )  # fmt: skip
    assert (media[video]["status"], media[video]["attempts"]) == ("failed", 1)
    assert "ValueError: cannot transcode /v/1.mov" in media[video]["error"]
    assert (summary.claimed, summary.completed, summary.failed) == (3, 2, 1)
    assert sorted(ran) == ["resize /p/1.jpg", "send_email ada@example.com", "transcode /v/1.mov"]
    assert await functions["resize"].wait(photo) == {"path": "/p/1.jpg", "width": 640}


async def test_a_task_whose_function_no_worker_knows_is_never_run_nor_charged(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A deploy in progress: the producer already defers `send_sms`, this worker does not have
    it yet. Its task stays exactly as put (pending, no attempt, no lease); the worker says so."""
    jobs, ran = new_jobs(db, clock), list[str]()
    functions = declare_three(jobs, ran)
    await jobs.setup()
    await jobs.queue("emails").put("sms-1", {"args": ["+380"], "kwargs": {}}, function="send_sms")
    await jobs.queue("emails").put("plain-1", {"n": 1})  # a task of run(handler): no function
    before = await documents(db, "emails")
    mail = await functions["send_email"].defer("ada@example.com")

    caplog.set_level(logging.WARNING, logger="mongoq.jobs")
    summary = await jobs.run(concurrency=2, stop_when_drained=True)

    after = await documents(db, "emails")
    assert after["sms-1"] == before["sms-1"] and after["plain-1"] == before["plain-1"]
    assert after["sms-1"]["attempts"] == 0 and after["sms-1"]["status"] == "pending"
    assert after[mail]["status"] == "done" and summary.claimed == 1
    waiting = {r.mongoq_function: r.mongoq_waiting for r in caplog.records  # type: ignore[attr-defined]
               if hasattr(r, "mongoq_waiting")}  # fmt: skip
    assert waiting == {"send_sms": 1, None: 1}


async def test_a_flooded_queue_does_not_hold_back_a_quiet_one_beyond_one_claim_round(
    db: Any, clock: ManualClock
) -> None:
    jobs, ran = new_jobs(db, clock), list[str]()

    @jobs.task(queue="bulk", name="bulk")
    async def bulk(n: int) -> None:
        ran.append(f"bulk {n}")

    @jobs.task(queue="urgent", name="urgent")
    async def urgent(n: int) -> None:
        ran.append(f"urgent {n}")

    await jobs.setup()
    for n in range(30):
        await bulk.defer(n)
    for n in range(3):
        await urgent.defer(n)

    await jobs.run(concurrency=1, stop_when_drained=True)

    # One slot: claims alternate between the queues while both have work.
    assert ran[:6] == ["bulk 0", "urgent 0", "bulk 1", "urgent 1", "bulk 2", "urgent 2"]
    assert len(ran) == 33


async def test_max_attempts_of_a_function_makes_its_failure_final(
    db: Any, clock: ManualClock
) -> None:
    jobs = new_jobs(db, clock)

    @jobs.task(queue="emails", name="flaky", max_attempts=2)
    async def flaky() -> None:
        raise ConnectionError("try again")

    await jobs.setup()
    task_id = await flaky.defer()
    first = await jobs.run(stop_when_empty=True)
    clock.advance(5)  # past the retry's backoff
    second = await jobs.run(stop_when_empty=True)
    doc = (await documents(db, "emails"))[task_id]
    assert (first.retried, second.failed) == (1, 1)
    assert (doc["status"], doc["attempts"]) == ("failed", 2)
    assert "attempt 2 of 2" in doc["error"]


def test_declarations_are_checked_where_they_are_made(db: Any) -> None:
    jobs = Jobs(db)

    def blocking() -> None:
        return None

    with pytest.raises(InvalidInput, match=r"^function"):
        jobs.task(blocking)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"^retry_on"):
        jobs.task(retry_on=ValueError)  # type: ignore[arg-type]

    @jobs.task(name="same")
    async def one() -> None:
        raise PermanentError("never runs")

    with pytest.raises(InvalidInput, match=r"^name"):

        @jobs.task(name="same")
        async def two() -> None:
            return None


USER_CODE = """
import mongoq

jobs = mongoq.Jobs()


@jobs.task(queue="emails")
async def send_email(to: str, subject: str) -> None:
    return None


async def producer() -> None:
    await send_email.defer(to="a@b.c", subject="hi")
    await send_email.options(task_id="welcome-42").defer("a@b.c", "hi")
    await send_email.defer(to="a@b.c", subjet="hi"){wrong_name}
    await send_email.defer(to=42, subject="hi"){wrong_type}
"""


def test_mypy_rejects_a_defer_with_a_wrong_argument_name_or_type(tmp_path: Path) -> None:
    script = tmp_path / "producer.py"
    script.write_text(textwrap.dedent(USER_CODE.format(wrong_name="", wrong_type="")))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, result.stdout
    assert 'Unexpected keyword argument "subjet"' in errors[0]
    assert 'Argument "to" to "defer"' in errors[1] and '"int"' in errors[1]


async def test_a_periodic_function_runs_once_a_tick(db: Any, clock: ManualClock) -> None:
    jobs, ran = new_jobs(db, clock), list[Any]()

    @jobs.periodic(every=60, queue="reports", name="hourly")
    async def hourly() -> None:
        ran.append(clock.now())

    await jobs.setup()
    await jobs.setup()  # idempotent: the same definition keeps its next tick
    async with anyio.create_task_group() as group:
        group.start_soon(partial(jobs.run, concurrency=2))
        for tick in range(3):
            await wait_for(lambda: napping(jobs), "the worker to wait for the next tick")
            clock.advance(60)
            await wait_for(lambda tick=tick: len(ran) > tick, f"tick {tick} to run")
        jobs.stop()

    stored = await documents(db, "reports")
    assert len(stored) == 3 and len(ran) == 3
    assert all(doc["function"] == "hourly" and doc["status"] == "done" for doc in stored.values())
    assert all(task_id.startswith("hourly@") for task_id in stored)
    (schedule,) = await jobs.queue("reports").schedules()
    assert (schedule.name, schedule.function, schedule.every) == ("hourly", "hourly", 60)


async def test_calls_with_star_args_and_a_plain_re_put_are_stored_as_they_are_called(
    db: Any, clock: ManualClock
) -> None:
    """Values for ``*args`` take every parameter before them by position; a plain put of a
    new revision over a deferred task clears its function, never leaving the call of one
    beside the payload of another."""
    jobs, seen = new_jobs(db, clock), list[Any]()

    @jobs.task(queue="emails", name="notify")
    async def notify(first: str, *rest: str, loud: bool = False) -> None:
        seen.append((first, rest, loud))

    await jobs.setup()
    task_id = await notify.defer("a", "b", "c", loud=True)
    assert (await documents(db, "emails"))[task_id]["payload"] == {
        "args": ["a", "b", "c"], "kwargs": {"loud": True},
    }  # fmt: skip
    await jobs.run(stop_when_drained=True)
    assert seen == [("a", ("b", "c"), True)]

    await notify.options(task_id="n2").defer("x")
    await jobs.queue("emails").put("n2", {"plain": 1}, revision=2)
    assert (await documents(db, "emails"))["n2"]["function"] is None


def test_a_misspelt_queue_option_is_refused_where_it_is_given(db: Any) -> None:
    with pytest.raises(InvalidInput, match=r"^queue_options: lease_tll: not an option"):
        Jobs(db, lease_tll=30)
    jobs = Jobs(db)
    with pytest.raises(InvalidInput, match=r"^options: max_attempt: not an option"):
        jobs.configure_queue("emails", max_attempt=3)


async def test_a_timed_out_call_follows_its_functions_max_attempts(
    db: Any, clock: ManualClock
) -> None:
    jobs = new_jobs(db, clock)

    @jobs.task(queue="emails", name="slow", timeout=5, max_attempts=1)
    async def slow() -> None:
        await anyio.sleep_forever()

    await jobs.setup()
    task_id = await slow.defer()
    async with anyio.create_task_group() as group:
        group.start_soon(partial(jobs.run, stop_when_empty=True))
        limit = clock.now() + timedelta(seconds=5)
        await wait_for(lambda: clock.sleeping_until(limit) >= 1, "the call's time limit")
        clock.advance(5)
    doc = (await documents(db, "emails"))[task_id]
    assert (doc["status"], doc["attempts"]) == ("failed", 1)  # the queue would allow 5
    assert "HandlerTimeout: timed out after 5 s (attempt 1 of 1)" in doc["error"]


async def test_a_jobs_like_another_defers_and_runs_its_functions_on_its_own_database(
    db: Any, clock: ManualClock
) -> None:
    """``Jobs(other_db, like=jobs)``: the same functions and queue options, declared once; its
    `defer` and `wait` put and read the tasks of its own database, never the original's."""
    jobs = Jobs(clock=clock, lease_ttl=45)  # declared before any database, as a module does

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> str:
        return f"sent to {to}"

    other = db.client[f"{db.name}_tenant"]
    try:
        tenant = Jobs(other, like=jobs)
        await tenant.setup()
        task_id = await tenant.defer(send_email, to="ada@example.com")
        keyed = await tenant.defer(send_email.options(task_id="welcome-1", priority=2), "bob")
        assert tenant.queue("emails").lease_ttl == 45 and tenant.clock is clock
        stored = await documents(other, "emails")
        assert stored[task_id]["function"] == "send_email"
        assert stored[task_id]["payload"] == {"args": [], "kwargs": {"to": "ada@example.com"}}
        assert (keyed, stored[keyed]["priority"]) == ("welcome-1", 2)
        assert await documents(db, "emails") == {}  # nothing in the other database

        summary = await tenant.run(stop_when_empty=True)
        assert summary.completed == 2
        assert await tenant.wait(send_email, task_id, timeout=5) == "sent to ada@example.com"
        assert (await documents(other, "emails"))[task_id]["status"] == "done"

        stranger = Jobs(other)

        @stranger.task(queue="emails", name="send_email")
        async def lookalike(to: str) -> str:
            return to

        with pytest.raises(InvalidInput, match=r"^function: must be a task function of this"):
            await tenant.defer(lookalike, to="x")
        with pytest.raises(InvalidInput, match=r"^like: must be a mongoq\.Jobs"):
            Jobs(other, like="jobs")  # type: ignore[arg-type]
        assert len(await documents(other, "emails")) == 2
    finally:
        await db.client.drop_database(other.name)


# ------------------------------------------------------------ unknown functions: presences


def declare_a(jobs: Jobs) -> None:
    @jobs.task(queue="emails", name="a")
    async def a() -> None:
        return None


async def presence_of(db: Any, worker_id: str) -> dict[str, Any] | None:
    doc: dict[str, Any] | None = await db["emails_workers"].find_one({"_id": worker_id})
    return doc


async def test_stats_count_the_due_tasks_of_a_function_no_running_worker_knows(
    db: Any, clock: ManualClock
) -> None:
    """A worker that knows `a` announces it in ``emails_workers`` while it runs: a due task of
    `b` then shows in `stats` as waiting for an unknown function, uncharged. Its run ended, the
    worker's document is gone, and with no worker live `stats` names none (`oldest_due_age` is
    the signal then)."""
    jobs = new_jobs(db, clock)
    declare_a(jobs)
    await jobs.setup()
    queue = jobs.queue("emails")
    await queue.put("b-1", {"args": [], "kwargs": {}}, function="b")
    assert (await queue.stats()).unknown_functions == {}  # no worker live: none to compare

    async with anyio.create_task_group() as group:
        group.start_soon(partial(jobs.run, worker_id="w-1"))
        doc = await until(partial(presence_of, db, "w-1"), bool, "the worker's presence")
        stats = await queue.stats()
        jobs.stop()

    assert doc["functions"] == ["a"]
    assert stored_instant(doc["seen"]) == clock.now()
    assert stored_instant(doc["expires"]) == clock.now() + timedelta(seconds=60)  # its lease
    assert stats.unknown_functions == {"b": 1} and stats.due == 1
    assert await presence_of(db, "w-1") is None  # withdrawn when the run ended
    after = (await documents(db, "emails"))["b-1"]
    assert (after["status"], after["attempts"]) == ("pending", 0)
    assert (await queue.stats()).unknown_functions == {}


async def test_a_presence_is_renewed_at_each_housekeeping_round(
    db: Any, clock: ManualClock
) -> None:
    jobs = new_jobs(db, clock)  # lease_ttl 60: a housekeeping round every 20 s
    declare_a(jobs)
    await jobs.setup()
    async with anyio.create_task_group() as group:
        group.start_soon(partial(jobs.run, worker_id="w-1"))
        await until(partial(presence_of, db, "w-1"), bool, "the worker's presence")
        await wait_for(lambda: napping(jobs), "the worker to wait on the clock")
        clock.advance(20)
        renewed = await until(
            partial(presence_of, db, "w-1"),
            lambda doc: doc is not None and stored_instant(doc["seen"]) == clock.now(),
            "the housekeeping round's announcement",
        )
        jobs.stop()
    assert stored_instant(renewed["expires"]) == clock.now() + timedelta(seconds=60)
    assert renewed["functions"] == ["a"]


async def test_a_killed_workers_presence_counts_until_it_expires_and_no_longer(
    db: Any, clock: ManualClock
) -> None:
    """Presences that were never withdrawn (workers killed with -9): each counts until its
    `expires`, whether or not the TTL index deleted it yet; the live ones' functions count
    together."""
    jobs = new_jobs(db, clock)
    declare_a(jobs)
    await jobs.setup()
    queue = jobs.queue("emails")
    await queue.put("b-1", {"args": [], "kwargs": {}}, function="b")
    await queue._presence.announce("old", ["a", "b"], 60)  # killed: expires in 60 s
    clock.advance(30)
    await queue._presence.announce("new", ["a"], 60)  # killed too: expires 30 s after "old"

    assert (await queue.stats()).unknown_functions == {}  # "old" still runs b
    clock.advance(30)  # "old" expires now: an expiry at `now` no longer counts
    assert (await queue.stats()).unknown_functions == {"b": 1}
    clock.advance(30)  # "new" expires too: no worker live
    assert (await queue.stats()).unknown_functions == {}


async def test_a_presence_that_cannot_be_withdrawn_is_logged_and_the_run_ends(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    faults = FaultInjector()
    jobs = new_jobs(instrument(db, faults), clock)
    declare_a(jobs)
    await jobs.setup()
    refused = OperationFailure("not authorized on mongoq to execute command", code=13)
    faults.fail_before("delete_one", collection="emails_workers", error=refused)

    caplog.set_level(logging.WARNING, logger="mongoq.jobs")
    await jobs.run(stop_when_empty=True, worker_id="w-1")

    [record] = [r for r in caplog.records if "could not withdraw" in r.getMessage()]
    assert (record.mongoq_queue, record.mongoq_worker) == ("emails", "w-1")  # type: ignore[attr-defined]
    assert "OperationFailure" in record.getMessage()
    doc = await presence_of(db, "w-1")  # left behind: it counts until it expires
    assert doc is not None and doc["functions"] == ["a"]


async def test_a_presence_a_queue_refuses_is_logged_and_the_worker_goes_on(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """No right to write one queue's ``_workers`` (a least-privilege role): that queue's
    announcements are logged, the other queue's are made, every task still runs."""
    faults = FaultInjector()
    jobs = new_jobs(instrument(db, faults), clock)
    declare_a(jobs)

    @jobs.task(queue="reports", name="b")
    async def b() -> None:
        return None

    await jobs.setup()
    refused = OperationFailure("not authorized on mongoq to execute command", code=13)
    faults.fail_before("update_one", collection="emails_workers", times=100, error=refused)
    await jobs.queue("emails").put("e1", {"args": [], "kwargs": {}}, function="a")
    await b.defer()
    seen: list[dict[str, Any] | None] = []

    @jobs.task(queue="reports", name="look")
    async def look() -> None:  # runs while the worker runs: its presences as they are
        seen.append(await db["reports_workers"].find_one({"_id": "w-1"}))
        seen.append(await presence_of(db, "w-1"))

    await look.defer()
    caplog.set_level(logging.WARNING, logger="mongoq.jobs")
    summary = await jobs.run(stop_when_empty=True, worker_id="w-1")

    assert summary.completed == 3
    reports, emails = seen
    assert reports is not None and reports["functions"] == ["b", "look"]
    assert emails is None  # refused: never written
    records = [r for r in caplog.records if "could not announce" in r.getMessage()]
    assert records and {r.mongoq_queue for r in records} == {"emails"}  # type: ignore[attr-defined]
    assert await db["reports_workers"].find_one({"_id": "w-1"}) is None  # withdrawn at the end


async def test_a_retried_error_keeps_its_own_cause_in_the_stored_error(
    db: Any, clock: ManualClock
) -> None:
    jobs = new_jobs(db, clock)

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> None:
        try:
            {}[to]
        except KeyError as missing:
            raise ConnectionError("smtp down") from missing

    await jobs.setup()
    task_id = await send_email.defer("ada")
    await jobs.run(stop_when_empty=True)
    stored = (await documents(db, "emails"))[task_id]
    assert (stored["status"], stored["attempts"]) == ("pending", 1)  # retried
    assert "KeyError: 'ada'" in stored["error"] and "ConnectionError: smtp down" in stored["error"]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"cron": "not a cron"}, "cron"),
        ({"cron": "* * * * *", "every": 60}, "cron"),
        ({}, "cron"),
        ({"every": 0.5}, "every"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "timezone"),
        ({"every": 60, "missed": "all"}, "missed"),
        ({"every": 60, "grace": 0}, "grace"),
    ],
)
def test_a_periodic_declaration_is_checked_where_it_is_made(
    options: dict[str, Any], field: str
) -> None:
    jobs = Jobs()
    with pytest.raises(InvalidInput, match=rf"^{field}: "):

        @jobs.periodic(**options)
        async def tick() -> None:
            return None

    assert jobs.functions == {}


async def one_email_deferred(db: Any, clock: ManualClock) -> tuple[Jobs, Any, Any]:
    """A `Jobs` of one task function, ``send_email`` in queue "emails", deferred once."""
    jobs = new_jobs(db, clock)

    @jobs.task(queue="emails")
    async def send_email(to: str) -> str:
        return to

    await jobs.setup()
    return jobs, send_email, await send_email.defer("ada@example.com")


async def test_waiting_for_a_task_cancelled_before_it_ran_says_it_was_cancelled(
    db: Any, clock: ManualClock
) -> None:
    jobs, send_email, task_id = await one_email_deferred(db, clock)
    assert await jobs.queue("emails").cancel(task_id)

    with pytest.raises(MongoqError, match=rf"^task {task_id!r} was cancelled before it ran$"):
        await jobs.wait(send_email, task_id, timeout=1)
    assert (await documents(db, "emails"))[task_id]["status"] == "cancelled"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"stop_when_empty": "yes"}, "stop_when_empty"),
        ({"stop_when_empty": True, "stop_when_drained": True}, "stop_when_drained"),
        ({"concurrency": 0}, "concurrency"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"give_up_after": -1}, "give_up_after"),
    ],
)
async def test_a_jobs_run_checks_its_run_options_as_every_run_does(
    db: Any, clock: ManualClock, options: dict[str, Any], field: str
) -> None:
    jobs, _, task_id = await one_email_deferred(db, clock)
    with pytest.raises(InvalidInput, match=rf"^{field}: "):
        await jobs.run(**options)
    assert (await documents(db, "emails"))[task_id]["status"] == "pending"
