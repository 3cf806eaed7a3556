"""The release, as the workflow on a tag builds it (``.github/workflows/release.yml``): an
sdist and a wheel named for the distribution and the one version in ``mongoq/_version.py``,
which pass ``twine check --strict`` and ``check-wheel-contents``, and hold both packages with
their type markers and the dashboard's static files. Built from a copy of the tree, without a
network (``--no-isolation``: the test extra brings the build backend)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from mongoq import __version__

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "site"
)


def run(*argv: str, cwd: Path) -> str:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("release") / "tree"
    shutil.copytree(ROOT, tree, ignore=LEFT_OUT)
    out = tree.parent / "dist"
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), ".", cwd=tree)
    return out


def test_the_sdist_and_the_wheel_carry_the_name_and_the_one_version(dist: Path) -> None:
    names = sorted(path.name for path in dist.iterdir())
    assert names == [
        f"mongoq_queue-{__version__}-py3-none-any.whl",
        f"mongoq_queue-{__version__}.tar.gz",
    ]


def test_twine_and_check_wheel_contents_pass(dist: Path) -> None:
    files = [str(path) for path in sorted(dist.iterdir())]
    run(sys.executable, "-m", "twine", "check", "--strict", *files, cwd=ROOT)
    wheels = [f for f in files if f.endswith(".whl")]
    run(sys.executable, "-m", "check_wheel_contents", *wheels, cwd=ROOT)


def test_the_wheel_holds_both_packages_their_markers_and_the_dashboards_files(
    dist: Path,
) -> None:
    wheel = next(dist.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        members = set(archive.namelist())
        metadata = archive.read(f"mongoq_queue-{__version__}.dist-info/METADATA").decode()
    assert {"mongoq/py.typed", "mongoq_sync/py.typed", "mongoq_sync/_generated.py"} <= members
    assert any(m.startswith("mongoq/dashboard/static/") for m in members)
    assert not any(m.startswith(("tests/", "benchmarks/", "tools/")) for m in members)
    assert f"Version: {__version__}" in metadata and "Name: mongoq-queue" in metadata
    assert "Project-URL: Documentation" in metadata and "License-Expression: MIT" in metadata
    sdist = next(dist.glob("*.tar.gz"))
    with tarfile.open(sdist) as archive:
        assert f"mongoq_queue-{__version__}/README.md" in archive.getnames()


WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
PINNED = re.compile(r"^[\w.-]+/[\w.-]+@[0-9a-f]{40}  # v\d+(\.\d+)*$")


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.name for w in WORKFLOWS])
def test_each_workflow_pins_its_actions_by_commit_and_reads_by_default(workflow: Path) -> None:
    """What the workflows hold to (no linter for them runs here): YAML that parses, read-only
    permissions at the top (a job asks for more itself), each action pinned by commit with its
    tag beside it, a time limit on every job."""
    text = workflow.read_text()
    config = yaml.safe_load(text)
    assert config["permissions"] == {"contents": "read"}
    assert config.get(True) or config.get("on")  # YAML 1.1 reads the key `on` as True
    for name, job in config["jobs"].items():
        assert "timeout-minutes" in job, f"{workflow.name}: job {name} has no time limit"
        for step in job.get("steps", []):
            assert "uses" not in step or "@" in step["uses"], step
    for line in text.splitlines():
        if line.strip().startswith(("- uses:", "uses:")):
            assert PINNED.match(line.split("uses:", 1)[1].strip()), line


def test_the_release_workflow_builds_checks_and_publishes_on_a_version_tag() -> None:
    config = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    assert config[True] == {"push": {"tags": ["v*"]}}
    build, publish = config["jobs"]["build"], config["jobs"]["publish"]
    commands = "\n".join(step.get("run", "") for step in build["steps"])
    for needed in ("mongoq/_version.py", "python -m build", "twine check --strict",
                   "check_wheel_contents"):  # fmt: skip
        assert needed in commands, needed
    assert publish["needs"] == "build" and publish["permissions"] == {"id-token": "write"}
    assert publish["steps"][-1]["uses"].startswith("pypa/gh-action-pypi-publish@")
