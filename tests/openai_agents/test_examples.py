"""``examples/rag_agent``: the OpenAI Agents SDK researcher over the BM25 corpus, as a rollout against a fake server.

The real SDK (``Runner.run``, ``OpenAIChatCompletionsModel``, ``@function_tool``)
and the real BM25 search; only the model is scripted, found through
``OPENAI_BASE_URL`` as the example finds agl's gateway. Checked: one transition
per model call with the researcher's name and the server's token ids, the
search results fed back, the EM/F1 reward, and the AIR penalty for a failed
search.
"""

from __future__ import annotations

import asyncio
import json
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

from examples.rag_agent import agent as rag_agent  # noqa: E402
from examples.rag_agent.corpus import BM25, DOCUMENTS, TASKS, exact_match, f1, reward  # noqa: E402

pytestmark = pytest.mark.usefixtures("both_plugins")

TWO_HOPS = next(t for t in TASKS if t["id"] == "rag-03")  # the founder of Velmora's birthplace: Penwick


def search(query: str, call_id: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "search", "arguments": json.dumps({"query": query}), "id": call_id}]}


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


def test_bm25_finds_the_passage_each_question_needs() -> None:
    index = BM25(DOCUMENTS)
    assert index.search("Who founded Velmora?")[0].title == "Ilse Harrow"
    assert index.search("where was Ilse Harrow born")[0].title == "Ilse Harrow"
    assert index.search("market with smoked eel")[0].title == "Osk"
    assert index.search("zzz unknown words") == []
    with pytest.raises(ValueError, match="at least one document"):
        BM25({})
    assert (exact_match("The Marrow.", ["marrow"]), reward("Velmora", ["Velmora"])) == (1.0, 1.0)
    assert f1("Ilse", ["Ilse Harrow"]) == pytest.approx(2 / 3) and reward("Osk", ["Velmora"]) == 0.0


def test_a_two_hop_answer_gets_one(serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve(search("Who founded Velmora?", "c1"), search("Ilse Harrow birthplace", "c2"), "Penwick")
    assert asyncio.run(rag_agent.rollout(TWO_HOPS)) == 1.0
    run = rag_agent.rollout.last_run
    traj = run.trajectory()
    assert run.rollout.status == "succeeded" and traj.reward == 1.0 and traj.skipped == []
    assert [t.agent_name for t in traj.transitions] == ["researcher"] * 3
    first, second, last = traj.transitions
    assert first.response["tool_calls"][0]["function"]["name"] == "search" and first.tools
    assert last.response["content"] == "Penwick"
    # the second search saw the first one's passages: the tool result is in the prompt, as the model saw it
    assert any(m["role"] == "tool" and "[Ilse Harrow]" in str(m["content"]) for m in second.prompt)
    assert [t.reward for t in traj.transitions] == [None, None, None]
    assert [t.credited_reward for t in traj.transitions] == [1.0, 1.0, 1.0]
    requests = [r for r in srv.requests if r.path.endswith("/chat/completions")]
    for t, request in zip(traj.transitions, requests, strict=True):
        assert t.token_source == "response" and t.model == "policy"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        assert t.response_token_ids
    assert last.response_token_ids == tokenize("Penwick")
    tools = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [s.attributes[semconv.GEN_AI_TOOL_CALL_ID] for s in tools] == ["c1", "c2"]
    assert all(s.attributes[semconv.AGL_TOOL_STATUS] == "ok" for s in tools)
    assert guard.fault_counts() == {}


@pytest.mark.parametrize(("answer", "expected"), [("Brindle", 0.0), ("Penwick island", 2 / 3)])
def test_a_wrong_or_partial_answer(serve: Callable[..., FakeOpenAI], answer: str, expected: float) -> None:
    serve(search("Velmora founder", "c1"), answer)
    assert asyncio.run(rag_agent.rollout(TWO_HOPS)) == pytest.approx(expected)
    traj = rag_agent.rollout.last_run.trajectory()
    assert len(traj.transitions) == 2 and traj.reward == pytest.approx(expected)


def test_a_failed_search_is_an_air_penalty(serve: Callable[..., FakeOpenAI]) -> None:
    serve(search("  ", "c1"), search("Who founded Velmora", "c2"), "Ilse Harrow")
    task = next(t for t in TASKS if t["id"] == "rag-02")
    assert asyncio.run(rag_agent.rollout(task)) == 1.0
    traj = rag_agent.rollout.last_run.trajectory()
    assert [t.reward for t in traj.transitions] == [rag_agent.SEARCH_ERROR_REWARD, None, None]
    assert traj.transitions[0].credited_reward == pytest.approx(1.0 + rag_agent.SEARCH_ERROR_REWARD)
    assert traj.transitions[1].prompt[-1]["content"] == "search failed: the search query is empty"


def test_the_fake_mode_main_runs_and_prints_rewards(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # main points it at its fake; restored after
    monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
    try:
        assert rag_agent.main(["--fake", "--tasks", "2"]) == 0
    finally:
        agl.uninstrument()
    out = capsys.readouterr().out
    assert out.count("final reward") == 2 and "response ids" in out


def test_the_builder_is_what_train_yaml_gives_the_server() -> None:
    """examples/rag_agent/train.yaml gives `agl train` these rules (tests/trainer checks it)."""
    assert rag_agent.BUILDER.agent_match is None
    assert rag_agent.BUILDER.air == agl.AirRules(tool_error=-0.2, tool_exception=-0.2, malformed_tool_call=-0.5)
