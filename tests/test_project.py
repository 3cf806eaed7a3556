"""Project-level checks: the examples run, and the code is ruff- and mypy-clean.

These run the tools the test extra installs, so the README's single test command covers them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


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
