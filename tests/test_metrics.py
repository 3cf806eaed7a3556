"""`mongoq.metrics`: the gauges a scrape yields equal what the database holds, at a fixed number
of commands; the run counters equal the run summaries; a failed read is reported, never raised;
`serve` exports over HTTP; without prometheus_client the import names the extra."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import socket
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pymongo.errors import AutoReconnect

from mongoq import AsyncGroupTransport, AsyncOutbox, AsyncTaskQueue, MongoqError, OutboxDispatcher
from mongoq._portal import Portal
from mongoq.errors import InvalidInput
from mongoq.metrics import MetricsServer, RunMetrics, StatsCollector, serve
from mongoq.testing import CommandCounter, FaultInjector, ManualClock, instrument
from tests.support.group_helpers import new_transport
from tests.support.helpers import LEASE_TTL, QUEUE, claim_one, new_queue, utc
from tests.support.outbox_helpers import ONLY_H, PREFIX, event, new_outbox

#: A sample: (name, labels sorted), as the exposition text says.
Key = tuple[str, tuple[tuple[str, str], ...]]
GROUPS = "mq"  # the prefix `new_transport` uses


def key(name: str, **labels: str) -> Key:
    return name, tuple(sorted(labels.items()))


def parse(text: str) -> dict[Key, float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def collecting(*primitives: Any, **options: Any) -> CollectorRegistry:
    """A fresh registry whose collector reads `primitives` in the test's event loop: a scrape
    runs in a worker thread (as in the HTTP server's) and calls back into the loop."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(primitives, call=anyio.from_thread.run, **options))
    return registry


async def exposition(registry: CollectorRegistry) -> str:
    return (await anyio.to_thread.run_sync(generate_latest, registry)).decode()


async def scrape(registry: CollectorRegistry) -> dict[Key, float]:
    return parse(await exposition(registry))


def of_queue(samples: dict[Key, float], primitive: str, queue: str) -> dict[Key, float]:
    """The samples about one primitive: its gauges and its `mongoq_up` / error count."""
    return {
        k: v
        for k, v in samples.items()
        if dict(k[1]).get("queue") == queue and dict(k[1]).get("primitive", primitive) == primitive
    }


def by_label(samples: dict[Key, float], name: str, label: str) -> dict[str, float]:
    """The samples of metric `name`, by the value of `label`."""
    return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name}


def age(now: datetime, instants: list[Any]) -> float:
    """Seconds since the earliest of `instants` (stored values), 0 for none."""
    found = [utc(i) for i in instants]
    return max(0.0, (now - min(found)).total_seconds()) if found else 0.0


def up(primitive: str, queue: str, value: float, errors: float = 0.0) -> dict[Key, float]:
    return {
        key("mongoq_up", primitive=primitive, queue=queue): value,
        key("mongoq_scrape_errors_total", primitive=primitive, queue=queue): errors,
    }


# ------------------------------------------------------------ what the database holds, per kind


async def tasks_in_db(db: Any, now: datetime) -> dict[Key, float]:
    docs = [utc(d) for d in await db[QUEUE].find({}).to_list(None)]
    due = [d for d in docs if d["status"] == "pending" and d["lease_until"] <= now]
    expired = [d for d in docs if d["status"] == "processing" and d["lease_until"] < now]
    statuses = ("pending", "processing", "done", "failed", "cancelled", "tombstone")
    return {
        **{
            key("mongoq_tasks", queue=QUEUE, status=s): float(
                await db[QUEUE].count_documents({"status": s})
            )
            for s in statuses
        },
        key("mongoq_tasks_due", queue=QUEUE): float(len(due)),
        key("mongoq_tasks_expired", queue=QUEUE): float(len(expired)),
        key("mongoq_tasks_oldest_due_age_seconds", queue=QUEUE): age(
            now, [d["lease_until"] for d in due]
        ),
        **up("tasks", QUEUE, 1.0),
    }


async def groups_in_db(db: Any, now: datetime) -> dict[Key, float]:
    locks = [utc(d) for d in await db[f"{GROUPS}_locks"].find({}).to_list(None)]
    waiting = [lock for lock in locks if lock["available_at"] > now]
    parked = [lock for lock in waiting if lock.get("parked")]
    messages = await db[f"{GROUPS}_messages"].find({}).to_list(None)
    states = {
        "ready": len(locks) - len(waiting),
        "in_flight": len(waiting) - len(parked),
        "parked": len(parked),
    }
    return {
        **{key("mongoq_groups", queue=GROUPS, state=s): float(n) for s, n in states.items()},
        key("mongoq_group_messages", queue=GROUPS): float(len(messages)),
        key("mongoq_group_dead_letters", queue=GROUPS): float(
            await db[f"{GROUPS}_dead"].count_documents({})
        ),
        key("mongoq_group_oldest_message_age_seconds", queue=GROUPS): age(
            now, [m["published_at"] for m in messages]
        ),
        **up("groups", GROUPS, 1.0),
    }


async def outbox_in_db(db: Any, now: datetime) -> dict[Key, float]:
    deliveries = [utc(d) for d in await db[f"{PREFIX}deliveries"].find({}).to_list(None)]
    lanes = [utc(d) for d in await db[f"{PREFIX}lanes"].find({}).to_list(None)]
    live = [
        lane
        for lane in lanes
        if isinstance(lane["_id"], int) and lane.get("owner") and lane["lease_until"] > now
    ]
    # A lane's listed claim runs while the delivery is still pending at that generation.
    claims = {(e["d"], e.get("g", 0)) for lane in live for e in lane.get("in_flight") or ()}
    pending = [d for d in deliveries if "due_at" in d]
    states = {
        "pending": sum(d["status"] == "pending" for d in deliveries),
        "parked": sum(d.get("lane") == "parked" for d in deliveries),
        "running": sum((d["_id"], d.get("claims", 0)) in claims for d in pending),
        "dead": sum(d["status"] == "dead" for d in deliveries),
    }
    return {
        **{
            key("mongoq_outbox_deliveries", queue=PREFIX, state=s): float(n)
            for s, n in states.items()
        },
        key("mongoq_outbox_oldest_due_age_seconds", queue=PREFIX): age(
            now, [d["due_at"] for d in pending]
        ),
        key("mongoq_outbox_lanes_held", queue=PREFIX): float(len(live)),
        **up("outbox", PREFIX, 1.0),
    }


# ---------------------------------------------------------------------------- the scenario


async def tasks_in_every_status(queue: AsyncTaskQueue, clock: ManualClock) -> None:
    """One task each: processing with an expired lease, failed, done, removed, pending due."""
    for task_id in ("a", "b", "c", "d", "e"):
        await queue.put(task_id)
        clock.advance(1)  # distinct due times: the claims' order is the puts' order
    await claim_one(queue, expect="a")
    assert await queue.fail(await claim_one(queue, expect="b"), "broken")
    assert await queue.complete(await claim_one(queue, expect="c"))
    assert await queue.remove("d")
    await queue.put("later", delay=3600)
    clock.advance(LEASE_TTL + 1)


async def groups_in_every_state(transport: AsyncGroupTransport, clock: ManualClock) -> None:
    """Of four groups (never claimed, so claimed in no set order): one in flight, one parked
    by a nack, one whose head is dead-lettered, one ready."""
    for group in ("g1", "g1", "g2", "g3", "g4"):
        await transport.publish(group, {"group": group})
    clock.advance(7)
    held = [await transport.claim("w") for _ in range(3)]
    assert held[1] is not None and held[2] is not None and held[0] is not None
    assert await transport.nack(held[1], delay=60, error="later")
    assert await transport.dead_letter(held[2], "permanent")


async def outbox_in_every_state(outbox: AsyncOutbox, clock: ManualClock) -> None:
    """A keyed head rescheduled (its successor parked), one delivery buried, others running."""
    await outbox.publish([event(1, "k"), event(2, "k")], session=None)
    clock.advance(1)  # the keyed ones are due first: the first claim takes e1
    await outbox.publish([event(3), event(4)], session=None)
    [head] = await outbox.claim("w", limit=1)
    assert head.event.id == "e1"
    assert await outbox.reschedule(head, delay=600)
    claimed = await outbox.claim("w", limit=4)
    assert claimed, "the unkeyed deliveries are claimable"
    assert await outbox.bury(claimed[0], error="permanent")


async def test_the_gauges_equal_what_the_database_holds(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    transport = await new_transport(db, clock)
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H)
    e_due = clock.now() + timedelta(seconds=4)  # the fifth put, one second apart
    await tasks_in_every_status(queue, clock)
    published = clock.now()
    await groups_in_every_state(transport, clock)
    await outbox_in_every_state(outbox, clock)
    clock.advance(3)

    samples = await scrape(collecting(queue, transport, outbox))

    now = clock.now()
    assert of_queue(samples, "tasks", QUEUE) == await tasks_in_db(db, now)
    assert of_queue(samples, "groups", GROUPS) == await groups_in_db(db, now)
    assert of_queue(samples, "outbox", PREFIX) == await outbox_in_db(db, now)
    # The scenario reached every state it meant to (the comparisons above are not vacuous).
    tasks = by_label(samples, "mongoq_tasks", "status")
    assert tasks == {
        "pending": 2,
        "processing": 1,
        "done": 1,
        "failed": 1,
        "cancelled": 0,
        "tombstone": 1,
    }
    assert samples[key("mongoq_tasks_expired", queue=QUEUE)] == 1
    oldest_task = samples[key("mongoq_tasks_oldest_due_age_seconds", queue=QUEUE)]
    assert oldest_task == (now - e_due).total_seconds() > LEASE_TTL
    groups = by_label(samples, "mongoq_groups", "state")
    assert (groups["in_flight"], groups["parked"], groups["ready"] >= 1) == (1, 1, True)
    assert samples[key("mongoq_group_dead_letters", queue=GROUPS)] == 1
    oldest_message = samples[key("mongoq_group_oldest_message_age_seconds", queue=GROUPS)]
    assert oldest_message == (now - published).total_seconds() > 0
    deliveries = by_label(samples, "mongoq_outbox_deliveries", "state")
    assert (deliveries["parked"], deliveries["dead"], deliveries["running"] >= 1) == (1, 1, True)


async def test_a_scrape_shows_every_task_status_even_when_empty(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)

    samples = await scrape(collecting(queue))

    assert of_queue(samples, "tasks", QUEUE) == await tasks_in_db(db, clock.now())
    assert samples[key("mongoq_tasks", queue=QUEUE, status="pending")] == 0
    assert samples[key("mongoq_tasks_oldest_due_age_seconds", queue=QUEUE)] == 0


async def test_the_due_tasks_no_running_worker_runs_have_a_series_per_function(
    db: Any, clock: ManualClock
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("b-1", function="b")
    await queue.put("b-2", function="b")
    await queue.put("plain-1")
    await queue.put("a-1", function="a")
    registry = collecting(queue)
    # No worker running: nothing to compare the functions with, no series.
    assert by_label(await scrape(registry), "mongoq_tasks_unknown_function_due", "function") == {}

    await queue._presence.announce("w-1", ["a"], LEASE_TTL)

    samples = await scrape(registry)
    unknown = by_label(samples, "mongoq_tasks_unknown_function_due", "function")
    assert unknown == {"b": 2, "": 1}  # a plain task: no Jobs worker runs it
    assert samples[key("mongoq_tasks_unknown_function_due", queue=QUEUE, function="b")] == 2
    clock.advance(LEASE_TTL)  # the worker's presence expires
    assert by_label(await scrape(registry), "mongoq_tasks_unknown_function_due", "function") == {}


async def test_a_scrape_costs_a_fixed_number_of_commands_whatever_the_backlog(
    db: Any, clock: ManualClock
) -> None:
    counter = CommandCounter()
    counted = instrument(db, counter)
    queue = await new_queue(counted, clock)
    transport = await new_transport(counted, clock)
    outbox = await new_outbox(counted, clock, subscriptions=ONLY_H)
    registries = {kind: collecting(p) for kind, p in (("tasks", queue), ("groups", transport))}
    registries["outbox"] = collecting(outbox)

    async def costs() -> dict[str, int]:
        found = {}
        for kind, registry in registries.items():
            counter.reset()
            await scrape(registry)
            found[kind] = counter.total
        return found

    assert await costs() == {"tasks": 10, "groups": 6, "outbox": 5}
    for n in range(40):
        await queue.put(f"t{n}")
        await transport.publish(f"g{n % 7}", n)
    await outbox.publish([event(n) for n in range(40)], session=None)
    assert await costs() == {"tasks": 10, "groups": 6, "outbox": 5}
    # Deliveries running on held lanes: one more read, to tell them from stale listings.
    assert await outbox.claim("w", limit=8)
    assert await costs() == {"tasks": 10, "groups": 6, "outbox": 6}
    # With completion history, one more: its (estimated) count.
    history = AsyncOutbox(
        counted, "obh_", subscriptions=ONLY_H, completion_history=True, clock=clock
    )
    await history.setup()
    registries = {"outbox": collecting(history)}
    assert await costs() == {"outbox": 6}


# ------------------------------------------------------------------------------ failed reads


async def test_a_read_that_fails_is_reported_not_raised(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    faults = FaultInjector()
    queue = await new_queue(instrument(db, faults), clock)
    transport = await new_transport(db, clock)
    await queue.put("t1")
    registry = collecting(queue, transport)
    faults.fail_before("count_documents", collection=QUEUE, error=AutoReconnect("primary gone"))

    with caplog.at_level(logging.WARNING, logger="mongoq.metrics"):
        samples = await scrape(registry)

    assert of_queue(samples, "tasks", QUEUE) == up("tasks", QUEUE, 0.0, errors=1.0)
    assert of_queue(samples, "groups", GROUPS) == await groups_in_db(db, clock.now())
    [record] = [r for r in caplog.records if r.name == "mongoq.metrics"]
    assert record.levelno == logging.WARNING
    assert f"tasks {QUEUE!r}" in record.getMessage() and "primary gone" in record.getMessage()

    # The next scrape reads it again; the error count stays.
    samples = await scrape(registry)
    expected = await tasks_in_db(db, clock.now())
    expected[key("mongoq_scrape_errors_total", primitive="tasks", queue=QUEUE)] = 1.0
    assert of_queue(samples, "tasks", QUEUE) == expected


async def test_a_read_that_hangs_times_out_as_a_failure(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    faults = FaultInjector()
    queue = await new_queue(instrument(db, faults), clock)
    pause = faults.pause_before("count_documents", collection=QUEUE)
    # The read waits for a release that comes only after the scrape: down, whatever the
    # timing, after a hundredth of a second.
    with caplog.at_level(logging.WARNING, logger="mongoq.metrics"):
        samples = await scrape(collecting(queue, timeout=0.01))
    pause.release()

    assert pause.reached.is_set()
    assert of_queue(samples, "tasks", QUEUE) == up("tasks", QUEUE, 0.0, errors=1.0)
    assert "timed out after 0.01 s" in caplog.text


async def test_a_scrape_that_cannot_run_at_all_reports_every_primitive_down(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    queue = await new_queue(db, clock)
    transport = await new_transport(db, clock)
    portal = Portal()
    portal.close()  # a closed portal refuses every call
    registry = CollectorRegistry()
    registry.register(StatsCollector([queue, transport], call=portal.call))

    with caplog.at_level(logging.WARNING, logger="mongoq.metrics"):
        samples = await scrape(registry)

    assert samples == {**up("tasks", QUEUE, 0.0, 1.0), **up("groups", GROUPS, 0.0, 1.0)}
    assert "closed" in caplog.text


async def test_registering_reads_nothing_and_refuses_a_second_collector_of_the_same_names(
    db: Any, clock: ManualClock
) -> None:
    counter = CommandCounter()
    queue = await new_queue(instrument(db, counter), clock)
    counter.reset()
    # A registry that describes collectors by collecting them would scrape here.
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StatsCollector([queue], call=anyio.from_thread.run))
    assert counter.total == 0
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(StatsCollector([queue], call=anyio.from_thread.run))


async def test_the_collector_refuses_what_it_cannot_read(db: Any, clock: ManualClock) -> None:
    queue = await new_queue(db, clock)
    with pytest.raises(InvalidInput, match="primitives: must be AsyncTaskQueue"):
        StatsCollector([queue, object()], call=anyio.from_thread.run)  # type: ignore[list-item]
    with pytest.raises(InvalidInput, match="given twice"):
        StatsCollector([queue, queue], call=anyio.from_thread.run)
    with pytest.raises(InvalidInput, match="timeout"):
        StatsCollector([queue], call=anyio.from_thread.run, timeout=0)


# ------------------------------------------------------------------------------- run metrics


def handler_for(clock: ManualClock) -> Any:
    async def handler(item: Any, *context: Any) -> None:
        clock.advance(2)  # every handler runs 2 s of the clock
        if getattr(item, "id", None) == "bad" or getattr(item, "event", None) == {"n": "bad"}:
            raise ValueError("bad")

    return handler


@pytest.fixture
def run_metrics() -> Iterator[RunMetrics]:
    with RunMetrics(CollectorRegistry()) as metrics:
        yield metrics


def counted(metrics: RunMetrics, primitive: str, queue: str) -> dict[str, float]:
    """The run counters of one queue, by outcome."""
    samples = parse(generate_latest(metrics.registry).decode())
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in samples.items()
        if name == "mongoq_items_total"
        and dict(labels)["primitive"] == primitive
        and dict(labels)["queue"] == queue
    }


def handler_runs(metrics: RunMetrics, primitive: str, queue: str) -> tuple[float, float]:
    """(count, sum) of the handler-duration histogram of one queue."""
    labels = {"primitive": primitive, "queue": queue}
    count = metrics.registry.get_sample_value("mongoq_handler_seconds_count", labels)
    total = metrics.registry.get_sample_value("mongoq_handler_seconds_sum", labels)
    return count or 0.0, total or 0.0


def nonzero(summary: Any) -> dict[str, float]:
    return {k: float(v) for k, v in dataclasses.asdict(summary).items() if v}


async def test_the_run_counters_equal_the_run_summary(
    db: Any, clock: ManualClock, run_metrics: RunMetrics
) -> None:
    queue = await new_queue(db, clock)
    await queue.put("good")
    await queue.put("bad")

    summary = await queue.run(handler_for(clock), stop_when_empty=True)

    assert nonzero(summary) == {"claimed": 2, "completed": 1, "retried": 1}
    assert counted(run_metrics, "tasks", QUEUE) == nonzero(summary)
    assert handler_runs(run_metrics, "tasks", QUEUE) == (2, 4.0)
    statuses = {d["_id"]: d["status"] for d in await db[QUEUE].find({}).to_list(None)}
    assert statuses == {"good": "done", "bad": "pending"}
    # 2 s falls in the bucket up to 2.5 s, not below.
    labels = {"primitive": "tasks", "queue": QUEUE}
    bucket = run_metrics.registry.get_sample_value
    assert bucket("mongoq_handler_seconds_bucket", {**labels, "le": "1.0"}) == 0
    assert bucket("mongoq_handler_seconds_bucket", {**labels, "le": "2.5"}) == 2
    # Both due when put: the first claimed at once, the second after the first's 2 s.
    assert bucket("mongoq_start_delay_seconds_count", labels) == 2
    assert bucket("mongoq_start_delay_seconds_sum", labels) == 2.0


async def test_group_runs_and_dispatchers_are_counted_too(
    db: Any, clock: ManualClock, run_metrics: RunMetrics
) -> None:
    transport = await new_transport(db, clock)
    await transport.publish("g", {"n": "good"})
    await transport.publish("h", {"n": "bad"})
    outbox = await new_outbox(db, clock, subscriptions=ONLY_H)
    await outbox.publish([event(1), event(2)], session=None)

    groups = await transport.run(handler_for(clock), stop_when_empty=True, retry_delay=10)
    dispatch = await OutboxDispatcher(outbox, {"h": handler_for(clock)}).run(stop_when_empty=True)

    assert counted(run_metrics, "groups", GROUPS) == nonzero(groups)
    assert counted(run_metrics, "outbox", PREFIX) == nonzero(dispatch)
    assert nonzero(groups) == {"claimed": 2, "acked": 1, "retried": 1}
    assert nonzero(dispatch) == {"claimed": 2, "completed": 2}
    assert handler_runs(run_metrics, "groups", GROUPS) == (2, 4.0)
    assert handler_runs(run_metrics, "outbox", PREFIX) == (2, 4.0)
    assert await db[f"{GROUPS}_messages"].count_documents({}) == 1  # the nacked one stays
    assert await db[f"{PREFIX}deliveries"].count_documents({}) == 0


async def test_run_metrics_start_and_stop_are_idempotent(db: Any, clock: ManualClock) -> None:
    metrics = RunMetrics(CollectorRegistry())
    queue = await new_queue(db, clock)
    metrics.start()
    metrics.start()  # still one subscription: nothing is counted twice
    await queue.put("one")
    await queue.run(handler_for(clock), stop_when_empty=True)
    metrics.stop()
    metrics.stop()
    await queue.put("two")
    await queue.run(handler_for(clock), stop_when_empty=True)  # not heard

    assert counted(metrics, "tasks", QUEUE) == {"claimed": 1, "completed": 1}
    assert not metrics.started
    assert (await db[QUEUE].find_one({"_id": "two"}))["status"] == "done"


# ------------------------------------------------------------------------------------ serve


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


@pytest.fixture
def embedded_as_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let `serve` export from the embedded backend, which it refuses (new and empty in the
    exporter's process, it holds nothing): these tests serve over HTTP, with no server."""
    monkeypatch.setattr(serve.__module__ + "._fresh_embedded", lambda db: False)


@pytest.mark.usefixtures("embedded_as_a_server")
def test_serve_exports_over_http_until_closed() -> None:
    server = serve(
        0, uri="memory://", tasks=["emails"], groups=["orders"], outbox=["ob_"], addr="127.0.0.1"
    )
    try:
        assert isinstance(server, MetricsServer) and server.port > 0
        samples = parse(get(server.url))
    finally:
        server.close()
    server.close()  # idempotent

    assert samples[key("mongoq_tasks", queue="emails", status="pending")] == 0
    assert samples[key("mongoq_up", primitive="tasks", queue="emails")] == 1
    assert samples[key("mongoq_groups", queue="orders", state="ready")] == 0
    assert samples[key("mongoq_up", primitive="groups", queue="orders")] == 1
    assert samples[key("mongoq_outbox_deliveries", queue="ob_", state="pending")] == 0
    assert samples[key("mongoq_up", primitive="outbox", queue="ob_")] == 1
    assert not server._thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        get(server.url)


@pytest.mark.usefixtures("embedded_as_a_server")
def test_serve_on_a_port_in_use_raises_and_leaves_no_thread_behind() -> None:
    before = set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            serve(taken.getsockname()[1], uri="memory://", tasks=["emails"], addr="127.0.0.1")
    assert set(threading.enumerate()) <= before  # the portal's thread was stopped


@pytest.mark.parametrize("uri", [None, "memory://"])
def test_serve_refuses_the_embedded_backend_and_says_how_to_name_a_server(
    uri: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded backend is a new, empty database in the exporter's own process: its
    ``mongoq_up 1`` and zeros would make a misspelt queue look healthy and idle."""
    monkeypatch.delenv("MONGOQ_URI", raising=False)
    before = set(threading.enumerate())
    with pytest.raises(InvalidInput) as error:
        serve(0, uri=uri, tasks=["emails"], addr="127.0.0.1")
    assert error.value.field == "uri"
    message = str(error.value)
    assert "\n" not in message
    for words in ("embedded backend", "new, empty database", "nothing to export", "mongodb://",
                  "MONGOQ_URI"):  # fmt: skip
        assert words in message, message
    assert set(threading.enumerate()) <= before  # the portal's thread was stopped


def test_serve_refuses_bad_arguments_before_starting_anything() -> None:
    with pytest.raises(InvalidInput, match="name at least one"):
        serve(0, uri="memory://")
    with pytest.raises(InvalidInput, match="tasks: must be a list"):
        serve(0, uri="memory://", tasks="emails")
    with pytest.raises(InvalidInput, match="port"):
        serve(70000, uri="memory://", tasks=["emails"])


# ---------------------------------------------------------------------------- the extra


def test_without_prometheus_client_the_import_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "prometheus_client"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "mongoq.metrics")

    with pytest.raises(
        MongoqError,
        match=r"mongoq\.metrics needs the 'metrics' extra: pip install 'mongoq-queue\[metrics\]'",
    ):
        importlib.import_module("mongoq.metrics")


def service_rounds(metrics: RunMetrics, service: str, outcome: str) -> float:
    labels = {"primitive": "tasks", "queue": QUEUE, "service": service, "outcome": outcome}
    return metrics.registry.get_sample_value("mongoq_service_rounds_total", labels) or 0.0


async def test_the_maintenance_services_rounds_are_counted_ran_or_failed(
    db: Any, clock: ManualClock, run_metrics: RunMetrics
) -> None:
    faults = FaultInjector()
    # The first reclaim round (a slot found nothing: it runs when idle) loses its connection.
    faults.fail_before("update_many", collection=QUEUE, error=AutoReconnect("connection reset"))
    queue = await new_queue(instrument(db, faults), clock)
    await queue.put("t")

    await queue.run(handler_for(clock), stop_when_empty=True)
    await queue.run(handler_for(clock), stop_when_empty=True)

    assert [op.name for op in faults.triggered] == ["update_many"]
    assert service_rounds(run_metrics, "reclaim", "failed") == 1
    assert service_rounds(run_metrics, "reclaim", "ran") == 1
    assert (await db[QUEUE].find_one({"_id": "t"}))["status"] == "done"
