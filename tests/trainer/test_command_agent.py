"""``agl worker --command``: an agent in any language, a subprocess per task, on its rollout-scoped gateway URL."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agl_core.testing import FakeOpenAI, render_prompt, tokenize
from agl_core.worker import TaskClient, Worker

from .conftest import HERE, PYTHON, REPO, ServerFactory

NODE_DIR = REPO / ".venvs" / "node-openai"
"""Where the test set-up installs the `openai` npm package (once; .venvs is the test environments' folder)."""
GEO_AGENT = HERE / "node_agents" / "geo_agent.cjs"


@pytest.fixture(scope="session")
def node_openai() -> Path:
    """The node_modules folder holding the `openai` npm package, installed from the configured npm registry."""
    modules = NODE_DIR / "node_modules"
    if (modules / "openai" / "package.json").exists():
        return modules
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.fail(f"the Node.js agent test needs {tool} on PATH (Node 20 and npm)")
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(NODE_DIR), "openai@4"],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("npm install openai@4 took more than 300 s: is the npm registry reachable?")
    if done.returncode != 0 or not (modules / "openai" / "package.json").exists():
        pytest.fail(f"npm install openai@4 failed (exit {done.returncode}), so the Node.js agent cannot run:\n"
                    f"{(done.stderr or done.stdout)[-3000:]}")
    return modules


def _geo_model(body: dict[str, Any]) -> Any:
    """The model: looks the city up, then answers with the tool's result (or gets it wrong for Rome)."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return f"It is in {last['content'] if last['content'] != 'Italy' else 'Spain'}"
    city = last["content"].split()[3]
    return {"tool_calls": [{"name": "lookup", "arguments": {"city": city}, "id": f"call_{city}"}]}


def test_a_node_agent_on_the_openai_package_run_by_agl_worker_command_has_exact_gateway_ids(
        node_openai: Path, make_server: ServerFactory, subprocess_env: dict[str, str]) -> None:
    with FakeOpenAI(script=_geo_model) as fake:
        srv = make_server(fake, token="tok")  # the agent's OPENAI_API_KEY carries it to the scoped URL
        tasks = TaskClient(srv.url, "tok")
        tasks.enqueue([{"city": "Paris", "country": "France"}, {"city": "Rome", "country": "Italy"}],
                      task_ids=["paris", "rome"])
        env = {**subprocess_env, "NODE_PATH": str(node_openai)}
        done = subprocess.run([PYTHON, "-m", "agl_core.cli", "worker", "--server", srv.url, "--token", "tok",
                               "--command", f"node {GEO_AGENT}", "--max-tasks", "2", "--idle-exit", "2",
                               "--poll", "0.2"],
                              env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        sent = [r.body for r in fake.requests if r.path.endswith("/chat/completions")]
    assert tasks.counts() == {"queued": 0, "leased": 0, "done": 2, "failed": 0}
    assert len(sent) == 4
    store = srv.server.store
    for (task_id, city, reward), bodies in zip([("paris", "Paris", 1.0), ("rome", "Rome", 0.0)],
                                               [sent[:2], sent[2:]], strict=True):
        (traj,) = store.trajectories(task_id=task_id)
        assert traj.reward == reward
        ask, answer = traj.transitions
        args = json.dumps({"city": city})
        assert ask.response["tool_calls"] == [{"id": f"call_{city}", "type": "function",
                                               "function": {"name": "lookup", "arguments": args}}]
        assert ask.prompt == [{"role": "user", "content": f"Which country is {city} in?"}]
        assert ask.tools is not None and ask.tools[0]["function"]["name"] == "lookup"
        assert answer.prompt[-1]["role"] == "tool" and answer.prompt[-1]["tool_call_id"] == f"call_{city}"
        country = "France" if city == "Paris" else "Spain"
        assert answer.response["content"] == f"It is in {country}"
        for t, body, generated in ((ask, bodies[0], f"<tool_call> lookup {args}"),
                                   (answer, bodies[1], f"It is in {country}")):
            assert t.token_source == "gateway"
            assert t.prompt_token_ids == tokenize(render_prompt(body["messages"]))  # the engine's, as it saw them
            assert t.response_token_ids == tokenize(generated)
            assert t.credited_reward == reward
        assert bodies[1]["stream"] is True  # the second call was streamed, and kept its ids
        rollout = store.get_rollout(traj.rollout_id)
        assert rollout is not None and rollout.status == "succeeded"
        assert rollout.metadata["agl.group_id"] == task_id


AGENT_PY = """
import json, os, sys
task = json.loads(sys.stdin.readline())
assert json.loads(os.environ["AGL_TASK"]) == task
assert os.environ["OPENAI_BASE_URL"].endswith("/rollouts/" + os.environ["AGL_ROLLOUT_ID"] + "/v1")
assert os.environ["AGL_BASE_URL"] == os.environ["OPENAI_BASE_URL"]
print("some log line")
if task["do"] == "fail":
    print("it broke", file=sys.stderr)
    sys.exit(3)
if task["do"] == "infra":
    sys.exit(75)
if task["do"] == "reward":
    print(json.dumps({"reward": 0.25}))
"""


def test_the_command_contract_exit_status_and_reward_line(fake: FakeOpenAI, make_server: ServerFactory,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    script = tmp_path / "agent.py"
    script.write_text(AGENT_PY)
    srv = make_server(fake)
    tasks = TaskClient(srv.url)
    tasks.enqueue([{"do": "reward"}, {"do": "nothing"}, {"do": "fail"}, {"do": "infra"}],
                  task_ids=["reward", "nothing", "fail", "infra"], max_attempts=1)
    worker = Worker(srv.url, command=f"{sys.executable} {script}", idle_exit_s=0.5, poll_s=0.2, instrument=False,
                    concurrency=2)
    worker.run()
    store = srv.server.store
    (ok,) = store.rollouts(task_id="reward")
    assert ok.status == "succeeded" and store.trajectories(task_id="reward")[0].reward == 0.25
    (quiet,) = store.rollouts(task_id="nothing")
    assert quiet.status == "succeeded" and store.trajectories(task_id="nothing")[0].reward is None
    failed = [r for r in store.rollouts(task_id="fail") if r.status != "running"]
    assert [r.status for r in failed] == ["failed"] and "exited with status 3: it broke" in (failed[0].error or "")
    assert tasks.task("infra")["state"] == "failed"  # given back without a result ...
    (given_back,) = store.rollouts(task_id="infra")  # ... and its opened rollout does not stay "running"
    assert given_back.status == "cancelled" and "exited 75 (infrastructure)" in (given_back.error or "")
    assert store.trajectories(task_id="infra")[0].transitions == []
    assert worker.stats.infrastructure_errors == 1
    with pytest.raises(ValueError, match="one of them"):
        Worker(srv.url, instrument=False)
