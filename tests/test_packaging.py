"""A lean install: the base is PyMongo and anyio; the embedded backend and Motor are extras whose
absence is said plainly; a user's type checker sees mongoq's types after the README's install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import mongoq
from mongoq import MongoqError, cli

ROOT = Path(__file__).resolve().parent.parent


def _names(requirements: list[str]) -> set[str]:
    return {r.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip() for r in requirements}


def test_the_base_install_is_pymongo_and_anyio_and_the_rest_are_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _names(project["dependencies"]) == {"pymongo", "anyio"}
    extras = project["optional-dependencies"]
    assert _names(extras["embedded"]) == {"mongomock-motor", "mongomock"}
    assert _names(extras["motor"]) == {"motor"}
    assert _names(extras["metrics"]) == {"prometheus_client"}
    assert _names(extras["cron"]) == {"croniter"}
    assert _names(extras["dashboard"]) == {"starlette", "uvicorn"}
    assert _names(extras["otel"]) == {"opentelemetry-api"}
    assert _names(extras["docs"]) == {"mkdocs", "mkdocs-material", "mkdocstrings"}
    assert "mongoq-queue[embedded,motor,metrics,cron,dashboard,docs]" in extras["test"]


def test_the_distribution_is_named_apart_from_its_import_names() -> None:
    """``mongoq`` on the package index is another project; ours installs as ``mongoq-queue``
    and imports as ``mongoq`` and ``mongoq_sync``, and every missing-extra message says so."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "mongoq-queue"
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["packages"] == [
        "mongoq", "mongoq_sync",
    ]  # fmt: skip
    assert "pip install mongoq-queue" in (ROOT / "README.md").read_text()


async def test_the_dashboard_without_its_extra_names_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mongoq import cli

    # Submodules imported earlier would be found in sys.modules past a missing parent.
    for name in [m for m in sys.modules if m == "starlette" or m.startswith("starlette.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "starlette", None)
    for name in [m for m in sys.modules if m.startswith("mongoq.dashboard")]:
        monkeypatch.delitem(sys.modules, name)

    async def never(*args: object) -> None:
        raise AssertionError("the dashboard was served without its extra")

    monkeypatch.setattr(cli, "_serve_dashboard", never)
    monkeypatch.delattr(mongoq, "dashboard", raising=False)
    assert await cli.run(["dashboard", "--uri", "memory://"]) == 2
    assert "pip install 'mongoq-queue[dashboard]'" in capsys.readouterr().err


async def test_a_cron_schedule_without_the_cron_extra_names_it_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mongoq import AsyncTaskQueue
    from mongoq.testing import memory_database

    monkeypatch.setitem(sys.modules, "croniter", None)
    db = memory_database()
    queue = AsyncTaskQueue(db, "jobs")
    with pytest.raises(MongoqError, match=r"pip install 'mongoq-queue\[cron\]'"):
        await queue.schedule("nightly", cron="0 3 * * *")
    assert await queue.schedule("pulse", every=60)  # `every` needs no extra
    assert [s.name for s in await queue.schedules()] == ["pulse"]


@pytest.fixture
def without_embedded(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the embedded extra were not installed: importing mongomock_motor fails."""
    monkeypatch.setitem(sys.modules, "mongomock_motor", None)
    monkeypatch.delitem(sys.modules, "mongoq._embedded", raising=False)


@pytest.mark.usefixtures("without_embedded")
def test_connect_without_the_embedded_extra_names_it() -> None:
    wanted = r"needs the 'embedded' extra: pip install 'mongoq-queue\["
    with pytest.raises(MongoqError, match=wanted):
        mongoq.connect()
    with pytest.raises(MongoqError, match="'embedded' extra"):
        mongoq.connect("memory://")


@pytest.mark.usefixtures("without_embedded")
def test_the_demo_without_the_embedded_extra_says_so_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["demo", "--tasks", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("mongoq: error: the embedded backend")
    assert "Traceback" not in captured.err


def test_the_motor_driver_without_the_motor_extra_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "motor", None)
    monkeypatch.setitem(sys.modules, "motor.motor_asyncio", None)
    with pytest.raises(MongoqError, match=r"driver=\"motor\" needs the 'motor' extra"):
        mongoq.connect("mongodb://localhost:27017", driver="motor")


def test_a_users_script_is_type_checked_against_mongoq(tmp_path: Path) -> None:
    """Run in a folder of its own, mypy finds mongoq only through the install (the README's
    ``--config-settings editable_mode=compat``: the default editable mode hides packages from
    type checkers behind an import hook). A found mongoq shows as a real type error below."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """\
            import mongoq


            async def main() -> None:
                db: mongoq.Database = mongoq.connect("mongodb://localhost:27017")
                queue = mongoq.AsyncTaskQueue(db, "emails")
                await queue.put("t1", {"to": "a@example.com"}, priority="high")
                assert await mongoq.supports_transactions(db)
                await mongoq.close(db)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         "script.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert lines == [
        'script.py:7: error: Argument "priority" to "put" of "AsyncTaskQueue" has incompatible '
        'type "str"; expected "int"  [arg-type]'
    ], result.stdout + result.stderr


def test_the_project_metadata_names_its_authors_links_and_classifiers() -> None:
    """What the package index shows beside the name: who wrote it, where its source, docs,
    changelog and issues are, and what it is for. The licence is the SPDX expression alone:
    setuptools refuses a licence classifier beside it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["authors"] == [{"name": "The mongoq developers"}]
    assert project["license"] == "MIT"
    home = "https://github.com/mongoq/mongoq"
    urls = project["urls"]
    assert set(urls) == {"Homepage", "Documentation", "Source", "Changelog", "Issues"}
    assert all(url.startswith(home) for url in urls.values()), urls
    assert {"mongodb", "queue", "outbox"} <= set(project["keywords"])
    classifiers = project["classifiers"]
    assert {
        "Development Status :: 3 - Alpha",
        "Framework :: AsyncIO",
        "Intended Audience :: Developers",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    } <= set(classifiers)
    assert not [c for c in classifiers if c.startswith("License ::")]
    assert len(set(classifiers)) == len(classifiers)
