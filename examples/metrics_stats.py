"""Prometheus gauges of the primitives' stats: `StatsCollector` reads them at each scrape.

A scrape runs in the HTTP server's thread while the primitives belong to an event loop:
`call` hands each read to that loop. Runs on the embedded in-memory backend (needs the
``metrics`` extra): ``python examples/metrics_stats.py``.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

import mongoq
from mongoq.metrics import StatsCollector


async def main() -> None:
    db = mongoq.connect()
    queue = mongoq.AsyncTaskQueue(db, "emails")
    await queue.setup()
    await queue.put("mail-1", {"to": "ada@example.com"})

    loop = asyncio.get_running_loop()  # the loop the primitives run in
    registry = CollectorRegistry()
    registry.register(
        StatsCollector(
            [queue], call=lambda read: asyncio.run_coroutine_threadsafe(read(), loop).result()
        )
    )
    # prometheus_client.start_http_server(9108, registry=registry) scrapes from its own
    # thread; here one scrape, in a thread as well (never on the loop's own thread).
    exposition = (await asyncio.to_thread(generate_latest, registry)).decode()
    print("\n".join(line for line in exposition.splitlines() if line.startswith("mongoq_tasks")))


asyncio.run(main())
