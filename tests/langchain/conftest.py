"""Fixtures for the ``langchain`` plugin's tests: the real LangChain and LangGraph, offline.

Models are :mod:`fakes` (LangChain's own ``GenericFakeChatModel``, made
agent-ready) or ``ChatOpenAI`` talking to :class:`agl_core.testing.FakeOpenAI`
on 127.0.0.1. No LangSmith tracing, no API key from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import agl_core as agl
from agl_core import collector, guard
from agl_core.instrumentation import Instrumented
from agl_core.testing import FakeOpenAI
from agl_langchain import LangChainInstrumentor
from agl_langchain.instrumentor import Hooks

for _var in ("LANGCHAIN_TRACING_V2", "LANGSMITH_TRACING", "LANGCHAIN_API_KEY", "LANGSMITH_API_KEY", "OPENAI_API_KEY"):
    os.environ.pop(_var, None)


@pytest.fixture
def instrumented() -> Iterator[Instrumented]:
    """Only this plugin on (the ``openai`` plugin off), agl's own tracer, fault counters at zero."""
    agl.uninstrument()
    collector.use_provider(None)
    guard.reset_fault_counts()
    result = agl.instrument(["langchain"])
    assert result == ["langchain"], result.skipped
    yield result
    agl.uninstrument()


@pytest.fixture
def with_openai() -> Iterator[Instrumented]:
    """This plugin and agl's ``openai`` plugin, as ``agl.instrument()`` gives a ``ChatOpenAI`` user."""
    agl.uninstrument()
    collector.use_provider(None)
    guard.reset_fault_counts()
    result = agl.instrument(["langchain", "openai"])
    assert sorted(result) == ["langchain", "openai"], result.skipped
    yield result
    agl.uninstrument()


@pytest.fixture
def hooks(instrumented: Instrumented) -> Hooks:
    """The live callback handler (its map of in-flight runs is what must drain)."""
    handler = LangChainInstrumentor().handler
    assert handler is not None
    return handler


@pytest.fixture
def server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as srv:
        yield srv
