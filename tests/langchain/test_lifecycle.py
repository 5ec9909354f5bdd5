"""Switching the plugin on and off, a user's own TracerProvider, and no state left behind after many calls."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.callbacks import CallbackManager
from langchain_core.callbacks.manager import AsyncCallbackManagerForChainRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.tools import tool
from langchain_core.tracers import context as lc_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl_core as agl
from agl_core import collector, semconv
from agl_core.instrumentation import Instrumented
from agl_langchain import LangChainInstrumentor
from agl_langchain.instrumentor import Hooks, _Run

from .fakes import FakeChat, ai, script

PATCHED = ("_generate_with_cache", "_agenerate_with_cache", "stream", "astream", "_iter_v2_events",
           "_aiter_v2_events")


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def _ours(manager: Any) -> list[Any]:
    return [h for h in manager.handlers if isinstance(h, Hooks)]


def test_uninstrument_leaves_langchain_exactly_as_before() -> None:
    agl.uninstrument()
    before = {name: BaseChatModel.__dict__.get(name) for name in PATCHED}
    ends = {name: AsyncCallbackManagerForChainRun.__dict__[name] for name in ("on_chain_end", "on_chain_error")}
    hooks_before = list(lc_context._configure_hooks)
    assert _ours(CallbackManager.configure()) == []

    assert agl.instrument(["langchain"]) == ["langchain"]
    assert all(BaseChatModel.__dict__.get(n) is not before[n] for n in PATCHED if before[n] is not None)
    assert len(lc_context._configure_hooks) == len(hooks_before) + 1
    assert len(_ours(CallbackManager.configure())) == 1

    agl.uninstrument()
    assert all(BaseChatModel.__dict__.get(n) is before[n] for n in PATCHED)
    assert all(AsyncCallbackManagerForChainRun.__dict__[n] is ends[n] for n in ends)
    assert lc_context._configure_hooks == hooks_before
    assert _ours(CallbackManager.configure()) == []
    with agl.rollout("t") as run:
        FakeChat(messages=script("r1")).invoke("q")
        assert "".join(str(c.content) for c in FakeChat(messages=script("r2")).stream("q")) == "r2"
        add.invoke({"a": 1, "b": 2})
    assert [s.name for s in run.rollout.spans] == ["agl.rollout t"]


def test_instrument_again_after_uninstrument(instrumented: Instrumented) -> None:
    agl.uninstrument()
    assert agl.instrument(["langchain"]) == ["langchain"]
    assert len(_ours(CallbackManager.configure())) == 1  # one handler, never two
    with agl.rollout("t") as run:
        FakeChat(messages=script("r1")).invoke("q")
    assert len(run.trajectory().transitions) == 1


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """A user's own SDK provider, with an exporter: agl's spans go there too."""
    agl.uninstrument()
    provider = TracerProvider()
    exp = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    assert agl.instrument(["langchain"], tracer_provider=provider) == ["langchain"]
    try:
        yield exp
    finally:
        agl.uninstrument()
        collector.use_provider(None)


def test_a_users_tracer_provider_gets_the_same_spans(exporter: InMemorySpanExporter) -> None:
    model = FakeChat(messages=script(ai("", calls=[("add", {"a": 1, "b": 2}, "c1")]), ai("3")))
    with agl.rollout("t") as run:
        create_agent(model, [add], name="calc").invoke({"messages": [("user", "1+2?")]})
    exported = {s.name: s for s in exporter.get_finished_spans()}
    assert {"invoke_agent calc", "chat fake-chat", "execute_tool add"} <= set(exported)
    agent = exported["invoke_agent calc"]
    tool_span = exported["execute_tool add"]
    assert tool_span.parent is not None and tool_span.parent.span_id == agent.context.span_id
    assert (tool_span.attributes or {})[semconv.AGL_TOOL_STATUS] == "ok"
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["calc", "calc"]
    assert traj.transitions[1].prompt[-1] == {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "3"}


# --------------------------------------------------------------------------- nothing left behind


CALLS = 10_000
PER_ROLLOUT = 500


def _chat_and_tool(model: FakeChat, i: int) -> None:
    message = model.invoke(f"add {i} and 1")
    add.invoke(message.tool_calls[0])


async def _achat_and_tool(model: FakeChat, i: int) -> None:
    message = await model.ainvoke(f"add {i} and 1")
    await add.ainvoke(message.tool_calls[0])


def test_ten_thousand_calls_leave_the_maps_empty(hooks: Hooks) -> None:
    reply = ai("", calls=[("add", {"a": 1, "b": 2}, "c1")])
    model = FakeChat(messages=iter(lambda: reply, None)).bind_tools([add])  # the same answer forever
    peak = 0

    async def async_half(start: int) -> None:
        nonlocal peak
        for first in range(start, CALLS, PER_ROLLOUT):
            async with agl.rollout("t") as run:
                for i in range(first, first + PER_ROLLOUT):
                    await _achat_and_tool(model, i)  # type: ignore[arg-type]
                    peak = max(peak, len(hooks.runs))
            assert len(run.trajectory().transitions) == PER_ROLLOUT

    for first in range(0, CALLS // 2, PER_ROLLOUT):
        with agl.rollout("t") as run:
            for i in range(first, first + PER_ROLLOUT):
                _chat_and_tool(model, i)  # type: ignore[arg-type]
                peak = max(peak, len(hooks.runs))
        assert len(run.trajectory().transitions) == PER_ROLLOUT
    asyncio.run(async_half(CALLS // 2))

    assert hooks.runs == {} and peak == 0  # between calls nothing is in flight
    assert trace.get_current_span() is trace.INVALID_SPAN
    gc.collect()
    assert not any(isinstance(o, _Run) for o in gc.get_objects())  # no run kept alive by a stale context
    assert LangChainInstrumentor().handler is hooks
