"""Frozen models stay frozen: an agent's judge on its own server gets its calls and is never trained.

The agent reads its judge's endpoint from ``OPENAI_BASE_URL``, as ported agents do;
the judge is a FakeOpenAI of its own on 127.0.0.1, the policy's backend another.
Either the agent reaches the policy through ``agl.policy()`` (the worker leaves the
environment alone), or the judge's calls reach the gateway and go to the judge's
configured upstream; a call for another model under ``--model-rule strict`` is
refused naming the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

import agl_core as agl
from agl_core.testing import FakeOpenAI
from agl_core.worker import TaskClient, Worker
from agl_trainer.gateway import GatewayConfig

from .conftest import ServerFactory

TASKS = [{"id": f"q{i}", "q": f"say {i}"} for i in range(3)]


@pytest.fixture(autouse=True)
def _restore_openai_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unset")


def _judged(policy: openai.OpenAI, model: str, task: dict[str, Any]) -> float:
    answer = policy.chat.completions.create(model=model, messages=[{"role": "user", "content": task["q"]}])
    judge = openai.OpenAI(max_retries=0)  # the judge: wherever OPENAI_BASE_URL says
    verdict = judge.chat.completions.create(
        model="judge", messages=[{"role": "user", "content": f"grade: {answer.choices[0].message.content}"}])
    return 1.0 if verdict.choices[0].message.content else 0.0


def agent_with_policy_endpoint(task: dict[str, Any]) -> float:
    """Reaches the policy through agl.policy(); its judge keeps OPENAI_BASE_URL."""
    endpoint = agl.policy()
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    return _judged(client, endpoint.model or "?", task)


def agent_on_the_environment(task: dict[str, Any]) -> float:
    """Zero-change: policy and judge both from OPENAI_BASE_URL, told apart by the model they ask for."""
    return _judged(openai.OpenAI(max_retries=0), "gpt-4o-mini", task)


def _run(url: str, agent: Any, **kwargs: Any) -> Worker:
    worker = Worker(url, agent, concurrency=1, idle_exit_s=0.5, poll_s=0.2, instrument=False, **kwargs)
    worker.run()
    return worker


def test_an_agent_reaching_the_policy_through_agl_policy_leaves_its_frozen_judge_alone(
        fake: FakeOpenAI, make_server: ServerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeOpenAI(model="judge") as judge:
        monkeypatch.setenv("OPENAI_BASE_URL", judge.url)
        srv = make_server(fake)
        TaskClient(srv.url).enqueue(TASKS)
        worker = _run(srv.url, agent_with_policy_endpoint, set_openai_env=False)
        assert worker.stats.posted == 3 and worker.stats.agent_errors == 0, worker.stats
        asked_judge = [r for r in judge.requests if r.path.endswith("/chat/completions")]
        assert len(asked_judge) == 3, "the frozen judge did not get its calls"
        assert srv.server.gateway.calls == 3  # the policy's calls only
    store = srv.server.store
    for traj in store.trajectories():
        (t,) = traj.transitions
        assert (t.model, t.token_source) == ("fake-model", "gateway"), t
        (skipped,) = traj.skipped
        assert "frozen model 'judge at 127.0.0.1" in skipped.reason and "not trained" in skipped.reason


def test_a_frozen_model_reached_through_the_gateway_goes_to_its_upstream_untrained(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    with FakeOpenAI(model="judge") as judge:
        srv = make_server(fake, gateway=GatewayConfig(upstreams={"judge": judge.url}))
        TaskClient(srv.url).enqueue(TASKS)
        worker = _run(srv.url, agent_on_the_environment)  # OPENAI_BASE_URL: the gateway, for both models
        assert worker.stats.posted == 3 and worker.stats.agent_errors == 0, worker.stats
        asked_judge = [r for r in judge.requests if r.path.endswith("/chat/completions")]
        assert len(asked_judge) == 3, "the frozen judge did not get its calls"
        assert all(r.body.get("model") == "judge" and "return_token_ids" not in r.body for r in asked_judge)
        policy_calls = [r for r in fake.requests if r.path.endswith("/chat/completions")]
        assert len(policy_calls) == 3 and all("grade:" not in str(r.body) for r in policy_calls)
    for traj in srv.server.store.trajectories():
        (t,) = traj.transitions
        assert t.token_source == "gateway" and "grade:" not in str(t.prompt), t
        (skipped,) = traj.skipped
        assert skipped.reason == "answered by the frozen model 'judge', not the policy: not trained"


def test_a_call_for_a_model_that_is_not_the_policy_is_refused_under_the_strict_rule_naming_the_fix(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, gateway=GatewayConfig(model_rule="strict"))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="judge", messages=[{"role": "user", "content": "hi"}])
    said = str(caught.value)
    assert "'judge' is not the policy" in said and "--upstream judge=URL" in said and "agl.policy()" in said, said
    ok = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content == "hi"
    assert len([r for r in fake.requests if r.path.endswith("/chat/completions")]) == 1


def test_agl_policy_outside_a_worker_says_where_it_comes_from() -> None:
    with pytest.raises(agl.AglError, match="agl worker hands it to each rollout"):
        agl.policy()


def test_a_frozen_models_stream_is_relayed_as_it_came(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    with FakeOpenAI(model="judge") as judge:
        srv = make_server(fake, gateway=GatewayConfig(upstreams={"judge": judge.url}))
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with agl.rollout(task_id="stream", store=agl.SqliteStore(":memory:")) as run:
            stream = client.chat.completions.create(model="judge", stream=True,
                                                    messages=[{"role": "user", "content": "grade this answer"}])
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == "grade this answer"
        (asked,) = [r for r in judge.requests if r.path.endswith("/chat/completions")]
        assert asked.body["stream"] is True and "logprobs" not in asked.body
        assert not [r for r in fake.requests if r.path.endswith("/chat/completions")]
        joined, keys = srv.server.records.join(run.rollout.spans)
    assert len(keys) == 1
    built = agl.TransitionBuilder().build_from_spans(joined, rollout_id=run.id, task_id="stream")
    assert built.transitions == [] and "frozen model 'judge'" in built.skipped[0].reason
