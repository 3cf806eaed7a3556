"""``mongoq worker module:attribute``: one process running every task function of a `Jobs`.

It imports the `Jobs` named (``app.tasks:jobs``; the current directory is on the import path),
connects it to ``--uri`` / ``MONGOQ_URI``, sets its queues up, and runs them until SIGTERM or
SIGINT (the first drains: in-flight tasks finish; a second stops at once, releasing them).
``--ready-file PATH`` is written once its queues are set up and it starts claiming, and
removed when it stops: a container's readiness probe tests for it. Exit codes: 0 after a stop,
2 for an error (one line on stderr: the target cannot be imported or is no `Jobs`, no server,
a bad option). Owns no collections.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mongoq import _driver
from mongoq.errors import MongoqError
from mongoq.jobs.registry import Jobs
from mongoq.runtime import handler

__all__ = ["add_worker_arguments", "load_jobs", "worker"]

log = logging.getLogger("mongoq.jobs")


def add_worker_arguments(sub: argparse.ArgumentParser, positive: Any, batch: Any) -> None:
    """The ``worker`` command's own options (`positive` and `batch` parse numbers)."""
    options: list[tuple[str, dict[str, Any]]] = [
        ("target", {"metavar": "MODULE:ATTRIBUTE", "help": "the Jobs to run: app.tasks:jobs"}),
        ("--concurrency", {"type": positive, "default": 8,
                           "help": "tasks run at once, over every queue (default: 8)"}),
        ("--queues", {"nargs": "+", "metavar": "QUEUE",
                      "help": "only these queues (default: every declared function's)"}),
        ("--batch-size", {"type": batch, "default": 1,
                          "help": "tasks one claim takes (default: 1)"}),
        ("--metrics-port", {"type": int, "metavar": "PORT",
                            "help": "Prometheus metrics on PORT (the metrics extra)"}),
        ("--metrics-addr", {"default": "127.0.0.1", "metavar": "ADDR",
                            "help": "the metrics' address (default: 127.0.0.1, this machine "
                            "only; 0.0.0.0 or :: is every interface)"}),
        ("--ready-file", {"type": Path, "metavar": "PATH",
                          "help": "written while the worker runs (a readiness probe)"}),
        ("--in-process", {"action": "store_true",
                          "help": "allow the embedded backend (a demo of one process)"}),
    ]  # fmt: skip
    for flag, spec in options:
        sub.add_argument(flag, **spec)


def load_jobs(target: str) -> Jobs:
    """The `Jobs` ``module:attribute`` names; `MongoqError` saying what is wrong otherwise."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise MongoqError(f"worker: {target!r} is not MODULE:ATTRIBUTE (e.g. app.tasks:jobs)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the project's own modules
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise MongoqError(f"worker: cannot import {module_name!r}: {error}") from None
    if not hasattr(module, attribute):
        found = sorted(name for name, value in vars(module).items() if isinstance(value, Jobs))
        raise MongoqError(
            f"worker: module {module_name!r} has no attribute {attribute!r}; its mongoq.Jobs: "
            + (", ".join(found) if found else "none (declare one: jobs = mongoq.Jobs())")
        )
    jobs = getattr(module, attribute)
    if not isinstance(jobs, Jobs):
        raise MongoqError(f"worker: {target} is {type(jobs).__name__}, not a mongoq.Jobs")
    return jobs


async def worker(args: argparse.Namespace, uri: str | None) -> int:
    """Run the worker `args` describe until stopped; its exit code."""
    jobs = load_jobs(args.target)
    if args.ready_file is not None:
        args.ready_file.unlink(missing_ok=True)  # one a killed worker left: not ready yet
    db = _driver.connect(uri, args.database, timeout=args.timeout)
    try:
        if _driver.backend_of(db) is _driver.Backend.MEMORY and not args.in_process:
            raise MongoqError(
                "worker: no --uri nor MONGOQ_URI: on the embedded backend only this process "
                "would see its tasks; point it at your server (--uri mongodb://HOST), or pass "
                "--in-process for a demo"
            )
        jobs.use(db)
        await jobs.setup(args.queues)
        with _metrics(args.metrics_port, args.metrics_addr), _ready(args.ready_file):
            summary = await jobs.run(
                queues=args.queues, concurrency=args.concurrency, batch_size=args.batch_size,
                handle_signals=True,
            )  # fmt: skip
        log.info("worker stopped: %s", summary)
    finally:
        await _driver.close(db)
    if handler.abandoned:
        # asyncio.run would wait for them at its end, for ever if they never end.
        log.warning("worker: exiting with %d abandoned handler(s) still running",
                    len(handler.abandoned))  # fmt: skip
        exit_now(0)
    return 0


def exit_now(code: int) -> None:
    """End the process at once with `code`, leaving its tasks behind: its logs, its output and
    its tracer's spans flushed first (no ``atexit`` hook runs: one may wait for the very
    threads an abandoned call holds)."""
    _flush_spans()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _flush_spans() -> None:
    """The spans an OpenTelemetry SDK still buffers, exported (bounded by the SDK)."""
    trace = sys.modules.get("opentelemetry.trace")
    flush = getattr(trace.get_tracer_provider(), "force_flush", None) if trace else None
    if flush is not None:
        with contextlib.suppress(Exception):
            flush()


@contextlib.contextmanager
def _metrics(port: int | None, addr: str) -> Iterator[None]:
    """`RunMetrics` on ``http://addr:port/metrics`` while the worker runs (nothing for None)."""
    if port is None:
        yield
        return
    with _driver.extra_required("metrics", "--metrics-port"):
        from prometheus_client import start_http_server

        from mongoq.metrics import RunMetrics
    with RunMetrics():
        server, thread = start_http_server(port, addr)
        try:
            yield
        finally:
            server.shutdown()
            thread.join(timeout=5)


@contextlib.contextmanager
def _ready(path: Path | None) -> Iterator[None]:
    if path is not None:
        path.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
