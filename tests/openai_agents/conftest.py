"""Fixtures for the ``openai_agents`` plugin's tests: the real SDK, offline, exporting nowhere.

No API key is set and no trace is ever exported to the vendor: the SDK's
default processor (the exporter to OpenAI) is replaced by none at session
start, and each test gets the SDK's tracing switched back on and no processor
left behind. Models talk to :class:`agl_core.testing.FakeOpenAI` on 127.0.0.1,
or are the tests' own ``Model`` subclasses.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import agl_core as agl
from agl_core import guard
from agl_core.instrumentation import Instrumented
from agl_core.testing import FakeOpenAI

os.environ.pop("OPENAI_API_KEY", None)


@pytest.fixture(autouse=True)
def sdk_offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tracing on (as a user has it), with no processor: nothing is exported anywhere."""
    from agents import set_trace_processors, set_tracing_disabled

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_AGENTS_DISABLE_TRACING", raising=False)
    set_trace_processors([])
    set_tracing_disabled(False)
    yield
    set_trace_processors([])
    set_tracing_disabled(False)


@pytest.fixture
def instrumented() -> Iterator[Instrumented]:
    """Only this plugin on (the ``openai`` plugin off), fault counters at zero."""
    agl.uninstrument()
    guard.reset_fault_counts()
    result = agl.instrument(["openai_agents"])
    assert result == ["openai_agents"], result.skipped
    yield result
    agl.uninstrument()


@pytest.fixture
def both_plugins() -> Iterator[None]:
    """This plugin and agl's ``openai`` plugin, as ``agl.instrument()`` turns them on for a user."""
    agl.uninstrument()
    result = agl.instrument(["openai_agents", "openai"])
    assert sorted(result) == ["openai", "openai_agents"], result.skipped
    yield
    agl.uninstrument()


def _chat_model(srv: FakeOpenAI, name: str = "fake-model") -> Any:
    from agents import OpenAIChatCompletionsModel
    from openai import AsyncOpenAI

    return OpenAIChatCompletionsModel(name, AsyncOpenAI(base_url=srv.url, api_key="not-a-key", max_retries=0))


@pytest.fixture
def chat_model() -> Callable[..., Any]:
    """``chat_model(srv)``: an ``OpenAIChatCompletionsModel`` on the fake server (explicit key, none from the env)."""
    return _chat_model
