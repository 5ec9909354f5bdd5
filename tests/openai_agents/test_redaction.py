"""Content capture switched off: no prompt, output, tool argument or result of an Agents SDK run reaches a span.

``agl.instrument(capture_content=False)`` and ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false``
each keep them out of agl's records and out of what the user's own exporter sees, while token ids,
usage, names and timing stay, so the run still trains from token ids.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
from openai import AsyncOpenAI
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl_core as agl
from agl_core import collector, encoding, semconv
from agl_core.testing import FakeOpenAI

SECRET = "SECRET-7f3a"
SCRIPT = [{"tool_calls": [{"name": "lookup", "arguments": {"city": f"Paris {SECRET}"}, "id": "call_1"}]},
          f"It is sunny. {SECRET}"]
PLUGINS = ["openai", "openai_agents"]


@function_tool
def lookup(city: str) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


def run_agent(srv: FakeOpenAI) -> tuple[Any, agl.RolloutRun]:
    model = OpenAIChatCompletionsModel("policy", AsyncOpenAI(base_url=srv.url, api_key="x", max_retries=0))
    weather = Agent(name="weather", instructions=f"Answer briefly. {SECRET}", tools=[lookup], model=model,
                    model_settings=ModelSettings(extra_body={"return_token_ids": True}))
    with agl.rollout("private") as run:
        result = asyncio.run(Runner.run(weather, f"weather in Paris? {SECRET}"))
        agl.emit_reward(1.0)
    return result.final_output, run


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """A user SDK provider with an in-memory exporter; the capture setting is put back afterwards."""
    agl.uninstrument()
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    collector.use_provider(provider)
    yield exporter
    agl.uninstrument()
    collector.use_provider(None)
    monkeypatch.delenv(encoding.CAPTURE_CONTENT_ENV, raising=False)
    encoding.reset_capture_content()


def _switch_off(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "argument":
        active = agl.instrument(PLUGINS, capture_content=False)
    else:
        monkeypatch.setenv(encoding.CAPTURE_CONTENT_ENV, "false")
        active = agl.instrument(PLUGINS)
    assert sorted(active) == PLUGINS and encoding.capture_content is False


def _texts(attributes: Any) -> str:
    return json.dumps({k: v for k, v in dict(attributes or {}).items()}, default=str)


@pytest.mark.parametrize("how", ["argument", "env"])
def test_capture_off_redacts_every_span_and_keeps_token_ids(capture: InMemorySpanExporter, how: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _switch_off(how, monkeypatch)
    with FakeOpenAI(script=SCRIPT) as srv:
        answer, run = run_agent(srv)
    assert answer == f"It is sunny. {SECRET}"  # the agent is unaffected
    exported = capture.get_finished_spans()
    assert exported and run.rollout.spans
    for attrs in [s.attributes for s in run.rollout.spans] + [s.attributes for s in exported]:
        assert SECRET not in _texts(attrs)
        assert not set(dict(attrs or {})) & encoding.CONTENT_ATTRIBUTES
    spans = run.rollout.spans
    assert not [s.name for s in spans if SECRET in s.name]
    assert any(s.attributes.get(semconv.GEN_AI_TOOL_NAME) == "lookup" for s in spans)  # names kept
    assert any(s.attributes.get(semconv.GEN_AI_USAGE_INPUT_TOKENS) for s in spans)  # usage kept
    assert all(s.end_ns >= s.start_ns > 0 for s in spans)  # timing kept
    traj = run.trajectory()
    assert len(traj.transitions) == 2 and traj.reward == 1.0
    for t in traj.transitions:  # training still works from token ids
        assert t.prompt_token_ids and t.response_token_ids and t.agent_name == "weather"
        assert SECRET not in json.dumps(t.to_dict())


def test_capture_on_by_default_records_content(capture: InMemorySpanExporter) -> None:
    """The control: without the switch the same run does carry the content (so the test above can fail)."""
    assert sorted(agl.instrument(PLUGINS)) == PLUGINS
    assert encoding.capture_content is True
    with FakeOpenAI(script=SCRIPT) as srv:
        _, run = run_agent(srv)
    keys = set().union(*(s.attributes for s in run.rollout.spans))
    assert {semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES, semconv.GEN_AI_TOOL_CALL_ARGUMENTS,
            semconv.GEN_AI_TOOL_CALL_RESULT} <= keys
    assert SECRET in _texts(capture.get_finished_spans()[0].attributes) or any(
        SECRET in _texts(s.attributes) for s in capture.get_finished_spans())
