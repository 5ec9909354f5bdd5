"""Fixtures of the Agent Framework suite: agl's ``agent_framework`` and ``openai`` plugins on, the framework's
own tracing on a user's SDK provider when asked, and fake model servers on 127.0.0.1.

The framework's instrumentation is on by default (it writes to the global
provider, a no-op one until the user sets one); ``framework_tracing`` gives it a
real SDK provider with sensitive data on, as a user with Jaeger or Phoenix has,
and puts everything back afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from agent_framework.observability import OBSERVABILITY_SETTINGS, enable_instrumentation
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl_core as agl
from agl_core import guard
from agl_core.testing import FakeOpenAI

PLUGINS = ["agent_framework", "openai"]


@pytest.fixture
def instrumented() -> Iterator[list[str]]:
    """The two plugins an Agent Framework user gets from ``agl.instrument()``: this one, and ``openai`` beneath it."""
    agl.uninstrument()
    active = agl.instrument(PLUGINS)
    assert list(active) == PLUGINS, active.skipped
    guard.reset_fault_counts()
    try:
        yield list(active)
    finally:
        agl.uninstrument()


@pytest.fixture
def framework_tracing() -> Iterator[InMemorySpanExporter]:
    """The framework's own OpenTelemetry instrumentation on (sensitive data too), exporting to a global SDK provider."""
    from opentelemetry.util._once import Once

    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    settings = (OBSERVABILITY_SETTINGS.enable_instrumentation, OBSERVABILITY_SETTINGS.enable_sensitive_data)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace.set_tracer_provider(provider)
    enable_instrumentation(enable_sensitive_data=True, force=True)
    assert OBSERVABILITY_SETTINGS.ENABLED and OBSERVABILITY_SETTINGS.SENSITIVE_DATA_ENABLED
    try:
        yield exporter
    finally:
        OBSERVABILITY_SETTINGS.enable_instrumentation, OBSERVABILITY_SETTINGS.enable_sensitive_data = settings
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved
        provider.shutdown()


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeOpenAI]]:
    """``serve(*replies)``: a running fake vLLM-like server saying them, with token ids; stopped after the test."""
    servers: list[FakeOpenAI] = []

    def start(*replies: Any, **kwargs: Any) -> FakeOpenAI:
        kwargs.setdefault("return_token_ids", True)
        srv = FakeOpenAI(list(replies), **kwargs).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()

