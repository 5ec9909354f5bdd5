"""The ``crewai`` plugin never breaks a crew, undoes itself completely, keeps no state, and leaves crewai's own
telemetry alone."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
from crewai.agent.core import Agent
from crewai.agents.cache.cache_handler import CacheHandler
from crewai.crew import Crew
from crewai.events.event_bus import CrewAIEventsBus
from crewai.flow.flow import Flow
from crewai.llm import LLM
from crewai.llms.base_llm import BaseLLM
from crewai.llms.providers.openai.completion import OpenAICompletion
from crewai.task import Task
from crewai.tools import tool
from opentelemetry import trace

import agl_core as agl
from agl_core import collector, guard, semconv
from agl_core.testing import FakeOpenAI
from agl_crewai import CrewAIInstrumentor, attributes, instrumentor

Serve = Callable[..., FakeOpenAI]


@tool("multiply")
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def _crew(srv: FakeOpenAI) -> Crew:
    llm = LLM(model="gpt-4o", base_url=srv.url, api_key="x", max_retries=0)
    agent = Agent(role="Calculator", goal="compute", backstory="b", llm=llm, tools=[multiply])
    return Crew(agents=[agent], tasks=[Task(description="What is 6*7?", expected_output="a number", agent=agent)])


def _script() -> list[Any]:
    return [{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]}, "The answer is 42."]


def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected fault in agl")


@pytest.mark.parametrize("hook", ["llm_request_attributes", "llm_response_attributes", "reply_message",
                                  "tool_start_attributes", "tool_end_attributes", "agent_attributes",
                                  "task_attributes", "crew_attributes"])
def test_a_fault_in_agl_never_reaches_the_crew(instrumented: list[str], serve: Serve,
                                               monkeypatch: pytest.MonkeyPatch, hook: str) -> None:
    srv = serve(_script())
    monkeypatch.setattr(attributes, hook, _boom)
    with agl.rollout("faulty") as run:
        out = _crew(srv).kickoff()
    assert out.raw == "The answer is 42."
    assert [r.body["messages"][-1]["role"] for r in srv.requests] == ["user", "tool"]  # the tool still ran
    assert sum(guard.fault_counts().values()) >= 1, "the fault was swallowed without being reported"
    assert run.rollout.status == "succeeded"
    assert trace.get_current_span() is trace.INVALID_SPAN  # no span of ours was left current
    by_id = {s.span_id: s for s in run.rollout.spans}
    for span in run.rollout.spans:  # nor current on crewai's threads: nothing nests under a half-ended tool span
        parent = by_id.get(span.parent_id or "")
        assert parent is None or parent.attributes.get(semconv.GEN_AI_OPERATION_NAME) != "execute_tool", span.name


def test_the_users_own_exceptions_pass_through_unchanged(crewai_only: list[str]) -> None:
    class Refusal(Exception):
        pass

    raised = Refusal("no")

    class Refusing(BaseLLM):
        def call(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
            raise raised

    with pytest.raises(Refusal) as caught, agl.rollout("refuse") as run:
        Refusing(model="m").call("hi")
    assert caught.value is raised
    (span,) = [s for s in run.rollout.spans if s.name == "chat m"]
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE].endswith("Refusal")


def _hooked() -> dict[str, Any]:
    """Every attribute the plugin patches, as its owner holds it now (``__dict__``, so ``is`` means the same)."""
    from crewai.agents import step_executor
    from crewai.agents.agent_executor import AgentExecutor

    return {
        "OpenAICompletion.call": OpenAICompletion.__dict__["call"],
        "OpenAICompletion.acall": OpenAICompletion.__dict__["acall"],
        "LLM.call": LLM.__dict__["call"],
        "LLM.acall": LLM.__dict__["acall"],
        "LLM._prepare_completion_params": LLM.__dict__["_prepare_completion_params"],
        "BaseLLM.__init_subclass__": BaseLLM.__dict__["__init_subclass__"],
        "CrewAIEventsBus.emit": CrewAIEventsBus.__dict__["emit"],
        "CacheHandler.read": CacheHandler.__dict__["read"],
        "Crew.kickoff": Crew.__dict__["kickoff"],
        "Crew.akickoff": Crew.__dict__["akickoff"],
        "Task._execute_core": Task.__dict__["_execute_core"],
        "Task._aexecute_core": Task.__dict__["_aexecute_core"],
        "Agent.execute_task": Agent.__dict__["execute_task"],
        "Agent.aexecute_task": Agent.__dict__["aexecute_task"],
        "Agent.kickoff": Agent.__dict__["kickoff"],
        "Agent.kickoff_async": Agent.__dict__["kickoff_async"],
        "Flow.kickoff_async": next(c.__dict__["kickoff_async"] for c in Flow.__mro__ if "kickoff_async" in c.__dict__),
        "AgentExecutor._execute_single_native_tool_call": AgentExecutor.__dict__["_execute_single_native_tool_call"],
        "step_executor.execute_single_native_tool_call": step_executor.execute_single_native_tool_call,
    }


def test_uninstrument_restores_every_original(serve: Serve) -> None:
    agl.uninstrument()
    before = _hooked()
    assert agl.instrument(["crewai"]) == ["crewai"]
    during = _hooked()
    assert all(during[name] is not before[name] for name in before), [n for n in before if during[n] is before[n]]

    class DefinedWhileOn(BaseLLM):
        def call(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
            return "fine"

    assert hasattr(DefinedWhileOn.__dict__["call"], instrumentor._MARK)
    crewai_wrapper = getattr(DefinedWhileOn.__dict__["call"], instrumentor._MARK)
    agl.uninstrument()
    after = _hooked()
    assert all(after[name] is before[name] for name in before), [n for n in before if after[n] is not before[n]]
    assert DefinedWhileOn.__dict__["call"] is crewai_wrapper  # crewai's own retry wrapper, as crewai made it
    assert not CrewAIInstrumentor().is_instrumented_by_opentelemetry

    srv = serve(_script())
    with agl.rollout("off") as run:
        assert _crew(srv).kickoff().raw == "The answer is 42."
        assert DefinedWhileOn(model="m").call("hi") == "fine"
    assert [s.name for s in run.rollout.spans] == ["agl.rollout off"]
    assert "traceparent" not in srv.requests[0].headers


def test_no_state_outlives_a_run(instrumented: list[str], serve: Serve) -> None:
    srv = serve(lambda body: _script()[0] if body["messages"][-1]["role"] == "user" else "The answer is 42.")
    crew = _crew(srv)
    for i in range(5):
        with agl.rollout(f"run-{i}") as run:
            crew.kickoff()
        assert len(run.trajectory().transitions) == 2
    gc.collect()
    live = [o for o in gc.get_objects() if isinstance(o, (instrumentor._LLMCall, instrumentor._ToolSpan))]
    assert live == []
    assert instrumentor._llm_call.get() is None and instrumentor._tool.get() is None
    assert instrumentor._native_call.get() is None
    assert collector._open == {}  # every rollout buffer was closed
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_crewai_telemetry_stays_its_own(instrumented: list[str], serve: Serve,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """crewai's anonymous telemetry, switched on (exporting to memory), keeps its private provider and its spans.

    agl collects none of crewai's telemetry spans, puts none of its own into crewai's provider, and installs no
    global provider; crewai's telemetry still records its crew and task spans.
    """
    from crewai.events.event_bus import crewai_event_bus
    from crewai.events.event_listener import EventListener
    from crewai.telemetry import telemetry as telemetry_module
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "false")
    monkeypatch.setattr(telemetry_module, "SafeOTLPSpanExporter", lambda **kwargs: exported)
    monkeypatch.setattr(telemetry_module.Telemetry, "_register_shutdown_handlers", lambda self: None)
    monkeypatch.setattr(telemetry_module.Telemetry, "_instance", None)
    telemetry = telemetry_module.Telemetry()
    assert telemetry.ready
    listener = EventListener()
    monkeypatch.setattr(listener, "_telemetry", telemetry)
    telemetry.set_tracer()

    srv = serve(_script())
    try:
        with agl.rollout("telemetry") as run:
            assert _crew(srv).kickoff().raw == "The answer is 42."
        crewai_event_bus.flush()
        telemetry.provider.force_flush()
    finally:
        telemetry.provider.shutdown()

    theirs = {s.name for s in exported.get_finished_spans()}
    assert {"Crew Created", "Task Created", "Crew Completed"} <= theirs, theirs  # crewai's telemetry still works
    ours = {s.name for s in run.rollout.spans}
    assert not theirs & ours
    plugins = {s.attributes.get(semconv.AGL_PLUGIN) for s in run.rollout.spans} - {None}
    assert plugins == {"crewai", "openai"}  # every collected span but the rollout's own is agl's
    assert all(s.instrumentation_scope is None or s.instrumentation_scope.name != semconv.TRACER_NAME
               for s in exported.get_finished_spans())
    assert not any(p is telemetry.provider for p in collector._t.attached)
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # agl installed no global provider
