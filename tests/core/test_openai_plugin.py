"""The ``openai`` plugin against the real OpenAI client and a fake OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest
from openai.resources.chat.completions import AsyncCompletions, Completions
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import BaseModel

from agl_core import collector, encoding, guard, semconv
from agl_core.messages import many_to_genai
from agl_core.openai_client import OpenAIInstrumentor, attributes
from agl_core.testing import FakeOpenAI, render_prompt, tokenize
from agl_core.transitions import TransitionBuilder

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """The plugin on, writing to a provider of our own; agl's collector state is put back afterwards."""
    saved = collector._t.explicit
    provider = TracerProvider()
    exp = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    plugin = OpenAIInstrumentor()
    if plugin.is_instrumented_by_opentelemetry:  # e.g. left on by agl.instrument() in another test
        plugin.uninstrument()
    plugin.instrument(tracer_provider=provider, skip_dep_check=True)
    guard.reset_fault_counts()
    try:
        yield exp
    finally:
        plugin.uninstrument()
        collector._t.explicit = saved
        collector._t.tracer = None  # the next tracer() call re-applies the provider rule


@pytest.fixture
def server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(script=["Paris."]) as srv:
        yield srv


def _client(srv: FakeOpenAI, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, **kwargs)


def _aclient(srv: FakeOpenAI) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url, api_key="x", max_retries=0)


def _only_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def _json(span: ReadableSpan, key: str) -> Any:
    value = (span.attributes or {})[key]
    assert isinstance(value, str)
    return json.loads(value)


def _ids(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"


# --------------------------------------------------------------------------- plain calls


def test_sync_call_makes_one_genai_chat_span(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    client = _client(server)
    response = client.chat.completions.create(model="m-1", messages=USER, temperature=0.5, top_p=1, max_tokens=32,
                                              seed=7)
    assert response.choices[0].message.content == "Paris."
    span = _only_span(exporter)
    attrs = span.attributes or {}
    assert span.name == "chat m-1" and span.kind is SpanKind.CLIENT
    assert span.status.status_code is StatusCode.UNSET
    assert attrs[semconv.GEN_AI_OPERATION_NAME] == "chat"
    assert attrs[semconv.GEN_AI_PROVIDER_NAME] == "openai"
    assert attrs[semconv.AGL_PLUGIN] == "openai"
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == "m-1"
    assert attrs[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.5
    assert attrs[semconv.GEN_AI_REQUEST_TOP_P] == 1.0
    assert attrs[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 32
    assert attrs[semconv.GEN_AI_REQUEST_SEED] == 7
    assert attrs[semconv.GEN_AI_REQUEST_STREAM] is False
    assert attrs[semconv.SERVER_ADDRESS] == "127.0.0.1"
    assert attrs[semconv.SERVER_PORT] == int(server.url.split(":")[2].split("/")[0])
    assert attrs[semconv.GEN_AI_RESPONSE_MODEL] == "m-1"
    assert attrs[semconv.GEN_AI_RESPONSE_ID] == response.id
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert response.usage is not None
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == response.usage.prompt_tokens
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == response.usage.completion_tokens
    assert _json(span, semconv.GEN_AI_INPUT_MESSAGES) == many_to_genai(USER)
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "Paris."}], "finish_reason": "stop"}
    ]
    assert semconv.AGL_PROMPT_TOKEN_IDS not in attrs and semconv.AGL_TOKEN_SOURCE not in attrs
    assert semconv.GEN_AI_TOOL_DEFINITIONS not in attrs


async def test_async_call_makes_the_same_span(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    response = await _aclient(server).chat.completions.create(model="m-1", messages=USER)
    assert response.choices[0].message.content == "Paris."
    span = _only_span(exporter)
    assert span.name == "chat m-1" and span.kind is SpanKind.CLIENT
    assert (span.attributes or {})[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES)[0]["parts"] == [{"type": "text", "content": "Paris."}]
    assert server.requests[-1].headers["traceparent"] == _ids(span)


def test_span_is_current_while_the_request_runs(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    seen: list[trace.Span] = []
    http = openai.DefaultHttpxClient(event_hooks={"request": [lambda request: seen.append(trace.get_current_span())]})
    _client(server, http_client=http).chat.completions.create(model="m", messages=USER)
    span = _only_span(exporter)
    assert len(seen) == 1 and seen[0].get_span_context() == span.get_span_context()
    assert trace.get_current_span() is trace.INVALID_SPAN  # detached again afterwards


def test_traceparent_header_carries_the_span_ids(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    client = _client(server)
    client.chat.completions.create(model="m", messages=USER, extra_headers={"X-Mine": "1"})
    span = _only_span(exporter)
    headers = server.requests[-1].headers
    assert headers["traceparent"] == _ids(span) and headers["x-mine"] == "1"


def test_a_traceparent_the_caller_set_is_kept(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    mine = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    headers = {"Traceparent": mine}
    _client(server).chat.completions.create(model="m", messages=USER, extra_headers=headers)
    assert server.requests[-1].headers["traceparent"] == mine
    assert headers == {"Traceparent": mine}  # the caller's dict is never modified
    _only_span(exporter)


def test_span_is_emitted_outside_a_rollout_and_attributed_inside_one(
    exporter: InMemorySpanExporter, server: FakeOpenAI
) -> None:
    client = _client(server)
    client.chat.completions.create(model="m", messages=USER)
    outside = _only_span(exporter)
    assert semconv.AGL_ROLLOUT_ID not in (outside.attributes or {})

    buffer = collector.RolloutBuffer("r-openai", "t", 1)
    collector.open_buffer(buffer)
    token = collector.current_rollout.set(buffer)
    try:
        client.chat.completions.create(model="m", messages=USER)
    finally:
        collector.current_rollout.reset(token)
        spans = collector.close_buffer(buffer)
    assert [s.name for s in spans] == ["chat m"]
    assert (spans[0].attributes or {})[semconv.AGL_ROLLOUT_ID] == "r-openai"


def test_messages_given_as_a_generator_still_reach_the_server(
    exporter: InMemorySpanExporter, server: FakeOpenAI
) -> None:
    _client(server).chat.completions.create(model="m", messages=(m for m in USER))
    assert server.requests[-1].body["messages"] == USER
    assert _json(_only_span(exporter), semconv.GEN_AI_INPUT_MESSAGES) == many_to_genai(USER)


# --------------------------------------------------------------------------- tool calls and token ids


def test_tool_calls_in_the_response(exporter: InMemorySpanExporter) -> None:
    reply = {"tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}', "id": "call_1"}]}
    with FakeOpenAI(script=[reply]) as srv:
        response = _client(srv).chat.completions.create(model="m", messages=USER, tools=[WEATHER_TOOL])
    call = response.choices[0].message.tool_calls
    assert call is not None and call[0].id == "call_1"
    span = _only_span(exporter)
    assert (span.attributes or {})[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("tool_calls",)
    assert _json(span, semconv.GEN_AI_TOOL_DEFINITIONS) == [WEATHER_TOOL]
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES) == [{
        "role": "assistant",
        "parts": [{"type": "tool_call", "id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
        "finish_reason": "tool_calls",
    }]


def test_token_ids_and_logprobs_from_the_response(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    response = _client(server).chat.completions.create(model="m", messages=USER, logprobs=True,
                                                       extra_body={"return_token_ids": True})
    attrs = _only_span(exporter).attributes or {}
    expected = tokenize("Paris.")
    assert attrs[semconv.AGL_PROMPT_TOKEN_IDS] == tuple(tokenize(render_prompt(USER)))
    assert attrs[semconv.AGL_RESPONSE_TOKEN_IDS] == tuple(expected)
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert attrs[semconv.AGL_RESPONSE_LOGPROBS] == tuple(t.logprob for t in logprobs.content)
    assert len(attrs[semconv.AGL_RESPONSE_LOGPROBS]) == len(expected)  # type: ignore[arg-type]
    assert attrs[semconv.AGL_TOKEN_SOURCE] == "response"


# --------------------------------------------------------------------------- streaming


def _stream_kwargs() -> dict[str, Any]:
    return {"model": "m", "messages": USER, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "extra_body": {"return_token_ids": True}}


def _assert_streamed_span(span: ReadableSpan, text: str) -> None:
    attrs = span.attributes or {}
    assert attrs[semconv.GEN_AI_REQUEST_STREAM] is True
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == len(tokenize(render_prompt(USER)))
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == len(tokenize(text))
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES) == [
        {"role": "assistant", "parts": [{"type": "text", "content": text}], "finish_reason": "stop"}
    ]
    assert attrs[semconv.AGL_PROMPT_TOKEN_IDS] == tuple(tokenize(render_prompt(USER)))
    assert attrs[semconv.AGL_RESPONSE_TOKEN_IDS] == tuple(tokenize(text))
    assert len(attrs[semconv.AGL_RESPONSE_LOGPROBS]) == len(tokenize(text))  # type: ignore[arg-type]
    assert attrs[semconv.AGL_TOKEN_SOURCE] == "response"


def test_sync_stream(exporter: InMemorySpanExporter) -> None:
    text = "The capital of France is Paris."
    with FakeOpenAI(script=[text]) as srv:
        stream = _client(srv).chat.completions.create(**_stream_kwargs())
        assert isinstance(stream, openai.Stream)
        assert exporter.get_finished_spans() == ()  # the span stays open until the stream ends
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == text
    _assert_streamed_span(_only_span(exporter), text)


async def test_async_stream(exporter: InMemorySpanExporter) -> None:
    text = "The capital of France is Paris."
    with FakeOpenAI(script=[text]) as srv:
        stream = await _aclient(srv).chat.completions.create(**_stream_kwargs())
        assert isinstance(stream, openai.AsyncStream)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == text
    _assert_streamed_span(_only_span(exporter), text)


def test_streamed_tool_calls_are_reassembled(exporter: InMemorySpanExporter) -> None:
    reply = {"content": "Checking.", "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                                    {"name": "get_weather", "arguments": '{"city": "Rome"}'}]}
    with FakeOpenAI(script=[reply]) as srv:
        for _ in _client(srv).chat.completions.create(**_stream_kwargs(), tools=[WEATHER_TOOL]):
            pass
    span = _only_span(exporter)
    (message,) = _json(span, semconv.GEN_AI_OUTPUT_MESSAGES)
    assert message["finish_reason"] == "tool_calls"
    assert message["parts"] == [
        {"type": "text", "content": "Checking."},
        {"type": "tool_call", "id": "call_1_0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "tool_call", "id": "call_1_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    attrs = span.attributes or {}
    assert len(attrs[semconv.AGL_RESPONSE_TOKEN_IDS]) == attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]  # type: ignore


def test_error_in_the_middle_of_a_stream_marks_the_span(exporter: InMemorySpanExporter) -> None:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]}
    body = f"data: {json.dumps(chunk)}\n\n" 'data: {"error": {"message": "boom", "type": "server_error"}}\n\n'
    with FakeOpenAI(script=[{"body": body}]) as srv:
        stream = _client(srv).chat.completions.create(model="m", messages=USER, stream=True)
        received = []
        with pytest.raises(openai.APIError, match="boom"):
            for c in stream:
                received.append(c.choices[0].delta.content)
    assert received == ["Hel"]
    span = _only_span(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})[semconv.ERROR_TYPE] == "APIError"
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES)[0]["parts"] == [{"type": "text", "content": "Hel"}]


def test_stream_left_early_through_its_context_manager_ends_the_span(
    exporter: InMemorySpanExporter, server: FakeOpenAI
) -> None:
    with _client(server).chat.completions.create(**_stream_kwargs()) as stream:
        next(stream)
        assert exporter.get_finished_spans() == ()
    span = _only_span(exporter)
    _assert_unfinished(span, "StreamClosedUnfinished")  # left before the answer finished: not trainable
    assert (span.attributes or {})[semconv.AGL_PROMPT_TOKEN_IDS] == tuple(tokenize(render_prompt(USER)))


def test_stream_closed_early_ends_the_span(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    stream = _client(server).chat.completions.create(**_stream_kwargs())
    next(stream)
    stream.close()
    _assert_unfinished(_only_span(exporter), "StreamClosedUnfinished")


def test_stream_dropped_unfinished_does_not_leak_its_span(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    stream = _client(server).chat.completions.create(**_stream_kwargs())
    next(stream)
    del stream
    gc.collect()
    _assert_unfinished(_only_span(exporter), "StreamClosedUnfinished")


def test_stream_read_to_the_end_is_not_an_error(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    with _client(server).chat.completions.create(**_stream_kwargs()) as stream:
        for _ in stream:
            pass
    span = _only_span(exporter)
    assert span.status.status_code is StatusCode.UNSET and semconv.ERROR_TYPE not in (span.attributes or {})


def _assert_unfinished(span: ReadableSpan, error_type: str) -> None:
    assert span.status.status_code is StatusCode.ERROR
    assert "before the model finished its answer" in (span.status.description or "")
    assert (span.attributes or {})[semconv.ERROR_TYPE] == error_type


# --------------------------------------------------------------------------- streams that break


_HEL = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]}


@contextlib.contextmanager
def _breaking_server(mode: str) -> Iterator[str]:
    """A model server that streams one chunk ("Hel") and then breaks, as ``mode`` says.

    ``cut``: drops the connection inside the chunked body (an engine that crashed);
    ``error``: an SSE error event (what agl's gateway sends when its backend dies);
    ``eof``: ends the body cleanly with no finish_reason and no ``[DONE]``.
    """

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(f"data: {json.dumps(_HEL)}\n\n".encode())
            if mode == "error":
                self._chunk(b'event: error\ndata: {"error": {"message": "backend died", "type": "x"}}\n\n')
                self._chunk(b"data: [DONE]\n\n")
            if mode != "cut":
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


_BREAKS = [("cut", openai.APIConnectionError, "APIConnectionError"),
           ("error", openai.APIError, "APIError"),
           ("eof", None, "StreamEndedUnfinished")]


def _assert_failed_call(span: ReadableSpan, error_type: str) -> None:
    """A failed call: status error and error.type, the partial text kept, and no transition built from it."""
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})[semconv.ERROR_TYPE] == error_type
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES)[0]["parts"] == [{"type": "text", "content": "Hel"}]
    traj = TransitionBuilder().build_from_spans([collector.to_record(span)], rollout_id="r", task_id="t")
    assert traj.transitions == []
    assert [s.reason for s in traj.skipped] == [f"the call failed ({error_type}): no response to train on"]


@pytest.mark.parametrize(("mode", "raises", "error_type"), _BREAKS)
def test_a_stream_that_breaks_is_a_failed_call(exporter: InMemorySpanExporter, mode: str,
                                               raises: type[Exception] | None, error_type: str) -> None:
    with _breaking_server(mode) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        received: list[str] = []
        with contextlib.ExitStack() as stack:
            if raises is not None:
                stack.enter_context(pytest.raises(raises))
            for c in client.chat.completions.create(model="m", messages=USER, stream=True):
                received.append(c.choices[0].delta.content or "")
    assert received == ["Hel"]
    _assert_failed_call(_only_span(exporter), error_type)


@pytest.mark.parametrize(("mode", "raises", "error_type"), _BREAKS)
async def test_an_async_stream_that_breaks_is_a_failed_call(exporter: InMemorySpanExporter, mode: str,
                                                            raises: type[Exception] | None, error_type: str) -> None:
    with _breaking_server(mode) as url:
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        received: list[str] = []
        with contextlib.ExitStack() as stack:
            if raises is not None:
                stack.enter_context(pytest.raises(raises))
            async for c in await client.chat.completions.create(model="m", messages=USER, stream=True):
                received.append(c.choices[0].delta.content or "")
        await client.close()
    assert received == ["Hel"]
    _assert_failed_call(_only_span(exporter), error_type)


@pytest.mark.parametrize(("mode", "raises", "error_type"), _BREAKS)
def test_a_stream_helper_that_breaks_is_a_failed_call(exporter: InMemorySpanExporter, mode: str,
                                                      raises: type[Exception] | None, error_type: str) -> None:
    with _breaking_server(mode) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        with contextlib.ExitStack() as stack:
            if raises is not None:
                stack.enter_context(pytest.raises(raises))
            with client.chat.completions.stream(model="m", messages=USER) as stream:
                for _ in stream:
                    pass
    _assert_failed_call(_only_span(exporter), error_type)


@pytest.mark.parametrize(("mode", "raises", "error_type"), _BREAKS)
async def test_an_async_stream_helper_that_breaks_is_a_failed_call(
    exporter: InMemorySpanExporter, mode: str, raises: type[Exception] | None, error_type: str
) -> None:
    with _breaking_server(mode) as url:
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        with contextlib.ExitStack() as stack:
            if raises is not None:
                stack.enter_context(pytest.raises(raises))
            async with client.chat.completions.stream(model="m", messages=USER) as stream:
                async for _ in stream:
                    pass
        await client.close()
    _assert_failed_call(_only_span(exporter), error_type)


def test_stream_helper_goes_through_the_hook(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    with _client(server).chat.completions.stream(model="m", messages=USER) as stream:
        events = [e.type for e in stream]
        assert "content.done" in events
    span = _only_span(exporter)
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES)[0]["parts"] == [{"type": "text", "content": "Paris."}]
    assert server.requests[-1].headers["traceparent"] == _ids(span)


def test_stream_helper_left_early_ends_the_span(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI(script=["one two three four five"]) as srv:
        with _client(srv).chat.completions.stream(model="m", messages=USER) as stream:
            next(iter(stream))
            assert exporter.get_finished_spans() == ()
        _only_span(exporter)


async def test_async_stream_helper(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    async with _aclient(server).chat.completions.stream(model="m", messages=USER) as stream:
        async for _ in stream:
            pass
    span = _only_span(exporter)
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES)[0]["parts"] == [{"type": "text", "content": "Paris."}]


# --------------------------------------------------------------------------- other entry points


def test_parse_is_covered(exporter: InMemorySpanExporter) -> None:
    class Answer(BaseModel):
        city: str

    with FakeOpenAI(script=['{"city": "Paris"}']) as srv:
        parsed = _client(srv).chat.completions.parse(model="m", messages=USER, response_format=Answer)
    assert parsed.choices[0].message.parsed == Answer(city="Paris")
    span = _only_span(exporter)
    assert span.name == "chat m"
    assert _json(span, semconv.GEN_AI_OUTPUT_MESSAGES)[0]["parts"][0]["content"] == '{"city": "Paris"}'


def test_with_raw_response_is_covered(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    raw = _client(server).chat.completions.with_raw_response.create(model="m", messages=USER)
    span = _only_span(exporter)
    completion = raw.parse()
    assert completion is raw.parse()
    assert (span.attributes or {})[semconv.GEN_AI_RESPONSE_ID] == completion.id
    assert server.requests[-1].headers["traceparent"] == _ids(span)


def test_with_streaming_response_records_the_request_side(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    with _client(server).chat.completions.with_streaming_response.create(model="m", messages=USER) as response:
        assert response.parse().choices[0].message.content == "Paris."
    span = _only_span(exporter)
    attrs = span.attributes or {}
    assert attrs[semconv.GEN_AI_REQUEST_MODEL] == "m" and semconv.GEN_AI_RESPONSE_ID not in attrs
    assert server.requests[-1].headers["traceparent"] == _ids(span)


# --------------------------------------------------------------------------- errors and faults


def test_server_error_marks_the_span_and_passes_through(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI(status=500) as srv, pytest.raises(openai.InternalServerError) as caught:
        _client(srv).chat.completions.create(model="m", messages=USER)
    assert caught.value.status_code == 500
    span = _only_span(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})[semconv.ERROR_TYPE] == "InternalServerError"
    assert [e.name for e in span.events] == ["exception"]
    assert guard.fault_counts() == {}


async def test_async_server_error(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI(script=[{"status": 400, "error": "bad request"}]) as srv:
        with pytest.raises(openai.BadRequestError):
            await _aclient(srv).chat.completions.create(model="m", messages=USER)
    assert (_only_span(exporter).attributes or {})[semconv.ERROR_TYPE] == "BadRequestError"


def test_malformed_reply_passes_through(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI(script=[{"body": "this is not json"}]) as srv:
        with pytest.raises(ValueError) as caught:  # openai 3.x lets the JSONDecodeError through
            _client(srv).chat.completions.create(model="m", messages=USER)
    span = _only_span(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})[semconv.ERROR_TYPE] == type(caught.value).__qualname__


def test_the_exception_object_is_the_one_openai_raised(exporter: InMemorySpanExporter) -> None:
    with FakeOpenAI(status=503) as srv:
        client = _client(srv)
        with pytest.raises(openai.APIStatusError) as with_hook:
            client.chat.completions.create(model="m", messages=USER)
        OpenAIInstrumentor().uninstrument()
        with pytest.raises(openai.APIStatusError) as without_hook:
            client.chat.completions.create(model="m", messages=USER)
        OpenAIInstrumentor().instrument(skip_dep_check=True)
    assert type(with_hook.value) is type(without_hook.value)
    assert str(with_hook.value) == str(without_hook.value)
    assert with_hook.value.__traceback__ is not None
    assert with_hook.traceback[-1].name == without_hook.traceback[-1].name  # raised where openai raises it


def test_a_fault_in_request_attributes_leaves_the_call_alone(
    exporter: InMemorySpanExporter, server: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(params: Any, base_url: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(attributes, "request_attributes", broken)
    response = _client(server).chat.completions.create(model="m", messages=USER)
    assert response.choices[0].message.content == "Paris."
    assert guard.fault_counts() == {"openai.request": 1}
    assert exporter.get_finished_spans() == ()


def test_a_fault_in_response_attributes_leaves_the_call_alone(
    exporter: InMemorySpanExporter, server: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(completion: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(attributes, "response_attributes", broken)
    response = _client(server).chat.completions.create(model="m", messages=USER)
    assert response.choices[0].message.content == "Paris."
    assert guard.fault_counts() == {"openai.response": 1}
    span = _only_span(exporter)  # still ended, with the request side
    assert (span.attributes or {})[semconv.GEN_AI_REQUEST_MODEL] == "m"


def test_a_fault_while_folding_chunks_leaves_the_stream_alone(
    exporter: InMemorySpanExporter, server: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any, chunk: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(attributes.StreamAccumulator, "add", broken)
    chunks = list(_client(server).chat.completions.create(**_stream_kwargs()))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Paris."
    assert guard.fault_counts()["openai.stream_chunk"] == len(chunks)
    _only_span(exporter)


# --------------------------------------------------------------------------- uninstrument


def test_uninstrument_restores_the_originals_exactly(server: FakeOpenAI) -> None:
    originals = {(owner, name): owner.__dict__[name] for owner in (Completions, AsyncCompletions)
                 for name in ("create", "parse")}
    plugin = OpenAIInstrumentor()
    if plugin.is_instrumented_by_opentelemetry:
        plugin.uninstrument()
    provider = TracerProvider()
    exp = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    saved = collector._t.explicit
    try:
        plugin.instrument(tracer_provider=provider, skip_dep_check=True)
        assert all(owner.__dict__[name] is not original for (owner, name), original in originals.items())
        client = _client(server)
        raw = client.chat.completions.with_raw_response  # binds the patched create, then outlives the patch
        plugin.uninstrument()
        assert all(owner.__dict__[name] is original for (owner, name), original in originals.items())
        client.chat.completions.create(model="m", messages=USER)
        raw.create(model="m", messages=USER)
        assert exp.get_finished_spans() == ()
    finally:
        collector._t.explicit = saved
        collector._t.tracer = None


# --------------------------------------------------------------------------- attribute helpers


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "hi"},
    {"role": "system", "content": ""},
    {"role": "tool", "content": "42"},
    {"role": "", "content": "no role"},
    {"role": "user", "content": [{"type": "text", "text": "parts"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "user", "content": "named", "name": "bob"},
])
def test_input_messages_json_agrees_with_the_shared_converter(message: dict[str, Any]) -> None:
    for _ in range(2):  # converted, then memoised
        assert json.loads(attributes.input_messages_json([message, message])) == many_to_genai([message, message])


def test_an_edited_message_is_never_served_from_the_memo() -> None:
    message = {"role": "user", "content": "first"}
    before = attributes.input_messages_json([message])
    message["content"] = "second"
    after = attributes.input_messages_json([message])
    assert json.loads(before)[0]["parts"][0]["content"] == "first"
    assert json.loads(after)[0]["parts"][0]["content"] == "second"


def test_set_on_matches_set_attributes_and_respects_span_limits() -> None:
    attrs: dict[str, Any] = {"a": "text", "b": 1, "c": 0.5, "d": True, "e": (1, 2, 3)}
    for limits, expect_fast in ((SpanLimits(), True), (SpanLimits(max_attribute_length=2), False)):
        tracer = TracerProvider(span_limits=limits).get_tracer("t")
        fast: Any = tracer.start_span("fast")
        plain: Any = tracer.start_span("plain")
        encoding.set_on(fast, dict(attrs))
        plain.set_attributes(dict(attrs))
        assert dict(fast.attributes or {}) == dict(plain.attributes or {})
        assert (dict(fast.attributes or {})["a"] == "text") is expect_fast
        fast.end()
        plain.end()
        encoding.set_on(fast, {"late": 1})  # an ended span takes nothing, as with set_attributes
        assert "late" not in (fast.attributes or {})


def test_dumps_handles_pydantic_classes_and_instances() -> None:
    """A pydantic class (a structured-output response_format) is written as its JSON Schema, never a crash."""
    import json

    import pydantic

    from agl_core.encoding import dumps

    class Answer(pydantic.BaseModel):
        value: int

    assert json.loads(dumps({"response_format": Answer}))["response_format"]["properties"]["value"]["type"] == "integer"
    assert json.loads(dumps(Answer(value=3))) == {"value": 3}


# Content as sent: an MCP tool result is a list of parts, a user turn may be a one-part list (issue 16).
_AS_SENT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18C"},
                                                       {"type": "text", "text": "sunny"}]},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "one part"}]},
]


def test_list_content_reaches_the_prompt_as_sent(exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    _client(server).chat.completions.create(model="m", messages=_AS_SENT)
    span = _only_span(exporter)
    (t,) = TransitionBuilder().build_from_spans([collector.to_record(span)], rollout_id="r", task_id="t").transitions
    assert t.prompt == _AS_SENT


# --------------------------------------------------------------------------- the agent scope header


def _agent_header(srv: FakeOpenAI, **kwargs: Any) -> str | None:
    _client(srv).chat.completions.create(model="m", messages=USER, **kwargs)
    return srv.requests[-1].headers.get("x-agl-agent")


def test_a_call_in_an_agent_scope_names_its_agent_to_the_gateway(server: FakeOpenAI) -> None:
    """agl's own tracer (no provider of the user's): the nearest span above the call that names an agent."""
    plugin = OpenAIInstrumentor()
    if plugin.is_instrumented_by_opentelemetry:
        plugin.uninstrument()
    plugin.instrument(skip_dep_check=True)
    try:
        assert _agent_header(server) is None  # no agent scope: no header
        tracer = collector.tracer()
        with tracer.start_as_current_span("invoke_agent writer", attributes={semconv.GEN_AI_AGENT_NAME: "writer"}):
            with tracer.start_as_current_span("step"):  # a span between the agent and its call
                assert _agent_header(server) == "writer"
            with tracer.start_as_current_span("invoke_agent vérif", attributes={semconv.GEN_AI_AGENT_NAME: "vérif/2"}):
                assert _agent_header(server) == "v%C3%A9rif%2F2"  # percent-encoded: a header is ASCII
            mine = {"X-Agl-Agent": "judge"}
            assert _agent_header(server, extra_headers=mine) == "judge" and mine == {"X-Agl-Agent": "judge"}
    finally:
        plugin.uninstrument()


def test_under_a_users_provider_the_span_a_call_starts_under_names_the_agent(
        exporter: InMemorySpanExporter, server: FakeOpenAI) -> None:
    with collector.tracer().start_as_current_span("chat", attributes={semconv.GEN_AI_AGENT_NAME: "checker"}):
        assert _agent_header(server) == "checker"
    assert _agent_header(server) is None
