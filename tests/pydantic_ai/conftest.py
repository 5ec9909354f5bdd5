"""Fixtures of the Pydantic AI suite: the real framework, offline, against agl's fake model server.

No API key is set and nothing leaves 127.0.0.1: models are Pydantic AI's OpenAI models on
:class:`agl_core.testing.FakeOpenAI` (chat completions and the Responses API), or the
framework's own ``FunctionModel`` and ``TestModel``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl_core as agl
from agl_core import guard

os.environ.pop("OPENAI_API_KEY", None)


@pytest.fixture
def instrumented() -> Iterator[list[str]]:
    """The two plugins a Pydantic AI user gets from ``agl.instrument()``: ``pydantic_ai``, and ``openai`` beneath it."""
    agl.uninstrument()
    active = agl.instrument(["pydantic_ai", "openai"])
    assert sorted(active) == ["openai", "pydantic_ai"], active.skipped
    guard.reset_fault_counts()
    try:
        yield list(active)
    finally:
        agl.uninstrument()


@pytest.fixture
def global_provider() -> Iterator[InMemorySpanExporter]:
    """An OpenTelemetry SDK provider set as the global one (as a user with Jaeger has), undone after."""
    from opentelemetry.util._once import Once

    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
