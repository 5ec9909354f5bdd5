"""The spider agent ported from Agent Lightning (``examples/spider_agent``) trains one real step with ``agl train``.

A tiny Llama built here is the policy behind agl's gateway; the example's own ``train.yaml``
runs with its validation section, ``agent_match: write`` and its ``air.custom`` rule; the
checker is a frozen model reached through its own base URL (a fake OpenAI-compatible server
on 127.0.0.1, ``SPIDER_CHECKER_BASE_URL``) that always finds the query wrong, so every rollout
writes once and rewrites twice. Checked on the data itself: the trained transitions are the
writer's and the rewriter's, every one with the gateway's token ids; the checker's calls reached
its own server, are traced, and are in no transition.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("langgraph")

import agl_core as agl  # noqa: E402
from agl_core import semconv  # noqa: E402
from agl_core.testing import FakeOpenAI  # noqa: E402

from .test_engine import tiny_tokenizer  # noqa: E402
from .test_train import agl_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHECKER_MODEL = "frozen-checker"


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    return tmp_path / "policy"


def test_the_ported_spider_agent_trains_one_step_with_validation_and_a_frozen_checker(tmp_path: Path,
                                                                                      policy: Path) -> None:
    from examples.spider_agent.agent import INCORRECT, MAX_TURNS, SQL_ERROR_REWARD

    with FakeOpenAI(lambda _: f"The query does not answer the question.\n{INCORRECT}.", model=CHECKER_MODEL) as checker:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), str(ROOT / "trainer")]),
               "SPIDER_CHECKER_BASE_URL": checker.url, "SPIDER_CHECKER_MODEL": CHECKER_MODEL,
               "SPIDER_CHECKER_API_KEY": "checker-key"}
        overrides = [f"backend.model={policy}", "backend.threads=1", "run.steps=1", "data.group_size=2",
                     "data.tasks_per_step=1", "workers.count=2", f"run.dir={tmp_path / 'out'}",
                     f"server.db={tmp_path / 'agl.db'}", "validation.max_tasks=2", "algorithm.max_response_length=64"]
        args = [*agl_train(), "examples/spider_agent/train.yaml"]
        for item in overrides:
            args += ["--set", item]
        result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        checker_requests = list(checker.requests)
        checker_address = checker.url.removeprefix("http://").removesuffix("/v1")
    assert result.returncode == 0, result.stderr[-3000:]

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (step,) = summary["steps"]
    validations = summary["validation"]
    assert [v["step"] for v in validations] == [0, 1]  # before the first step, and after the last
    assert all(v["rollouts"] == 2 and v["failed_rollouts"] == 0 for v in validations)
    assert step["rollouts"] == 2 and step["failed_rollouts"] == 0
    assert step["transitions"] == 2 * MAX_TURNS  # one write_query and two rewrite_query calls a rollout

    store = agl.SqliteStore(str(tmp_path / "agl.db"))
    try:
        held_out = {i for v in validations for i in v["rollout_ids"]}
        rollouts = store.rollouts()
        training = [store.trajectories(task_id=r.task_id)[0] for r in rollouts if r.id not in held_out]
        spans = [s for r in rollouts for s in store.spans(r.id)]
    finally:
        store.close()
    assert len(rollouts) == 2 + 2 * 2 and len(training) == 2
    assert all(r.task["db_id"] == "concert_singer" for r in rollouts)

    # agent_match "write" is a search: write_query and rewrite_query are trained, each with the gateway's ids
    trained = [t for traj in training for t in traj.transitions]
    assert Counter(t.agent_name for t in trained) == {"write_query": 2, "rewrite_query": 2 * (MAX_TURNS - 1)}
    assert {t.token_source for t in trained} == {"gateway"}
    assert all(t.prompt_token_ids and t.response_token_ids for t in trained)
    assert CHECKER_MODEL not in {t.model for t in trained}
    assert not any("You are a careful SQL reviewer" in str(t.prompt) for t in trained)
    # the frozen checker: traced, never a transition, and every one of its calls went to its own server
    frozen = f"answered by the frozen model '{CHECKER_MODEL} at {checker_address}', not the policy: not trained"
    for traj in training:  # agl worker marks a call sent past the policy's endpoint as a frozen model's
        assert [(s.agent_name, s.reason) for s in traj.skipped] == [("check_query", frozen)] * MAX_TURNS
    checker_spans = {s.span_id: s for s in spans if s.attributes.get(semconv.GEN_AI_REQUEST_MODEL) == CHECKER_MODEL}
    calls = [s for s in checker_spans.values() if s.parent_id not in checker_spans]  # LangChain's span over openai's
    assert len(checker_requests) == len(calls) == 6 * MAX_TURNS  # 6 rollouts (2 trained, 4 held out)
    assert {r.body["model"] for r in checker_requests} == {CHECKER_MODEL}
    assert {r.headers.get("authorization") for r in checker_requests} == {"Bearer checker-key"}
    # air.custom: the tool said "Error: ..." with an ok status; the call that wrote the query pays for it
    assert any(t.reward == SQL_ERROR_REWARD for t in trained)


def test_every_gold_query_scores_one_and_a_failing_query_is_an_error_result() -> None:
    from examples.spider_agent.database import TASKS, VALIDATION_TASKS, connect, evaluate_query, run_query

    assert all(evaluate_query(t["query"], t["query"]) == 1.0 for t in TASKS + VALIDATION_TASKS)
    assert evaluate_query("SELECT name FROM singer", TASKS[1]["query"]) == 0.0
    conn = connect()
    assert run_query(conn, "SELECT nope FROM singer") == "Error: (OperationalError) no such column: nope"
    assert run_query(conn, "DELETE FROM singer").startswith("Error:")  # read only: the next rollout sees it all
    assert evaluate_query("SELECT count(*) FROM singer", TASKS[0]["query"]) == 1.0


def test_the_builder_is_what_train_yaml_gives_the_server(tmp_path: Path) -> None:
    """One source of truth: the example's @agl.rollout_fn builder and its train.yaml agree, so agl train joins them."""
    from examples.spider_agent import agent

    from agl_trainer.config import code_builder, load_config, transition_builder

    (tmp_path / "config.json").write_text("{}")
    config = load_config(ROOT / "examples" / "spider_agent" / "train.yaml", [f"backend.model={tmp_path}"])
    joined = transition_builder(config, code_builder(config))
    assert joined.agent_match.pattern == "write" and joined.air.custom is agent.query_failed
    assert config.validation is not None and config.validation.sampling.overrides() == {"temperature": 0.0}
    assert [bool(joined.agent_match.search(n)) for n in ("write_query", "rewrite_query", "check_query")] == \
        [True, True, False]
