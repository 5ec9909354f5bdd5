"""``examples/calc_agent``: the AutoGen calculator solver (Calc-X style), as a rollout against a fake server.

The real ``AssistantAgent``, ``OpenAIChatCompletionClient`` and ``FunctionTool``
and the real safe calculator; only the model is scripted, found through
``OPENAI_BASE_URL``. Checked: one transition per model call with the solver's
name and the server's token ids, the answer reward, and the AIR penalty for a
calculator call that fails, including one that tries to run code.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import agl_core as agl
from agl_core import guard, semconv
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.calc_agent import agent as calc_agent  # noqa: E402
from examples.calc_agent.calculator import TASKS, CalculatorError, answer_of, calculate, reward  # noqa: E402

pytestmark = pytest.mark.usefixtures("instrumented")

SAVINGS = next(t for t in TASKS if t["id"] == "calc-10")  # 45 a week for 16 weeks, a third spent: 480


def calc(expression: str, call_id: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "calculator", "arguments": {"expression": expression}, "id": call_id}]}


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeOpenAI]]:
    """``serve(*replies)``: a fake vLLM-like server saying them (token ids always), where the env vars point."""
    servers: list[FakeOpenAI] = []

    def start(*replies: Any) -> FakeOpenAI:
        srv = FakeOpenAI(list(replies), return_token_ids=True).start()
        servers.append(srv)
        monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
        monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
        return srv

    yield start
    for srv in servers:
        srv.stop()


def test_the_calculator_computes_arithmetic_and_nothing_else() -> None:
    assert [calculate(e) for e in ("24 * 7 - 13", "1,200 - 35 * 18", "147 / 3 + 4", "2 ** 0.5", "-7 // 2")] == [
        "155", "570", "53", "1.4142135624", "-4"]
    for bad in ("__import__('os').system('true')", "x + 1", "1 / 0", "9 ** 9 ** 9", "(10 ** 10) ** 10", "", "2 +"):
        with pytest.raises(CalculatorError):
            calculate(bad)
    assert answer_of("Sam keeps 480. Answer: 480") == 480.0 and answer_of("it is 1,825.") == 1825.0
    assert answer_of("no idea") is None and reward("Answer: 387.50", 387.5) == 1.0 and reward("Answer: 38", 387.5) == 0


def test_two_calculator_steps_then_the_right_answer(serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve(calc("45 * 16", "c1"), calc("720 - 720 / 3", "c2"), "Sam has 480 left. Answer: 480")
    assert asyncio.run(calc_agent.rollout(SAVINGS)) == 1.0
    run = calc_agent.rollout.last_run
    traj = run.trajectory()
    assert run.rollout.status == "succeeded" and traj.reward == 1.0 and traj.skipped == []
    assert [t.agent_name for t in traj.transitions] == ["solver"] * 3
    first, second, last = traj.transitions
    assert first.response["tool_calls"][0]["function"]["name"] == "calculator"
    assert any(m["role"] == "tool" and m["content"] == "720" for m in second.prompt)
    assert any(m["role"] == "tool" and m["content"] == "480" for m in last.prompt)
    assert last.response["content"] == "Sam has 480 left. Answer: 480"
    assert [t.reward for t in traj.transitions] == [None, None, None]
    assert [t.credited_reward for t in traj.transitions] == [1.0, 1.0, 1.0]
    requests = [r for r in srv.requests if r.path.endswith("/chat/completions")]
    assert len(requests) == 3
    for t, request in zip(traj.transitions, requests, strict=True):
        assert t.token_source == "response" and t.model == "policy"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        assert t.response_token_ids
    assert last.response_token_ids == tokenize("Sam has 480 left. Answer: 480")
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [s.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] for s in tools] == ["720", "480"]
    assert guard.fault_counts() == {}


def test_a_wrong_answer_scores_zero(serve: Callable[..., FakeOpenAI]) -> None:
    serve(calc("45 * 16", "c1"), "Sam has 720. Answer: 720")
    assert asyncio.run(calc_agent.rollout(SAVINGS)) == 0.0
    traj = calc_agent.rollout.last_run.trajectory()
    assert len(traj.transitions) == 2 and traj.reward == 0.0


def test_code_in_a_calculator_call_is_refused_and_penalised(serve: Callable[..., FakeOpenAI],
                                                             tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    attack = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    serve(calc(attack, "c1"), calc("45 * 16 * 2 / 3", "c2"), "Answer: 480")
    assert asyncio.run(calc_agent.rollout(SAVINGS)) == 1.0
    assert not marker.exists()  # parsed, never run
    run = calc_agent.rollout.last_run
    traj = run.trajectory()
    assert [t.reward for t in traj.transitions] == [calc_agent.CALCULATOR_ERROR_REWARD, None, None]
    assert traj.transitions[0].credited_reward == pytest.approx(1.0 + calc_agent.CALCULATOR_ERROR_REWARD)
    assert "not arithmetic" in str(traj.transitions[1].prompt[-1]["content"])  # the model was told why
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [s.attributes[semconv.AGL_TOOL_STATUS] for s in tools] == ["exception", "ok"]


def test_the_fake_mode_main_runs_and_prints_rewards(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # main points it at its fake; restored after
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
    try:
        assert calc_agent.main(["--fake", "--tasks", "3"]) == 0
    finally:
        agl.uninstrument()
    out = capsys.readouterr().out
    assert out.count("final reward") == 3 and "response ids" in out


def test_the_builder_is_what_train_yaml_gives_the_server() -> None:
    """examples/calc_agent/train.yaml gives `agl train` these rules (tests/trainer checks it)."""
    assert calc_agent.BUILDER.agent_match is None
    assert calc_agent.BUILDER.air == agl.AirRules(tool_error=-0.2, tool_exception=-0.2)
