"""Real instrumentations, real agents, the SDK's own OTLP/HTTP exporter, a real ``agl serve``: transitions.

Each agent adds 2 and 3 with a tool against the fake model server (two model calls: the tool call, then
the answer). For each instrumentation: one transition per model call, the prompts as the agent sent them
(read back from the fake server), the responses as served, the tool call, the agent's name where the
convention carries it, and the reward posted when the rollout is finished.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest
from otlp_harness import TOKEN, TOOLS, Agl, exporting_provider

from agl_core.testing import FakeOpenAI, render_prompt, tokenize


def _openai_agent(base_url: str, api_key: str = "x", http_client: Any = None) -> None:
    """The plain openai-client tool loop an instrumentor sees."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client)
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}]
    reply = client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS)
    call = reply.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    client.chat.completions.create(model="fake-model", messages=messages, tools=TOOLS)


def _norm(message: dict[str, Any]) -> dict[str, Any]:
    """What a transition must keep of a message: role, text, tool calls (arguments compared as JSON), call id."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content)
    out = {"role": message["role"], "content": content or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [(c.get("id"), c["function"]["name"], json.loads(c["function"]["arguments"]))
                             for c in message["tool_calls"]]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _check(agl: Agl, fake: FakeOpenAI, rollout_id: str, task_id: str, agent: str | None) -> list[dict[str, Any]]:
    summary = agl.finish(rollout_id, task_id, reward=0.75)
    assert summary["transitions"] == 2, summary
    transitions = agl.transitions(rollout_id)
    sent = [r.body for r in fake.requests if r.path.endswith("/chat/completions")]
    assert len(sent) == 2 and len(transitions) == 2
    for t, request in zip(transitions, sent, strict=True):
        assert [_norm(m) for m in t["prompt"]] == [_norm(m) for m in request["messages"]]  # as sent
        assert t["task_id"] == task_id and t["agent_name"] == agent and t["model"] == "fake-model"
        assert t["token_source"] is None  # no gateway on the way: no ids, and the transition says so
    first, second = transitions
    assert _norm(first["response"]) == {"role": "assistant", "content": None,
                                        "tool_calls": [("call_1", "add", {"a": 2, "b": 3})]}  # as served
    assert _norm(second["response"]) == {"role": "assistant", "content": "The sum is 5."}
    assert second["prompt"][-1]["role"] == "tool" and second["prompt"][-1]["content"] == "5"
    assert [t["credited_reward"] for t in transitions] == [0.75, 0.75]
    (trajectory,) = agl.get("/v1/trajectories", rollout_id=rollout_id)["trajectories"]
    assert trajectory["reward"] == 0.75
    return transitions


def _conventions(agl: Agl, rollout_id: str) -> set[str]:
    """The conventions the received spans were read in (the reward span the finishing post made is agl's)."""
    return {s["attributes"]["agl.otlp.convention"] for s in agl.spans(rollout_id)
            if s["attributes"].get("agl.span.kind") != "reward"}


def _instrumented(agl: Agl, instrumentor: Any, rollout_id: str, run: Callable[[], None]) -> None:
    provider = exporting_provider(agl, **{"agl.rollout.id": rollout_id, "agl.task.id": "add-2-3"})
    instrumentor.instrument(tracer_provider=provider)
    try:
        run()
    finally:
        instrumentor.uninstrument()
        provider.shutdown()  # exports what is left, as an app's exit does


def test_openinference_openai(agl: Agl, fake: FakeOpenAI) -> None:
    from openinference.instrumentation.openai import OpenAIInstrumentor

    _instrumented(agl, OpenAIInstrumentor(), "oi-openai", lambda: _openai_agent(fake.url))
    _check(agl, fake, "oi-openai", "add-2-3", None)
    assert _conventions(agl, "oi-openai") == {"openinference"}


def test_openllmetry_openai(agl: Agl, fake: FakeOpenAI) -> None:
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    _instrumented(agl, OpenAIInstrumentor(), "openllmetry", lambda: _openai_agent(fake.url))
    _check(agl, fake, "openllmetry", "add-2-3", None)
    assert _conventions(agl, "openllmetry") == {"openllmetry"}


def test_opentelemetry_openai_v2(agl: Agl, fake: FakeOpenAI) -> None:
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    _instrumented(agl, OpenAIInstrumentor(), "openai-v2", lambda: _openai_agent(fake.url))
    _check(agl, fake, "openai-v2", "add-2-3", None)
    assert _conventions(agl, "openai-v2") == {"genai"}


def _langchain_agent(base_url: str) -> None:
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    model = ChatOpenAI(model="fake-model", base_url=base_url, api_key="x", max_retries=0)
    agent = create_agent(model, [add], name="calculator", system_prompt="Be brief.")
    agent.invoke({"messages": [("user", "Add 2 and 3.")]})


@pytest.mark.parametrize("with_openai", [False, True], ids=["langchain", "langchain+openai"])
def test_openinference_langchain(agl: Agl, fake: FakeOpenAI, with_openai: bool) -> None:
    """With OpenInference's OpenAI instrumentor on too, each call is two nested LLM spans: still one transition."""
    from openinference.instrumentation.langchain import LangChainInstrumentor
    from openinference.instrumentation.openai import OpenAIInstrumentor

    provider = exporting_provider(agl, **{"agl.rollout.id": "oi-langchain", "agl.task.id": "add-2-3"})
    instrumentors: list[Any] = [LangChainInstrumentor()] + ([OpenAIInstrumentor()] if with_openai else [])
    for instrumentor in instrumentors:
        instrumentor.instrument(tracer_provider=provider)
    try:
        _langchain_agent(fake.url)
    finally:
        for instrumentor in instrumentors:
            instrumentor.uninstrument()
        provider.shutdown()
    spans = agl.spans("oi-langchain")
    llm_spans = [s for s in spans if s["attributes"].get("openinference.span.kind") == "LLM"]
    assert len(llm_spans) == (4 if with_openai else 2)
    (tool,) = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "execute_tool"]
    assert tool["attributes"]["gen_ai.tool.name"] == "add" and tool["attributes"]["gen_ai.tool.call.id"] == "call_1"
    assert tool["attributes"]["gen_ai.tool.call.result"] == "5"
    transitions = _check(agl, fake, "oi-langchain", "add-2-3", "calculator")
    assert transitions[0]["tools"][0]["function"]["name"] == "add"


@pytest.mark.parametrize("version", [None, 2], ids=["default", "version-2"])
def test_pydantic_ai_builtin_instrumentation(agl: Agl, fake: FakeOpenAI, version: int | None) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.instrumented import InstrumentationSettings
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = exporting_provider(agl, **{"agl.rollout.id": "pydantic-ai", "agl.task.id": "add-2-3"})
    model = OpenAIChatModel("fake-model", provider=OpenAIProvider(base_url=fake.url, api_key="x"))
    agent = Agent(model, name="calculator", instructions="Be brief.")
    versioned: dict[str, Any] = {} if version is None else {"version": version}
    agent.instrument = InstrumentationSettings(tracer_provider=provider, **versioned)  # its own instrumentation

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    try:
        assert agent.run_sync("Add 2 and 3.").output == "The sum is 5."
    finally:
        provider.shutdown()
    assert _conventions(agl, "pydantic-ai") == {"pydantic_ai"}
    (tool,) = [s for s in agl.spans("pydantic-ai") if s["attributes"].get("gen_ai.operation.name") == "execute_tool"]
    assert tool["attributes"]["gen_ai.tool.call.id"] == "call_1"
    assert tool["attributes"]["gen_ai.tool.call.result"] == "5"
    _check(agl, fake, "pydantic-ai", "add-2-3", "calculator")



def test_through_the_gateway_a_traceparent_joins_the_exact_token_ids(agl: Agl, fake: FakeOpenAI) -> None:
    """OpenInference's instrumentor sends no traceparent; one request hook on the app's HTTP client (the
    OpenTelemetry propagator's ``inject``) sends the current span's, the LLM span's: the gateway records the
    call's ids under it, and they join the ingested span (token_source gateway)."""
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.propagate import inject

    provider = exporting_provider(agl, **{"agl.rollout.id": "via-gateway"})
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    http = openai.DefaultHttpxClient(event_hooks={"request": [lambda request: inject(request.headers)]})
    try:
        _openai_agent(f"{agl.url}/v1", TOKEN, http)  # the agent's base URL is the gateway's
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    assert agl.finish("via-gateway")["transitions"] == 2
    transitions = agl.transitions("via-gateway")
    relayed = [r.body for r in fake.requests if r.path.endswith("/chat/completions")]
    for t, request in zip(transitions, relayed, strict=True):
        assert t["token_source"] == "gateway"
        assert t["prompt_token_ids"] == tokenize(render_prompt(request["messages"]))
    assert transitions[1]["response_token_ids"] == tokenize("The sum is 5.")
    assert transitions[1]["response"]["content"] == "The sum is 5."
