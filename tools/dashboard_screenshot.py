"""Take the README's screenshots of the dashboard (``docs/dashboard.png``, the overview, and
``docs/dashboard-tasks.png``, a task queue's page): the primitives of
``tests/support/dashboard_helpers.seed`` and a queue worked through for a few minutes of
simulated time, sampled on the way, shown in Debian's Chromium through Playwright.

    python tools/dashboard_screenshot.py [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mongoq import NewTask  # noqa: E402
from mongoq.dashboard import bind, serve  # noqa: E402
from mongoq.testing import ManualClock, memory_database  # noqa: E402
from tests.dashboard.test_browser import CHROMIUM_ARGS  # noqa: E402
from tests.support.dashboard_helpers import app_of, seed  # noqa: E402


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
    await seeded.queue.put_many(NewTask(f"invoice-{n}", {"n": n}) for n in range(400))
    for minute in range(30):  # a worker speeding up, then the backlog gone
        await sampler.sample()
        for _ in range(min(5 + minute, 40)):
            task = await seeded.queue.claim("w")
            if task is not None:
                await seeded.queue.complete(task)
        clock.advance(60)
    await sampler.sample()
    sock = bind("127.0.0.1", 0)
    server = asyncio.ensure_future(serve(app, sock=sock))
    try:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=chromium,
                                                       args=CHROMIUM_ARGS)  # fmt: skip
            page = await browser.new_page(viewport={"width": 1200, "height": 520})
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            await page.goto(f"{url}/")
            await page.locator("svg.chart polyline").first.wait_for(state="attached")
            await page.screenshot(path=str(out), full_page=True)
            tasks = out.with_name(out.stem + "-tasks" + out.suffix)
            await page.goto(f"{url}/tasks/emails")
            await page.screenshot(path=str(tasks), clip={"x": 0, "y": 0, "width": 1200,
                                                         "height": 560})  # fmt: skip
            await browser.close()
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
    print(f"wrote {out} and {tasks}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    asyncio.run(main(parser.parse_args().out))
