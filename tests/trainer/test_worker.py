"""The full loop: server + gateway + fake vLLM backend, workers running unchanged OpenAI agents; and faults."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agl_core.testing import FakeOpenAI, render_prompt, tokenize
from agl_core.worker import TaskClient, Worker

from . import trainer_test_agents as agents
from .conftest import PYTHON, ServerFactory

QUESTIONS = [{"id": f"q{i}", "q": f"say {i}", "answer": str(i)} for i in range(8)]


@pytest.fixture(autouse=True)
def _restore_openai_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Workers point OPENAI_* at the gateway; keep that inside each test."""
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    monkeypatch.setenv("AGL_TEST_DIR", str(tmp_path))


def _run_worker(url: str, agent: Any, **kwargs: Any) -> Worker:
    worker = Worker(url, agent, concurrency=kwargs.pop("concurrency", 4), idle_exit_s=kwargs.pop("idle_exit_s", 0.5),
                    poll_s=0.2, instrument=False, **kwargs)
    worker.run()
    return worker


def test_worker_runs_a_plain_openai_agent_with_gateway_token_ids(fake: FakeOpenAI,
                                                                 make_server: ServerFactory) -> None:
    srv = make_server(fake, token="tok")
    tasks = TaskClient(srv.url, "tok")
    tasks.enqueue(QUESTIONS)
    worker = _run_worker(srv.url, agents.solve, token="tok")
    assert worker.stats.posted == 8 and worker.stats.agent_errors == 0
    assert worker.stats.token_sources == {"gateway": 8}
    assert tasks.counts() == {"queued": 0, "leased": 0, "done": 8, "failed": 0}
    store = srv.server.store
    for q in QUESTIONS:
        (traj,) = store.trajectories(task_id=q["id"])
        assert traj.reward == 1.0 and traj.attempt == 1
        (t,) = traj.transitions
        assert t.token_source == "gateway"
        assert t.prompt_token_ids == tokenize(render_prompt([{"role": "user", "content": q["q"]}]))
        assert t.response_token_ids == tokenize(q["q"])
        assert store.get_rollout(traj.rollout_id).metadata["agl.group_id"] == q["id"]  # type: ignore[union-attr]


def test_worker_runs_an_async_rollout_fn_with_streaming(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    TaskClient(srv.url).enqueue(QUESTIONS[:4], repeat=2)
    worker = _run_worker(srv.url, agents.solve_async, concurrency=3)
    assert worker.stats.posted == 8 and worker.stats.transitions == 16
    assert worker.stats.token_sources == {"gateway": 16}
    groups = {}
    for r in srv.server.store.rollouts():
        groups.setdefault(r.metadata["agl.group_id"], []).append(r.task_id)
    assert sorted(groups["q0"]) == ["q0#0", "q0#1"]
    streamed = [t for t in srv.server.store.transitions() if t.prompt[-1]["content"] == "sure?"]
    assert len(streamed) == 8 and all(t.response_logprobs for t in streamed)


def test_backend_failure_fails_the_rollout_with_the_reason(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=[{"status": 500, "error": "engine crashed"}]) as fake:
        srv = make_server(fake)
        tasks = TaskClient(srv.url)
        tasks.enqueue(QUESTIONS[:1])
        worker = _run_worker(srv.url, agents.solve, concurrency=1)
    assert worker.stats.agent_errors == 1 and worker.stats.posted == 1
    (rollout,) = srv.server.store.rollouts()
    assert rollout.status == "failed" and "engine crashed" in (rollout.error or "")
    assert tasks.task("q0")["state"] == "done"
    (traj,) = srv.server.store.trajectories()
    assert traj.transitions == [] and "the call failed" in traj.skipped[0].reason


def test_bad_agent_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="pkg.module:function"):
        Worker("http://127.0.0.1:9", "no_colon", instrument=False)
    with pytest.raises(ValueError, match="cannot import 'no_such_module_here'"):
        Worker("http://127.0.0.1:9", "no_such_module_here:fn", instrument=False)
    with pytest.raises(ValueError, match="has no 'nope'"):
        Worker("http://127.0.0.1:9", "json:nope", instrument=False)


# ---------------------------------------------------------------------- faults, with workers in subprocesses


def _worker_process(url: str, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, "-m", "agl_core.cli", "worker", "--server", url, "--agent",
                             "trainer_test_agents:blocking", "--poll", "0.2", "--log-level", "WARNING", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)


def test_kill_9_mid_rollout_is_retried_as_attempt_2(fake: FakeOpenAI, make_server: ServerFactory, tmp_path: Path,
                                                    subprocess_env: dict[str, str]) -> None:
    srv = make_server(fake, lease_timeout_s=1.0, sweep_interval_s=0.1)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "k", "q": "hello"}])
    victim = _worker_process(srv.url, subprocess_env)
    try:
        _wait_for(lambda: any(tmp_path.glob(f"started-k-{victim.pid}")))
        assert tasks.task("k")["state"] == "leased"
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
    finally:
        victim.kill()
    (tmp_path / "go").touch()
    worker = _run_worker(srv.url, agents.blocking, concurrency=1, idle_exit_s=10, max_tasks=1)
    assert worker.stats.posted == 1
    info = tasks.task("k")
    assert info["state"] == "done" and info["attempt"] == 2
    assert info["attempts"][0]["outcome"].startswith("expired") and info["attempts"][1]["outcome"] == "finished"
    (rollout,) = srv.server.store.rollouts(task_id="k")  # nothing of attempt 1 was stored: no duplicates
    assert rollout.attempt == 2 and rollout.id == info["rollout_id"]
    transitions = srv.server.store.transitions(task_id="k")
    assert len(transitions) == 2 and {t.token_source for t in transitions} == {"gateway"}
    assert all(t.attempt == 2 for t in transitions)


def test_sigterm_finishes_rollouts_in_flight(fake: FakeOpenAI, make_server: ServerFactory, tmp_path: Path,
                                             subprocess_env: dict[str, str]) -> None:
    srv = make_server(fake)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "a", "q": "x"}, {"id": "b", "q": "y"}, {"id": "c", "q": "z"}])
    proc = _worker_process(srv.url, subprocess_env, "-n", "2", "--grace", "20")
    try:
        _wait_for(lambda: len(list(tmp_path.glob("started-*"))) == 2)
        proc.send_signal(signal.SIGTERM)
        threading.Timer(0.5, (tmp_path / "go").touch).start()
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    counts = tasks.counts()
    assert counts == {"queued": 1, "leased": 0, "done": 2, "failed": 0}, out  # the third was never leased
    assert all(r.status == "succeeded" for r in srv.server.store.rollouts())


def test_sigterm_past_the_grace_releases_leases(fake: FakeOpenAI, make_server: ServerFactory, tmp_path: Path,
                                                subprocess_env: dict[str, str]) -> None:
    srv = make_server(fake)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "a", "q": "x"}])
    proc = _worker_process(srv.url, subprocess_env, "--grace", "0.3")
    try:
        _wait_for(lambda: any(tmp_path.glob("started-a-*")))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    info = tasks.task("a")
    assert info["state"] == "queued" and info["released"] == 1, out
    assert info["attempts"][0]["outcome"].startswith("released: worker")
    (tmp_path / "go").touch()
    worker = _run_worker(srv.url, agents.blocking, concurrency=1)
    assert worker.stats.posted == 1 and tasks.task("a")["attempt"] == 2


def test_workers_as_ray_actors_on_a_local_cluster(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    ray = pytest.importorskip("ray")
    from agl_core.worker import run_on_ray

    from .conftest import HERE, REPO

    srv = make_server(fake)
    tasks = TaskClient(srv.url)
    tasks.enqueue(QUESTIONS)
    path = os.pathsep.join([str(HERE), str(REPO / "src"), str(REPO / "trainer")])
    try:
        stats = run_on_ray("local", srv.url, "trainer_test_agents:solve", actors=2, actor_cpus=0.5,
                           runtime_env={"env_vars": {"PYTHONPATH": path}},
                           ray_init={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False},
                           concurrency=2, max_tasks=4, idle_exit_s=30.0, poll_s=0.2)
    finally:
        ray.shutdown()
    assert stats.posted == 8 and stats.token_sources == {"gateway": 8}
    assert tasks.counts() == {"queued": 0, "leased": 0, "done": 8, "failed": 0}
    workers = {tasks.task(q["id"])["attempts"][0]["worker_id"] for q in QUESTIONS}
    assert len(workers) == 2  # each actor took its four


# ---------------------------------------------------------------------- the heartbeat and the result post


def _slow_agent(task: Any) -> float:
    time.sleep(float(task["sleep"]))
    return 1.0


def _heartbeat_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == "agl-worker-heartbeat"), None)


def test_a_heartbeat_answered_after_the_rollout_was_posted_is_not_a_lost_lease(
        fake: FakeOpenAI, make_server: ServerFactory, caplog: pytest.LogCaptureFixture) -> None:
    """The race: a heartbeat sent while the agent runs reaches the server after the rollout finished the lease."""
    srv = make_server(fake)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "r", "sleep": 0.5}])
    worker = Worker(srv.url, _slow_agent, concurrency=1, max_tasks=1, poll_s=0.2, heartbeat_s=0.05,
                    instrument=False)
    real = worker.tasks.heartbeat
    held: list[list[str]] = []

    def late_heartbeat(lease_ids: Any) -> tuple[list[str], list[str]]:
        # hold the first heartbeat until the rollout it covers is posted: the interleaving the race needs
        if not held:
            held.append(list(lease_ids))
            _wait_for(lambda: tasks.counts()["done"] == 1, timeout=10)
        return real(lease_ids)

    worker.tasks.heartbeat = late_heartbeat  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="agl.worker"):
        worker.run()
        beat = _heartbeat_thread()
        if beat is not None:
            beat.join(timeout=10)
    assert held and worker.stats.posted == 1
    assert real(held[0]) == ([], held[0])  # the server does answer "lost" for the finished lease
    assert worker.stats.lost == 0
    assert not [r for r in caplog.records if "lost" in r.getMessage()], caplog.text


def test_a_lease_that_really_expired_is_reported_lost_once(fake: FakeOpenAI, make_server: ServerFactory,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    srv = make_server(fake, sweep_interval_s=0.05)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "e", "sleep": 1.5}], max_attempts=1)
    # heartbeats come less often than the lease lasts: the server expires it while the agent runs
    worker = Worker(srv.url, _slow_agent, concurrency=1, max_tasks=1, poll_s=0.2, heartbeat_s=0.7,
                    lease_timeout=0.3, instrument=False)
    with caplog.at_level("WARNING", logger="agl.worker"):
        worker.run()
    assert worker.stats.lost == 1 and worker.stats.posted == 0  # seen by the heartbeat and the post: counted once
    assert any("was lost" in r.getMessage() for r in caplog.records), caplog.text
    assert tasks.task("e")["state"] == "failed"
    assert srv.server.store.rollouts(task_id="e") == []
