"""`mongoq_sync` exports the types its methods take and return, and the errors: a user of the
blocking facade annotates with ``mongoq_sync.Task`` and catches ``mongoq_sync.PermanentError``
without importing the async package, and `mypy --strict` accepts it."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mongoq
import mongoq_sync
from mongoq import errors
from mongoq_sync import _generated

FACADES = (
    mongoq_sync.TaskQueue, mongoq_sync.TaskLease, mongoq_sync.GroupTransport, mongoq_sync.Outbox,
    mongoq_sync.OutboxDispatcher, mongoq_sync.Jobs,
)  # fmt: skip


def _annotations(cls: type) -> set[str]:
    """The identifiers in the annotations of `cls`'s public methods and properties."""
    texts: list[str] = []
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        function = member.fget if isinstance(member, property) else member
        if not inspect.isfunction(function):
            continue
        texts += [str(a) for a in function.__annotations__.values()]
    return {word for text in texts for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)}


def _mongoqs(names: set[str]) -> dict[str, Any]:
    """Those of `names` that the generated module imports from mongoq (not from the standard
    library, and not the facade's own machinery)."""
    found: dict[str, Any] = {}
    for name in names:
        value = vars(_generated).get(name)
        home = getattr(value, "__module__", None) or ""
        if value is None or name in ("Facade", "in_worker_thread") or name.startswith("_"):
            continue
        if home.startswith("mongoq.") or name in ("TaskId", "GroupId", "TaskStatus"):
            found[name] = value
    return found


def test_every_mongoq_type_a_facade_method_names_is_exported() -> None:
    named = _mongoqs(set().union(*(_annotations(cls) for cls in FACADES)))
    assert {"Task", "NewTask", "TaskStats", "TaskPage", "GroupLease", "Event", "Clock"} <= set(
        named
    )
    facades = {cls.__name__ for cls in FACADES} | {"Database"}
    for name, value in named.items():
        if name in facades:
            continue
        assert name in mongoq_sync.__all__, name
        assert getattr(mongoq_sync, name) is value, name


def test_the_errors_and_the_types_inside_results_are_exported_as_mongoq_has_them() -> None:
    for name in errors.__all__:
        assert name in mongoq_sync.__all__ and getattr(mongoq_sync, name) is getattr(errors, name)
    # A page's items, named by a field rather than by a signature.
    assert "GroupInfo" in mongoq_sync.__all__ and mongoq_sync.GroupInfo is mongoq.GroupInfo
    for name in mongoq_sync.__all__:
        value = getattr(mongoq_sync, name)  # every name listed is there
        assert not name.startswith("Async"), name  # the facade has its own classes for those
        facade = name in ("Database", "connect") or value in FACADES
        if name in mongoq.__all__ and not facade:
            assert value is getattr(mongoq, name), name
    assert len(set(mongoq_sync.__all__)) == len(mongoq_sync.__all__)


def test_a_users_script_annotated_with_the_facades_types_passes_mypy_strict(
    tmp_path: Path,
) -> None:
    """Run in a folder of its own, mypy finds mongoq_sync through the install, as a user's
    type checker does (see tests/test_packaging.py)."""
    (tmp_path / "script.py").write_text(
        textwrap.dedent(
            """\
            from datetime import datetime

            import mongoq_sync


            def handle(task: mongoq_sync.Task) -> dict[str, object]:
                if not isinstance(task.payload, dict):
                    raise mongoq_sync.PermanentError(f"task {task.id}: expected a mapping")
                return {"seen": task.attempts}


            def report(stats: mongoq_sync.TaskStats, page: mongoq_sync.TaskPage) -> int:
                return stats.due + len(page.tasks)


            def batch(ids: list[mongoq_sync.TaskId]) -> list[mongoq_sync.NewTask]:
                return [mongoq_sync.NewTask(task_id, {"n": 1}) for task_id in ids]


            def main(db: mongoq_sync.Database) -> None:
                queue = mongoq_sync.TaskQueue(db, "emails")
                result: mongoq_sync.PutManyResult = queue.put_many(batch(["a", "b"]))
                summary: mongoq_sync.TaskRunSummary = queue.run(handle, stop_when_empty=True)
                status: mongoq_sync.TaskStatus = "done"
                try:
                    task = queue.wait("a", timeout=5)
                except mongoq_sync.NotFound:
                    return
                except (mongoq_sync.InvalidInput, mongoq_sync.MongoqError):
                    raise
                schedule: mongoq_sync.Schedule = queue.schedule("tick", every=60)
                since: datetime | None = task.updated_at
                print(result, summary, status, schedule, since, report(queue.stats(),
                      queue.list_tasks()))
                groups = mongoq_sync.GroupTransport(db, "orders_")
                lease: mongoq_sync.GroupLease | None = groups.claim()
                info: list[mongoq_sync.GroupInfo] = groups.list_groups().groups
                stats: mongoq_sync.GroupStats = groups.stats()
                print(lease, info, stats)


            main(mongoq_sync.connect("mongodb://localhost:27017"))
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         "script.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found in 1 source file" in result.stdout
