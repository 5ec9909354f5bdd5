"""Workers, the server and the model backend killed mid-run, with poison tasks in the queue.

A seeded schedule (``AGL_SCALE_SEED``) decides when to act, as shares of the
run's tasks finished, and which busy worker dies: kill -9 a worker holding
leases (a replacement starts), kill -9 the model backend for a few seconds
(the agents' calls fail for the infrastructure: their attempts are retried,
not results), kill -9 the server and start it again on the same port and file,
kill -9 another worker. Among the tasks are poison ones whose rollouts no
server can store (over its body limit). Then every task must
end done or failed with a reason, a poison task failed within ``max_attempts``
tries; every finished rollout must be whole (its transitions checked against
its agent, as in the concurrency test) and its own task's; no transition, span
or nonce may appear twice; a task that was retried must show it as new
attempts, numbered up, with only its last attempt's rollout stored; and every
listing of the server (HttpStore) must hold exactly what the store holds.
Token ids may miss the gateway's record only for calls answered within the
last second before the server died (its records reach the file every 0.25 s).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from scale_harness import FULL, SEED, Child, Processes, check_transitions, free_port, make_tasks, stop_gracefully

from agl_core.store.http import HttpStore
from agl_core.store.sqlite import SqliteStore
from agl_core.worker import TaskClient
from agl_trainer.queue import TaskQueue

TASKS = 300 if FULL else 60
POISON = 12 if FULL else 4
WORKERS = 4 if FULL else 3
THREADS = 4 if FULL else 3
LEASE_TIMEOUT_S = 2.0
MAX_ATTEMPTS = 4
RESTART_GAP_S = (0.3, 1.5)
BACKEND_GAP_S = (2.5, 3.5)  # longer than the agents' clients retry by themselves: some calls must fail


def _busy_worker(client: TaskClient, alive: dict[str, Child], rng: random.Random) -> str | None:
    """A live worker that holds a lease now (so it dies mid-rollout), picked by ``rng``."""
    _, data = client.client.request("GET", "/v1/tasks", query={"state": "leased"})
    holders = sorted({t["worker_id"] for t in data["tasks"]} & set(alive))
    return rng.choice(holders) if holders else None


def test_killed_workers_and_a_killed_server_lose_and_duplicate_nothing(procs: Processes, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    db = tmp_path / "agl.db"
    port = free_port()
    server_args = ("--lease-timeout", str(LEASE_TIMEOUT_S), "--max-attempts", str(MAX_ATTEMPTS), "--backend-timeout",
                   "10", "--max-body-mb", "1", "--retry-backoff", "0.5")
    backend_port = free_port()
    backend, backend_url = procs.backend(backend_port)
    server, url = procs.server(db, backend_url, port, *server_args)
    alive: dict[str, Child] = {}
    serial = 0

    def start_worker() -> None:
        nonlocal serial
        name = f"w{serial}"
        alive[name] = procs.worker(url, THREADS, asynchronous=serial % 2 == 1, worker_id=name)
        serial += 1

    for _ in range(WORKERS):
        start_worker()
    for child in alive.values():
        child.wait_for_line("agl worker: ", timeout=120)

    tasks = make_tasks(TASKS, SEED, delay=(0.05, 0.4), poison=POISON)
    by_id = {t["id"]: t for t in tasks}
    client = TaskClient(url, retry_s=30.0)
    client.enqueue(tasks)
    # the schedule: at these shares of tasks done, kill a worker / the backend / the server / a worker
    schedule = [(share + rng.uniform(-0.05, 0.05), what)
                for share, what in ((0.15, "worker"), (0.3, "backend"), (0.5, "server"), (0.7, "worker"))]
    log: list[str] = [f"seed {SEED}"]
    server_deaths: list[float] = []
    deadline = time.monotonic() + (900 if FULL else 240)
    while schedule:
        assert time.monotonic() < deadline, f"the run stalled: {client.counts()}; {log}"
        share, what = schedule[0]
        counts = client.counts()
        if counts["done"] + counts["failed"] < share * len(tasks):
            time.sleep(0.05)
            continue
        time.sleep(rng.uniform(0.0, 0.3))  # a random point inside whatever is running now
        if what == "worker":
            name = _busy_worker(client, alive, rng)
            if name is None:
                continue
            alive.pop(name).kill()
            log.append(f"killed worker {name} at {counts}")
            start_worker()
        elif what == "backend":
            backend.kill()
            time.sleep(rng.uniform(*BACKEND_GAP_S))
            backend, url2 = procs.backend(backend_port)
            assert url2 == backend_url
            log.append(f"killed and restarted the model backend at {counts}")
        else:
            server.kill()
            server_deaths.append(time.time())
            time.sleep(rng.uniform(*RESTART_GAP_S))
            server, url2 = procs.server(db, backend_url, port, *server_args)
            assert url2 == url
            log.append(f"killed and restarted the server at {counts}")
        schedule.pop(0)
    while True:
        counts = client.counts()
        if counts["queued"] == counts["leased"] == 0:
            break
        assert time.monotonic() < deadline, f"tasks still pending: {counts}; {log}"
        time.sleep(0.2)
    stop_gracefully(alive.values())
    listed = _listings(HttpStore(url))
    stop_gracefully([server])

    store, queue = SqliteStore(str(db)), TaskQueue(str(db))
    try:
        problems = _check_run(store, queue, by_id, server_deaths)
        if listed != _listings(store):
            problems.append("the server's listings (HttpStore) differ from what its store holds")
        retried = [t for t in queue.tasks() if t.attempt > 1]
        infrastructure = [a for t in queue.tasks() for a in (queue.get(t.task_id) or t).attempts
                          if (a["outcome"] or "").startswith("failed: infrastructure")]
        failed_rollouts = store.rollouts(status="failed")
        sources = [t.token_source for t in store.transitions()]
    finally:
        store.close()
        queue.close()
    print(f"\ncrashes: {'; '.join(log)}; final {counts}; {len(retried)} tasks retried, {len(infrastructure)} "
          f"attempts failed for the infrastructure (retried, not stored), {len(failed_rollouts)} rollouts failed, "
          f"{len(sources)} transitions, {sum(s != 'gateway' for s in sources)} without the gateway's ids")
    assert not problems, "\n".join([*log, *problems[:40]])
    assert retried, f"no task was retried, so no kill landed mid-rollout: {log}"
    assert infrastructure, f"no call met the dead backend, so no infrastructure failure was retried: {log}"


def _listings(store: Any) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """What every listing of ``store`` holds, in its order (HttpStore pages through the server's)."""
    return ([r.id for r in store.rollouts()], [(t.rollout_id, t.index) for t in store.transitions()],
            [t.rollout_id for t in store.trajectories()])


def _check_run(store: SqliteStore, queue: TaskQueue, by_id: dict[str, dict[str, Any]],
               server_deaths: list[float]) -> list[str]:
    problems: list[str] = []
    rollouts: dict[str, list[Any]] = {}
    for r in store.rollouts(with_spans=True):
        rollouts.setdefault(r.task_id, []).append(r)
    transitions = store.transitions()
    keys = [(t.rollout_id, t.index) for t in transitions]
    if len(set(keys)) != len(keys):
        problems.append("a transition was stored twice")
    if len({t.span_id for t in transitions}) != len(transitions):
        problems.append("two transitions share one LLM span")

    def near_a_server_death(t: Any, spans: dict[str, Any]) -> bool:
        span = spans.get(t.span_id)
        end = span.end_ns / 1e9 if span is not None else 0.0
        return any(death - 1.0 <= end <= death for death in server_deaths)

    owners: dict[str, str] = {}
    for task_id, task in by_id.items():
        info = queue.get(task_id)
        stored = rollouts.pop(task_id, [])
        if info is None or info.state not in ("done", "failed"):
            problems.append(f"{task_id}: ended {info and info.state}")
            continue
        for a in info.attempts:
            if a["rollout_id"] is not None and owners.setdefault(a["rollout_id"], task_id) != task_id:
                problems.append(f"{task_id}: its rollout {a['rollout_id']} is also {owners[a['rollout_id']]}'s")
        tries = [a for a in info.attempts if not (a["outcome"] or "").startswith("released")]
        if len(tries) > MAX_ATTEMPTS:
            problems.append(f"{task_id}: {len(tries)} tries, more than max_attempts {MAX_ATTEMPTS}")
        if task.get("poison"):
            # a kill may land on a poison task too: one of its tries must have met the server's refusal
            refused = any("bytes" in (a["outcome"] or "") for a in info.attempts)
            if info.state != "failed" or not info.error or not refused or stored:
                problems.append(f"{task_id} (poison {task['poison']}): {info.state} with {info.error!r}, "
                                f"{len(stored)} rollouts stored")
            continue
        numbers = [a["attempt"] for a in info.attempts]
        if numbers != list(range(1, len(numbers) + 1)) or info.attempt != len(numbers):
            problems.append(f"{task_id}: attempts numbered {numbers}, task at attempt {info.attempt}")
        if any(a["outcome"] is None for a in info.attempts):
            problems.append(f"{task_id}: an attempt never ended: {info.attempts}")
        if info.state == "failed":
            if not info.error:
                problems.append(f"{task_id}: failed without a reason")
            if stored:
                problems.append(f"{task_id}: failed, yet {len(stored)} rollouts are stored")
            continue
        if len(stored) != 1:
            problems.append(f"{task_id}: {len(stored)} rollouts stored for one done task")
            continue
        (rollout,) = stored
        finished = [a for a in info.attempts if a["outcome"] == "finished"]
        if info.rollout_id != rollout.id or [a["attempt"] for a in finished] != [rollout.attempt]:
            problems.append(f"{task_id}: rollout {rollout.id} attempt {rollout.attempt}, task says "
                            f"{info.rollout_id} after attempts {info.attempts}")
        if any(a["attempt"] > rollout.attempt for a in info.attempts):
            problems.append(f"{task_id}: an attempt after the one whose rollout is stored")
        if rollout.status not in ("succeeded", "failed"):
            problems.append(f"{task_id}: rollout status {rollout.status}")
        if rollout.status == "failed" and not rollout.error:
            problems.append(f"{task_id}: a failed rollout without its error")
        spans = {s.span_id: s for s in rollout.spans}
        problems += check_transitions(task, rollout, store.transitions(rollout_id=rollout.id),
                                      complete=rollout.status == "succeeded",
                                      gateway_ok=lambda t, spans=spans: not near_a_server_death(t, spans))
    if rollouts:
        problems.append(f"rollouts of unknown tasks: {sorted(rollouts)[:5]}")
    return problems
