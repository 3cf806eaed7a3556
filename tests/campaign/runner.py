"""How the campaign's runs are run: finding the scenario modules (`scenario_names`,
`scenario`), running seeds (`run_seeds`, `until_caught`), each in a process of its own forked
from one idle process (`jobs` at a time), and what makes a seed's run repeat: `seed_library`
(the library's random streams, the order of its wake-ups, per-process facts forgotten) and
`repeatable` (no garbage collection in the middle of a run)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import os
import pickle
import pkgutil
import random
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

from tests.campaign import mutants
from tests.campaign.report import Finding, Report, error_text

__all__ = [
    "Primitive",
    "primitives",
    "repeatable",
    "run_async",
    "run_seeds",
    "scenario",
    "scenario_names",
    "seed_library",
    "until_caught",
]


class _InsertionOrdered(set[Any]):
    """A set that iterates in insertion order (a plain set of objects iterates in the order of
    their memory addresses, which differ from one process to the next)."""

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self._order = dict.fromkeys(items)

    def add(self, item: Any) -> None:
        super().add(item)
        self._order[item] = None

    def discard(self, item: Any) -> None:
        super().discard(item)
        self._order.pop(item, None)

    def remove(self, item: Any) -> None:
        super().remove(item)
        self._order.pop(item, None)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._order))


class _OrderedListeners(dict[Any, Any]):
    """The library's same-process wake-up listeners, each key's set insertion-ordered: one
    put wakes every worker's loop, and the order they claim in is then the seed's."""

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = _InsertionOrdered(default or ())
        return self[key]


def _orderly_wakeups() -> None:
    wakeups = sys.modules.get("mongoq.runtime.wakeups")
    listeners = getattr(wakeups, "_listeners", None)
    if isinstance(listeners, dict) and not isinstance(listeners, _OrderedListeners):
        ordered = _OrderedListeners({k: _InsertionOrdered(v) for k, v in listeners.items()})
        wakeups._listeners = ordered  # type: ignore[union-attr]


def seed_library(seed: int) -> None:
    """Make a run of `seed` repeat: seed the random streams the library draws from (the global
    one for retry jitter, and any `random.Random` a ``mongoq`` module keeps, such as the
    batched claim's pick among contended candidates); iterate the wake-up listeners in the
    order they registered; forget per-process facts keyed by object ids (below)."""
    random.seed(seed)
    _orderly_wakeups()
    # Where change streams are missing is remembered per client id; a later run's client may
    # reuse an earlier one's id, and then its loops would skip a step this run's loops take.
    changes = sys.modules.get("mongoq.runtime.changes")
    unsupported = getattr(changes, "_unsupported", None)
    if isinstance(unsupported, set):
        unsupported.clear()
    for name, module in sorted(sys.modules.items()):
        if name != "mongoq" and not name.startswith("mongoq."):
            continue
        for attribute, value in sorted(vars(module).items()):
            if type(value) is random.Random:
                value.seed(f"{seed}:{name}.{attribute}")


class Primitive(Protocol):
    """What a scenario module exposes as ``PRIMITIVE``."""

    name: str

    def run(self, seed: int) -> Report: ...


_NOT_SCENARIOS = frozenset({"engine", "faults", "mutants", "report", "runner", "__main__"})


def scenario_names() -> list[str]:
    """The scenario modules of this package: those with a top-level ``PRIMITIVE = ...`` (named
    as the module), found by reading them, not importing them."""
    folder = Path(__file__).parent
    return sorted(
        module.name
        for module in pkgutil.iter_modules([str(folder)])
        if module.name not in _NOT_SCENARIOS
        and not module.name.startswith("test")
        and "\nPRIMITIVE = " in (folder / f"{module.name}.py").read_text()
    )


def scenario(name: str) -> Primitive:
    """The ``PRIMITIVE`` of scenario module `name` (imported now)."""
    primitive: Primitive = importlib.import_module(f"{__package__}.{name}").PRIMITIVE
    return primitive


def primitives() -> dict[str, Primitive]:
    """Every scenario of this package, by name (imports them all)."""
    return {name: scenario(name) for name in scenario_names()}


def run_seeds(
    primitive: str, seeds: Sequence[int], mutant: str | None = None, jobs: int = 1
) -> Report:
    """Run `primitive` for every seed (under `mutant`, if named), `jobs` at a time; the
    merged report."""
    report = Report(primitive)
    with mutants.applied(mutant):
        for part in _runs(scenario(primitive), seeds, jobs):
            report.merge(part)
    return report


def until_caught(
    primitive: str, mutant: str, limit: int, jobs: int = 1
) -> tuple[int | None, Report]:
    """Run seeds 0, 1, ... (`jobs` at a time) under `mutant` until one shows a violation, at
    most `limit` of them; the seed that did (None: none did) and the report so far."""
    report = Report(primitive)
    with mutants.applied(mutant):
        for part in _runs(scenario(primitive), range(limit), jobs):
            report.merge(part)
            if part.violations:
                return part.seeds[0], report
    return None, report


def _runs(scenario: Primitive, seeds: Sequence[int], jobs: int = 1) -> Iterator[Report]:
    """Each seed's report (in the order the runs end), each run in a process of its own
    forked from one idle process, `jobs` at a time, so that every run starts from the same
    process state whatever ran before it: what a run does may depend on the order in which
    sets of objects iterate (anyio's cancel scopes, the loops' naps), that is on memory
    addresses, that is on the process's history. A seed then runs alike alone (``--first S
    --seeds 1``) and anywhere in a long campaign. Without fork, the runs share this process."""
    if not hasattr(os, "fork"):
        yield from (scenario.run(seed) for seed in seeds)
        return
    folder = tempfile.mkdtemp(prefix="campaign-")
    read, write = os.pipe()
    zygote = os.fork()
    if zygote == 0:  # pragma: no cover - the idle process
        os.close(read)
        os.setpgid(0, 0)
        _spawn_each(scenario, seeds, max(1, jobs), folder, write)
    os.close(write)
    finished = False
    try:
        with os.fdopen(read, "rb") as ended:
            while seed := ended.read(8):
                path = Path(folder, f"{int.from_bytes(seed, 'big')}.report")
                yield pickle.loads(path.read_bytes())
                path.unlink()
        finished = True
    finally:
        if not finished:  # the caller stopped early: stop the runs still going
            with contextlib.suppress(ProcessLookupError):
                os.killpg(zygote, 9)
        os.waitpid(zygote, 0)
        shutil.rmtree(folder, ignore_errors=True)


def _spawn_each(
    scenario: Primitive, seeds: Sequence[int], jobs: int, folder: str, write: int
) -> NoReturn:
    """The idle process: a child per seed, `jobs` at a time; it allocates next to nothing
    between two forks."""
    running = 0
    for seed in seeds:
        if running == jobs:
            os.wait()
            running -= 1
        if os.fork() == 0:
            _run_child(scenario, seed, folder, write)
        running += 1
    while running:
        os.wait()
        running -= 1
    os._exit(0)


def _run_child(scenario: Primitive, seed: int, folder: str, write: int) -> NoReturn:
    try:
        report = scenario.run(seed)
    except BaseException as exc:  # a run that raised is itself a finding
        report = Report(scenario.name, runs=1)
        report.count(Finding(seed, "unexpected_errors", f"the run raised {error_text(exc)}"))
    Path(folder, f"{seed}.report").write_bytes(pickle.dumps(report))
    os.write(write, seed.to_bytes(8, "big"))  # one small write: never torn
    os._exit(0)


@contextlib.contextmanager
def repeatable() -> Iterator[None]:
    """Around one run: the garbage of earlier runs is collected first, and no collection runs
    meanwhile. A collection in the middle of a run (when one comes depends on everything the
    process did before) finalizes leftovers such as abandoned async generators, whose clean-up
    tasks would add steps to this run's event loop."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_async(main: Callable[[], Awaitable[Report]]) -> Report:
    """Run one async scenario in a fresh event loop (`repeatable`)."""

    async def wrapped() -> Report:
        return await main()

    with repeatable():
        return asyncio.run(wrapped())
