"""The pytest plugin (`mongoq.pytest_plugin`): a user's suite gets a database, a manual clock and
a harness that runs its task functions to their results, moving the clock over retries and
delays; the harness cannot hang, and says what is left when it gives up; the fixtures need no
async test plugin and shadow none of the user's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from mongoq import InvalidInput, Jobs
from mongoq.pytest_plugin import JobsHarness, JobsNotIdle
from mongoq.testing import ManualClock

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]

#: The plugin by its module, whether or not mongoq's entry point is installed yet: pytest
#: refuses one module registered under two names (the entry point's, ``mongoq``, and its own).
PLUGIN = ("-p", "no:mongoq", "-p", "mongoq.pytest_plugin")

#: A user's test module: two task functions, one that fails once and is retried, one deferred
#: with a delay; tests that run them through the plugin's fixtures, beside fixtures of the
#: user's own named like the mongoq suite's.
USER_TESTS = """
from datetime import timedelta

import pytest

import mongoq

jobs = mongoq.Jobs(backoff_base=10, backoff_cap=10)
attempts = []


@jobs.task(queue="emails", retry_on=(ConnectionError,))
async def send_email(to: str) -> str:
    attempts.append(to)
    if len(attempts) == 1:
        raise ConnectionError("mail server unreachable")
    return f"sent to {to}"


@jobs.task(queue="reports")
async def report(n: int) -> int:
    return n * 2


@pytest.fixture
def db():  # the user's own, as mongoq's suite has one: the plugin's are mongoq_*
    return "the user's db"


@pytest.fixture
def clock():
    return "the user's clock"


@pytest.mark.MARKER
async def test_a_retried_and_a_delayed_task_reach_their_results(mongoq_jobs, mongoq_clock):
    assert await mongoq_jobs.bind(jobs) is jobs
    started = mongoq_clock.now()
    email = await send_email.defer("ada@example.com")
    doubled = await report.options(delay=3600).defer(21)

    run = await mongoq_jobs.run_until_idle()

    assert await send_email.wait(email) == "sent to ada@example.com"
    assert await report.wait(doubled) == 42
    assert attempts == ["ada@example.com", "ada@example.com"]
    assert (run.summary.completed, run.summary.retried, run.pending) == (2, 1, [])
    assert mongoq_clock.now() - started == run.advanced == timedelta(hours=1)
    assert run.rounds == 3  # the first try; the retry 10 s later; the report an hour later


def test_the_jobs_got_their_database_and_clock_back_and_user_fixtures_are_untouched(db, clock):
    assert (jobs.db, jobs.clock) == (None, None)
    assert (db, clock) == ("the user's db", "the user's clock")


@pytest.mark.MARKER
async def test_what_is_due_later_is_left_pending_without_advance(mongoq_jobs, mongoq_db):
    await mongoq_jobs.bind(jobs)
    await report.options(task_id="later", delay=60).defer(1)

    run = await mongoq_jobs.run_until_idle(advance_clock=False)

    assert (run.rounds, run.summary.claimed) == (1, 0)
    assert [(task.id, task.status) for task in run.pending] == [("later", "pending")]
    assert await mongoq_db["reports"].count_documents({}) == 1  # the test's own database
"""


@pytest.mark.parametrize(
    ("marker", "options"),
    [
        ("anyio", ("-p", "no:asyncio")),  # no pytest-asyncio at all: anyio's plugin
        # pytest-asyncio, as most suites use it
        (
            "asyncio",
            ("-o", "asyncio_mode=strict", "-o", "asyncio_default_fixture_loop_scope=function"),
        ),
    ],
)
def test_a_users_suite_runs_its_task_functions_to_their_results(
    pytester: pytest.Pytester, marker: str, options: tuple[str, ...]
) -> None:
    pytester.makepyfile(test_app=USER_TESTS.replace("MARKER", marker))
    result = pytester.runpytest(*PLUGIN, *options, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


def test_every_fixture_of_the_plugin_is_named_mongoq(pytester: pytest.Pytester) -> None:
    """Loaded into any suite (mongoq's own has ``db`` and ``clock``), it shadows none."""
    pytester.makepyfile(test_nothing="def test_nothing(): pass")
    result = pytester.runpytest(*PLUGIN, "-p", "no:asyncio", "-p", "no:cacheprovider", "--fixtures")
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if "defined from mongoq.pytest_plugin" in line)
    section = []
    for line in lines[start + 1 :]:
        if " defined from " in line:  # the next plugin's section
            break
        section.append(line)
    names = [line.split()[0] for line in section if line and not line.startswith(" ")]
    assert names == ["mongoq_db", "mongoq_clock", "mongoq_jobs"]


def installed_with_the_entry_point(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Put on the path of every process the test starts a distribution that declares only
    mongoq's ``pytest11`` entry point: mongoq as installed with it."""
    site = pytester.mkdir("site")
    info = site / "mongoq_plugin_probe-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mongoq-plugin-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pytest11]\nmongoq = mongoq.pytest_plugin\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


def test_the_entry_point_loads_the_plugin_with_no_option(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed_with_the_entry_point(pytester, monkeypatch)
    pytester.makepyfile(
        test_uses="def test_uses(mongoq_db, mongoq_clock, mongoq_jobs):\n    assert mongoq_db\n"
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_docs_example_runs_where_the_entry_point_is_installed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its command names the module as well (for where it is not): no double registration."""
    installed_with_the_entry_point(pytester, monkeypatch)
    example = ROOT / "examples" / "test_with_mongoq_plugin.py"
    ran = subprocess.run(
        [sys.executable, str(example)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0 and "2 passed" in ran.stdout, ran.stdout + ran.stderr


# ----------------------------------------------------------------------- the harness itself


def forever_failing(jobs: Jobs) -> Any:
    @jobs.task(queue="flaky", name="flaky")
    async def flaky(n: int) -> None:
        raise ConnectionError(f"still down ({n})")

    return flaky


async def test_it_gives_up_after_its_rounds_naming_what_is_left(
    db: Any, clock: ManualClock
) -> None:
    jobs = Jobs(max_attempts=100, backoff_base=5, backoff_cap=5)
    flaky = forever_failing(jobs)
    harness = JobsHarness(db, clock)
    await harness.bind(jobs)
    await flaky.options(task_id="f-1").defer(1)
    started = clock.now()

    with pytest.raises(JobsNotIdle) as raised:
        await harness.run_until_idle(max_rounds=3)

    message = str(raised.value)
    assert message.startswith("run_until_idle gave up after 3 rounds (max_rounds)"), message
    assert "3 claimed, 0 completed, 3 retried, 0 failed" in message
    left = r"flaky: flaky\(\) task 'f-1': pending, 3 attempt\(s\), due in [\d.]+ s; "
    assert re.search(left + r"last error: ConnectionError: still down \(1\)", message), message
    assert [(task.id, task.attempts) for task in raised.value.pending] == [("f-1", 3)]
    assert 10 <= (clock.now() - started).total_seconds() <= 15  # two backoffs (5 s, jittered)
    harness.unbind()
    assert (jobs.db, jobs.clock) == (None, None)


async def test_a_task_function_that_never_returns_is_cancelled_at_the_timeout(
    db: Any, clock: ManualClock
) -> None:
    """It awaits a sleep on the manual clock, which no round moves while it runs: the call
    gives up after `timeout` seconds of real time, and its task is released, not lost."""
    jobs = Jobs()
    harness = JobsHarness(db, clock)

    @jobs.task(queue="stuck", name="stuck")
    async def stuck() -> None:
        await clock.sleep(60)

    await harness.bind(jobs)
    await stuck.options(task_id="s-1").defer()

    with anyio.fail_after(10), pytest.raises(JobsNotIdle) as raised:
        await harness.run_until_idle(timeout=0.3)

    message = str(raised.value)
    assert "gave up after 0.3 s of real time (timeout), in round 1" in message, message
    assert re.search(r"stuck: stuck\(\) task 's-1': pending, 1 attempt\(s\), due in [\d.]+ s; "
                     r"last error: worker stopped", message)  # fmt: skip
    assert [task.status for task in raised.value.pending] == ["pending"]  # retried later


async def test_it_needs_a_bound_jobs_and_checks_its_limits(db: Any, clock: ManualClock) -> None:
    harness = JobsHarness(db, clock)
    with pytest.raises(InvalidInput, match=r"^jobs: none is bound"):
        await harness.run_until_idle()
    with pytest.raises(InvalidInput, match=r"^max_rounds"):
        await harness.run_until_idle(max_rounds=0)
    with pytest.raises(InvalidInput, match=r"^timeout"):
        await harness.run_until_idle(timeout=0)


def test_the_docs_page_includes_the_example() -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    section = page[page.index("## The pytest plugin") :]
    assert '--8<-- "examples/test_with_mongoq_plugin.py"' in section
    for name in ("mongoq_db", "mongoq_clock", "mongoq_jobs", "run_until_idle", "JobsNotIdle"):
        assert f"`{name}" in section, name
