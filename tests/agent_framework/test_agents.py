"""The ``agent_framework`` plugin on single Agent Framework agents, against a fake vLLM-like server on 127.0.0.1.

Every test drives the real ``agent-framework-core`` ``Agent`` and its OpenAI
clients (or a chat client of the test's own, as a user writes one); only the
network edge is fake (``FakeOpenAI``, and a minimal Responses API server here).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from typing import Any

import agent_framework._tools as af_tools
import pytest
from agent_framework import (
    Agent,
    BaseAgent,
    BaseChatClient,
    ChatResponse,
    ChatResponseUpdate,
    Content,
    FunctionTool,
    Message,
    tool,
)
from agent_framework import observability as af_observability
from agent_framework.observability import ChatTelemetryLayer
from agent_framework.openai import OpenAIChatClient, OpenAIChatCompletionClient
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

import agl_core as agl
from agl_core import semconv
from agl_core.openai_client.responses_items import chat_request
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

AIR = agl.AirRules(tool_exception=-1.0, tool_error=-0.5, tool_timeout=-0.8, tool_ok=0.1)
SYSTEM = "Use the tools."


def chat_client(srv: FakeOpenAI, **kwargs: Any) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(model="fake-model", base_url=srv.url, api_key="x", **kwargs)


def spans(run: agl.RolloutRun, operation: str, plugin: str | None = "agent_framework") -> list[Span]:
    return sorted((s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == operation
                   and (plugin is None or s.attributes.get(semconv.AGL_PLUGIN) == plugin)), key=lambda s: s.start_ns)


def tool_call(name: str, arguments: dict[str, Any] | str, call_id: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": name, "arguments": arguments, "id": call_id}]}


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


@tool
async def slow_lookup(key: str) -> str:
    """Look a key up in a slow store."""
    raise TimeoutError(f"the store did not answer for {key}")


def math_agent(srv: FakeOpenAI, **kwargs: Any) -> Agent:
    return Agent(client=chat_client(srv), name="math", instructions=SYSTEM, tools=[add, divide, slow_lookup],
                 **kwargs)


async def run_text(agent: Any, prompt: str, stream: bool) -> str:
    if stream:
        return "".join([u.text async for u in agent.run(prompt, stream=True)])
    return str((await agent.run(prompt)).text)


# --------------------------------------------------------------------------- one agent, one tool


@pytest.mark.parametrize("stream", [False, True], ids=["awaited", "streamed"])
async def test_agent_with_a_tool_gives_one_transition_per_request_with_exact_token_ids(
        instrumented: list[str], serve: Callable[..., FakeOpenAI], stream: bool) -> None:
    srv = serve(tool_call("add", {"a": 2, "b": 3}, "call-1"), "2 + 3 = 5")
    async with agl.rollout(task_id="t-tool") as run:
        answer = await run_text(math_agent(srv), "What is 2 + 3?", stream)
        agl.emit_reward(1.0)
    assert answer == "2 + 3 = 5"

    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["math", "math"] and traj.skipped == []
    first, second = traj.transitions
    assert first.prompt == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]
    assert first.response == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}
    assert first.finish_reason == "tool_calls"
    assert {t["function"]["name"] for t in first.tools or []} == {"add", "divide", "slow_lookup"}
    assert second.prompt[-1] == {"role": "tool", "tool_call_id": "call-1", "content": "5"}
    assert second.response == {"role": "assistant", "content": "2 + 3 = 5"}
    # the exact ids the server generated, through agl's openai plugin beneath the framework's client
    for t, request in zip(traj.transitions, srv.requests, strict=True):
        assert t.token_source == "response"
        assert t.prompt_token_ids == tokenize(render_prompt(request.body["messages"]))
    assert second.response_token_ids == tokenize("2 + 3 = 5")
    assert traj.reward == 1.0 and [t.credited_reward for t in traj.transitions] == [1.0, 1.0]

    # one agl span per request, with the openai plugin's span of the HTTP request nested in it
    chats, clients = spans(run, "chat"), spans(run, "chat", "openai")
    assert len(chats) == len(clients) == 2
    assert [c.parent_id for c in clients] == [c.span_id for c in chats]
    assert all(c.attributes[semconv.GEN_AI_REQUEST_STREAM] is stream for c in chats)
    assert chats[0].attributes[semconv.GEN_AI_PROVIDER_NAME] == "openai"
    assert chats[0].name == "chat fake-model" and chats[0].attributes[semconv.GEN_AI_AGENT_NAME] == "math"
    assert chats[1].attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == len(tokenize("2 + 3 = 5"))
    (span,) = spans(run, "execute_tool")
    assert span.name == "execute_tool add"
    assert {k: span.attributes[k] for k in (semconv.GEN_AI_TOOL_NAME, semconv.GEN_AI_TOOL_CALL_ID,
                                            semconv.GEN_AI_TOOL_CALL_ARGUMENTS, semconv.GEN_AI_TOOL_CALL_RESULT,
                                            semconv.AGL_TOOL_STATUS, semconv.GEN_AI_AGENT_NAME)} == {
        semconv.GEN_AI_TOOL_NAME: "add", semconv.GEN_AI_TOOL_CALL_ID: "call-1",
        semconv.GEN_AI_TOOL_CALL_ARGUMENTS: '{"a": 2, "b": 3}', semconv.GEN_AI_TOOL_CALL_RESULT: "5",
        semconv.AGL_TOOL_STATUS: "ok", semconv.GEN_AI_AGENT_NAME: "math"}
    assert trace.get_current_span() is trace.INVALID_SPAN


async def test_a_stream_gives_the_same_updates_traced_or_not(instrumented: list[str],
                                                             serve: Callable[..., FakeOpenAI]) -> None:
    script = [tool_call("add", {"a": 20, "b": 22}, "call-1"), "The sum is 42"]

    async def updates(srv: FakeOpenAI) -> list[tuple[str, str]]:
        stream = math_agent(srv).run("20 + 22?", stream=True)
        got = [(str(u.role), u.text) async for u in stream]
        final = await stream.get_final_response()
        return [*got, ("final", final.text)]

    agl.uninstrument()
    plain = await updates(serve(*script))
    agl.instrument(instrumented)
    async with agl.rollout(task_id="t-same") as run:
        traced = await updates(serve(*script))
    assert traced == plain and plain[-1] == ("final", "The sum is 42")
    assert [t.response.get("content") for t in run.trajectory().transitions] == [None, "The sum is 42"]


async def test_a_stream_closed_early_keeps_what_arrived(instrumented: list[str],
                                                        serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve("one two three four five")
    agent = Agent(client=chat_client(srv), name="talker")
    async with agl.rollout(task_id="t-early") as run:
        stream = agent.run("count", stream=True)
        async for update in stream:
            if update.text:
                break
        await stream.close()
    (chat,) = spans(run, "chat")
    assert chat.end_ns >= chat.start_ns > 0 and chat.status != "error"
    assert trace.get_current_span() is trace.INVALID_SPAN


# --------------------------------------------------------------------------- tool outcomes for AIR


async def test_tool_outcomes_become_air_rewards(instrumented: list[str], serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve(
        {"tool_calls": [{"name": "divide", "arguments": {"a": 1, "b": 0}, "id": "c-raise"},
                        {"name": "slow_lookup", "arguments": {"key": "k"}, "id": "c-timeout"},
                        {"name": "abacus", "arguments": {"x": 1}, "id": "c-unknown"},
                        {"name": "add", "arguments": {"a": "two"}, "id": "c-bad-args"},
                        {"name": "add", "arguments": {"a": 1, "b": 1}, "id": "c-ok"}]},
        "Some of that worked.",
    )
    async with agl.rollout(task_id="t-air") as run:
        answer = await run_text(math_agent(srv), "Try everything.", stream=False)
        agl.emit_reward(0.0)
    assert answer == "Some of that worked."  # the agent goes on after each failure

    outcomes = {s.attributes[semconv.GEN_AI_TOOL_CALL_ID]: (s.attributes[semconv.AGL_TOOL_STATUS],
                                                            s.attributes.get(semconv.ERROR_TYPE), s.status)
                for s in spans(run, "execute_tool")}
    assert outcomes == {
        "c-raise": ("exception", "ZeroDivisionError", "error"),
        "c-timeout": ("timeout", "TimeoutError", "error"),
        "c-unknown": ("error", "tool_error", "error"),
        "c-bad-args": ("error", "tool_error", "error"),
        "c-ok": ("ok", None, "unset"),
    }
    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR, credit="discounted"))
    assert [t.reward for t in traj.transitions] == [pytest.approx(-1.0 - 0.8 - 0.5 - 0.5 + 0.1), None]
    # what the model was shown for each call is what the span says
    shown = {m["tool_call_id"]: m["content"] for m in traj.transitions[1].prompt if m["role"] == "tool"}
    assert shown == {s.attributes[semconv.GEN_AI_TOOL_CALL_ID]: s.attributes[semconv.GEN_AI_TOOL_CALL_RESULT]
                     for s in spans(run, "execute_tool")}


async def test_a_tool_invoked_directly_gets_a_span_of_its_own(instrumented: list[str]) -> None:
    async with agl.rollout(task_id="t-direct") as run:
        assert [c.text for c in await add.invoke(arguments={"a": 1, "b": 2}, tool_call_id="d-1")] == ["3"]
        with pytest.raises(ZeroDivisionError):
            await divide.invoke(a=1, b=0)
    ok, failed = spans(run, "execute_tool")
    assert (ok.attributes[semconv.AGL_TOOL_STATUS], ok.attributes[semconv.GEN_AI_TOOL_CALL_RESULT],
            ok.attributes[semconv.GEN_AI_TOOL_CALL_ID]) == ("ok", "3", "d-1")
    assert failed.attributes[semconv.AGL_TOOL_STATUS] == "exception" and failed.status == "error"


# --------------------------------------------------------------------------- structured output


class Answer(BaseModel):
    value: int
    unit: str


@pytest.mark.parametrize("stream", [False, True], ids=["awaited", "streamed"])
async def test_structured_output_is_one_json_transition(instrumented: list[str], serve: Callable[..., FakeOpenAI],
                                                        stream: bool) -> None:
    reply = '{"value": 42, "unit": "apples"}'
    srv = serve(reply)
    agent = Agent(client=chat_client(srv), name="extractor", instructions="Answer in JSON.")
    async with agl.rollout(task_id="t-json") as run:
        if stream:
            response_stream = agent.run("How many apples?", stream=True, options={"response_format": Answer})
            async for _ in response_stream:
                pass
            result = await response_stream.get_final_response()
        else:
            result = await agent.run("How many apples?", options={"response_format": Answer})
    assert result.value == Answer(value=42, unit="apples")
    assert srv.requests[0].body["response_format"]["type"] == "json_schema"
    (chat,) = spans(run, "chat")
    assert chat.attributes[semconv.GEN_AI_OUTPUT_TYPE] == "json"
    (t,) = run.trajectory().transitions
    assert t.response == {"role": "assistant", "content": reply} and t.agent_name == "extractor"
    assert t.response_token_ids == tokenize(reply)


# --------------------------------------------------------------------------- other clients


class EchoClient(BaseChatClient):
    """A user's own chat client, defined after ``instrument()``: answers with the last user text, reversed."""

    OTEL_PROVIDER_NAME = "echo"

    def _inner_get_response(self, *, messages: Sequence[Message], stream: bool, options: Mapping[str, Any],
                            **kwargs: Any) -> Any:
        text = [m.text for m in messages if m.role == "user"][-1][::-1]
        if stream:
            async def chunks() -> AsyncIterable[ChatResponseUpdate]:
                for word in text.split(" "):
                    yield ChatResponseUpdate(role="assistant", contents=[Content.from_text(word + " ")])

            return self._build_response_stream(chunks())

        async def respond() -> ChatResponse:
            return ChatResponse(messages=[Message("assistant", [text])], finish_reason="stop",
                                usage_details={"input_token_count": 3, "output_token_count": 2})

        return respond()


class BrokenClient(BaseChatClient):
    """A user's own chat client whose model fails: before answering (awaited), after its first chunk (streamed)."""

    OTEL_PROVIDER_NAME = "broken"

    def _inner_get_response(self, *, messages: Sequence[Message], stream: bool, options: Mapping[str, Any],
                            **kwargs: Any) -> Any:
        if stream:
            async def chunks() -> AsyncIterable[ChatResponseUpdate]:
                yield ChatResponseUpdate(role="assistant", contents=[Content.from_text("partial ")])
                raise ConnectionError("the model went away")

            return self._build_response_stream(chunks())

        async def respond() -> ChatResponse:
            raise ConnectionError("the model went away")

        return respond()


@pytest.mark.parametrize("stream", [False, True], ids=["awaited", "streamed"])
async def test_a_failed_request_keeps_the_prompt_and_tools_it_sent(instrumented: list[str], stream: bool) -> None:
    agent = Agent(client=BrokenClient(), name="broken", instructions="Answer.", tools=[add])
    async with agl.rollout(task_id="t-broken") as run:
        with pytest.raises(Exception, match="the model went away"):
            await run_text(agent, "what is 2 + 3?", stream)
    (chat,) = spans(run, "chat")
    assert chat.status == "error" and chat.end_ns >= chat.start_ns > 0
    assert "what is 2 + 3?" in chat.attributes[semconv.GEN_AI_INPUT_MESSAGES]
    assert "Answer." in chat.attributes[semconv.GEN_AI_INPUT_MESSAGES]
    assert '"add"' in chat.attributes[semconv.GEN_AI_TOOL_DEFINITIONS]
    assert trace.get_current_span() is trace.INVALID_SPAN


@pytest.mark.parametrize("stream", [False, True], ids=["awaited", "streamed"])
async def test_a_client_of_the_users_own_defined_later_is_traced(instrumented: list[str], stream: bool) -> None:
    class LoudEcho(EchoClient):  # defined while instrumented, calling its parent: still one span per request
        def _inner_get_response(self, **kwargs: Any) -> Any:
            return super()._inner_get_response(**kwargs)

    for client in (EchoClient(), LoudEcho()):
        agent = Agent(client=client, name="echo", instructions="Echo.")
        async with agl.rollout(task_id="t-own") as run:
            answer = await run_text(agent, "abc def", stream)
        assert answer.strip() == "fed cba"
        (chat,) = spans(run, "chat")
        assert chat.attributes[semconv.GEN_AI_PROVIDER_NAME] == "echo"
        (t,) = run.trajectory().transitions
        assert t.agent_name == "echo" and t.prompt == [{"role": "system", "content": "Echo."},
                                                       {"role": "user", "content": "abc def"}]
        assert t.response["content"].strip() == "fed cba" and t.token_source is None
        if not stream:
            assert chat.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 3


@pytest.mark.parametrize("stream", [False, True], ids=["awaited", "streamed"])
async def test_the_responses_api_client_is_one_transition_per_request_with_exact_token_ids(
        instrumented: list[str], serve: Callable[..., FakeOpenAI], stream: bool) -> None:
    srv = serve(tool_call("add", {"a": 1, "b": 2}, "call-r1"), "It is 3.")
    client = OpenAIChatClient(model="fake-model", base_url=srv.url, api_key="x")  # the Responses API client
    agent = Agent(client=client, name="responder", instructions=SYSTEM, tools=[add], default_options={"store": False})
    async with agl.rollout(task_id="t-responses") as run:
        if stream:  # the updates hold the deltas and then the whole text again (output_text.done): read the final
            updates = agent.run("1 + 2?", stream=True)
            _ = [u async for u in updates]
            answer = str((await updates.get_final_response()).text)
        else:
            answer = await run_text(agent, "1 + 2?", stream)
    assert answer == "It is 3."
    requests = [r for r in srv.requests if r.path.endswith("/responses")]
    assert len(requests) == 2 and all(r.body.get("stream", False) is stream for r in requests)
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["responder", "responder"] and traj.skipped == []
    first, second = traj.transitions
    assert first.prompt == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "1 + 2?"}]
    assert first.response["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert second.prompt[-1] == {"role": "tool", "tool_call_id": "call-r1", "content": "3"}
    assert second.response == {"role": "assistant", "content": "It is 3."}
    # the exact ids of what the server tokenised, from the openai plugin's span of each Responses request
    for t, request in zip(traj.transitions, requests, strict=True):
        messages = chat_request(request.body)["messages"]
        assert t.token_source == "response" and t.prompt_token_ids == tokenize(render_prompt(messages))
    assert first.response_token_ids == tokenize('<tool_call> add {"a": 1, "b": 2}')
    assert second.response_token_ids == tokenize("It is 3.")
    chats, clients = spans(run, "chat"), spans(run, "chat", "openai")
    assert len(chats) == len(clients) == 2  # one span each per request, nested: never a doubled transition
    assert [c.parent_id for c in clients] == [c.span_id for c in chats]
    assert [r.headers["traceparent"].split("-")[2] for r in requests] == [c.span_id for c in clients]
    assert [s.attributes[semconv.AGL_TOOL_STATUS] for s in spans(run, "execute_tool")] == ["ok"]


# --------------------------------------------------------------------------- agents inside agents


async def test_an_agent_used_as_a_tool_names_its_own_calls(instrumented: list[str],
                                                           serve: Callable[..., FakeOpenAI]) -> None:
    srv = serve(tool_call("researcher", {"task": "find the capital of France"}, "call-sub"),
                "Paris is the capital of France.", "The researcher says: Paris.")
    researcher = Agent(client=chat_client(srv), name="researcher", description="Finds facts.")
    lead = Agent(client=chat_client(srv), name="lead", tools=[researcher.as_tool()])
    async with agl.rollout(task_id="t-nested") as run:
        answer = await run_text(lead, "What is the capital of France?", stream=False)
    assert answer == "The researcher says: Paris."
    traj = run.trajectory()
    assert [t.agent_name for t in traj.transitions] == ["lead", "researcher", "lead"]
    (span,) = spans(run, "execute_tool")
    assert span.attributes[semconv.GEN_AI_AGENT_NAME] == "lead"
    assert span.attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "Paris is the capital of France."
    assert run.trajectory(builder=agl.TransitionBuilder(agent_match="lead")).transitions[1].response["content"] == (
        "The researcher says: Paris.")


# --------------------------------------------------------------------------- the framework's own tracing


@pytest.mark.parametrize("stream", [False, True], ids=["awaited", "streamed"])
async def test_the_frameworks_own_tracing_coexists_and_never_doubles(
        framework_tracing: InMemorySpanExporter, instrumented: list[str], serve: Callable[..., FakeOpenAI],
        stream: bool) -> None:
    srv = serve({"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "c1"},
                                {"name": "divide", "arguments": {"a": 1, "b": 0}, "id": "c2"}]}, "5, and no quotient.")
    async with agl.rollout(task_id="t-otel") as run:
        answer = await run_text(math_agent(srv), "2 + 3 and 1 / 0?", stream)
        agl.emit_reward(1.0)
    assert answer == "5, and no quotient."

    exported = framework_tracing.get_finished_spans()
    scopes = {(s.instrumentation_scope.name if s.instrumentation_scope else "", s.name) for s in exported}
    framework = {name for scope, name in scopes if scope.startswith("agent_framework")}
    assert {"invoke_agent math", "chat fake-model"} <= framework  # the user's exporters keep the framework's spans
    # agl's spans sit around the framework's: each request is one transition, each tool call one AIR signal
    traj = run.trajectory(builder=agl.TransitionBuilder(air=AIR))
    assert len(traj.transitions) == 2 and [t.agent_name for t in traj.transitions] == ["math", "math"]
    assert traj.transitions[0].prompt[0] == {"role": "system", "content": SYSTEM}  # agl's prompt, system included
    assert traj.transitions[0].reward == pytest.approx(0.1 - 1.0)
    assert all(t.token_source == "response" for t in traj.transitions)
    framework_chats = [s for s in spans(run, "chat", None) if semconv.AGL_PLUGIN not in s.attributes]
    ours = {s.span_id for s in spans(run, "chat")}
    assert len(framework_chats) == 2 and all(s.parent_id in ours for s in framework_chats)
    tools = [s for s in exported if s.name.startswith("execute_tool")]
    assert len(tools) == 2 == len(spans(run, "execute_tool", None))  # one span per tool call, exported too
    failed = next(s for s in tools if s.attributes[semconv.GEN_AI_TOOL_CALL_ID] == "c2")
    assert failed.attributes[semconv.AGL_TOOL_STATUS] == "exception"
    assert "gen_ai.tool.description" in failed.attributes  # the framework's own attributes are on it


# --------------------------------------------------------------------------- uninstrument


def _hooked() -> dict[tuple[Any, str], Any]:
    """Every attribute the plugin may replace, as it is now (classes' own ``__dict__`` entries)."""
    found: dict[tuple[Any, str], Any] = {}

    def family(base: type[Any], attr: str) -> None:
        stack, seen = [base], set()
        while stack:
            cls = stack.pop()
            if cls in seen:
                continue
            seen.add(cls)
            if attr in cls.__dict__:
                found[(cls, attr)] = cls.__dict__[attr]
            stack.extend(cls.__subclasses__())
        found[(base, "__init_subclass__")] = base.__dict__.get("__init_subclass__")

    family(BaseChatClient, "_inner_get_response")
    family(BaseAgent, "run")
    found[(ChatTelemetryLayer, "get_response")] = ChatTelemetryLayer.__dict__["get_response"]
    found[(FunctionTool, "invoke")] = FunctionTool.__dict__["invoke"]
    found[(af_tools, "_auto_invoke_function")] = af_tools._auto_invoke_function
    found[(af_tools, "get_function_span")] = af_tools.get_function_span
    found[(af_observability, "get_function_span")] = af_observability.get_function_span
    return found


def test_uninstrument_restores_every_original() -> None:
    agl.uninstrument()
    before = _hooked()
    assert agl.instrument(["agent_framework"]) == ["agent_framework"]
    during = _hooked()
    changed = [key for key, value in before.items() if during.get(key) is not value]
    assert {(ChatTelemetryLayer, "get_response"), (FunctionTool, "invoke"), (af_tools, "_auto_invoke_function"),
            (Agent, "run"), (BaseChatClient, "__init_subclass__")} <= set(changed)
    raw = [cls for (cls, attr) in changed if attr == "_inner_get_response"]
    assert {c.__name__ for c in raw} >= {"RawOpenAIChatCompletionClient", "RawOpenAIChatClient", "EchoClient"}

    class Later(EchoClient):  # hooked as it is made, and restored with the rest
        def _inner_get_response(self, **kwargs: Any) -> Any:
            return super()._inner_get_response(**kwargs)

    original = inspect.unwrap(Later.__dict__["_inner_get_response"])
    assert Later.__dict__["_inner_get_response"] is not original
    agl.uninstrument()
    after = _hooked()
    assert all(after[key] is value for key, value in before.items())
    assert Later.__dict__["_inner_get_response"] is original
    assert asyncio.run(Agent(client=EchoClient()).run("ab")).text == "ba"  # and the framework still works


@tool
def weather(city: str) -> list[Content]:
    """Two text parts, the shape an MCP tool's result takes."""
    return [Content.from_text(f"{city}: 18C"), Content.from_text("sunny")]


@pytest.mark.parametrize("plugins", [["agent_framework", "openai"], ["agent_framework"]])
async def test_content_given_as_parts_reaches_the_prompt_as_sent(plugins: list[str]) -> None:
    """A tool result of several parts and a user turn of one part reach the prompt as the server got them."""
    agl.uninstrument()
    assert list(agl.instrument(plugins)) == plugins
    try:
        with FakeOpenAI(script=[tool_call("weather", {"city": "Paris"}, "c1"), "18C, sunny."]) as srv:
            agent = Agent(client=chat_client(srv), name="w", instructions=SYSTEM, tools=[weather])
            with agl.rollout("as-sent") as run:
                await agent.run(Message(role="user", contents=[Content.from_text("Weather in Paris?")]))
    finally:
        agl.uninstrument()
    # the framework joins a tool result's text parts into one string; an assistant message without text has
    # content None in a transition, as OpenAI has it
    sent = [[{"content": None, **m} if m["role"] == "assistant" else m for m in r.body["messages"]]
            for r in srv.requests]
    assert sent[1][-1]["content"] == "Paris: 18C\nsunny"
    assert [t.prompt for t in run.trajectory().transitions] == sent


# --------------------------------------------------------------------------- the streamed path's cost


async def test_a_streamed_span_takes_the_frameworks_final_response_built_once(
        instrumented: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream consumed to its end: its span records the response the framework builds from the updates,
    which is built once (agl rebuilt it with ``from_updates``, deep copies and all), and every pull still
    goes through the stream's one pull-context factory with agl's span current inside the framework's."""
    from agent_framework import ResponseStream

    built = []
    original = ChatResponse.from_updates.__func__  # type: ignore[attr-defined]

    def counting(cls: type[ChatResponse], *args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(ChatResponse, "from_updates", classmethod(counting))
    factories: list[int] = []
    pull = ResponseStream._pull_next_update

    async def counted_pull(self: Any, **kwargs: Any) -> Any:
        factories.append(len(self._pull_context_manager_factories))
        return await pull(self, **kwargs)

    monkeypatch.setattr(ResponseStream, "_pull_next_update", counted_pull)
    agent = Agent(client=EchoClient(), name="echo", instructions="Echo.")

    async def consume() -> tuple[str, str]:
        stream = agent.run("abc def", stream=True)
        texts = [u.text async for u in stream]
        return "".join(texts).strip(), (await stream.get_final_response()).text.strip()

    agl.uninstrument()
    assert await consume() == ("fed cba", "fed cba")
    untraced, built[:] = len(built), []
    agl.instrument(instrumented)
    async with agl.rollout(task_id="t-once") as run:
        assert await consume() == ("fed cba", "fed cba")
    (chat,) = spans(run, "chat")
    (t,) = run.trajectory().transitions
    assert t.response["content"].strip() == "fed cba" and chat.status != "error"
    assert chat.attributes[semconv.GEN_AI_OUTPUT_MESSAGES].count("fed") == 1
    assert len(built) == untraced, (built, untraced)  # agl built no response of its own
    assert factories and max(factories) == 1, factories


async def test_the_merged_pull_context_keeps_the_framework_outside_and_agl_inside() -> None:
    from agl_agent_framework.instrumentor import _Nested

    order: list[str] = []

    class Cm:
        def __init__(self, name: str, suppress: bool = False) -> None:
            self.name, self.suppress = name, suppress

        def __enter__(self) -> str:
            order.append(f"enter {self.name}")
            return self.name

        def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
            order.append(f"exit {self.name} {type(exc).__name__ if exc else None}")
            return self.suppress

    merged = _Nested(lambda: Cm("framework"), Cm("agl"))  # the stream's factory: one object for every pull
    with merged() as value:
        assert value == "framework"
    with pytest.raises(KeyError), merged():
        raise KeyError("x")
    with _Nested(lambda: Cm("framework"), Cm("agl", suppress=True))():
        raise KeyError("y")
    assert order == ["enter framework", "enter agl", "exit agl None", "exit framework None",
                     "enter framework", "enter agl", "exit agl KeyError", "exit framework KeyError",
                     "enter framework", "enter agl", "exit agl KeyError", "exit framework None"]
