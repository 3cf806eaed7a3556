"""The FastAPI integration (examples/fastapi_app.py): a route defers a task function, the worker
runs beside the app in its lifespan (or not, with ``RUN_WORKER_IN_APP=0``), and the lifespan's
shutdown stops it gracefully. The app is driven as a server drives it: the ASGI lifespan
protocol around requests sent through httpx's ASGI transport."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import anyio
import httpx
import pytest

from tests.support.helpers import read, until, wait_for

pytest.importorskip("fastapi", reason="the FastAPI integration: fastapi is not installed")
fastapi_app = importlib.import_module("examples.fastapi_app")

EMAIL = {"to": "ada@example.com", "subject": "hi"}
SENT = "sent 'hi' to ada@example.com"
#: Seconds of real time a lifespan step may take: a bound for a hang, never a wait.
WITHIN = 20


class Server:
    """The lifespan side of an ASGI server: ``lifespan.startup`` before the first request,
    ``lifespan.shutdown`` after the last (`shut_down`), and the app's answers to them."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._inbox, self._outbox = anyio.create_memory_object_stream[dict[str, Any]](2)
        self.started = anyio.Event()
        self.stopped = anyio.Event()
        self.shutting_down = False
        self.answers: list[dict[str, Any]] = []

    async def lifespan(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
        await self.app({**scope, "state": {}}, self._outbox.receive, self._send)

    async def _send(self, message: dict[str, Any]) -> None:
        self.answers.append(message)
        if message["type"].startswith("lifespan.startup."):
            self.started.set()
        elif message["type"].startswith("lifespan.shutdown."):
            self.stopped.set()

    def start_up(self) -> None:
        self._inbox.send_nowait({"type": "lifespan.startup"})

    def shut_down(self) -> None:
        self.shutting_down = True
        self._inbox.send_nowait({"type": "lifespan.shutdown"})


@contextlib.asynccontextmanager
async def served(app: Any) -> AsyncIterator[tuple[Server, httpx.AsyncClient]]:
    """`app` started up, a client on it, and shut down at the end (unless the test did)."""
    server = Server(app)
    transport = httpx.ASGITransport(app=app)
    async with anyio.create_task_group() as group:
        group.start_soon(server.lifespan)
        server.start_up()
        with anyio.fail_after(WITHIN):
            await server.started.wait()
        assert server.answers == [{"type": "lifespan.startup.complete"}]
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield server, client
        if not server.shutting_down:
            server.shut_down()
        with anyio.fail_after(WITHIN):
            await server.stopped.wait()
        assert server.answers[-1] == {"type": "lifespan.shutdown.complete"}


def finished(doc: dict[str, Any] | None) -> bool:
    return doc is not None and doc["status"] not in ("pending", "processing")


async def test_a_post_defers_a_task_naming_the_function_and_holding_the_call(db: Any) -> None:
    app = fastapi_app.create_app(db, run_worker=False)
    async with served(app) as (_, client):
        posted = await client.post("/emails", json=EMAIL)
        assert posted.status_code == 202
        task_id = posted.json()["task_id"]

        doc = await read(db, task_id, "emails")
        assert doc is not None
        assert (doc["function"], doc["payload"]) == ("send_email", {"args": [], "kwargs": EMAIL})
        assert (doc["status"], doc["attempts"]) == ("pending", 0)
        shown = await client.get(f"/tasks/{task_id}")
        assert shown.json() == {
            "id": task_id, "function": "send_email", "status": "pending", "attempts": 0,
            "result": None,
        }  # fmt: skip
        assert (await client.get("/tasks/no-such-task")).status_code == 404
        invalid = await client.post("/emails", json={"to": "ada@example.com"})
        assert invalid.status_code == 422  # refused by the route's model: nothing deferred
    assert list(await db["emails"].find({}, {"_id": 1}).to_list(None)) == [{"_id": task_id}]


async def test_with_the_worker_in_the_lifespan_a_task_ends_done_with_its_result(
    db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer-only app (``RUN_WORKER_IN_APP=0``) defers and its task waits; the next app,
    with the worker in its lifespan (the default), runs it and the one deferred through it.
    Both share the example's module-level `jobs`: the producer's shutdown must not call
    `jobs.stop()`, whose pending stop would end the next `run` at once."""
    monkeypatch.setenv("RUN_WORKER_IN_APP", "0")
    async with served(fastapi_app.create_app(db)) as (_, client):
        earlier = (await client.post("/emails", json=EMAIL)).json()["task_id"]
    assert (await read(db, earlier, "emails") or {}).get("status") == "pending"

    monkeypatch.delenv("RUN_WORKER_IN_APP")
    async with served(fastapi_app.create_app(db)) as (_, client):
        later = (await client.post("/emails", json=EMAIL)).json()["task_id"]
        for task_id in (earlier, later):
            doc = await until(partial(read, db, task_id, "emails"), finished, f"{task_id} ends")
            assert (doc["status"], doc["result"], doc["attempts"]) == ("done", SENT, 1)
        shown = (await client.get(f"/tasks/{later}")).json()
        assert (shown["status"], shown["result"]) == ("done", SENT)
    assert not fastapi_app.jobs._loops  # the shutdown stopped the worker: its run returned


async def test_the_lifespans_shutdown_stops_the_worker_gracefully_a_task_in_flight_finishes(
    db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = anyio.Event(), anyio.Event()
    returned: list[str] = []

    async def held(to: str, subject: str) -> str:
        started.set()
        await release.wait()
        returned.append(to)  # not reached if the stop cancelled the call
        return f"sent {subject!r} to {to}"

    monkeypatch.setattr(fastapi_app.send_email, "function", held)
    jobs = fastapi_app.jobs
    async with served(fastapi_app.create_app(db, run_worker=True)) as (server, client):
        task_id = (await client.post("/emails", json=EMAIL)).json()["task_id"]
        await wait_for(started.is_set, "the call to start")

        server.shut_down()
        await wait_for(
            lambda: bool(jobs._loops) and all(loop.stopping for loop in jobs._loops),
            "the worker to stop claiming",
        )
        # Stopping, not stopped: the lifespan waits for the call in flight, which holds its task.
        assert not server.stopped.is_set()
        assert (await read(db, task_id, "emails") or {}).get("status") == "processing"

        release.set()
        with anyio.fail_after(WITHIN):
            await server.stopped.wait()
        assert server.answers[-1] == {"type": "lifespan.shutdown.complete"}

    assert returned == ["ada@example.com"]
    doc = await read(db, task_id, "emails")
    assert doc is not None
    assert (doc["status"], doc["result"], doc["attempts"]) == ("done", SENT, 1)
    assert not jobs._loops
