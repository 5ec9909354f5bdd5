"""The ``openai`` plugin on ``client.responses``: one chat span per Responses call, sync, async, streamed, parsed.

The network edge is a small Responses server on 127.0.0.1 that answers the way the
Responses API does (a ``Response`` object, or its server-sent events); the client is the
real OpenAI SDK, whose own parsing checks that the answers are well formed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from openai.resources.responses import AsyncResponses, Responses
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from pydantic import BaseModel

from agl_core import collector, guard, semconv
from agl_core.openai_client import OpenAIInstrumentor
from agl_core.openai_client.responses_items import ItemError, input_messages
from agl_core.transitions import TransitionBuilder

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PROMPT_IDS = [5, 6, 7]
ANSWER_IDS = [11, 12]


def _response(body: dict[str, Any], output: list[dict[str, Any]], ids: bool) -> dict[str, Any]:
    reply: dict[str, Any] = {
        "id": "resp_1", "object": "response", "created_at": 0, "status": "completed", "model": body.get("model"),
        "output": output, "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "metadata": {}, "parallel_tool_calls": True, "temperature": None, "top_p": None, "tool_choice": "auto",
        "tools": body.get("tools") or [],
        "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    }
    if ids:  # a server that returns token ids in the body, as vLLM's return_token_ids does
        reply["prompt_token_ids"], reply["token_ids"] = PROMPT_IDS, ANSWER_IDS
    return reply


def _output(reply: Any) -> list[dict[str, Any]]:
    if isinstance(reply, str):
        return [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": reply, "annotations": []}]}]
    return [{"type": "function_call", "id": "fc_1", "call_id": reply["call_id"], "name": reply["name"],
             "arguments": reply["arguments"], "status": "completed"}]


def _events(body: dict[str, Any], reply: Any, ids: bool) -> Iterator[dict[str, Any]]:
    final = _response(body, _output(reply), ids)
    shell = {**final, "status": "in_progress", "output": [], "usage": None}
    yield {"type": "response.created", "response": shell}
    item = final["output"][0]
    yield {"type": "response.output_item.added", "output_index": 0, "item": {**item, "status": "in_progress"}}
    if isinstance(reply, str):
        for word in reply.split(" "):
            yield {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0,
                   "delta": word, "logprobs": []}
    yield {"type": "response.output_item.done", "output_index": 0, "item": item}
    yield {"type": "response.completed", "response": final}


class ResponsesServer:
    """Answers ``POST /v1/responses`` with the scripted replies in turn (a text, or a function call dict)."""

    def __init__(self, *replies: Any, ids: bool = False, cut_stream: bool = False) -> None:
        self.replies = list(replies)
        self.ids = ids
        self.cut_stream = cut_stream
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                server.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                reply = server.replies.pop(0) if server.replies else "Paris."
                if body.get("stream"):
                    events = list(_events(body, reply, server.ids))
                    if server.cut_stream:
                        events = events[:-1]
                    data = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(
                        {**e, "sequence_number": i}).encode() + b"\n\n" for i, e in enumerate(events))
                    kind = "text/event-stream"
                else:
                    data, kind = json.dumps(_response(body, _output(reply), server.ids)).encode(), "application/json"
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    saved = collector._t.explicit
    provider = TracerProvider()
    exp = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    plugin = OpenAIInstrumentor()
    if plugin.is_instrumented_by_opentelemetry:
        plugin.uninstrument()
    plugin.instrument(tracer_provider=provider, skip_dep_check=True)
    guard.reset_fault_counts()
    try:
        yield exp
    finally:
        plugin.uninstrument()
        collector._t.explicit = saved
        collector._t.tracer = None


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[ResponsesServer] = []

    def start(*replies: Any, **kw: Any) -> ResponsesServer:
        servers.append(ResponsesServer(*replies, **kw))
        return servers[-1]

    yield start
    for srv in servers:
        srv.close()


def _client(srv: ResponsesServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)


def _only(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def _json(span: ReadableSpan, key: str) -> Any:
    return json.loads(str((span.attributes or {})[key]))


def _traceparent(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"


def _transition(span: ReadableSpan) -> Any:
    (t,) = TransitionBuilder().build_from_spans([collector.to_record(span)], rollout_id="r", task_id="t").transitions
    return t


def test_a_plain_call_is_one_chat_span_with_the_prompt_as_chat_messages(
        exporter: InMemorySpanExporter, serve: Any) -> None:
    srv = serve("Paris is the capital.")
    reply = _client(srv).responses.create(model="m-1", instructions="Be brief.", input="Capital of France?",
                                          temperature=0.5, max_output_tokens=32)
    assert reply.output_text == "Paris is the capital."
    span = _only(exporter)
    attrs = span.attributes or {}
    assert span.name == "chat m-1" and attrs[semconv.GEN_AI_OPERATION_NAME] == "chat"
    assert attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 32 and attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 3 and attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == 2
    assert attrs[semconv.GEN_AI_RESPONSE_ID] == "resp_1" and attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    headers, _ = srv.requests[-1]
    assert headers["traceparent"] == _traceparent(span)  # what the gateway keys its token ids on
    t = _transition(span)
    assert t.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert t.response == {"role": "assistant", "content": "Paris is the capital."}


def test_a_tool_call_and_its_output_round_trip(exporter: InMemorySpanExporter, serve: Any) -> None:
    srv = serve({"call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}, "Sunny.")
    client = _client(srv)
    first = client.responses.create(model="m", input="Weather in Paris?", tools=[TOOL])  # type: ignore[list-item]
    (call,) = first.output
    second = client.responses.create(model="m", tools=[TOOL], input=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather in Paris?"}, call,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert second.output_text == "Sunny."
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    t1, t2 = (_transition(s) for s in spans)
    assert t1.response["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert (spans[0].attributes or {})[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("tool_calls",)
    assert _json(spans[0], semconv.GEN_AI_TOOL_DEFINITIONS)[0]["function"]["name"] == "get_weather"
    assert t2.prompt == [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": t1.response["tool_calls"]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


async def test_async_and_streamed_calls(exporter: InMemorySpanExporter, serve: Any) -> None:
    srv = serve("One two three", "Four five", ids=True)
    client = openai.AsyncOpenAI(base_url=srv.url, api_key="x", max_retries=0)
    reply = await client.responses.create(model="m", input="count")
    assert reply.output_text == "One two three"
    stream = await client.responses.create(model="m", input="count", stream=True)
    kinds = [event.type async for event in stream]
    assert kinds[-1] == "response.completed"
    plain, streamed = exporter.get_finished_spans()
    for span, text in ((plain, "One two three"), (streamed, "Four five")):
        t = _transition(span)
        assert t.response["content"] == text and span.status.status_code is StatusCode.UNSET
        # token ids the server put in the body are picked up (a gateway's records win over them when joined)
        assert (t.prompt_token_ids, t.response_token_ids, t.token_source) == (PROMPT_IDS, ANSWER_IDS, "response")
    assert (streamed.attributes or {})[semconv.GEN_AI_REQUEST_STREAM] is True
    headers, _ = srv.requests[-1]
    assert headers["traceparent"] == _traceparent(streamed)


def test_the_stream_helper_and_parse_go_through_the_hook(exporter: InMemorySpanExporter, serve: Any) -> None:
    class City(BaseModel):
        name: str

    srv = serve("Four five", '{"name": "Paris"}')
    client = _client(srv)
    with client.responses.stream(model="m", input="count") as stream:
        for _ in stream:
            pass
    parsed = client.responses.parse(model="m", input="city?", text_format=City)
    assert parsed.output_parsed == City(name="Paris")
    streamed, parsed_span = exporter.get_finished_spans()
    assert _transition(streamed).response["content"] == "Four five"
    assert _transition(parsed_span).response["content"] == '{"name": "Paris"}'
    assert [h["traceparent"] for h, _ in srv.requests] == [_traceparent(streamed), _traceparent(parsed_span)]


def test_a_stream_that_ends_without_its_response_is_a_failed_call(
        exporter: InMemorySpanExporter, serve: Any) -> None:
    srv = serve("Four five", cut_stream=True)
    events = list(_client(srv).responses.create(model="m", input="count", stream=True))
    assert events[-1].type == "response.output_item.done"
    span = _only(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})[semconv.ERROR_TYPE] == "StreamEndedUnfinished"
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES)[0]["parts"] == [{"type": "text", "content": "Four five"}]
    assert not TransitionBuilder().build_from_spans([collector.to_record(span)], rollout_id="r",
                                                    task_id="t").transitions


def test_inside_a_framework_llm_span_it_is_one_transition(exporter: InMemorySpanExporter, serve: Any) -> None:
    srv = serve("Paris.", ids=True)
    outer = collector.tracer().start_span("chat m", attributes={
        semconv.GEN_AI_OPERATION_NAME: "chat", semconv.GEN_AI_AGENT_NAME: "writer",
        semconv.GEN_AI_INPUT_MESSAGES: json.dumps([{"role": "user", "parts": [{"type": "text", "content": "hi"}]}])})
    with trace.use_span(outer, end_on_exit=True):
        _client(srv).responses.create(model="m", input="hi")
    inner, framework = exporter.get_finished_spans()
    assert inner.parent is not None and inner.parent.span_id == framework.context.span_id
    traj = TransitionBuilder().build_from_spans([collector.to_record(s) for s in (framework, inner)],
                                                rollout_id="r", task_id="t")
    (t,) = traj.transitions
    assert t.agent_name == "writer" and t.response_token_ids == ANSWER_IDS


def test_a_fault_in_agl_never_breaks_the_call(exporter: InMemorySpanExporter, serve: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_core.openai_client import attributes

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("agl bug")

    monkeypatch.setattr(attributes.ResponsesStreamAccumulator, "add", broken)
    monkeypatch.setattr(attributes.responses_items, "output_message", broken)
    srv = serve("Paris.", "Four five")
    client = _client(srv)
    assert client.responses.create(model="m", input="hi").output_text == "Paris."
    assert [e.type for e in client.responses.create(model="m", input="hi", stream=True)][-1] == "response.completed"
    assert len(exporter.get_finished_spans()) == 2
    faults = guard.fault_counts()
    assert {"openai.response", "openai.stream_chunk", "openai.stream_end"} <= set(faults), faults


def test_uninstrument_restores_the_originals(serve: Any) -> None:
    originals = (Responses.create, AsyncResponses.create, Responses.parse)
    plugin = OpenAIInstrumentor()
    if plugin.is_instrumented_by_opentelemetry:
        plugin.uninstrument()
        originals = (Responses.create, AsyncResponses.create, Responses.parse)
    plugin.instrument(skip_dep_check=True)
    assert Responses.create is not originals[0]
    plugin.uninstrument()
    assert (Responses.create, AsyncResponses.create, Responses.parse) == originals


@pytest.mark.parametrize(("given", "field"), [
    (7, "input"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
])
def test_items_without_a_chat_equivalent_name_their_field(given: Any, field: str) -> None:
    with pytest.raises(ItemError) as caught:
        input_messages(given)
    assert caught.value.field == field


async def test_a_streamed_raw_response_records_its_stream_once_parsed(exporter: InMemorySpanExporter,
                                                                      serve: Any) -> None:
    srv = serve("Four five", ids=True)
    client = openai.AsyncOpenAI(base_url=srv.url, api_key="x", max_retries=0)
    raw = await client.responses.with_raw_response.create(model="m", input="count", stream=True)
    assert raw.headers["content-type"] == "text/event-stream"
    stream = raw.parse()
    assert raw.parse() is stream  # parsed once, as the SDK caches it
    assert [e.type async for e in stream][-1] == "response.completed"
    t = _transition(_only(exporter))
    assert t.response["content"] == "Four five" and t.response_token_ids == ANSWER_IDS
