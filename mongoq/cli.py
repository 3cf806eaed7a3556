"""The ``mongoq`` command (also ``python -m mongoq``): operate the three primitives, export their
metrics, run the demo.

    mongoq list
    mongoq tasks stats QUEUE
    mongoq tasks list QUEUE [--status S] [--limit N] [--after CURSOR]
    mongoq tasks get QUEUE TASK_ID [--int-id]
    mongoq tasks requeue QUEUE (TASK_ID ... | --all-failed) [--int-ids]
    mongoq tasks cancel QUEUE TASK_ID ... [--int-ids]
    mongoq tasks schedules QUEUE
    mongoq tasks unschedule QUEUE NAME
    mongoq tasks purge QUEUE --status done|failed|cancelled|tombstone --older-than AGE
    mongoq tasks reclaim QUEUE [--max-attempts N]
    mongoq groups stats PREFIX
    mongoq groups list PREFIX [--state S] [--limit N] [--after CURSOR]
    mongoq groups dead-letters PREFIX [--group G [--int-group]] [--limit N]
    mongoq groups redrive PREFIX (SEQ ... | --group G [--int-group] | --all) [--limit N]
    mongoq outbox stats [--prefix P] [--completion-history]
    mongoq outbox list [--prefix P] [--status S] [--handler H] [--event-type T] [--limit N]
    mongoq outbox requeue EVENT_ID HANDLER [--prefix P]
    mongoq outbox purge [--prefix P] [--dead-older-than AGE] [--completed-older-than AGE]
    mongoq metrics [--port 9108] [--addr 127.0.0.1] [--tasks NAME ...] [--groups P ...]
                   [--outbox P ...]
    mongoq dashboard [--host 127.0.0.1] [--port 8188] [--allow-actions] [--token T]
                     [--allowed-host NAME ...] [--sample-interval S]
    mongoq worker MODULE:ATTRIBUTE [--concurrency N] [--queues Q ...] [--batch-size N]
                  [--metrics-port P [--metrics-addr 127.0.0.1]] [--ready-file PATH]
                  [--in-process]
    mongoq demo [--tasks N] [--workers N] [--batch-size N] [--seed N]
                [--dashboard [--host H] [--port P]]

Global options, before or after the command: ``--uri`` (``MONGOQ_URI``; else the embedded
backend), ``--database`` (``MONGOQ_DATABASE``, mongoq), ``--timeout`` (``MONGOQ_TIMEOUT``, 5 s),
``--json``, ``--log-level``; ``--version``. See `EPILOG` for the exit codes.
Printing is this module's job; the library itself only logs. Owns no collections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn
from urllib.parse import unquote, unquote_plus

import anyio
from pymongo.errors import PyMongoError

from mongoq import __version__, _driver, registry
from mongoq._text import format_age as _age
from mongoq._text import mask_uri_credentials, one_line, parse_age
from mongoq._text import plain as _plain
from mongoq._validation import MAX_BATCH
from mongoq.clock import ManualClock
from mongoq.demo import (
    DEMO_DATABASE,
    DemoConfig,
    DemoReport,
    demo_queue_name,
    drop_demo,
    run_demo,
)
from mongoq.errors import MongoqError
from mongoq.groups import AsyncGroupTransport
from mongoq.groups.models import NEVER_CLAIMED
from mongoq.jobs.command import add_worker_arguments, worker
from mongoq.outbox import AsyncOutbox
from mongoq.tasks import AsyncTaskQueue
from mongoq.tasks.models import STATUSES
from mongoq.tasks.operators import UNKNOWN_READ
from mongoq.tasks.schema import PURGEABLE

__all__ = ["main", "redact", "run", "scrub"]

GROUP_STATES = ("ready", "in_flight", "parked")
DELIVERY_STATUSES = ("pending", "parked", "dead", "completed")
#: Wall-clock seconds between the demo's rounds under ``--dashboard``: a chart that moves.
DEMO_ROUND_PAUSE = 0.5
#: Seconds the demo waits, at most, to drop its queue when it stops.
DEMO_DROP_WAIT = 10.0
#: The widest a free-text cell (an error) is printed in a table.
CELL_WIDTH = 60
EPILOG = (
    "global options go before or after the command; AGE is seconds or 30s, 15m, 12h, 7d\n"
    "exit codes: 0 done, 1 nothing to requeue/redrive/cancel (or no such task), 2 error, "
    "130 interrupted"
)


class UsageError(Exception):
    """A command line that asks for nothing sensible; `prog` names the (sub)command."""

    def __init__(self, message: str, prog: str = "mongoq") -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``mongoq tasks list: error: ...``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)", self.prog)


# ------------------------------------------------------------------------- credentials


def _split(uri: str) -> tuple[str, str, str, str]:
    """``scheme, userinfo, hosts, rest`` as PyMongo splits a URI (at the first ``/``, then the
    last ``@``); an ``@`` only further on (an unescaped ``/`` in a password) masks up to it."""
    scheme, sep, body = uri.partition("://")
    if not sep:
        return "", "", uri, ""
    head, slash, tail = body.partition("/")
    if "@" not in head and "@" in body:
        userinfo, _, after = body.rpartition("@")
        head, slash, tail = after.partition("/")
        return scheme, userinfo, head, slash + tail
    userinfo, _, head = head.rpartition("@")
    return scheme, userinfo, head, slash + tail


_SECRET_OPTION = re.compile(r"(?i)([?&;][^=&;]*(?:password|secret|token)[^=&;]*=)[^&;]*")
_MASK = r"\1***"


def redact(uri: str) -> str:
    """`uri` without credentials: the user and password become ``***``, and so do the values
    of options naming a password, secret or token (``tlsCertificateKeyFilePassword``)."""
    scheme, userinfo, hosts, rest = _split(uri)
    if not scheme:
        return uri
    masked = "***@" if userinfo else ""
    return f"{scheme}://{masked}{hosts}{_SECRET_OPTION.sub(_MASK, rest)}"


def scrub(text: str, uri: str | None) -> str:
    """`text` (a driver's error message) with the credentials of `uri`, as written and
    percent-decoded, and the user part of any URI in it replaced by ``***``."""
    text = mask_uri_credentials(text)
    if not uri:
        return text
    userinfo = _split(uri)[1]
    secrets = {userinfo, *userinfo.split(":", 1)}
    secrets |= {m.group(0).split("=", 1)[1] for m in _SECRET_OPTION.finditer(uri)}
    secrets |= {decode(s) for s in tuple(secrets) for decode in (unquote, unquote_plus)}
    # Under four characters a secret is masked only where it stands in a URI (above): masking
    # every "u" of a message garbles it, and a password that short guards nothing anyway.
    for secret in sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


# ---------------------------------------------------------------------------- printing


def _line(text: str, width: int = CELL_WIDTH) -> str:
    return one_line(text, width)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):  # to the second, in UTC
        utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str | int):
        return _line(str(value))
    return _line(json.dumps(_plain(value)))


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], empty: str) -> list[str]:
    cells = [list(headers)] + [[_cell(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return lines if len(cells) > 1 else [empty]


def _pairs(rows: Sequence[tuple[str, Any]]) -> list[str]:
    width = max(len(label) for label, _ in rows)
    return [f"{label:<{width}}  {_cell(value)}" for label, value in rows]


@dataclass(frozen=True)
class Out:
    """What an operator command shows: `data` under ``--json``, else the lines of `text`."""

    data: Any
    text: list[str]
    code: int = 0


def _duration(text: str) -> float:
    seconds = parse_age(text)
    if seconds is None:
        raise argparse.ArgumentTypeError(f"expected seconds or 30s, 15m, 12h, 7d; got {text!r}")
    return seconds


# ----------------------------------------------------------------------------- tasks


def _ids(texts: list[str], integers: bool, name: str) -> list[Any]:
    """Ids as given, or as integers (``--int-id``): a stored 7 and "7" are different ids."""
    try:
        return [int(text) for text in texts] if integers else texts
    except ValueError:
        raise UsageError(f"{name}: expected integers, got {' '.join(texts)}") from None


def _queue(args: argparse.Namespace, db: Any) -> AsyncTaskQueue:
    return AsyncTaskQueue(db, args.queue, max_attempts=getattr(args, "max_attempts", 5))


def _found(count: int | bool, done: str, nothing: str, data: Any) -> Out:
    """A requeue's or a redrive's outcome: exit code 1 when it found nothing to do."""
    return Out(data, [done if count else nothing], 0 if count else 1)


async def _tasks_stats(args: argparse.Namespace, db: Any) -> Out:
    stats = await _queue(args, db).stats()
    rows = [*stats.counts.items(), ("due", stats.due), ("expired", stats.expired)]
    text = _pairs([*rows, ("oldest due age", _age(stats.oldest_due_age))])
    return Out(stats, text + _unknown_lines(stats.unknown_functions, stats.due))


def _unknown_lines(unknown: dict[str, int], due: int) -> list[str]:
    """A line per task function no running worker runs, the most waiting first."""
    bound = "at least " if due > UNKNOWN_READ else ""  # counted among the oldest due only
    return [
        f"waiting for unknown function {_line(repr(name))}: {bound}{n}" if name else
        f"waiting without a function (plain tasks: no Jobs worker runs them): {bound}{n}"
        for name, n in sorted(unknown.items(), key=lambda item: (-item[1], item[0]))
    ]  # fmt: skip


async def _tasks_list(args: argparse.Namespace, db: Any) -> Out:
    page = await _queue(args, db).list_tasks(args.status, limit=args.limit, after=args.after)
    text = _table(
        ["ID", "STATUS", "ATTEMPTS", "PRIORITY", "UPDATED", "LEASE UNTIL", "WORKER", "ERROR"],
        [[t.id, t.status, t.attempts, t.priority, t.updated_at, t.lease_until, t.worker_id,
          t.error] for t in page.tasks],
        "no tasks",
    )  # fmt: skip
    return Out(page, text + ([f"next: --after {page.next}"] if page.next else []))


async def _tasks_get(args: argparse.Namespace, db: Any) -> Out:
    task = await _queue(args, db).get(_ids([args.task_id], args.int_id, "TASK_ID")[0])
    if task is None:
        return Out(None, [f"no task {args.task_id!r} in {args.queue}"], 1)
    rows = [(f.name, getattr(task, f.name)) for f in fields(task) if f.name != "error"]
    return Out(task, _pairs(rows) + (["error:", task.error] if task.error else ["error  -"]))


async def _tasks_requeue(args: argparse.Namespace, db: Any) -> Out:
    if bool(args.task_ids) == args.all_failed:
        raise UsageError("name the task ids to requeue, or pass --all-failed (not both)")
    ids = _ids(args.task_ids, args.int_ids, "TASK_ID")
    n = await _queue(args, db).requeue_failed(ids or None)
    return _found(n, f"requeued {n} failed task(s)", "no failed task to requeue", {"requeued": n})


async def _tasks_cancel(args: argparse.Namespace, db: Any) -> Out:
    queue = _queue(args, db)
    ids = _ids(args.task_ids, args.int_ids, "TASK_ID")
    cancelled = [task_id for task_id in ids if await queue.cancel(task_id)]
    n = len(cancelled)
    return _found(n, f"cancelled {n} task(s)", "no pending or running task to cancel",
                  {"cancelled": n})  # fmt: skip


async def _tasks_schedules(args: argparse.Namespace, db: Any) -> Out:
    schedules = await _queue(args, db).schedules()
    text = _table(
        ["NAME", "WHEN", "TIME ZONE", "MISSED", "NEXT", "LAST TICK", "PRIORITY"],
        [[s.name, s.cron if s.cron is not None else f"every {_age(s.every)}", s.timezone,
          s.missed, s.next_at, s.last_tick, s.priority] for s in schedules],
        "no schedules",
    )  # fmt: skip
    return Out(schedules, text)


async def _tasks_unschedule(args: argparse.Namespace, db: Any) -> Out:
    removed = await _queue(args, db).unschedule(args.name)
    return _found(removed, f"removed schedule {args.name!r}", f"no schedule {args.name!r}",
                  {"removed": removed})  # fmt: skip


async def _tasks_purge(args: argparse.Namespace, db: Any) -> Out:
    n = await _queue(args, db).purge(args.status, args.older_than)
    age = _age(args.older_than)
    return Out({"purged": n}, [f"purged {n} {args.status} task(s) last changed over {age} ago"])


async def _tasks_reclaim(args: argparse.Namespace, db: Any) -> Out:
    result = await _queue(args, db).reclaim_expired()
    text = f"expired leases: {result.failed} task(s) failed, {result.requeued} requeued"
    return Out(result, [text])


# ---------------------------------------------------------------------------- groups


def _group_id(args: argparse.Namespace) -> Any:
    return None if args.group is None else _ids([args.group], args.int_group, "--group")[0]


async def _groups_stats(args: argparse.Namespace, db: Any) -> Out:
    stats = await AsyncGroupTransport(db, args.prefix).stats()
    return Out(stats, _pairs([
        ("ready", stats.ready), ("in flight", stats.in_flight), ("parked", stats.parked),
        ("messages", stats.messages), ("dead letters", stats.dead),
        ("oldest message age", _age(stats.oldest_message_age)),
    ]))  # fmt: skip


async def _groups_list(args: argparse.Namespace, db: Any) -> Out:
    transport = AsyncGroupTransport(db, args.prefix)
    page = await transport.list_groups(args.state, limit=args.limit, after=args.after)
    text = _table(
        ["GROUP", "STATE", "PRIORITY", "AVAILABLE AT", "HEAD", "HEAD AGE", "DELIVERIES", "ERROR"],
        [[g.group_id, g.state, g.priority,
          None if g.available_at == NEVER_CLAIMED else g.available_at,  # never claimed: "-"
          g.head_seq, _age(g.head_age), g.head_deliveries, g.head_error] for g in page.groups],
        "no groups",
    )  # fmt: skip
    return Out(page, text + ([f"next: --after {page.next}"] if page.next else []))


async def _groups_dead_letters(args: argparse.Namespace, db: Any) -> Out:
    transport = AsyncGroupTransport(db, args.prefix)
    letters = await transport.dead_letters(group_id=_group_id(args), limit=args.limit)
    return Out({"dead_letters": letters}, _table(
        ["SEQ", "GROUP", "PRIORITY", "DELIVERIES", "PUBLISHED", "DEAD AT", "ERROR"],
        [[d.seq, d.group_id, d.priority, d.deliveries, d.published_at, d.dead_at, d.error]
         for d in letters],
        "no dead letters",
    ))  # fmt: skip


async def _groups_redrive(args: argparse.Namespace, db: Any) -> Out:
    if [bool(args.seqs), args.group is not None, args.all].count(True) != 1:
        raise UsageError("choose the dead letters: SEQ ..., --group G or --all (one of them)")
    transport = AsyncGroupTransport(db, args.prefix)
    n = await transport.redrive(args.seqs or None, group_id=_group_id(args), limit=args.limit)
    return _found(n, f"redrove {n} dead letter(s)", "no dead letter to redrive", {"redriven": n})


# ---------------------------------------------------------------------------- outbox


def _outbox(args: argparse.Namespace, db: Any) -> AsyncOutbox:
    # Subscriptions matter to publishing only; the completion history to listing and purging.
    return AsyncOutbox(
        db, args.prefix, subscriptions={}, completion_history=args.completion_history
    )


async def _outbox_stats(args: argparse.Namespace, db: Any) -> Out:
    stats = await _outbox(args, db).stats()
    return Out(stats, _pairs([(f.name.replace("_", " "), getattr(stats, f.name))
                              for f in fields(stats)]))  # fmt: skip


async def _outbox_list(args: argparse.Namespace, db: Any) -> Out:
    deliveries = await _outbox(args, db).list_deliveries(
        status=args.status, handler=args.handler, event_type=args.event_type, limit=args.limit
    )
    return Out({"deliveries": deliveries}, _table(
        ["EVENT", "TYPE", "HANDLER", "STATUS", "ATTEMPTS", "KEY", "DUE AT", "UPDATED", "ERROR"],
        [[d.event_id, d.event_type, d.handler, "running" if d.running else d.status, d.attempts,
          d.key, d.due_at, d.updated_at, d.last_error] for d in deliveries],
        "no deliveries",
    ))  # fmt: skip


async def _outbox_requeue(args: argparse.Namespace, db: Any) -> Out:
    done = await _outbox(args, db).requeue(args.event_id, args.handler)
    nothing = f"no dead delivery of event {args.event_id} to {args.handler}"
    return _found(done, f"requeued {args.event_id} to {args.handler}", nothing, {"requeued": done})


async def _outbox_purge(args: argparse.Namespace, db: Any) -> Out:
    if args.dead_older_than is None and args.completed_older_than is None:
        raise UsageError("pass --dead-older-than, --completed-older-than or both")
    outbox = _outbox(args, db)
    await outbox.clock.refresh()  # the cutoffs on the server's clock, as the outbox's own
    dead, completed = (
        None if age is None else outbox.clock.now() - timedelta(seconds=age)
        for age in (args.dead_older_than, args.completed_older_than)
    )
    result = await outbox.purge(dead_before=dead, completed_before=completed)
    counts = (result.dead_deliveries, result.completed_records, result.events)
    text = "purged {} dead deliveries, {} completion records, {} events".format(*counts)
    return Out(result, [text])


# ------------------------------------------------------------------------- metrics, demo


async def _serve_until_stopped(url: str) -> None:
    """Wait for Ctrl-C (the main task is cancelled); tests replace it."""
    await anyio.sleep_forever()


async def _metrics(args: argparse.Namespace) -> int:
    from mongoq import metrics  # the metrics extra: imported only when asked for

    try:  # the embedded backend is refused there: the exporter opens it new and empty
        server = metrics.serve(
            args.port, uri=args.uri, database=args.database, tasks=args.tasks,
            groups=args.groups, outbox=args.outbox, addr=args.addr,
        )  # fmt: skip
    except OSError as error:  # the port is taken, the address is not this host's
        raise MongoqError(f"cannot serve on {args.addr}:{args.port}: {error}") from error
    try:
        print(f"serving metrics on {server.url} (Ctrl-C stops)", flush=True)
        if args.addr in _ANY_ADDRESS:
            print(f"mongoq: warning: the metrics are reachable on {args.addr}, not only from "
                  "this machine (--addr 127.0.0.1 keeps them here)", file=sys.stderr)  # fmt: skip
        await _serve_until_stopped(server.url)
    finally:
        server.close()
    return 0


def _print_report(report: DemoReport) -> None:
    print(f"\n{'final state':<24}{'tasks':>8}")
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
    print("\ninvariants")
    for label, passed in report.checks:
        print(f"  [{'ok' if passed else 'FAILED'}] {label}")


async def _worker(args: argparse.Namespace) -> int:
    return await worker(args, _uri(args))


async def _demo(args: argparse.Namespace) -> int:
    config = DemoConfig(
        uri=args.uri, tasks=args.tasks, workers=args.workers, batch_size=args.batch_size,
        seed=args.seed,
    )  # fmt: skip
    if args.dashboard:
        return await _demo_with_dashboard(args, config)
    out = sys.stderr if args.json else sys.stdout  # --json: stdout holds the report only
    report = await run_demo(config, progress=lambda line: print(line, file=out, flush=True))
    if args.json:
        print(json.dumps(_report_document(report), indent=2))
    else:
        _print_report(report)
    return 0 if report.ok else 1


def _report_document(report: DemoReport) -> dict[str, Any]:
    """The demo's report as ``demo --json`` prints it."""
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    fields["statuses"] = dict(report.statuses)
    fields["checks"] = [{"check": label, "ok": passed} for label, passed in report.checks]
    return {**fields, "ok": report.ok}


def _at_least_one(text: str) -> int:
    """An argument that counts something there must be at least one of."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _batch_size(text: str) -> int:
    """The demo's ``--batch-size``: what `AsyncTaskQueue.run` accepts, refused by the parser."""
    value = _at_least_one(text)
    if value > MAX_BATCH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_BATCH}, got {value}")
    return value


# ------------------------------------------------------------------------- dashboard


def _dashboard_module() -> Any:
    try:
        from mongoq import dashboard  # the dashboard extra: imported only when asked for
    except ImportError as error:
        raise MongoqError(
            f"the dashboard needs the dashboard extra ({error.name} is missing): "
            "pip install 'mongoq-queue[dashboard]'"
        ) from None
    return dashboard


async def _serve_dashboard(app: Any, sock: Any) -> None:
    """Serve `app` on `sock` until Ctrl-C; tests replace it."""
    await _dashboard_module().serve(app, sock=sock)


#: Addresses that bind every interface: the host names the dashboard is reached by are unknown.
_ANY_ADDRESS = ("0.0.0.0", "::", "")


def _dashboard_app(args: argparse.Namespace, db: Any, **options: Any) -> tuple[Any, Any]:
    """The app `args` ask for, and its socket, bound before anything is printed (a port
    taken is one error line). It answers the host names of ``--allowed-host``; by default
    loopback names on loopback, the address itself on another, any on every address."""
    dashboard = _dashboard_module()  # first: a missing extra is said before anything else
    from mongoq.dashboard.security import LOOPBACK

    loopback = args.host in LOOPBACK
    hosts = getattr(args, "allowed_hosts", None)
    if not hosts and not loopback:
        hosts = ["*"] if args.host in _ANY_ADDRESS else [args.host]
    token = None
    if args.allow_actions:  # a read-only dashboard needs no token, configured or not
        token = getattr(args, "token", None) or os.environ.get("MONGOQ_DASHBOARD_TOKEN") or None
    app = dashboard.create_app(
        db, allow_actions=args.allow_actions, token=token, allowed_hosts=hosts or None, **options
    )
    sock = dashboard.bind(args.host, args.port)
    port = sock.getsockname()[1]  # the one given, or the free one --port 0 found
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving the dashboard on http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    if args.allow_actions:
        given = "the configured one" if token else app.state.dashboard.token
        print(f"actions are enabled; each needs the token: {given}", flush=True)
    else:
        print("read-only (--allow-actions enables requeue, redrive, cancel, purge)", flush=True)
    if hosts == ["*"]:
        print(f"mongoq: warning: the dashboard is reachable on {args.host}, not only from this "
              "machine, under any host name (--allowed-host NAME narrows it)",
              file=sys.stderr)  # fmt: skip
    if args.log_level is None:  # actions are logged at INFO: shown whatever the default
        logging.getLogger("mongoq.dashboard").setLevel(logging.INFO)
    return app, sock


async def _dashboard(args: argparse.Namespace) -> int:
    _dashboard_module()  # a missing extra is said first, before the database is opened
    async with _database(args) as db:
        app, sock = _dashboard_app(args, db, sample_interval=args.sample_interval)
        await _serve_dashboard(app, sock)
    return 0


async def _drop_demo_quietly(db: Any, name: str) -> None:
    """Drop the demo's queue however the demo stopped; a failure to is said, never raised
    over the error that stopped it, and waited for at most `DEMO_DROP_WAIT` seconds."""
    with anyio.move_on_after(DEMO_DROP_WAIT, shield=True) as scope:
        try:
            await drop_demo(db, name)
        except PyMongoError as error:
            print(f"mongoq: warning: could not drop the demo's queue {name}: {error}",
                  file=sys.stderr)  # fmt: skip
    if scope.cancelled_caught:
        print(f"mongoq: warning: dropping the demo's queue {name} timed out", file=sys.stderr)


async def _demo_with_dashboard(args: argparse.Namespace, config: DemoConfig) -> int:
    """The demo with its dashboard beside it, on the same database (the embedded backend
    lives in this process only; on a server the demo's own database), until Ctrl-C after the
    demo ends. With ``--uri`` the demo's queue is dropped however it stops."""
    args.allow_actions = True  # a newcomer tries a requeue; the token still guards it
    args.database = DEMO_DATABASE
    config = dataclasses.replace(config, round_pause=DEMO_ROUND_PAUSE)
    clock, name = ManualClock(), demo_queue_name()
    report: DemoReport | None = None
    started = False
    async with _database(args, demo=True) as db:
        try:
            app, sock = _dashboard_app(args, db, clock=clock, sample_interval=1.0)
            async with anyio.create_task_group() as group:
                group.start_soon(_serve_dashboard, app, sock)
                started = True
                report = await run_demo(config, lambda line: print(line, flush=True), db=db,
                                        clock=clock, name=name)  # fmt: skip
                _print_report(report)
                print("the demo is over; the dashboard still serves it (Ctrl-C stops)",
                      flush=True)  # fmt: skip
                await _serve_until_stopped("")
                group.cancel_scope.cancel()
        finally:
            if started and _uri(args) is not None:
                await _drop_demo_quietly(db, name)
    return 0 if report is not None and report.ok else 1


# ---------------------------------------------------------------------------- parsing


def _global_options(suppress: bool) -> _Parser:
    """The options every level accepts; below the top, unset ones leave the top's values."""
    try:
        timeout = _duration(os.environ.get("MONGOQ_TIMEOUT", "5"))
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"MONGOQ_TIMEOUT: {error}") from None
    database = os.environ.get("MONGOQ_DATABASE", "mongoq")
    specs: list[tuple[str, Any, dict[str, Any]]] = [
        ("--uri", None, {"help": "mongodb:// or mongodb+srv:// (default: MONGOQ_URI)"}),
        ("--database", database, {"help": "default: MONGOQ_DATABASE, else mongoq"}),
        ("--timeout", timeout, {"type": _duration, "metavar": "SECONDS",
                                "help": "to find the server (default: MONGOQ_TIMEOUT, else 5)"}),
        ("--json", False, {"action": "store_true", "help": "one JSON document on stdout"}),
        ("--log-level", None, {"choices": ["DEBUG", "INFO", "WARNING", "ERROR"],
                               "help": "what the library logs (default: WARNING; demo: ERROR)"}),
    ]  # fmt: skip
    options = _Parser(add_help=False)
    for flag, default, extra in specs:
        options.add_argument(flag, default=argparse.SUPPRESS if suppress else default, **extra)
    return options


def _command(where: Any, name: str, func: Any, text: str, *target: str) -> Any:
    """Add the command `name` running `func` (which connects) with the positionals `target`."""
    sub = where.add_parser(name, help=text, description=text, parents=[_global_options(True)])
    sub.set_defaults(func=func, connects=True)
    for positional in target:
        sub.add_argument(positional, metavar=positional.upper())
    return sub


def _paged(sub: Any, state: str, choices: Sequence[str]) -> None:
    """A listing's options: which state, how many, and the cursor of the page before."""
    sub.add_argument(state, choices=choices)
    sub.add_argument("--limit", type=int, default=100, help="at most this many (up to 1000)")
    sub.add_argument("--after", metavar="CURSOR", help="the `next:` of the previous page")


def _actions(commands: Any, name: str, text: str) -> Any:
    sub = commands.add_parser(name, help=text, parents=[_global_options(True)])
    return sub.add_subparsers(dest="action", required=True, metavar="ACTION")


def _add_tasks(commands: Any) -> None:
    tasks = _actions(commands, "tasks", "a task queue (AsyncTaskQueue): stats, list, requeue...")
    _command(tasks, "stats", _tasks_stats, "counts per status, due, expired", "queue")
    sub = _command(tasks, "list", _tasks_list, "tasks, least recently changed first", "queue")
    _paged(sub, "--status", STATUSES)
    sub = _command(tasks, "get", _tasks_get, "one task, in full", "queue", "task_id")
    sub.add_argument("--int-id", action="store_true", help="the id is an integer")
    sub = _command(tasks, "requeue", _tasks_requeue, "failed tasks back to pending", "queue")
    sub.add_argument("task_ids", nargs="*", metavar="TASK_ID")
    sub.add_argument("--all-failed", action="store_true", help="every failed task")
    sub.add_argument("--int-ids", action="store_true", help="the ids are integers")
    sub = _command(tasks, "cancel", _tasks_cancel, "end pending or running tasks", "queue")
    sub.add_argument("task_ids", nargs="+", metavar="TASK_ID")
    sub.add_argument("--int-ids", action="store_true", help="the ids are integers")
    _command(tasks, "schedules", _tasks_schedules, "the queue's periodic tasks", "queue")
    _command(tasks, "unschedule", _tasks_unschedule, "remove a schedule", "queue", "name")
    sub = _command(tasks, "purge", _tasks_purge, "delete old finished tasks", "queue")
    sub.add_argument("--status", choices=PURGEABLE, required=True)
    sub.add_argument("--older-than", type=_duration, required=True, metavar="AGE")
    sub = _command(tasks, "reclaim", _tasks_reclaim, "fail or requeue expired leases", "queue")
    sub.add_argument("--max-attempts", type=int, default=5, help="the workers' (default 5)")


def _add_groups(commands: Any) -> None:
    groups = _actions(commands, "groups", "a group transport (AsyncGroupTransport)")
    _command(groups, "stats", _groups_stats, "groups by state, messages, dead letters", "prefix")
    sub = _command(groups, "list", _groups_list, "groups, by group id", "prefix")
    _paged(sub, "--state", GROUP_STATES)
    for name, func, text in (
        ("dead-letters", _groups_dead_letters, "dead letters, oldest first"),
        ("redrive", _groups_redrive, "publish dead letters again, at the tail of their groups"),
    ):
        sub = _command(groups, name, func, text, "prefix")
        if name == "redrive":
            sub.add_argument("seqs", nargs="*", type=int, metavar="SEQ")
            sub.add_argument("--all", action="store_true", help="the oldest --limit ones")
        sub.add_argument("--group", metavar="G", help="only this group's")
        sub.add_argument("--int-group", action="store_true", help="the group id is an integer")
        sub.add_argument("--limit", type=int, default=100 if name == "dead-letters" else 1000)


def _add_outbox(commands: Any) -> None:
    outbox = _actions(commands, "outbox", "an outbox (AsyncOutbox): stats, list, requeue, purge")
    parsers = {}
    for name, func, text, target in (
        ("stats", _outbox_stats, "deliveries by status, lanes held", ()),
        ("list", _outbox_list, "deliveries, oldest first", ()),
        ("requeue", _outbox_requeue, "a dead delivery back to pending", ("event_id", "handler")),
        ("purge", _outbox_purge, "delete old dead deliveries, completions, events", ()),
    ):
        parsers[name] = sub = _command(outbox, name, func, text, *target)
        sub.add_argument("--prefix", default="mongoq_outbox_", help="default: mongoq_outbox_")
        sub.add_argument("--completion-history", action="store_true", help="as the outbox has it")
    parsers["list"].add_argument("--status", choices=DELIVERY_STATUSES)
    parsers["list"].add_argument("--handler")
    parsers["list"].add_argument("--event-type")
    parsers["list"].add_argument("--limit", type=int, default=100)
    parsers["purge"].add_argument("--dead-older-than", type=_duration, metavar="AGE")
    parsers["purge"].add_argument("--completed-older-than", type=_duration, metavar="AGE")


async def _list(args: argparse.Namespace, db: Any) -> Out:
    found = await registry.registered(db)
    text = _table(
        ["PRIMITIVE", "NAME", "SET UP", "FIRST SET UP", "VERSION"],
        [[r.primitive, r.name, r.set_up_at, r.registered_at, r.version] for r in found],
        "no mongoq primitive set up in this database",
    )
    return Out(found, text)


def _serving(sub: Any) -> None:
    sub.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    sub.add_argument("--port", type=int, default=8188, help="default: 8188")


def _add_others(commands: Any) -> None:
    """`list`, `metrics`, `demo` and `dashboard` (the last three do not connect here)."""
    _command(commands, "list", _list, "the task queues, group transports and outboxes set up")
    text = "export the stats of the named primitives to Prometheus, until Ctrl-C"
    sub = _command(commands, "metrics", _metrics, text)
    sub.set_defaults(connects=False)
    sub.add_argument("--port", type=int, default=9108, help="default: 9108")
    sub.add_argument("--addr", default="127.0.0.1",
                     help="default: 127.0.0.1 (this machine only); 0.0.0.0 or :: is every "
                     "interface, with a warning")  # fmt: skip
    for name, metavar in (("tasks", "QUEUE"), ("groups", "PREFIX"), ("outbox", "PREFIX")):
        sub.add_argument(f"--{name}", nargs="+", default=[], metavar=metavar)
    sub = _command(commands, "demo", _demo, "run the task-queue demo (embedded backend default)")
    sub.set_defaults(connects=False)
    sub.add_argument("--tasks", type=_at_least_one, default=DemoConfig.tasks)
    sub.add_argument("--workers", type=_at_least_one, default=DemoConfig.workers)
    sub.add_argument("--batch-size", type=_batch_size, default=DemoConfig.batch_size,
                     help="tasks a worker claims at once (default: %(default)s; 1: one "
                     "claim a task, slower on the embedded backend)")  # fmt: skip
    sub.add_argument("--seed", type=int, default=DemoConfig.seed)
    sub.add_argument("--dashboard", action="store_true",
                     help="serve the dashboard on the demo's database while it runs")  # fmt: skip
    _serving(sub)
    text = "run every task function of a mongoq.Jobs (MODULE:ATTRIBUTE) until SIGTERM"
    sub = _command(commands, "worker", _worker, text)
    sub.set_defaults(connects=False)
    add_worker_arguments(sub, _at_least_one, _batch_size)
    text = "serve the web dashboard of this database's primitives, until Ctrl-C"
    sub = _command(commands, "dashboard", _dashboard, text)
    sub.set_defaults(connects=False)
    _serving(sub)
    sub.add_argument(
        "--allow-actions",
        action="store_true",
        help="enable requeue, redrive, cancel and purge (each needs the token)",
    )
    sub.add_argument(
        "--token",
        help="the actions' token (default: MONGOQ_DASHBOARD_TOKEN, else a random one, printed)",
    )
    sub.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        metavar="NAME",
        help="a host name the dashboard answers to (repeatable; default: loopback "
        "names, or the --host address)",
    )
    sub.add_argument("--sample-interval", type=_duration, default=10.0, metavar="SECONDS",
                     help="how often the throughput chart samples (default: 10)")  # fmt: skip


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mongoq", parents=[_global_options(suppress=False)], epilog=EPILOG,
        description="Operate mongoq's task queues, group transports and outboxes; export "
        "their metrics; run the demo.", formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"mongoq {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_tasks, _add_groups, _add_outbox, _add_others):
        add(commands)
    return parser


# ---------------------------------------------------------------------------- running


def _uri(args: argparse.Namespace) -> str | None:
    return args.uri or os.environ.get("MONGOQ_URI") or None


def _fresh_embedded(db: Any) -> bool:
    """Whether `db` is the embedded backend, which a command opens new and empty in its own
    process: nothing there is anyone's data. (Tests that hand a command an embedded database
    they seeded replace this.)"""
    return _driver.backend_of(db) is _driver.Backend.MEMORY


def _embedded_refused(uri: str | None) -> MongoqError:
    given = uri if uri is not None else "no --uri nor MONGOQ_URI"
    return MongoqError(
        f"{given}: the embedded backend is a new, empty database in this process, with nothing "
        "to show; point mongoq at your server with --uri mongodb://HOST or MONGOQ_URI"
    )


@contextlib.asynccontextmanager
async def _database(args: argparse.Namespace, *, demo: bool = False) -> AsyncIterator[Any]:
    """The database of one command. The embedded backend is refused (its zeros would make a
    misspelt queue look healthy and empty), except for the demo, which fills it."""
    uri = _uri(args)
    try:
        db = _driver.connect(uri, args.database, timeout=args.timeout)
    except ValueError as error:  # PyMongo's refusal of a malformed URI (InvalidInput is ours)
        raise error if isinstance(error, MongoqError) else MongoqError(f"uri: {error}") from None
    try:
        if not demo and _fresh_embedded(db):
            raise _embedded_refused(uri)
        if _driver.backend_of(db) is not _driver.Backend.MEMORY:
            await _driver.ping(db)  # an unreachable server: `ServerUnavailable` now
        yield db
    finally:
        await _driver.close(db)


def _fail(message: str) -> int:
    print(" ".join(message.split()), file=sys.stderr)
    return 2


async def run(argv: Sequence[str] | None = None) -> int:
    """Run one ``mongoq`` command in the running event loop; returns its exit code."""
    try:
        args = _build_parser().parse_args(argv)  # --uri & co. before or after the command
    except UsageError as error:
        return _fail(f"{error.prog}: error: {error}")
    except SystemExit as exit:  # --help, --version
        return exit.code if isinstance(exit.code, int) else 0
    level = args.log_level or ("ERROR" if args.command == "demo" else "WARNING")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    uri = _uri(args)
    try:
        if args.json and not args.connects and args.command != "demo":
            raise UsageError("--json is for the operator commands", f"mongoq {args.command}")
        if not args.connects:
            return int(await args.func(args))
        async with _database(args) as db:
            out: Out = await args.func(args, db)
        print(json.dumps(_plain(out.data), indent=2) if args.json else "\n".join(out.text))
        return out.code
    except UsageError as error:
        return _fail(f"{error.prog}: error: {error}")
    except MongoqError as error:  # a missing extra, a refused argument: said plainly
        return _fail(f"mongoq: error: {scrub(str(error), uri)}")
    except PyMongoError as error:  # a refused login, a malformed URI: the first line, scrubbed
        return _fail(f"mongoq: error: {_line(scrub(str(error), uri), 300)}")
    except Exception as error:  # anything else (a malformed URI, an overflowing age): one line
        logging.getLogger("mongoq.cli").debug("the command failed", exc_info=True)
        text = f"{type(error).__name__}: {error}"
        return _fail(f"mongoq: error: {_line(scrub(text, uri), 300)} (--log-level DEBUG: more)")


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point: `run` under ``asyncio.run``; Ctrl-C stops any command (exit 130)."""
    try:
        return asyncio.run(run(argv))
    except KeyboardInterrupt:
        print("mongoq: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
