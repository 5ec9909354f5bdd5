"""Fail-open for the ``langchain`` plugin: no fault inside agl changes what a LangChain agent returns or raises.

Every agl function the plugin's callback handler calls is found by introspection
(``agl_langchain.attributes``, the agl helpers it and the instrumentor import,
``collector.tracer``) and made to raise in turn while a ``ChatOpenAI`` model and a
``create_agent`` tool agent run sync, streamed and async against a fake server;
a hook added later is covered without editing this file. Each fault is logged
once and counted. Functions that this agent cannot reach are listed in
``NOT_ON_PATH`` (and the test checks they really are not reached).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from opentelemetry import trace

import agl_core as agl
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
from agl_langchain import attributes
from agl_langchain import instrumentor as plugin_instrumentor

FAULTS = hook_faults(attributes, plugin_instrumentor)
NOT_ON_PATH = {
    "agl_langchain.attributes._make_spaced", "_Memo.__init__",  # run once, at import
    "agl_langchain.attributes.input_messages",  # the reference the memoised JSON is tested against; no hook calls it
    "agl_langchain.attributes._param_default",  # JSON fallback for invocation parameters JSON cannot hold
}

SCRIPT = ["a1", "s1", {"tool_calls": [{"name": "lookup", "arguments": {"city": "Paris"}}]}, "It is sunny.", "async"]


@tool
def lookup(city: str) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


@tool
def broken(city: str) -> str:
    """A tool that raises."""
    raise ValueError(f"no weather for {city}")


def _llm(srv: FakeOpenAI) -> ChatOpenAI:
    return ChatOpenAI(model="policy", base_url=srv.url, api_key="x", max_retries=0,  # type: ignore[arg-type]
                      extra_body={"return_token_ids": True})


def agent(srv: FakeOpenAI, during: Callable[[], None] = lambda: None,
          after: Callable[[], None] = lambda: None) -> list[Any]:
    """A plain call (a message new to agl's memo), a stream, a tool-calling agent and an async call."""
    llm = _llm(srv)
    out: list[Any] = []
    with agl.rollout("fail-open") as run:
        during()
        out.append(llm.invoke([HumanMessage(f"fresh {uuid.uuid4()}")]).content)
        out.append("".join(str(c.content) for c in llm.stream("q")))
        result = create_agent(llm, [lookup], name="weather").invoke({"messages": [HumanMessage("weather in Paris?")]})
        out.append([(type(m).__name__, m.content) for m in result["messages"]])
        out.append(asyncio.run(llm.ainvoke("q")).content)
        with pytest.raises(ValueError) as caught:  # the tool's own exception reaches the caller unchanged
            broken.invoke({"city": "Atlantis"})
        out.append(repr(caught.value))
        after()
        agl.emit_reward(1.0)
    assert run.rollout.status == "succeeded"
    assert trace.get_current_span() is trace.INVALID_SPAN, "a span of ours was left current"
    out.append(run.trajectory().reward)
    return out


def failing_agent(srv: FakeOpenAI) -> tuple[type[BaseException], str]:
    with pytest.raises(openai.APIStatusError) as caught:
        _llm(srv).invoke("q")
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
    assert "agl_core.collector.tracer" in names and "agl_langchain.instrumentor.set_on" in names
    assert len([n for n in names if n.startswith("agl_langchain.attributes.")]) >= 10, sorted(names)


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


# --------------------------------------------------------------------------- the user's provider misbehaves


@pytest.mark.parametrize("fault", PROVIDER_FAULTS)
def test_a_misbehaving_user_provider_never_reaches_the_agent(baseline: Any, fault: str) -> None:
    """With a user SDK provider whose processor raises (before agl's, so the SDK stops its chain there) or
    whose exporter raises or never answers: the agent gets the same, and agl's rollout is as complete."""
    good = baseline[0] if isinstance(baseline, tuple) else baseline
    check_misbehaving_provider(fault, agent, SCRIPT_FOR_PROVIDER, good)


SCRIPT_FOR_PROVIDER = SCRIPT
