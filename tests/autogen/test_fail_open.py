"""Fail-open for the ``autogen`` plugin: no fault inside agl changes what an AutoGen agent returns or raises.

Every agl function the plugin's hooks call is found by introspection
(``agl_autogen.attributes``, the agl helpers it and the instrumentor import,
``collector.tracer``) and made to raise in turn while an ``AssistantAgent`` with
tools (one of which raises) runs, plain and streamed, against a fake server; a
hook added later is covered without editing this file. Each fault is logged once
and counted. Functions this agent cannot reach are listed in ``NOT_ON_PATH`` (and
the test checks they really are not reached).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient
from opentelemetry import trace

import agl_core as agl
from agl_autogen import attributes
from agl_autogen import instrumentor as plugin_instrumentor
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
NOT_ON_PATH = {"agl_autogen.attributes._provider"}  # per client class, cached before the faulted run
INFO = ModelInfo(vision=False, function_calling=True, json_output=False, family=ModelFamily.UNKNOWN,
                 structured_output=False)
ROUND = [{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}, "id": "c1"},
                         {"name": "divide", "arguments": {"a": 1, "b": 0}, "id": "c2"}]},
         "6 * 7 = 42, and 1 / 0 has no answer."]


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def divide(a: int, b: int) -> float:
    """Divide two numbers."""
    return a / b


def _agent(srv: FakeOpenAI, stream: bool) -> AssistantAgent:
    client = OpenAIChatCompletionClient(model="fake-model", base_url=srv.url, api_key="x", max_retries=0,
                                        model_info=INFO, extra_body={"return_token_ids": True})
    return AssistantAgent("math", model_client=client, tools=[multiply, divide], reflect_on_tool_use=True,
                          system_message="Use the tools.", model_client_stream=stream)


def agent(srv: FakeOpenAI, during: Callable[[], None] = lambda: None,
          after: Callable[[], None] = lambda: None) -> list[Any]:
    """A plain and a streamed run, each calling a tool that works and one that raises."""
    out: list[Any] = []

    async def go() -> None:
        result = await _agent(srv, False).run(task=f"What is 6 * 7 and 1 / 0? ({uuid.uuid4()})")
        out.append([(type(m).__name__, m.to_text()) for m in result.messages[1:]])
        events = [e async for e in _agent(srv, True).run_stream(task="What is 6 * 7 and 1 / 0?")]
        out.append([(type(m).__name__, m.to_text()) for m in events[-1].messages[1:]])

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
        asyncio.run(_agent(srv, False).run(task="q"))
    return type(caught.value), str(caught.value)


@pytest.fixture
def baseline(instrumented: Any) -> Iterator[tuple[list[Any], tuple[type[BaseException], str]]]:
    with FakeOpenAI(script=[*ROUND, *ROUND]) as srv:
        good = agent(srv)
    with FakeOpenAI(status=500) as srv:
        bad = failing_agent(srv)
    guard.reset_fault_counts()
    yield good, bad
    guard.reset_fault_counts()


def test_the_introspection_finds_the_hooks() -> None:
    names = {fault_id(f) for f in FAULTS}
    assert "agl_core.collector.tracer" in names and "agl_autogen.instrumentor.set_on" in names
    assert len([n for n in names if n.startswith("agl_autogen.attributes.")]) >= 10, sorted(names)


@pytest.mark.parametrize("fault", FAULTS, ids=fault_id)
def test_a_fault_in_any_hook_function_never_changes_what_the_agent_gets(
        baseline: tuple[list[Any], tuple[type[BaseException], str]], fault: tuple[Any, str],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    good, bad = baseline
    hits: list[int] = []
    arm = inject(monkeypatch, fault, hits)
    caplog.set_level(logging.WARNING, logger="agl")
    with FakeOpenAI(script=[*ROUND, *ROUND]) as srv:
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


# --------------------------------------------------------------------------- the user's provider misbehaves


@pytest.mark.parametrize("fault", PROVIDER_FAULTS)
def test_a_misbehaving_user_provider_never_reaches_the_agent(baseline: Any, fault: str) -> None:
    """With a user SDK provider whose processor raises (before agl's, so the SDK stops its chain there) or
    whose exporter raises or never answers: the agent gets the same, and agl's rollout is as complete."""
    good = baseline[0] if isinstance(baseline, tuple) else baseline
    check_misbehaving_provider(fault, agent, SCRIPT_FOR_PROVIDER, good)


SCRIPT_FOR_PROVIDER = [*ROUND, *ROUND]
