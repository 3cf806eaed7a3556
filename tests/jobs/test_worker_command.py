"""``mongoq worker MODULE:ATTRIBUTE``: one process runs every task function of a `Jobs`; it
refuses the embedded backend unless asked, says a bad target in one line, and keeps a
readiness file while it runs."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from mongoq import _driver, cli
from mongoq.jobs import command
from mongoq.runtime import handler
from mongoq.testing import ManualClock, settle
from tests.support.helpers import until, wait_for

APP = """
import mongoq

jobs = mongoq.Jobs()


@jobs.task(queue="emails")
async def send_email(to: str, subject: str) -> str:
    return f"sent {subject} to {to}"


@jobs.task(queue="media")
async def resize(path: str, width: int = 640) -> dict:
    return {"path": path, "width": width}


@jobs.task(queue="media")
async def transcode(path: str) -> str:
    return path.replace(".mov", ".mp4")
"""


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A project's module declaring three task functions in two queues, importable as
    ``worker_app`` from the directory the worker starts in."""
    (tmp_path / "worker_app.py").write_text(APP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("worker_app", None)
    import worker_app  # type: ignore[import-not-found]

    yield worker_app
    sys.modules.pop("worker_app", None)


async def test_one_worker_process_runs_three_functions_of_two_queues(
    app: Any, db: Any, clock: ManualClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command as a container runs it, on the test's database (a server's, on the real
    lane; the embedded one with ``--in-process``): every deferred call done, the readiness
    file there while it runs and gone after."""
    jobs = app.jobs.use(db)
    jobs.clock = clock
    await jobs.setup()
    ids = [
        await app.send_email.defer("ada@example.com", "hi"),
        await app.resize.defer("/p/1.jpg"),
        await app.transcode.defer("/v/1.mov"),
    ]
    monkeypatch.setattr(_driver, "connect", lambda *args, **kwargs: db)
    monkeypatch.setattr(_driver, "close", _closed)
    ready = tmp_path / "ready"
    codes: list[int] = []

    async def command() -> None:
        argv = ["worker", "worker_app:jobs", "--in-process", "--concurrency", "2",
                "--ready-file", str(ready)]  # fmt: skip
        codes.append(await cli.run(argv))

    async with anyio.create_task_group() as group:
        group.start_soon(command)
        done: dict[str, list[str]] = {}
        for queue in ("emails", "media"):
            done[queue] = await until(
                partial(_statuses, db, queue), lambda s: set(s) == {"done"}, f"{queue} done"
            )
        assert ready.read_text().strip().isdigit()  # written while it runs: the pid
        jobs.stop()
    assert codes == [0] and not ready.exists()
    assert len(done["emails"]) == 1 and len(done["media"]) == 2
    media = {doc["_id"]: doc for doc in await db["media"].find({}).to_list(None)}
    assert media[ids[1]]["result"] == {"path": "/p/1.jpg", "width": 640}
    assert media[ids[2]]["result"] == "/v/1.mp4"


async def _closed(db: Any) -> None:
    return None


async def _statuses(db: Any, queue: str) -> list[str]:
    return [doc["status"] for doc in await db[queue].find({}).to_list(None)]


def test_without_a_server_the_worker_refuses_the_embedded_backend(
    app: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MONGOQ_URI", raising=False)
    assert cli.main(["worker", "worker_app:jobs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mongoq: error: worker: no --uri nor MONGOQ_URI: on the embedded")
    assert "--in-process" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("worker_app", "is not MODULE:ATTRIBUTE"),
        ("no_such_module:jobs", "cannot import 'no_such_module'"),
        ("worker_app:send_email", "is TaskFunction, not a mongoq.Jobs"),
        ("worker_app:job", "module 'worker_app' has no attribute 'job'; its mongoq.Jobs: jobs"),
        ("worker_app:nothing", "module 'worker_app' has no attribute 'nothing'; its mongoq.Jobs"),
    ],
)
def test_a_bad_target_is_one_line(
    app: Any, target: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["worker", target, "--in-process"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mongoq: error: worker: ") and said in err


RUNAWAY = """
import anyio
import mongoq

jobs = mongoq.Jobs()
release = anyio.Event()


@jobs.task(queue="runaway", timeout=1)
async def swallow() -> None:
    while not release.is_set():
        try:
            await release.wait()
        except BaseException:  # the careless function under test
            pass
"""


async def test_a_worker_whose_call_was_abandoned_still_exits_when_stopped(
    db: Any, clock: ManualClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncio.run`` would wait for the abandoned call for ever: the worker exits at once."""
    (tmp_path / "runaway_app.py").write_text(RUNAWAY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("runaway_app", None)
    import runaway_app  # type: ignore[import-not-found]

    jobs = runaway_app.jobs.use(db)
    jobs.clock = clock
    await jobs.setup()
    task_id = await runaway_app.swallow.defer()
    monkeypatch.setattr(_driver, "connect", lambda *args, **kwargs: db)
    monkeypatch.setattr(_driver, "close", _closed)
    exits: list[int] = []
    monkeypatch.setattr(command, "exit_now", exits.append)
    codes: list[int] = []

    async def worker() -> None:
        codes.append(await cli.run(["worker", "runaway_app:jobs", "--in-process"]))

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(worker)
            await until(partial(_statuses, db, "runaway"), lambda s: s == ["processing"], "run")
            await wait_for(lambda: bool(handler.running), "the call to start")
            clock.advance(1)  # its time limit: cancelled once, swallowed
            await settle(10)
            clock.advance(handler.GRACE)  # abandoned
            await wait_for(lambda: bool(handler.abandoned), "the call to be abandoned")
            jobs.stop()
        assert codes == [0] and exits == [0]
        assert await _statuses(db, "runaway") == ["processing"]  # left to its lease
    finally:
        runaway_app.release.set()
        await settle(5)
        sys.modules.pop("runaway_app", None)
    assert (await db["runaway"].find_one({"_id": task_id}) or {})["attempts"] == 1
