"""Django views that defer task functions through the blocking facade, `mongoq_sync`.

Django's views are plain functions: they defer through ``mongoq_sync.Jobs(db, like=jobs)``, a
blocking twin of the application's `mongoq.Jobs`. The task functions are the async ones
declared on `jobs`, and a worker of its own runs them:

    mongoq worker examples.django_shop:jobs

In a project the parts live apart: `jobs` and its functions in ``shop/tasks.py`` (imported by
the views and by the worker), the views in ``shop/views.py``, the routes in ``shop/urls.py``;
``MONGOQ_URI`` names the server. ``python examples/django_shop.py`` checks it all in one
process, on the embedded backend: Django's test client places an order, the facade runs the
worker until no task is left, and the client reads the task's status.
"""

from __future__ import annotations

import json
import threading

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.http import require_GET, require_POST

import mongoq
import mongoq_sync

# --- shop/tasks.py ------------------------------------------------------------------------
jobs = mongoq.Jobs()  # no database here: the worker connects it, the views use a twin


@jobs.task(queue="receipts", max_attempts=5, timeout=30)
async def send_receipt(order_id: str, email: str) -> str:
    return f"receipt of order {order_id} sent to {email}"


# --- shop/views.py ------------------------------------------------------------------------
_producer: mongoq_sync.Jobs | None = None
_connecting = threading.Lock()


def producer() -> mongoq_sync.Jobs:
    """This process's blocking `Jobs`: one connection, and one portal thread, per process,
    made by the first request that needs it (``MONGOQ_URI``; none: the embedded backend)."""
    global _producer
    if _producer is None:
        with _connecting:  # a threaded server's first requests may come at once
            if _producer is None:
                _producer = mongoq_sync.Jobs(mongoq_sync.connect(), like=jobs)
    return _producer


@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    order = json.loads(request.body)
    order_id, email = str(order["order_id"]), str(order["email"])
    # The task's id is the order's: a request sent twice (a client's retry) defers once.
    receipt = send_receipt.options(task_id=f"receipt-{order_id}")
    task_id = producer().defer(receipt, order_id, email)
    return JsonResponse({"task_id": task_id}, status=202)


@require_GET
def show_task(request: HttpRequest, task_id: str) -> JsonResponse:
    task = producer().queue(send_receipt.queue).get(task_id)
    if task is None:
        return JsonResponse({"error": f"no task {task_id!r}"}, status=404)
    fields = {"status": task.status, "attempts": task.attempts, "result": task.result}
    return JsonResponse({"id": task.id, **fields})


# --- shop/urls.py -------------------------------------------------------------------------
urlpatterns = [
    path("orders", place_order),
    path("tasks/<str:task_id>", show_task),
]


def self_check() -> None:
    """Place an order through Django's test client, run the worker through the facade until
    no task is left, then read the task: one process, the embedded backend, no server."""
    import django
    from django.conf import settings
    from django.test import Client

    settings.configure(ROOT_URLCONF=__name__, ALLOWED_HOSTS=["testserver"])
    django.setup()
    client = Client()
    producer().setup()  # the queues' indexes; `mongoq worker` creates them too
    order = {"order_id": "1042", "email": "ada@example.com"}
    posted = client.post("/orders", order, content_type="application/json")
    task_id = posted.json()["task_id"]
    print(posted.status_code, task_id)
    producer().run(stop_when_empty=True)  # what `mongoq worker` does, until the queue is empty
    print(producer().wait(send_receipt, task_id, timeout=30))
    print(client.get(f"/tasks/{task_id}").json()["status"])


if __name__ == "__main__":
    self_check()
