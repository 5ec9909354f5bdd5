"""``examples/pydantic_ai_agent``: the shop's quote desk (a price tool, a structured ``Quote``) as a rollout
against the fake server.

The real ``Agent``, tool, output type and Pydantic AI's ``OpenAIChatModel``; only the model is scripted, found
through ``OPENAI_BASE_URL``. Checked: one transition per model call named ``desk``, the server's token ids,
the reward, the AIR penalties for an unknown item and for a quote that fails validation, and a policy that
never gives a valid quote scoring 0.0 without breaking the rollout.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import agl_core as agl
from agl_core import guard, semconv
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.pydantic_ai_agent import agent as shop  # noqa: E402

pytestmark = pytest.mark.usefixtures("instrumented")

TASK = shop.TASKS[0]  # 3 notebooks at 349 cents


def call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments, "id": call_id}]}


def serve(monkeypatch: pytest.MonkeyPatch, *replies: Any) -> FakeOpenAI:
    srv = FakeOpenAI(script=list(replies), return_token_ids=True).start()
    monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
    return srv


def test_the_reward_checks_the_total() -> None:
    assert shop.reward(shop.Quote(item="notebook", quantity=3, total_cents=1047), TASK) == 1.0
    assert shop.reward(shop.Quote(item="notebook", quantity=3, total_cents=1000), TASK) == 0.0
    assert shop.reward(None, TASK) == 0.0


def test_the_desk_quotes_right(monkeypatch: pytest.MonkeyPatch) -> None:
    srv = serve(monkeypatch, call("price", {"item": "notebook"}, "p1"),
                call("final_result", {"item": "notebook", "quantity": 3, "total_cents": 1047}, "q1"))
    try:
        assert shop.rollout(TASK) == 1.0
    finally:
        srv.stop()
    run = shop.rollout.last_run
    traj = run.trajectory()
    assert run.rollout.status == "succeeded" and traj.reward == 1.0 and traj.skipped == []
    assert [t.agent_name for t in traj.transitions] == ["desk", "desk"]
    ask, quote = traj.transitions
    assert ask.response["tool_calls"][0]["function"]["name"] == "price"
    assert quote.prompt[-1] == {"role": "tool", "tool_call_id": "p1",
                                "content": '{"item": "notebook", "price_cents": 349}'}
    assert quote.response["tool_calls"][0]["function"]["name"] == "final_result"
    for t, request in zip(traj.transitions, srv.requests, strict=True):
        assert t.token_source == "response" and t.model == "policy"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
    assert [t.credited_reward for t in traj.transitions] == [1.0, 1.0]
    assert guard.fault_counts() == {}


def test_an_unknown_item_and_an_invalid_quote_are_air_penalties(monkeypatch: pytest.MonkeyPatch) -> None:
    srv = serve(monkeypatch, call("price", {"item": "laptop"}, "p1"), call("price", {"item": "notebook"}, "p2"),
                call("final_result", {"item": "notebook", "quantity": 0, "total_cents": 0}, "q1"),
                call("final_result", {"item": "notebook", "quantity": 3, "total_cents": 1047}, "q2"))
    try:
        assert shop.rollout(TASK) == 1.0
    finally:
        srv.stop()
    run = shop.rollout.last_run
    traj = run.trajectory()
    assert [t.reward for t in traj.transitions] == [shop.RETRY_REWARD, None, shop.RETRY_REWARD, None]
    assert "sells no 'laptop'" in str(traj.transitions[1].prompt[-1]["content"])  # the model was told
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [(s.attributes[semconv.GEN_AI_TOOL_NAME], s.attributes[semconv.AGL_TOOL_STATUS]) for s in tools] == [
        ("price", "error"), ("price", "ok"), ("final_result", "error"), ("final_result", "ok")]


def test_a_policy_that_never_quotes_scores_zero_and_the_rollout_still_succeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    srv = serve(monkeypatch, "no idea", "still no idea", "nothing")
    try:
        assert shop.rollout(TASK) == 0.0
    finally:
        srv.stop()
    run = shop.rollout.last_run
    assert run.rollout.status == "succeeded" and len(run.trajectory().transitions) >= 2


def test_the_fake_mode_main_runs_and_prints_rewards(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # main points it at its fake; restored after
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
    try:
        assert shop.main(["--fake", "--tasks", "2"]) == 0
    finally:
        agl.uninstrument()
    out = capsys.readouterr().out
    assert out.count("final reward") == 2 and "response ids" in out


def test_the_builder_is_what_train_yaml_gives_the_server() -> None:
    """examples/pydantic_ai_agent/train.yaml gives `agl train` these rules (tests/trainer checks it)."""
    assert shop.BUILDER.agent_match is None
    assert shop.BUILDER.air == agl.AirRules(tool_error=-0.2, tool_exception=-0.2)
