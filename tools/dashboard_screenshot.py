"""Take the screenshots of the dashboard that the README and docs/dashboard.md show, one per
page: the overview (``docs/dashboard.png``), a task queue (``dashboard-tasks.png``), a task
(``dashboard-task.png``), a group transport (``dashboard-groups.png``), a group
(``dashboard-group.png``), an outbox (``dashboard-outbox.png``) and a delivery
(``dashboard-delivery.png``).

The primitives are those of ``tests/support/dashboard_helpers.seed`` and some more work, run
through thirty minutes of simulated time (a `ManualClock`) and sampled once a minute on the
way; Debian's Chromium shows them through Playwright (never a browser Playwright downloads).

    python tools/dashboard_screenshot.py [--out docs]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mongoq import NewTask  # noqa: E402
from mongoq.dashboard import bind, serve  # noqa: E402
from mongoq.outbox import AsyncOutbox, Event  # noqa: E402
from mongoq.testing import ManualClock, memory_database  # noqa: E402
from tests.dashboard.test_browser import CHROMIUM_ARGS  # noqa: E402
from tests.support.dashboard_helpers import Seeded, app_of, seed  # noqa: E402

#: Each page: its file name's ending, its path, and how much of it the picture shows.
PAGES = [
    ("", "/", None),
    ("-tasks", "/tasks/emails", 900),
    ("-task", "/task/emails?id=bounce-2&id_type=str", 900),
    ("-groups", "/groups/orders", 900),
    ("-group", "/group/orders?id=o-2&id_type=str", 760),
    ("-outbox", "/outbox/shop_", 820),
    ("-delivery", "/delivery/shop_?event_id=order-1042&handler=stats", 1180),
]
WIDTH = 1280


async def work(seeded: Seeded, clock: ManualClock, sampler: Any) -> None:
    """Thirty minutes of a worker that speeds up until the invoices are done, sampled once a
    minute; a few more orders and events waiting at the end."""
    queue, transport = seeded.queue, seeded.transport
    await queue.put_many(NewTask(f"invoice-{n}", {"n": n}) for n in range(400))
    for n in range(3):
        await transport.publish("o-2", {"order": 2, "line": n + 1})
    for minute in range(30):
        await sampler.sample()
        for _ in range(min(5 + minute, 40)):
            task = await queue.claim("worker-a")
            if task is not None:
                await queue.complete(task, {"sent": True})
        if minute % 3 == 0:
            await transport.publish(f"o-{10 + minute}", {"order": 10 + minute})
        clock.advance(60)
    parked = await transport.claim("worker-b")  # one group waiting out a retry, one held
    assert parked is not None
    await transport.nack(parked, 300, error="TimeoutError: payment service")
    await transport.claim("worker-b")
    # An event for two handlers whose delivery to one died: the delivery page's example.
    both = AsyncOutbox(seeded.outbox.db, "shop_", clock=clock,
                       subscriptions={"order.paid": ["stats", "mailer"]})  # fmt: skip
    await both.publish(Event(id="order-1042", type="order.paid", key="customer-7",
                             payload={"order": 1042, "total": "89.90", "currency": "EUR"},
                             headers={"source": "checkout"}), session=None)  # fmt: skip
    [stats] = await both.claim("worker-c", handlers=["stats"])
    await both.bury(stats, error="Traceback (most recent call last):\n  File \"stats.py\", "
                    "line 12, in handle\nKeyError: 'amount'")  # fmt: skip
    await both.publish(
        [Event(id=f"e{n}", type="order.paid", key=f"k{n % 2}", payload={"order": n})
         for n in range(2, 6)], session=None,
    )  # fmt: skip
    clock.advance(5)
    await sampler.sample()


async def main(out: Path) -> None:
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    db, clock = memory_database(), ManualClock()
    seeded = await seed(db, clock)
    app = app_of(db, clock, allow_actions=True)
    sampler = app.state.dashboard.sampler
    sampler.clock = clock
    await work(seeded, clock, sampler)
    sock = bind("127.0.0.1", 0)
    server = asyncio.ensure_future(serve(app, sock=sock))
    written = []
    try:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=chromium,
                                                       args=CHROMIUM_ARGS)  # fmt: skip
            page = await browser.new_page(viewport={"width": WIDTH, "height": 600})
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            for suffix, path, height in PAGES:
                await page.set_viewport_size({"width": WIDTH, "height": height or 600})
                await page.goto(url + path)
                await page.locator("main h1").wait_for()
                shot = out / f"dashboard{suffix}.png"
                await page.screenshot(path=str(shot), full_page=height is None)
                written.append(shot)
            await browser.close()
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    print("wrote " + ", ".join(str(shot) for shot in written))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="the folder")
    asyncio.run(main(parser.parse_args().out))
