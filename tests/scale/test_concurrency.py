"""Many rollouts over many concurrent workers against one server: nothing lost, duplicated or mis-attributed.

Worker processes (``agl worker``, several threads each, sync and async agents)
and an asyncio driver (many rollouts on one event loop) take tasks of three
frameworks from one server, whose gateway sits in front of FakeOpenAI. Every
rollout's transitions are then checked against what its agent did: the right
count, in order, each carrying its own task's nonce and no other, with the
gateway's token ids for exactly its own prompt and response.

CI: 120 rollouts over 16 concurrent slots. ``AGL_FULL=1``: 1,000 over 64.
The figures (seconds, rollouts/s, transitions/s) are printed.
"""

from __future__ import annotations

import time
from pathlib import Path

from scale_harness import (
    FULL,
    SEED,
    Processes,
    check_transitions,
    expected_count,
    free_port,
    make_tasks,
    stop_gracefully,
)

from agl_core.store.sqlite import SqliteStore
from agl_core.worker import TaskClient
from agl_trainer.queue import TaskQueue

if FULL:
    ROLLOUTS, SYNC_WORKERS, ASYNC_WORKERS, DRIVERS, THREADS, DRIVER_SLOTS = 1000, 2, 2, 1, 12, 16
else:
    ROLLOUTS, SYNC_WORKERS, ASYNC_WORKERS, DRIVERS, THREADS, DRIVER_SLOTS = 120, 1, 1, 1, 4, 8
CONCURRENCY = (SYNC_WORKERS + ASYNC_WORKERS) * THREADS + DRIVERS * DRIVER_SLOTS


def test_rollouts_over_concurrent_workers_lose_duplicate_and_misattribute_nothing(procs: Processes,
                                                                                 tmp_path: Path) -> None:
    db = tmp_path / "agl.db"
    _, backend_url = procs.backend()
    _, url = procs.server(db, backend_url, free_port())
    workers = [procs.worker(url, THREADS, worker_id=f"sync-{i}") for i in range(SYNC_WORKERS)]
    workers += [procs.worker(url, THREADS, asynchronous=True, worker_id=f"async-{i}") for i in range(ASYNC_WORKERS)]
    drivers = [procs.asyncio_driver(url, DRIVER_SLOTS) for _ in range(DRIVERS)]
    for w in workers:
        w.wait_for_line("agl worker: ", timeout=120)  # the agent module is imported: ready to lease
    for d in drivers:
        d.wait_for_line("ready", timeout=120)

    tasks = make_tasks(ROLLOUTS, SEED)
    client = TaskClient(url)
    start = time.monotonic()
    client.enqueue(tasks)
    counts = client.wait(timeout=600 if FULL else 150, poll_s=0.2)
    elapsed = time.monotonic() - start
    stop_gracefully([*workers, *drivers])
    assert counts == {"queued": 0, "leased": 0, "done": ROLLOUTS, "failed": 0}, counts

    store, queue = SqliteStore(str(db)), TaskQueue(str(db))
    try:
        rollouts = store.rollouts()
        transitions = store.transitions()
        problems: list[str] = []
        by_task: dict[str, list] = {}
        for r in rollouts:
            by_task.setdefault(r.task_id, []).append(r)
        for task in tasks:
            stored = by_task.pop(task["id"], [])
            info = queue.get(task["id"])
            assert info is not None
            if len(stored) != 1:
                problems.append(f"{task['id']}: {len(stored)} rollouts stored")
                continue
            (rollout,) = stored
            if rollout.status != "succeeded" or info.rollout_id != rollout.id or info.attempt != 1:
                problems.append(f"{task['id']}: {rollout.status} {rollout.error}, attempt {info.attempt}")
            problems += check_transitions(task, rollout, store.transitions(rollout_id=rollout.id))
        assert not by_task, f"rollouts of unknown tasks: {sorted(by_task)[:5]}"
        keys = [(t.rollout_id, t.index) for t in transitions]
        assert len(set(keys)) == len(keys), "a transition was stored twice"
        assert len({t.span_id for t in transitions}) == len(transitions), "two transitions share one LLM span"
        assert not problems, "\n".join(problems[:40])
        want = sum(expected_count(t) for t in tasks)
        assert len(transitions) == want
        workers_used = {queue.get(t["id"]).attempts[0]["worker_id"].split("-")[0] for t in tasks}  # type: ignore
    finally:
        store.close()
        queue.close()
    assert workers_used == {"sync", "async", "asyncio"}, workers_used
    print(f"\nscale: {ROLLOUTS} rollouts ({want} transitions, 3 frameworks) over {CONCURRENCY} concurrent "
          f"slots in {elapsed:.1f} s: {ROLLOUTS / elapsed:.1f} rollouts/s, {want / elapsed:.1f} transitions/s")
