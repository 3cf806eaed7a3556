"""``python -m tests.campaign``: run the run-loop fault campaign and print one line per primitive.

    python -m tests.campaign --primitive tasks|facade|all --seeds 1000 [--first 0]
                             [--mutant NAME] [--jobs 2]

Each line counts runs, items, and the violations (lost, overlaps under a live lease, stale
settles accepted, order violations, unexpected errors, late starts); the first findings follow,
each with the arguments that rerun its seed alone. The exit status is 1 when any violation was
counted, or, with ``--mutant``, when the mutant was not caught; 2 for a mutant that does not
apply to this version of the library.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.campaign import mutants
from tests.campaign.engine import Report, run_seeds, scenario_names


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    names = scenario_names()
    parser = argparse.ArgumentParser(
        prog="python -m tests.campaign",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--primitive", choices=[*names, "all"], default="all")
    parser.add_argument("--seeds", type=int, default=50, help="runs per primitive")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--mutant",
        choices=sorted(mutants.MUTANTS),
        default=None,
        help="run with this deliberate breakage applied",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (processes)")
    return parser.parse_args(argv)


def campaign(primitive: str, seeds: range, mutant: str | None, jobs: int) -> Report:
    """Run `seeds` of `primitive`, `jobs` at a time; the merged report, timed."""
    began = time.monotonic()
    report = run_seeds(primitive, seeds, mutant, jobs)
    report.seconds = time.monotonic() - began
    return report


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.mutant is not None and not mutants.MUTANTS[args.mutant].available():
        print(f"mutant {args.mutant!r} does not apply: the code it patches is not here")
        return 2
    names = scenario_names() if args.primitive == "all" else [args.primitive]
    seeds = range(args.first, args.first + args.seeds)
    caught = True
    violations = 0
    for name in names:
        report = campaign(name, seeds, args.mutant, args.jobs)
        print(f"{report.line()} ({report.seconds:.1f} s)", flush=True)
        for line in report.described():
            print(line, flush=True)
        violations += report.violations
        caught = caught and bool(report.violations)
    if args.mutant is not None:
        print(f"mutant {args.mutant!r}: {'caught' if caught else 'NOT caught'}")
        return 0 if caught else 1
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
