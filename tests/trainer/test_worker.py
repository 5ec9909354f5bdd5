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


def test_a_backend_failure_is_retried_and_the_next_attempt_is_the_result(make_server: ServerFactory) -> None:
    """A 500 from the engine is the infrastructure failing, not the agent: no failed rollout is stored for it."""
    with FakeOpenAI(script=[{"status": 500, "error": "engine crashed"}]) as fake:
        srv = make_server(fake, retry_backoff_s=0.05)
        tasks = TaskClient(srv.url)
        tasks.enqueue(QUESTIONS[:1])
        worker = _run_worker(srv.url, agents.solve, concurrency=1)
    assert worker.stats.agent_errors == 1 and worker.stats.infrastructure_errors == 1 and worker.stats.posted == 1
    info = tasks.task("q0")
    assert (info["state"], info["attempt"]) == ("done", 2)
    assert info["attempts"][0]["outcome"].startswith("failed: infrastructure") \
        and "engine crashed" in info["attempts"][0]["outcome"]
    (rollout,) = srv.server.store.rollouts()
    assert (rollout.status, rollout.attempt, rollout.final_reward) == ("succeeded", 2, 1.0)


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


# ---------------------------------------------------------------------- tokens, and a backend that fails


@pytest.mark.parametrize(("token", "problem"), [(None, "needs a bearer token"), ("nope", "token is wrong")])
def test_a_worker_without_the_right_token_stops_with_the_reason(fake: FakeOpenAI, make_server: ServerFactory,
                                                               token: str | None, problem: str) -> None:
    from agl_core.store.http import ServerError

    srv = make_server(fake, token="tok")
    tasks = TaskClient(srv.url, "tok")
    tasks.enqueue(QUESTIONS[:2])
    worker = Worker(srv.url, agents.solve, token=token, concurrency=2, poll_s=0.2, instrument=False)
    start = time.monotonic()
    with pytest.raises(ServerError, match=problem) as err:
        worker.run()
    assert err.value.status == 401 and "--token" in str(err.value)
    assert time.monotonic() - start < 10  # not retried forever
    assert tasks.counts() == {"queued": 2, "leased": 0, "done": 0, "failed": 0}  # nothing taken, nothing lost
    assert fake.requests == []


def test_worker_command_with_a_wrong_token_exits_2(fake: FakeOpenAI, make_server: ServerFactory,
                                                   subprocess_env: dict[str, str]) -> None:
    srv = make_server(fake, token="tok")
    done = subprocess.run([PYTHON, "-m", "agl_core.worker", "--server", srv.url, "--agent",
                           "trainer_test_agents:solve", "--token", "nope", "--poll", "0.2"],
                          env=subprocess_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "the bearer token is wrong" in done.stderr, done.stderr


def test_a_rollout_posted_with_a_wrong_token_leaves_the_agent_alone(fake: FakeOpenAI,
                                                                    make_server: ServerFactory) -> None:
    import agl_core as agl
    from agl_core.store.http import ServerError

    srv = make_server(fake, token="tok")
    with agl.rollout(task_id="t", store=agl.HttpStore(srv.url, "nope")) as run:
        agl.emit_reward(1.0)  # the agent's own work goes on; the store's refusal is reported, not raised
    assert isinstance(run.store_error, ServerError) and run.store_error.status == 401
    assert srv.server.store.rollouts() == []


def _dead_backend() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@pytest.mark.parametrize("failure", ["timeout", "unreachable"])
def test_a_backend_that_times_out_or_is_down_fails_the_task_with_the_reason(make_server: ServerFactory,
                                                                            failure: str) -> None:
    from agl_trainer.gateway import GatewayConfig, OpenAIBackend

    def slow(body: dict[str, Any]) -> str:
        time.sleep(1.5)
        return "late"

    with FakeOpenAI(script=slow) as fake:
        backend = OpenAIBackend(fake.url, timeout_s=0.3) if failure == "timeout" else OpenAIBackend(_dead_backend())
        srv = make_server(backend, gateway=GatewayConfig(served_model="policy"), max_attempts=2, retry_backoff_s=0.05)
        tasks = TaskClient(srv.url)
        tasks.enqueue(QUESTIONS[:1])
        worker = _run_worker(srv.url, agents.solve, concurrency=1)
    _assert_failed_with(srv, tasks, worker, "did not answer within 0.3 s" if failure == "timeout"
                        else "could not be reached")


def test_a_backend_that_dies_mid_stream_fails_the_rollout_with_the_reason(make_server: ServerFactory) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agl_trainer.gateway import GatewayConfig, OpenAIBackend

    class Dying(BaseHTTPRequestHandler):
        """Streams one chunk of an answer, then drops the connection (an engine that crashed)."""

        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            data = b'data: {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "policy", ' \
                   b'"prompt_token_ids": [1], "choices": [{"index": 0, "delta": {"content": "Hel"}, ' \
                   b'"token_ids": [5], "finish_reason": null}]}\n\n'
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            self.close_connection = True

    def streaming_agent(task: dict[str, Any]) -> float:
        import openai

        client = openai.OpenAI(max_retries=0)
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}],
                                                stream=True)
        return float(bool("".join(c.choices[0].delta.content or "" for c in stream if c.choices)))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        srv = make_server(OpenAIBackend(f"http://127.0.0.1:{server.server_address[1]}/v1"),
                          gateway=GatewayConfig(served_model="policy"), max_attempts=2, retry_backoff_s=0.05)
        tasks = TaskClient(srv.url)
        tasks.enqueue(QUESTIONS[:1])
        worker = _run_worker(srv.url, streaming_agent, concurrency=1)
    finally:
        server.shutdown()
        server.server_close()
    _assert_failed_with(srv, tasks, worker, "closed the connection mid-response")
    assert len(srv.server.records) == 0  # the broken call left no half record
    assert srv.server.store.transitions() == []  # the partial "Hel" is never trained on


def _assert_failed_with(srv: Any, tasks: TaskClient, worker: Worker, reason: str) -> None:
    """The infrastructure failed every try: the task fails with the reason, and no failed rollout is a result."""
    assert worker.stats.agent_errors == 2 and worker.stats.infrastructure_errors == 2 and worker.stats.posted == 0
    info = tasks.task("q0")
    assert info["state"] == "failed" and reason in info["error"] and "gave up after 2 attempts" in info["error"]
    assert [a["outcome"].startswith("failed: infrastructure") for a in info["attempts"]] == [True, True]
    assert srv.server.store.rollouts() == []
