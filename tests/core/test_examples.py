"""``examples/openai_client_agent`` (a plain OpenAI-client agent with its own tool loop) against a fake server, and
``examples/trace_openai_agent.py`` (``make trace-demo``) still running end to end.

The real ``openai`` client and agl's ``openai`` plugin; only the model is
scripted, found through ``OPENAI_BASE_URL``. Checked: one transition per model
call with the server's token ids, the reward, and the AIR penalties for a
lookup that fails and for a malformed tool call.
"""

from __future__ import annotations

import os
import subprocess
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

from examples.openai_client_agent import agent as atlas  # noqa: E402

COMPARE = next(t for t in atlas.TASKS if t["id"] == "atlas-03")  # Chile (19.6 M) or Portugal (10.4 M): Chile


def facts(country: str, call_id: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "country_facts", "arguments": {"country": country}, "id": call_id}]}


@pytest.fixture
def instrumented() -> Iterator[None]:
    agl.uninstrument()
    assert agl.instrument(["openai"]) == ["openai"]
    guard.reset_fault_counts()
    yield
    agl.uninstrument()


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


def test_two_lookups_then_the_right_answer(instrumented: None, serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve(facts("Chile", "c1"), facts("Portugal", "c2"), "Chile")
    assert atlas.rollout(COMPARE) == 1.0
    run = atlas.rollout.last_run
    traj = run.trajectory()
    assert run.rollout.status == "succeeded" and traj.reward == 1.0 and traj.skipped == []
    assert len(traj.transitions) == 3 and {t.agent_name for t in traj.transitions} == {None}
    first, second, last = traj.transitions
    assert first.response["tool_calls"][0]["function"]["arguments"] == '{"country": "Chile"}'
    assert '"capital": "Santiago"' in second.prompt[-1]["content"]
    assert last.response == {"role": "assistant", "content": "Chile"}
    assert [t.reward for t in traj.transitions] == [None, None, None]
    requests = [r for r in srv.requests if r.path.endswith("/chat/completions")]
    for t, request in zip(traj.transitions, requests, strict=True):
        assert t.token_source == "response" and t.model == "policy"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        assert request.headers["traceparent"].split("-")[2] == t.span_id  # what the gateway joins its ids by
    assert last.response_token_ids == tokenize("Chile")
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [s.attributes[semconv.GEN_AI_TOOL_CALL_ID] for s in tools] == ["c1", "c2"]
    assert guard.fault_counts() == {}


def test_a_wrong_answer_scores_zero(instrumented: None, serve: Callable[..., FakeOpenAI]) -> None:
    serve(facts("Chile", "c1"), facts("Portugal", "c2"), "Portugal")
    assert atlas.rollout(COMPARE) == 0.0
    assert atlas.rollout.last_run.trajectory().reward == 0.0


def test_bad_tool_calls_are_air_penalties(instrumented: None, serve: Callable[..., FakeOpenAI]) -> None:
    broken = {"tool_calls": [{"name": "country_facts", "arguments": "{country: Kenya", "id": "c1"}]}
    serve(broken, facts("Atlantis", "c2"), facts("Kenya", "c3"), "Nairobi")
    assert atlas.rollout(atlas.TASKS[0]) == 1.0
    run = atlas.rollout.last_run
    traj = run.trajectory()
    penalty = atlas.TOOL_ERROR_REWARD
    # the malformed call: its own AIR rule plus the tool error it caused; the unknown country: the tool error
    assert [t.reward for t in traj.transitions] == [2 * penalty, penalty, None, None]
    assert traj.transitions[0].credited_reward == pytest.approx(1.0 + 3 * penalty)
    assert "arguments are not JSON" in traj.transitions[1].prompt[-1]["content"]
    assert "no country 'Atlantis'" in traj.transitions[2].prompt[-1]["content"]
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [s.attributes[semconv.AGL_TOOL_STATUS] for s in tools] == ["error", "error", "ok"]


def test_the_fake_mode_main_runs_and_prints_rewards(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # main points it at its fake; restored after
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
    try:
        assert atlas.main(["--fake", "--tasks", "3"]) == 0
    finally:
        agl.uninstrument()
    out = capsys.readouterr().out
    assert out.count("(final reward in the trace: 1.0)") == 3 and "response ids" in out


def test_the_trace_demo_example_still_runs() -> None:
    """``make trace-demo`` runs ``examples/trace_openai_agent.py`` as a script."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "trace_openai_agent.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "store: 3 rollouts" in out.stdout and "6 of 6 requests carried traceparent" in out.stdout


def test_the_builder_is_what_train_yaml_gives_the_server() -> None:
    """examples/openai_client_agent/train.yaml gives `agl train` these rules (tests/trainer checks it)."""
    assert atlas.BUILDER.agent_match is None
    assert atlas.BUILDER.air == agl.AirRules(tool_error=-0.25, tool_exception=-0.25, malformed_tool_call=-0.25)
