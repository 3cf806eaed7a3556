"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` package, which
``.ci/run`` installs) driven by Playwright's Python package through ``executable_path``, never
a browser Playwright downloads. An operator opens the overview, finds a failed task, requeues
it with the token and sees the count change; another reads the chart's axes and follows the
ids of a task, a group and a delivery to their pages, and requeues the delivery from its page.
The database is checked after each. On failure it saves a screenshot and names it."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from mongoq.dashboard import bind, serve
from mongoq.testing import ManualClock, memory_database
from tests.support.dashboard_helpers import TOKEN, app_of, seed

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="browser test: no Chromium on this machine (apt-get install chromium; .ci/run does)",
)
async_api = pytest.importorskip(
    "playwright.async_api", reason="browser test: the playwright package is not installed"
)
#: What a sandboxed CI machine's Chromium needs: no sandbox as root, no calls home.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture
def db() -> Any:
    """The page is what these tests check, not the backend: the plain embedded backend only
    (the dashboard's reads run on every lane and on a server in tests/dashboard/test_http.py)."""
    return memory_database()


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    sock = bind("127.0.0.1", 0)
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: serve(app, sock=sock))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        group.cancel_scope.cancel()


@asynccontextmanager
async def browser_page(shots: Path) -> AsyncIterator[Any]:
    async with async_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            page.set_default_timeout(15_000)
            try:
                yield page
            except BaseException:
                shot = shots / "dashboard-failure.png"
                await page.screenshot(path=str(shot), full_page=True)
                print(f"the browser test failed; its screenshot: {shot}")
                raise
        finally:
            await browser.close()


async def test_an_operator_finds_a_failed_task_and_requeues_it_with_the_token(
    db: Any, clock: ManualClock, tmp_path: Path
) -> None:
    seeded = await seed(db, clock)
    app = app_of(db, clock, allow_actions=True)
    sampler = app.state.dashboard.sampler
    sampler.clock = clock
    await sampler.sample()
    clock.advance(1)
    task = await seeded.queue.claim("w")  # digest-3 runs and finishes: a point of throughput
    assert task is not None
    await seeded.queue.complete(task)
    clock.advance(10)
    await sampler.sample()

    async with served(app) as url, browser_page(tmp_path) as page:
        await page.goto(url + "/")
        failed = page.locator('[data-count="tasks:emails:failed"]')
        assert await failed.inner_text() == "2"
        await page.locator("svg.chart polyline.backlog").first.wait_for(state="attached")

        await page.get_by_role("link", name="emails").click()
        row = page.locator('tr[data-task="bounce-2"]')
        assert "SMTP 550 <script>" in await row.inner_text()  # shown as text, never run
        await row.get_by_role("link", name="Requeue").click()

        assert "Requeue failed task 'bounce-2'" in await page.locator("p.confirm").inner_text()
        await page.get_by_role("button", name="Confirm").click()  # no token: not even sent
        assert "/confirm/tasks/emails/requeue" in page.url
        await page.fill('input[name="token"]', "wrong-token-0123456")
        await page.get_by_role("button", name="Confirm").click()
        assert "a missing or wrong token" in await page.locator("main").inner_text()
        assert (await db["emails"].find_one({"_id": "bounce-2"}))["status"] == "failed"

        await page.go_back()
        await page.fill('input[name="token"]', TOKEN)
        await page.get_by_role("button", name="Confirm").click()
        await page.locator("p.note").wait_for()
        assert await page.locator("p.note").inner_text() == "Requeue: 1 changed."
        assert await page.locator('[data-count="tasks:emails:failed"]').inner_text() == "1"
        assert await page.locator('tr[data-task="bounce-2"]').count() == 0  # not failed now

    doc = await db["emails"].find_one({"_id": "bounce-2"})
    assert (doc["status"], doc["attempts"]) == ("pending", 0)


async def test_an_operator_follows_ids_to_the_pages_of_a_task_a_group_and_a_delivery(
    db: Any, clock: ManualClock, tmp_path: Path
) -> None:
    await seed(db, clock)
    app = app_of(db, clock, allow_actions=True)
    sampler = app.state.dashboard.sampler
    sampler.clock = clock
    await sampler.sample()
    clock.advance(60)
    await sampler.sample()

    async with served(app) as url, browser_page(tmp_path) as page:
        await page.goto(url + "/")
        chart = page.locator('svg.chart[data-key="tasks:emails"]')
        assert "last 30 min (UTC)" in await chart.locator("text.window").text_content()
        assert await chart.locator("text.tick.time").count() >= 2  # a time axis, labelled
        assert await chart.locator("text.tick.backlog").first.text_content() == "0"
        # The script swaps in the server's fresh chart: called here, not waited for.
        await chart.evaluate("svg => { svg.dataset.old = '1'; return refreshChart(svg); }")
        assert await page.locator('svg.chart[data-key="tasks:emails"][data-old]').count() == 0
        assert await page.locator('svg.chart[data-key="tasks:emails"] polyline').count() >= 1
        assert await page.evaluate("[formatAge(0), formatAge(0.4), formatAge(75)]") == [
            "<1s", "<1s", "1m15s",
        ]  # fmt: skip

        await page.get_by_role("link", name="emails").click()
        await page.get_by_role("link", name="7", exact=True).click()
        assert await page.locator("h1").inner_text() == "task 7 of emails"
        assert "ValueError: no such template" in await page.locator("pre.error").inner_text()
        assert "/task/emails?id=7&id_type=int" in page.url

        await page.goto(url + "/groups/orders")
        await page.get_by_role("link", name="o-1", exact=True).first.click()  # a dead letter
        assert await page.locator("h1").inner_text() == "group o-1 of orders"
        assert "PermanentError: card declined" in await page.locator("#seq-1").inner_text()

        await page.goto(url + "/outbox/shop_")
        await page.get_by_role("link", name="e1", exact=True).click()
        assert await page.locator("h1").inner_text() == "delivery of e1 to stats"
        assert "KeyError: 'amount'" in await page.locator("pre.error").inner_text()
        await page.get_by_role("link", name="Requeue").click()
        assert (
            "Requeue the dead delivery of event 'e1'"
            in await page.locator("p.confirm").inner_text()
        )
        await page.fill('input[name="token"]', TOKEN)
        await page.get_by_role("button", name="Confirm").click()
        await page.locator("p.note").wait_for()

    [delivery] = await db["shop_"].database["shop_deliveries"].find({}).to_list(None)
    assert (delivery["status"], delivery["attempts"]) == ("pending", 0)
