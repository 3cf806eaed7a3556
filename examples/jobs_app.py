"""Task functions: three job types in two queues, one worker for all of them.

    mongoq worker examples.jobs_app:jobs --uri mongodb://localhost/?replicaSet=rs0

runs every function's tasks (``--in-process`` allows the embedded backend, whose tasks only
that process sees). ``python examples/jobs_app.py`` defers a few calls and runs them in this
process, on the embedded backend.
"""

from __future__ import annotations

import asyncio

import mongoq

jobs = mongoq.Jobs()


@jobs.task(queue="emails", retry_on=(ConnectionError,), timeout=30)
async def send_email(to: str, subject: str) -> str:
    """At least once: an email may go twice after a crash, so the mail server dedupes by id."""
    return f"sent {subject!r} to {to}"


@jobs.task(queue="media")
async def resize(path: str, width: int = 640) -> dict[str, object]:
    return {"path": path, "width": width}


@jobs.task(queue="media", max_attempts=3)
async def transcode(path: str) -> str:
    return path.replace(".mov", ".mp4")


async def main() -> None:
    jobs.use(mongoq.connect())  # in-process; a server's URI in production
    await jobs.setup()
    welcome = await send_email.options(task_id="welcome-ada").defer("ada@example.com", "hi")
    await resize.defer("/photos/1.jpg")
    await transcode.defer("/videos/1.mov")
    summary = await jobs.run(concurrency=4, stop_when_drained=True)
    print(summary)
    print(await send_email.wait(welcome))


if __name__ == "__main__":
    asyncio.run(main())
