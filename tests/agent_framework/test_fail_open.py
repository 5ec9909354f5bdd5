"""Fail-open for the ``agent_framework`` plugin: no fault inside agl changes what an Agent Framework agent returns.

Every agl function the plugin's hooks call is found by introspection
(``agl_agent_framework.attributes``, the agl helpers it and the instrumentor
import, ``collector.tracer``) and made to raise in turn while an ``Agent`` with
tools (one of which raises) runs, awaited and streamed, with structured output,
against a fake server; a hook added later is covered without editing this file.
Each fault is logged once and counted. Functions this agent cannot reach are
listed in ``NOT_ON_PATH`` (and the test checks they really are not reached).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from agent_framework import Agent, tool
from agent_framework.openai import OpenAIChatCompletionClient
from openai import AsyncOpenAI
from opentelemetry import trace
from pydantic import BaseModel

import agl_core as agl
from agl_agent_framework import attributes
from agl_agent_framework import instrumentor as plugin_instrumentor
from agl_core import collector, guard
from agl_core.testing import FakeOpenAI
from agl_core.testing.faults import (
    PROVIDER_FAULTS,
    check_misbehaving_provider,
    check_reported,
    fault_id,
    hook_faults,
    inject,
)

FAULTS = hook_faults(attributes, plugin_instrumentor)
NOT_ON_PATH = {
    "agl_agent_framework.attributes._asks_for_tools",  # a response without a finish reason
    "agl_agent_framework.attributes.tool_definitions",  # per list of tools, cached before the faulted run
}
ROUND = [{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}, "id": "c1"},
                         {"name": "divide", "arguments": {"a": 1, "b": 0}, "id": "c2"}]},
         "6 * 7 = 42, and 1 / 0 has no answer."]
STRUCTURED = '{"value": 42}'
SCRIPT = [*ROUND, *ROUND, STRUCTURED]


class Number(BaseModel):
    value: int


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def divide(a: int, b: int) -> float:
    """Divide two numbers."""
    return a / b


def _agent(srv: FakeOpenAI) -> Agent:
    # no retries: the openai client's back-off on the 500 of failing_agent would cost seconds per test
    client = OpenAIChatCompletionClient(model="fake-model",
                                        async_client=AsyncOpenAI(base_url=srv.url, api_key="x", max_retries=0))
    return Agent(client=client, name="math", instructions="Use the tools.", tools=[multiply, divide])


def agent(srv: FakeOpenAI, during: Callable[[], None] = lambda: None,
          after: Callable[[], None] = lambda: None) -> list[Any]:
    """An awaited and a streamed run, each calling a tool that works and one that raises; then structured output."""
    out: list[Any] = []

    async def go() -> None:
        result = await _agent(srv).run(f"What is 6 * 7 and 1 / 0? ({uuid.uuid4()})")
        out.append([(str(m.role), m.text) for m in result.messages])
        stream = _agent(srv).run("What is 6 * 7 and 1 / 0?", stream=True)
        out.append([u.text async for u in stream])
        out.append((await stream.get_final_response()).text)
        structured = await _agent(srv).run("A number?", options={"response_format": Number})
        out.append(structured.value)

    with agl.rollout("fail-open") as run:
        during()
        asyncio.run(go())
        after()
        agl.emit_reward(1.0)
    assert run.rollout.status == "succeeded"
    assert trace.get_current_span() is trace.INVALID_SPAN, "a span of ours was left current"
    out.append(run.trajectory().reward)
    return out


def failing_agent(srv: FakeOpenAI) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as caught:
        asyncio.run(_agent(srv).run("q"))
    return type(caught.value), str(caught.value)


@pytest.fixture
def baseline(instrumented: Any) -> Iterator[tuple[list[Any], tuple[type[BaseException], str]]]:
    with FakeOpenAI(script=SCRIPT) as srv:
        good = agent(srv)
    with FakeOpenAI(status=500) as srv:
        bad = failing_agent(srv)
    guard.reset_fault_counts()
    yield good, bad
    guard.reset_fault_counts()


def test_the_introspection_finds_the_hooks() -> None:
    names = {fault_id(f) for f in FAULTS}
    assert "agl_core.collector.tracer" in names and "agl_agent_framework.instrumentor.set_on" in names
    assert len([n for n in names if n.startswith("agl_agent_framework.attributes.")]) >= 10, sorted(names)


@pytest.mark.parametrize("fault", FAULTS, ids=fault_id)
def test_a_fault_in_any_hook_function_never_changes_what_the_agent_gets(
        baseline: tuple[list[Any], tuple[type[BaseException], str]], fault: tuple[Any, str],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    good, bad = baseline
    hits: list[int] = []
    arm = inject(monkeypatch, fault, hits)
    caplog.set_level(logging.WARNING, logger="agl")
    with FakeOpenAI(script=SCRIPT) as srv:
        if fault[0] is collector:  # agl.rollout() and emit_reward need the tracer too: fault only the hooks
            got = agent(srv, during=arm, after=monkeypatch.undo)
        else:
            arm()
            got = agent(srv)
            with FakeOpenAI(status=500) as failing:
                assert failing_agent(failing) == bad  # the agent's own error passes through unchanged
    monkeypatch.undo()
    assert got == good
    if fault_id(fault) in NOT_ON_PATH:
        assert not hits, f"{fault_id(fault)} is reached now: take it out of NOT_ON_PATH"
        return
    assert hits, f"the agent never reached {fault_id(fault)}: list it in NOT_ON_PATH or reach it"
    check_reported(caplog)


@pytest.mark.parametrize("fault", PROVIDER_FAULTS)
def test_a_misbehaving_user_provider_never_reaches_the_agent(baseline: Any, fault: str) -> None:
    """With a user SDK provider whose processor raises (before agl's, so the SDK stops its chain there) or
    whose exporter raises or never answers: the agent gets the same, and agl's rollout is as complete."""
    check_misbehaving_provider(fault, agent, SCRIPT, baseline[0])
