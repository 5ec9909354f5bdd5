"""Fail-open for the ``crewai`` plugin: no fault inside agl changes what a crew or flow returns or raises.

This extends ``test_robustness.py`` (whose fault list is written by hand): every agl
function the plugin's hooks call is found by introspection (``agl_crewai.attributes``,
the agl helpers it and the instrumentor import, ``collector.tracer``) and made to
raise in turn while a crew with a tool (sync and native async) and a flow whose
steps call the LLM and a standalone agent run against a fake server; a hook added
later is covered without editing this file. Each fault is logged once and counted.
Functions this workload cannot reach are listed in ``NOT_ON_PATH`` (and the test
checks they really are not reached).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from crewai.agent.core import Agent
from crewai.crew import Crew
from crewai.flow.flow import Flow, listen, start
from crewai.llm import LLM
from crewai.task import Task
from crewai.tools import tool
from crewai.tools.tool_failure import ToolFailure
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
from agl_crewai import attributes
from agl_crewai import instrumentor as plugin_instrumentor

FAULTS = hook_faults(attributes, plugin_instrumentor)
NOT_ON_PATH = {"agl_crewai.attributes.asked_tools_message"}  # LLM.call(available_functions=...) runs tools itself
CREW = [{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}},
                        {"name": "divide", "arguments": {"a": 1, "b": 0}},
                        {"name": "lookup", "arguments": {"name": "Ada"}}]}, "The answer is 42."]
SCRIPT = [*CREW, *CREW, "teal", "Teal sea at dusk."]


@tool("multiply")
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool("divide")
def divide(a: int, b: int) -> float:
    """Divide two numbers."""
    return a / b


@tool("lookup")
def lookup(name: str) -> Any:
    """Look up a person's phone number."""
    return ToolFailure(message=f"no entry for {name}", code="not_found")


def _llm(srv: FakeOpenAI) -> LLM:
    return LLM(model="gpt-4o", base_url=srv.url, api_key="x", max_retries=0)


def _crew(llm: LLM, question: str) -> Crew:
    agent = Agent(role="Calculator", goal="compute", backstory="b", llm=llm, tools=[multiply, divide, lookup])
    return Crew(agents=[agent], tasks=[Task(description=question, expected_output="a number", agent=agent)])


def agent(srv: FakeOpenAI, during: Callable[[], None] = lambda: None,
          after: Callable[[], None] = lambda: None) -> list[Any]:
    """A crew (sync, then native async) that calls a tool, and a flow whose steps call the LLM and an agent."""
    llm = _llm(srv)
    poet = Agent(role="Poet", goal="write short poems", backstory="Writes haiku.", llm=llm)

    class ColorPoem(Flow):  # type: ignore[type-arg]
        @start()
        def pick_color(self) -> str:
            return str(llm.call("Name one color."))

        @listen(pick_color)
        def write_poem(self, color: str) -> str:
            return str(poet.kickoff(f"Write a poem about {color}.").raw)

    out: list[Any] = []
    with agl.rollout("fail-open") as run:
        during()
        out.append(_crew(llm, f"What is 6*7? ({uuid.uuid4()})").kickoff().raw)
        out.append(asyncio.run(_crew(llm, "What is 6*7?").akickoff()).raw)
        out.append(ColorPoem().kickoff())
        after()
        agl.emit_reward(1.0)
    assert run.rollout.status == "succeeded"
    assert trace.get_current_span() is trace.INVALID_SPAN, "a span of ours was left current"
    out.append(run.trajectory().reward)
    return out


def failing_agent(srv: FakeOpenAI) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as caught:
        _llm(srv).call("hi")
    return type(caught.value), str(caught.value)


@pytest.fixture
def baseline(instrumented: Any) -> Iterator[tuple[list[Any], tuple[type[BaseException], str]]]:
    with FakeOpenAI(script=SCRIPT) as srv:
        good = agent(srv)
    with FakeOpenAI(status=400) as srv:
        bad = failing_agent(srv)
    guard.reset_fault_counts()
    yield good, bad
    guard.reset_fault_counts()


def test_the_introspection_finds_the_hooks() -> None:
    names = {fault_id(f) for f in FAULTS}
    assert "agl_core.collector.tracer" in names and "agl_crewai.instrumentor.set_on" in names
    assert len([n for n in names if n.startswith("agl_crewai.attributes.")]) >= 10, sorted(names)


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
            with FakeOpenAI(status=400) as failing:
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
