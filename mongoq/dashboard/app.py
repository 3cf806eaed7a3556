"""The dashboard's ASGI application (Starlette): its routes, the checks every request and
every action goes through (`mongoq.dashboard.security`), the sampler it runs while served,
and `serve`, which runs it under uvicorn.

Routes: ``/`` (the overview), ``/tasks/{name}``, ``/groups/{prefix}``, ``/outbox/{prefix}``,
one item's page (``/task/{name}?id=``, ``/group/{prefix}?id=``,
``/delivery/{prefix}?event_id=&handler=``), ``/api/overview`` and ``/api/samples`` (JSON),
``/api/chart?key=`` (a chart, SVG), ``/metrics`` (Prometheus text, with the ``metrics``
extra), ``/confirm/{primitive}/{name}/{verb}`` (an action's confirmation page) and
``POST /actions/{primitive}/{name}/{verb}``.

Owns no collections: it reads the registry and the primitives' own operator calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from html import escape
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, quote

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from mongoq import _driver
from mongoq._text import plain
from mongoq._validation import check_seconds
from mongoq.clock import Clock
from mongoq.dashboard import chart, detail, items, pages
from mongoq.dashboard.actions import ACTIONS, Action, field, item_id
from mongoq.dashboard.readings import Catalog, Summary
from mongoq.dashboard.samples import Sampler
from mongoq.dashboard.security import SECURITY_HEADERS, Guard, new_token
from mongoq.errors import InvalidInput, MongoqError
from mongoq.groups import AsyncGroupTransport
from mongoq.outbox import AsyncOutbox
from mongoq.registry import Registration
from mongoq.tasks import AsyncTaskQueue, Task
from mongoq.tasks.models import TaskId

log = logging.getLogger("mongoq.dashboard")

__all__ = ["Dashboard", "bind", "create_app", "serve"]

#: Rows a section of a primitive's page lists (the oldest first).
SECTION_LIMIT = 100
#: The largest action form read (an action's fields are a few short values).
MAX_FORM = 16 * 1024
#: How long a stopped `serve` waits for uvicorn to close its connections and the lifespan.
_SHUTDOWN_WAIT = 10.0
_STATIC = {"dashboard.css": "text/css", "dashboard.js": "text/javascript"}
_Scope = MutableMapping[str, Any]
_ASGI = Callable[[_Scope, Any, Any], Awaitable[None]]


@dataclass
class Dashboard:
    """What one dashboard app holds (``app.state.dashboard``): the primitives it reads, its
    sampler (tests call ``await dashboard.sampler.sample()``), whether actions are allowed,
    and the token they need."""

    catalog: Catalog
    sampler: Sampler
    guard: Guard
    token: str
    allow_actions: bool
    database: str


def create_app(
    db: Any,
    *,
    allow_actions: bool = False,
    token: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
    clock: Clock | None = None,
    sample_interval: float | None = 10.0,
) -> Starlette:
    """The dashboard of the mongoq primitives in `db`, as an ASGI app.

    Read-only unless `allow_actions`; then every action needs `token` (a fresh random one
    when None: read it from ``app.state.dashboard.token`` and give it to the operators).
    The app answers only requests addressed to `allowed_hosts` (default: the loopback
    names; ``["*"]`` for any, behind a proxy that checks them). While served (its lifespan),
    it samples every primitive each `sample_interval` seconds for the throughput chart
    (None: only when told). `clock` is the primitives' clock (default: each its server's).
    """
    if not isinstance(allow_actions, bool):
        raise InvalidInput("allow_actions", "must be a bool")
    if sample_interval is not None:
        sample_interval = check_seconds("sample_interval", sample_interval, positive=True)
    _driver.backend_of(db)  # a clear error for something that is not a database
    catalog = Catalog(db, clock)
    sampler = Sampler(catalog, interval=float(sample_interval or 10.0))
    if not allow_actions:
        token = None  # a read-only dashboard takes no token: nothing to guard
    token = new_token() if token is None else token
    dashboard = Dashboard(catalog, sampler, Guard(token, allowed_hosts), token, allow_actions,
                          str(db.name))  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as group:
            if sample_interval is not None:
                group.start_soon(sampler.run)
            yield
            group.cancel_scope.cancel()

    app = Starlette(routes=_routes(), lifespan=lifespan)
    app.state.dashboard = dashboard
    app.add_middleware(_Checked, guard=dashboard.guard)
    return app


class _Checked:
    """Refuses a request addressed to another host (403), adds the security headers to every
    response, and turns a page that could not be read (the registry refused, a list timed
    out) into the error page, logged, never a bare 500."""

    def __init__(self, app: _ASGI, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: _Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_with_headers(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        host = _header(scope, "host")
        if not self.guard.host_allowed(host):
            log.warning("dashboard: refused a request for host %r", host,
                        extra={"mongoq_host": host})  # fmt: skip
            text = "this dashboard does not answer that host name"
            refused: Response = (
                JSONResponse({"error": text}, 403)
                if str(scope.get("path", "")).startswith("/api/")
                else Response(text, 403, media_type="text/plain")
            )
            await refused(scope, receive, send_with_headers)
            return
        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as exc:
            if started:
                raise
            request = Request(scope)
            # A driver error (the server away, a refused read) is one line, without a
            # traceback: every open page would repeat it each refresh.
            expected = isinstance(exc, _driver.DRIVER_ERRORS)
            log.log(logging.WARNING if expected else logging.ERROR,
                    "dashboard: %s %s failed: %s: %s", request.method, request.url.path,
                    type(exc).__name__, exc, exc_info=None if expected else exc)  # fmt: skip
            text = (f"this page could not be read ({type(exc).__name__}); the dashboard's log "
                    "has the detail")  # fmt: skip
            await _failure(request, 500, text)(scope, receive, send_with_headers)


def _header(scope: _Scope, name: str) -> str | None:
    wanted = name.encode()
    for key, value in scope.get("headers", []):
        if key.lower() == wanted:
            return str(value.decode("latin-1"))
    return None


def _state(request: Request) -> Dashboard:
    dashboard: Dashboard = request.app.state.dashboard
    return dashboard


def _html(
    request: Request, title: str, body: str, status: int = 200, note: str | None = None
) -> HTMLResponse:
    state = _state(request)
    text = pages.page(title, body, database=state.database, actions=state.allow_actions,
                      note=note, refresh=state.sampler.interval)  # fmt: skip
    return HTMLResponse(text, status)


def _failure(request: Request, status: int, message: str) -> Response:
    if _wants_json(request):
        return JSONResponse({"error": message}, status)
    return _html(
        request, "Refused" if status == 403 else "Not possible", pages.error(message), status
    )


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/") or (
        "application/json" in request.headers.get("accept", "")
    )


async def _registered(request: Request, primitive: str | None = None) -> Registration | None:
    primitive = primitive or request.path_params["primitive"]
    return await _state(request).catalog.find(primitive, request.path_params["name"])


def _chart(state: Dashboard, key: str, size: str = "small") -> str:
    sampler = state.sampler
    name = key.partition(":")[2]
    return chart.render(key, name, sampler.points(key), now=sampler.clock.now(),
                        window=sampler.window, size=size)  # fmt: skip


# ------------------------------------------------------------------------------- pages


async def _overview(request: Request) -> Response:
    state = _state(request)
    summaries = await state.catalog.summaries()
    charts = {s.key: _chart(state, s.key) for s in summaries}
    return _html(request, "Overview", pages.overview(summaries, charts))


async def _primitive(request: Request) -> Response:
    if request.path_params["primitive"] not in pages.TITLES or not request.path_params["name"]:
        return _failure(request, 404, "there is no such page on this dashboard")
    found = await _registered(request)
    if found is None:
        return _failure(request, 404, "no such primitive is registered in this database")
    state = _state(request)
    summary = await state.catalog.summary(found)
    opened = state.catalog.open(found)
    actions = state.allow_actions
    sections = await _sections(opened, found.name, actions) if summary.error is None else []
    note = _note(request)
    title = f"{pages.TITLES[found.primitive]} {found.name}"
    shown = _chart(state, summary.key, "large")
    return _html(request, title, pages.primitive_page(summary, shown, sections), note=note)


async def _sections(
    opened: AsyncTaskQueue | AsyncGroupTransport | AsyncOutbox, name: str, actions: bool
) -> list[tuple[str, str]]:
    now = opened.clock.now()
    if isinstance(opened, AsyncTaskQueue):
        # Their payloads and results are not shown here: not read either (each up to 16 MiB).
        failed = await opened.list_tasks("failed", limit=SECTION_LIMIT, payloads=False)
        running = await opened.list_tasks("processing", limit=SECTION_LIMIT, payloads=False)
        pending = await opened.list_tasks("pending", limit=SECTION_LIMIT, payloads=False)
        purgeable = ["done", "failed", "cancelled", "tombstone"]
        return [
            ("Failed tasks", pages.failed_tasks(name, failed.tasks, now, actions)),
            ("Running and pending tasks",
             pages.open_tasks(name, [*running.tasks, *pending.tasks], now, actions)),
            ("Find a task", pages.find_form("task", name, [("id", "task id")], typed=True)),
            *([("Purge finished tasks", pages.purge_form("tasks", name, purgeable))]
              if actions else []),
        ]  # fmt: skip
    if isinstance(opened, AsyncGroupTransport):
        letters = await opened.dead_letters(limit=SECTION_LIMIT)
        parked = await opened.list_groups("parked", limit=SECTION_LIMIT)
        ready = await opened.list_groups("ready", limit=SECTION_LIMIT)
        held = await opened.list_groups("in_flight", limit=SECTION_LIMIT)
        return [
            ("Dead letters", pages.dead_letters(name, letters, now, actions)),
            ("Parked groups (waiting out a retry delay)",
             pages.groups_table(name, parked.groups, "No parked group.", "retried at")),
            ("Ready and in-flight groups",
             pages.groups_table(name, [*held.groups, *ready.groups], "No group is ready or "
                                "in flight.", "claimable (ready) or lease ends")),
            ("Find a group", pages.find_form("group", name, [("id", "group id")], typed=True)),
        ]  # fmt: skip
    dead = await opened.list_deliveries(status="dead", limit=SECTION_LIMIT)
    waiting = await opened.list_deliveries(status="pending", limit=SECTION_LIMIT)  # parked too
    return [
        ("Dead deliveries", pages.deliveries_table(name, dead, now, actions, "No dead delivery.",
                                                   "dead for")),
        ("Pending and parked deliveries", pages.deliveries_table(
            name, waiting, now, actions, "No pending delivery.")),
        ("Find a delivery", pages.find_form(
            "delivery", name, [("event_id", "event id"), ("handler", "handler")], typed=False)),
        *([("Purge dead deliveries", pages.purge_form("outbox", name, []))] if actions else []),
    ]  # fmt: skip


def _note(request: Request) -> str | None:
    """The sentence after an action (``?did=<verb>&count=<n>``): built from known verbs and a
    number only, so a crafted link cannot put words on the page."""
    verb, count = request.query_params.get("did"), request.query_params.get("count", "")
    primitive = request.path_params.get("primitive", "")
    action = ACTIONS.get((primitive, verb or ""))
    if action is None or not count.isdigit():
        return None
    return f"{action.label}: {count} changed."


async def _api_overview(request: Request) -> Response:
    """The counts the overview's script refreshes: the sampler's last sample while it is
    fresh (every open page would otherwise read every primitive's stats again)."""
    state = _state(request)
    summaries: list[Summary] = state.sampler.fresh() or await state.catalog.summaries()
    shown = ("primitive", "name", "counts", "backlog", "oldest_age", "error", "unknown_functions")
    return JSONResponse({"primitives": [
        {**{f: plain(getattr(s, f)) for f in shown}, "key": s.key} for s in summaries
    ]})  # fmt: skip


async def _api_samples(request: Request) -> Response:
    return JSONResponse(_state(request).sampler.series())


async def _api_chart(request: Request) -> Response:
    """One chart as SVG (``?key=tasks:emails&size=small``): what the page's script swaps in."""
    state = _state(request)
    key, size = request.query_params.get("key", ""), request.query_params.get("size", "small")
    if key not in state.sampler.sampled() or size not in chart.SIZES:
        return Response("no such chart", 404, media_type="text/plain")
    return Response(_chart(state, key, size), media_type="image/svg+xml")


async def _metrics(request: Request) -> Response:
    """The registered primitives' stats in Prometheus' text format (`mongoq.metrics`'
    `StatsCollector`), or a plain 404 without the ``metrics`` extra."""
    try:
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import choose_encoder

        from mongoq.metrics import StatsCollector
    except (ImportError, MongoqError):
        text = ("not served: /metrics needs the 'metrics' extra: "
                "pip install 'mongoq-queue[metrics]'")  # fmt: skip
        return Response(text, 404, media_type="text/plain")
    catalog = _state(request).catalog
    primitives = [catalog.open(found) for found in await catalog.registrations()]
    registry = CollectorRegistry()
    # The collector reads synchronously, as a scrape thread would: it runs in a worker thread
    # and hands each read back to this event loop.
    registry.register(StatsCollector(primitives, call=anyio.from_thread.run))
    # The format the scraper asks for (Prometheus' text, or OpenMetrics), as its own server
    # answers.
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    body = await anyio.to_thread.run_sync(encoder, registry)
    return Response(body, headers={"content-type": content_type})


# ------------------------------------------------------------------------------ item pages


async def _item(
    request: Request, primitive: str, read: Callable[[Any, dict[str, str]], Awaitable[Any]],
) -> tuple[Registration, Any] | Response:  # fmt: skip
    """The registration of an item's page and `read` of what its query names, on the opened
    primitive; else the response that says why not (an unregistered primitive, a bad field:
    refused before anything is read)."""
    found = await _registered(request, primitive)
    if found is None:
        text = f"no {pages.TITLES[primitive]} {request.path_params['name']!r} is registered"
        return _failure(request, 404, f"{text} in this database")
    try:
        return found, await read(_state(request).catalog.open(found), dict(request.query_params))
    except InvalidInput as error:
        return _failure(request, 400, str(error))


def _missing(request: Request, what: str, where: Registration) -> Response:
    text = f"{what} was not found in {pages.TITLES[where.primitive]} {where.name!r}"
    return _html(request, "Not found", pages.error(text) + _back(where), 404)


def _back(where: Registration) -> str:
    title = f"{pages.TITLES[where.primitive]} {where.name}"
    return f'<p><a href="{pages.link(where.primitive, where.name)}">Back to {escape(title)}</a></p>'


async def _task_item(request: Request) -> Response:
    async def read(queue: AsyncTaskQueue, form: dict[str, str]) -> tuple[TaskId, Task | None]:
        task_id = item_id(form, "id")
        await queue.clock.refresh()  # the page's ages on the queue's own clock
        return task_id, await queue.get(task_id)

    got = await _item(request, "tasks", read)
    if isinstance(got, Response):
        return got
    found, (task_id, task) = got
    if task is None:
        return _missing(request, f"task {task_id!r}", found)
    state = _state(request)
    now = state.catalog.open(found).clock.now()
    body = detail.task_page(found.name, task, now, state.allow_actions)
    return _html(request, f"task {task_id} of {found.name}", body)


async def _group_item(request: Request) -> Response:
    async def read(transport: AsyncGroupTransport, form: dict[str, str]) -> items.GroupView:
        return await items.read_group(transport, item_id(form, "id"), SECTION_LIMIT)

    got = await _item(request, "groups", read)
    if isinstance(got, Response):
        return got
    found, view = got
    if not view.found:
        return _missing(request, f"group {view.group_id!r}", found)
    body = detail.group_page(found.name, view, _state(request).allow_actions)
    return _html(request, f"group {view.group_id} of {found.name}", body)


async def _delivery_item(request: Request) -> Response:
    async def read(outbox: AsyncOutbox, form: dict[str, str]) -> items.DeliveryView:
        return await items.read_delivery(outbox, field(form, "event_id"), field(form, "handler"))

    got = await _item(request, "outbox", read)
    if isinstance(got, Response):
        return got
    found, view = got
    if not view.found:
        what = f"the delivery of event {view.event_id!r} to {view.handler!r}"
        return _missing(request, what, found)
    body = detail.delivery_page(found.name, view, _state(request).allow_actions)
    return _html(request, f"delivery of {view.event_id} to {view.handler}", body)


async def _static(request: Request) -> Response:
    name = request.path_params["file"]
    if name not in _STATIC:
        return Response("not found", 404)
    text = resources.files("mongoq.dashboard").joinpath("static", name).read_text("utf-8")
    return Response(text, media_type=_STATIC[name])


# ----------------------------------------------------------------------------- actions


def _action(request: Request) -> Action | None:
    return ACTIONS.get((request.path_params["primitive"], request.path_params["verb"]))


async def _confirm(request: Request) -> Response:
    state = _state(request)
    if not state.allow_actions:
        return _failure(request, 403, "actions are disabled: start the dashboard with "
                        "--allow-actions (create_app(allow_actions=True))")  # fmt: skip
    action, found = _action(request), await _registered(request)
    if action is None or found is None:
        return _failure(request, 404, "no such action or primitive")
    form = dict(request.query_params)
    try:
        sentence = action.describe(found.name, form)
    except InvalidInput as error:
        return _failure(request, 400, str(error))
    body = pages.confirm(found.primitive, found.name, action.verb, sentence, form)
    return _html(request, f"{action.label}?", body)


async def _act(request: Request) -> Response:
    """Run an action; every outcome (done, refused, refused input, failed) is logged."""
    primitive, name = request.path_params["primitive"], request.path_params["name"]
    verb = request.path_params["verb"]
    fields = {"mongoq_action": verb, "mongoq_primitive": primitive, "mongoq_queue": name,
              "mongoq_client": request.client.host if request.client else None}  # fmt: skip
    try:
        response, outcome, text, count = await _acting(request)
    except ClientDisconnect:
        log.info("dashboard: the client went away before sending its %s on %s %r", verb,
                 primitive, name, extra={**fields, "mongoq_outcome": "abandoned"})  # fmt: skip
        return Response(status_code=400)
    except Exception as exc:
        log.error("dashboard: %s on %s %r failed: %s: %s", verb, primitive, name,
                  type(exc).__name__, exc, extra={**fields, "mongoq_outcome": "failed"},
                  exc_info=True)  # fmt: skip
        return _failure(request, 500, f"the action failed ({type(exc).__name__}); the "
                        "dashboard's log has the detail")  # fmt: skip
    level = logging.INFO if outcome == "done" else logging.WARNING
    extra = {**fields, "mongoq_outcome": outcome}
    if count is not None:
        extra["mongoq_count"] = count
    log.log(level, "dashboard: %s %s on %s %r: %s", outcome, verb, primitive, name, text,
            extra=extra)  # fmt: skip
    return response


async def _acting(request: Request) -> tuple[Response, str, str, int | None]:
    """The response to an action, its outcome, what to log of it and how many it changed.
    The cheap refusals come before the body is read, and the body is read only so far."""
    state = _state(request)
    refusal = _refusal(request, state)
    if refusal is not None:
        return _failure(request, 403, refusal), "refused", refusal, None
    body = await _bounded_body(request)
    if body is None:
        text = "a form this large is no action's"
        return _failure(request, 413, text), "refused", text, None
    form = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
    if not state.guard.token_valid(request.headers, form):
        text = "a missing or wrong token"
        return _failure(request, 403, text), "refused", text, None
    action, found = _action(request), await _registered(request)
    if action is None or found is None:
        text = "no such action or primitive"
        return _failure(request, 404, text), "refused", text, None
    try:
        action.describe(found.name, form)  # every field checked before anything is written
    except InvalidInput as error:
        return _failure(request, 400, str(error)), "refused", str(error), None
    done = await action.run(state.catalog.open(found), form)
    state.sampler.latest_at = None  # the overview's refresh reads afresh, not the old sample
    if _wants_json(request):
        response: Response = JSONResponse(
            {"action": action.verb, "count": done.count, "text": done.text}
        )
    else:
        where = f"{pages.link(found.primitive, found.name)}?did={quote(action.verb)}"
        response = RedirectResponse(f"{where}&count={done.count}", 303)
    return response, "done", done.text, done.count


async def _bounded_body(request: Request) -> bytes | None:
    """The request's body, or None past `MAX_FORM` bytes (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and not (re.fullmatch("[0-9]{1,9}", declared)
                                     and int(declared) <= MAX_FORM):  # fmt: skip
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            return None
    return body


def _refusal(request: Request, state: Dashboard) -> str | None:
    """Why an action may not run, known before its body is read (the token is in it)."""
    if not state.allow_actions:
        return "actions are disabled: start the dashboard with --allow-actions"
    if state.guard.cross_site(request.headers, request.headers.get("host")):
        return "a request from another site"
    return None


def _routes() -> list[Route]:
    return [
        Route("/", _overview),
        Route("/api/overview", _api_overview),
        Route("/api/samples", _api_samples),
        Route("/api/chart", _api_chart),
        Route("/metrics", _metrics),
        Route("/task/{name:path}", _task_item),
        Route("/group/{name:path}", _group_item),
        Route("/delivery/{name:path}", _delivery_item),
        Route("/static/{file}", _static),
        # `name:path`: a queue's name may hold a "/" (it reaches the router decoded).
        Route("/confirm/{primitive}/{name:path}/{verb}", _confirm),
        Route("/actions/{primitive}/{name:path}/{verb}", _act, methods=["POST"]),
        Route("/{primitive}/{name:path}", _primitive),
    ]


# ----------------------------------------------------------------------------- serving


def bind(host: str = "127.0.0.1", port: int = 8188) -> socket.socket:
    """A listening socket on `host`:`port` (0: any free port); `MongoqError` when the port
    is taken or the address is not this machine's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise MongoqError(f"cannot serve the dashboard on {host}:{port}: {error}") from None


async def serve(
    app: Starlette, host: str = "127.0.0.1", port: int = 8188, *,
    sock: socket.socket | None = None,
) -> None:  # fmt: skip
    """Serve `app` with uvicorn on `host`:`port` (or on `sock`, from `bind`) until
    cancelled or Ctrl-C; closes the socket when it stops."""
    import uvicorn  # the dashboard extra

    sock = sock if sock is not None else bind(host, port)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        # Stopped from outside: let uvicorn close its connections and end the app's
        # lifespan (the sampler) instead of abandoning them mid-flight.
        server.should_exit = True
        with anyio.move_on_after(_SHUTDOWN_WAIT, shield=True):
            await asyncio.wait([serving])
        raise
    finally:
        sock.close()
