"""The Django integration (examples/django_shop.py): Django's (blocking) views defer a task
function through ``mongoq_sync.Jobs(db, like=jobs)``, and the worker runs it. Requests go
through Django's test client, the whole request cycle (URL routing, middleware, views)."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import mongoq_sync
from mongoq.testing import ManualClock

pytest.importorskip("django", reason="the Django integration: django is not installed")
from django.conf import settings
from django.test import Client

django_shop = importlib.import_module("examples.django_shop")
ORDER = {"order_id": "1042", "email": "ada@example.com"}


@pytest.fixture(scope="module")
def client() -> Client:
    if not settings.configured:  # one configuration per process
        import django

        settings.configure(ROOT_URLCONF="examples.django_shop", ALLOWED_HOSTS=["testserver"])
        django.setup()
    return Client()


@pytest.fixture
def producer(
    blocking_db: mongoq_sync.Database, monkeypatch: pytest.MonkeyPatch
) -> Iterator[mongoq_sync.Jobs]:
    """The views' blocking `Jobs`, on the test's own database (the example's connects once per
    process, to ``MONGOQ_URI``)."""
    jobs = mongoq_sync.Jobs(blocking_db, like=django_shop.jobs, clock=ManualClock())
    jobs.setup()
    monkeypatch.setattr(django_shop, "producer", lambda: jobs)
    yield jobs


def stored(db: mongoq_sync.Database) -> dict[Any, dict[str, Any]]:
    raw = db.async_database["receipts"]
    return {doc["_id"]: doc for doc in db.call(lambda: raw.find({}).to_list(None))}


def test_a_view_defers_the_task_and_the_worker_runs_it(
    client: Client, producer: mongoq_sync.Jobs, blocking_db: mongoq_sync.Database
) -> None:
    posted = client.post("/orders", ORDER, content_type="application/json")
    assert posted.status_code == 202 and posted.json() == {"task_id": "receipt-1042"}
    (document,) = stored(blocking_db).values()
    assert (document["_id"], document["function"], document["status"]) == (
        "receipt-1042", "send_receipt", "pending",
    )  # fmt: skip
    assert document["payload"] == {"args": [], "kwargs": {"order_id": "1042",
                                                          "email": "ada@example.com"}}  # fmt: skip
    assert client.get("/tasks/receipt-1042").json()["status"] == "pending"

    summary = producer.run(stop_when_empty=True)  # the worker, here through the facade
    assert summary.completed == 1
    shown = client.get("/tasks/receipt-1042").json()
    assert shown == {
        "id": "receipt-1042", "status": "done", "attempts": 1,
        "result": "receipt of order 1042 sent to ada@example.com",
    }  # fmt: skip
    assert stored(blocking_db)["receipt-1042"]["status"] == "done"
    assert client.get("/tasks/receipt-9").status_code == 404


def test_an_order_posted_twice_defers_one_task(
    client: Client, producer: mongoq_sync.Jobs, blocking_db: mongoq_sync.Database
) -> None:
    for _ in range(2):
        posted = client.post("/orders", ORDER, content_type="application/json")
        assert posted.json() == {"task_id": "receipt-1042"}
    assert list(stored(blocking_db)) == ["receipt-1042"]


def test_requests_on_many_threads_share_one_producer(
    client: Client, producer: mongoq_sync.Jobs, blocking_db: mongoq_sync.Database
) -> None:
    """A threaded server's requests: each thread's own client, one facade among them."""
    answers: list[int] = []

    def place(number: int) -> None:
        order = {"order_id": str(number), "email": f"user{number}@example.com"}
        answers.append(Client().post("/orders", order, content_type="application/json").status_code)

    threads = [threading.Thread(target=place, args=(n,)) for n in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [202] * 10
    assert sorted(stored(blocking_db)) == sorted(f"receipt-{n}" for n in range(10))
    assert producer.run(concurrency=4, stop_when_empty=True).completed == 10
    assert all(doc["status"] == "done" for doc in stored(blocking_db).values())
