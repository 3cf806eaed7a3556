"""OpenTelemetry tracing of task functions (the ``otel`` extra): a PRODUCER span per defer whose
context the task document carries (``payload.trace``), a CONSUMER span per call that continues
that trace, with the messaging attributes and the attempt's outcome. Each test passes its own
SDK provider with an in-memory exporter; none sets the global one."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import mongoq_sync
from mongoq import InvalidInput, Jobs, PermanentError
from mongoq.testing import ManualClock
from tests.support.helpers import wait_for

WORKER = "worker-1"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    # Not registered at exit: the suite builds one per test.
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def traced_jobs(db: Any, clock: ManualClock, provider: Any, **options: Any) -> Jobs:
    options = {"lease_ttl": 60, "backoff_base": 1, "backoff_cap": 1, **options}
    return Jobs(db, clock=clock, tracer_provider=provider, **options)


def spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


async def stored(db: Any, queue: str, task_id: str) -> dict[str, Any]:
    doc = await db[queue].find_one({"_id": task_id})
    assert doc is not None
    return dict(doc)


def messaging(operation: str, queue: str, task_id: str, function: str) -> dict[str, Any]:
    return {
        "messaging.system": "mongoq",
        "messaging.operation.name": operation,
        "messaging.operation.type": operation,
        "messaging.destination.name": queue,
        "messaging.message.id": task_id,
        "mongoq.function": function,
    }


async def test_a_defer_is_a_producer_span_whose_context_the_task_document_carries(
    db: Any, clock: ManualClock, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    jobs = traced_jobs(db, clock, provider)

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> str:
        return to

    await jobs.setup()
    with provider.get_tracer("app").start_as_current_span("signup"):
        task_id = await send_email.defer("ada@example.com")
    again = await send_email.options(task_id=task_id).defer("ada@example.com")  # a replay

    (signup,) = spans(exporter, "signup")
    first, replay = spans(exporter, "send emails")
    assert first.kind is SpanKind.PRODUCER and first.parent is not None
    assert first.parent.span_id == signup.context.span_id
    assert first.context.trace_id == signup.context.trace_id
    assert dict(first.attributes or {}) == {
        **messaging("send", "emails", task_id, "send_email"), "mongoq.outcome": "inserted",
    }  # fmt: skip
    assert first.status.status_code is StatusCode.UNSET
    # A replayed put changes nothing, the carrier stored first included.
    assert (again, (replay.attributes or {})["mongoq.outcome"]) == (task_id, "unchanged")
    assert replay.parent is None  # deferred outside any span: a trace of its own

    payload = (await stored(db, "emails", task_id))["payload"]
    assert payload == {
        "args": [], "kwargs": {"to": "ada@example.com"},
        "trace": {"traceparent": traceparent(first)},
    }  # fmt: skip
    assert (await jobs.queue("emails").get(task_id)).payload["trace"] == payload["trace"]


async def test_the_workers_consumer_span_continues_the_trace_of_the_defer(
    db: Any, clock: ManualClock, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    jobs, current = traced_jobs(db, clock, provider), list[trace.SpanContext]()

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> str:
        current.append(trace.get_current_span().get_span_context())
        return f"sent to {to}"

    await jobs.setup()
    task_id = await send_email.defer("ada@example.com")
    await jobs.run(stop_when_empty=True, worker_id=WORKER)

    (send,) = spans(exporter, "send emails")
    (process,) = spans(exporter, "process emails")
    assert process.kind is SpanKind.CONSUMER
    assert process.context.trace_id == send.context.trace_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert dict(process.attributes or {}) == {
        **messaging("process", "emails", task_id, "send_email"),
        "messaging.client.id": WORKER, "mongoq.attempt": 1, "mongoq.outcome": "done",
    }  # fmt: skip
    assert process.status.status_code is StatusCode.UNSET
    assert current == [process.context]  # the function runs in the span: its own are children
    assert (await stored(db, "emails", task_id))["status"] == "done"


async def test_a_failing_call_is_retry_then_failed_with_its_error_recorded(
    db: Any, clock: ManualClock, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    jobs = traced_jobs(db, clock, provider, max_attempts=2)

    @jobs.task(queue="emails", name="flaky")
    async def flaky() -> None:
        raise ConnectionError("try again")

    await jobs.setup()
    task_id = await flaky.defer()
    await jobs.run(stop_when_empty=True)
    clock.advance(5)  # past the retry's backoff
    await jobs.run(stop_when_empty=True)

    (send,) = spans(exporter, "send emails")
    first, last = spans(exporter, "process emails")
    assert [(s.attributes or {})["mongoq.attempt"] for s in (first, last)] == [1, 2]
    assert [(s.attributes or {})["mongoq.outcome"] for s in (first, last)] == ["retry", "failed"]
    for span in (first, last):
        assert span.parent is not None and span.parent.span_id == send.context.span_id
        assert span.status.status_code is StatusCode.ERROR
        assert (span.attributes or {})["error.type"] == "ConnectionError"
        (event,) = span.events
        assert event.name == "exception"
        assert "try again" in str((event.attributes or {})["exception.message"])
    assert (await stored(db, "emails", task_id))["status"] == "failed"


async def test_a_final_error_says_failed_with_the_type_of_what_the_function_raised(
    db: Any, clock: ManualClock, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A `PermanentError`, or an exception the function's `retry_on` does not retry, ends the
    task at its first attempt; a timeout is a retry or a failure like any error, its type
    `HandlerTimeout`."""
    jobs = traced_jobs(db, clock, provider)

    @jobs.task(queue="q", name="refuse")
    async def refuse() -> None:
        raise PermanentError("never")

    @jobs.task(queue="q", name="picky", retry_on=(OSError,))
    async def picky() -> None:
        raise ValueError("not an OSError")

    @jobs.task(queue="slow", name="slow", timeout=5, max_attempts=1)
    async def slow() -> None:
        await anyio.sleep_forever()

    await jobs.setup()
    await refuse.defer()
    await picky.defer()
    await jobs.run(queues=["q"], stop_when_empty=True)
    await slow.defer()
    async with anyio.create_task_group() as group:
        group.start_soon(partial(jobs.run, queues=["slow"], stop_when_empty=True))
        limit = clock.now() + timedelta(seconds=5)
        await wait_for(lambda: clock.sleeping_until(limit) >= 1, "the call's time limit")
        clock.advance(5)

    outcomes = {
        (s.attributes or {})["mongoq.function"]: (
            (s.attributes or {})["mongoq.outcome"], (s.attributes or {})["error.type"],
            s.status.status_code,
        )
        for s in [*spans(exporter, "process q"), *spans(exporter, "process slow")]
    }  # fmt: skip
    assert outcomes == {
        "refuse": ("failed", "mongoq.errors.PermanentError", StatusCode.ERROR),
        "picky": ("failed", "ValueError", StatusCode.ERROR),
        "slow": ("failed", "mongoq.errors.HandlerTimeout", StatusCode.ERROR),
    }


async def test_a_call_cut_short_by_a_hard_stop_says_cancelled(
    db: Any, clock: ManualClock, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    jobs, started = traced_jobs(db, clock, provider), anyio.Event()

    @jobs.task(queue="emails", name="hang")
    async def hang() -> None:
        started.set()
        await anyio.sleep_forever()

    await jobs.setup()
    await hang.defer()
    async with anyio.create_task_group() as group:
        group.start_soon(jobs.run)
        with anyio.fail_after(20):  # a bound for a hang, never a wait
            await started.wait()
        group.cancel_scope.cancel()

    (process,) = spans(exporter, "process emails")
    assert (process.attributes or {})["mongoq.outcome"] == "cancelled"
    assert process.status.status_code is StatusCode.ERROR
    assert not process.events  # no error of the function's to record


@pytest.mark.parametrize("given", ["global", "no-op"])
async def test_without_a_recording_provider_no_context_is_stored(
    db: Any, clock: ManualClock, given: str
) -> None:
    """The API's no-op (no SDK configured, or a `NoOpTracerProvider`) writes no context: the
    documents of an application without tracing do not grow."""
    if given == "global":  # this suite never sets one: the API's proxy to the no-op
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    provider = None if given == "global" else trace.NoOpTracerProvider()
    jobs, ran = traced_jobs(db, clock, provider), list[str]()

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> None:
        ran.append(to)

    await jobs.setup()
    task_id = await send_email.defer("ada@example.com")
    assert (await stored(db, "emails", task_id))["payload"] == {
        "args": [], "kwargs": {"to": "ada@example.com"},
    }  # fmt: skip
    await jobs.run(stop_when_empty=True)
    assert ran == ["ada@example.com"]


async def test_the_global_provider_is_looked_up_when_used_not_when_built(
    db: Any,
    clock: ManualClock,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = traced_jobs(db, clock, None)  # built before the application configures its SDK

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> None:
        return None

    await jobs.setup()
    # As `trace.set_tracer_provider` would, without changing this process's global one.
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    task_id = await send_email.defer("ada@example.com")
    (send,) = spans(exporter, "send emails")
    assert (await stored(db, "emails", task_id))["payload"]["trace"] == {
        "traceparent": traceparent(send)
    }


async def test_a_task_put_without_a_carrier_runs_in_a_trace_of_its_own(
    db: Any, clock: ManualClock, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A plain put (or a periodic tick) has no carrier, and an unreadable one is ignored: the
    call starts a new trace, linked to the worker's own span when `run` was called in one."""
    jobs, ran = traced_jobs(db, clock, provider), list[str]()

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> None:
        ran.append(to)

    await jobs.setup()
    queue = jobs.queue("emails")
    await queue.put("plain", {"args": ["a"], "kwargs": {}}, function="send_email")
    await queue.put(
        "garbled", {"args": ["b"], "kwargs": {}, "trace": {"traceparent": "00-nonsense"}},
        function="send_email",
    )  # fmt: skip
    with provider.get_tracer("app").start_as_current_span("worker"):
        await jobs.run(stop_when_empty=True)

    (worker,) = spans(exporter, "worker")
    processes = spans(exporter, "process emails")
    assert sorted(ran) == ["a", "b"] and len(processes) == 2
    for process in processes:
        assert process.parent is None
        assert process.context.trace_id != worker.context.trace_id
        assert [link.context.span_id for link in process.links] == [worker.context.span_id]
        assert (process.attributes or {})["mongoq.outcome"] == "done"


async def test_a_payload_with_another_key_is_still_refused(
    db: Any, clock: ManualClock, provider: TracerProvider
) -> None:
    jobs = traced_jobs(db, clock, provider)

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> None:
        return None

    await jobs.setup()
    await jobs.queue("emails").put(
        "odd", {"args": ["a"], "kwargs": {}, "extra": 1}, function="send_email"
    )
    await jobs.run(stop_when_empty=True)
    doc = await stored(db, "emails", "odd")
    assert doc["status"] == "failed" and "holds no call of send_email" in doc["error"]


async def test_a_jobs_like_another_traces_with_its_provider_unless_given_one(
    db: Any, clock: ManualClock, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    jobs = traced_jobs(db, clock, provider)

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> None:
        return None

    await jobs.setup()
    tenant = Jobs(db, like=jobs)
    await tenant.defer(send_email, "ada@example.com")
    assert len(spans(exporter, "send emails")) == 1
    quiet = Jobs(db, like=jobs, tracer_provider=trace.NoOpTracerProvider())
    task_id = await quiet.defer(send_email, "bob@example.com")
    assert len(spans(exporter, "send emails")) == 1
    assert "trace" not in (await stored(db, "emails", task_id))["payload"]


@pytest.mark.parametrize("bad", ["provider", object(), trace.get_tracer("x")])
def test_a_tracer_provider_that_is_not_one_is_refused_naming_the_option(db: Any, bad: Any) -> None:
    with pytest.raises(InvalidInput, match=r"^tracer_provider: must be an OpenTelemetry"):
        Jobs(db, tracer_provider=bad)


def test_without_opentelemetry_installed_tracing_is_a_no_op() -> None:
    """The ``otel`` extra absent: nothing to import fails, the documents hold no context, and a
    provider given anyway is refused, naming the extra."""
    script = textwrap.dedent(
        """\
        import asyncio, sys
        sys.modules["opentelemetry"] = None  # as if the API were not installed
        import mongoq
        from mongoq.testing import memory_database

        async def main():
            db = memory_database()
            jobs = mongoq.Jobs(db)

            @jobs.task(queue="emails", name="send_email")
            async def send_email(to: str) -> str:
                return to

            await jobs.setup()
            task_id = await send_email.defer("ada@example.com")
            print(sorted((await db["emails"].find_one({"_id": task_id}))["payload"]))
            print((await jobs.run(stop_when_empty=True)).completed)
            try:
                mongoq.Jobs(db, tracer_provider=type("P", (), {"get_tracer": print})())
            except mongoq.InvalidInput as error:
                print(error)

        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["['args', 'kwargs']", "1"], result.stdout
    assert lines[2].startswith("tracer_provider: ") and "mongoq-queue[otel]" in lines[2]


class Failing(SimpleSpanProcessor):
    """A span processor that raises at every span's start and end (a broken exporter)."""

    def __init__(self) -> None:
        super().__init__(InMemorySpanExporter())

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("exporter broken at start")

    def on_end(self, span: Any) -> None:
        raise RuntimeError("exporter broken at end")


async def test_a_tracing_failure_never_fails_a_defer_nor_runs_a_call_twice(
    db: Any, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    broken = TracerProvider(shutdown_on_exit=False)
    broken.add_span_processor(Failing())
    jobs, calls = traced_jobs(db, clock, broken), list[str]()

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> str:
        calls.append(to)
        return to

    await jobs.setup()
    caplog.set_level(logging.DEBUG, logger="mongoq.jobs.tracing")
    task_id = await send_email.defer("ada@example.com")  # stored, and said so: no error
    assert [doc["_id"] for doc in await db["emails"].find({}).to_list(None)] == [task_id]

    summary = await jobs.run(stop_when_empty=True)
    assert (summary.completed, summary.retried, calls) == (1, 0, ["ada@example.com"])
    doc = await stored(db, "emails", task_id)
    assert (doc["status"], doc["attempts"], doc["result"]) == ("done", 1, "ada@example.com")
    failures = [r for r in caplog.records if "tracing failed" in r.getMessage()]
    assert failures and failures[0].levelno == logging.WARNING  # once, then quieter
    assert all(r.levelno == logging.DEBUG for r in failures[1:])
    broken.shutdown()


def test_a_blocking_defer_continues_the_calling_threads_span(
    blocking_db: mongoq_sync.Database, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The facade's call into its portal carries the calling thread's context: a Django view's
    request span is the parent of the defer's span."""
    jobs = Jobs(tracer_provider=provider)

    @jobs.task(queue="emails", name="send_email")
    async def send_email(to: str) -> None:
        return None

    producer = mongoq_sync.Jobs(blocking_db, like=jobs, clock=ManualClock())
    with provider.get_tracer("django").start_as_current_span("POST /orders") as request:
        task_id = producer.defer(send_email, "ada@example.com")
    (send,) = spans(exporter, "send emails")
    assert send.parent is not None
    assert send.parent.span_id == request.get_span_context().span_id
    raw = blocking_db.async_database["emails"]
    doc = blocking_db.call(raw.find_one, {"_id": task_id})
    assert doc["payload"]["trace"]["traceparent"] == traceparent(send)
