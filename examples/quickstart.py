import asyncio

import mongoq


async def resize(task: mongoq.Task) -> dict[str, int]:
    path = task.payload["path"]
    if not path.endswith(".jpg"):
        raise mongoq.PermanentError(f"not a JPEG: {path}")  # failed at once, no retry
    return {"width": 640}  # stored as the task's result; another exception is retried


async def main() -> None:
    db = mongoq.connect()  # in-process; mongoq.connect("mongodb://host/?replicaSet=rs0")
    queue = mongoq.AsyncTaskQueue(db, "thumbnails")
    await queue.setup()  # its indexes: once per deploy, idempotent
    await queue.put("img-1", {"path": "/photos/1.jpg"})  # by id: a second put is a no-op
    await queue.put("img-2", {"path": "/photos/2.gif"})

    summary = await queue.run(resize, concurrency=4, stop_when_drained=True)
    print(summary)
    for task_id in ("img-1", "img-2"):
        task = await queue.get(task_id)
        assert task is not None
        print(task_id, task.status, task.result or (task.error or "").splitlines()[-1])


asyncio.run(main())
