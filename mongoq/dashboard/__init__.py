"""A web dashboard for operators (the ``dashboard`` extra: Starlette and uvicorn): every
mongoq primitive of a database, found through the registry, with its counts, the age of its
oldest waiting item, a chart of its backlog and throughput with axes over the last 30 minutes,
its failed and waiting work, a page for each task, group and outbox delivery, the
primitives' stats for Prometheus at ``/metrics`` (with the ``metrics`` extra) and, when
allowed, the actions: requeue, cancel, redrive, purge. ``mongoq dashboard`` serves it;
`create_app` makes the ASGI app in-process. docs/dashboard.md is the operator's guide.

Without the extra, importing this package raises `MongoqError` naming it.

Owns no collections.
"""

from __future__ import annotations

from mongoq import _driver

with _driver.extra_required("dashboard", "mongoq.dashboard"):
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401

from mongoq.dashboard.app import Dashboard, bind, create_app, serve

__all__ = ["Dashboard", "bind", "create_app", "serve"]
