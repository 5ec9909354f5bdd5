"""Fail-open for the ``pydantic_ai`` plugin: no fault inside agl changes what a Pydantic AI agent returns or raises.

Every agl function the plugin's hooks call is found by introspection (``agl_pydantic_ai.attributes``, the
agl helpers it and the instrumentor import, ``collector.tracer``) and made to raise in turn while a
workload runs against the fake server: an agent with a tool that works, one that asks for a retry and
one whose output fails validation, run plain and streamed with structured output, an agent delegating to
another, and a graph whose node calls a model directly. The weather agent runs again (plain and
streamed), and the graph's model is, on a ``FunctionModel`` replaying the same answers: on a model that
no client plugin records below it, the chat span encodes the messages itself (over the ``openai``
client, that plugin's span of the request holds them). A hook added later is covered without editing
this file. Each fault is logged once and counted; functions the workload cannot reach are listed in
``NOT_ON_PATH`` (and the test checks they really are not reached).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry import trace
from pydantic import BaseModel
from pydantic_ai import Agent, ModelRetry, RunContext

import agl_core as agl
from agl_core import collector, guard
from agl_core.testing import FakeOpenAI
from agl_core.testing.faults import (
    PROVIDER_FAULTS,
    check_misbehaving_provider,
    check_reported,
    fault_id,
    hook_faults,
    inject,
)
from agl_pydantic_ai import attributes
from agl_pydantic_ai import instrumentor as plugin_instrumentor

from .fakes import chat_model

FAULTS = hook_faults(attributes, plugin_instrumentor)
NOT_ON_PATH = {"agl_pydantic_ai.attributes.input_messages"}  # the chat form, for users: hooks record another



class Answer(BaseModel):
    city: str
    celsius: int


def _calls(*calls: tuple[str, dict[str, Any], str]) -> dict[str, Any]:
    return {"tool_calls": [{"name": n, "arguments": a, "id": i} for n, a, i in calls]}


# one run of `agent()`: the weather agent plain, then streamed, then the lead delegating, then the graph
ROUND = [
    _calls(("lookup", {"city": "Oslo"}, "a1"), ("lookup", {"city": "Nowhere"}, "a2")),
    _calls(("final_result", {"city": "Oslo", "celsius": "cold"}, "o1")),
    _calls(("final_result", {"city": "Oslo", "celsius": 3}, "o2")),
    _calls(("final_result", {"city": "Oslo", "celsius": 3}, "o3")),
    _calls(("ask", {"question": "Oslo?"}, "d1")),
    "Oslo is cold.", "The helper says Oslo is cold.",
]


def _replayed(script: list[Any]) -> Any:
    """A ``FunctionModel`` answering with ``script``'s replies (the fake server's form) in turn, over and over."""
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

    def response(entry: Any) -> ModelResponse:
        if isinstance(entry, str):
            return ModelResponse(parts=[TextPart(entry)])
        return ModelResponse(parts=[ToolCallPart(c["name"], c["arguments"], tool_call_id=c["id"])
                                    for c in entry["tool_calls"]])

    turn = iter(range(1 << 30))

    def reply(messages: list[Any], info: AgentInfo) -> ModelResponse:
        return response(script[next(turn) % len(script)])

    async def streamed(messages: list[Any], info: AgentInfo) -> AsyncIterator[Any]:
        entry = script[next(turn) % len(script)]
        if isinstance(entry, str):
            yield entry
            return
        yield {i: DeltaToolCall(c["name"], json.dumps(c["arguments"]), tool_call_id=c["id"])
               for i, c in enumerate(entry["tool_calls"])}

    return FunctionModel(reply, stream_function=streamed)


def _weather(model: Any) -> Agent[None, Answer]:
    agent: Agent[None, Answer] = Agent(model, name="weather", output_type=Answer,
                                       instructions="Be brief.", system_prompt="You answer weather questions.")

    @agent.tool_plain
    def lookup(city: str) -> str:
        """Look up a city's weather."""
        if city == "Nowhere":
            raise ModelRetry("no such city")
        return f"{city}: 3C"

    return agent


def agent(srv: FakeOpenAI, during: Callable[[], None] = lambda: None,
          after: Callable[[], None] = lambda: None) -> list[Any]:
    from pydantic_ai.direct import model_request
    from pydantic_ai.messages import ModelRequest, SystemPromptPart
    from pydantic_graph import BaseNode, End, GraphBuilder, GraphRunContext

    out: list[Any] = []
    helper: Agent[None, str] = Agent(chat_model(srv), name="helper")
    lead: Agent[None, str] = Agent(chat_model(srv), name="lead")

    @lead.tool
    async def ask(ctx: RunContext[None], question: str) -> str:
        return (await helper.run(question, usage=ctx.usage)).output

    @dataclass
    class Ask(BaseNode[None, None, str]):
        question: str

        async def run(self, ctx: GraphRunContext[None, None]) -> End[str]:
            # a history whose first request holds only a system prompt: the plain conversion path
            history = [ModelRequest(parts=[SystemPromptPart("You answer in one line.")], instructions="Be brief."),
                       ModelRequest.user_text_prompt(self.question, instructions="Be brief.")]
            reply = await model_request(_replayed(["A graph answer."]), history)
            return End(reply.parts[0].content)

    builder = GraphBuilder(input_type=Ask, output_type=str)
    builder.add(builder.edge_from(builder.start_node).to(Ask), builder.node(Ask))
    graph = builder.build()

    async def go() -> None:
        out.append((await _weather(chat_model(srv)).run(f"Weather in Oslo? ({uuid.uuid4()})")).output)
        async with _weather(chat_model(srv)).run_stream("Weather in Oslo?") as result:
            out.append(await result.get_output())
        out.append((await _weather(_replayed(ROUND[:3])).run(["Weather in Oslo?"])).output)  # a prompt of parts
        async with _weather(_replayed([ROUND[0], ROUND[2]])).run_stream("Weather in Oslo?") as result:
            out.append(await result.get_output())
        out.append((await lead.run(["Ask the helper."])).output)  # a prompt of parts
        out.append(await graph.run(inputs=Ask("Anything?")))

    with agl.rollout("fail-open") as run:
        during()
        asyncio.run(go())
        after()
        agl.emit_reward(1.0)
    assert run.rollout.status == "succeeded"
    assert trace.get_current_span() is trace.INVALID_SPAN, "a span of ours was left current"
    out.append(run.trajectory().reward)
    return out


def failing_agent(srv: FakeOpenAI) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as caught:
        _weather(chat_model(srv)).run_sync("q")
    return type(caught.value), str(caught.value)


@pytest.fixture(scope="module")
def unfaulted() -> tuple[list[Any], tuple[type[BaseException], str]]:
    """What the workload gets with both plugins on and no fault (once for the module: it is the same each time)."""
    agl.uninstrument()
    agl.instrument(["pydantic_ai", "openai"])
    try:
        with FakeOpenAI(script=ROUND, return_token_ids=True) as srv:
            good = agent(srv)
        with FakeOpenAI(status=500) as srv:
            bad = failing_agent(srv)
    finally:
        agl.uninstrument()
    return good, bad


@pytest.fixture
def baseline(unfaulted: tuple[list[Any], tuple[type[BaseException], str]],
             instrumented: Any) -> Iterator[tuple[list[Any], tuple[type[BaseException], str]]]:
    guard.reset_fault_counts()
    yield unfaulted
    guard.reset_fault_counts()


def test_the_introspection_finds_the_hooks() -> None:
    names = {fault_id(f) for f in FAULTS}
    assert "agl_core.collector.tracer" in names and "agl_pydantic_ai.instrumentor.set_on" in names
    assert len([n for n in names if n.startswith("agl_pydantic_ai.attributes.")]) >= 15, sorted(names)


@pytest.mark.parametrize("fault", FAULTS, ids=fault_id)
def test_a_fault_in_any_hook_function_never_changes_what_the_agent_gets(
        baseline: tuple[list[Any], tuple[type[BaseException], str]], fault: tuple[Any, str],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    good, bad = baseline
    hits: list[int] = []
    arm = inject(monkeypatch, fault, hits)
    caplog.set_level(logging.WARNING, logger="agl")
    with FakeOpenAI(script=ROUND, return_token_ids=True) as srv:
        if fault[0] is collector:  # agl.rollout() and emit_reward need the tracer too: fault only the hooks
            got = agent(srv, during=arm, after=monkeypatch.undo)
        else:
            arm()
            got = agent(srv)
            with FakeOpenAI(status=500) as failing:
                assert failing_agent(failing) == bad  # the agent's own error passes through unchanged
    monkeypatch.undo()
    assert got == good
    if fault_id(fault) in NOT_ON_PATH:
        assert not hits, f"{fault_id(fault)} is reached now: take it out of NOT_ON_PATH"
        return
    assert hits, f"the agent never reached {fault_id(fault)}: list it in NOT_ON_PATH or reach it"
    check_reported(caplog)


@pytest.mark.parametrize("fault", PROVIDER_FAULTS)
def test_a_misbehaving_user_provider_never_reaches_the_agent(baseline: Any, fault: str) -> None:
    """A user SDK provider whose processor raises or whose exporter raises or never answers: the agent gets
    the same, and agl's rollout is as complete."""
    check_misbehaving_provider(fault, agent, ROUND, baseline[0])
