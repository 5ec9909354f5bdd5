"""The ``autogen`` plugin on single AutoGen agents: the replay client, and the OpenAI client against a fake server.

Every test drives the real ``autogen-agentchat`` / ``autogen-core`` / ``autogen-ext``;
only the network edge is fake (``FakeOpenAI`` on 127.0.0.1), or the model is
AutoGen's own ``ReplayChatCompletionClient``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

import pytest
from autogen_agentchat.agents import AssistantAgent, BaseChatAgent
from autogen_agentchat.base import TaskResult
from autogen_agentchat.messages import ModelClientStreamingChunkEvent
from autogen_core import CancellationToken, FunctionCall
from autogen_core.models import (
    ChatCompletionClient,
    CreateResult,
    LLMMessage,
    ModelFamily,
    ModelInfo,
    RequestUsage,
    UserMessage,
)
from autogen_core.tools import BaseStreamTool, BaseTool, FunctionTool
from autogen_ext.models.openai import BaseOpenAIChatCompletionClient, OpenAIChatCompletionClient
from autogen_ext.models.replay import ReplayChatCompletionClient
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agl_core as agl
from agl_autogen import attributes
from agl_autogen import instrumentor as hooks
from agl_core import collector, guard, instrumentation, semconv
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

INFO = ModelInfo(vision=False, function_calling=True, json_output=False, family=ModelFamily.UNKNOWN,
                 structured_output=False)
AIR = agl.AirRules(tool_exception=-1.0, tool_error=-0.5, tool_ok=0.1)

_OPS: dict[type[ast.AST], Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                  ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_eval(node.operand)))
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '12 * (3 + 4)'."""
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value)) if value == int(value) else str(value)


def tool_call(name: str, arguments: Mapping[str, Any] | str, call_id: str, thought: str | None = None) -> CreateResult:
    """A model result asking for one tool call, as a replay client answers it."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return CreateResult(finish_reason="function_calls", content=[FunctionCall(id=call_id, name=name, arguments=args)],
                        usage=RequestUsage(prompt_tokens=0, completion_tokens=0), cached=False, thought=thought)


def replay(*replies: str | CreateResult) -> ReplayChatCompletionClient:
    return ReplayChatCompletionClient(list(replies), model_info=INFO)


def openai_client(srv: FakeOpenAI, **kwargs: Any) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(model="fake-model", base_url=srv.url, api_key="x", max_retries=0,
                                      model_info=INFO, **kwargs)


def spans(run: agl.RolloutRun, operation: str) -> list[Span]:
    return [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == operation]


def texts(result: TaskResult) -> list[tuple[str, str]]:
    """What a run produced, without ids and timestamps: (message type, text) per message."""
    return [(type(m).__name__, m.to_text()) for m in result.messages]


# --------------------------------------------------------------------------- one agent, one tool


async def test_agent_with_a_tool_gives_one_transition_per_model_call(instrumented: list[str]) -> None:
    client = replay(tool_call("calculator", {"expression": "6 * 7"}, "call-1"), "6 * 7 = 42")
    agent = AssistantAgent("math", model_client=client, tools=[calculator], reflect_on_tool_use=True,
                           system_message="Use the calculator.")
    async with agl.rollout(task_id="t-tool") as run:
        result = await agent.run(task="What is 6 * 7?")
        agl.emit_reward(1.0)
    assert result.messages[-1].to_text() == "6 * 7 = 42"

    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["math", "math"]
    first, second = traj.transitions
    assert first.prompt == [{"role": "system", "content": "Use the calculator."},
                            {"role": "user", "content": "What is 6 * 7?", "name": "user"}]
    assert first.response == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'}}
    ]}
    assert first.finish_reason == "tool_calls"
    assert first.tools is not None and first.tools[0]["function"]["name"] == "calculator"
    assert second.prompt[-2:] == [first.response, {"role": "tool", "tool_call_id": "call-1", "content": "42"}]
    assert second.response == {"role": "assistant", "content": "6 * 7 = 42"}
    assert second.tools is None  # the reflection call offers no tools
    assert traj.reward == 1.0 and [t.credited_reward for t in traj.transitions] == [1.0, 1.0]

    (chat, _), (tool,) = spans(run, "chat"), spans(run, "execute_tool")
    assert chat.name == "chat" and chat.attributes[semconv.AGL_PLUGIN] == "autogen"
    assert chat.attributes[semconv.GEN_AI_PROVIDER_NAME] == "autogen.replay"
    assert chat.attributes[semconv.GEN_AI_REQUEST_STREAM] is False
    assert tool.name == "execute_tool calculator"
    assert {k: tool.attributes[k] for k in (semconv.GEN_AI_TOOL_NAME, semconv.GEN_AI_TOOL_CALL_ID,
                                            semconv.GEN_AI_TOOL_CALL_ARGUMENTS, semconv.GEN_AI_TOOL_CALL_RESULT,
                                            semconv.AGL_TOOL_STATUS, semconv.GEN_AI_AGENT_NAME)} == {
        semconv.GEN_AI_TOOL_NAME: "calculator", semconv.GEN_AI_TOOL_CALL_ID: "call-1",
        semconv.GEN_AI_TOOL_CALL_ARGUMENTS: '{"expression": "6 * 7"}', semconv.GEN_AI_TOOL_CALL_RESULT: "42",
        semconv.AGL_TOOL_STATUS: "ok", semconv.GEN_AI_AGENT_NAME: "math"}
    assert tool.status != "error" and semconv.ERROR_TYPE not in tool.attributes


async def test_a_failing_tool_is_seen_by_air_and_the_agent_goes_on(instrumented: list[str]) -> None:
    client = replay(tool_call("calculator", {"expression": "1 / 0"}, "call-1"), "I cannot divide by zero.")
    agent = AssistantAgent("math", model_client=client, tools=[calculator], reflect_on_tool_use=True)
    async with agl.rollout(task_id="t-fail") as run:
        result = await agent.run(task="What is 1 / 0?")
        agl.emit_reward(0.0)
    assert result.messages[-1].to_text() == "I cannot divide by zero."

    (tool,) = spans(run, "execute_tool")
    assert tool.attributes[semconv.AGL_TOOL_STATUS] == "exception"
    assert tool.attributes[semconv.ERROR_TYPE] == "ZeroDivisionError"
    assert tool.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "division by zero"  # what the model is shown
    assert tool.status == "error"

    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR, credit="discounted"))
    assert [t.reward for t in traj.transitions] == [-1.0, None]
    assert traj.transitions[1].prompt[-1] == {"role": "tool", "tool_call_id": "call-1", "content": "division by zero"}


async def test_error_results_without_an_exception_are_tool_errors(instrumented: list[str]) -> None:
    client = replay(
        tool_call("abacus", {"expression": "1 + 1"}, "call-unknown"),  # no such tool
        tool_call("calculator", "{not json", "call-bad-json"),  # arguments the agent cannot parse
        "Giving up.",
    )
    agent = AssistantAgent("math", model_client=client, tools=[calculator], reflect_on_tool_use=False,
                           max_tool_iterations=3)
    async with agl.rollout(task_id="t-error") as run:
        await agent.run(task="What is 1 + 1?")

    tools = spans(run, "execute_tool")
    assert [(t.attributes[semconv.GEN_AI_TOOL_CALL_ID], t.attributes[semconv.AGL_TOOL_STATUS],
             t.attributes[semconv.ERROR_TYPE]) for t in tools] == [("call-unknown", "error", "tool_error"),
                                                                   ("call-bad-json", "error", "tool_error")]
    assert "not found" in tools[0].attributes[semconv.GEN_AI_TOOL_CALL_RESULT]
    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR))
    assert [t.reward for t in traj.transitions] == [-0.5, -0.5, None]


async def test_streaming_run_records_the_final_result_and_leaves_the_stream_unchanged(
    instrumented: list[str],
) -> None:
    def make() -> AssistantAgent:
        client = replay(tool_call("calculator", {"expression": "2 + 2"}, "call-1"), "The sum is 4")
        return AssistantAgent("math", model_client=client, tools=[calculator], reflect_on_tool_use=True,
                              model_client_stream=True)

    async def collect(agent: AssistantAgent) -> list[Any]:
        return [item async for item in agent.run_stream(task="What is 2 + 2?")]

    agl.uninstrument()
    plain = await collect(make())
    agl.instrument(["autogen", "openai"])
    async with agl.rollout(task_id="t-stream") as run:
        traced = await collect(make())

    def shape(items: list[Any]) -> list[tuple[str, str]]:
        return [(type(i).__name__, "" if isinstance(i, TaskResult) else i.to_text()) for i in items]

    assert shape(traced) == shape(plain)
    assert sum(isinstance(i, ModelClientStreamingChunkEvent) for i in traced) == 4  # "The ", "sum ", "is ", "4"
    traj = run.trajectory()
    assert [t.response.get("content") for t in traj.transitions] == [None, "The sum is 4"]
    assert traj.transitions[0].response["tool_calls"][0]["id"] == "call-1"
    assert all(s.attributes[semconv.GEN_AI_REQUEST_STREAM] is True for s in spans(run, "chat"))
    assert [s.attributes[semconv.AGL_TOOL_STATUS] for s in spans(run, "execute_tool")] == ["ok"]


# --------------------------------------------------------------------------- the OpenAI client, nested spans


@pytest.mark.parametrize("stream", [False, True], ids=["create", "create_stream"])
async def test_openai_client_call_is_one_transition_with_token_ids(instrumented: list[str], stream: bool) -> None:
    script = [{"content": "Let me compute.", "tool_calls": [{"name": "calculator", "id": "call_a",
                                                              "arguments": {"expression": "6 * 7"}}]},
              "The answer is 42."]
    with FakeOpenAI(script=script) as srv:
        client = openai_client(srv, extra_body={"return_token_ids": True})
        agent = AssistantAgent("math", model_client=client, tools=[calculator], reflect_on_tool_use=True,
                               model_client_stream=stream, system_message="Be exact.")
        async with agl.rollout(task_id="t-openai") as run:
            result = await agent.run(task="What is 6 * 7?")
    assert result.messages[-1].to_text() == "The answer is 42."

    traj = run.trajectory()
    assert len(traj.transitions) == 2 == len(srv.requests) and not traj.skipped
    chats = {s.span_id: s for s in spans(run, "chat")}
    for t, request in zip(traj.transitions, srv.requests, strict=True):
        assert t.agent_name == "math" and t.model == "fake-model" and t.token_source == "response"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
        outer = chats[t.span_id]
        assert outer.attributes[semconv.AGL_PLUGIN] == "autogen"
        # the openai plugin's span of the same request is nested in ours and carries the traceparent join key
        (inner,) = [s for s in chats.values() if s.parent_id == outer.span_id]
        assert inner.attributes[semconv.AGL_PLUGIN] == "openai"
        assert request.headers["traceparent"] == f"00-{inner.trace_id}-{inner.span_id}-01"
        # our conversion of AutoGen's messages is what the client really sent
        assert outer.attributes[semconv.GEN_AI_INPUT_MESSAGES] == inner.attributes[semconv.GEN_AI_INPUT_MESSAGES]
        assert outer.attributes.get(semconv.GEN_AI_TOOL_DEFINITIONS) == inner.attributes.get(
            semconv.GEN_AI_TOOL_DEFINITIONS)
        for key in (semconv.GEN_AI_REQUEST_MODEL, semconv.GEN_AI_RESPONSE_FINISH_REASONS,
                    semconv.GEN_AI_OUTPUT_MESSAGES,
                    semconv.GEN_AI_USAGE_INPUT_TOKENS, semconv.GEN_AI_USAGE_OUTPUT_TOKENS):
            assert outer.attributes.get(key) == inner.attributes.get(key), key  # usage: none when streamed
        assert stream or outer.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == len(t.prompt_token_ids)
    assert traj.transitions[0].response["content"] == "Let me compute."
    assert traj.transitions[0].response["tool_calls"][0]["function"]["arguments"] == '{"expression": "6 * 7"}'
    assert spans(run, "execute_tool")[0].attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "42"


# --------------------------------------------------------------------------- the Calc-X math agent

MATH_PROMPT = "Solve the math problem. Use the calculator tool for arithmetic, then state the final number."
PROBLEMS = [
    {"id": "calc-1", "question": "A shop sells 12 boxes of 7 pens. How many pens? Compute 12 * 7.", "answer": 84},
    {"id": "calc-2", "question": "Share 90 apples among 6 kids. Compute 90 / 6.", "answer": 15},
    {"id": "calc-3", "question": "Misread on purpose: compute (3 + 4) * 5.", "answer": 35},
]


def fake_math_model(body: dict[str, Any]) -> dict[str, Any] | str:
    """The policy behind FakeOpenAI: asks the calculator, then reports its result (off by one on a 'Misread')."""
    messages = body["messages"]
    if messages[-1]["role"] == "tool":
        if not re.fullmatch(r"-?\d+(\.\d+)?", messages[-1]["content"]):
            return "The calculator failed, so I cannot tell."
        value = int(float(messages[-1]["content"]))
        question = next(m["content"] for m in messages if m["role"] == "user")
        return f"The answer is {value + 1 if question.startswith('Misread') else value}."
    question = messages[-1]["content"]
    expression = question.rsplit("ompute ", 1)[1].rstrip(".")
    return {"tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}]}


def math_reward(answer_text: str, expected: float) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer_text)
    return 1.0 if numbers and float(numbers[-1]) == expected else 0.0


async def test_calc_x_math_agent_with_a_calculator(instrumented: list[str]) -> None:
    store = agl.SqliteStore(":memory:")
    trajectories = []
    with FakeOpenAI(script=fake_math_model) as srv:
        for problem in PROBLEMS:
            agent = AssistantAgent("solver", model_client=openai_client(srv, extra_body={"return_token_ids": True}),
                                   tools=[calculator], reflect_on_tool_use=True, system_message=MATH_PROMPT)
            async with agl.rollout(task_id=problem["id"], task=problem, store=store) as run:
                result = await agent.run(task=problem["question"])
                agl.emit_reward(math_reward(result.messages[-1].to_text(), problem["answer"]))
            trajectories.append(run.trajectory(builder=agl.TransitionBuilder(agent_match="solver", air=AIR)))

    assert [t.reward for t in trajectories] == [1.0, 1.0, 0.0]
    for traj, problem in zip(trajectories, PROBLEMS, strict=True):
        ask, answer = traj.transitions
        assert ask.response["tool_calls"][0]["function"]["name"] == "calculator"
        assert ask.reward == 0.1  # AIR: the calculator call went through
        assert answer.prompt[-1]["role"] == "tool" and float(answer.prompt[-1]["content"]) == problem["answer"]
        assert all(t.token_source == "response" and t.response_token_ids for t in traj.transitions)
        assert [t.credited_reward for t in traj.transitions] == [traj.reward + 0.1] * 2  # "final": the return
    stored = store.trajectories()
    assert sorted(t.task_id for t in stored) == ["calc-1", "calc-2", "calc-3"]
    store.close()


# --------------------------------------------------------------------------- autogen-core's own spans


async def test_with_a_global_sdk_provider_autogen_spans_add_no_duplicates(
    instrumented: list[str], global_provider: InMemorySpanExporter
) -> None:
    with FakeOpenAI(script=fake_math_model) as srv:
        client = openai_client(srv, extra_body={"return_token_ids": True})
        agent = AssistantAgent("solver", model_client=client, tools=[calculator], reflect_on_tool_use=True)
        async with agl.rollout(task_id="t-global") as run:
            await agent.run(task="Compute 1 / 0.")  # the calculator raises: one AIR signal, not two

    names = [s.name for s in run.rollout.spans]
    assert "invoke_agent solver" in names  # autogen-core's own spans reach the rollout through the global provider
    tools = spans(run, "execute_tool")
    assert len(tools) == 1 and tools[0].attributes[semconv.AGL_PLUGIN] == "autogen"  # autogen's was replaced by ours
    assert tools[0].attributes[semconv.AGL_TOOL_STATUS] == "exception"
    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR))
    assert len(traj.transitions) == 2 == len(srv.requests)
    assert [t.reward for t in traj.transitions] == [-1.0, None]
    assert [t.agent_name for t in traj.transitions] == ["solver", "solver"]
    exported = [s.name for s in global_provider.get_finished_spans()]  # the user's exporter sees agl's spans too
    assert exported.count("execute_tool calculator") == 1 and exported.count("chat fake-model") == 4


# --------------------------------------------------------------------------- every client class, now and later


def _echo_result(messages: Sequence[LLMMessage]) -> CreateResult:
    return CreateResult(finish_reason="stop", content=f"echo: {messages[-1].content}",
                        usage=RequestUsage(prompt_tokens=3, completion_tokens=2), cached=False)


async def test_a_client_class_defined_after_instrument_is_traced_with_its_span_current(
    instrumented: list[str],
) -> None:
    class EchoClient(ChatCompletionClient):
        """A user's own client, defined after ``instrument()``."""

        def __init__(self) -> None:
            self.current: list[trace.Span] = []

        async def create(self, messages: Sequence[LLMMessage], *, tools: Any = (), tool_choice: Any = "auto",
                         json_output: Any = None, extra_create_args: Mapping[str, Any] = {},
                         cancellation_token: CancellationToken | None = None) -> CreateResult:
            self.current.append(trace.get_current_span())
            return _echo_result(messages)

        async def create_stream(self, messages: Sequence[LLMMessage], *, tools: Any = (), tool_choice: Any = "auto",
                                json_output: Any = None, extra_create_args: Mapping[str, Any] = {},
                                cancellation_token: CancellationToken | None = None,
                                ) -> AsyncGenerator[str | CreateResult, None]:
            self.current.append(trace.get_current_span())
            yield "echo"
            self.current.append(trace.get_current_span())
            yield _echo_result(messages)

        async def close(self) -> None:
            return None

        def actual_usage(self) -> RequestUsage:
            return RequestUsage(prompt_tokens=0, completion_tokens=0)

        total_usage = actual_usage

        def count_tokens(self, messages: Sequence[LLMMessage], *, tools: Any = ()) -> int:
            return 0

        remaining_tokens = count_tokens

        @property
        def capabilities(self) -> Any:
            return INFO

        @property
        def model_info(self) -> ModelInfo:
            return INFO

    class LoudEcho(EchoClient):
        async def create(self, *args: Any, **kwargs: Any) -> CreateResult:  # a subclass calling super(): one span
            return await super().create(*args, **kwargs)

    assert hasattr(EchoClient.__dict__["create"], hooks._MARK) and hasattr(LoudEcho.__dict__["create"], hooks._MARK)
    client = LoudEcho()
    question = [UserMessage(content="hi", source="user")]
    async with agl.rollout(task_id="t-late") as run:
        await client.create(question)
        held = []
        async for chunk in client.create_stream(question):
            held.append(trace.get_current_span())  # what the consumer sees between chunks
            del chunk
    chats = spans(run, "chat")
    assert len(chats) == 2 and [s.attributes[semconv.GEN_AI_REQUEST_STREAM] for s in chats] == [False, True]
    assert [format(s.get_span_context().span_id, "016x") for s in client.current] == [
        chats[0].span_id, chats[1].span_id, chats[1].span_id]
    assert all(s.name == "agl.rollout t-late" for s in held)  # never our chat span outside the client's own code
    assert [json.loads(s.attributes[semconv.GEN_AI_OUTPUT_MESSAGES])[0]["parts"][0]["content"] for s in chats] == [
        "echo: hi", "echo: hi"]
    assert chats[0].attributes[semconv.GEN_AI_PROVIDER_NAME] == EchoClient.__module__.split(".")[0]

    original = LoudEcho.__dict__["create"].__wrapped__
    agl.uninstrument()
    assert LoudEcho.__dict__["create"] is original


async def test_a_client_wrapping_another_gives_one_span_per_call(instrumented: list[str]) -> None:
    from autogen_core import InMemoryStore
    from autogen_ext.models.cache import ChatCompletionCache

    cache = ChatCompletionCache(replay("first answer", "second answer"), InMemoryStore[Any]())
    question = [UserMessage(content="hi", source="user")]
    async with agl.rollout(task_id="t-cache") as run:
        miss = await cache.create(question)
        hit = await cache.create(question)  # answered from the cache, the replay client is not asked
        streamed = [item async for item in cache.create_stream([UserMessage(content="again", source="user")])]
    assert miss.content == hit.content == "first answer" and streamed[-1].content == "second answer"
    chats = spans(run, "chat")
    assert len(chats) == 3 and all(s.parent_id == run.rollout.spans[0].span_id for s in chats)
    assert len(run.trajectory().transitions) == 3


async def test_calling_on_messages_directly_names_the_agent(instrumented: list[str]) -> None:
    from autogen_agentchat.messages import TextMessage

    agent = AssistantAgent("helper", model_client=replay("hello"))
    async with agl.rollout(task_id="t-direct") as run:
        response = await agent.on_messages([TextMessage(content="hi", source="user")], CancellationToken())
    assert response.chat_message.to_text() == "hello"
    assert [t.agent_name for t in run.trajectory().transitions] == ["helper"]


async def test_a_stream_closed_early_still_ends_its_span(instrumented: list[str]) -> None:
    client = replay("one two three four")
    async with agl.rollout(task_id="t-close") as run:
        never_read = client.create_stream([UserMessage(content="unused", source="user")])
        await never_read.aclose()  # a stream nobody reads makes no span
        stream = client.create_stream([UserMessage(content="count", source="user")])
        first = await stream.__anext__()
        await stream.aclose()
    assert first == "one "
    (chat,) = spans(run, "chat")
    assert chat.status != "error" and semconv.GEN_AI_OUTPUT_MESSAGES not in chat.attributes
    assert run.trajectory().skipped[0].reason.startswith("no response recorded")


async def test_a_model_error_passes_through_unchanged(instrumented: list[str]) -> None:
    client = replay()  # no replies left: the replay client raises ValueError
    agent = AssistantAgent("math", model_client=client)
    with pytest.raises(ValueError, match="No more mock responses available"):
        async with agl.rollout(task_id="t-error") as run:
            await agent.run(task="anything")
    (chat,) = spans(run, "chat")
    assert chat.status == "error" and chat.attributes[semconv.ERROR_TYPE] == "ValueError"
    assert "the call failed (ValueError)" in run.trajectory().skipped[0].reason


async def test_a_tool_run_outside_an_agent_gets_its_own_span(instrumented: list[str]) -> None:
    tool = FunctionTool(calculator, description="calculator")
    async with agl.rollout(task_id="t-bare-tool") as run:
        value = await tool.run_json({"expression": "3 * 3"}, CancellationToken(), call_id="c9")
        with pytest.raises(ValueError):
            await tool.run_json({"expression": "x + 1"}, CancellationToken(), call_id="c10")
    assert value == "9"
    ok, failed = spans(run, "execute_tool")
    assert (ok.attributes[semconv.GEN_AI_TOOL_CALL_ID], ok.attributes[semconv.AGL_TOOL_STATUS],
            ok.attributes[semconv.GEN_AI_TOOL_CALL_RESULT]) == ("c9", "ok", "9")
    assert json.loads(ok.attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"expression": "3 * 3"}
    assert failed.attributes[semconv.AGL_TOOL_STATUS] == "exception" and failed.status == "error"


async def test_an_agent_used_as_a_tool_streams_through_the_workbench(instrumented: list[str]) -> None:
    from autogen_agentchat.tools import AgentTool

    expert = AssistantAgent("expert", model_client=replay("Paris"), description="Knows capitals.")
    lead = AssistantAgent("lead", model_client=replay(tool_call("expert", {"task": "Capital of France?"}, "call-x"),
                                                     "It is Paris."),
                          tools=[AgentTool(expert, return_value_as_last_message=True)], reflect_on_tool_use=True)
    async with agl.rollout(task_id="t-agent-tool") as run:
        result = await lead.run(task="Ask the expert.")
    assert result.messages[-1].to_text() == "It is Paris."

    (tool,) = spans(run, "execute_tool")  # one span: the stream tool's run reports to _execute_tool_call's
    assert (tool.attributes[semconv.GEN_AI_TOOL_NAME], tool.attributes[semconv.AGL_TOOL_STATUS],
            tool.attributes[semconv.GEN_AI_TOOL_CALL_RESULT]) == ("expert", "ok", "Paris")
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["lead", "expert", "lead"]
    (inner,) = [s for s in spans(run, "chat") if s.attributes[semconv.GEN_AI_AGENT_NAME] == "expert"]
    assert inner.parent_id == tool.span_id  # the expert's call runs inside the tool call that asked for it
    expert_only = run.trajectory(builder=agl.TransitionBuilder(agent_match="expert"))
    assert [t.response["content"] for t in expert_only.transitions] == ["Paris"]


def test_client_classes_imported_after_instrument_are_traced(tmp_path: Any) -> None:
    """The import order many users have: ``agl.instrument()`` first, then ``autogen_ext``'s clients."""
    import subprocess
    import sys

    code = """
import sys
import agl_core as agl
print(list(agl.instrument(["autogen"])))
assert "autogen_ext.models.openai" not in sys.modules
from autogen_ext.models.openai import AzureOpenAIChatCompletionClient, BaseOpenAIChatCompletionClient
for cls, attr in [(BaseOpenAIChatCompletionClient, "create"), (BaseOpenAIChatCompletionClient, "create_stream")]:
    assert hasattr(cls.__dict__[attr], "_agl_autogen_original"), (cls, attr)
assert "create" not in AzureOpenAIChatCompletionClient.__dict__  # inherits the traced one
agl.uninstrument()
assert not hasattr(BaseOpenAIChatCompletionClient.__dict__["create"], "_agl_autogen_original")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['autogen']", "ok"]


# --------------------------------------------------------------------------- fail-open, uninstrument, memory


def _scenario() -> AssistantAgent:
    client = replay(tool_call("calculator", {"expression": "5 + 5"}, "call-1"), "10")
    return AssistantAgent("math", model_client=client, tools=[calculator], reflect_on_tool_use=True,
                          model_client_stream=True)


@pytest.mark.parametrize("target", ["request_attributes", "result_attributes", "tool_start_attributes",
                                    "tool_end_attributes", "input_messages_json"])
async def test_a_fault_in_agl_never_reaches_the_agent(
    instrumented: list[str], monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    agl.uninstrument()
    expected = texts(await _scenario().run(task="5 + 5?"))
    agl.instrument(["autogen", "openai"])

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected fault in {target}")

    monkeypatch.setattr(attributes, target, broken)
    async with agl.rollout(task_id="t-fault") as run:
        result = await _scenario().run(task="5 + 5?")
    assert texts(result) == expected
    assert sum(guard.fault_counts().values()) >= 1
    assert run.rollout.status == "succeeded"


def test_uninstrument_restores_every_original() -> None:
    import autogen_core
    import autogen_core.tools._base as tools_base
    from autogen_agentchat.teams._group_chat._selector_group_chat import SelectorGroupChatManager

    watched: list[tuple[Any, str]] = [
        (ChatCompletionClient, "__init_subclass__"), (BaseChatAgent, "__init_subclass__"),
        (BaseOpenAIChatCompletionClient, "create"), (BaseOpenAIChatCompletionClient, "create_stream"),
        (ReplayChatCompletionClient, "create"), (ReplayChatCompletionClient, "create_stream"),
        (AssistantAgent, "on_messages"), (AssistantAgent, "on_messages_stream"),
        (BaseChatAgent, "on_messages_stream"), (AssistantAgent, "_execute_tool_call"),
        (BaseTool, "run_json"), (BaseStreamTool, "run_json_stream"),
        (SelectorGroupChatManager, "select_speaker"),
        (autogen_core, "trace_tool_span"), (tools_base, "trace_tool_span"),
    ]
    missing = object()
    before = [owner.__dict__.get(attr, missing) for owner, attr in watched]
    agl.uninstrument()
    assert list(agl.instrument(["autogen"])) == ["autogen"]
    agl.instrument(["autogen"])  # idempotent
    during = [owner.__dict__.get(attr, missing) for owner, attr in watched]
    assert all(a is not b for a, b in zip(before, during, strict=True))
    agl.uninstrument()
    after = [owner.__dict__.get(attr, missing) for owner, attr in watched]
    assert all(a is b for a, b in zip(before, after, strict=True))


async def test_no_state_is_left_behind(instrumented: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attributes._memo, "max_chars", 20_000)
    monkeypatch.setattr(attributes._memo, "entries", {})
    monkeypatch.setattr(attributes._memo, "chars", 0)
    plugin_patches = len(instrumentation._active["autogen"]._patches)
    for i in range(40):
        client = replay(tool_call("calculator", {"expression": f"{i} + 1"}, f"call-{i}"), f"{i + 1} " * 50)
        agent = AssistantAgent("math", model_client=client, tools=[calculator], reflect_on_tool_use=True,
                               model_client_stream=i % 2 == 0)
        async with agl.rollout(task_id=f"t-{i}") as run:
            await agent.run(task=f"What is {i} + 1? " + "Think. " * 50)
        assert len(run.trajectory().transitions) == 2
    assert hooks._agent.get() is None and hooks._in_llm.get() is False and hooks._tool_run.get() is None
    assert trace.get_current_span() is trace.INVALID_SPAN
    assert not collector._open  # every rollout's buffer is gone
    assert attributes._memo.chars <= 20_000 + 2_000  # bounded: it starts over past the limit
    assert len(instrumentation._active["autogen"]._patches) == plugin_patches  # no patch per call or run


async def test_content_given_as_a_list_reaches_the_prompt_as_sent(instrumented: list[str]) -> None:
    """A ``UserMessage`` whose content is a list is sent as a list of parts; the prompt keeps that list."""
    from autogen_core.models import SystemMessage

    with FakeOpenAI(script=["18C."]) as srv:
        with agl.rollout(task_id="t") as run:
            await openai_client(srv).create([SystemMessage(content="Be brief."),
                                             UserMessage(content=["Weather in Paris?"], source="user")])
    sent = srv.requests[0].body["messages"]
    assert sent[1]["content"] == [{"type": "text", "text": "Weather in Paris?"}]
    assert run.trajectory().transitions[0].prompt == sent
