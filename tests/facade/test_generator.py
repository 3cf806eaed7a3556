"""tools/gen_sync.py refuses a rule that no longer fires: a spec naming a class, attribute or
constructor parameter the async core no longer has stops generation (as httpcore's unasync
fails on replacements that match nothing), instead of quietly generating a thinner facade."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen_sync() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_sync", ROOT / "tools" / "gen_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_sync"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _generate_with(
    gen_sync: ModuleType, monkeypatch: pytest.MonkeyPatch, **changes: object
) -> None:
    queue_spec = next(s for s in gen_sync.CLASSES if s.async_name == "AsyncTaskQueue")
    stale = dataclasses.replace(queue_spec, **changes)
    monkeypatch.setattr(
        gen_sync, "CLASSES", tuple(stale if s is queue_spec else s for s in gen_sync.CLASSES)
    )
    gen_sync.generate()


def test_the_specs_as_written_generate(gen_sync: ModuleType) -> None:
    generated, init = gen_sync.generate()
    assert "class TaskQueue(Facade):" in generated
    # A type alias is imported from the module that defines it, not one that merely uses it.
    assert "from mongoq.tasks.models import" in generated
    assert "from mongoq.tasks.queue import PutOutcome" not in generated
    assert "TaskQueue" in init


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"async_name": "AsyncTaskQueueOld"}, "AsyncTaskQueueOld, which no longer exists"),
        (
            {"attributes": (("name", "str"), ("lease_seconds", "float"))},
            "AsyncTaskQueue.lease_seconds, which no longer exists",
        ),
        ({"database_params": ("database",)}, "parameter 'database'"),
        ({"database_from": "source.db"}, "parameter 'source'"),
    ],
    ids=["class", "attribute", "database-parameter", "database-source"],
)
def test_a_spec_naming_what_no_longer_exists_stops_generation(
    gen_sync: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    changes: dict[str, object],
    message: str,
) -> None:
    with pytest.raises(gen_sync.GenerationError, match=message):
        _generate_with(gen_sync, monkeypatch, **changes)
