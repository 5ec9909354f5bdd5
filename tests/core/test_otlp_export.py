"""docs/otlp-export.md, exactly: the user's own SDK ``TracerProvider`` with an exporter, set before or after
``agl.instrument()``, keeps receiving every span while agl collects the same spans into rollouts.

An ``InMemorySpanExporter`` stands where the OTLP exporter to Phoenix, Jaeger or
Langfuse would be (the processor and the provider are the SDK's real ones).
Checked: agl never replaces the provider, the user's processor stays, the
exporter gets agl's LLM, tool, rollout and reward spans with the GenAI
attributes and the same ids the transitions point at, the user's own span
around a training step is their parent, and agl's trajectory is as complete as
without a provider.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl_core as agl
from agl_core import collector, guard, semconv
from agl_core.testing import FakeOpenAI

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.openai_client_agent import agent as atlas  # noqa: E402

REPLIES: list[Any] = [
    {"tool_calls": [{"name": "country_facts", "arguments": {"country": "Kenya"}, "id": "c1"}]},
    "Nairobi",
]


@pytest.fixture
def restore_global_provider() -> Iterator[None]:
    """The API lets a process set its global provider once: put the slot back after the test."""
    from opentelemetry.util._once import Once

    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    agl.uninstrument()
    collector.use_provider(None)
    guard.reset_fault_counts()
    try:
        yield
    finally:
        agl.uninstrument()
        collector.use_provider(None)
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeOpenAI]]:
    servers: list[FakeOpenAI] = []

    def start(replies: list[Any]) -> FakeOpenAI:
        srv = FakeOpenAI(list(replies), return_token_ids=True).start()
        servers.append(srv)
        monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
        monkeypatch.setenv("OPENAI_API_KEY", "not-a-key")
        return srv

    yield start
    for srv in servers:
        srv.stop()


def _user_provider(exporter: InMemorySpanExporter, *, batch: bool) -> TracerProvider:
    """What docs/otlp-export.md sets up, with the in-memory exporter in the OTLP exporter's place."""
    provider = TracerProvider(resource=Resource.create({"service.name": "sql-agent-training"}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


def _check_export(exporter: InMemorySpanExporter, provider: TracerProvider, run: agl.RolloutRun,
                  step_span_id: int) -> None:
    provider.force_flush()
    exported = {format(s.context.span_id, "016x"): s for s in exporter.get_finished_spans()}
    traj = run.trajectory()
    assert run.rollout.status == "succeeded" and traj.reward == 1.0
    assert len(traj.transitions) == 2 and all(t.response_token_ids for t in traj.transitions)
    # every span of the rollout went to the user's exporter too, with the same ids
    assert {s.span_id for s in run.rollout.spans} <= set(exported)
    for t in traj.transitions:
        span = exported[t.span_id]
        assert format(span.context.trace_id, "032x") == t.trace_id
        assert span.name == "chat policy" and span.attributes is not None
        assert span.attributes[semconv.GEN_AI_OPERATION_NAME] == "chat"
        assert span.attributes[semconv.GEN_AI_REQUEST_MODEL] == "policy"
        assert span.attributes[semconv.AGL_ROLLOUT_ID] == run.id
        assert span.resource.attributes["service.name"] == "sql-agent-training"
    names = [s.name for s in exported.values()]
    assert "execute_tool country_facts" in names and "agl.reward" in names
    (root,) = [s for s in exported.values() if s.name.startswith("agl.rollout")]
    assert root.parent is not None and root.parent.span_id == step_span_id  # nests in the user's own span
    assert guard.fault_counts() == {}


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "simple"])
def test_a_global_provider_set_before_instrument_keeps_its_exporter(restore_global_provider: None,
                                                                    model: Callable[..., FakeOpenAI],
                                                                    batch: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = _user_provider(exporter, batch=batch)
    trace.set_tracer_provider(provider)
    processors = list(provider._active_span_processor._span_processors)

    assert agl.instrument(["openai"]) == ["openai"]
    assert trace.get_tracer_provider() is provider  # never replaced
    assert collector.provider() is provider
    after = list(provider._active_span_processor._span_processors)
    assert after[:len(processors)] == processors and len(after) == len(processors) + 1  # agl's added, theirs kept

    model(REPLIES)
    with trace.get_tracer("my.trainer").start_as_current_span("training step 3") as step:
        assert atlas.rollout(atlas.TASKS[0]) == 1.0
    _check_export(exporter, provider, atlas.rollout.last_run, step.get_span_context().span_id)


def test_a_provider_set_after_instrument_is_picked_up(restore_global_provider: None,
                                                      model: Callable[..., FakeOpenAI]) -> None:
    assert agl.instrument(["openai"]) == ["openai"]
    assert collector.provider() is None  # no SDK provider yet: agl's own light tracer
    exporter = InMemorySpanExporter()
    provider = _user_provider(exporter, batch=True)
    trace.set_tracer_provider(provider)
    model(REPLIES)
    with trace.get_tracer("my.trainer").start_as_current_span("training step 1") as step:
        assert atlas.rollout(atlas.TASKS[0]) == 1.0
    assert collector.provider() is provider and trace.get_tracer_provider() is provider
    _check_export(exporter, provider, atlas.rollout.last_run, step.get_span_context().span_id)


def test_a_provider_passed_to_instrument_is_used_without_becoming_global(restore_global_provider: None,
                                                                         model: Callable[..., FakeOpenAI]) -> None:
    exporter = InMemorySpanExporter()
    provider = _user_provider(exporter, batch=False)
    assert agl.instrument(["openai"], tracer_provider=provider) == ["openai"]
    assert trace.get_tracer_provider() is not provider
    model(REPLIES)
    with provider.get_tracer("my.trainer").start_as_current_span("training step 7") as step:
        assert atlas.rollout(atlas.TASKS[0]) == 1.0
    _check_export(exporter, provider, atlas.rollout.last_run, step.get_span_context().span_id)


def test_an_exporter_that_fails_loses_agl_nothing(restore_global_provider: None,
                                                  model: Callable[..., FakeOpenAI]) -> None:
    """A backend that is down: the exporter raises on every export; the rollout is still whole."""

    class Down(InMemorySpanExporter):
        def export(self, spans: Any) -> Any:
            raise ConnectionError("collector unreachable")

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Down()))
    trace.set_tracer_provider(provider)
    agl.instrument(["openai"])
    model(REPLIES)
    assert atlas.rollout(atlas.TASKS[0]) == 1.0
    traj = atlas.rollout.last_run.trajectory()
    assert len(traj.transitions) == 2 and traj.reward == 1.0
