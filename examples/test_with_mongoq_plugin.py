"""Testing an application's task functions with mongoq's pytest plugin.

The application's part (its `Jobs`, its task functions, the code that defers them) would live
in a module of its own; the tests below use the plugin's fixtures (`mongoq_jobs`,
`mongoq_clock`) and anyio's pytest plugin for async tests (anyio comes with mongoq;
pytest-asyncio's ``@pytest.mark.asyncio`` works as well). ``pytest
examples/test_with_mongoq_plugin.py`` runs them, and so does
``python examples/test_with_mongoq_plugin.py``.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest

import mongoq

if TYPE_CHECKING:  # the plugin's module is pytest's to import first (it rewrites its asserts)
    from mongoq.pytest_plugin import JobsHarness
    from mongoq.testing import ManualClock

# ---------------------------------------------------------------------------- the application

jobs = mongoq.Jobs(backoff_base=30)  # a failed call is retried 30 s later, then 60 s...


class MailServer:
    """A stand-in for the SMTP server: refuses the next `down` connections."""

    def __init__(self) -> None:
        self.down = 0
        self.sent: list[str] = []

    async def send(self, to: str, subject: str) -> None:
        if self.down:
            self.down -= 1
            raise ConnectionError("mail server unreachable")
        self.sent.append(f"{subject} -> {to}")


mail = MailServer()


@jobs.task(queue="emails", retry_on=(ConnectionError,))
async def send_email(to: str, subject: str) -> str:
    await mail.send(to, subject)
    return f"sent {subject!r} to {to}"


@jobs.task(queue="reminders")
async def remind(user: str) -> str:
    return f"reminded {user}"


async def sign_up(user: str) -> None:
    """The code under test: a welcome email now (once per user: its id says whose), a
    reminder in a day."""
    await send_email.options(task_id=f"welcome-{user}").defer(f"{user}@example.com", "welcome")
    await remind.options(delay=timedelta(days=1).total_seconds()).defer(user)


# -------------------------------------------------------------------------------- its tests


@pytest.mark.anyio
async def test_sign_up_sends_a_welcome_through_an_outage_and_reminds_a_day_later(
    mongoq_jobs: JobsHarness, mongoq_clock: ManualClock
) -> None:
    await mongoq_jobs.bind(jobs)  # on this test's database and clock, indexes created
    mail.down = 1  # the first attempt fails; the retry, 30 s of the clock later, succeeds
    started = mongoq_clock.now()
    await sign_up("ada")

    run = await mongoq_jobs.run_until_idle()

    assert await send_email.wait("welcome-ada") == "sent 'welcome' to ada@example.com"
    assert mail.sent[-1] == "welcome -> ada@example.com"
    assert (run.summary.completed, run.summary.retried) == (2, 1)
    assert mongoq_clock.now() - started == timedelta(days=1)  # the reminder ran on its day


@pytest.mark.anyio
async def test_the_reminder_waits_for_its_day(mongoq_jobs: JobsHarness) -> None:
    await mongoq_jobs.bind(jobs)
    await sign_up("bob")

    run = await mongoq_jobs.run_until_idle(advance_clock=False)  # only what is due now

    assert run.summary.completed == 1  # the welcome
    assert [(task.function, task.payload["kwargs"]) for task in run.pending] == [
        ("remind", {"user": "bob"})
    ]


if __name__ == "__main__":
    # As a script: pytest on this file alone, in a fresh interpreter (one that imported
    # nothing yet, so pytest rewrites the asserts of every plugin). `-o addopts=` leaves out
    # the options of the project around it (mongoq's own run on every core). `-p no:mongoq -p
    # mongoq.pytest_plugin` loads the plugin by its module whether or not mongoq's entry point
    # is installed: pytest refuses one module registered under two names.
    command = [sys.executable, "-m", "pytest", __file__, "-q", "-o", "addopts="]
    sys.exit(subprocess.run([*command, "-p", "no:mongoq", "-p", "mongoq.pytest_plugin"]).returncode)
