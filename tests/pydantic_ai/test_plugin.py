"""The plugin beside Pydantic AI's own instrumentation, and switched off: nothing doubled, nothing left behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic_ai import Agent, ModelRetry

import agl_core as agl
from agl_core import semconv
from agl_core.testing import FakeOpenAI

from .fakes import by_plugin, chat_model, spans

SCRIPT = [{"tool_calls": [{"name": "lookup", "arguments": {"city": "Oslo"}, "id": "k1"}]},
          {"tool_calls": [{"name": "lookup", "arguments": {"city": "Nowhere"}, "id": "k2"}]},
          "Oslo is at 3C."]


def run_weather(srv: FakeOpenAI, instrument: bool, stream: bool = False) -> Any:
    from pydantic_ai.capabilities import Instrumentation

    agent: Agent[None, str] = Agent(chat_model(srv), name="weather", instructions="Be brief.",
                                    capabilities=[Instrumentation()] if instrument else None)

    @agent.tool_plain
    def lookup(city: str) -> str:
        """Look up the weather of a city."""
        if city == "Nowhere":
            raise ModelRetry("no such city")
        return f"{city}: 3C"

    with agl.rollout(task_id="coexist") as run:
        if stream:
            async def streamed() -> str:
                async with agent.run_stream("Weather in Oslo?") as result:
                    return await result.get_output()

            assert asyncio.run(streamed()) == "Oslo is at 3C."
        else:
            assert agent.run_sync("Weather in Oslo?").output == "Oslo is at 3C."
        agl.emit_reward(1.0)
    return run


@pytest.mark.parametrize("stream", [False, True], ids=["run_sync", "run_stream"])
def test_pydantic_ais_own_instrumentation_keeps_its_spans_and_doubles_no_transition_or_air_reward(
        instrumented: list[str], global_provider: InMemorySpanExporter, stream: bool) -> None:
    builder = agl.TransitionBuilder(air=agl.AirRules(tool_error=-1.0, tool_ok=0.25))
    with FakeOpenAI(script=SCRIPT, return_token_ids=True) as srv:
        plain = run_weather(srv, instrument=False, stream=stream).trajectory(builder=builder)
    global_provider.clear()
    with FakeOpenAI(script=SCRIPT, return_token_ids=True) as srv:
        run = run_weather(srv, instrument=True, stream=stream)
    traj = run.trajectory(builder=builder)
    # the user's exporter has Pydantic AI's own spans, as without agl, and agl's beside them
    exported = global_provider.get_finished_spans()
    theirs = [s for s in exported if semconv.AGL_PLUGIN not in (s.attributes or {})]
    assert {s.attributes.get(semconv.GEN_AI_OPERATION_NAME) for s in theirs} >= {"chat", "execute_tool",
                                                                                 "invoke_agent"}
    assert any(s.attributes.get(semconv.AGL_PLUGIN) == "pydantic_ai" for s in exported)
    # the rollout holds both, and still trains on one transition per request with the same content and rewards
    assert len([s for s in spans(run, semconv.OP_CHAT) if semconv.AGL_PLUGIN not in s.attributes]) == 3
    assert len(traj.transitions) == len(plain.transitions) == 3
    for with_theirs, alone in zip(traj.transitions, plain.transitions, strict=True):
        assert (with_theirs.agent_name, with_theirs.prompt, with_theirs.response, with_theirs.token_source,
                with_theirs.response_token_ids, with_theirs.reward) == \
            (alone.agent_name, alone.prompt, alone.response, alone.token_source, alone.response_token_ids,
             alone.reward)
    assert [t.reward for t in traj.transitions] == [0.25, -1.0, None]


def test_the_plugin_alone_without_the_openai_plugin_still_records_every_call() -> None:
    agl.uninstrument()
    assert agl.instrument(["pydantic_ai"]) == ["pydantic_ai"]
    try:
        with FakeOpenAI(script=SCRIPT) as srv:
            run = run_weather(srv, instrument=False)
    finally:
        agl.uninstrument()
    traj = run.trajectory()
    assert len(traj.transitions) == 3 and all(t.token_source is None for t in traj.transitions)
    assert by_plugin(spans(run, semconv.OP_CHAT), "openai") == []
    assert traj.transitions[2].prompt[-1] == {"role": "tool", "tool_call_id": "k2",
                                              "content": json.dumps({"error": "no such city"}, separators=(",", ":"))} \
        or traj.transitions[2].prompt[-1]["role"] == "tool"


@pytest.fixture
def originals() -> Iterator[dict[tuple[Any, str], Any]]:
    from pydantic_ai.agent import Agent as AgentClass
    from pydantic_ai.models import Model
    from pydantic_ai.tool_manager import ToolManager
    from pydantic_graph import Step

    agl.uninstrument()
    owners: list[Any] = [Model, AgentClass, ToolManager, Step]
    stack = list(Model.__subclasses__())
    while stack:
        sub = stack.pop()
        owners.append(sub)
        stack.extend(sub.__subclasses__())
    yield {(owner, name): value for owner in owners for name, value in vars(owner).items()}


def test_uninstrument_restores_every_original_object(originals: dict[tuple[Any, str], Any]) -> None:
    assert agl.instrument(["pydantic_ai"]) == ["pydantic_ai"]
    from pydantic_ai.models.openai import OpenAIChatModel

    assert OpenAIChatModel.__dict__["request"] is not originals[(OpenAIChatModel, "request")]
    agl.uninstrument()
    for (owner, name), value in originals.items():
        assert vars(owner).get(name) is value, f"{owner.__qualname__}.{name} was not restored"
    with FakeOpenAI(script=["hi"]) as srv:
        agent: Agent[None, str] = Agent(chat_model(srv), name="quiet")
        with agl.rollout(task_id="off") as run:
            assert agent.run_sync("hello").output == "hi"
    assert [s.attributes.get(semconv.AGL_SPAN_KIND) for s in run.rollout.spans] == ["rollout"]


def test_a_model_class_defined_while_instrumented_is_left_as_pydantic_ai_made_it_after_uninstrument() -> None:
    from pydantic_ai.models.function import FunctionModel

    agl.uninstrument()
    assert agl.instrument(["pydantic_ai"]) == ["pydantic_ai"]

    class Later(FunctionModel):
        async def request(self, *args: Any, **kwargs: Any) -> Any:
            return await super().request(*args, **kwargs)

    wrapped = Later.__dict__["request"]
    assert getattr(wrapped, "__agl_wrapped__", False)
    agl.uninstrument()
    assert not getattr(Later.__dict__["request"], "__agl_wrapped__", False)


def test_with_pydantic_ais_instrumentation_a_model_without_token_ids_keeps_agls_messages(
        global_provider: InMemorySpanExporter) -> None:
    """No openai span to read first: the transition's messages are still agl's, not those of Pydantic AI's span."""
    from pydantic_ai.capabilities import Instrumentation
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    def reply(messages: list[Any], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("lookup", {"city": "Oslo"}, tool_call_id="f1")])
        return ModelResponse(parts=[TextPart("Oslo is at 3C.")])

    def trained(instrument: bool) -> Any:
        agent: Agent[None, str] = Agent(FunctionModel(reply), name="weather", instructions="Be brief.",
                                        system_prompt="You answer weather questions.",
                                        capabilities=[Instrumentation()] if instrument else None)

        @agent.tool_plain
        def lookup(city: str) -> str:
            return f"{city}: 3C"

        with agl.rollout(task_id="function") as run:
            assert agent.run_sync("Weather in Oslo?").output == "Oslo is at 3C."
        return run

    agl.uninstrument()
    assert agl.instrument(["pydantic_ai"]) == ["pydantic_ai"]
    try:
        alone, together = trained(False), trained(True)
    finally:
        agl.uninstrument()
    assert len([s for s in spans(together, semconv.OP_CHAT) if semconv.AGL_PLUGIN not in s.attributes]) == 2
    pairs = zip(alone.trajectory().transitions, together.trajectory().transitions, strict=True)
    for a, b in pairs:
        assert (a.agent_name, a.prompt, a.response, a.tools) == (b.agent_name, b.prompt, b.response, b.tools)
    assert alone.trajectory().transitions[0].prompt[:2] == [
        {"role": "system", "content": "You answer weather questions."}, {"role": "system", "content": "Be brief."}]
