"""The plugin's own guarantees: fail-open hooks, exact uninstrument, no state left behind, the user's trace
processors untouched, guardrail trips recorded, and a clear skip on an SDK layout it does not know."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from agents import (
    Agent,
    GuardrailFunctionOutput,
    InputGuardrailTripwireTriggered,
    ModelResponse,
    Runner,
    Usage,
    function_tool,
    input_guardrail,
)
from agents.models.interface import Model
from agents.tool_context import ToolContext
from agents.tracing import TracingProcessor, add_trace_processor, set_trace_processors
from agents.tracing.spans import NoOpSpan, SpanImpl

import agl_core as agl
from agl_core import guard, semconv
from agl_core.testing import FakeOpenAI
from agl_openai_agents import attributes
from agl_openai_agents.instrumentor import OpenAIAgentsInstrumentor

SCRIPT = [{"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "call_1"}]}, "2 + 3 = 5."]


def answer(body: dict[str, Any]) -> Any:
    """The same two replies for every run: the tool call, then (once the tool answered) the result."""
    return SCRIPT[1] if body["messages"][-1]["role"] == "tool" else SCRIPT[0]


@function_tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def calculator(model: Any) -> Agent[Any]:
    return Agent(name="Calculator", instructions="Use the tool.", tools=[add], model=model)


def run(agent: Agent[Any], text: str = "What is 2 + 3?") -> Any:
    return asyncio.run(Runner.run(agent, text))


class Recorder(TracingProcessor):
    """A user's own trace processor: records what the SDK hands it."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.ended: list[tuple[str, Any]] = []

    def on_trace_start(self, trace: Any) -> None:
        self.started.append("trace")

    def on_trace_end(self, trace: Any) -> None:
        return None

    def on_span_start(self, span: Any) -> None:
        self.started.append(type(span.span_data).__name__)

    def on_span_end(self, span: Any) -> None:
        self.ended.append((type(span.span_data).__name__, span.error))

    def shutdown(self) -> None:
        return None

    def force_flush(self) -> None:
        return None


def plugin() -> OpenAIAgentsInstrumentor:
    return OpenAIAgentsInstrumentor()  # a singleton, like every BaseInstrumentor


# --------------------------------------------------------------------------- fail-open


@pytest.mark.parametrize("hook", ["request_attributes", "response_attributes", "stream_attributes",
                                  "tool_end_attributes", "tool_start_attributes", "agent_attributes",
                                  "input_messages_json"])
@pytest.mark.usefixtures("instrumented")
def test_a_fault_inside_agls_hooks_never_reaches_the_agent(hook: str, monkeypatch: pytest.MonkeyPatch,
                                                           chat_model: Callable[..., Any]) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected fault in {hook}")

    monkeypatch.setattr(attributes, hook, broken)
    async def streamed(agent: Agent[Any]) -> Any:
        streamed_result = Runner.run_streamed(agent, "What is 2 + 3?")
        async for _ in streamed_result.stream_events():
            pass
        return streamed_result.final_output

    with FakeOpenAI(script=answer) as srv:
        with agl.rollout(task_id="faulty") as rollout:
            result = run(calculator(chat_model(srv)))
            streamed_output = asyncio.run(streamed(calculator(chat_model(srv))))
    assert result.final_output == streamed_output == "2 + 3 = 5."
    assert sum(guard.fault_counts().values()) > 0
    assert rollout.rollout.status == "succeeded"
    assert not plugin()._bridge or not plugin()._bridge.nodes  # type: ignore[union-attr]


# --------------------------------------------------------------------------- uninstrument


def _hooked() -> dict[tuple[Any, str], Any]:
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel

    owners = [(cls, name) for cls in (OpenAIChatCompletionsModel, OpenAIResponsesModel)
              for name in ("get_response", "stream_response")]
    owners += [(cls, name) for cls in (SpanImpl, NoOpSpan) for name in ("start", "finish", "set_error")]
    owners += [(ToolContext, "from_agent_context"), (Model, "__init_subclass__")]
    return {key: key[0].__dict__.get(key[1]) for key in owners}


def test_uninstrument_restores_every_sdk_attribute_exactly() -> None:
    agl.uninstrument()
    before = _hooked()
    assert before[(Model, "__init_subclass__")] is None
    assert agl.instrument(["openai_agents"]) == ["openai_agents"]

    class LateModel(Model):  # defined while instrumented: its methods get wrapped, then unwrapped
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            return ModelResponse(output=[], usage=Usage(), response_id=None)

        async def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            yield None

    late = {name: LateModel.__dict__[name] for name in ("get_response", "stream_response")}
    during = _hooked()
    assert all(during[key] is not before[key] for key in before)
    assert agl.instrument(["openai_agents"]) == ["openai_agents"]  # idempotent: nothing wrapped twice
    assert _hooked() == during
    agl.uninstrument()
    after = _hooked()
    assert all(after[key] is before[key] for key in before)
    assert "__init_subclass__" not in Model.__dict__
    assert all(getattr(LateModel.__dict__[name], "__agl_wrapped__", False) is False for name in late)
    assert all(LateModel.__dict__[name] is late[name].__wrapped__ for name in late)


# --------------------------------------------------------------------------- no state left behind


@pytest.mark.usefixtures("instrumented")
def test_nothing_is_left_behind_after_many_runs(chat_model: Callable[..., Any]) -> None:
    from agl_openai_agents.attributes import _model_static, _tool_defs

    async def many(agent: Agent[Any]) -> tuple[int, int]:
        sizes = (0, 0)
        for i in range(50):
            async with agl.rollout(task_id=f"t{i}") as rollout:
                assert (await Runner.run(agent, "What is 2 + 3?")).final_output == "2 + 3 = 5."
            assert len(rollout.trajectory().transitions) == 2
            if i == 24:
                sizes = len(_model_static), len(_tool_defs)
        return sizes

    with FakeOpenAI(script=answer) as srv:
        cached = asyncio.run(many(calculator(chat_model(srv))))  # one loop: the client's connections live in it
    bridge = plugin()._bridge
    assert bridge is not None and bridge.nodes == {}
    assert (len(_model_static), len(_tool_defs)) == cached  # per model class and per tool, not per call


# --------------------------------------------------------------------------- coexistence with trace processors


def _sdk_events(chat_model: Callable[..., Any]) -> Recorder:
    recorder = Recorder()
    add_trace_processor(recorder)
    try:
        with FakeOpenAI(script=[{"tool_calls": [{"name": "add", "arguments": {"a": "x"}, "id": "c"}]}, *SCRIPT]) \
                as srv:
            run(calculator(chat_model(srv)))
    finally:
        set_trace_processors([])
    return recorder


def test_the_users_trace_processors_see_exactly_what_they_see_without_agl(chat_model: Callable[..., Any]) -> None:
    from agents.tracing import get_trace_provider

    agl.uninstrument()
    without = _sdk_events(chat_model)
    processors = list(get_trace_provider()._multi_processor._processors)  # type: ignore[attr-defined]
    assert agl.instrument(["openai_agents"]) == ["openai_agents"]
    try:
        assert list(get_trace_provider()._multi_processor._processors) == processors  # type: ignore[attr-defined]
        with_agl = _sdk_events(chat_model)
    finally:
        agl.uninstrument()
    assert with_agl.started == without.started and "FunctionSpanData" in with_agl.started
    assert [(name, error is None) for name, error in with_agl.ended] == \
        [(name, error is None) for name, error in without.ended]


@pytest.mark.usefixtures("instrumented")
def test_processors_replaced_after_instrument_do_not_blind_agl(chat_model: Callable[..., Any]) -> None:
    recorder = Recorder()
    set_trace_processors([recorder])  # what a user does to stop exporting to OpenAI: agl keeps working
    try:
        with FakeOpenAI(script=SCRIPT) as srv, agl.rollout(task_id="replaced") as rollout:
            run(calculator(chat_model(srv)))
    finally:
        set_trace_processors([])
    assert "AgentSpanData" in recorder.started
    names = [s.name for s in rollout.rollout.spans]
    assert "invoke_agent Calculator" in names and "execute_tool add" in names


# --------------------------------------------------------------------------- guardrails


@pytest.mark.usefixtures("instrumented")
def test_a_guardrail_trip_is_a_span_and_the_sdks_exception_passes_through(chat_model: Callable[..., Any]) -> None:
    @input_guardrail
    def no_homework(ctx: Any, agent: Any, text: Any) -> GuardrailFunctionOutput:
        return GuardrailFunctionOutput(output_info={"homework": True}, tripwire_triggered="homework" in str(text))

    with FakeOpenAI(script=["Here is the answer."]) as srv:
        agent = Agent(name="Tutor", input_guardrails=[no_homework], model=chat_model(srv))
        with pytest.raises(InputGuardrailTripwireTriggered), agl.rollout(task_id="guard") as rollout:
            run(agent, "Do my homework")
        with agl.rollout(task_id="fine") as fine:
            run(agent, "Explain fractions")
    (tripped,) = [s for s in rollout.rollout.spans if s.name == "guardrail no_homework"]
    assert tripped.attributes[semconv.AGL_GUARDRAIL_TRIGGERED] is True
    assert tripped.attributes[semconv.AGL_GUARDRAIL_NAME] == "no_homework"
    assert tripped.attributes[semconv.GEN_AI_AGENT_NAME] == "Tutor"
    (passed,) = [s for s in fine.rollout.spans if s.name == "guardrail no_homework"]
    assert passed.attributes[semconv.AGL_GUARDRAIL_TRIGGERED] is False


# --------------------------------------------------------------------------- an SDK layout agl does not know


@pytest.fixture
def off() -> Iterator[None]:
    agl.uninstrument()
    yield
    agl.uninstrument()


@pytest.mark.parametrize("missing", ["NoOpSpan", "SpanImpl"])
@pytest.mark.usefixtures("off")
def test_an_unknown_sdk_layout_is_skipped_with_a_clear_reason(missing: str, monkeypatch: pytest.MonkeyPatch,
                                                              chat_model: Callable[..., Any]) -> None:
    import agents.tracing.spans

    monkeypatch.delattr(agents.tracing.spans, missing)
    result = agl.instrument(["openai_agents"])
    assert "openai_agents" not in result
    reason = result.skipped["openai_agents"]
    assert "unsupported OpenAI Agents SDK layout" in reason and f"{missing} is missing" in reason
    assert "openai-agents >=" in reason
    assert "__init_subclass__" not in Model.__dict__
    with FakeOpenAI(script=SCRIPT) as srv:  # the SDK itself works as before
        assert run(calculator(chat_model(srv))).final_output == "2 + 3 = 5."
