"""Each example's ``train.yaml`` is a valid ``agl train`` config: it loads, names the example's entry point and task
file, and carries the same ``agent_match`` and AIR rules as the example's own ``TransitionBuilder``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import agl_core as agl
from agl_core.testing import FakeOpenAI
from agl_core.worker import TaskClient, Worker
from agl_trainer.config import ConfigError, load_config, load_tasks

from .conftest import ServerFactory

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["sql_agent", "rag_agent", "calc_agent", "crewai_agent", "openai_client_agent", "agent_framework_agent",
            "pydantic_ai_agent", "spider_agent"]
# what each example's BUILDER says (the framework suites check the BUILDERs themselves)
RULES = {
    "sql_agent": ("writer|rewriter", {"tool_error": -0.5, "tool_exception": -0.5}),
    "rag_agent": (None, {"tool_error": -0.2, "tool_exception": -0.2, "malformed_tool_call": -0.5}),
    "calc_agent": (None, {"tool_error": -0.2, "tool_exception": -0.2}),
    "crewai_agent": (None, {"tool_error": -0.3, "tool_exception": -0.3}),
    "openai_client_agent": (None, {"tool_error": -0.25, "tool_exception": -0.25, "malformed_tool_call": -0.25}),
    "agent_framework_agent": (None, {"tool_error": -0.3, "tool_exception": -0.3}),
    "pydantic_ai_agent": (None, {"tool_error": -0.2, "tool_exception": -0.2}),
    "spider_agent": ("write", {"custom": "examples.spider_agent.agent:query_failed"}),
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.fixture(autouse=True)
def root_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # as PYTHONPATH=. does for `agl train` run from the root


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_train_config_loads(name: str, model_dir: Path) -> None:
    path = ROOT / "examples" / name / "train.yaml"
    config = load_config(path, [f"backend.model={model_dir}"])
    assert config.agent == f"examples.{name}.agent:rollout"
    match, air = RULES[name]
    assert config.agent_match == match
    assert {k: v for k, v in config.air.model_dump().items() if v is not None} == air
    tasks = load_tasks(config)
    lines = (ROOT / "examples" / name / "tasks.jsonl").read_text().splitlines()
    assert tasks == [json.loads(line) for line in lines] and len({t["id"] for t in tasks}) == len(tasks) >= 5
    assert Path(config.path(config.run.dir)) == ROOT / "agl-train" / name


def test_without_the_root_on_the_path_the_error_says_so(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    for module in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(ConfigError, match="no module 'examples.sql_agent.agent' to import .*PYTHONPATH"):
        load_config(ROOT / "examples" / "sql_agent" / "train.yaml", [f"backend.model={model_dir}"])


# --------------------------------------------------------------------------- through agl's gateway, as in training


@pytest.fixture
def gateway_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers point OPENAI_* at the gateway; keep that inside the test."""
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unset")


def _run(url: str, spec: str, tasks: list[dict[str, Any]]) -> Worker:
    TaskClient(url).enqueue(tasks, task_ids=[t["id"] for t in tasks])
    worker = Worker(url, spec, concurrency=2, idle_exit_s=0.5, poll_s=0.2, instrument=False)
    worker.run()
    return worker


def test_the_plain_client_example_through_the_gateway(gateway_env: None, make_server: ServerFactory) -> None:
    """``agl worker --agent examples.openai_client_agent.agent:rollout``: the gateway's token ids, the rewards."""
    from examples.openai_client_agent import agent as atlas

    with FakeOpenAI(atlas.fake_policy) as backend:  # the vLLM-like server behind the gateway
        srv = make_server(backend, builder=atlas.BUILDER)
        tasks = atlas.TASKS[:3]
        worker = _run(srv.url, "examples.openai_client_agent.agent:rollout", tasks)
    assert worker.stats.posted == 3 and worker.stats.agent_errors == 0
    for task in tasks:
        (traj,) = srv.server.store.trajectories(task_id=task["id"])
        assert traj.reward == 1.0 and len(traj.transitions) >= 2
        assert {t.token_source for t in traj.transitions} == {"gateway"}
        assert all(t.prompt_token_ids and t.response_token_ids and t.response_logprobs for t in traj.transitions)


def test_the_sql_example_through_the_gateway_trains_writer_and_rewriter(gateway_env: None,
                                                                        make_server: ServerFactory) -> None:
    """The text-to-SQL agent under ``agl serve --agent-match 'writer|rewriter'``: only those calls are transitions."""
    from examples.sql_agent import agent as sql_agent

    from agl_langchain import LangChainInstrumentor

    plugin = LangChainInstrumentor()
    plugin.instrument(skip_dep_check=True)
    try:
        with FakeOpenAI(sql_agent.fake_policy) as backend:
            srv = make_server(backend, builder=sql_agent.BUILDER)
            tasks = sql_agent.TASKS[:3]
            worker = _run(srv.url, "examples.sql_agent.agent:rollout", tasks)
    finally:
        plugin.uninstrument()
        sql_agent._graphs.clear()
    assert worker.stats.posted == 3 and worker.stats.agent_errors == 0
    first, *rest = [srv.server.store.trajectories(task_id=t["id"])[0] for t in tasks]
    # the fake policy's writer gets sql-01 right at once; for the others it drafts a broken query that is rewritten
    assert [t.agent_name for t in first.transitions] == ["writer"] and first.reward == 1.0
    for traj in rest:
        assert [t.agent_name for t in traj.transitions] == ["writer", "rewriter"] and traj.reward == 1.0
        assert [t.reward for t in traj.transitions] == [sql_agent.SQL_ERROR_REWARD, None]
        assert {t.token_source for t in traj.transitions} == {"gateway"}
        assert [s.reason for s in traj.skipped] == ["agent 'checker' does not match agent_match 'writer|rewriter'"] * 2


# --------------------------------------------------------------------------- agl train on an example's own config


@pytest.mark.parametrize("name", ["openai_client_agent", "agent_framework_agent", "pydantic_ai_agent"])
def test_agl_train_runs_an_example_config(tmp_path: Path, name: str) -> None:
    """``PYTHONPATH=. agl train examples/<name>/train.yaml`` with a tiny model built here: one real step, the
    example's agent leased from the queue, its calls through the gateway, the run's files written. The plain
    client's agent; the Agent Framework handoff desk (its calls reach the gateway through agl's ``openai``
    plugin beneath the framework's client); the Pydantic AI quote desk (its calls go through Pydantic AI's
    ``OpenAIChatModel`` and agl's ``pydantic_ai`` plugin: the gateway joins its token ids to them by the
    ``traceparent`` the plugin sends)."""
    import os
    import subprocess

    pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from .test_engine import tiny_tokenizer
    from .test_train import agl_train

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), str(ROOT / "trainer")])}
    overrides = [f"backend.model={tmp_path / 'policy'}", "backend.threads=1", "run.steps=1",
                 "data.group_size=2", "data.tasks_per_step=1", "workers.count=2", f"run.dir={tmp_path / 'out'}",
                 f"server.db={tmp_path / 'agl.db'}", "algorithm.max_response_length=64"]
    args = [*agl_train(), f"examples/{name}/train.yaml", "--quiet"]
    for item in overrides:
        args += ["--set", item]
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (step,) = summary["steps"]
    assert step["rollouts"] == 2 and step["failed_rollouts"] == 0 and step["transitions"] >= 2
    store = agl.SqliteStore(str(tmp_path / "agl.db"))
    try:
        rollouts = store.rollouts()
        trajectories = store.trajectories()
    finally:
        store.close()
    known = {t["id"] for t in load_tasks(load_config(ROOT / f"examples/{name}/train.yaml",
                                                     [f"backend.model={tmp_path / 'policy'}"]))}
    assert len(rollouts) == 2 and all(r.status == "succeeded" and r.task["id"] in known for r in rollouts)
    assert {t.token_source for traj in trajectories for t in traj.transitions} == {"gateway"}
    if name == "pydantic_ai_agent":  # every call of the Pydantic AI agent is the desk's, with the gateway's ids
        assert {t.agent_name for traj in trajectories for t in traj.transitions} == {"desk"}
        assert all(t.prompt_token_ids and t.response_token_ids for traj in trajectories for t in traj.transitions)
