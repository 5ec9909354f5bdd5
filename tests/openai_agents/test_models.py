"""Every ``Model`` implementation is captured: users' own subclasses (defined before or after ``instrument()``),
subclasses that call ``super()``, the Responses API model, failing and abandoned calls."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from agents import (
    Agent,
    ModelResponse,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    Usage,
    function_tool,
)
from agents.models.interface import Model, ModelTracing
from openai import AsyncOpenAI
from openai.types.responses import Response, ResponseCompletedEvent

import agl_core as agl
from agl_core import semconv
from agl_core.messages import many_from_genai, many_to_genai
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI
from agl_openai_agents import attributes

pytestmark = pytest.mark.usefixtures("instrumented")


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}."


USAGE = {"input_tokens": 11, "output_tokens": 7, "total_tokens": 18,
         "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
         "output_tokens_details": {"reasoning_tokens": 0}}


def call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def text_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def response(output: list[dict[str, Any]], model: str = "scripted-1") -> Response:
    return Response.model_validate({
        "id": "resp_1", "object": "response", "created_at": 0, "model": model, "status": "completed",
        "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "usage": USAGE,
    })


def spans(run: Any, operation: str) -> list[Span]:
    return [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == operation]


def run_streamed(agent: Agent[Any], text: str) -> Any:
    async def go() -> Any:
        result = Runner.run_streamed(agent, text)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(go())


class EarlyModel(Model):
    """A user's model class defined before ``instrument()`` (at import): found among Model's subclasses."""

    model = "early-1"

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        return ModelResponse(output=[response([text_item("early")]).output[0]], usage=Usage(requests=1),
                             response_id=None)

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        yield ResponseCompletedEvent(type="response.completed", sequence_number=0,
                                     response=response([text_item("early")], model="early-1"))


# --------------------------------------------------------------------------- users' own models


def scripted_model_class() -> type[Model]:
    """A user's Model subclass, defined only now: after ``instrument()``."""

    class ScriptedModel(Model):
        def __init__(self, replies: list[list[dict[str, Any]]]) -> None:
            self.model = "scripted-1"
            self.replies = replies
            self.inputs: list[Any] = []

        async def get_response(self, system_instructions: str | None, input: Any, model_settings: ModelSettings,
                               tools: list[Any], output_schema: Any, handoffs: list[Any], tracing: ModelTracing,
                               **kwargs: Any) -> ModelResponse:
            self.inputs.append(input)
            final = response(self.replies.pop(0))
            usage = Usage(requests=1, input_tokens=11, output_tokens=7, total_tokens=18)
            return ModelResponse(output=final.output, usage=usage, response_id=final.id)

        async def stream_response(self, system_instructions: str | None, input: Any, model_settings: ModelSettings,
                                  tools: list[Any], output_schema: Any, handoffs: list[Any], tracing: ModelTracing,
                                  **kwargs: Any) -> AsyncIterator[Any]:
            self.inputs.append(input)
            yield ResponseCompletedEvent(type="response.completed", sequence_number=0,
                                         response=response(self.replies.pop(0)))

    return ScriptedModel


@pytest.mark.parametrize("mode", ["run", "streamed"])
def test_a_users_model_class_defined_after_instrument_is_captured(mode: str) -> None:
    model_class = scripted_model_class()
    model = model_class([[call_item("c1", "get_weather", '{"city":"Oslo"}')], [text_item("Sunny in Oslo.")]])
    agent = Agent(name="Forecaster", instructions="Be brief.", tools=[get_weather], model=model)
    with agl.rollout(task_id="custom") as run:
        result = run_streamed(agent, "Weather in Oslo?") if mode == "streamed" else \
            asyncio.run(Runner.run(agent, "Weather in Oslo?"))
    assert result.final_output == "Sunny in Oslo."
    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(tool_ok=1.0)))
    assert [t.agent_name for t in traj.transitions] == ["Forecaster", "Forecaster"]
    assert [t.model for t in traj.transitions] == ["scripted-1", "scripted-1"]
    first, second = traj.transitions
    assert first.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    assert first.response["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    assert second.prompt[2:] == [
        {"role": "assistant", "content": None, "tool_calls": first.response["tool_calls"]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny in Oslo."},
    ]
    assert second.response == {"role": "assistant", "content": "Sunny in Oslo."}
    assert first.reward == 1.0  # the tool span is tied to the call that asked for it
    for chat in spans(run, semconv.OP_CHAT):
        assert chat.name == "chat scripted-1"
        assert chat.attributes[semconv.GEN_AI_PROVIDER_NAME] == "_OTHER"
        assert chat.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 11
        assert chat.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 7
        assert chat.attributes[semconv.GEN_AI_RESPONSE_ID] == "resp_1"


def test_a_model_class_defined_before_instrument_is_captured() -> None:
    agent = Agent(name="Early", model=EarlyModel())
    with agl.rollout(task_id="early") as run:
        assert asyncio.run(Runner.run(agent, "hi")).final_output == "early"
        assert run_streamed(agent, "hi").final_output == "early"
    traj = run.trajectory()
    assert [(t.agent_name, t.model, t.response["content"]) for t in traj.transitions] == \
        [("Early", "early-1", "early")] * 2


def test_a_subclass_calling_super_makes_one_span_per_call(chat_model: Callable[..., Any]) -> None:
    class AuditedModel(OpenAIChatCompletionsModel):
        calls = 0

        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            type(self).calls += 1
            return await super().get_response(*args, **kwargs)

    with FakeOpenAI(script=["Hello there."]) as srv:
        base = chat_model(srv)
        model = AuditedModel(model="audited-1", openai_client=base._client)
        with agl.rollout(task_id="audited") as run:
            result = asyncio.run(Runner.run(Agent(name="Audited", model=model), "hi"))
    assert result.final_output == "Hello there." and AuditedModel.calls == 1
    (chat,) = spans(run, semconv.OP_CHAT)
    assert chat.name == "chat audited-1" and chat.attributes[semconv.GEN_AI_AGENT_NAME] == "Audited"
    assert chat.attributes[semconv.GEN_AI_PROVIDER_NAME] == "openai"  # a subclass of the SDK's OpenAI model
    assert len(run.trajectory().transitions) == 1


def test_a_failing_model_call_passes_its_exception_through_and_is_skipped_with_the_reason() -> None:
    class BrokenModel(Model):
        model = "broken-1"

        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            raise ConnectionError("backend down")

        async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            raise ConnectionError("backend down")
            yield  # an async generator

    agent = Agent(name="Fragile", model=BrokenModel())
    for call in (lambda: asyncio.run(Runner.run(agent, "hi")), lambda: run_streamed(agent, "hi")):
        with pytest.raises(ConnectionError, match="backend down"), agl.rollout(task_id="broken") as run:
            call()
        (chat,) = spans(run, semconv.OP_CHAT)
        assert chat.status == "error" and chat.attributes[semconv.ERROR_TYPE] == "ConnectionError"
        traj = run.trajectory()
        assert traj.transitions == [] and "the call failed (ConnectionError)" in traj.skipped[0].reason


def test_a_stream_abandoned_midway_ends_its_span_with_what_arrived(chat_model: Callable[..., Any]) -> None:
    from agl_openai_agents.instrumentor import OpenAIAgentsInstrumentor

    async def first_event(model: Any) -> Any:
        stream = model.stream_response(None, "hi", ModelSettings(), [], None, [], ModelTracing.DISABLED,
                                       previous_response_id=None, conversation_id=None, prompt=None)
        event = await stream.__anext__()
        await stream.aclose()
        return event

    with FakeOpenAI(script=["one two three four"]) as srv:
        with agl.rollout(task_id="abandoned") as run:
            event = asyncio.run(first_event(chat_model(srv)))
    assert event is not None
    (chat,) = spans(run, semconv.OP_CHAT)
    assert chat.end_ns >= chat.start_ns and chat.status == "unset"
    assert chat.attributes[semconv.GEN_AI_REQUEST_STREAM] is True
    assert OpenAIAgentsInstrumentor()._bridge is not None and not OpenAIAgentsInstrumentor()._bridge.nodes


def test_the_provider_is_named_by_the_sdks_model_classes() -> None:
    class LiteLLMStyle(EarlyModel):  # what agents.extensions.models.litellm_model.LitellmModel is to agl
        model = "anthropic/claude-x"

    LiteLLMStyle.__module__ = "agents.extensions.models.litellm_model"
    with FakeOpenAI() as srv:
        chat = OpenAIChatCompletionsModel("m", AsyncOpenAI(base_url=srv.url, api_key="not-a-key"))
    names = [attributes.request_attributes(m, None, "hi", None, [], [], False)[semconv.GEN_AI_PROVIDER_NAME]
             for m in (chat, LiteLLMStyle(), EarlyModel())]
    assert names == ["openai", "anthropic", "_OTHER"]


# --------------------------------------------------------------------------- the Responses API model


class FakeResponses:
    """``POST /v1/responses`` on 127.0.0.1: scripted output items, as JSON or as a server-sent event stream."""

    def __init__(self, replies: list[list[dict[str, Any]]]) -> None:
        self.replies = replies
        self.requests: list[dict[str, Any]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                return None

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"body": body, "headers": {k.lower(): v for k, v in self.headers.items()}})
                data = response(fake.replies.pop(0), model=body["model"]).model_dump(mode="json")
                if body.get("stream"):
                    created = {**data, "output": [], "status": "in_progress"}
                    events = [{"type": "response.created", "sequence_number": 0, "response": created},
                              {"type": "response.completed", "sequence_number": 1, "response": data}]
                    payload = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode()
                                       + b"\n\n" for e in events)
                    content_type = "text/event-stream"
                else:
                    payload, content_type = json.dumps(data).encode(), "application/json"
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler

    def __enter__(self) -> FakeResponses:
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.mark.parametrize("mode", ["run", "streamed"])
def test_the_responses_api_model_is_captured(mode: str) -> None:
    replies = [[call_item("r1", "get_weather", '{"city":"Rome"}')], [text_item("Sunny in Rome.")]]
    with FakeResponses(replies) as srv:
        client = AsyncOpenAI(base_url=srv.url, api_key="not-a-key", max_retries=0)
        agent = Agent(name="Roman", instructions="Be brief.", tools=[get_weather],
                      model=OpenAIResponsesModel(model="resp-model", openai_client=client))
        with agl.rollout(task_id="responses") as run:
            result = run_streamed(agent, "Weather in Rome?") if mode == "streamed" else \
                asyncio.run(Runner.run(agent, "Weather in Rome?"))
    assert result.final_output == "Sunny in Rome."
    traj = run.trajectory()
    assert [(t.agent_name, t.model) for t in traj.transitions] == [("Roman", "resp-model")] * 2
    assert traj.transitions[0].prompt == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Weather in Rome?"}]
    assert traj.transitions[1].prompt[-1] == {"role": "tool", "tool_call_id": "r1", "content": "Sunny in Rome."}
    assert traj.transitions[1].response == {"role": "assistant", "content": "Sunny in Rome."}
    chats = spans(run, semconv.OP_CHAT)
    assert [c.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] for c in chats] == [11, 11]
    # the Responses API goes through no agl openai span, so this span's traceparent is what reaches the server
    assert [r["headers"]["traceparent"] for r in srv.requests] == [f"00-{c.trace_id}-{c.span_id}-01" for c in chats]


# --------------------------------------------------------------------------- input items -> chat messages


def test_input_items_become_the_chat_messages_the_sdks_own_converter_makes() -> None:
    from agents.models.chatcmpl_converter import Converter

    items: list[Any] = [
        {"role": "user", "content": "Look at this."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "And this picture:"},
            {"type": "input_image", "image_url": "https://example.invalid/cat.png", "detail": "auto"}]},
        text_item("A cat."),
        call_item("c1", "lookup", '{"q": "cat"}'),
        call_item("c2", "lookup", '{"q": "dog"}'),
        {"type": "function_call_output", "call_id": "c1", "output": "felis"},
        {"type": "function_call_output", "call_id": "c2", "output": "canis"},
        {"role": "developer", "content": "Be nice."},
        {"role": "system", "content": [{"type": "input_text", "text": "Stay on topic."}]},
        {"role": "assistant", "content": "Noted."},
        call_item("c3", "lookup", "{}"),
        {"type": "function_call_output", "call_id": "c3", "output": "nothing"},
    ]
    theirs = [{"role": "system", "content": "Sys."}, *Converter.items_to_messages(items)]
    ours = attributes.input_messages("Sys.", items)
    # what a transition holds: both through the span format and back
    assert many_from_genai(many_to_genai(ours)) == many_from_genai(many_to_genai(theirs))
    assert attributes.input_messages(None, "plain") == Converter.items_to_messages("plain")


def test_tool_definitions_are_the_ones_the_chat_model_sends(chat_model: Callable[..., Any]) -> None:
    from agents.models.chatcmpl_converter import Converter

    billing = Agent(name="Billing agent")
    agent = Agent(name="Triage", tools=[get_weather], handoffs=[billing])
    from agents import handoff

    handoffs = [handoff(billing)]
    ours = attributes.tool_definitions(agent.tools, handoffs)
    theirs = [Converter.tool_to_openai(agent.tools[0]), Converter.convert_handoff_tool(handoffs[0])]
    for mine, sent in zip(ours, theirs, strict=True):
        assert mine["type"] == "function"
        assert {k: mine["function"][k] for k in ("name", "description", "parameters")} == \
            {k: sent["function"][k] for k in ("name", "description", "parameters")}



# --------------------------------------------------------------------------- LitellmModel (issue 16)


@pytest.mark.parametrize("mode", ["run", "streamed"])
def test_a_litellm_model_talking_to_a_vllm_style_server_keeps_its_token_ids(instrumented: Any, mode: str) -> None:
    """LiteLLM keeps the server's ``prompt_token_ids`` and ``token_ids`` (which ``LitellmModel`` drops when it
    converts the reply): the transition has them, exact, with no gateway."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of LiteLLM's price list
    pytest.importorskip("litellm", reason="the SDK's litellm extra (tests/openai_agents installs it)")
    from agents.extensions.models import litellm_model

    from agl_core.testing import render_prompt, tokenize

    with FakeOpenAI(["Paris is the capital."], return_token_ids=True) as srv:
        model = litellm_model.LitellmModel(model="openai/fake-model", base_url=srv.url, api_key="not-a-key")
        agent = Agent(name="Geographer", instructions="Answer briefly.", model=model)

        async def go() -> Any:
            if mode == "run":
                return await Runner.run(agent, "Capital of France?")
            result = Runner.run_streamed(agent, "Capital of France?")
            async for _ in result.stream_events():
                pass
            return result

        with agl.rollout(task_id="litellm") as run:
            assert asyncio.run(go()).final_output == "Paris is the capital."
    (transition,) = run.trajectory().transitions
    assert transition.agent_name == "Geographer"
    assert transition.token_source == "response"
    assert transition.response_token_ids == tokenize("Paris is the capital.")
    assert transition.prompt_token_ids == tokenize(render_prompt(srv.requests[0].body["messages"]))
