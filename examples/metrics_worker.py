"""Prometheus metrics in a worker: `RunMetrics` counts what every `run` of the process does
(claimed, completed, retried, failed...) and times the handlers.

Runs on the embedded in-memory backend (needs the ``metrics`` extra):
``python examples/metrics_worker.py``. In a service, expose the registry as you already do,
e.g. ``prometheus_client.start_http_server(9100)``.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

import mongoq
from mongoq.metrics import RunMetrics


async def resize(task: mongoq.Task) -> dict[str, int]:
    return {"width": 640}


async def main() -> None:
    registry = CollectorRegistry()  # or leave it out: prometheus_client.REGISTRY
    with RunMetrics(registry):
        db = mongoq.connect()
        queue = mongoq.AsyncTaskQueue(db, "thumbnails")
        await queue.setup()
        await queue.put_many(mongoq.NewTask(f"img-{n}", {"n": n}) for n in range(3))
        await queue.run(resize, stop_when_drained=True)
    exposition = generate_latest(registry).decode()
    print("\n".join(line for line in exposition.splitlines() if "items_total{" in line))


asyncio.run(main())
