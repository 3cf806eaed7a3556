"""The limits every primitive keeps alike: NaN and infinity, values
nested too deep or containing themselves, naive datetimes, names the server refuses or whose
collections collide with another primitive's, leases and intervals out of range, listeners on
every interface, and text that would forge a log line. Each refusal is an `InvalidInput`
naming the field, and a refused call writes nothing (asserted on what the database holds)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Any

import bson
import pytest

from mongoq import (
    AsyncGroupTransport,
    AsyncTaskQueue,
    InvalidInput,
    NewMessage,
    NewTask,
    _validation,
    cli,
    registry,
)
from mongoq._text import for_log
from mongoq._validation import (
    INTERVAL_SECONDS,
    LEASE_SECONDS,
    MAX_NAME_BYTES,
    MAX_NESTING,
    check_interval,
    check_lease_seconds,
    check_nesting,
    check_payload,
)
from mongoq.outbox import AsyncOutbox, Event, OutboxDispatcher
from mongoq.testing import ManualClock

#: The task queue, group transport and outbox prefix the tests set up.
QUEUE, PREFIX, OUTBOX = "tasks", "mq", "ob_"


async def stored(db: Any) -> dict[str, Any]:
    """Every collection of `db`: its documents (as BSON, sorted) and its index names."""
    found: dict[str, Any] = {}
    for name in sorted(await db.list_collection_names()):
        docs = await db[name].find({}).to_list(None)
        indexes = await db[name].index_information()
        found[name] = (sorted(bson.encode(doc) for doc in docs), sorted(indexes))
    return found


def nested(levels: int, inner: Any = 1) -> Any:
    """`inner` inside `levels` mappings, alternating with lists: ``{"x": [{"x": [...]}]}``."""
    value = inner
    for level in range(levels):
        value = {"x": value} if level % 2 else [value]
    return value


def containing_itself() -> dict[str, Any]:
    value: dict[str, Any] = {"a": 1}
    value["self"] = value
    return value


class Primitives:
    """A task queue (holding one task, claimed), a group transport and an outbox, set up on
    one database: what every kind of put, publish and completion is tried on."""

    def __init__(self, db: Any, clock: ManualClock) -> None:
        self.db = db
        self.queue = AsyncTaskQueue(db, QUEUE, clock=clock, lease_ttl=30)
        self.groups = AsyncGroupTransport(db, PREFIX, clock=clock, lease_ttl=30)
        self.outbox = AsyncOutbox(db, OUTBOX, subscriptions={"t": ["h"]}, clock=clock)

    async def setup(self) -> Primitives:
        for primitive in (self.queue, self.groups, self.outbox):
            await primitive.setup()
        await self.queue.put("held")
        await self.groups.publish("g", {"keep": True})
        await self.outbox.publish(Event("e0", "t", {"keep": True}), session=None)
        return self

    def calls(self, value: Any) -> dict[str, Callable[[], Awaitable[Any]]]:
        """Each call that stores `value`, by the field its refusal names (before the value's
        own path)."""
        queue, groups, outbox = self.queue, self.groups, self.outbox

        async def complete() -> Any:
            task = await queue.claim("w")
            assert task is not None
            try:
                return await queue.complete(task, value)
            finally:
                await queue.release_for_retry(task)  # the next call claims it again

        return {
            "payload": lambda: queue.put("new", value),
            "tasks[0].payload": lambda: queue.put_many([NewTask("new", value)]),
            "result": complete,
            "event": lambda: groups.publish("g2", value),
            "messages[0].event": lambda: groups.publish_many([NewMessage("g2", value)]),
            "events[0].payload": lambda: outbox.publish(Event("e1", "t", value), session=None),
        }


@pytest.fixture
async def primitives(db: Any, clock: ManualClock) -> Primitives:
    return await Primitives(db, clock).setup()


async def assert_each_refused(primitives: Primitives, value: Any, path: str) -> None:
    """Every call storing `value` raises `InvalidInput` naming its field followed by `path`;
    nothing is written (the claim a completion needs aside)."""
    for field, call in primitives.calls(value).items():
        before = await stored(primitives.db)
        with pytest.raises(InvalidInput) as raised:
            await call()
        assert raised.value.field == f"{field}{path}", (field, str(raised.value))
        assert str(raised.value).startswith(f"{field}{path}: ")
        if field != "result":
            assert await stored(primitives.db) == before, field


# ------------------------------------------------------------------- NaN and infinities


class Measure(float):
    """A float subclass (as NumPy's float64 is)."""


NOT_FINITE = {
    "nan": (math.nan, ""),
    "inf": (math.inf, ""),
    "minus-inf": (-math.inf, ""),
    "nested": ({"price": {"net": math.nan}}, ".price.net"),
    "in-a-list": ({"x": [1.5, -math.inf]}, ".x[1]"),
    "in-a-tuple": ({"x": (1, math.inf)}, ".x[1]"),
    "subclass": ({"m": Measure("nan")}, ".m"),
}


@pytest.mark.parametrize(("value", "path"), list(NOT_FINITE.values()), ids=list(NOT_FINITE))
async def test_nan_and_infinity_are_refused_by_every_primitive(
    primitives: Primitives, value: Any, path: str
) -> None:
    """The outbox always refused them (JSON has neither); a task queue and a group transport
    stored them. Now all three refuse, naming the field, and store nothing."""
    await assert_each_refused(primitives, value, path)


def test_a_decimal128_nan_is_refused_and_finite_numbers_pass() -> None:
    with pytest.raises(InvalidInput, match=r"^payload\.d: must be a finite number"):
        check_payload("payload", {"d": bson.Decimal128("NaN")})
    assert check_payload("payload", {"d": bson.Decimal128("1.5"), "f": 1e308, "z": -0.0}) > 0


# -------------------------------------------------------------- nesting and recursion


@pytest.mark.parametrize(
    "value", [nested(5000), containing_itself(), [containing_itself()]],
    ids=["5000-deep", "containing-itself", "in-a-list"],
)  # fmt: skip
async def test_a_value_nested_too_deep_or_containing_itself_is_refused_not_a_recursion_error(
    primitives: Primitives, value: Any
) -> None:
    for field, call in primitives.calls(value).items():
        if field == "events[0].payload":
            continue  # the outbox's normalize: test_the_outbox_refuses_a_value_nested_too_deep
        before = await stored(primitives.db)
        with pytest.raises(InvalidInput) as raised:
            await call()
        assert raised.value.field == field
        assert f"nests deeper than {MAX_NESTING} levels (or contains itself)" in str(raised.value)
        if field != "result":
            assert await stored(primitives.db) == before


@pytest.mark.parametrize("value", [nested(5000), containing_itself()], ids=["deep", "itself"])
async def test_the_outbox_refuses_a_value_nested_too_deep(
    primitives: Primitives, value: Any
) -> None:
    before = await stored(primitives.db)
    with pytest.raises(InvalidInput) as raised:
        await primitives.outbox.publish(Event("e1", "t", value), session=None)
    assert raised.value.field == "events[0].payload"
    assert await stored(primitives.db) == before


def test_check_nesting_names_the_field_of_a_value_too_deep_for_any_primitive() -> None:
    """What the outbox calls before it normalizes an event's payload and headers."""
    for value in (nested(MAX_NESTING + 1), containing_itself(), nested(5000)):
        with pytest.raises(InvalidInput, match=r"^event\.payload: nests deeper than 90 levels"):
            check_nesting("event.payload", value)
    check_nesting("event.payload", nested(MAX_NESTING - 2, {"a": [1, "b", None]}))  # 90 in all


async def test_a_value_nested_as_deep_as_the_limit_is_stored(
    db: Any, primitives: Primitives
) -> None:
    deepest = nested(MAX_NESTING)
    assert await primitives.queue.put("deep", deepest) == "inserted"
    doc = await db[QUEUE].find_one({"_id": "deep"})
    assert doc is not None and doc["payload"] == deepest
    with pytest.raises(InvalidInput, match="nests deeper"):
        check_payload("payload", nested(MAX_NESTING + 1))


# ------------------------------------------------------------------- naive datetimes


class NoOffset(tzinfo):
    """A tzinfo that knows no offset: Python counts such a datetime as naive."""

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        return None

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str | None:
        return None


NAIVE = {"naive": datetime(2030, 1, 1), "no-offset": datetime(2030, 1, 1, tzinfo=NoOffset())}


@pytest.mark.parametrize("created_at", list(NAIVE.values()), ids=list(NAIVE))
async def test_an_event_created_at_a_naive_datetime_is_refused(
    db: Any, primitives: Primitives, created_at: datetime
) -> None:
    """It was read as UTC; `count_finished` and `run_at` refused a naive datetime."""
    before = await stored(db)
    with pytest.raises(InvalidInput) as raised:
        await primitives.outbox.publish(Event("e1", "t", created_at=created_at), session=None)
    assert raised.value.field == "events[0].created_at"
    assert "timezone-aware" in str(raised.value)
    assert await stored(db) == before


async def test_an_event_created_at_an_instant_out_of_range_is_refused(
    db: Any, primitives: Primitives
) -> None:
    edge = datetime.max.replace(tzinfo=timezone(timedelta(hours=-1)))  # past year 9999 in UTC
    before = await stored(db)
    with pytest.raises(InvalidInput, match=r"^events\[0\]\.created_at: is out of range"):
        await primitives.outbox.publish(Event("e1", "t", created_at=edge), session=None)
    assert await stored(db) == before


async def test_every_other_datetime_argument_refuses_a_naive_one_alike(
    db: Any, primitives: Primitives
) -> None:
    naive, aware = datetime(2030, 1, 1), datetime(2030, 1, 1, tzinfo=UTC)
    before = await stored(db)
    for count_finished in (primitives.queue.count_finished, primitives.outbox.count_finished):
        with pytest.raises(InvalidInput, match=r"^since: must be a timezone-aware"):
            await count_finished(naive)
        with pytest.raises(InvalidInput, match=r"^until: must be None or a timezone-aware"):
            await count_finished(aware, naive)
    with pytest.raises(InvalidInput, match=r"^run_at: must be a timezone-aware"):
        await primitives.queue.put("new", run_at=naive)
    assert await stored(db) == before


@pytest.mark.parametrize("field", ["dead_before", "completed_before"])
async def test_an_outbox_purge_refuses_a_naive_cutoff(
    db: Any, primitives: Primitives, field: str
) -> None:
    before = await stored(db)
    with pytest.raises(InvalidInput) as raised:
        await primitives.outbox.purge(**{field: datetime(2030, 1, 1)})
    assert raised.value.field == field
    assert await stored(db) == before


# ------------------------------------------------------------------------------- names

BAD_NAMES = {
    "leading-dot": ".x",
    "double-dot": "a..b",
    "only-dots": "..",
    "line-break": "a\nb",
    "tab": "a\tb",
    "escape": "a\x1b[31m",
    "too-long": "x" * (MAX_NAME_BYTES + 1),
    "too-long-in-utf-8": "ї" * (MAX_NAME_BYTES // 2 + 1),  # 2 bytes each
    "lone-surrogate": "a\udc80",
    "empty": "",
    "dollar": "a$b",
    "nul": "a\x00b",
}


@pytest.mark.parametrize("name", list(BAD_NAMES.values()), ids=list(BAD_NAMES))
async def test_a_name_the_server_refuses_is_invalid_input_naming_it(
    db: Any, clock: ManualClock, name: str
) -> None:
    """PyMongo raised its own `InvalidName` for ``.x`` or ``..``, and a 100,000-character name
    was accepted (the namespace ``<db>.<collection>`` is at most 255 bytes)."""
    for build, field in (
        (lambda: AsyncTaskQueue(db, name, clock=clock), "name"),
        (lambda: AsyncGroupTransport(db, name, clock=clock), "prefix"),
        (lambda: AsyncOutbox(db, name, subscriptions={}, clock=clock), "prefix"),
    ):
        with pytest.raises(InvalidInput) as raised:
            build()
        assert raised.value.field == field
    assert await db.list_collection_names() == []


async def test_a_trailing_dot_is_refused_only_where_the_name_is_a_whole_collection(
    db: Any, clock: ManualClock
) -> None:
    with pytest.raises(InvalidInput, match=r"^name: must not start or end with '.'"):
        AsyncTaskQueue(db, "jobs.", clock=clock)
    transport = AsyncGroupTransport(db, "shop.", clock=clock)  # shop._messages, ...
    outbox = AsyncOutbox(db, "shop.", subscriptions={"t": ["h"]}, clock=clock)  # shop.events
    await transport.setup()
    await outbox.setup()
    assert {"shop._messages", "shop.events"} <= set(await db.list_collection_names())


async def test_the_longest_name_fits_every_namespace(db: Any, clock: ManualClock) -> None:
    """A database name is at most 63 bytes; with the longest suffix a primitive appends, a
    name of `MAX_NAME_BYTES` still fits the server's 255-byte namespace."""
    longest = "x" * MAX_NAME_BYTES
    for kind in ("tasks", "groups", "outbox"):
        for collection in registry.collections_of(kind, longest):
            assert 63 + 1 + len(collection.encode()) <= 255, collection
    queue = AsyncTaskQueue(db, longest, clock=clock)
    await queue.setup()
    assert await queue.put("t1") == "inserted"


async def test_the_registry_knows_every_collection_each_primitive_uses(
    db: Any, clock: ManualClock
) -> None:
    queue = AsyncTaskQueue(db, "jobs", clock=clock)
    transport = AsyncGroupTransport(db, "orders", clock=clock)
    outbox = AsyncOutbox(db, "shop_", subscriptions={}, clock=clock)
    used = {
        "tasks": {queue.collection.name, queue._scheduler.collection.name,
                  queue._presence.collection.name},
        "groups": {c.name for c in (transport.messages, transport.locks, transport.counters,
                                    transport.dead)},
        "outbox": {c.name for c in (outbox.events, outbox.deliveries, outbox.sequences,
                                    outbox.lanes, outbox.history)},
    }  # fmt: skip
    assert set(registry.collections_of("tasks", "jobs")) == used["tasks"]
    assert set(registry.collections_of("groups", "orders")) == used["groups"]
    assert set(registry.collections_of("outbox", "shop_")) == used["outbox"]


# ---------------------------------------------------------------- colliding collections


def task_queue(db: Any, clock: ManualClock, name: str) -> Any:
    return AsyncTaskQueue(db, name, clock=clock)


def group_transport(db: Any, clock: ManualClock, name: str) -> Any:
    return AsyncGroupTransport(db, name, clock=clock)


def outbox_of(db: Any, clock: ManualClock, name: str) -> Any:
    return AsyncOutbox(db, name, subscriptions={"t": ["h"]}, clock=clock)


COLLISIONS = {
    # first set up, then the one refused: (kind, name) each, the field, both titles
    "groups-then-queue": ((group_transport, "g"), (task_queue, "g_messages"), "name",
                          "task queue 'g_messages'", "group transport 'g'"),
    "queue-then-groups": ((task_queue, "g_messages"), (group_transport, "g"), "prefix",
                          "group transport 'g'", "task queue 'g_messages'"),
    "queue-then-outbox": ((task_queue, "ob_events"), (outbox_of, "ob_"), "prefix",
                          "outbox 'ob_'", "task queue 'ob_events'"),
    "outbox-then-queue": ((outbox_of, "ob_"), (task_queue, "ob_events"), "name",
                          "task queue 'ob_events'", "outbox 'ob_'"),
    "queue-then-queue": ((task_queue, "a"), (task_queue, "a_schedules"), "name",
                         "task queue 'a_schedules'", "task queue 'a'"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("first", "second", "field", "refused", "other"),
    list(COLLISIONS.values()),
    ids=list(COLLISIONS),
)
async def test_a_primitive_whose_collections_are_anothers_is_refused_at_setup(
    db: Any, clock: ManualClock, first: Any, second: Any, field: str, refused: str, other: str
) -> None:
    """It was set up, and the other's documents later failed with ``KeyError: 'type'``."""
    (make_first, first_name), (make_second, second_name) = first, second
    await make_first(db, clock, first_name).setup()
    entries = await registry.registered(db)

    with pytest.raises(InvalidInput) as raised:
        await make_second(db, clock, second_name).setup()

    assert raised.value.field == field
    message = str(raised.value)
    assert refused in message and other in message, message
    assert await registry.registered(db) == entries


@pytest.mark.parametrize(
    ("first", "second"),
    [(COLLISIONS[case][0], COLLISIONS[case][1]) for case in ("queue-then-groups",
                                                              "queue-then-outbox")],
    ids=["groups", "outbox"],
)  # fmt: skip
async def test_a_colliding_transport_or_outbox_writes_nothing(
    db: Any, clock: ManualClock, first: Any, second: Any
) -> None:
    (make_first, first_name), (make_second, second_name) = first, second
    queue = make_first(db, clock, first_name)
    await queue.setup()
    await queue.put("t1", {"keep": True})
    before = await stored(db)
    with pytest.raises(InvalidInput):
        await make_second(db, clock, second_name).setup()
    assert await stored(db) == before


async def test_a_colliding_task_queue_writes_nothing(db: Any, clock: ManualClock) -> None:
    """The check runs at the end of the queue's setup (in `register`) until the queue calls
    `registry.check_collections` first: its indexes land on the transport's messages."""
    await AsyncGroupTransport(db, "g", clock=clock).setup()
    before = await stored(db)
    with pytest.raises(InvalidInput):
        await AsyncTaskQueue(db, "g_messages", clock=clock).setup()
    assert await stored(db) == before


async def test_primitives_that_share_a_name_but_no_collection_are_kept(
    db: Any, clock: ManualClock
) -> None:
    for primitive in (task_queue(db, clock, "orders"), group_transport(db, clock, "orders"),
                      outbox_of(db, clock, "orders")):  # fmt: skip
        await primitive.setup()
        await primitive.setup()  # a restart: the same registration
    found = [(r.primitive, r.name) for r in await registry.registered(db)]
    assert found == [("tasks", "orders"), ("groups", "orders"), ("outbox", "orders")]


# ---------------------------------------------------------------- leases and intervals

BAD_LEASES = [1e-6, 0.49, LEASE_SECONDS[1] + 1]
BAD_INTERVALS = [0.001, INTERVAL_SECONDS[1] + 1]


@pytest.mark.parametrize("lease_ttl", BAD_LEASES)
async def test_a_lease_out_of_range_is_refused_by_the_transport_and_the_outbox(
    db: Any, clock: ManualClock, lease_ttl: float
) -> None:
    """``lease_ttl=1e-6`` was accepted: each handler then ran several times at once."""
    with pytest.raises(InvalidInput, match=r"^lease_ttl: must be from 0.5 to 604800 seconds"):
        AsyncGroupTransport(db, PREFIX, lease_ttl=lease_ttl, clock=clock)
    with pytest.raises(InvalidInput, match=r"^lease_ttl: must be from 0.5 to 604800 seconds"):
        AsyncOutbox(db, OUTBOX, subscriptions={}, lease_ttl=lease_ttl, clock=clock)
    assert await db.list_collection_names() == []


@pytest.mark.parametrize("lease_ttl", BAD_LEASES)
async def test_a_lease_out_of_range_is_refused_by_the_task_queue(
    db: Any, clock: ManualClock, lease_ttl: float
) -> None:
    with pytest.raises(InvalidInput, match=r"^lease_ttl: must be from 0.5"):
        AsyncTaskQueue(db, QUEUE, lease_ttl=lease_ttl, clock=clock)


async def test_the_shortest_and_the_longest_lease_are_taken(clock: ManualClock) -> None:
    from mongoq.testing import memory_database

    for lease_ttl in LEASE_SECONDS:
        assert AsyncGroupTransport(memory_database(), PREFIX, lease_ttl=lease_ttl).lease_ttl == (
            lease_ttl
        )
        outbox = AsyncOutbox(memory_database(), OUTBOX, subscriptions={}, lease_ttl=lease_ttl)
        assert outbox.lease_ttl == lease_ttl


async def never_called(*args: Any) -> None:
    raise AssertionError("nothing may be claimed")


@pytest.mark.parametrize("poll_interval", BAD_INTERVALS)
async def test_a_poll_interval_out_of_range_is_refused_before_anything_is_claimed(
    db: Any, primitives: Primitives, poll_interval: float
) -> None:
    before = await stored(db)
    with pytest.raises(InvalidInput, match=r"^poll_interval: must be from 0.01 to 3600"):
        await primitives.groups.run(never_called, poll_interval=poll_interval,
                                    stop_when_empty=True)  # fmt: skip
    with pytest.raises(InvalidInput, match=r"^poll_interval: must be from 0.01 to 3600"):
        await OutboxDispatcher(primitives.outbox, {"h": never_called}).run(
            poll_interval=poll_interval
        )
    assert await stored(db) == before


@pytest.mark.parametrize("poll_interval", BAD_INTERVALS)
async def test_a_poll_interval_out_of_range_is_refused_by_the_task_queue(
    db: Any, primitives: Primitives, poll_interval: float
) -> None:
    before = await stored(db)
    with pytest.raises(InvalidInput, match=r"^poll_interval: must be from 0.01"):
        await primitives.queue.run(never_called, poll_interval=poll_interval,
                                   stop_when_empty=True)  # fmt: skip
    with pytest.raises(InvalidInput, match=r"^poll_interval: must be from 0.01"):
        await primitives.queue.wait("held", timeout=1, poll_interval=poll_interval)
    assert await stored(db) == before


@pytest.mark.parametrize("value", [True, "5", None, math.nan, math.inf, -1, 0])
def test_lease_and_interval_checks_refuse_what_is_no_duration(value: Any) -> None:
    with pytest.raises(InvalidInput, match=r"^lease_ttl: "):
        check_lease_seconds("lease_ttl", value)
    with pytest.raises(InvalidInput, match=r"^poll_interval: "):
        check_interval("poll_interval", value)
    assert check_lease_seconds("lease_ttl", 30) == 30.0
    assert check_interval("poll_interval", 0.01) == 0.01


# ------------------------------------------------------------------------- listeners


def test_the_metrics_exporter_listens_on_this_machine_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mongoq import metrics

    monkeypatch.setattr(metrics, "_fresh_embedded", lambda db: False)
    assert inspect.signature(metrics.serve).parameters["addr"].default == "127.0.0.1"
    with metrics.serve(0, uri="memory://", tasks=["emails"]) as server:
        assert server._server.server_address[0] == "127.0.0.1"
        assert server.addr == "127.0.0.1"


async def test_mongoq_metrics_listens_on_this_machine_unless_told_and_warns_of_every_interface(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mongoq import metrics

    bound: list[str] = []
    serve = metrics.serve

    def recording(*args: Any, **kwargs: Any) -> Any:
        server = serve(*args, **kwargs)
        bound.append(server._server.server_address[0])
        return server

    async def stop_at_once(url: str) -> None:
        return None

    monkeypatch.setattr(metrics, "_fresh_embedded", lambda db: False)
    monkeypatch.setattr(metrics, "serve", recording)
    monkeypatch.setattr(cli, "_serve_until_stopped", stop_at_once)
    argv = ["metrics", "--port", "0", "--tasks", "jobs", "--uri", "memory://"]

    assert await cli.run(argv) == 0
    assert "warning" not in capsys.readouterr().err
    assert await cli.run([*argv, "--addr", "0.0.0.0"]) == 0
    err = capsys.readouterr().err
    assert "warning: the metrics are reachable on 0.0.0.0" in err
    assert bound == ["127.0.0.1", "0.0.0.0"]


def test_mongoq_worker_serves_its_metrics_on_this_machine_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It bound every interface, with no option to say otherwise."""
    import prometheus_client

    from mongoq.jobs import command

    parser = cli._build_parser()
    assert parser.parse_args(["worker", "app:jobs"]).metrics_addr == "127.0.0.1"
    given = parser.parse_args(["worker", "app:jobs", "--metrics-addr", "0.0.0.0"])
    assert given.metrics_addr == "0.0.0.0"

    bound: list[str] = []
    start = prometheus_client.start_http_server

    def recording(port: int, addr: str = "0.0.0.0", **kwargs: Any) -> Any:
        server, thread = start(port, addr, **kwargs)
        bound.append(str(server.server_address[0]))
        return server, thread

    monkeypatch.setattr(prometheus_client, "start_http_server", recording)
    with command._metrics(0, "127.0.0.1"):
        pass
    assert bound == ["127.0.0.1"]


# ------------------------------------------------------------------------------ logs


def test_for_log_escapes_what_would_forge_a_line_and_keeps_the_rest() -> None:
    assert for_log("order-1") == "order-1"
    assert for_log("Київ 5") == "Київ 5"
    assert for_log("a\nINFO forged") == "a\\nINFO forged"
    assert for_log("a\r\x1b[2K") == "a\\r\\x1b[2K"
    assert for_log("line\u2028separator") == "line\\u2028separator"
    assert for_log(17) == "17"
    assert "\n" not in for_log("x\n" * 3)


@pytest.mark.parametrize("worker_id", ["w\nINFO forged", "w\r", "w\x1b[2K"])
async def test_a_worker_id_that_would_forge_a_log_line_is_refused(
    db: Any, primitives: Primitives, worker_id: str
) -> None:
    """A worker id is shown as is in log lines (``%s``: the loop's name, "claimed ... for")."""
    before = await stored(db)
    with pytest.raises(InvalidInput, match=r"^worker_id: must not contain line breaks"):
        await primitives.queue.claim(worker_id)
    with pytest.raises(InvalidInput, match=r"^worker_id: must not contain line breaks"):
        await primitives.groups.claim(worker_id)
    with pytest.raises(InvalidInput, match=r"^worker_id: must not contain line breaks"):
        await primitives.outbox.claim(worker_id)
    with pytest.raises(InvalidInput, match=r"^worker_id: must not contain line breaks"):
        await OutboxDispatcher(primitives.outbox, {"h": never_called}).run(worker_id=worker_id)
    assert await stored(db) == before


def test_the_limits_are_the_documented_ones() -> None:
    assert LEASE_SECONDS == (0.5, 7 * 24 * 3600.0)
    assert INTERVAL_SECONDS == (0.01, 3600.0)
    assert (MAX_NAME_BYTES, MAX_NESTING) == (128, 90)
    assert LEASE_SECONDS[1] <= _validation.MAX_SECONDS
