"""Agent identity in LangGraph: nodes, ``create_agent(name=...)``, ``create_react_agent(name=...)``, and
``agent_match`` keeping one agent's calls out of a multi-agent graph."""

from __future__ import annotations

import asyncio
from typing import Any, TypedDict

import openai
import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import create_react_agent
from opentelemetry import trace

import agl_core as agl
from agl_core import guard, semconv
from agl_core.instrumentation import Instrumented
from agl_core.testing import FakeOpenAI
from agl_langchain import attributes
from agl_langchain.instrumentor import Hooks

from .fakes import FakeChat, ai, script

pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


# --------------------------------------------------------------------------- the Spider-SQL shape


class SqlState(TypedDict):
    question: str
    query: str
    verdict: str
    rounds: int


def _sql_graph(llm: FakeChat) -> Any:
    """writer -> checker -> (rewriter -> checker)* -> end, each node one call of the same model."""

    def writer(state: SqlState) -> dict[str, Any]:
        return {"query": llm.invoke([HumanMessage(f"write SQL for: {state['question']}")]).content, "rounds": 0}

    def checker(state: SqlState) -> dict[str, Any]:
        return {"verdict": llm.invoke([HumanMessage(f"check: {state['query']}")]).content}

    def rewriter(state: SqlState) -> dict[str, Any]:
        answer = llm.invoke([HumanMessage(f"rewrite: {state['query']} ({state['verdict']})")])
        return {"query": answer.content, "rounds": state["rounds"] + 1}

    graph = StateGraph(SqlState)
    graph.add_node("writer", writer)
    graph.add_node("checker", checker)
    graph.add_node("rewriter", rewriter)
    graph.add_edge(START, "writer")
    graph.add_edge("writer", "checker")
    graph.add_conditional_edges("checker", lambda s: END if s["verdict"] == "ok" else "rewriter")
    graph.add_edge("rewriter", "checker")
    return graph.compile(name="sql_agent")  # named: the nodes are still the agents


def _sql_llm() -> FakeChat:
    return FakeChat(messages=script("SELECT nme FROM t", "bad column", "SELECT name FROM t", "ok"))


def _check_sql_run(run: agl.RolloutRun) -> None:
    every = run.trajectory()
    assert [t.agent_name for t in every.transitions] == ["writer", "checker", "rewriter", "checker"]
    writer = run.trajectory(builder=agl.TransitionBuilder(agent_match="^writer$"))  # a search: anchored
    assert [t.response["content"] for t in writer.transitions] == ["SELECT nme FROM t"]
    assert [s.reason for s in writer.skipped].count("agent 'checker' does not match agent_match '^writer$'") == 2
    both = run.trajectory(builder=agl.TransitionBuilder(agent_match="writer|rewriter"))
    assert [t.agent_name for t in both.transitions] == ["writer", "rewriter"]
    assert [t.index for t in both.transitions] == [0, 1] and both.reward == 1.0
    agents = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "invoke_agent"]
    assert [s.name for s in agents] == ["invoke_agent writer", "invoke_agent checker", "invoke_agent rewriter",
                                        "invoke_agent checker"]


def test_agent_match_keeps_only_the_writer_of_a_writer_checker_rewriter_graph(instrumented: Instrumented,
                                                                              hooks: Hooks) -> None:
    with agl.rollout("spider-1") as run:
        out = _sql_graph(_sql_llm()).invoke({"question": "names?"})
        agl.emit_reward(1.0 if out["query"] == "SELECT name FROM t" else 0.0)
    _check_sql_run(run)
    assert hooks.runs == {}


async def test_the_same_graph_run_async(instrumented: Instrumented, hooks: Hooks) -> None:
    async with agl.rollout("spider-1") as run:
        root = trace.get_current_span()
        out = await _sql_graph(_sql_llm()).ainvoke({"question": "names?"})
        assert trace.get_current_span() is root  # no agent span left current in the caller (async ends run elsewhere)
        agl.emit_reward(1.0 if out["query"] == "SELECT name FROM t" else 0.0)
    _check_sql_run(run)
    assert hooks.runs == {}


@pytest.mark.parametrize("mode", ["values", "messages"])
def test_the_same_graph_streamed(instrumented: Instrumented, hooks: Hooks, mode: str) -> None:
    with agl.rollout("spider-1") as run:
        parts = list(_sql_graph(_sql_llm()).stream({"question": "names?"}, stream_mode=mode))
        agl.emit_reward(1.0)
    assert parts
    _check_sql_run(run)
    assert hooks.runs == {}


# --------------------------------------------------------------------------- prebuilt agents


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def _tool_loop_model(answer: str) -> FakeChat:
    return FakeChat(messages=script(ai("", calls=[("add", {"a": 1, "b": 2}, "c1")]), ai(answer)))


@pytest.mark.parametrize("factory", ["create_agent", "create_react_agent"])
def test_a_named_prebuilt_agent_is_one_agent_its_steps_are_not(instrumented: Instrumented, factory: str) -> None:
    make = create_agent if factory == "create_agent" else create_react_agent
    agent = make(_tool_loop_model("3"), [add], name="calculator")
    with agl.rollout("t") as run:
        out = agent.invoke({"messages": [("user", "1+2?")]})
    assert out["messages"][-1].content == "3"
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["calculator", "calculator"]
    agents = [s.name for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "invoke_agent"]
    assert agents == ["invoke_agent calculator"]  # no "model", "agent" or "tools" scopes
    (tool_span,) = [s for s in run.rollout.spans if s.name == "execute_tool add"]
    assert tool_span.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "3"


def test_a_hand_built_tool_loop_keeps_its_node_names(instrumented: Instrumented) -> None:
    """A named graph with a ``tools`` node of its own is not mistaken for a prebuilt agent."""
    from langgraph.prebuilt import ToolNode, tools_condition

    llm = _tool_loop_model("3").bind_tools([add])

    def writer(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("writer", writer)
    graph.add_node("tools", ToolNode([add]))
    graph.add_edge(START, "writer")
    graph.add_conditional_edges("writer", tools_condition)
    graph.add_edge("tools", "writer")
    with agl.rollout("t") as run:
        graph.compile(name="pipeline").invoke({"messages": [("user", "1+2?")]})
    assert [t.agent_name for t in run.trajectory().transitions] == ["writer", "writer"]


@pytest.mark.parametrize("how", ["astream_events", "astream_messages", "astream_updates"])
async def test_a_prebuilt_agent_streamed_async(instrumented: Instrumented, hooks: Hooks, how: str) -> None:
    agent = create_agent(_tool_loop_model("3"), [add], name="calculator")
    request = {"messages": [("user", "1+2?")]}
    async with agl.rollout("t") as run:
        if how == "astream_events":
            kinds = {e["event"] async for e in agent.astream_events(request, version="v2")}
            assert {"on_chat_model_start", "on_tool_end"} <= kinds
        else:
            parts = [p async for p in agent.astream(request, stream_mode=how.split("_")[1])]  # type: ignore[arg-type]
            assert parts
    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=1.0)))
    assert [t.agent_name for t in traj.transitions] == ["calculator", "calculator"]
    assert [t.reward for t in traj.transitions] == [1.0, None]  # the tool call's outcome, on the call that asked
    assert hooks.runs == {}


def test_an_unnamed_create_agent_adds_no_scope_of_its_own(instrumented: Instrumented) -> None:
    agent = create_agent(_tool_loop_model("3"), [add])
    with agl.rollout("t") as run:
        agent.invoke({"messages": [("user", "1+2?")]})
    marked = ((agent.config or {}).get("metadata") or {}).get("ls_integration") == "langchain_create_agent"
    # a release of langchain that marks create_agent's graph: no scope; an older one: an unnamed graph's nodes
    assert [t.agent_name for t in run.trajectory().transitions] == ([None, None] if marked else ["model", "model"])


def _supervised(writer_factory: Any) -> Any:
    """A two-agent graph: a researcher then a writer, each a prebuilt agent used as a node."""
    researcher = create_agent(_tool_loop_model("facts: 3"), [add], name="researcher")
    writer = writer_factory(FakeChat(messages=script(ai("Report: 1+2 is 3."))), [], name="writer")
    graph = StateGraph(MessagesState)
    graph.add_node("research", researcher)
    graph.add_node(writer)  # the node takes the agent's name
    graph.add_edge(START, "research")
    graph.add_edge("research", "writer")
    graph.add_edge("writer", END)
    return graph.compile()


@pytest.mark.parametrize("factory", ["create_agent", "create_react_agent"])
async def test_agent_match_in_a_multi_agent_graph(instrumented: Instrumented, hooks: Hooks, factory: str) -> None:
    graph = _supervised(create_agent if factory == "create_agent" else create_react_agent)
    async with agl.rollout("t") as run:
        root = trace.get_current_span()
        out = await graph.ainvoke({"messages": [("user", "write about 1+2")]})
        assert trace.get_current_span() is root
    assert out["messages"][-1].content == "Report: 1+2 is 3."
    every = run.trajectory()
    assert [t.agent_name for t in every.transitions] == ["researcher", "researcher", "writer"]
    only = run.trajectory(builder=agl.TransitionBuilder(agent_match="writer"))
    assert [t.response["content"] for t in only.transitions] == ["Report: 1+2 is 3."]
    assert hooks.runs == {}


# --------------------------------------------------------------------------- the agent scope is current


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_node_calling_the_openai_client_directly_is_named_after_the_node(with_openai: Instrumented,
                                                                         mode: str) -> None:
    with FakeOpenAI(script=["draft", "fine", "next"]) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
        aclient = openai.AsyncOpenAI(base_url=srv.url, api_key="x", max_retries=0)

        def node(name: str) -> Any:
            def run(state: MessagesState) -> dict[str, Any]:
                reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": name}])
                return {"messages": [AIMessage(reply.choices[0].message.content or "")]}

            async def arun(state: MessagesState) -> dict[str, Any]:
                reply = await aclient.chat.completions.create(model="m", messages=[{"role": "user", "content": name}])
                return {"messages": [AIMessage(reply.choices[0].message.content or "")]}

            return run if mode == "sync" else arun

        graph = StateGraph(MessagesState)
        graph.add_node("writer", node("writer"))
        graph.add_node("checker", node("checker"))
        graph.add_edge(START, "writer")
        graph.add_edge("writer", "checker")
        graph.add_edge("checker", END)
        compiled = graph.compile()

        async def main() -> None:
            await compiled.ainvoke({"messages": [("user", "go")]})
            await aclient.chat.completions.create(model="m", messages=[{"role": "user", "content": "after"}])

        with agl.rollout("t") as run:
            if mode == "sync":
                compiled.invoke({"messages": [("user", "go")]})
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "after"}])
            else:
                asyncio.run(main())
    traj = run.trajectory(builder=agl.TransitionBuilder(agent_match="writer"))
    assert [t.response["content"] for t in traj.transitions] == ["draft"]
    # the call made after the graph belongs to no agent: no node's span was left current
    assert [t.agent_name for t in run.trajectory().transitions] == ["writer", "checker", None]


def test_a_fault_in_agl_around_a_node_leaves_the_graph_alone(instrumented: Instrumented, hooks: Hooks,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("agl bug")

    monkeypatch.setattr(attributes, "agent_attributes", broken)
    with agl.rollout("spider-1") as run:
        out = _sql_graph(_sql_llm()).invoke({"question": "names?"})
    assert out["query"] == "SELECT name FROM t"
    assert guard.fault_counts()["langchain.chain_start"] == 4
    assert len(run.trajectory().transitions) == 4  # the calls are still recorded
    assert hooks.runs == {}
