"""A web dashboard for operators (the ``dashboard`` extra: Starlette and uvicorn): every
mongoq primitive of a database, found through the registry, with its counts, the age of its
oldest waiting item, a throughput chart, its failed work (failed tasks, dead letters, parked
groups, dead deliveries) and, when allowed, the actions on it: requeue, cancel, redrive,
purge. ``mongoq dashboard`` serves it; `create_app` makes the ASGI app in-process.

Owns no collections.
"""

from __future__ import annotations

from mongoq.dashboard.app import Dashboard, bind, create_app, serve

__all__ = ["Dashboard", "bind", "create_app", "serve"]
