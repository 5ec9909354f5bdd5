"""LangGraph's and its libraries' own example programs, unchanged but for the model, against the fake model server.

langgraph-swarm's README swarm (``create_swarm``: a graph whose entry is a
conditional edge, run twice on one thread with a checkpointer). Checked: every
request is one transition with the right agent, and LangGraph's internal nodes
(``__start__``) are never agents.

LangGraph's documented approval step (``interrupt()`` inside a tool, an agent
with a checkpointer, resumed with ``Command(resume=...)``). Checked: the
interrupt is a pause (``tool_pause``), not a tool exception, and the resumed
run's ``execute_tool`` span of the same call id is the call's one outcome.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt
from langgraph_swarm import create_handoff_tool, create_swarm

import agl_core as agl
from agl_core import semconv
from agl_core.instrumentation import Instrumented
from agl_core.testing import FakeOpenAI
from agl_langchain import LangChainInstrumentor
from agl_langchain.instrumentor import Hooks


def handler() -> Hooks:
    hooks = LangChainInstrumentor().handler
    assert hooks is not None
    return hooks


def agent_span_names(run: agl.RolloutRun) -> list[str]:
    return [s.name for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "invoke_agent"]


# --------------------------------------------------------------------------- langgraph-swarm's README


def add(a: int, b: int) -> int:
    """Add two numbers"""
    return a + b


def _readme_swarm(base_url: str) -> Any:
    model = ChatOpenAI(model="gpt-4o", base_url=base_url, api_key="not-a-key", max_retries=0)  # type: ignore[arg-type]
    alice = create_agent(
        model,
        tools=[add, create_handoff_tool(agent_name="Bob", description="Transfer to Bob")],
        system_prompt="You are Alice, an addition expert.",
        name="Alice",
    )
    bob = create_agent(
        model,
        tools=[create_handoff_tool(agent_name="Alice", description="Transfer to Alice, she can help with math")],
        system_prompt="You are Bob, you speak like a pirate.",
        name="Bob",
    )
    return create_swarm([alice, bob], default_active_agent="Alice").compile(checkpointer=InMemorySaver())


SWARM_SCRIPT: list[Any] = [
    {"tool_calls": [{"name": "transfer_to_bob", "arguments": {}}]},  # turn 1: Alice hands off
    "Ahoy, Bob here!",
    {"tool_calls": [{"name": "transfer_to_alice", "arguments": {}}]},  # turn 2: Bob (now active) hands back
    {"tool_calls": [{"name": "add", "arguments": {"a": 5, "b": 7}}]},
    "5 + 7 is 12.",
]


@pytest.mark.parametrize("how", ["invoke", "stream"])
def test_the_readme_swarm_has_its_two_agents_and_no_start_node(with_openai: Instrumented, how: str) -> None:
    config = {"configurable": {"thread_id": "1"}}
    with FakeOpenAI(SWARM_SCRIPT, return_token_ids=True) as model_server, agl.rollout("swarm") as run:
        app = _readme_swarm(model_server.url)
        for text in ("i'd like to speak to Bob", "what's 5 + 7?"):
            request = {"messages": [{"role": "user", "content": text}]}
            if how == "invoke":
                out = app.invoke(request, config)
            else:
                *_, out = app.stream(request, config, stream_mode="values")
    assert out["messages"][-1].content == "5 + 7 is 12."
    assert len(model_server.requests) == 5
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["Alice", "Bob", "Bob", "Alice", "Alice"]
    assert all(t.token_source == "response" for t in traj.transitions)
    names = agent_span_names(run)
    assert not [n for n in names if "__" in n], names  # __start__ is LangGraph's, never an agent
    assert names == ["invoke_agent Alice", "invoke_agent Bob", "invoke_agent Bob", "invoke_agent Alice"]
    assert handler().runs == {}


# --------------------------------------------------------------------------- interrupt() inside a tool


@tool
def book_hotel(hotel_name: str) -> str:
    """Book a hotel"""
    response = interrupt(
        f"Trying to call `book_hotel` with args {{'hotel_name': {hotel_name}}}. "
        "Please approve or suggest edits."
    )
    if response["type"] == "accept":
        pass
    elif response["type"] == "edit":
        hotel_name = response["args"]["hotel_name"]
    else:
        raise ValueError(f"Unknown response type: {response['type']}")
    return f"Successfully booked a stay at {hotel_name}."


BOOKING_SCRIPT: list[Any] = [
    {"tool_calls": [{"name": "book_hotel", "arguments": {"hotel_name": "McKittrick Hotel"}, "id": "call_book"}]},
    "Booked the McKittrick Hotel.",
]


@pytest.mark.parametrize("how", ["stream", "invoke"])
def test_an_interrupt_inside_a_tool_is_a_pause_and_the_resumed_run_is_the_outcome(with_openai: Instrumented,
                                                                                how: str) -> None:
    config = {"configurable": {"thread_id": "1"}}
    with FakeOpenAI(BOOKING_SCRIPT, return_token_ids=True) as model_server, agl.rollout("booking") as run:
        model = ChatOpenAI(model="gpt-4o", base_url=model_server.url, api_key="not-a-key",  # type: ignore[arg-type]
                           max_retries=0)
        agent = create_agent(model, tools=[book_hotel], checkpointer=InMemorySaver())
        request = {"messages": [{"role": "user", "content": "book a stay at McKittrick hotel"}]}
        for step in (request, Command(resume={"type": "accept"})):
            if how == "stream":
                for _ in agent.stream(step, config):
                    pass
            else:
                agent.invoke(step, config)
        assert agent.get_state(config).values["messages"][-1].content == "Booked the McKittrick Hotel."
    assert len(model_server.requests) == 2

    (pause,) = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "tool_pause"]
    assert pause.name == "tool_pause book_hotel" and pause.status != "error"
    assert pause.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_PENDING
    # langchain-core 1.0 (the legacy suite) tells a tool run's start nothing of its call id; later releases do
    told = "tool_call_id=tool_call_id" in inspect.getsource(BaseTool.run)
    assert pause.attributes.get(semconv.GEN_AI_TOOL_CALL_ID) == ("call_book" if told else None)
    assert semconv.ERROR_TYPE not in pause.attributes
    (done,) = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert done.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "call_book"
    assert done.attributes[semconv.AGL_TOOL_STATUS] == semconv.TOOL_OK
    assert done.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "Successfully booked a stay at McKittrick Hotel."

    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=0.1, tool_exception=-1.0)))
    assert [t.reward for t in traj.transitions] == [0.1, None]  # approved and successful: not a tool exception
    assert handler().runs == {}
