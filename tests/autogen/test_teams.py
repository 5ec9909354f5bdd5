"""The ``autogen`` plugin on AutoGen teams: each transition names its agent, so ``agent_match`` can train one member."""

from __future__ import annotations

import json
from typing import Any

import pytest
from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
from autogen_agentchat.messages import HandoffMessage
from autogen_agentchat.teams import RoundRobinGroupChat, SelectorGroupChat, Swarm
from autogen_core import FunctionCall
from autogen_core.models import CreateResult, ModelFamily, ModelInfo, RequestUsage
from autogen_ext.models.openai import OpenAIChatCompletionClient
from autogen_ext.models.replay import ReplayChatCompletionClient

import agl_core as agl
from agl_autogen import SELECTOR
from agl_core import semconv
from agl_core.testing import FakeOpenAI

INFO = ModelInfo(vision=False, function_calling=True, json_output=False, family=ModelFamily.UNKNOWN,
                 structured_output=False)


def replay(*replies: str | CreateResult) -> ReplayChatCompletionClient:
    return ReplayChatCompletionClient(list(replies), model_info=INFO)


def writer_and_critic(writer_replies: list[str], critic_replies: list[str]) -> list[AssistantAgent]:
    return [
        AssistantAgent("writer", model_client=replay(*writer_replies), description="Writes drafts.",
                       system_message="You write."),
        AssistantAgent("critic", model_client=replay(*critic_replies), description="Reviews drafts.",
                       system_message="You review."),
    ]


async def test_round_robin_team_names_each_agent_and_agent_match_keeps_one(instrumented: list[str]) -> None:
    team = RoundRobinGroupChat(writer_and_critic(["draft 1", "draft 2"], ["too short", "good"]),
                               termination_condition=MaxMessageTermination(5))
    async with agl.rollout(task_id="t-round-robin") as run:
        result = await team.run(task="Write a haiku.")
        agl.emit_reward(0.75)
    assert [m.source for m in result.messages] == ["user", "writer", "critic", "writer", "critic"]

    everyone = run.trajectory()
    assert [t.agent_name for t in everyone.transitions] == ["writer", "critic", "writer", "critic"]
    critic = run.trajectory(builder=agl.TransitionBuilder(agent_match="critic"))
    assert [t.response["content"] for t in critic.transitions] == ["too short", "good"]
    assert [t.index for t in critic.transitions] == [0, 1] and critic.reward == 0.75
    assert {s.reason for s in critic.skipped} == {"agent 'writer' does not match agent_match 'critic'"}
    # the critic's second prompt holds the whole conversation so far, as AutoGen gave it to the model
    assert critic.transitions[1].prompt == [
        {"role": "system", "content": "You review."},
        {"role": "user", "content": "Write a haiku.", "name": "user"},
        {"role": "user", "content": "draft 1", "name": "writer"},
        {"role": "assistant", "content": "too short"},
        {"role": "user", "content": "draft 2", "name": "writer"},
    ]


@pytest.mark.parametrize("streaming", [False, True], ids=["create", "create_stream"])
async def test_selector_calls_are_attributed_to_the_selector(instrumented: list[str], streaming: bool) -> None:
    selector_client = replay("writer", "critic", "writer")
    team = SelectorGroupChat(writer_and_critic(["draft 1", "draft 2"], ["needs a title"]),
                             model_client=selector_client, allow_repeated_speaker=True,
                             termination_condition=MaxMessageTermination(4), model_client_streaming=streaming)
    async with agl.rollout(task_id="t-selector") as run:
        result = await team.run(task="Write a poem.")
    assert [m.source for m in result.messages] == ["user", "writer", "critic", "writer"]

    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == [SELECTOR, "writer", SELECTOR, "critic", SELECTOR, "writer"]
    selector = [t for t in traj.transitions if t.agent_name == SELECTOR]
    assert [t.response["content"] for t in selector] == ["writer", "critic", "writer"]
    assert "Read the following conversation" in str(selector[0].prompt[0]["content"])
    writer = run.trajectory(builder=agl.TransitionBuilder(agent_match="writer"))
    assert [t.response["content"] for t in writer.transitions] == ["draft 1", "draft 2"]
    chats = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "chat"]
    assert all(s.attributes[semconv.GEN_AI_REQUEST_STREAM] is streaming
               for s in chats if s.attributes[semconv.GEN_AI_AGENT_NAME] == SELECTOR)


async def test_swarm_handoff_is_a_tool_call_and_each_member_is_named(instrumented: list[str]) -> None:
    handoff = CreateResult(finish_reason="function_calls", usage=RequestUsage(prompt_tokens=0, completion_tokens=0),
                           content=[FunctionCall(id="h-1", name="transfer_to_bob", arguments="{}")], cached=False)
    alice = AssistantAgent("alice", model_client=replay(handoff), handoffs=["bob"])
    bob = AssistantAgent("bob", model_client=replay("Booked. TERMINATE"))
    team = Swarm([alice, bob], termination_condition=TextMentionTermination("TERMINATE"))
    async with agl.rollout(task_id="t-swarm") as run:
        result = await team.run(task="Book a flight.")
        agl.emit_reward(1.0)
    assert any(isinstance(m, HandoffMessage) and m.target == "bob" for m in result.messages)

    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["alice", "bob"]
    assert traj.transitions[0].response["tool_calls"][0]["function"]["name"] == "transfer_to_bob"
    (tool,) = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert (tool.attributes[semconv.GEN_AI_TOOL_NAME], tool.attributes[semconv.GEN_AI_TOOL_CALL_ID],
            tool.attributes[semconv.AGL_TOOL_STATUS], tool.attributes[semconv.GEN_AI_AGENT_NAME]) == (
        "transfer_to_bob", "h-1", "ok", "alice")
    bob_only = run.trajectory(builder=agl.TransitionBuilder(agent_match="bob"))
    assert [t.response["content"] for t in bob_only.transitions] == ["Booked. TERMINATE"]
    assert bob_only.reward == 1.0


async def test_selector_team_on_the_openai_client_merges_with_the_openai_plugin(instrumented: list[str]) -> None:
    def model(body: dict[str, Any]) -> str:
        system = body["messages"][0]["content"]
        if system.startswith("You write"):
            return "draft"
        if system.startswith("You review"):
            return "approved"
        return "critic" if "draft" in json.dumps(body["messages"]) else "writer"

    with FakeOpenAI(script=model) as srv:
        def client() -> OpenAIChatCompletionClient:
            return OpenAIChatCompletionClient(model="fake-model", base_url=srv.url, api_key="x", max_retries=0,
                                              model_info=INFO, extra_body={"return_token_ids": True})

        members = [AssistantAgent("writer", model_client=client(), system_message="You write."),
                   AssistantAgent("critic", model_client=client(), system_message="You review.")]
        team = SelectorGroupChat(members, model_client=client(), allow_repeated_speaker=True,
                                 termination_condition=MaxMessageTermination(3))
        async with agl.rollout(task_id="t-selector-openai") as run:
            await team.run(task="Write one word.")
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == [SELECTOR, "writer", SELECTOR, "critic"]
    assert len(traj.transitions) == len(srv.requests)
    assert all(t.token_source == "response" and t.prompt_token_ids for t in traj.transitions)
