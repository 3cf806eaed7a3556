"""Run the benchmarks: ``python -m benchmarks [--uri URI] [--tasks N] [--backlogs ...] [--json]``.

Prints one line per scenario as it finishes (throughput and server commands per item) and, with
``--json``, a JSON document instead. The embedded backend is the default. ``--only peer`` runs
the side by side with mongo-taskqueue (the ``bench`` extra), also part of the default run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
from collections.abc import Awaitable
from typing import Any, cast

from benchmarks import groups, outbox, peer, slots, sync_facade, tasks
from benchmarks.harness import Result
from benchmarks.peer import Ratio, Skipped
from benchmarks.slots import SlotsResult
from benchmarks.sync_facade import Overhead

Outcome = Result | Overhead | Ratio | Skipped | SlotsResult


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--uri", help="a MongoDB URI; default: the embedded in-memory backend")
    parser.add_argument("--tasks", type=int, default=500, help="tasks per lifecycle scenario")
    parser.add_argument(
        "--backlogs", type=int, nargs="*", default=[10, 100, 1000, 5000],
        help="backlog sizes for the claim-cost scenario",
    )  # fmt: skip
    parser.add_argument(
        "--groups", type=int, nargs="*", default=[10, 100, 1000, 5000],
        help="group counts for the group claim-cost scenario",
    )  # fmt: skip
    parser.add_argument(
        "--blocked", type=int, nargs="*", default=[1000],
        help="backlog sizes behind a blocked key for the outbox claim-cost scenario",
    )  # fmt: skip
    parser.add_argument(
        "--only",
        choices=["tasks", "groups", "outbox", "slots", "sync", "peer"],
        help="run one family",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")
    args = parser.parse_args(argv)
    results: list[Outcome] = []
    runs = []
    if args.only in (None, "tasks"):
        runs += tasks.scenarios(args.tasks, args.backlogs)
    if args.only in (None, "groups"):
        runs += groups.scenarios(args.tasks, args.groups)
    if args.only in (None, "outbox"):
        runs += outbox.scenarios(args.tasks, args.blocked)
    if args.only in (None, "slots"):
        runs += slots.scenarios()
    if args.only in (None, "sync") and not args.uri:
        runs += sync_facade.scenarios()
    if args.only in (None, "peer"):
        runs += peer.scenarios(args.tasks)
    for number, (label, run) in enumerate(runs, 1):
        if not args.json:  # progress on stderr, results on stdout
            print(f"... [{number}/{len(runs)}] {label}", file=sys.stderr, flush=True)
        # A scenario returns one result, or several (the side by side: each run and the ratios).
        outcome = asyncio.run(cast(Awaitable[Outcome | list[Outcome]], run(args.uri)))
        for result in outcome if isinstance(outcome, list) else [outcome]:
            results.append(result)
            if not args.json:
                print(result.line(), flush=True)
    machine = f"{platform.machine()} {platform.python_implementation()} {platform.python_version()}"
    if not args.json:  # the table at the end: every line again, under what it ran on
        backend = "a server" if args.uri else "the embedded backend"
        print(f"\n{len(results)} results on {backend}, {machine}, {os.cpu_count()} cores:")
        for result in results:
            print(f"  {result.line()}")
    if args.json:
        document: dict[str, Any] = {
            "machine": machine,
            "results": [result.as_dict() for result in results],
        }
        print(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
