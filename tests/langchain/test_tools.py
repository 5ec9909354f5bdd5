"""Tool runs: one ``execute_tool`` span each, with the outcome AIR rules read (ok, error, exception, timeout)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import InjectedToolCallId, ToolException, tool
from langgraph.prebuilt import ToolNode, create_react_agent

import agl_core as agl
from agl_core import guard, semconv
from agl_core.instrumentation import Instrumented
from agl_core.schema import Span
from agl_langchain import attributes
from agl_langchain.instrumentor import Hooks

from .fakes import FakeChat, ai, script

pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool
def explode(reason: str) -> str:
    """Always raises."""
    raise ValueError(f"exploded: {reason}")


@tool
def strict(x: int) -> str:
    """Refuses negative numbers, as a tool error the model sees."""
    if x < 0:
        raise ToolException("x must be >= 0")
    return "fine"


strict.handle_tool_error = True  # ToolException becomes a result with status="error" (what the model sees)


@tool
def lookup(key: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> ToolMessage:
    """Reports a missing key as an error result of its own."""
    return ToolMessage(f"no such key: {key}", tool_call_id=tool_call_id, status="error")


@tool
def slow(seconds: int) -> str:
    """Times out."""
    raise TimeoutError(f"gave up after {seconds}s")


def _tool_spans(spans: list[Span]) -> dict[str, Span]:
    return {str(s.attributes[semconv.GEN_AI_TOOL_NAME]): s for s in spans
            if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL}


CALLS = [("add", {"a": 2, "b": 3}, "c-add"), ("explode", {"reason": "boom"}, "c-explode"),
         ("strict", {"x": -1}, "c-strict"), ("lookup", {"key": "k"}, "c-lookup"), ("slow", {"seconds": 5}, "c-slow")]
AIR = agl.AirRules(tool_ok=0.1, tool_error=-0.5, tool_exception=-1.0, tool_timeout=-2.0)


def _agent() -> Any:
    model = FakeChat(messages=script(ai("", calls=CALLS), ai("done")))
    return create_react_agent(model, ToolNode([add, explode, strict, lookup, slow], handle_tool_errors=True))


def _check_outcomes(spans: list[Span]) -> None:
    tools = _tool_spans(spans)
    assert sorted(tools) == ["add", "explode", "lookup", "slow", "strict"]
    expect = {"add": ("ok", "5"), "explode": ("exception", None), "strict": ("error", "x must be >= 0"),
              "lookup": ("error", "no such key: k"), "slow": ("timeout", None)}
    for name, (status, result) in expect.items():
        a = tools[name].attributes
        assert a[semconv.AGL_TOOL_STATUS] == status, name
        assert a.get(semconv.GEN_AI_TOOL_CALL_RESULT) == result, name
        # a tool that raised has its call id only where LangChain reports it with the start (langchain-core 1.1+)
        assert a.get(semconv.GEN_AI_TOOL_CALL_ID) in ((f"c-{name}",) if result else (f"c-{name}", None))
        assert tools[name].status == ("unset" if status == "ok" else "error"), name
    assert json.loads(tools["add"].attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    assert tools["explode"].attributes[semconv.ERROR_TYPE] == "ValueError"
    assert tools["slow"].attributes[semconv.ERROR_TYPE] == "TimeoutError"
    assert tools["lookup"].attributes[semconv.ERROR_TYPE] == "tool_error"


def test_tool_outcomes_in_an_agent_become_air_rewards(instrumented: Instrumented, hooks: Hooks) -> None:
    with agl.rollout("t") as run:
        out = _agent().invoke({"messages": [("user", "go")]})
    assert out["messages"][-1].content == "done"
    _check_outcomes(run.rollout.spans)
    first, second = run.trajectory(builder=agl.TransitionBuilder(air=AIR)).transitions
    assert first.reward == pytest.approx(0.1 - 1.0 - 0.5 - 0.5 - 2.0) and second.reward is None
    assert hooks.runs == {}


async def test_async_tool_outcomes(instrumented: Instrumented, hooks: Hooks) -> None:
    async with agl.rollout("t") as run:
        out = await _agent().ainvoke({"messages": [("user", "go")]})
    assert out["messages"][-1].content == "done"
    _check_outcomes(run.rollout.spans)
    assert hooks.runs == {}


def test_tool_spans_nest_in_the_agent_and_calls_nest_in_a_tool(instrumented: Instrumented) -> None:
    @tool
    def ask_expert(question: str) -> str:
        """A tool that asks another model."""
        return str(FakeChat(messages=script("42")).invoke(question).content)

    model = FakeChat(messages=script(ai("", calls=[("ask_expert", {"question": "meaning?"}, "c1")]), ai("42 it is")))
    with agl.rollout("t") as run:
        create_react_agent(model, [ask_expert], name="lead").invoke({"messages": [("user", "go")]})
    spans = {s.span_id: s for s in run.rollout.spans}
    tool_span = _tool_spans(run.rollout.spans)["ask_expert"]
    inner = [s for s in spans.values() if s.attributes.get(semconv.GEN_AI_INPUT_MESSAGES, "").count("meaning?")
             and s.parent_id == tool_span.span_id]
    assert len(inner) == 1  # the expert's call is a child of the tool call that made it
    assert spans[str(tool_span.parent_id)].attributes[semconv.GEN_AI_AGENT_NAME] == "lead"
    agents = [t.agent_name for t in run.trajectory().transitions]
    assert agents == ["lead", "lead", "lead"]


def test_tools_called_directly(instrumented: Instrumented, hooks: Hooks) -> None:
    with agl.rollout("t") as run:
        assert add.invoke({"a": 1, "b": 1}) == 2
        message = add.invoke({"name": "add", "args": {"a": 1, "b": 2}, "id": "c7", "type": "tool_call"})
        assert isinstance(message, ToolMessage) and message.content == "3"
        with pytest.raises(ValueError, match="exploded"):
            explode.invoke({"reason": "x"})
    spans = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [(s.attributes.get(semconv.GEN_AI_TOOL_CALL_ID), s.attributes[semconv.AGL_TOOL_STATUS]) for s in spans] == [
        (None, "ok"), ("c7", "ok"), (None, "exception")]
    assert spans[0].name == "execute_tool add" and spans[0].attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "2"
    assert hooks.runs == {}


async def test_async_tool_called_directly(instrumented: Instrumented) -> None:
    async with agl.rollout("t") as run:
        assert await add.ainvoke({"a": 1, "b": 1}) == 2
        assert (await strict.ainvoke({"x": -5})) == "x must be >= 0"
    (ok, error) = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert ok.attributes[semconv.AGL_TOOL_STATUS] == "ok" and error.attributes[semconv.AGL_TOOL_STATUS] == "ok"
    # without a tool call id the handled error is a plain string result: nothing marks it as an error


def test_a_fault_in_agl_around_a_tool_leaves_the_tool_alone(instrumented: Instrumented, hooks: Hooks,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("agl bug")

    monkeypatch.setattr(attributes, "tool_end_attributes", broken)
    with agl.rollout("t") as run:
        assert add.invoke({"a": 2, "b": 2}) == 4
    assert guard.fault_counts()["langchain.tool_end"] == 1
    assert len(_tool_spans(run.rollout.spans)) == 1  # the span still ended
    monkeypatch.setattr(attributes, "tool_start_attributes", broken)
    with agl.rollout("t") as run:
        assert add.invoke({"a": 2, "b": 3}) == 5
    assert guard.fault_counts()["langchain.tool_start"] == 1 and _tool_spans(run.rollout.spans) == {}
    assert hooks.runs == {}
