"""The ``mongoq`` command: the demo, and operator commands for task queues.

    mongoq [--log-level LEVEL] demo [--uri URI] [--tasks N] [--workers N] [--seed N]
    mongoq stats QUEUE --uri URI [--database DB]
    mongoq reclaim QUEUE --uri URI [--database DB]
    mongoq requeue QUEUE TASK_ID --uri URI [--database DB]

Printing is this module's job; the library itself only logs. Owns no collections.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from mongoq import _driver
from mongoq.demo import DemoConfig, DemoReport, run_demo
from mongoq.errors import MongoqError
from mongoq.tasks import AsyncTaskQueue

__all__ = ["main"]


def _print_report(report: DemoReport) -> None:
    print()
    print(f"{'final state':<24}{'tasks':>8}")
    for status, count in sorted(report.statuses.items()):
        print(f"  {status:<22}{count:>8}")
    print()
    rows = [
        ("rounds", report.rounds),
        ("handler runs", report.handler_runs),
        ("transient errors (retried)", report.transient_errors),
        ("tasks abandoned by crashes", report.abandoned_by_crashes),
        ("stalled writes accepted", report.zombie_writes_accepted),
        ("stalled writes rejected", report.zombie_writes_rejected),
        ("simulated time (s)", f"{report.simulated_seconds:.0f}"),
        ("wall time (s)", f"{report.wall_seconds:.1f}"),
    ]
    for label, value in rows:
        print(f"  {label:<30}{value!s:>10}")
    print()
    print("invariants")
    for label, passed in report.checks:
        print(f"  [{'ok' if passed else 'FAILED'}] {label}")


async def _operate(args: argparse.Namespace) -> int:
    db = _driver.connect(args.uri, args.database)
    queue = AsyncTaskQueue(db, args.queue)
    try:
        if args.command == "stats":
            stats = await queue.stats()
            for status, count in stats.counts.items():
                print(f"{status:<12}{count:>10}")
            print(f"{'due':<12}{stats.due:>10}")
            print(f"{'expired':<12}{stats.expired:>10}")
            print(f"oldest due age: {stats.oldest_due_age}")
        elif args.command == "reclaim":
            result = await queue.reclaim_expired()
            print(f"failed {result.failed}, requeued {result.requeued}")
        elif args.command == "requeue":
            task_id: Any = int(args.task_id) if args.int_id else args.task_id
            requeued = await queue.requeue(task_id)
            print("requeued" if requeued else "no failed task with that id")
            return 0 if requeued else 1
    finally:
        await _driver.close(db)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mongoq", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the task-queue demo (embedded backend default)")
    demo.add_argument("--uri", help="a MongoDB URI; default: the embedded in-memory backend")
    demo.add_argument("--tasks", type=int, default=DemoConfig.tasks)
    demo.add_argument("--workers", type=int, default=DemoConfig.workers)
    demo.add_argument("--seed", type=int, default=DemoConfig.seed)
    for name, text in (
        ("stats", "counts per status of a task queue"),
        ("reclaim", "bury/requeue tasks whose lease expired"),
        ("requeue", "put a failed task back to pending with fresh attempts"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("queue", help="the queue's collection name")
        if name == "requeue":
            command.add_argument("task_id")
            command.add_argument("--int-id", action="store_true", help="the id is an integer")
        command.add_argument("--uri", required=True)
        command.add_argument("--database", default="mongoq")
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="what the library logs to stderr (default: WARNING; ERROR for the demo, whose "
        "failures are staged and reported in its summary)",
    )
    args = parser.parse_args(argv)
    level = args.log_level or ("ERROR" if args.command == "demo" else "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            config = DemoConfig(
                uri=args.uri, tasks=args.tasks, workers=args.workers, seed=args.seed
            )
            report = asyncio.run(run_demo(config, progress=lambda line: print(line, flush=True)))
            _print_report(report)
            return 0 if report.ok else 1
        return asyncio.run(_operate(args))
    except MongoqError as error:  # a missing extra, a bad argument: said plainly, no traceback
        print(f"mongoq: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
