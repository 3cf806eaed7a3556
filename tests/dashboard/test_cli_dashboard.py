"""``mongoq dashboard`` and ``mongoq demo --dashboard``: what they print, the app they serve
(fetched over HTTP from the real server they start), the token they print, and their errors."""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from mongoq import _driver, cli
from mongoq.testing import ManualClock
from tests.support.dashboard_helpers import seed

Run = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
def mongoq_cmd(db: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """``mongoq ARGS...`` on the test's database: exit code, stdout, stderr."""
    for name in ("MONGOQ_URI", "MONGOQ_DATABASE", "MONGOQ_DASHBOARD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_driver, "connect", lambda *args, **options: db)

    # The CLI closes the client it connected: the test's database must outlive the command.
    async def keep_open(database: Any) -> None:
        return None

    monkeypatch.setattr(_driver, "close", keep_open)
    # The command refuses the embedded backend, new and empty in its process; this one is the
    # test's, seeded.
    monkeypatch.setattr(cli, "_fresh_embedded", lambda db: False)

    async def invoke(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await cli.run(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def served_url(out: str) -> str:
    line = next(line for line in out.splitlines() if line.startswith("serving the dashboard"))
    return line.split(" on ")[1].split(" ")[0].rstrip("/")


def serving_then(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    visit: Callable[[httpx.AsyncClient, str], Awaitable[None]], printed: list[str],
) -> None:  # fmt: skip
    """Serve for real, and instead of waiting for Ctrl-C, `visit` the dashboard over HTTP."""
    real = cli._serve_dashboard

    async def serve_and_visit(app: Any, sock: socket.socket) -> None:
        import anyio

        async with anyio.create_task_group() as group:
            group.start_soon(real, app, sock)
            captured = capsys.readouterr()
            out = captured.out
            printed.append(out + captured.err)
            async with httpx.AsyncClient(base_url=served_url(out), timeout=10) as http:
                await visit(http, out)
            group.cancel_scope.cancel()

    monkeypatch.setattr(cli, "_serve_dashboard", serve_and_visit)


async def test_dashboard_serves_read_only_by_default(
    db: Any, clock: ManualClock, mongoq_cmd: Run, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    await seed(db, clock)
    seen: dict[str, Any] = {}

    async def visit(http: httpx.AsyncClient, out: str) -> None:
        seen["page"] = await http.get("/")
        seen["post"] = await http.post("/actions/tasks/emails/requeue", data={"all": "1"})

    printed: list[str] = []
    serving_then(monkeypatch, capsys, visit, printed)
    code, _, err = await mongoq_cmd("dashboard", "--port", "0", "--uri", "memory://")

    assert code == 0, err
    assert "read-only (--allow-actions enables" in printed[0] and "token" not in printed[0]
    assert seen["page"].status_code == 200 and "emails" in seen["page"].text
    assert seen["post"].status_code == 403
    assert (await db["emails"].find_one({"_id": "bounce-2"}))["status"] == "failed"


async def test_dashboard_with_actions_prints_the_token_that_an_action_needs(
    db: Any, clock: ManualClock, mongoq_cmd: Run, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    await seed(db, clock)
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)  # the default level
    dashboard_log = logging.getLogger("mongoq.dashboard")
    monkeypatch.setattr(dashboard_log, "level", dashboard_log.level)  # restored after
    statuses: list[int] = []

    async def visit(http: httpx.AsyncClient, out: str) -> None:
        token = out.split("each needs the token: ")[1].split()[0]
        form = {"id": "bounce-2", "id_type": "str"}
        statuses.append((await http.post("/actions/tasks/emails/requeue", data=form)).status_code)
        form["token"] = token
        statuses.append((await http.post("/actions/tasks/emails/requeue", data=form)).status_code)

    serving_then(monkeypatch, capsys, visit, [])
    code, _, err = await mongoq_cmd("dashboard", "--port", "0", "--allow-actions",
                                    "--uri", "memory://")  # fmt: skip

    assert (code, statuses) == (0, [403, 303]), err
    assert (await db["emails"].find_one({"_id": "bounce-2"}))["status"] == "pending"
    outcomes = [getattr(r, "mongoq_outcome", None) for r in caplog.records
                if r.name == "mongoq.dashboard"]  # fmt: skip
    assert outcomes == ["refused", "done"]  # a done action is logged at the default level


async def test_a_configured_token_is_used_and_never_printed(
    db: Any, clock: ManualClock, mongoq_cmd: Run, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    await seed(db, clock)
    token = "configured-token-0123456789"
    monkeypatch.setenv("MONGOQ_DASHBOARD_TOKEN", token)
    statuses: list[int] = []

    async def visit(http: httpx.AsyncClient, out: str) -> None:
        form = {"id": "bounce-2", "token": token}
        statuses.append((await http.post("/actions/tasks/emails/requeue", data=form)).status_code)

    printed: list[str] = []
    serving_then(monkeypatch, capsys, visit, printed)
    code, _, _ = await mongoq_cmd("dashboard", "--port", "0", "--allow-actions",
                                  "--uri", "memory://")  # fmt: skip

    assert (code, statuses) == (0, [303])
    assert token not in printed[0] and "the configured one" in printed[0]
    code, _, err = await mongoq_cmd("dashboard", "--allow-actions", "--token", "short",
                                    "--uri", "memory://")  # fmt: skip
    assert code == 2 and "token: must be a text of at least 16 characters" in err


@pytest.mark.parametrize("options", [[], ["--uri", "memory://"]], ids=["no-uri", "memory"])
async def test_the_dashboard_refuses_the_embedded_backend_it_would_show_nothing_of(
    options: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a server the command opens the embedded backend afresh: an empty dashboard
    would make misspelt or missing primitives look idle. ``demo --dashboard`` fills it."""
    monkeypatch.delenv("MONGOQ_URI", raising=False)

    async def never(app: Any, sock: socket.socket) -> None:
        raise AssertionError("an empty dashboard was served")

    monkeypatch.setattr(cli, "_serve_dashboard", never)
    code = await cli.run(["dashboard", "--port", "0", *options])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    [line] = err.splitlines()
    assert line.startswith("mongoq: error: ") and "embedded backend" in line
    assert "nothing to show" in line and "--uri mongodb://" in line and "MONGOQ_URI" in line


async def test_a_port_in_use_is_one_error_line(db: Any, mongoq_cmd: Run) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, out, err = await mongoq_cmd("dashboard", "--port", str(port), "--uri", "memory://")
    assert code == 2 and out == ""
    assert f"mongoq: error: cannot serve the dashboard on 127.0.0.1:{port}" in err


async def test_a_dashboard_on_every_address_warns_and_answers_any_host_name(
    db: Any, clock: ManualClock, mongoq_cmd: Run, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    seen: list[int] = []

    async def visit(http: httpx.AsyncClient, out: str) -> None:
        port = http.base_url.port
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as local:
            reply = await local.get("/", headers={"host": f"dashboard.internal:{port}"})
            seen.append(reply.status_code)

    printed: list[str] = []
    serving_then(monkeypatch, capsys, visit, printed)
    code, _, _ = await mongoq_cmd("dashboard", "--host", "0.0.0.0", "--port", "0",
                                  "--uri", "memory://")  # fmt: skip
    assert (code, seen) == (0, [200])
    assert "warning: the dashboard is reachable on 0.0.0.0" in printed[0]


async def test_the_demo_serves_its_dashboard_while_it_runs_and_after(
    db: Any, mongoq_cmd: Run, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setattr(cli, "DEMO_ROUND_PAUSE", 0)
    overviews: list[str] = []

    async def after_the_demo(url: str) -> None:  # instead of waiting for Ctrl-C
        printed = capsys.readouterr().out
        capsys.readouterr()
        async with httpx.AsyncClient(base_url=served_url(printed), timeout=10) as http:
            overviews.append((await http.get("/")).text)  # read now, not the last sample
        print(printed, end="")

    monkeypatch.setattr(cli, "_serve_until_stopped", after_the_demo)
    code, out, err = await mongoq_cmd("demo", "--dashboard", "--tasks", "60", "--port", "0")

    assert code == 0, err
    assert "each needs the token: " in out and "[ok] no task lost" in out
    [queue] = re.findall(r'href="/tasks/(demo_tasks_[0-9a-f]+)"', overviews[0])
    counts = {label: int(n) for label, n in re.findall(
        rf'data-count="tasks:{queue}:(\w+)">(\d+)<', overviews[0])}  # fmt: skip
    assert counts["done"] + counts["failed"] == 60 and counts["pending"] == 0
