"""``ChatOpenAI`` against a vLLM-like fake server: with agl's ``openai`` plugin on too, each call is ONE
transition that carries the server's token ids, and the server receives the ``traceparent`` of the call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

import agl_core as agl
from agl_core import semconv
from agl_core.instrumentation import Instrumented
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI, render_prompt, tokenize


def _llm(srv: FakeOpenAI) -> ChatOpenAI:
    return ChatOpenAI(model="policy", base_url=srv.url, api_key="x", max_retries=0,  # type: ignore[arg-type]
                      extra_body={"return_token_ids": True})


def _by_plugin(spans: list[Span], plugin: str) -> list[Span]:
    return [s for s in spans if s.attributes.get(semconv.AGL_PLUGIN) == plugin
            and s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "chat"]


def _check(run: agl.RolloutRun, srv: FakeOpenAI, calls: int) -> None:
    """One transition per request, each joined to its request by traceparent, with the server's token ids."""
    spans = run.rollout.spans
    outer, inner = _by_plugin(spans, "langchain"), _by_plugin(spans, "openai")
    assert len(outer) == len(inner) == len(srv.requests) == calls
    traj = run.trajectory()
    assert len(traj.transitions) == calls and traj.skipped == []
    by_traceparent = {r.headers["traceparent"]: r for r in srv.requests}
    for t in traj.transitions:
        (span,) = [s for s in inner if s.parent_id == t.span_id]  # the openai span nests in the LangChain one
        request = by_traceparent[f"00-{span.trace_id}-{span.span_id}-01"]
        assert t.token_source == "response" and t.model == "policy"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        assert t.response_token_ids and t.response_token_ids == span.attributes[semconv.AGL_RESPONSE_TOKEN_IDS]
    assert {t.span_id for t in traj.transitions} == {s.span_id for s in outer}


def _invoke(llm: ChatOpenAI) -> int:
    assert llm.invoke("q1").content == "a1"
    assert llm.invoke([HumanMessage("q2")]).content == "a2"
    return 2


def _stream(llm: ChatOpenAI) -> int:
    assert "".join(str(c.content) for c in llm.stream("q1")) == "a1"
    return 1


def _batch(llm: ChatOpenAI) -> int:
    assert sorted(str(m.content) for m in llm.batch(["q1", "q2", "q3"])) == ["a1", "a2", "a3"]
    return 3


def _generate(llm: ChatOpenAI) -> int:
    result = llm.generate([[HumanMessage("q1")], [HumanMessage("q2")]])
    assert [g[0].text for g in result.generations] == ["a1", "a2"]
    return 2


async def _ainvoke(llm: ChatOpenAI) -> int:
    assert (await llm.ainvoke("q1")).content == "a1"
    return 1


async def _astream(llm: ChatOpenAI) -> int:
    assert "".join([str(c.content) async for c in llm.astream("q1")]) == "a1"
    return 1


async def _abatch(llm: ChatOpenAI) -> int:
    assert sorted(str(m.content) for m in await llm.abatch(["q1", "q2"])) == ["a1", "a2"]
    return 2


async def _astream_events(llm: ChatOpenAI) -> int:
    events = [e["event"] async for e in llm.astream_events("q1", version="v2")]
    assert events[0] == "on_chat_model_start" and events[-1] == "on_chat_model_end"
    return 1


async def _agenerate(llm: ChatOpenAI) -> int:
    result = await llm.agenerate([[HumanMessage("q1")], [HumanMessage("q2")]])
    assert sorted(g[0].text for g in result.generations) == ["a1", "a2"]
    return 2


PATHS: dict[str, Callable[[ChatOpenAI], Any]] = {
    "invoke": _invoke, "stream": _stream, "batch": _batch, "generate": _generate, "ainvoke": _ainvoke,
    "astream": _astream, "abatch": _abatch, "astream_events": _astream_events, "agenerate": _agenerate,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_one_transition_per_request_with_token_ids(with_openai: Instrumented, path: str) -> None:
    with FakeOpenAI(script=["a1", "a2", "a3"]) as srv:
        with agl.rollout("t") as run:
            result = PATHS[path](_llm(srv))
            calls = asyncio.run(result) if asyncio.iscoroutine(result) else result
    _check(run, srv, calls)


def test_structured_output_through_chat_openai(with_openai: Instrumented) -> None:
    class City(BaseModel):
        name: str

    with FakeOpenAI(script=['{"name": "Paris"}']) as srv:
        with agl.rollout("t") as run:
            assert _llm(srv).with_structured_output(City).invoke("capital of France?") == City(name="Paris")
    _check(run, srv, 1)
    assert srv.requests[0].body["response_format"]["type"] == "json_schema"


def test_an_agent_on_chat_openai(with_openai: Instrumented) -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    replies = [{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "c1"}]}, "It is 3."]
    with FakeOpenAI(script=replies) as srv:
        with agl.rollout("t") as run:
            out = create_agent(_llm(srv), [add], name="solver").invoke({"messages": [("user", "1+2?")]})
    assert out["messages"][-1].content == "It is 3."
    _check(run, srv, 2)
    first, second = run.trajectory().transitions
    assert first.agent_name == second.agent_name == "solver"
    assert first.response["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert first.tools is not None and first.tools[0]["function"]["name"] == "add"
    assert second.prompt[-1] == {"role": "tool", "tool_call_id": "c1", "content": "3"}


def test_only_the_langchain_plugin_still_records_every_call(instrumented: Instrumented) -> None:
    with FakeOpenAI(script=["a1", "a2"]) as srv:
        with agl.rollout("t") as run:
            _invoke(_llm(srv))
    traj = run.trajectory()
    assert [t.response["content"] for t in traj.transitions] == ["a1", "a2"]
    assert all(t.token_source is None for t in traj.transitions)  # token ids come from the openai plugin's span
    (first, _) = _by_plugin(run.rollout.spans, "langchain")
    assert first.attributes[semconv.GEN_AI_PROVIDER_NAME] == "openai"
    assert first.attributes[semconv.GEN_AI_RESPONSE_MODEL] == "policy"
    assert first.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] > 0


@pytest.mark.parametrize("plugins", ["instrumented", "with_openai"])
def test_a_tool_result_given_as_parts_reaches_the_prompt_as_sent(plugins: str, request: pytest.FixtureRequest) -> None:
    """An MCP-style tool result (a list of text parts) stays that list in the prompt, never its JSON text."""
    request.getfixturevalue(plugins)
    parts = [{"type": "text", "text": "18C"}, {"type": "text", "text": "sunny"}]

    @tool
    def weather(city: str) -> list[dict[str, str]]:
        """The weather in a city."""
        return parts

    replies = [{"tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}, "id": "c1"}]}, "18C, sunny."]
    with FakeOpenAI(script=replies) as srv:
        with agl.rollout("t") as run:
            create_agent(_llm(srv), [weather], name="solver").invoke({"messages": [("user", "Paris?")]})
    sent = srv.requests[1].body["messages"][-1]
    assert sent["content"] == parts
    last = run.trajectory().transitions[1].prompt[-1]
    assert (last["role"], last["tool_call_id"], last["content"]) == ("tool", "c1", parts)
