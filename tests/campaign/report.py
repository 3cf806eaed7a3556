"""The campaign's counts: a `Report` per primitive (runs, items, each violation counter) and
its first `Finding`s, each with the seed that reruns it; what every run returns and what the
command line prints."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["COUNTERS", "KEPT", "Finding", "Report", "error_text"]

#: The violation counters, by key, with the words the summary line uses.
COUNTERS = {
    "lost": "lost",
    "overlaps": "overlaps under a live lease",
    "stale_settles": "stale settles accepted",
    "order_violations": "order violations",
    "unexpected_errors": "unexpected errors",
    "late_starts": "late starts",
    "set_aside": "poisoned documents mishandled",
    "runaways": "runaway handlers kept",
}
#: Findings kept per counter (the lowest seeds): enough to rerun, few enough to read.
KEPT = 3


@dataclass(frozen=True)
class Finding:
    seed: int
    counter: str
    text: str


@dataclass
class Report:
    """Counts of one primitive over any number of runs, and the first findings of each kind."""

    primitive: str
    runs: int = 0
    items: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    findings: list[Finding] = field(default_factory=list)
    #: seeds of the runs with any violation, in order
    seeds: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def violations(self) -> int:
        return sum(self.counts.values())

    def count(self, finding: Finding) -> None:
        self.counts[finding.counter] += 1
        if sum(1 for kept in self.findings if kept.counter == finding.counter) < KEPT:
            self.findings.append(finding)
        if finding.seed not in self.seeds:
            self.seeds.append(finding.seed)

    def merge(self, other: Report) -> None:
        self.runs += other.runs
        self.items += other.items
        self.seconds += other.seconds
        for key, value in other.counts.items():
            self.counts[key] += value
        self.seeds = sorted({*self.seeds, *other.seeds})
        findings = sorted([*self.findings, *other.findings], key=lambda f: f.seed)
        self.findings = []
        for finding in findings:
            if sum(1 for kept in self.findings if kept.counter == finding.counter) < KEPT:
                self.findings.append(finding)

    def line(self) -> str:
        counted = ", ".join(f"{COUNTERS[key]} {self.counts[key]}" for key in COUNTERS)
        return f"{self.primitive}: runs {self.runs}, items {self.items}, {counted}"

    def described(self, limit: int = 8) -> list[str]:
        """The first findings, each with the command that reruns its seed."""
        lines = []
        for finding in sorted(self.findings, key=lambda f: (f.seed, f.counter))[:limit]:
            rerun = f"--primitive {self.primitive} --first {finding.seed} --seeds 1"
            lines.append(f"  seed {finding.seed}: {finding.text}  [rerun: {rerun}]")
        return lines


def error_text(exc: BaseException) -> str:
    """``Type: message at file:line``, the line the library's own deepest frame was at (where
    it called what raised, or raised itself), else the deepest frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/mongoq/" in f.filename and "testing.py" not in f.filename]
    chosen = ours or frames
    where = f" at {Path(chosen[-1].filename).name}:{chosen[-1].lineno}" if chosen else ""
    return f"{type(exc).__name__}: {exc}{where}"
