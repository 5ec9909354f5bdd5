"""The ``agent_framework`` plugin on multi-agent workflows: a handoff between two agents, a group chat, a sequence.

The real ``agent-framework-orchestrations`` builders run real ``Agent``s against
one fake server; each model call is named after the agent that made it, so
``agent_match`` trains one agent of the workflow and skips the others, and a
handoff is a tool call with an outcome like any other.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from agent_framework import Agent, tool
from agent_framework.openai import OpenAIChatCompletionClient
from agent_framework_orchestrations import GroupChatBuilder, HandoffBuilder, SequentialBuilder

import agl_core as agl
from agl_core import semconv
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI

ORDERS = {"A-17": "shipped on Monday", "B-4": "waiting for stock"}


@tool
def order_status(order_id: str) -> str:
    """The status of an order."""
    if order_id not in ORDERS:
        raise KeyError(f"no order {order_id}")
    return ORDERS[order_id]


def chat_client(srv: FakeOpenAI) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(model="fake-model", base_url=srv.url, api_key="x")


def tool_spans(run: agl.RolloutRun) -> list[Span]:
    return sorted((s for s in run.rollout.spans
                   if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == semconv.OP_EXECUTE_TOOL),
                  key=lambda s: s.start_ns)


def handoff_workflow(srv: FakeOpenAI) -> Any:
    triage = Agent(client=chat_client(srv), name="triage", instructions="Route the customer.",
                   description="Routes customers.", require_per_service_call_history_persistence=True)
    orders = Agent(client=chat_client(srv), name="orders", instructions="Answer about orders.",
                   description="Knows every order.", tools=[order_status],
                   require_per_service_call_history_persistence=True)
    return (HandoffBuilder(participants=[triage, orders],
                           termination_condition=lambda conversation: any(
                               m.author_name == "orders" and m.text for m in conversation))
            .with_start_agent(triage).add_handoff(triage, [orders]).build())


HANDOFF_SCRIPT = [
    {"tool_calls": [{"name": "handoff_to_orders", "arguments": {}, "id": "call-handoff"}]},
    {"tool_calls": [{"name": "order_status", "arguments": {"order_id": "A-17"}, "id": "call-status"}]},
    "Your order A-17 shipped on Monday.",
]


@pytest.mark.parametrize("stream", [False, True], ids=["awaited", "streamed"])
async def test_a_handoff_between_two_agents(instrumented: list[str], serve: Callable[..., FakeOpenAI],
                                           stream: bool) -> None:
    srv = serve(*HANDOFF_SCRIPT)
    workflow = handoff_workflow(srv)
    async with agl.rollout(task_id="t-handoff") as run:
        if stream:
            events = [e async for e in workflow.run("Where is my order A-17?", stream=True)]
            outputs = [e.data for e in events if e.type == "output"]
        else:
            outputs = (await workflow.run("Where is my order A-17?")).get_outputs()
        agl.emit_reward(1.0)
    said = "".join(getattr(o, "text", "") for o in outputs)  # whole replies, or a stream's chunks
    assert "Your order A-17 shipped on Monday." in said

    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["triage", "orders", "orders"] and traj.skipped == []
    assert traj.transitions[0].response["tool_calls"][0]["function"]["name"] == "handoff_to_orders"
    assert traj.transitions[2].response["content"] == "Your order A-17 shipped on Monday."
    assert all(t.token_source == "response" for t in traj.transitions)
    handoff, status = tool_spans(run)
    assert {k: handoff.attributes.get(k) for k in (semconv.GEN_AI_TOOL_NAME, semconv.AGL_TOOL_STATUS,
                                                   semconv.AGL_HANDOFF_FROM_AGENT, semconv.AGL_HANDOFF_TO_AGENT,
                                                   semconv.GEN_AI_AGENT_NAME)} == {
        semconv.GEN_AI_TOOL_NAME: "handoff_to_orders", semconv.AGL_TOOL_STATUS: "ok",
        semconv.AGL_HANDOFF_FROM_AGENT: "triage", semconv.AGL_HANDOFF_TO_AGENT: "orders",
        semconv.GEN_AI_AGENT_NAME: "triage"}
    assert (status.attributes[semconv.GEN_AI_AGENT_NAME], status.attributes[semconv.GEN_AI_TOOL_CALL_RESULT]) == (
        "orders", "shipped on Monday")

    only_orders = run.trajectory(builder=agl.TransitionBuilder(agent_match="orders"))
    assert [t.agent_name for t in only_orders.transitions] == ["orders", "orders"]
    assert [s.reason for s in only_orders.skipped] == ["agent 'triage' does not match agent_match 'orders'"]
    assert [t.credited_reward for t in only_orders.transitions] == [1.0, 1.0]


async def test_a_failed_tool_after_a_handoff_is_an_air_penalty_on_the_agent_that_called_it(
        instrumented: list[str], serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve(HANDOFF_SCRIPT[0],
                {"tool_calls": [{"name": "order_status", "arguments": {"order_id": "Z-9"}, "id": "call-missing"}]},
                "I cannot find order Z-9.")
    async with agl.rollout(task_id="t-handoff-air") as run:
        await handoff_workflow(srv).run("Where is my order Z-9?")
    assert [s.attributes[semconv.AGL_TOOL_STATUS] for s in tool_spans(run)] == ["ok", "exception"]
    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_exception=-1.0),
                                                        agent_match="orders"))
    assert [(t.agent_name, t.reward) for t in traj.transitions] == [("orders", -1.0), ("orders", None)]


def _decision(next_speaker: str | None, final: str | None = None) -> str:
    return json.dumps({"terminate": next_speaker is None, "reason": "because", "next_speaker": next_speaker,
                       "final_message": final})


async def test_a_group_chat_names_the_manager_and_each_member(instrumented: list[str],
                                                              serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve(_decision("writer"), "Roses are red.", _decision("critic"), "Too short.",
                _decision(None, "Done."))
    writer = Agent(client=chat_client(srv), name="writer", description="Writes poems.")
    critic = Agent(client=chat_client(srv), name="critic", description="Criticises poems.")
    manager = Agent(client=chat_client(srv), name="manager", instructions="Pick who speaks next.")
    workflow = GroupChatBuilder(participants=[writer, critic], orchestrator_agent=manager, max_rounds=6).build()
    async with agl.rollout(task_id="t-group") as run:
        await workflow.run("Write a poem.")
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["manager", "writer", "manager", "critic", "manager"]
    decisions = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_AGENT_NAME) == "manager"
                 and s.attributes.get(semconv.AGL_PLUGIN) == "agent_framework"]
    assert decisions and all(s.attributes[semconv.GEN_AI_OUTPUT_TYPE] == "json" for s in decisions)
    assert json.loads(traj.transitions[0].response["content"])["next_speaker"] == "writer"


async def test_a_sequence_of_two_agents(instrumented: list[str], serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve("Draft: the sky is green.", "Fixed: the sky is blue.")
    writer = Agent(client=chat_client(srv), name="writer", instructions="Write.")
    editor = Agent(client=chat_client(srv), name="editor", instructions="Fix mistakes.")
    async with agl.rollout(task_id="t-seq") as run:
        result = await SequentialBuilder(participants=[writer, editor]).build().run("Describe the sky.")
    assert result.get_outputs()[-1].text == "Fixed: the sky is blue."
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["writer", "editor"]
    assert traj.transitions[1].prompt[0] == {"role": "system", "content": "Fix mistakes."}
    assert any(m.get("content") == "Draft: the sky is green." for m in traj.transitions[1].prompt)
