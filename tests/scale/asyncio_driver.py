"""``python asyncio_driver.py URL N``: N rollouts at a time as asyncio tasks on one event loop.

What an async service that hosts many agents does: each coroutine leases a task
(the blocking call in a thread), runs the async agent inside ``async with
agl.rollout(...)`` and posts the rollout with the lease, as ``agl worker`` does
per thread. All N rollouts share one loop and one thread, so each rollout's
spans stay apart only through context variables. It prints ``ready`` once the
agent module is imported, and exits after ``idle_exit`` seconds without a task,
or on SIGTERM.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import time
from typing import Any

import agl_core as agl
from agl_core.schema import Rollout, Trajectory
from agl_core.store.http import HttpStore
from agl_core.worker import Lease, TaskClient, point_openai_at


class LeaseStore:
    """Posts the rollout with its lease, so the task is done in the same step."""

    def __init__(self, store: HttpStore, lease: Lease) -> None:
        self.store, self.lease = store, lease
        self.summary: dict[str, Any] | None = None

    def put_rollout(self, rollout: Rollout, trajectory: Trajectory | None = None, *, validate: bool = True) -> None:
        self.summary = self.store.post_rollout(rollout, lease_id=self.lease.lease_id)


async def main(url: str, slots: int, idle_exit: float) -> None:
    point_openai_at(url, None)
    agl.instrument()
    import scale_agents

    tasks, store = TaskClient(url), HttpStore(url)
    worker_id = f"asyncio-{os.getpid()}"
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    posted = 0

    async def slot() -> None:
        nonlocal posted
        last = time.monotonic()
        while not stop.is_set() and time.monotonic() - last < idle_exit:
            lease = await asyncio.to_thread(tasks.lease, worker_id, wait_s=0.5)
            if lease is None:
                continue
            sink = LeaseStore(store, lease)
            try:
                async with agl.rollout(lease.task_id, lease.task, attempt=lease.attempt, store=sink):
                    agl.emit_reward(await scale_agents.agent_async(lease.task))
            except Exception as exc:  # noqa: BLE001 - the failure is the rollout's status, already posted
                print(f"rollout {lease.task_id} failed: {type(exc).__name__}: {exc}", flush=True)
            if sink.summary is None:
                await asyncio.to_thread(functools.partial(tasks.release, lease.lease_id, "the rollout was not posted",
                                                          failed=True))
            else:
                posted += 1
            last = time.monotonic()

    print("ready", flush=True)
    await asyncio.gather(*(slot() for _ in range(slots)))
    print(f"posted {posted}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 3600.0))
