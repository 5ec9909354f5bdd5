"""Fixtures of the AutoGen suite: agl's ``autogen`` and ``openai`` plugins on, and a global SDK provider when asked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl_core as agl
from agl_core import guard


@pytest.fixture
def instrumented() -> Iterator[list[str]]:
    """The two plugins an AutoGen user gets from ``agl.instrument()``: ``autogen``, and ``openai`` beneath it."""
    agl.uninstrument()
    active = agl.instrument(["autogen", "openai"])
    assert list(active) == ["autogen", "openai"], active.skipped
    guard.reset_fault_counts()
    try:
        yield list(active)
    finally:
        agl.uninstrument()


@pytest.fixture
def global_provider() -> Iterator[InMemorySpanExporter]:
    """An OpenTelemetry SDK provider set as the global one (as a user with Jaeger or Phoenix has), undone after."""
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
