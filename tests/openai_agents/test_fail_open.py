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
import inspect
import logging
import threading
import types
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
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

import agl_core as agl
from agl_core import collector, guard
from agl_core.testing import FakeOpenAI
from agl_openai_agents import attributes
from agl_openai_agents import instrumentor as plugin_instrumentor

# --------------------------------------------------------------------------- the faults, by introspection
# (the same helpers in every suite's test_fail_open.py: each suite runs in its own environment)


def hook_faults(attrs_module: types.ModuleType, instrumentor_module: types.ModuleType) -> list[tuple[Any, str]]:
    """(owner, name) of every agl function the plugin's hooks call.

    The attributes module's own functions, its classes' methods and the agl helpers it imports; the
    agl_core helpers the instrumentor imports by name (``set_on``, ...); ``collector.tracer``. Fault
    reporting itself (``agl_core.guard``) and the hook wrappers are not faults that a hook calls.
    """
    found: list[tuple[Any, str]] = []
    for name, value in vars(attrs_module).items():
        if inspect.isclass(value) and value.__module__ == attrs_module.__name__:
            found += [(value, m) for m, f in vars(value).items() if inspect.isfunction(f)]
        elif _agl_callable(value):
            found.append((attrs_module, name))
    for name, value in vars(instrumentor_module).items():
        if _agl_callable(value) and value.__module__ not in (instrumentor_module.__name__, attrs_module.__name__):
            found.append((instrumentor_module, name))
    found.append((collector, "tracer"))
    return found


def _agl_callable(value: Any) -> bool:
    if not (inspect.isfunction(value) or inspect.ismethod(value)):
        return False
    module = getattr(value, "__module__", "") or ""
    return module.startswith("agl_") and module != guard.__name__


def fault_id(fault: tuple[Any, str]) -> str:
    owner, name = fault
    return f"{getattr(owner, '__qualname__', None) or owner.__name__}.{name}"


def _raiser(*args: Any, **kwargs: Any) -> Any:
    """The body a faulty function gets (its ``__code__``): counts the call through builtins, then raises."""
    __agl_fault_hits__.append(1)  # type: ignore[name-defined]  # noqa: F821
    raise RuntimeError("agl-injected-fault")


def inject(monkeypatch: pytest.MonkeyPatch, fault: tuple[Any, str], hits: list[int]) -> Callable[[], None]:
    """The function that arms ``fault``: a plain function gets the raising body in place, so every
    reference to it fails (ones bound at import time too); a closure or bound method is replaced by name."""
    import builtins

    monkeypatch.setattr(builtins, "__agl_fault_hits__", hits, raising=False)
    owner, name = fault
    target = vars(owner)[name] if inspect.isclass(owner) else getattr(owner, name)

    def arm() -> None:
        if inspect.isfunction(target) and not target.__code__.co_freevars:
            monkeypatch.setattr(target, "__code__", _raiser.__code__)
        else:
            def boom(*args: Any, **kwargs: Any) -> Any:
                hits.append(1)
                raise RuntimeError("agl-injected-fault")

            monkeypatch.setattr(owner, name, boom)

    return arm


def check_reported(caplog: pytest.LogCaptureFixture) -> None:
    """Each faulty site was logged exactly once, naming the injected fault, and counted."""
    counts = guard.fault_counts()
    assert sum(counts.values()) >= 1, "the fault was swallowed without being reported"
    logged = [r for r in caplog.records if r.name == "agl" and "error in" in r.getMessage()]
    assert sorted(r.args[0] for r in logged) == sorted(counts), "each faulty site is logged exactly once"  # type: ignore[index]
    assert any("agl-injected-fault" in r.getMessage() for r in logged)


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


class _Exporter(SpanExporter):
    """An exporter whose backend raises, or never answers (until the test lets it go)."""

    def __init__(self, blocks: bool) -> None:
        self.blocks = blocks
        self.release = threading.Event()

    def export(self, spans: Any) -> SpanExportResult:
        if self.blocks:
            self.release.wait(60)
            return SpanExportResult.SUCCESS
        raise ConnectionError("collector unreachable")

    def shutdown(self) -> None:
        self.release.set()


class _RaisingProcessor(SpanProcessor):
    def __init__(self, on: str) -> None:
        self.on = on

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.on == "start":
            raise RuntimeError("processor on_start")

    def on_end(self, span: Any) -> None:
        if self.on == "end":
            raise RuntimeError("processor on_end")


PROVIDER_FAULTS = ["processor raises on start", "processor raises on end", "exporter raises", "exporter blocks"]


@pytest.mark.parametrize("fault", PROVIDER_FAULTS)
def test_a_misbehaving_user_provider_never_reaches_the_agent(baseline: Any, fault: str) -> None:
    """With a user SDK provider whose processor raises (before agl's, so the SDK stops its chain there) or
    whose exporter raises or never answers: the agent gets the same, and agl's rollout is as complete."""
    good = baseline[0] if isinstance(baseline, tuple) else baseline
    with FakeOpenAI(script=SCRIPT_FOR_PROVIDER) as srv:
        plain_names = sorted(s.name for s in _last_rollout(srv))
    provider = TracerProvider()
    exporter = _Exporter(blocks=fault == "exporter blocks")
    if fault.startswith("processor"):
        provider.add_span_processor(_RaisingProcessor(fault.split()[-1]))
    elif fault == "exporter raises":
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1, max_export_batch_size=1))
    collector.use_provider(provider)
    try:
        with FakeOpenAI(script=SCRIPT_FOR_PROVIDER) as srv:
            assert agent(srv) == good
        with FakeOpenAI(script=SCRIPT_FOR_PROVIDER) as srv:
            assert sorted(s.name for s in _last_rollout(srv)) == plain_names  # no span lost
    finally:
        collector.use_provider(None)
        exporter.release.set()
        provider.shutdown()
    if fault.startswith("processor"):
        assert set(guard.fault_counts()) <= {"collector.start_span", "collector.span_end"}, guard.fault_counts()
        assert guard.fault_counts()


def _last_rollout(srv: FakeOpenAI) -> list[Any]:
    spans: list[Any] = []

    def grab() -> None:
        spans.append(collector.current_rollout.get())

    agent(srv, during=grab)
    buffer = spans[0]
    return [collector.to_record(s) for s in buffer.spans]


SCRIPT_FOR_PROVIDER = _script()
