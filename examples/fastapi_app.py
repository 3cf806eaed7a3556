"""A FastAPI app whose routes defer task functions, with their worker in the app's lifespan.

    uvicorn examples.fastapi_app:app                          # the app, its worker beside it
    RUN_WORKER_IN_APP=0 uvicorn examples.fastapi_app:app      # the app only defers...
    mongoq worker examples.fastapi_app:jobs                   # ...and this process runs them

Both connect to ``MONGOQ_URI``. ``POST /emails`` defers `send_email` and answers its task id;
``GET /tasks/{task_id}`` shows the task's status and result. ``python
examples/fastapi_app.py`` checks the app without a server, on the embedded backend, through
httpx (what FastAPI's test client uses).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, HTTPException
from pydantic import BaseModel

import mongoq

jobs = mongoq.Jobs()  # connected when the app starts (or by `mongoq worker`)


@jobs.task(queue="emails", retry_on=(ConnectionError,), timeout=30)
async def send_email(to: str, subject: str) -> str:
    return f"sent {subject!r} to {to}"


class Email(BaseModel):
    to: str
    subject: str


class Deferred(BaseModel):
    task_id: str


class TaskView(BaseModel):
    id: str
    function: str | None
    status: str
    attempts: int
    result: Any = None


router = APIRouter()


@router.post("/emails", status_code=202)
async def enqueue_email(email: Email) -> Deferred:
    task_id = await send_email.defer(email.to, email.subject)  # a new random id: a string
    return Deferred(task_id=str(task_id))


@router.get("/tasks/{task_id}")
async def show_task(task_id: str) -> TaskView:
    for name in jobs.queues:
        task = await jobs.queue(name).get(task_id)
        if task is not None:
            # Not the task's error: its traceback is for operators, not for API clients.
            return TaskView(
                id=str(task.id), function=task.function, status=task.status,
                attempts=task.attempts, result=task.result,
            )  # fmt: skip
    raise HTTPException(status_code=404, detail=f"no task {task_id!r}")


def create_app(db: Any = None, *, run_worker: bool | None = None) -> FastAPI:
    """The app on `db` (default: `mongoq.connect()` when it starts, closed when it stops).
    `run_worker`: run the worker in its lifespan (default: yes, unless ``RUN_WORKER_IN_APP``
    is ``0``: the worker then runs as a process of its own, ``mongoq worker``)."""
    if run_worker is None:
        run_worker = os.environ.get("RUN_WORKER_IN_APP", "1") != "0"
    in_app = run_worker

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        database = mongoq.connect() if db is None else db
        jobs.use(database)
        try:
            await jobs.setup()
            if not in_app:
                yield
                return
            async with anyio.create_task_group() as group:
                # The server owns the signals: its shutdown ends the lifespan, which stops the
                # worker (below), hence no handle_signals here.
                group.start_soon(partial(jobs.run, concurrency=8))
                try:
                    yield
                finally:
                    # After the server's last response: claim nothing more; the group waits
                    # for the calls in flight to finish and `run` to return.
                    jobs.stop()
        finally:
            if db is None:
                await mongoq.close(database)

    app = FastAPI(title="mongoq example", lifespan=lifespan)
    app.include_router(router)
    return app


app = create_app()


async def self_check() -> None:
    """Defer an email through the app and wait for its task to be done, all in this process:
    the embedded backend, the worker in the app's lifespan, no server started."""
    import httpx  # FastAPI's test client; not needed to serve the app

    app = create_app(mongoq.connect("memory://"), run_worker=True)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),  # what a server runs around its requests
        httpx.AsyncClient(transport=transport, base_url="http://app") as client,
    ):
        posted = await client.post("/emails", json={"to": "ada@example.com", "subject": "hi"})
        task_id = posted.json()["task_id"]
        print(posted.status_code, await send_email.wait(task_id, timeout=30))
        print((await client.get(f"/tasks/{task_id}")).json()["status"])


if __name__ == "__main__":
    anyio.run(self_check)
