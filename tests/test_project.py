"""Project-level checks: the examples run, the code is ruff- and mypy-clean, and the library
does not import its test tools or its blocking facade.

These run the tools the test extra installs, so the README's single test command covers them.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


#: What the library's own modules must not import: the test tools (which import the library,
#: not the other way round) and the blocking facade generated from it.
FORBIDDEN_IN_LIBRARY = ("mongoq.testing", "mongoq_sync")


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` (a file under mongoq/) imports, at any depth, relative imports
    resolved; ``from package import name`` also counts as importing ``package.name``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]  # a module's package; for __init__, the package itself
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_library_imports_neither_its_test_tools_nor_its_blocking_facade() -> None:
    """Production code never imports `mongoq.testing` (only `mongoq/testing.py` is it) nor
    `mongoq_sync`: a tool tests and the demo both need lives in its own module (as
    `ManualClock` in `mongoq.clock`)."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name
            for name in _imported_modules(path)
            if any(name == bad or name.startswith(f"{bad}.") for bad in FORBIDDEN_IN_LIBRARY)
        )
        for path in sorted((ROOT / "mongoq").rglob("*.py"))
        if path != ROOT / "mongoq" / "testing.py"
    }
    assert {path: names for path, names in offenders.items() if names} == {}


#: The floor beneath the primitives: what they are built on, which imports none of them (not
#: even inside a function), so that no import arrow runs from a lower module back up.
FLOOR = [
    *sorted(p for p in (ROOT / "mongoq").glob("_*.py") if not p.name.startswith("__")),
    *(ROOT / "mongoq" / f"{name}.py" for name in ("clock", "errors", "registry")),
    *sorted((ROOT / "mongoq" / "runtime").glob("*.py")),
]
PRIMITIVES = ("mongoq.tasks", "mongoq.groups", "mongoq.outbox", "mongoq.jobs")


def test_no_module_beneath_the_primitives_imports_one() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name
            for name in _imported_modules(path)
            if any(name == up or name.startswith(f"{up}.") for up in PRIMITIVES)
        )
        for path in FLOOR
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def _private_names_of(folder: Path) -> set[str]:
    """The private names (``_x``, not dunders) the modules of `folder` define: functions,
    classes, methods, and attributes they assign (``self._x = ...``, ``_x: T``)."""
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_the_task_functions_use_no_private_name_of_the_task_queue() -> None:
    """`mongoq/jobs` runs its queues through their public members (`AsyncTaskQueue.source`):
    no private name that `mongoq/tasks` defines is imported or reached into from there, unless
    `mongoq/jobs` defines that name for itself too (and reaches it on ``self``)."""
    theirs = _private_names_of(ROOT / "mongoq" / "tasks")
    found: set[str] = set()
    for path in sorted((ROOT / "mongoq" / "jobs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mongoq.tasks"):
                found.update(f"{path.name}: {a.name}" for a in node.names if a.name in theirs)
            elif isinstance(node, ast.Attribute) and node.attr in theirs:
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not own:
                    found.add(f"{path.name}:{node.lineno}: .{node.attr}")
    assert sorted(found) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_example_runs_on_the_embedded_backend(example: Path) -> None:
    result = run(sys.executable, str(example))
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_is_clean() -> None:
    result = run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
    result = run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_demo_runs_and_its_invariants_hold() -> None:
    result = run(sys.executable, "-m", "mongoq", "demo", "--tasks", "120", "--workers", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[FAILED]" not in result.stdout
    assert result.stdout.count("[ok]") >= 7


#: A test hung in a call through the blocking facade (the call waits in the portal's thread),
#: and a test after it.
HUNG_SUITE = """
import anyio
import mongoq_sync


def test_hangs_in_the_portal():
    with mongoq_sync.connect() as database:
        database.call(anyio.sleep_forever)


def test_after_it():
    pass
"""


def hung_suite(config: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`HUNG_SUITE` under the test configuration in `config`, its time limit cut to 2 s (the
    method and the rest as configured); at most 120 s in all."""
    (tmp_path / "test_hung.py").write_text(HUNG_SUITE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(config),
         "--rootdir", str(tmp_path), "-o", "timeout=2", str(tmp_path / "test_hung.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_test_hung_in_the_blocking_facade_fails_at_its_time_limit_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(
        r.startswith("pytest-timeout") for r in config["project"]["optional-dependencies"]["test"]
    )
    assert 60 <= config["tool"]["pytest"]["ini_options"]["timeout"] <= 600
    result = hung_suite(ROOT / "pyproject.toml", tmp_path)
    assert "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
    assert "Timeout" in result.stdout, result.stdout


def _load_tool(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ci_constraints_pin_each_test_requirement_within_its_range() -> None:
    """The workflows install with .github/constraints.txt (tools/constraints.py writes it): a
    requirement of the test extra added or narrowed in pyproject.toml without the constraints
    regenerated would make the workflows' install fail."""
    tool = _load_tool("constraints")
    pinned = dict(
        line.split("==", 1)
        for line in tool.OUTPUT.read_text().splitlines()
        if line and not line.startswith("#")
    )
    for requirement in tool._project_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not in {tool.OUTPUT.name}: run tools/constraints.py"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (name, pinned[name])
