"""Poison tasks and infrastructure failures: every task ends done or failed with a reason, within max_attempts.

A real worker leases from the real server on 127.0.0.1; the model server is
FakeOpenAI (or a dead port), the agents are ordinary OpenAI-client functions.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import pytest

import agl_core as agl
from agl_core.testing import FakeOpenAI
from agl_core.worker import TaskClient, Worker, is_infrastructure_error

from .conftest import PYTHON, ServerFactory


@pytest.fixture(autouse=True)
def _restore_openai_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    monkeypatch.setenv("AGL_TEST_DIR", str(tmp_path))


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _work(url: str, agent: Any, **kwargs: Any) -> Worker:
    worker = Worker(url, agent, concurrency=1, idle_exit_s=kwargs.pop("idle_exit_s", 1.5), poll_s=0.2,
                    instrument=False, max_tasks=kwargs.pop("max_tasks", 30), **kwargs)
    worker.run()
    return worker


def _ask(task: dict[str, Any]) -> float:
    client = openai.OpenAI(max_retries=0)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}])
    return 1.0 if reply.choices[0].message.content else 0.0


def _starts(info: dict[str, Any]) -> list[float]:
    return [a["started"] for a in info["attempts"]]


# ---------------------------------------------------------------------- 3. poison tasks


class _RaisesBeforeItsRollout:
    """An agent object (already a rollout function, so the worker does not wrap it) that fails at once."""

    last_run = None

    def __call__(self, task: Any, **kwargs: Any) -> None:
        raise RuntimeError("no rollout today")


def test_an_agent_that_raises_before_its_rollout_exists_fails_within_max_attempts(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, max_attempts=3, retry_backoff_s=0.2)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "p", "q": "x"}])
    _work(srv.url, _RaisesBeforeItsRollout())
    info = tasks.task("p")
    assert (info["state"], len(info["attempts"])) == ("failed", 3), \
        f"state {info['state']} after {len(info['attempts'])} leases"
    assert "no rollout today" in info["error"] and "3 attempts" in info["error"]
    gaps = [b - a for a, b in zip(_starts(info), _starts(info)[1:], strict=False)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4, f"no back-off between tries: {gaps}"


def _too_big(task: dict[str, Any]) -> float:
    agl.emit_message("x" * 100_000)  # the rollout is over the server's body limit: 413
    return 1.0


def test_a_rollout_the_server_refuses_fails_its_task_within_max_attempts(fake: FakeOpenAI,
                                                                          make_server: ServerFactory) -> None:
    srv = make_server(fake, max_attempts=2, max_body_bytes=64 * 1024, retry_backoff_s=0.05)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "big", "q": "x"}, {"id": "fine", "q": "y"}])

    def agent(task: dict[str, Any]) -> float:
        return _too_big(task) if task["id"] == "big" else 1.0

    _work(srv.url, agent)
    info = tasks.task("big")
    assert (info["state"], len(info["attempts"])) == ("failed", 2), \
        f"state {info['state']} after {len(info['attempts'])} leases"
    assert "413" in info["error"] or "bytes" in info["error"], info["error"]
    assert tasks.task("fine")["state"] == "done"
    assert srv.server.store.rollouts(task_id="big") == []


@agl.rollout_fn
async def _cancels_itself(task: dict[str, Any]) -> float:
    raise asyncio.CancelledError()  # an agent whose own task is cancelled, every time


def test_an_agent_cancelled_every_time_fails_within_max_attempts(fake: FakeOpenAI,
                                                                 make_server: ServerFactory) -> None:
    srv = make_server(fake, max_attempts=2, retry_backoff_s=0.05)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "c", "q": "x"}, {"id": "after", "q": "y"}])
    worker = _work(srv.url, _cancels_itself)
    info = tasks.task("c")
    assert (info["state"], len(info["attempts"])) == ("failed", 2), info
    assert "cancelled" in info["error"]
    assert tasks.task("after")["state"] == "failed" and worker.stats.leased == 4  # the slot lived on


def test_a_shutdown_release_stays_free(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, max_attempts=1)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "s"}])
    for _ in range(3):
        lease = tasks.lease("w")
        assert lease is not None and tasks.release(lease.lease_id, "shutting down")
    assert tasks.task("s")["state"] == "queued"
    lease = tasks.lease("w")
    assert lease is not None and tasks.release(lease.lease_id, "it broke", failed=True)
    info = tasks.task("s")
    assert info["state"] == "failed" and "it broke" in info["error"]


# ---------------------------------------------------------------------- 4. infrastructure failures


def test_what_counts_as_an_infrastructure_failure() -> None:
    import httpx

    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    assert is_infrastructure_error(openai.APIConnectionError(request=request))
    assert is_infrastructure_error(openai.APITimeoutError(request=request))
    for status in (429, 500, 502, 503, 504):
        assert is_infrastructure_error(openai.APIStatusError("x", response=httpx.Response(status, request=request),
                                                             body=None)), status
    for status in (400, 401, 404, 422):
        assert not is_infrastructure_error(openai.APIStatusError("x", response=httpx.Response(status, request=request),
                                                                 body=None)), status
    assert is_infrastructure_error(httpx.ConnectError("refused"))
    assert is_infrastructure_error(ConnectionRefusedError())
    wrapped = ValueError("the agent gave up")
    wrapped.__cause__ = openai.APIConnectionError(request=request)
    assert is_infrastructure_error(wrapped)
    assert not is_infrastructure_error(ValueError("a bug in the agent"))
    assert not is_infrastructure_error(KeyError("answer"))


def test_a_gateway_that_cannot_be_reached_is_retried_not_a_result(fake: FakeOpenAI, make_server: ServerFactory,
                                                                  tmp_path: Path) -> None:
    srv = make_server(fake, retry_backoff_s=0.05)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "i", "q": "hello"}])
    dead = _dead_url() + "/v1"

    def agent(task: dict[str, Any]) -> float:
        flag = tmp_path / "first-try"
        first = not flag.exists()
        flag.touch()
        client = openai.OpenAI(base_url=dead if first else srv.url + "/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}])
        return 1.0

    _work(srv.url, agent)
    info = tasks.task("i")
    assert (info["state"], info["attempt"]) == ("done", 2), \
        f"task {info['state']} at attempt {info['attempt']}: {info['attempts']}"
    assert "APIConnectionError" in info["attempts"][0]["outcome"]
    (rollout,) = srv.server.store.rollouts(task_id="i")
    assert (rollout.status, rollout.attempt) == ("succeeded", 2)


def test_a_backend_that_fails_is_retried_then_the_task_fails_with_the_reason(make_server: ServerFactory) -> None:
    from agl_trainer.gateway import GatewayConfig, OpenAIBackend

    srv = make_server(OpenAIBackend(_dead_url() + "/v1"), gateway=GatewayConfig(served_model="policy"),
                      max_attempts=3, retry_backoff_s=0.05)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "d", "q": "x"}])
    _work(srv.url, _ask)
    info = tasks.task("d")
    assert (info["state"], len(info["attempts"])) == ("failed", 3), info
    assert "could not be reached" in info["error"]
    assert srv.server.store.rollouts() == []  # no failed rollout was taken for a result


def test_a_backend_error_once_is_retried_and_the_next_attempt_counts(make_server: ServerFactory) -> None:
    with FakeOpenAI(script=[{"status": 503, "error": "engine restarting"}]) as fake:
        srv = make_server(fake, retry_backoff_s=0.05)
        tasks = TaskClient(srv.url)
        tasks.enqueue([{"id": "q", "q": "hi"}])
        _work(srv.url, _ask)
    info = tasks.task("q")
    assert (info["state"], info["attempt"]) == ("done", 2), info
    assert "engine restarting" in info["attempts"][0]["outcome"]
    (rollout,) = srv.server.store.rollouts()
    assert (rollout.status, rollout.attempt, rollout.final_reward) == ("succeeded", 2, 1.0)


# ---------------------------------------------------------------------- the worker against an unreachable server


def test_a_worker_facing_an_unreachable_server_says_so_and_honours_idle_exit(subprocess_env: dict[str, str]) -> None:
    url = _dead_url()
    worker = subprocess.Popen([PYTHON, "-m", "agl_core.cli", "worker", "--server", url, "--agent",
                               "trainer_test_agents:solve", "--idle-exit", "2", "--log-level", "WARNING"],
                              env={**subprocess_env, **{k: v for k, v in os.environ.items() if k == "PATH"}},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    first = worker.stdout.readline()  # "working for ...": said once it started (imports take long on a busy machine)
    took, said = _worker_outlives(worker, time.monotonic(), 25)
    said = first + said
    assert f"cannot reach the agl server at {url}" in said, said
    assert said.count("cannot reach") < 10, said  # said with back-off, not once per attempt
    assert took < 2 + 6 and worker.returncode == 1, (took, worker.returncode, said)


def _serve(fake: FakeOpenAI, db: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """``agl serve --port 0`` in a subprocess; the process and the URL it printed."""
    proc = subprocess.Popen([PYTHON, "-m", "agl_core.cli", "serve", "--db", str(db), "--port", "0", "--backend",
                             fake.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("agl serve: listening on "), (line, proc.stderr.read() if proc.stderr else "")
    return proc, line.rsplit(" ", 1)[1].strip()


def _worker_outlives(proc: subprocess.Popen[str], killed_at: float, limit: float) -> tuple[float, str]:
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"agl worker still ran {limit:g} s after its server went away: {out!r} {err!r}"
                             ) from None
    return time.monotonic() - killed_at, out + err


@pytest.mark.parametrize("when", ["idle", "mid-rollout"])
def test_a_worker_whose_server_went_away_stops_within_idle_exit_with_one_line(
        fake: FakeOpenAI, tmp_path: Path, subprocess_env: dict[str, str], when: str) -> None:
    server, url = _serve(fake, tmp_path / "gone.db", subprocess_env)
    try:
        tasks = TaskClient(url)
        tasks.enqueue([{"id": "first", "q": "say 1", "answer": "1"}])
        agent = "trainer_test_agents:solve" if when == "idle" else "trainer_test_agents:blocking"
        worker = subprocess.Popen([PYTHON, "-m", "agl_core.cli", "worker", "--server", url, "--agent", agent,
                                   "--idle-exit", "2", "--poll", "0.5", "--log-level", "WARNING"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env)
        deadline = time.monotonic() + 30
        if when == "idle":  # the task is done and the worker waits for the next one
            while tasks.counts().get("done", 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert tasks.counts().get("done") == 1, tasks.counts()
        else:  # the agent is inside its rollout, its first call answered
            while not list(tmp_path.glob("started-first-*")) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert list(tmp_path.glob("started-first-*")), "the agent never started"
        tasks.close()
    finally:
        server.kill()
        server.wait(timeout=20)
    killed_at = time.monotonic()
    (tmp_path / "go").touch()
    took, said = _worker_outlives(worker, killed_at, 60)
    assert worker.returncode == 1, (worker.returncode, said)
    assert took < 2 + 6, f"the worker stopped {took:.1f} s after its server went away (--idle-exit 2): {said}"
    stops = [line for line in said.splitlines() if line.startswith("agl worker: stopped:")]
    assert len(stops) == 1 and f"cannot reach the agl server at {url}" in stops[0], said
    assert said.count("cannot reach") < 8, said
