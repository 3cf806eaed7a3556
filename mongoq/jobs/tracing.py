"""OpenTelemetry tracing of task functions (the ``otel`` extra): a PRODUCER span ``send
<queue>`` around each defer, a CONSUMER span ``process <queue>`` around each call a worker
makes, the second continuing the first's trace. Attributes follow OpenTelemetry's messaging
conventions (``messaging.*``, ``error.type``), plus ``mongoq.function``, ``mongoq.attempt``
and ``mongoq.outcome``.

The defer's context travels in its task document, as the global text-map propagator writes it
(W3C ``traceparent``, ``tracestate`` and ``baggage`` by default): the one field it writes is
``payload.trace``, only when the propagator wrote something, so without a configured SDK the
documents stay as they were. Without ``opentelemetry-api`` installed, tracing is a plain call.
Owns no collections.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Protocol, TypeVar, cast

from mongoq._version import __version__
from mongoq.errors import InvalidInput, PermanentError
from mongoq.tasks.batch import FAILS_AT_ONCE

try:
    # Typed when installed; a type check without the extra sees them as Any.
    from opentelemetry import context as _context  # type: ignore[import-not-found,unused-ignore]
    from opentelemetry import propagate as _propagate  # type: ignore[import-not-found,unused-ignore]
    from opentelemetry import trace as _trace  # type: ignore[import-not-found,unused-ignore]
    from opentelemetry.context import Context  # type: ignore[import-not-found,unused-ignore]

    _INSTALLED = True
except ImportError:  # the `otel` extra is not installed
    _INSTALLED = False

__all__ = ["CARRIER", "TracerProviderLike", "Tracing", "check_tracer_provider"]

log = logging.getLogger("mongoq.jobs.tracing")

T = TypeVar("T")

#: The key of a task function's payload that holds the context of the defer that put it.
CARRIER = "trace"
#: The instrumentation scope of mongoq's spans, and `messaging.system`.
SYSTEM = "mongoq"


class TracerProviderLike(Protocol):
    """What `Jobs(tracer_provider=...)` takes: an OpenTelemetry ``TracerProvider`` (the SDK's,
    or any with ``get_tracer``)."""

    def get_tracer(
        self, instrumenting_module_name: str, instrumenting_library_version: str | None = None, /
    ) -> Any: ...


def check_tracer_provider(field: str, provider: object) -> TracerProviderLike | None:
    """`provider` when it is a tracer provider (None: the global one); else `InvalidInput`."""
    if provider is None:
        return None
    if not callable(getattr(provider, "get_tracer", None)):
        raise InvalidInput(
            field, f"must be an OpenTelemetry TracerProvider (with get_tracer), "
            f"got {type(provider).__name__}",
        )  # fmt: skip
    if not _INSTALLED:
        raise InvalidInput(field, "needs the 'otel' extra: pip install 'mongoq-queue[otel]'")
    return cast(TracerProviderLike, provider)


class Tracing:
    """The spans of one `Jobs`, from `provider` (None: OpenTelemetry's global provider)."""

    __slots__ = ("_failed_before", "_source", "_tracer", "provider")

    def __init__(self, provider: TracerProviderLike | None) -> None:
        self.provider = provider
        self._source: Any = None  # the provider `_tracer` comes from
        self._tracer: Any = None
        self._failed_before = False

    def _recording(self) -> Any:
        """The tracer of the spans; None while nothing would record them (no SDK configured:
        the API's proxy or no-op provider), which spares each task the API's no-op spans."""
        provider = self.provider
        if provider is None or isinstance(provider, _trace.ProxyTracerProvider):
            if self._source is not None:  # the global provider, once set, is set for good
                return self._tracer
            # Looked up at use, not when built: a provider configured after the `Jobs` counts.
            provider = _trace.get_tracer_provider()
        if isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider):
            return None
        if provider is not self._source:
            tracer = provider.get_tracer(SYSTEM, __version__)
            # An SDK disabled by its configuration (OTEL_SDK_DISABLED) hands out a no-op.
            self._tracer = None if isinstance(tracer, _trace.NoOpTracer) else tracer
            self._source = provider
        return self._tracer

    def _guarded(self, step: str, action: Callable[[], T]) -> T | None:
        """`action()`, or None when it raises: a failure of tracing (an SDK's processor, a
        propagator) never fails a defer nor a call, nor makes either run twice. Said once as
        a WARNING, then at DEBUG."""
        try:
            return action()
        except Exception as exc:
            level = logging.DEBUG if self._failed_before else logging.WARNING
            self._failed_before = True
            log.log(
                level, "tracing failed at %s, which goes on untraced: %s: %s", step,
                type(exc).__name__, exc,
                extra={"mongoq_event": "tracing_failed", "mongoq_step": step},
            )  # fmt: skip
            return None

    async def send(
        self,
        queue: str,
        function: str,
        task_id: str,
        payload: dict[str, Any],
        put: Callable[[dict[str, Any]], Awaitable[str]],
    ) -> str:
        """``put(payload)`` (a defer's put, returning its outcome) in a PRODUCER span, the
        span's context stored in `payload` (`CARRIER`) when the propagator writes any."""
        if not _INSTALLED:
            return await put(payload)
        span = self._guarded("send", lambda: self._start_send(queue, function, task_id, payload))
        if span is None:
            return await put(payload)
        try:
            outcome = await put(payload)
        except BaseException as error:
            self._guarded("send", partial(_end, span, None, None, error))
            raise
        self._guarded("send", partial(_end, span, None, outcome, None))
        return outcome

    def _start_send(self, queue: str, function: str, task_id: str, payload: dict[str, Any]) -> Any:
        tracer = self._recording()
        if tracer is None:  # no span; a context the caller was given upstream still travels
            _carry(payload, None)
            return None
        span = tracer.start_span(
            f"send {queue}", kind=_trace.SpanKind.PRODUCER,
            attributes=_attributes("send", queue, task_id, function),
        )  # fmt: skip
        _carry(payload, _trace.set_span_in_context(span))
        return span

    async def process(
        self,
        task: Any,
        function: str,
        queue: str,
        *,
        max_attempts: int,
        worker: str,
        call: Callable[[], Awaitable[T]],
    ) -> T:
        """``call()`` (the run of `task`, a `Task` of `queue`) in a CONSUMER span whose parent
        is the context its defer stored (none: a new trace), current while it runs, with the
        call's outcome."""
        if not _INSTALLED:
            return await call()
        started = self._guarded(
            "process", lambda: self._start_process(task, function, queue, worker)
        )
        if started is None:
            return await call()
        span, token = started
        try:
            result = await call()
        except Exception as error:
            # As the queue settles it (`TaskBatch.settle_failure`): these fail the task,
            # any other error is retried until the queue's attempts are used up.
            final = isinstance(error, FAILS_AT_ONCE) or task.attempts >= max_attempts
            outcome = "failed" if final else "retry"
            self._guarded("process", partial(_end, span, token, outcome, error))
            raise
        except BaseException as error:  # cancelled: its lease lost, or a hard stop
            self._guarded("process", partial(_end, span, token, "cancelled", error))
            raise
        self._guarded("process", partial(_end, span, token, "done", None))
        return result

    def _start_process(self, task: Any, function: str, queue: str, worker: str) -> Any:
        """The call's span, started and made current (with the token that undoes it)."""
        tracer = self._recording()
        if tracer is None:
            return None
        parent, links = _origins(task.payload)
        attributes = _attributes("process", queue, str(task.id), function)
        attributes.update({"messaging.client.id": worker, "mongoq.attempt": task.attempts})
        span = tracer.start_span(
            f"process {queue}", context=parent, kind=_trace.SpanKind.CONSUMER,
            attributes=attributes, links=links,
        )  # fmt: skip
        # Current while the function runs: its own spans, and its defers, continue the trace.
        return span, _context.attach(_trace.set_span_in_context(span))


def _end(span: Any, token: Any, outcome: str | None, error: BaseException | None) -> None:
    """`span` with its outcome (and `error`) ended, and the context before it current again."""
    try:
        if outcome is not None:
            span.set_attribute("mongoq.outcome", outcome)
        if error is not None:
            _failed(span, error)
    finally:
        try:
            span.end()
        finally:
            if token is not None:
                _context.detach(token)


def _carry(payload: dict[str, Any], context: Any) -> None:
    """`context` (None: the current one) into `payload`, when the global propagator writes
    any."""
    carrier: dict[str, str] = {}
    _propagate.inject(carrier, context=context)
    if carrier:
        payload[CARRIER] = carrier


def _attributes(operation: str, queue: str, task_id: str, function: str) -> dict[str, Any]:
    return {
        "messaging.system": SYSTEM,
        "messaging.operation.name": operation,
        "messaging.operation.type": operation,
        "messaging.destination.name": queue,
        "messaging.message.id": task_id,
        "mongoq.function": function,
    }


def _origins(payload: Any) -> tuple[Any, list[Any]]:
    """The parent of a call's span, the context `payload` carries (an empty one: a new
    trace), and its links: to that context, and to the worker's own span when `run` was
    called in one (the conventions' advice when a process span takes the message's parent)."""
    carrier = payload.get(CARRIER) if isinstance(payload, Mapping) else None
    readable = (
        {k: v for k, v in carrier.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(carrier, Mapping)
        else {}
    )
    # An explicit empty context: the worker's current one must not become the parent.
    parent = _propagate.extract(readable, context=Context())
    links = []
    for origin in (_trace.get_current_span(parent), _trace.get_current_span()):
        context = origin.get_span_context()
        if context.is_valid:
            links.append(_trace.Link(context))
    return parent, links


def _failed(span: Any, error: BaseException) -> None:
    span.set_attribute("error.type", _error_type(error))
    if isinstance(error, Exception):  # not a cancellation: the function's own error
        span.record_exception(error)
    span.set_status(_trace.Status(_trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))


def _error_type(error: BaseException) -> str:
    """The class of `error`, by its qualified name (the conventions' ``error.type``). A failure
    the function's policy made final is a `PermanentError` whose cause is what the call raised
    (its `HandlerTimeout` included): that names the class of error."""
    cause = error.__cause__
    origin = cause if isinstance(error, PermanentError) and cause is not None else error
    kind = type(origin)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"
