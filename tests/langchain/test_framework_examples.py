"""LangGraph's and its libraries' own example programs, unchanged but for the model, against the fake model server.

langgraph-swarm's README swarm (``create_swarm``: a graph whose entry is a
conditional edge, run twice on one thread with a checkpointer). Checked: every
request is one transition with the right agent, and LangGraph's internal nodes
(``__start__``) are never agents.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
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
