"""The ``mongoq`` command, run through its entry points: `cli.run` in the test's event loop and
`cli.main` (what the console script runs) in a worker thread, both on the test's database
(`mongoq._driver.connect` hands it to the command). Each command's output is checked against
the data seeded, the database after every write, and the errors are one line with exit code 2.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

import mongoq
from mongoq import _driver, cli
from mongoq.groups import AsyncGroupTransport
from mongoq.outbox import AsyncOutbox, Event
from mongoq.tasks import AsyncTaskQueue
from mongoq.testing import ManualClock
from tests.conftest import TEST_URI

Mongoq = Callable[..., Awaitable[tuple[int, str, str]]]
TRACEBACK = "Traceback (most recent call last):\n  File 'x.py', line 1\nValueError: bad payload"


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MONGOQ_URI", "MONGOQ_DATABASE", "MONGOQ_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def opened(db: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The CLI's connections, each answered with the test's database. On a server, `cli.main`
    runs its own event loop in a worker thread, where a client of the test's loop cannot be
    used: it gets a client of its own on the same database, which the CLI then closes. The
    test's own client outlives every command."""
    calls: list[tuple[Any, ...]] = []
    test_thread = threading.current_thread()
    backend = _driver.backend_of(db)
    close = _driver.close

    def connect(uri: str | None = None, database: str = "mongoq", **options: Any) -> Any:
        calls.append((uri, database, options))
        if backend is _driver.Backend.MEMORY or threading.current_thread() is test_thread:
            return db
        assert TEST_URI is not None
        return mongoq.connect(TEST_URI, db.name, driver=backend.value)

    async def close_but_the_tests(database: Any) -> None:
        if database is not db:
            await close(database)

    monkeypatch.setattr(_driver, "connect", connect)
    monkeypatch.setattr(_driver, "close", close_but_the_tests)
    seeded_embedded(monkeypatch)
    return calls


def seeded_embedded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the commands and the exporter use the embedded backend, which they refuse (new and
    empty in each command's process, it holds nothing): here it is the test's, seeded."""
    from mongoq import metrics

    monkeypatch.setattr(cli, "_fresh_embedded", lambda db: False)
    monkeypatch.setattr(metrics, "_fresh_embedded", lambda db: False)


@pytest.fixture(params=["run", "main"])
def mongoq_cmd(
    request: pytest.FixtureRequest, opened: Any, capsys: pytest.CaptureFixture[str]
) -> Mongoq:
    """``mongoq ARGS...``: its exit code, stdout and stderr."""

    async def invoke(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        if request.param == "run":
            code = await cli.run(list(argv))
        else:  # asyncio.run inside: not in this loop
            code = await anyio.to_thread.run_sync(cli.main, list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def rows(out: str) -> dict[str, list[str]]:
    """A printed table by its first column."""
    return {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------------------ tasks


async def seed_tasks(db: Any) -> AsyncTaskQueue:
    """old-done (10 days ago), new-done, bad-1 and bad-2 failed, waiting and 7 pending."""
    now = datetime.now(UTC)
    clock = ManualClock(now - timedelta(days=10))
    queue = AsyncTaskQueue(db, "jobs", clock=clock, max_attempts=1)
    await queue.setup()
    await queue.put("old-done", {"n": 1})
    assert await queue.complete(await claimed(queue, "old-done"), {"ok": True})
    clock.set(now - timedelta(hours=1))
    for task_id in ("new-done", "bad-1", "bad-2", "waiting"):
        await queue.put(task_id, {"id": task_id})
    assert await queue.complete(await claimed(queue, "new-done"))
    assert await queue.fail(await claimed(queue, "bad-1"), TRACEBACK)
    assert await queue.fail(await claimed(queue, "bad-2"), "x" * 500)
    await queue.put(7, priority=-1)
    return queue


async def status_of(queue: AsyncTaskQueue, task_id: Any) -> str | None:
    task = await queue.get(task_id)
    return None if task is None else task.status


async def claimed(queue: AsyncTaskQueue, task_id: Any) -> Any:
    task = await queue.claim("w1")
    assert task is not None and task.id == task_id
    return task


async def test_tasks_stats_in_a_table_and_in_json(db: Any, mongoq_cmd: Mongoq) -> None:
    await seed_tasks(db)
    code, out, err = await mongoq_cmd("tasks", "stats", "jobs")
    assert (code, err) == (0, "")
    lines = dict(line.rsplit(None, 1) for line in out.splitlines() if line[0] != "o")
    assert lines == {"pending": "2", "processing": "0", "done": "2", "failed": "2",
                     "cancelled": "0", "tombstone": "0", "due": "2", "expired": "0"}  # fmt: skip
    assert re.fullmatch(r"oldest due age  1h\d+m", out.splitlines()[-1])  # put an hour ago

    code, out, _ = await mongoq_cmd("tasks", "stats", "jobs", "--json")
    stats = json.loads(out)
    assert code == 0 and stats["counts"]["failed"] == 2 and stats["due"] == 2
    assert stats["unknown_functions"] == {}  # no worker running
    assert 3600 <= stats["oldest_due_age"] < 3660  # put an hour ago


async def test_tasks_stats_names_the_functions_no_running_worker_knows(
    db: Any, mongoq_cmd: Mongoq
) -> None:
    queue = AsyncTaskQueue(db, "jobs")  # the server's clock, as the command's own
    await queue.setup()
    for task_id in ("e-1", "e-2"):
        await queue.put(task_id, function="send_emial")
    await queue.put("e-3", function="send_email")
    await queue.put("p-1")  # a plain task
    code, out, _ = await mongoq_cmd("tasks", "stats", "jobs")
    assert code == 0 and "waiting" not in out  # no worker running: none to compare with

    await queue._presence.announce("w-1", ["send_email"], 60)  # a worker of send_email runs
    code, out, err = await mongoq_cmd("tasks", "stats", "jobs")
    assert (code, err) == (0, "")
    assert out.splitlines()[-3].startswith("oldest due age")
    assert out.splitlines()[-2:] == [
        "waiting for unknown function 'send_emial': 2",
        "waiting without a function (plain tasks: no Jobs worker runs them): 1",
    ]
    code, out, _ = await mongoq_cmd("tasks", "stats", "jobs", "--json")
    assert code == 0 and json.loads(out)["unknown_functions"] == {"send_emial": 2, "": 1}


async def test_tasks_list_aligns_cuts_errors_and_pages(db: Any, mongoq_cmd: Mongoq) -> None:
    queue = await seed_tasks(db)
    code, out, _ = await mongoq_cmd("tasks", "list", "jobs")
    assert code == 0
    table = rows(out)
    assert set(table) == {"old-done", "new-done", "bad-1", "bad-2", "waiting", "7"}
    header = out.splitlines()[0]
    assert header.split() == ["ID", "STATUS", "ATTEMPTS", "PRIORITY", "UPDATED", "LEASE",
                              "UNTIL", "WORKER", "ERROR"]  # fmt: skip
    error_column = header.index("ERROR")
    line_of = {line.split()[0]: line for line in out.splitlines()}
    assert line_of["bad-1"][error_column:] == "ValueError: bad payload"  # a traceback's last line
    assert line_of["bad-2"][error_column:] == "x" * 57 + "..."  # cut to one line
    old = await queue.get("old-done")
    assert old is not None and old.updated_at is not None
    assert table["old-done"][4] == old.updated_at.strftime("%Y-%m-%dT%H:%M:%SZ")  # no fraction

    code, out, _ = await mongoq_cmd("tasks", "list", "jobs", "--status", "failed")
    assert set(rows(out)) == {"bad-1", "bad-2"}

    code, out, _ = await mongoq_cmd("tasks", "list", "jobs", "--limit", "4")
    first, cursor = list(rows(out))[:-1], out.splitlines()[-1].split()[-1]
    assert out.splitlines()[-1].startswith("next: --after ") and len(first) == 4
    code, out, _ = await mongoq_cmd("tasks", "list", "jobs", "--limit", "4", "--after", cursor)
    assert code == 0 and "next:" not in out
    assert set(first) | set(rows(out)) == {"old-done", "new-done", "bad-1", "bad-2", "waiting", "7"}

    code, out, _ = await mongoq_cmd("--json", "tasks", "list", "jobs", "--status", "failed")
    page = json.loads(out)
    assert page["next"] is None and [t["id"] for t in page["tasks"]] == ["bad-1", "bad-2"]
    assert page["tasks"][0]["error"] == TRACEBACK  # in full
    bad = await queue.get("bad-1")
    assert bad is not None and bad.updated_at is not None
    assert page["tasks"][0]["updated_at"] == bad.updated_at.isoformat()


async def test_tasks_get_shows_one_task(db: Any, mongoq_cmd: Mongoq) -> None:
    await seed_tasks(db)
    code, out, _ = await mongoq_cmd("tasks", "get", "jobs", "bad-1")
    assert code == 0 and "status       failed" in out and out.endswith(TRACEBACK + "\n")
    code, out, _ = await mongoq_cmd("tasks", "get", "jobs", "7", "--int-id", "--json")
    assert code == 0 and json.loads(out)["priority"] == -1
    code, out, _ = await mongoq_cmd("tasks", "get", "jobs", "7")  # the string "7": none
    assert code == 1 and out == "no task '7' in jobs\n"


async def test_tasks_requeue_by_id_or_all_failed(db: Any, mongoq_cmd: Mongoq) -> None:
    queue = await seed_tasks(db)
    code, out, _ = await mongoq_cmd("tasks", "requeue", "jobs", "bad-1", "new-done")
    assert (code, out) == (0, "requeued 1 failed task(s)\n")
    task = await queue.get("bad-1")
    assert task is not None and (task.status, task.attempts) == ("pending", 0)
    assert await status_of(queue, "new-done") == "done"

    code, out, _ = await mongoq_cmd("tasks", "requeue", "jobs", "bad-1")
    assert (code, out) == (1, "no failed task to requeue\n")

    code, out, _ = await mongoq_cmd("tasks", "requeue", "jobs", "--all-failed", "--json")
    assert (code, json.loads(out)) == (0, {"requeued": 1})
    assert (await queue.stats()).counts["failed"] == 0

    while (task := await queue.claim("w1")) is not None:  # "waiting", then 7
        assert await (queue.fail(task, "again") if task.id == 7 else queue.complete(task))
    code, _, _ = await mongoq_cmd("tasks", "requeue", "jobs", "7")  # the string "7"
    assert code == 1
    code, _, _ = await mongoq_cmd("tasks", "requeue", "jobs", "7", "--int-ids")
    assert code == 0 and await status_of(queue, 7) == "pending"


async def test_tasks_cancel_ends_pending_tasks_and_says_when_there_was_none(
    db: Any, mongoq_cmd: Mongoq
) -> None:
    queue = await seed_tasks(db)  # "waiting" and 7 are pending
    code, out, _ = await mongoq_cmd("tasks", "cancel", "jobs", "waiting", "new-done", "7")
    assert (code, out) == (0, "cancelled 1 task(s)\n")  # new-done is done; "7" is no id here
    assert await status_of(queue, "waiting") == "cancelled"
    assert await status_of(queue, "new-done") == "done"
    code, out, _ = await mongoq_cmd("tasks", "cancel", "jobs", "7", "--int-ids", "--json")
    assert (code, json.loads(out)) == (0, {"cancelled": 1})
    assert await status_of(queue, 7) == "cancelled"
    code, out, _ = await mongoq_cmd("tasks", "cancel", "jobs", "waiting")
    assert (code, out) == (1, "no pending or running task to cancel\n")


async def test_list_shows_every_primitive_set_up_in_the_database(
    db: Any, mongoq_cmd: Mongoq
) -> None:
    code, out, _ = await mongoq_cmd("list")
    assert (code, out) == (0, "no mongoq primitive set up in this database\n")
    await AsyncTaskQueue(db, "jobs").setup()
    await AsyncGroupTransport(db, "orders").setup()
    code, out, _ = await mongoq_cmd("list")
    rows = [line.split()[:2] for line in out.splitlines()]
    assert code == 0 and rows == [["PRIMITIVE", "NAME"], ["tasks", "jobs"], ["groups", "orders"]]
    code, out, _ = await mongoq_cmd("list", "--json")
    assert [(r["primitive"], r["name"]) for r in json.loads(out)] == [
        ("tasks", "jobs"), ("groups", "orders"),
    ]  # fmt: skip


async def test_tasks_schedules_lists_and_unschedule_removes(db: Any, mongoq_cmd: Mongoq) -> None:
    queue = AsyncTaskQueue(db, "jobs")
    await queue.setup()
    await queue.schedule("nightly", cron="0 3 * * *", timezone="Europe/Paris", missed="skip")
    await queue.schedule("pulse", every=90)
    code, out, _ = await mongoq_cmd("tasks", "schedules", "jobs")
    assert code == 0
    header, nightly, pulse = out.splitlines()
    assert header.split()[:4] == ["NAME", "WHEN", "TIME", "ZONE"]
    assert nightly.split()[:7] == ["nightly", "0", "3", "*", "*", "*", "Europe/Paris"]
    assert pulse.split()[:5] == ["pulse", "every", "1m30s", "UTC", "once"]
    code, out, _ = await mongoq_cmd("tasks", "schedules", "jobs", "--json")
    assert code == 0 and [s["name"] for s in json.loads(out)] == ["nightly", "pulse"]
    code, out, _ = await mongoq_cmd("tasks", "unschedule", "jobs", "pulse")
    assert (code, out) == (0, "removed schedule 'pulse'\n")
    code, out, _ = await mongoq_cmd("tasks", "unschedule", "jobs", "pulse")
    assert (code, out) == (1, "no schedule 'pulse'\n")
    assert [s.name for s in await queue.schedules()] == ["nightly"]


@pytest.mark.parametrize("age", ["604800", "7d", "168h", "10080m", "604800s"])
async def test_tasks_purge_deletes_finished_tasks_older_than(
    db: Any, mongoq_cmd: Mongoq, age: str
) -> None:
    queue = await seed_tasks(db)
    code, out, _ = await mongoq_cmd(
        "tasks", "purge", "jobs", "--status", "done", "--older-than", age
    )
    assert (code, out) == (0, "purged 1 done task(s) last changed over 7d0h ago\n")
    assert await queue.get("old-done") is None
    assert (await queue.stats()).counts == {"pending": 2, "processing": 0, "done": 1, "failed": 2,
                                            "cancelled": 0, "tombstone": 0}  # fmt: skip
    code, out, _ = await mongoq_cmd(
        "tasks", "purge", "jobs", "--status", "failed", "--older-than", "30m", "--json"
    )
    assert (code, json.loads(out)) == (0, {"purged": 2})
    assert (await queue.stats()).counts["failed"] == 0


async def test_tasks_reclaim_fails_or_requeues_expired_leases(db: Any, mongoq_cmd: Mongoq) -> None:
    clock = ManualClock(datetime.now(UTC) - timedelta(hours=1))
    queue = AsyncTaskQueue(db, "jobs", clock=clock, lease_ttl=60)
    await queue.setup()
    await queue.put("a")
    await queue.put("b", delay=1)
    await claimed(queue, "a")
    code, out, _ = await mongoq_cmd("tasks", "reclaim", "jobs", "--max-attempts", "1")
    assert (code, out) == (0, "expired leases: 1 task(s) failed, 0 requeued\n")
    assert await status_of(queue, "a") == "failed"
    clock.advance(1)
    await claimed(queue, "b")
    code, out, _ = await mongoq_cmd("tasks", "reclaim", "jobs", "--json")
    assert (code, json.loads(out)) == (0, {"failed": 0, "requeued": 1})
    assert await status_of(queue, "b") == "pending"


# ----------------------------------------------------------------------------- groups


async def seed_groups(db: Any) -> tuple[AsyncGroupTransport, int]:
    """Group "a": its head dead-lettered, one message left (ready); "b" parked; "c" in flight;
    7 never claimed (ready). Returns the transport and the dead letter's seq."""
    transport = AsyncGroupTransport(db, "orders", clock=ManualClock())
    await transport.setup()
    dead_seq = await transport.publish("a", {"n": 1})
    await transport.publish("a", {"n": 2})
    lease = await transport.claim("w1")
    assert lease is not None and lease.group_id == "a"
    assert await transport.dead_letter(lease, TRACEBACK)
    for group_id in ("b", "c"):
        await transport.publish(group_id, {"n": 3})
        lease = await transport.claim("w1")
        while lease is not None and lease.group_id != group_id:  # "a" again: leave it ready
            assert await transport.nack(lease)
            lease = await transport.claim("w1")
        assert lease is not None
        if group_id == "b":
            assert await transport.nack(lease, 3600, error="later")
    await transport.publish(7, {"n": 4})
    return transport, dead_seq


async def test_groups_stats_and_list(db: Any, mongoq_cmd: Mongoq) -> None:
    await seed_groups(db)
    code, out, _ = await mongoq_cmd("groups", "stats", "orders")
    assert code == 0
    assert [line.rsplit(None, 1)[-1] for line in out.splitlines()][:5] == ["2", "1", "1", "4", "1"]
    code, out, _ = await mongoq_cmd("groups", "stats", "orders", "--json")
    stats = json.loads(out)
    assert 0 <= stats.pop("oldest_message_age") < 60  # published at the start of the test
    assert stats == {"ready": 2, "in_flight": 1, "parked": 1, "messages": 4, "dead": 1}

    code, out, _ = await mongoq_cmd("groups", "list", "orders")
    table = rows(out)
    assert code == 0 and {g: r[1] for g, r in table.items()} == {
        "a": "ready", "b": "parked", "c": "in_flight", "7": "ready"
    }  # fmt: skip
    assert table["7"][3] == "-"  # never claimed: no instant to show
    code, out, _ = await mongoq_cmd("groups", "list", "orders", "--state", "parked", "--json")
    page = json.loads(out)
    assert [(g["group_id"], g["head_deliveries"]) for g in page["groups"]] == [("b", 1)]
    assert page["groups"][0]["head_error"] == "later" and page["next"] is None

    code, out, _ = await mongoq_cmd("groups", "list", "orders", "--limit", "3")
    cursor = out.splitlines()[-1].removeprefix("next: --after ")
    code, out, _ = await mongoq_cmd("groups", "list", "orders", "--after", cursor, "--json")
    assert len(json.loads(out)["groups"]) == 1


async def test_groups_dead_letters_and_redrive(db: Any, mongoq_cmd: Mongoq) -> None:
    transport, seq = await seed_groups(db)
    code, out, _ = await mongoq_cmd("groups", "dead-letters", "orders")
    assert code == 0 and list(rows(out)) == [str(seq)]
    assert out.splitlines()[1].endswith("ValueError: bad payload")
    code, out, _ = await mongoq_cmd("groups", "dead-letters", "orders", "--group", "7",
                                    "--int-group")  # fmt: skip
    assert (code, out) == (0, "no dead letters\n")
    code, out, _ = await mongoq_cmd("groups", "dead-letters", "orders", "--group", "a", "--json")
    letters = json.loads(out)["dead_letters"]
    assert [(d["seq"], d["event"], d["error"]) for d in letters] == [(seq, {"n": 1}, TRACEBACK)]

    code, _, err = await mongoq_cmd("groups", "redrive", "orders")
    assert code == 2 and "SEQ ..., --group G or --all" in err
    code, out, _ = await mongoq_cmd("groups", "redrive", "orders", str(seq + 100))
    assert (code, out) == (1, "no dead letter to redrive\n")
    code, out, _ = await mongoq_cmd("groups", "redrive", "orders", str(seq))
    assert (code, out) == (0, "redrove 1 dead letter(s)\n")
    assert await transport.dead_letters() == []
    assert (await transport.stats()).messages == 5
    code, out, _ = await mongoq_cmd("groups", "redrive", "orders", "--group", "a", "--json")
    assert (code, json.loads(out)) == (1, {"redriven": 0})


# ----------------------------------------------------------------------------- outbox


async def seed_outbox(db: Any) -> AsyncOutbox:
    """e1 and e2 to "email" and "ledger": e1/email dead since 40 days, e2/email since an hour,
    the ledger deliveries pending."""
    now = datetime.now(UTC)
    clock = ManualClock(now - timedelta(days=40))
    outbox = AsyncOutbox(db, subscriptions={"order.placed": ["email", "ledger"]}, clock=clock)
    await outbox.setup()
    for event_id in ("e1", "e2"):
        await outbox.publish(Event(event_id, "order.placed", {"id": event_id}), session=None)
        for delivery in await outbox.claim("w1", limit=16):
            if delivery.handler == "email" and delivery.event.id == event_id:
                assert await outbox.bury(delivery, error=f"smtp down for {event_id}")
            else:
                assert await outbox.release(delivery)
        clock.set(now - timedelta(hours=1))
    return outbox


async def test_outbox_stats_and_list(db: Any, mongoq_cmd: Mongoq) -> None:
    await seed_outbox(db)
    code, out, _ = await mongoq_cmd("outbox", "stats")
    assert code == 0 and out.splitlines()[:5] == [
        "pending        2", "parked         0", "running        0", "dead           2",
        "completed      0",
    ]  # fmt: skip
    code, out, _ = await mongoq_cmd("outbox", "list", "--status", "dead")
    assert [(r[0], r[2], r[3]) for r in rows(out).values()] == [
        ("e1", "email", "dead"), ("e2", "email", "dead")
    ]  # fmt: skip
    assert out.splitlines()[2].endswith("smtp down for e2")
    code, out, _ = await mongoq_cmd("outbox", "list", "--handler", "ledger", "--json")
    deliveries = json.loads(out)["deliveries"]
    assert [(d["event_id"], d["status"]) for d in deliveries] == [
        ("e1", "pending"),
        ("e2", "pending"),
    ]
    code, out, _ = await mongoq_cmd("outbox", "list", "--event-type", "order.shipped")
    assert (code, out) == (0, "no deliveries\n")


async def test_outbox_requeue_and_purge(db: Any, mongoq_cmd: Mongoq) -> None:
    outbox = await seed_outbox(db)
    code, out, _ = await mongoq_cmd("outbox", "requeue", "e2", "email")
    assert (code, out) == (0, "requeued e2 to email\n")
    requeued = await outbox.list_deliveries(handler="email", status="pending")
    assert [(d.event_id, d.attempts) for d in requeued] == [("e2", 0)]
    code, out, _ = await mongoq_cmd("outbox", "requeue", "e2", "email", "--json")
    assert (code, json.loads(out)) == (1, {"requeued": False})

    code, _, err = await mongoq_cmd("outbox", "purge")
    assert code == 2 and "--dead-older-than" in err
    code, out, _ = await mongoq_cmd("outbox", "purge", "--dead-older-than", "30d")
    assert (code, out) == (0, "purged 1 dead deliveries, 0 completion records, 0 events\n")
    assert [d.event_id for d in await outbox.list_deliveries(status="dead")] == []
    assert len(await outbox.list_deliveries()) == 3
    code, out, _ = await mongoq_cmd(
        "outbox", "purge", "--prefix", "other_", "--dead-older-than", "1s", "--json"
    )
    assert json.loads(out) == {"dead_deliveries": 0, "completed_records": 0, "events": 0}


# ------------------------------------------------------------------ options, metrics, errors


async def test_global_options_go_before_or_after_the_command(
    db: Any, mongoq_cmd: Mongoq, opened: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    await seed_tasks(db)
    outputs = [
        await mongoq_cmd(*argv)
        for argv in (
            ["--json", "--database", "app", "tasks", "stats", "jobs"],
            ["tasks", "--json", "stats", "jobs", "--database", "app"],
            ["tasks", "stats", "jobs", "--json", "--database", "app", "--uri", "memory://"],
        )
    ]
    assert [json.loads(out)["counts"]["failed"] for _, out, _ in outputs] == [2, 2, 2]
    assert [call[:2] for call in opened] == [(None, "app"), (None, "app"), ("memory://", "app")]
    assert outputs[2][2] == ""  # memory:// named: no note
    assert opened[0][2] == {"timeout": 5.0}
    monkeypatch.setenv("MONGOQ_DATABASE", "env_db")
    monkeypatch.setenv("MONGOQ_TIMEOUT", "2")
    await mongoq_cmd("tasks", "stats", "jobs")
    assert opened[-1][1] == "env_db"
    assert opened[-1][2]["timeout"] == 2.0


async def test_the_demo_runs_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    assert await cli.run(["demo", "--tasks", "20", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("[ok]") == 7 and "[FAILED]" not in out


async def test_the_demo_with_json_prints_its_report_as_one_document(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``demo --json``: the rounds go to stderr, stdout holds one JSON document, the report."""
    assert await cli.run(["demo", "--tasks", "20", "--workers", "2", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["ok"] is True and report["statuses"]["done"] >= 1
    assert len(report["checks"]) == 7 and all(check["ok"] for check in report["checks"])
    assert "round" in captured.err


@pytest.mark.parametrize("flag", ["--workers", "--tasks"])
async def test_the_demo_refuses_a_count_below_one_by_its_flag_before_writing(
    flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the demo ran")

    monkeypatch.setattr(cli, "run_demo", never)
    assert await cli.run(["demo", flag, "0"]) == 2
    assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"    {name} " in out for name in ("tasks", "groups", "outbox", "metrics", "demo"))


def test_version_through_the_console_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mongoq", "--version"], capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (0, f"mongoq {mongoq.__version__}\n")


async def test_metrics_serves_the_named_primitives_until_stopped(
    db: Any, mongoq_cmd: Mongoq, monkeypatch: pytest.MonkeyPatch
) -> None:
    await seed_tasks(db)
    scraped: list[str] = []

    def get(url: str) -> str:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return str(reply.read().decode())

    async def scrape_then_stop(url: str) -> None:  # instead of waiting for Ctrl-C
        scraped.extend([url, await anyio.to_thread.run_sync(get, url)])

    monkeypatch.setattr(cli, "_serve_until_stopped", scrape_then_stop)
    code, out, _ = await mongoq_cmd(
        "metrics", "--port", "0", "--addr", "127.0.0.1", "--tasks", "jobs", "--groups", "orders",
        "--outbox", "mongoq_outbox_", "--uri", "memory://",
    )  # fmt: skip
    url, text = scraped
    assert code == 0 and out == f"serving metrics on {url} (Ctrl-C stops)\n"
    assert 'mongoq_tasks{queue="jobs",status="failed"} 2.0' in text
    assert 'mongoq_up{primitive="groups",queue="orders"} 1.0' in text
    with pytest.raises(urllib.error.URLError):  # closed once stopped
        await anyio.to_thread.run_sync(get, url)

    code, _, err = await mongoq_cmd("metrics", "--port", "0", "--uri", "memory://")
    assert code == 2 and one_error_line(err).startswith("mongoq: error: tasks: name at least")
    code, _, err = await mongoq_cmd("metrics", "--port", "0", "--tasks", "jobs", "--json")
    assert code == 2 and "--json is for the operator commands" in one_error_line(err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tasks", "list", "jobs", "--status", "bogus"],
         "mongoq tasks list: error: argument --status: invalid choice: 'bogus'"),
        (["tasks", "list", "jobs", "--limit", "5000"],
         "mongoq: error: limit: must be between 1 and 1000, got 5000"),
        (["tasks", "list", "jobs", "--after", "nonsense"],
         "mongoq: error: after: must be the `next` of an earlier page"),
        (["tasks", "purge", "jobs", "--status", "done", "--older-than", "a week"],
         "mongoq tasks purge: error: argument --older-than: expected seconds or 30s"),
        (["tasks", "requeue", "jobs", "a", "--all-failed"],
         "mongoq: error: name the task ids to requeue, or pass --all-failed (not both)"),
        (["groups", "list", "bad$prefix"], "mongoq: error: prefix: must not contain '$'"),
        (["frobnicate"], "mongoq: error: argument COMMAND: invalid choice: 'frobnicate'"),
    ],
)  # fmt: skip
async def test_bad_input_is_one_line_and_exit_code_2(
    db: Any, mongoq_cmd: Mongoq, argv: list[str], message: str
) -> None:
    code, out, err = await mongoq_cmd(*argv, "--uri", "memory://")
    assert (code, out) == (2, "")
    assert one_error_line(err).startswith(message)


OPERATOR_COMMANDS = [
    ["list"], ["tasks", "stats", "jobs"], ["tasks", "list", "jobs", "--json"],
    ["tasks", "requeue", "jobs", "--all-failed"], ["tasks", "schedules", "jobs"],
    ["groups", "stats", "orders"], ["groups", "dead-letters", "orders"], ["outbox", "stats"],
    ["outbox", "list"],
]  # fmt: skip


def assert_refuses_the_embedded_backend(code: int, out: str, err: str, exports: str) -> None:
    """Exit 2, nothing on stdout, one line: what the database is and how to name a server."""
    assert (code, out) == (2, ""), err
    line = one_error_line(err)
    assert line.startswith("mongoq: error: "), line
    for words in ("embedded backend", "new, empty database", f"nothing to {exports}",
                  "--uri mongodb://", "MONGOQ_URI"):  # fmt: skip
        assert words in line, line


@pytest.mark.parametrize("argv", OPERATOR_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("given", ["nothing", "--uri memory://", "MONGOQ_URI=memory://"])
async def test_an_operator_command_on_the_embedded_backend_refuses_instead_of_showing_zeros(
    argv: list[str], given: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Without a server each command opens the embedded backend afresh: its zeros would make
    a misspelt queue look healthy and empty."""
    if given.startswith("MONGOQ_URI"):
        monkeypatch.setenv("MONGOQ_URI", "memory://")
    options = ["--uri", "memory://"] if given.startswith("--uri") else []
    code = await cli.run([*argv, *options])
    out, err = capsys.readouterr()
    assert_refuses_the_embedded_backend(code, out, err, "show")
    assert ("memory://" in err) is (given != "nothing")


async def test_metrics_on_the_embedded_backend_refuses_before_serving(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never(url: str) -> None:
        raise AssertionError(f"the exporter served {url}")

    monkeypatch.setattr(cli, "_serve_until_stopped", never)
    for options in ([], ["--uri", "memory://"]):
        code = await cli.run(["metrics", "--port", "0", "--tasks", "jobs", *options])
        out, err = capsys.readouterr()
        assert_refuses_the_embedded_backend(code, out, err, "export")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_server_is_one_line_without_credentials(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = closed_port()
    monkeypatch.setenv("MONGOQ_URI", f"mongodb://alice:s3cr%40t@127.0.0.1:{port}/?authSource=admin")
    started = time.monotonic()
    assert cli.main(["tasks", "stats", "jobs", "--timeout", "0.2"]) == 2
    assert time.monotonic() - started < 5
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"mongoq: error: cannot reach the MongoDB server at 127.0.0.1:{port} (")
    assert line.endswith("; gave up after 0.2 s)")
    assert not any(secret in line for secret in ("alice", "s3cr", "%40", "s3cr@t"))

    monkeypatch.setenv("MONGOQ_TIMEOUT", "0.2")
    assert cli.main(["groups", "stats", "orders", "--uri", f"mongodb://localhost:{port}"]) == 2
    assert f"at localhost:{port} (" in one_error_line(capsys.readouterr().err)


def test_a_malformed_uri_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["outbox", "stats", "--uri", "http://bob:hunter2@example.com"]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "mongoq: error: uri: must start with mongodb://, mongodb+srv:// or memory://"
    )
    assert cli.main(["outbox", "stats", "--uri", "mongodb://bob:hunter2@host:notaport"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("mongoq: error: ") and "hunter2" not in line and "bob" not in line


@pytest.mark.parametrize(
    ("uri", "redacted"),
    [
        ("mongodb://alice:s3cret@db1:27017,db2/app?replicaSet=rs0",
         "mongodb://***@db1:27017,db2/app?replicaSet=rs0"),
        ("mongodb+srv://alice:p%40ss%2Fw0rd@cluster0.example.net/?retryWrites=true",
         "mongodb+srv://***@cluster0.example.net/?retryWrites=true"),
        ("mongodb://alice@db1/?authMechanism=MONGODB-X509", "mongodb://***@db1/?authMechanism=MONGODB-X509"),
        ("mongodb://alice:pa/ss@db1/app", "mongodb://***@db1/app"),  # an unescaped '/'
        ("mongodb://db1/?tls=true&tlsCertificateKeyFilePassword=k3y",
         "mongodb://db1/?tls=true&tlsCertificateKeyFilePassword=***"),
        ("mongodb://localhost", "mongodb://localhost"),
        ("memory://", "memory://"),
    ],
)  # fmt: skip
def test_redact_removes_credentials_from_a_uri(uri: str, redacted: str) -> None:
    assert cli.redact(uri) == redacted


def test_scrub_removes_credentials_from_a_driver_message() -> None:
    uri = "mongodb+srv://alice:p%40ss+w0rd@cluster0.example.net/?authSource=admin"
    message = (
        "bad auth for p@ss+w0rd (decoded), p@ss w0rd (plus-decoded), p%40ss+w0rd (as written), "
        "user alice, at mongodb://alice:p%40ss+w0rd@cluster0.example.net"
    )
    scrubbed = cli.scrub(message, uri)
    assert not any(s in scrubbed for s in ("alice", "p@ss", "p%40ss", "w0rd"))
    assert scrubbed.endswith("at mongodb://***@cluster0.example.net")
    assert cli.scrub("at mongodb://u:p@h/x", None) == "at mongodb://***@h/x"


@pytest.mark.parametrize(
    "argv",
    [
        ["outbox", "purge", "--dead-older-than", "99999999999999d", "--uri", "memory://"],
        ["metrics", "--port", "0", "--tasks", "q", "--uri", "mongodb://u:pa/ss@h"],
        ["tasks", "list", "q", "--after", "99999999999999999:i:1", "--uri", "memory://"],
    ],
    ids=["overflowing-age", "malformed-uri-for-metrics", "cursor-past-year-9999"],
)
def test_any_other_failure_is_one_line_with_exit_2_and_no_secret(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded_embedded(monkeypatch)  # the failure itself, not the embedded backend's refusal
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mongoq") and "Traceback" not in err
    assert "embedded" not in err and len(err.strip().splitlines()) == 1
    assert "pa/ss" not in err
