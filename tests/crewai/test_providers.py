"""Every provider class ``crewai.LLM(...)`` can hand an agent, and a user's own ``BaseLLM``, traced alike.

The native OpenAI provider runs through the crew tests; here: the LiteLLM
fallback (``crewai[litellm]``), and ``BaseLLM`` subclasses defined before and
after ``instrument()``, which take crewai's text (ReAct) tool path and emit no
events of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from crewai.agent.core import Agent
from crewai.crew import Crew
from crewai.llm import LLM
from crewai.llms.base_llm import BaseLLM
from crewai.llms.providers.openai.completion import OpenAICompletion
from crewai.task import Task
from crewai.tools import tool

import agl_core as agl
from agl_core import guard, semconv
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

Serve = Callable[..., FakeOpenAI]


@tool("multiply")
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


SCRIPT: list[str] = []  # what ScriptedLLM says next


class ScriptedLLM(BaseLLM):
    """A user's own LLM class (no network, no events), defined before ``instrument()``: it answers from a script."""

    def call(self, messages: Any, tools: Any = None, callbacks: Any = None, available_functions: Any = None,
             from_task: Any = None, from_agent: Any = None, response_model: Any = None) -> Any:
        return SCRIPT.pop(0)


REACT = [
    'Thought: multiply first\nAction: multiply\nAction Input: {"a": 6, "b": 7}',
    'Thought: another one\nAction: multiply\nAction Input: {"a": 2, "b": 2}',
    'Thought: the first again\nAction: multiply\nAction Input: {"a": 6, "b": 7}',
    "Thought: I now know the final answer\nFinal Answer: 42",
]


def _react_crew(llm: Any) -> Crew:
    agent = Agent(role="Reasoner", goal="compute", backstory="Thinks aloud.", llm=llm, tools=[multiply])
    task = Task(description="What is 6*7?", expected_output="a number", agent=agent, name="reason")
    return Crew(agents=[agent], tasks=[task], cache=True)


def _check_react_run(run: Any) -> None:
    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=0.5)))
    assert [t.agent_name for t in traj.transitions] == ["Reasoner"] * 4
    assert [t.response["content"] for t in traj.transitions] == REACT
    assert [t.reward for t in traj.transitions] == [0.5, 0.5, 0.5, None]
    assert traj.transitions[0].prompt[0]["role"] == "system"
    assert "Observation: 42" in json.dumps(traj.transitions[1].prompt)  # the tool result went back to the model
    calls = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [c.attributes[semconv.GEN_AI_TOOL_NAME] for c in calls] == ["multiply"] * 3
    assert [json.loads(c.attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS]) for c in calls] == [
        {"a": 6, "b": 7}, {"a": 2, "b": 2}, {"a": 6, "b": 7}]
    # crewai appends its tool list to some observations: the result is what the agent was shown
    assert [c.attributes[semconv.GEN_AI_TOOL_CALL_RESULT].split("\n")[0] for c in calls] == ["42", "4", "42"]
    assert [c.attributes[semconv.AGL_TOOL_CACHE_HIT] for c in calls] == [False, False, True]
    assert all(semconv.GEN_AI_TOOL_CALL_ID not in c.attributes for c in calls)  # text actions have no call id


def test_user_llm_class_defined_before_instrument(crewai_only: list[str]) -> None:
    SCRIPT[:] = REACT
    with agl.rollout("react") as run:
        out = _react_crew(ScriptedLLM(model="my-model")).kickoff()
        agl.emit_reward(1.0)
    assert out.raw == "42"
    _check_react_run(run)
    span = next(s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "chat")
    assert span.name == "chat my-model" and span.attributes[semconv.CREWAI_LLM_CLASS] == "ScriptedLLM"
    assert run.trajectory().reward == 1.0
    assert guard.fault_counts() == {}


def test_user_llm_class_defined_after_instrument(crewai_only: list[str]) -> None:
    replies = list(REACT)

    class LateLLM(BaseLLM):
        def call(self, messages: Any, tools: Any = None, callbacks: Any = None, available_functions: Any = None,
                 from_task: Any = None, from_agent: Any = None, response_model: Any = None) -> Any:
            return replies.pop(0)

    class LaterLLM(LateLLM):  # inherits call: traced through its parent, once
        pass

    with agl.rollout("late") as run:
        assert _react_crew(LaterLLM(model="late-model")).kickoff().raw == "42"
    _check_react_run(run)
    assert len([s for s in run.rollout.spans if s.name == "chat late-model"]) == 4


def test_user_llm_calling_super_is_one_span(crewai_only: list[str], serve: Serve) -> None:
    srv = serve(["hello"])

    class Wrapped(OpenAICompletion):
        def call(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
            return "wrapped: " + str(super().call(messages, *args, **kwargs))

    llm = Wrapped(model="gpt-4o", base_url=srv.url, api_key="x", max_retries=0)
    with agl.rollout("super") as run:
        assert llm.call("hi") == "wrapped: hello"
    (span,) = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "chat"]
    assert span.attributes[semconv.CREWAI_LLM_CLASS] == "Wrapped"
    (transition,) = run.trajectory().transitions
    assert transition.response["content"] == "hello"  # what the model said, before the subclass rewrote it


def test_litellm_fallback(instrumented: list[str], serve: Serve) -> None:
    srv = serve([{"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]}, "It is 42."])
    llm = LLM(model="openai/gpt-4o-mini", is_litellm=True, base_url=srv.url, api_key="x",
              extra_body={"return_token_ids": True})
    assert type(llm) is LLM  # crewai's LiteLLM-backed class, not a native provider
    agent = Agent(role="Calculator", goal="compute", backstory="b", llm=llm, tools=[multiply])
    crew = Crew(agents=[agent], tasks=[Task(description="What is 6*7?", expected_output="a number", agent=agent)])
    with agl.rollout("litellm") as run:
        assert crew.kickoff().raw == "It is 42."
        agl.emit_reward(1.0)

    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=0.5)))
    assert [t.agent_name for t in traj.transitions] == ["Calculator", "Calculator"]
    assert traj.transitions[0].response["tool_calls"][0]["function"]["name"] == "multiply"
    assert traj.transitions[1].response["content"] == "It is 42."
    assert [t.reward for t in traj.transitions] == [0.5, None] and traj.reward == 1.0
    outer = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "chat"]
    assert [s.attributes[semconv.CREWAI_LLM_CLASS] for s in outer] == ["LLM", "LLM"]
    assert outer[0].name == "chat openai/gpt-4o-mini"
    # LiteLLM posts with the openai client's raw ``post``, which the openai plugin does not see; the crewai span
    # sends the traceparent itself, so agl's gateway can key its token-id record to it
    assert [r.headers["traceparent"].split("-")[2] for r in srv.requests] == [s.span_id for s in outer]
    # crewai's LiteLLM route reports usage for text replies only (it hands tool calls back without an event)
    prompt_tokens = len(tokenize(render_prompt(srv.requests[1].body["messages"])))
    assert outer[1].attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == prompt_tokens
    assert semconv.GEN_AI_USAGE_INPUT_TOKENS not in outer[0].attributes


def test_litellm_alone_still_yields_transitions(crewai_only: list[str], serve: Serve) -> None:
    """Without the ``openai`` plugin the crewai span carries the whole call (no token ids, no merge needed)."""
    srv = serve(["Paris."])
    llm = LLM(model="openai/gpt-4o-mini", is_litellm=True, base_url=srv.url, api_key="x")
    with agl.rollout("litellm-alone") as run:
        assert llm.call([{"role": "user", "content": "Capital of France?"}]) == "Paris."
    (transition,) = run.trajectory().transitions
    assert transition.prompt == [{"role": "user", "content": "Capital of France?"}]
    assert transition.response == {"role": "assistant", "content": "Paris."}
    assert transition.token_source is None and transition.finish_reason == "stop"
    (span,) = [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "chat"]
    assert srv.requests[0].headers["traceparent"] == f"00-{span.trace_id}-{span.span_id}-01"


AS_SENT: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1",
     "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": "sunny"}]},
]


def test_content_given_as_parts_reaches_the_prompt_as_sent(crewai_only: list[str], serve: Serve) -> None:
    """An MCP-style tool result (a list of parts) and a one-part user turn stay lists in the prompt, as sent."""
    srv = serve(["18C, sunny.", "18C, sunny."])
    for llm in (LLM(model="openai/fake-model", is_litellm=True, base_url=srv.url, api_key="x"),
                LLM(model="openai/fake-model", base_url=srv.url, api_key="x")):
        with agl.rollout("as-sent") as run:
            llm.call([dict(m) for m in AS_SENT])
        (transition,) = run.trajectory().transitions
        assert transition.prompt == AS_SENT
    assert [r.body["messages"][-1]["content"] for r in srv.requests] == [AS_SENT[-1]["content"]] * 2


# LiteLLM's hosted_vllm route keeps no prompt_token_ids in a stream's chunks (its openai route does): that stream's
# transition has no token ids, as it would with any client that drops half of them
@pytest.mark.parametrize(("model", "stream"), [("hosted_vllm/fake-model", False), ("openai/fake-model", False),
                                               ("openai/fake-model", True)])
def test_litellm_talking_to_a_vllm_style_server_keeps_its_token_ids(crewai_only: list[str], serve: Serve,
                                                                    model: str, stream: bool) -> None:
    """LiteLLM keeps the server's ``prompt_token_ids`` and ``token_ids`` on its reply (and stream chunks): the
    transition has them, exact, with no gateway and no re-tokenising."""
    srv = serve(["Paris is the capital."], return_token_ids=True)
    llm = LLM(model=model, is_litellm=True, base_url=srv.url, api_key="x", stream=stream, logprobs=True)
    assert type(llm) is LLM
    with agl.rollout("litellm-ids") as run:
        assert llm.call([{"role": "user", "content": "Capital of France?"}]) == "Paris is the capital."
    assert srv.requests[0].body.get("stream", False) is stream
    (transition,) = run.trajectory().transitions
    assert transition.token_source == "response"
    assert transition.response_token_ids == tokenize("Paris is the capital.")
    assert transition.prompt_token_ids == tokenize(render_prompt(srv.requests[0].body["messages"]))
    assert transition.response_logprobs is not None and len(transition.response_logprobs) == 4
