"""Prometheus metrics for the three primitives, on prometheus_client (the ``metrics`` extra).

- `RunMetrics`: what the run loops of this process do, heard through
  `mongoq.runtime.events`: ``mongoq_items_total{primitive,queue,outcome}`` and the handler
  durations ``mongoq_handler_seconds{primitive,queue}``, and the maintenance services' rounds
  ``mongoq_service_rounds_total{primitive,queue,service,outcome}``. Start it once in a worker
  process and expose the registry however you already do.
- `StatsCollector`: a custom collector that reads ``stats()`` of each primitive it was given on
  every scrape and yields gauges (backlog, in flight, dead letters, the oldest waiting age),
  with ``mongoq_up`` saying whether that read succeeded. A fixed number of indexed commands per
  primitive and scrape, whatever the backlog (see docs/metrics.md).
- `serve`: a standalone exporter (what ``mongoq metrics --port`` runs): its own event-loop
  thread and client, a `StatsCollector` on a fresh registry, prometheus_client's HTTP server;
  `MetricsServer.close()` stops it all.

Nothing here runs at import. Owns no collections: it only reads through ``stats()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio

from mongoq import _driver
from mongoq._portal import Portal
from mongoq._validation import check_name
from mongoq.errors import InvalidInput
from mongoq.groups import AsyncGroupTransport, GroupStats
from mongoq.outbox import AsyncOutbox, OutboxStats
from mongoq.runtime.events import RunEvent, subscribe
from mongoq.tasks import AsyncTaskQueue, TaskStats
from mongoq.tasks.models import STATUSES

with _driver.extra_required("metrics", "mongoq.metrics"):
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.exposition import start_http_server

__all__ = ["MetricsServer", "RunMetrics", "StatsCollector", "serve"]

log = logging.getLogger("mongoq.metrics")

#: Handler durations from 5 ms to 10 min: short tasks and batch jobs land in distinct buckets.
_HANDLER_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
#: Seconds a scrape waits for each primitive's stats(): below Prometheus' default scrape
#: timeout (10 s), so a slow server shows as ``mongoq_up 0`` rather than a failed scrape.
_SCRAPE_TIMEOUT = 5.0

#: A primitive `StatsCollector` reads.
_Primitive = AsyncTaskQueue | AsyncGroupTransport | AsyncOutbox
#: Runs a coroutine function to completion from the calling thread and returns its result
#: (`mongoq._portal.Portal.call`, ``anyio.from_thread.run``...).
_Runner = Callable[[Callable[[], Coroutine[Any, Any, Any]]], Any]

_Family = GaugeMetricFamily | CounterMetricFamily

_TASKS, _GROUPS, _OUTBOX = "tasks", "groups", "outbox"
_GROUP_STATES = ("ready", "in_flight", "parked")
_OUTBOX_STATES = ("pending", "parked", "running", "dead")


# ---------------------------------------------------------------------------- run metrics


def _durations(name: str, text: str, registry: CollectorRegistry) -> Histogram:
    """A histogram of seconds per primitive and queue, from 5 ms to 10 min."""
    return Histogram(
        name, text, ("primitive", "queue"), buckets=_HANDLER_BUCKETS, registry=registry
    )


class RunMetrics:
    """Counts what this process's run loops do, for Prometheus.

    ``mongoq_items_total{primitive,queue,outcome}`` adds up the run summaries' fields
    (``claimed``, ``completed`` / ``acked``, ``retried``, ``failed`` / ``dead`` / ``buried``,
    ``released``, ``lost``, ``unknown``); ``mongoq_handler_seconds{primitive,queue}`` is a
    histogram of how long each handler ran, on the primitive's clock;
    ``mongoq_start_delay_seconds{primitive,queue}`` one of how long after falling due each item
    was claimed (a backlog's wait: every claim reports it, run loop or not). Every `run` of every
    `AsyncTaskQueue`, `AsyncGroupTransport` and `OutboxDispatcher` in the process is heard,
    whichever thread or loop it runs in.

    Call it once in a worker process and expose the registry however you already do
    (``prometheus_client.start_http_server``, your web framework's ``/metrics``)::

        metrics = RunMetrics()
        metrics.start()
        await queue.run(handler)

    The metrics are registered on `registry` when constructed: a second `RunMetrics` on the
    same registry is refused by prometheus_client (duplicated timeseries). `start` and `stop`
    are idempotent; ``with RunMetrics() as metrics:`` starts and stops it.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self._items = Counter(
            "mongoq_items",
            "Work items of a mongoq run loop, by how their lease ended (run-summary fields).",
            ("primitive", "queue", "outcome"),
            registry=registry,
        )
        self._handler_seconds = _durations(
            "mongoq_handler_seconds",
            "How long each handler of a mongoq run loop ran, on the primitive's clock.",
            registry,
        )
        self._start_delay = _durations(
            "mongoq_start_delay_seconds",
            "How long after falling due each mongoq work item was claimed.",
            registry,
        )
        self._service_rounds = Counter(
            "mongoq_service_rounds",
            "Rounds of a mongoq run loop's maintenance services, by whether they reached the "
            "server (ran) or failed with a driver error (failed).",
            ("primitive", "queue", "service", "outcome"),
            registry=registry,
        )
        self._lock = threading.Lock()
        self._unsubscribe: Callable[[], None] | None = None

    def _observe(self, event: RunEvent) -> None:
        if event.outcome == "handler_seconds":
            self._handler_seconds.labels(event.primitive, event.queue).observe(event.seconds)
        elif event.outcome == "start_delay_seconds":
            self._start_delay.labels(event.primitive, event.queue).observe(event.seconds)
        elif event.service:
            outcome = event.outcome.removeprefix("service_")
            self._service_rounds.labels(event.primitive, event.queue, event.service, outcome).inc(
                event.count
            )
        else:
            self._items.labels(event.primitive, event.queue, event.outcome).inc(event.count)

    @property
    def started(self) -> bool:
        return self._unsubscribe is not None

    def start(self) -> RunMetrics:
        """Hear the run loops from now on (once, however often it is called)."""
        with self._lock:
            if self._unsubscribe is None:
                self._unsubscribe = subscribe(self._observe)
        return self

    def stop(self) -> None:
        """Stop hearing them; what was counted stays in the registry."""
        with self._lock:
            if self._unsubscribe is not None:
                self._unsubscribe()
                self._unsubscribe = None

    def __enter__(self) -> RunMetrics:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -------------------------------------------------------------------------- stats collector


@dataclass(frozen=True)
class _Reading:
    """One primitive's part of a scrape: its stats and the instant they were read at on its
    clock, or None when the read failed."""

    kind: str
    queue: str
    stats: TaskStats | GroupStats | OutboxStats | None
    now: datetime | None = None


def _identify(primitive: object) -> tuple[str, str]:
    """(kind, queue label) of a primitive; `InvalidInput` for anything else."""
    if isinstance(primitive, AsyncTaskQueue):
        return _TASKS, primitive.name
    if isinstance(primitive, AsyncGroupTransport):
        return _GROUPS, primitive.prefix
    if isinstance(primitive, AsyncOutbox):
        return _OUTBOX, primitive.prefix
    raise InvalidInput(
        "primitives",
        "must be AsyncTaskQueue, AsyncGroupTransport or AsyncOutbox instances, got "
        f"{type(primitive).__name__}",
    )


def _age(now: datetime, since: datetime | None) -> float:
    """Seconds from `since` to `now`; 0 when nothing waits (or it is not due yet)."""
    return 0.0 if since is None else max(0.0, (now - since).total_seconds())


class StatsCollector:
    """A prometheus_client collector reading ``stats()`` of `primitives` on every scrape.

    `primitives` are `AsyncTaskQueue`, `AsyncGroupTransport` and `AsyncOutbox` instances; the
    ``queue`` label is the queue's name, the transport's prefix, the outbox's prefix.
    `collect` is synchronous and runs in the HTTP server's thread while the primitives belong
    to an event loop: `call` runs a coroutine function there to completion and returns its
    result (`serve` passes its portal's ``call``; inside an asyncio service, something like
    ``lambda fn: asyncio.run_coroutine_threadsafe(fn(), loop).result()``).

    The primitives are read concurrently, each for at most `timeout` seconds. One whose read
    fails (a driver error, the timeout, missing indexes) is logged as a WARNING and reported as
    ``mongoq_up{primitive,queue} 0`` with ``mongoq_scrape_errors_total`` counting up; its gauges
    are left out of that scrape rather than shown stale or as a made-up 0. `collect` never
    raises. The cost is what each ``stats()`` costs: 10 or 11 commands per task queue, 6 per
    group transport, 5 to 7 per outbox, whatever the backlog.
    """

    def __init__(
        self, primitives: Iterable[_Primitive], *, call: _Runner, timeout: float = _SCRAPE_TIMEOUT
    ) -> None:
        if isinstance(primitives, str) or not isinstance(primitives, Iterable):
            raise InvalidInput("primitives", "must be a list of primitives")
        self._primitives: list[tuple[str, str, _Primitive]] = []
        seen: set[tuple[str, str]] = set()
        for primitive in primitives:
            kind, queue = _identify(primitive)
            if (kind, queue) in seen:
                # Two series with the same labels would make the exposition invalid.
                raise InvalidInput("primitives", f"{kind} {queue!r} is given twice")
            seen.add((kind, queue))
            self._primitives.append((kind, queue, primitive))
        if not callable(call):
            raise InvalidInput("call", "must run a coroutine function and return its result")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise InvalidInput("timeout", f"must be a positive number of seconds, got {timeout!r}")
        self._call = call
        self._timeout = float(timeout)
        self._errors = {(kind, queue): 0 for kind, queue, _ in self._primitives}
        self._errors_lock = threading.Lock()  # scrapes may run in several server threads

    # The registry asks `describe` for the names at registration (duplicates are refused)
    # instead of running a whole scrape through `collect`.
    def describe(self) -> list[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterator[Metric]:
        readings = self._scrape()
        families = self._families()
        for reading in readings:
            labels = [reading.kind, reading.queue]
            families["mongoq_up"].add_metric(labels, 0.0 if reading.stats is None else 1.0)
            if reading.stats is not None and reading.now is not None:
                self._add(families, reading.queue, reading.stats, reading.now)
        with self._errors_lock:
            for reading in readings:
                if reading.stats is None:
                    self._errors[(reading.kind, reading.queue)] += 1
            for (kind, queue), count in self._errors.items():
                families["mongoq_scrape_errors"].add_metric([kind, queue], float(count))
        yield from families.values()

    def _scrape(self) -> list[_Reading]:
        try:
            readings: list[_Reading] = self._call(self._read_all)
            return readings
        except Exception as exc:  # e.g. the portal is closed: every primitive is down
            log.warning(
                "mongoq metrics: the scrape could not run (%s: %s)", type(exc).__name__, exc
            )
            return [_Reading(kind, queue, None) for kind, queue, _ in self._primitives]

    async def _read_all(self) -> list[_Reading]:
        readings: list[_Reading | None] = [None] * len(self._primitives)

        async def read(index: int, kind: str, queue: str, primitive: _Primitive) -> None:
            readings[index] = await self._read(kind, queue, primitive)

        async with anyio.create_task_group() as group:
            for index, (kind, queue, primitive) in enumerate(self._primitives):
                group.start_soon(read, index, kind, queue, primitive)
        return [reading for reading in readings if reading is not None]

    async def _read(self, kind: str, queue: str, primitive: _Primitive) -> _Reading:
        failure: str | None = None
        try:
            with anyio.move_on_after(self._timeout) as scope:
                stats = await primitive.stats()
            if scope.cancelled_caught:
                failure = f"timed out after {self._timeout:g} s"
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if failure is not None:
            log.warning(
                "mongoq metrics: reading the stats of %s %r failed (%s)", kind, queue, failure
            )
            return _Reading(kind, queue, None)
        # The instant the ages are measured against: the primitive's own clock, as refreshed
        # by stats() (the server's time with the default clock).
        return _Reading(kind, queue, stats, primitive.clock.now())

    def _families(self) -> dict[str, _Family]:
        """Empty families of every metric this collector yields, for the kinds it reads."""
        families: dict[str, _Family] = {}

        def gauge(name: str, documentation: str, *labels: str) -> None:
            families[name] = GaugeMetricFamily(name, documentation, labels=["queue", *labels])

        kinds = {kind for kind, _, _ in self._primitives}
        if _TASKS in kinds:
            gauge("mongoq_tasks", "Tasks of a task queue, by status.", "status")
            gauge("mongoq_tasks_due", "Pending tasks claimable now.")
            gauge("mongoq_tasks_expired", "Processing tasks whose lease ran out.")
            gauge(
                "mongoq_tasks_oldest_due_age_seconds",
                "How long the oldest claimable task has waited; 0 when none is due.",
            )
            gauge(
                "mongoq_tasks_unknown_function_due",
                "Due tasks of a task function no running worker runs (plain tasks: function "
                "empty); no series when none waits, or when no worker is running.",
                "function",
            )
        if _GROUPS in kinds:
            gauge("mongoq_groups", "Groups of a group transport, by state.", "state")
            gauge("mongoq_group_messages", "Messages stored (not yet acked or dead-lettered).")
            gauge("mongoq_group_dead_letters", "Messages in the dead letters.")
            gauge(
                "mongoq_group_oldest_message_age_seconds",
                "Age of the oldest message not yet acked; 0 when there is none.",
            )
        if _OUTBOX in kinds:
            gauge(
                "mongoq_outbox_deliveries",
                "Outbox deliveries by state; pending includes parked and running ones.",
                "state",
            )
            gauge(
                "mongoq_outbox_oldest_due_age_seconds",
                "How long the oldest unfinished delivery has been due; 0 when none is.",
            )
            gauge("mongoq_outbox_lanes_held", "Outbox lanes held under a live lease.")
        families["mongoq_up"] = GaugeMetricFamily(
            "mongoq_up",
            "1 if the last scrape read this primitive's stats, 0 if that failed.",
            labels=["primitive", "queue"],
        )
        families["mongoq_scrape_errors"] = CounterMetricFamily(
            "mongoq_scrape_errors",
            "Scrapes that failed to read this primitive's stats.",
            labels=["primitive", "queue"],
        )
        return families

    @staticmethod
    def _add(
        families: dict[str, _Family],
        queue: str,
        stats: TaskStats | GroupStats | OutboxStats,
        now: datetime,
    ) -> None:
        def put(name: str, value: float, *labels: str) -> None:
            families[name].add_metric([queue, *labels], float(value))

        if isinstance(stats, TaskStats):
            for status in dict.fromkeys([*STATUSES, *stats.counts]):
                put("mongoq_tasks", stats.counts.get(status, 0), status)
            put("mongoq_tasks_due", stats.due)
            put("mongoq_tasks_expired", stats.expired)
            age = stats.oldest_due_age
            put("mongoq_tasks_oldest_due_age_seconds", 0.0 if age is None else max(0.0, age))
            for function, waiting in sorted(stats.unknown_functions.items()):
                put("mongoq_tasks_unknown_function_due", waiting, function)
        elif isinstance(stats, GroupStats):
            for state in _GROUP_STATES:
                put("mongoq_groups", getattr(stats, state), state)
            put("mongoq_group_messages", stats.messages)
            put("mongoq_group_dead_letters", stats.dead)
            age = stats.oldest_message_age
            put("mongoq_group_oldest_message_age_seconds", 0.0 if age is None else max(0.0, age))
        else:
            for state in _OUTBOX_STATES:
                put("mongoq_outbox_deliveries", getattr(stats, state), state)
            put("mongoq_outbox_oldest_due_age_seconds", _age(now, stats.oldest_due_at))
            put("mongoq_outbox_lanes_held", stats.lanes_held)


# ----------------------------------------------------------------------------------- serve


@dataclass(eq=False)
class MetricsServer:
    """A running exporter (see `serve`): `port` is the port it listens on (the one the system
    picked when asked for port 0). `close()` stops the HTTP server, closes the client and the
    event-loop thread; idempotent, and ``with serve(...) as server:`` calls it."""

    port: int
    addr: str
    registry: CollectorRegistry
    _server: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _portal: Portal = field(repr=False)
    _db: Any = field(repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        wildcard = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
        host = wildcard.get(self.addr, self.addr)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The HTTP server first: no scrape starts on a client that is going away.
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        _close_portal(self._portal, self._db)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close_portal(portal: Portal, db: Any) -> None:
    try:
        portal.call(_driver.close, db)
    except Exception:
        log.warning("mongoq metrics: closing the client failed", exc_info=True)
    finally:
        portal.close()


def _fresh_embedded(db: Any) -> bool:
    """Whether `db` is the embedded backend, which `serve` opens new and empty in its own
    client: nothing there is anyone's data. (Tests that export an embedded database they
    seeded replace this.)"""
    return _driver.backend_of(db) is _driver.Backend.MEMORY


_EMBEDDED_REFUSED = (
    "is the embedded backend (none given and no MONGOQ_URI, or memory://): a new, empty "
    "database in the exporter's own process, with nothing to export; name your server with a "
    "mongodb:// URI (--uri mongodb://HOST on the command line) or MONGOQ_URI"
)


def _names(field_name: str, names: Iterable[str], *, prefix: bool = False) -> list[str]:
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise InvalidInput(field_name, f"must be a list of names, got {names!r}")
    return [check_name(field_name, name, prefix=prefix) for name in names]


def serve(
    port: int,
    *,
    uri: str | None = None,
    database: str = "mongoq",
    tasks: Iterable[str] = (),
    groups: Iterable[str] = (),
    outbox: Iterable[str] = (),
    addr: str = "127.0.0.1",
) -> MetricsServer:
    """Export the stats of the named primitives on ``http://addr:port/metrics``: by default
    on this machine only (``addr="0.0.0.0"`` or ``"::"`` listens on every interface, where
    anyone who reaches the port reads the queues' names and sizes).

    `tasks` are task-queue names, `groups` group-transport prefixes, `outbox` outbox prefixes
    (e.g. ``"mongoq_outbox_"``). `uri` as for `mongoq.connect` (None: ``MONGOQ_URI``); the
    embedded backend is refused (`InvalidInput` naming ``uri``): opened here, in the
    exporter's own client, it is new and empty, and its ``mongoq_up 1`` and zeros would make
    a misspelt queue look healthy and idle. The client lives in an event-loop thread of its
    own; each scrape reads every primitive's ``stats()`` there (see `StatsCollector`), and
    nothing else: no index is created and nothing is written. Returns once the server
    listens; `MetricsServer.close()` stops it.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInput("port", f"must be an int from 0 to 65535, got {port!r}")
    if not isinstance(addr, str):
        raise InvalidInput("addr", f"must be a string, got {addr!r}")
    queues, transports = _names("tasks", tasks), _names("groups", groups, prefix=True)
    outboxes = _names("outbox", outbox, prefix=True)
    if not (queues or transports or outboxes):
        raise InvalidInput("tasks", "name at least one task queue, group transport or outbox")
    portal = Portal()
    db: Any = None
    try:
        db = portal.call(_driver.connect, uri, database)
        if _fresh_embedded(db):
            raise InvalidInput("uri", _EMBEDDED_REFUSED)

        # Built in the portal, as mongoq_sync builds its objects: whatever a primitive sets
        # up belongs to the loop it will run in.
        def build() -> list[_Primitive]:
            built: list[_Primitive] = [AsyncTaskQueue(db, name) for name in queues]
            built += [AsyncGroupTransport(db, prefix) for prefix in transports]
            # Subscriptions matter to publishing only, never to stats().
            built += [AsyncOutbox(db, prefix, subscriptions={}) for prefix in outboxes]
            return built

        primitives: list[_Primitive] = portal.call(build)
        registry = CollectorRegistry()
        registry.register(StatsCollector(primitives, call=portal.call))
        server, thread = start_http_server(port, addr, registry=registry)
    except BaseException:
        if db is not None:
            _close_portal(portal, db)
        else:
            portal.close()
        raise
    bound = int(server.server_port)
    log.info("mongoq metrics on %s:%d (%d primitives)", addr, bound, len(primitives))
    return MetricsServer(bound, addr, registry, server, thread, portal, db)
