"""Fail-open for the ``openai_agents`` plugin: no fault inside agl changes what an Agents SDK run returns or raises.

Every agl function the plugin's hooks call is found by introspection
(``agl_openai_agents.attributes``, the agl helpers it and the instrumentor import,
``collector.tracer``) and made to raise in turn while a triage agent hands off to a
tool-using agent with an input guardrail, run and streamed against a fake server;
a hook added later is covered without editing this file. Each fault is logged once
and counted. Functions this agent cannot reach are listed in ``NOT_ON_PATH`` (and
the test checks they really are not reached).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from importlib.metadata import version
from typing import Any

import pytest
from agents import (
    Agent,
    GuardrailFunctionOutput,
    InputGuardrailTripwireTriggered,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    input_guardrail,
)
from openai import AsyncOpenAI
from opentelemetry import trace

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
from agl_openai_agents import attributes
from agl_openai_agents import instrumentor as plugin_instrumentor

FAULTS = hook_faults(attributes, plugin_instrumentor)
# openai-agents before 0.3 (the legacy suite runs these tests on 0.2.11) hands earlier model replies back as
# content-part lists, so its runs do join parts' text; later releases pass plain strings.
_PARTS_JOINED = tuple(int(p) for p in version("openai-agents").split(".")[:2]) < (0, 3)

NOT_ON_PATH = {
    "_InputMemo.__init__",  # built once, at import
    "agl_openai_agents.attributes.input_messages",  # the reference the memoised JSON is tested against
    # paths this chat-completions agent does not take: content-part lists, reasoning items, tool outputs as
    # parts, plain-string inputs rebuilt as messages, per-model attributes cached before the faulted run
    *(f"agl_openai_agents.attributes.{n}" for n in ("_provider", "_part", "_reasoning",
                                                     "_tool_output", "_system", "_user", "_function")),
    *(() if _PARTS_JOINED else ("agl_openai_agents.attributes._joined_text",)),
    "agl_openai_agents.attributes.error_type",  # an agent error the SDK reports without its exception: none here
}

ROUND = [
    {"tool_calls": [{"name": "transfer_to_weather_agent", "arguments": {}, "id": "call_h1"}]},
    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_w1"},
                    {"name": "get_weather", "arguments": {"city": "Atlantis"}, "id": "call_w2"}]},
    "Sunny in Paris.",
]


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    if city == "Atlantis":
        raise ValueError("no such city: Atlantis")
    return f"Sunny in {city}, 21 C."


@input_guardrail
async def polite(ctx: Any, agent: Any, text: Any) -> GuardrailFunctionOutput:
    return GuardrailFunctionOutput(output_info=None, tripwire_triggered="rude" in str(text))


def _agents(srv: FakeOpenAI) -> Agent[Any]:
    model = OpenAIChatCompletionsModel("fake-model", AsyncOpenAI(base_url=srv.url, api_key="x", max_retries=0))
    settings = ModelSettings(extra_body={"return_token_ids": True})
    weather = Agent(name="Weather agent", instructions="Answer briefly.", tools=[get_weather], model=model,
                    model_settings=settings)
    return Agent(name="Triage agent", instructions="Route.", handoffs=[weather], model=model,
                 model_settings=settings, input_guardrails=[polite])


def agent(srv: FakeOpenAI, during: Callable[[], None] = lambda: None,
          after: Callable[[], None] = lambda: None) -> list[Any]:
    """One run and one streamed run of the triage -> weather handoff, and one run its guardrail trips."""
    triage = _agents(srv)
    out: list[Any] = []

    async def go() -> None:
        result = await Runner.run(triage, f"Weather in Paris? ({uuid.uuid4()})")
        out.append((result.final_output, result.last_agent.name, [type(i).__name__ for i in result.new_items]))
        streamed = Runner.run_streamed(triage, "Weather in Paris?")
        kinds = [e.type async for e in streamed.stream_events()]
        out.append((streamed.final_output, sorted(set(kinds))))
        try:
            await Runner.run(triage, "a rude question")
        except InputGuardrailTripwireTriggered as exc:  # the SDK's own exception reaches the caller
            out.append(type(exc).__name__)

    with agl.rollout("fail-open") as run:
        during()
        asyncio.run(go())
        after()
        agl.emit_reward(1.0)
    assert run.rollout.status == "succeeded"
    assert trace.get_current_span() is trace.INVALID_SPAN, "a span of ours was left current"
    out.append(run.trajectory().reward)
    return out


def _script() -> list[Any]:
    return [*ROUND, *ROUND, "unused"]


@pytest.fixture
def baseline(instrumented: Any) -> Iterator[list[Any]]:
    with FakeOpenAI(script=_script()) as srv:
        good = agent(srv)
    guard.reset_fault_counts()
    yield good
    guard.reset_fault_counts()


def test_the_introspection_finds_the_hooks() -> None:
    names = {fault_id(f) for f in FAULTS}
    assert "agl_core.collector.tracer" in names and "agl_openai_agents.instrumentor.set_on" in names
    assert len([n for n in names if n.startswith("agl_openai_agents.attributes.")]) >= 20, sorted(names)


@pytest.mark.parametrize("fault", FAULTS, ids=fault_id)
def test_a_fault_in_any_hook_function_never_changes_what_the_agent_gets(
        baseline: list[Any], fault: tuple[Any, str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    hits: list[int] = []
    arm = inject(monkeypatch, fault, hits)
    caplog.set_level(logging.WARNING, logger="agl")
    with FakeOpenAI(script=_script()) as srv:
        if fault[0] is collector:  # agl.rollout() and emit_reward need the tracer too: fault only the hooks
            got = agent(srv, during=arm, after=monkeypatch.undo)
        else:
            arm()
            got = agent(srv)
    monkeypatch.undo()
    assert got == baseline
    if fault_id(fault) in NOT_ON_PATH:
        assert not hits, f"{fault_id(fault)} is reached now: take it out of NOT_ON_PATH"
        return
    assert hits, f"the agent never reached {fault_id(fault)}: list it in NOT_ON_PATH or reach it"
    check_reported(caplog)


# --------------------------------------------------------------------------- the user's provider misbehaves


@pytest.mark.parametrize("fault", PROVIDER_FAULTS)
def test_a_misbehaving_user_provider_never_reaches_the_agent(baseline: Any, fault: str) -> None:
    """With a user SDK provider whose processor raises (before agl's, so the SDK stops its chain there) or
    whose exporter raises or never answers: the agent gets the same, and agl's rollout is as complete."""
    good = baseline[0] if isinstance(baseline, tuple) else baseline
    check_misbehaving_provider(fault, agent, SCRIPT_FOR_PROVIDER, good)


SCRIPT_FOR_PROVIDER = _script()
