"""The README and the documentation site: the README stays one screen's worth, every Python
block in it and in ``docs/`` runs (a block that includes a file of ``examples/`` is run by
``tests/test_project.py``'s example test), and ``mkdocs build --strict`` passes, so a broken
link, include or API reference fails the suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\n```text\n(.*?)^```\n)?", re.S | re.M)
INCLUDE = re.compile(r'--8<-- "([^"]+)"')


def python_blocks(page: Path) -> list[tuple[str, str | None]]:
    """Each ```python block of `page`, with the ```text block right after it (its output)."""
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(page.read_text())]


def run_script(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`code` as a script of its own, on the embedded backend (no ``MONGOQ_URI``)."""
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "MONGOQ_URI"}
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, f"{code}\n--- stderr:\n{result.stderr}"
    return result


def test_the_readme_is_one_screen_of_a_newcomers_reading() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    for page in [README, *PAGES]:
        text = page.read_text()
        assert "../shared" not in text and "seed document" not in text, page


README_BLOCKS = python_blocks(README)


@pytest.mark.parametrize("number", range(len(README_BLOCKS)))
def test_each_python_block_of_the_readme_runs_and_prints_what_it_shows(
    number: int, tmp_path: Path
) -> None:
    code, shown = README_BLOCKS[number]
    result = run_script(code, tmp_path)
    if shown is not None:
        assert result.stdout == shown


def test_the_readmes_quick_start_is_the_docs_quick_start() -> None:
    quick_start = README_BLOCKS[0][0]
    assert (ROOT / "examples" / "quickstart.py").read_text() == quick_start


DOC_BLOCKS = [
    (page, code)
    for page in PAGES
    for code, _ in python_blocks(page)
    if not INCLUDE.fullmatch(code.strip())
]


@pytest.mark.parametrize(
    ("page", "code"), DOC_BLOCKS, ids=[f"{p.name}-{n}" for n, (p, _) in enumerate(DOC_BLOCKS)]
)
def test_each_inline_python_block_of_the_docs_runs(page: Path, code: str, tmp_path: Path) -> None:
    run_script(code, tmp_path)


def test_each_included_block_of_the_docs_is_an_example_the_suite_runs() -> None:
    included = [
        INCLUDE.fullmatch(code.strip()) for page in PAGES for code, _ in python_blocks(page)
    ]
    paths = [m.group(1) for m in included if m is not None]
    assert paths, "no page includes an example"
    for path in paths:
        assert path.startswith("examples/") and (ROOT / path).is_file(), path


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "api" / "tasks" / "index.html").is_file()
    assert "AsyncTaskQueue" in (tmp_path / "api" / "tasks" / "index.html").read_text()
