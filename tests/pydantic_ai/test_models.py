"""Every ``Model`` class is captured: the OpenAI chat and Responses models, the test models, a user's own
class defined after ``instrument()``, wrappers (one span, not two), direct model requests, streams cut short."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.usage import RequestUsage

import agl_core as agl
from agl_core import semconv
from agl_core.openai_client.responses_items import chat_request
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

from .fakes import by_plugin, chat_model, spans

pytestmark = pytest.mark.usefixtures("instrumented")


@pytest.mark.parametrize("stream", [False, True], ids=["run_sync", "run_stream"])
def test_the_responses_api_model_is_one_transition_per_request_with_exact_token_ids(stream: bool) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    script = [{"tool_calls": [{"name": "lookup", "arguments": '{"city":"Rome"}', "id": "r1"}]}, "Sunny in Rome."]
    with FakeOpenAI(script, return_token_ids=True) as srv:
        client = AsyncOpenAI(base_url=srv.url, api_key="not-a-key", max_retries=0)
        model = OpenAIResponsesModel("fake-model", provider=OpenAIProvider(openai_client=client))
        agent: Agent[None, str] = Agent(model, name="roman", instructions="Be brief.")

        @agent.tool_plain
        def lookup(city: str) -> str:
            return f"{city}: sunny"

        async def streamed() -> str:
            async with agent.run_stream("Weather in Rome?") as result:
                return await result.get_output()

        with agl.rollout(task_id="responses") as run:
            output = asyncio.run(streamed()) if stream else agent.run_sync("Weather in Rome?").output
    assert output == "Sunny in Rome."
    requests = [r for r in srv.requests if r.path.endswith("/responses")]
    assert len(requests) == 2 and all(r.body.get("stream", False) is stream for r in requests)
    traj = run.trajectory()
    assert [(t.agent_name, t.model) for t in traj.transitions] == [("roman", "fake-model")] * 2
    first, second = traj.transitions
    assert first.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"}]
    assert first.response["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"city":"Rome"}'}
    assert second.prompt[-1] == {"role": "tool", "tool_call_id": "r1", "content": "Rome: sunny"}
    assert second.response == {"role": "assistant", "content": "Sunny in Rome."}
    # the exact ids of what the server tokenised, through agl's openai plugin beneath the framework's model
    for t, request in zip(traj.transitions, requests, strict=True):
        messages = chat_request(request.body)["messages"]
        assert t.token_source == "response" and t.prompt_token_ids == tokenize(render_prompt(messages))
    assert first.response_token_ids == tokenize('<tool_call> lookup {"city":"Rome"}')
    assert second.response_token_ids == tokenize("Sunny in Rome.")
    chats = spans(run, semconv.OP_CHAT)
    outer, inner = by_plugin(chats, "pydantic_ai"), by_plugin(chats, "openai")
    assert len(outer) == len(inner) == 2  # one span each per request, nested: never a doubled transition
    assert [c.parent_id for c in inner] == [c.span_id for c in outer]
    # the openai plugin's span's traceparent goes out, nested in the framework span: a gateway joins on it
    assert [r.headers["traceparent"] for r in requests] == [f"00-{c.trace_id}-{c.span_id}-01" for c in inner]


def test_the_callers_own_traceparent_is_kept() -> None:
    mine = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    with FakeOpenAI(script=["ok"]) as srv:
        agent: Agent[None, str] = Agent(chat_model(srv), model_settings={"extra_headers": {"TraceParent": mine}})
        with agl.rollout(task_id="mine"):
            assert agent.run_sync("hi").output == "ok"
    assert srv.requests[0].headers["traceparent"] == mine


class Scripted(Model):
    """A user's own model class, defined at import time (before the test instruments)."""

    def __init__(self, answers: list[str]) -> None:
        super().__init__()
        self.answers = answers

    @property
    def model_name(self) -> str:
        return "scripted-1"

    @property
    def system(self) -> str:
        return "scripted"

    async def request(self, messages: list[Any], model_settings: Any,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        return ModelResponse(parts=[TextPart(self.answers.pop(0))], model_name=self.model_name,
                             usage=RequestUsage(input_tokens=3, output_tokens=2))


def test_a_users_model_class_its_subclass_defined_later_and_super_calls_make_one_span_each() -> None:
    class Louder(Scripted):  # defined after instrument(): wrapped through Model.__init_subclass__
        async def request(self, *args: Any, **kwargs: Any) -> ModelResponse:
            response = await super().request(*args, **kwargs)  # the parent's wrapped request: no second span
            return ModelResponse(parts=[TextPart(response.parts[0].content.upper())], model_name="scripted-1")

    with agl.rollout(task_id="custom") as run:
        assert Agent(Scripted(["hello"]), name="plain").run_sync("hi").output == "hello"
        assert Agent(Louder(["hello"]), name="loud").run_sync("hi").output == "HELLO"
    traj = run.trajectory()
    assert [(t.agent_name, t.model, t.response["content"]) for t in traj.transitions] == [
        ("plain", "scripted-1", "hello"), ("loud", "scripted-1", "HELLO")]
    assert [c.attributes[semconv.GEN_AI_PROVIDER_NAME] for c in spans(run, semconv.OP_CHAT)] == ["scripted"] * 2
    assert [c.attributes.get(semconv.GEN_AI_USAGE_INPUT_TOKENS) for c in spans(run, semconv.OP_CHAT)] == [3, 0]


class _Stream(StreamedResponse):
    def __init__(self, params: ModelRequestParameters, words: list[str]) -> None:
        super().__init__(model_request_parameters=params)
        self.words = words

    async def _get_event_iterator(self) -> AsyncIterator[Any]:
        for word in self.words:
            for event in self._parts_manager.handle_text_delta(vendor_part_id="t", content=word):
                yield event

    @property
    def model_name(self) -> str:
        return "streamer-1"

    @property
    def provider_name(self) -> str:
        return "streamer"

    @property
    def provider_url(self) -> str | None:
        return None

    @property
    def timestamp(self) -> datetime:
        return datetime(2026, 1, 1, tzinfo=UTC)


def test_a_users_streaming_model_is_captured_and_a_stream_left_early_is_a_failed_call() -> None:
    class Streamer(Scripted):
        @asynccontextmanager
        async def request_stream(self, messages: list[Any], model_settings: Any,
                                 model_request_parameters: ModelRequestParameters,
                                 run_context: Any = None) -> AsyncIterator[StreamedResponse]:
            yield _Stream(model_request_parameters, ["Hello", " there", " friend"])

    agent: Agent[None, str] = Agent(Streamer([]), name="streamer")

    async def full() -> str:
        async with agent.run_stream("hi") as result:
            return await result.get_output()

    async def early() -> None:
        async with agent.run_stream("hi") as result:
            async for _ in result.stream_text(delta=True, debounce_by=None):
                break

    with agl.rollout(task_id="stream") as run:
        assert asyncio.run(full()) == "Hello there friend"
    (t,) = run.trajectory().transitions
    assert t.response == {"role": "assistant", "content": "Hello there friend"} and t.agent_name == "streamer"
    (chat,) = spans(run, semconv.OP_CHAT)
    assert chat.attributes[semconv.GEN_AI_REQUEST_STREAM] is True and chat.status != "error"

    with agl.rollout(task_id="early") as run:
        asyncio.run(early())
    traj = run.trajectory()
    chats = spans(run, semconv.OP_CHAT)
    assert len(chats) == 1
    # the stream was left before the model finished: a failed call, never trained on as if it were complete
    assert chats[0].status == "error"
    assert traj.transitions == [] and "failed" in traj.skipped[0].reason


def test_wrappers_make_one_span_and_a_fallback_records_the_model_that_answered() -> None:
    from pydantic_ai.models.fallback import FallbackModel
    from pydantic_ai.models.instrumented import InstrumentedModel

    with FakeOpenAI(script=[{"status": 500, "error": "down"}, "from backup"]) as srv:
        fallback = FallbackModel(chat_model(srv, "primary"), chat_model(srv, "backup"))
        with agl.rollout(task_id="fallback") as run:
            assert Agent(fallback, name="resilient").run_sync("hi").output == "from backup"
            assert Agent(InstrumentedModel(Scripted(["x"])), name="wrapped").run_sync("hi").output == "x"
    traj = run.trajectory()
    assert [(t.agent_name, t.model) for t in traj.transitions] == [("resilient", "backup"), ("wrapped", "scripted-1")]
    ours = by_plugin(spans(run, semconv.OP_CHAT), "pydantic_ai")
    assert len(ours) == 2  # the wrapper's, not one per wrapped model
    inner = by_plugin(spans(run, semconv.OP_CHAT), "openai")
    assert [s.status for s in inner] == ["error", "unset"] and {s.parent_id for s in inner} == {ours[0].span_id}


def test_the_test_models_and_direct_requests_are_captured_and_their_settings_left_unchanged() -> None:
    from pydantic_ai.direct import model_request

    seen: list[Any] = []

    def reply(messages: list[Any], info: AgentInfo) -> ModelResponse:
        seen.append(info.model_settings)
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("add", {"a": 1, "b": 2}, tool_call_id="a1")])
        return ModelResponse(parts=[TextPart("3")])

    agent: Agent[None, str] = Agent(FunctionModel(reply), name="adder", model_settings={"temperature": 0.5})

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        return a + b

    with agl.rollout(task_id="test-models") as run:
        assert agent.run_sync("1+2?").output == "3"
        assert Agent(TestModel(custom_output_text="fine"), name="tested").run_sync("hi").output == "fine"
        reply_ = asyncio.run(model_request(Scripted(["direct"]), [ModelRequest.user_text_prompt("hi")]))
        assert reply_.parts[0].content == "direct"
    assert all("extra_headers" not in (s or {}) for s in seen)  # no traceparent pushed into a model without HTTP
    traj = run.trajectory()
    assert [(t.agent_name, t.model) for t in traj.transitions] == [
        ("adder", "function:reply:"), ("adder", "function:reply:"), ("tested", "test"), (None, "scripted-1")]
    first = spans(run, semconv.OP_CHAT)[0]
    assert first.attributes[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert traj.transitions[1].prompt[-1] == {"role": "tool", "tool_call_id": "a1", "content": "3"}


@pytest.mark.filterwarnings("ignore:`RetryPromptPart` is deprecated")  # still in stored histories
def test_the_memoised_input_json_is_the_plain_conversion() -> None:
    """``input_messages_json`` (the run's memo, instructions spliced in) says exactly what converting every
    message says, and the conversion says what Pydantic AI's OpenAI chat model puts on the wire."""
    import json

    from pydantic_ai.messages import RetryPromptPart, SystemPromptPart, ThinkingPart, ToolReturnPart, UserPromptPart

    from agl_pydantic_ai import attributes

    first = ModelRequest(parts=[SystemPromptPart("sys"), UserPromptPart("hi")], instructions="Be brief.")
    call = ModelResponse(parts=[ThinkingPart("hmm"), TextPart("a"), TextPart("b"),
                                ToolCallPart("f", {"x": 1}, tool_call_id="c1")])
    back = ModelRequest(parts=[ToolReturnPart("f", "1", tool_call_id="c1"),
                               RetryPromptPart("bad", tool_name="f", tool_call_id="c2"), RetryPromptPart("again")],
                        instructions="Be brief.")
    only_system = ModelRequest(parts=[SystemPromptPart("sys")], instructions="Be brief.")
    memo = attributes.RunMemo()
    for history in ([first], [first, call, back], [first, call, back, call, back], [only_system, back], [call],
                    [ModelRequest(parts=[UserPromptPart("x")])], []):
        for _ in range(2):  # the second time from the memo
            plain = json.loads(attributes.input_messages_json(history))
            assert json.loads(attributes.input_messages_json(history, memo)) == plain, history
            assert plain == attributes.genai_input(history)
    assert attributes.input_messages([first, call, back]) == [
        {"role": "system", "content": "sys"}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning_content": "hmm", "content": "ab", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": RetryPromptPart("bad", tool_name="f").model_response()},
        {"role": "user", "content": RetryPromptPart("again").model_response()}]
    call.parts.append(TextPart("c"))  # an edited message is encoded again, never answered from the memo
    assert json.loads(attributes.input_messages_json([call], memo))[0]["parts"][1] == {"type": "text",
                                                                                       "content": "abc"}


def test_the_runs_memo_answers_within_its_run_and_keeps_no_message_past_it() -> None:
    """The JSON memo lives with its agent run: the second request's history is answered from it, the same
    JSON the plain conversion gives, and once the run is over agl holds none of the run's messages."""
    import gc
    import weakref

    from agl_pydantic_ai import attributes

    converted: list[Any] = []
    plain = attributes._message_json

    def counting(message: Any) -> str:
        converted.append(message)
        return plain(message)

    def reply(messages: list[Any], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("add", {"a": 1, "b": 2}, tool_call_id="a1")])
        return ModelResponse(parts=[TextPart("3")])

    agent: Agent[None, str] = Agent(FunctionModel(reply), name="adder", instructions="Add.")

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        return a + b

    attributes._message_json = counting
    try:
        with agl.rollout(task_id="memo") as run:
            result = agent.run_sync("1+2?")
            history = result.all_messages()
            refs = [weakref.ref(m) for m in history]
            del result
    finally:
        attributes._message_json = plain
    second = spans(run, semconv.OP_CHAT)[1]
    assert second.attributes[semconv.GEN_AI_INPUT_MESSAGES] == json.dumps(
        attributes.genai_input(history[:3]), ensure_ascii=False, separators=(",", ":"))
    # the first request is encoded once (with the instructions), the first response never (its output JSON
    # is remembered): the second request converts only the tool's return
    assert converted == [history[2]]
    del history, converted[:]
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_a_responses_output_json_and_its_remembered_history_json_are_the_plain_conversions() -> None:
    """The output JSON is derived from the history JSON (the finish reason spliced in), and the history JSON is
    remembered in the run's memo for the next request: both say, byte for byte, what converting the message says."""
    from pydantic_ai.messages import ThinkingPart

    from agl_core.encoding import dumps
    from agl_pydantic_ai import attributes

    memo = attributes.RunMemo()
    for response in (ModelResponse(parts=[ToolCallPart("f", {"x": 1}, tool_call_id="c1")], finish_reason="tool_call"),
                     ModelResponse(parts=[ThinkingPart("hmm"), TextPart("done"), ToolCallPart("g", "{}", "c2")]),
                     ModelResponse(parts=[TextPart("a"), TextPart("b")], finish_reason="length")):
        attrs = attributes.response_attributes(response, "m", memo)
        message = attributes.response_message(response)
        reason = attributes._finish_reason(response)
        assert attrs[semconv.GEN_AI_OUTPUT_MESSAGES] == dumps([{**message, "finish_reason": reason}
                                                               if reason else message])
        assert memo.messages[id(response)][2] == attributes._message_json(response) == dumps(message)


def test_tool_definitions_are_encoded_once_per_schema_not_per_request() -> None:
    """Pydantic AI builds a new ``ToolDefinition`` for every request around the tool's one schema dict: the
    definitions' JSON is made once for it; another schema (or name, or description) is another definition."""
    from pydantic_ai.tools import ToolDefinition

    from agl_pydantic_ai import attributes

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}

    def params(**kwargs: Any) -> ModelRequestParameters:
        return ModelRequestParameters(function_tools=[ToolDefinition(**{"name": "f", "description": "F.",
                                                                         "parameters_json_schema": schema,
                                                                         **kwargs})])

    first = attributes.tool_definitions_json(params())
    again = attributes.tool_definitions_json(params())
    assert again is first  # the same text object: nothing encoded again
    assert json.loads(first) == [{"type": "function", "function": {"name": "f", "description": "F.",
                                                                   "parameters": schema}}]
    other = {"type": "object", "properties": {"y": {"type": "string"}}}
    assert json.loads(attributes.tool_definitions_json(params(parameters_json_schema=other)))[0]["function"][
        "parameters"] == other
    assert json.loads(attributes.tool_definitions_json(params(description="G.")))[0]["function"][
        "description"] == "G."
