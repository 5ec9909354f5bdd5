"""The ``openai`` plugin: one ``chat {model}`` span per chat-completion or Responses call of the OpenAI Python client.

Hook: the class methods ``Completions.create`` / ``AsyncCompletions.create`` (and
``.parse``) in ``openai.resources.chat.completions``, and the same methods of
``Responses`` / ``AsyncResponses`` in ``openai.resources.responses``. Every client instance
(``OpenAI``, ``AsyncOpenAI``, ``AzureOpenAI``, and the clients that frameworks
build on them) looks these up on the class, so one patch covers them all, and
sync, async and streaming calls alike:

- ``create(stream=True)`` returns a ``Stream``/``AsyncStream``; we hand back a
  ``wrapt.ObjectProxy`` of it (``isinstance`` still holds) that folds the chunks
  and ends the span when the stream is exhausted, closed, leaves its ``with``
  block, raises, or is garbage collected unfinished. A stream that raised (an
  SSE error event, a cut connection) or stopped before every choice had a
  ``finish_reason`` is recorded as a failed call (status error, ``error.type``),
  its partial text kept on the span for debugging; transitions skip it.
- ``client.chat.completions.stream(...)`` looks up ``resource.create`` at call
  time and calls it with ``stream=True``, so it goes through the same hook. Its
  ``ChatCompletionStream`` closes the HTTP response itself rather than our
  stream, so the proxy's ``.response`` is a proxy too, whose ``close`` ends the span.
- ``.parse(...)`` posts without going through ``create``, hence its own patch
  (same wrapper).
- ``with_raw_response.create`` (LiteLLM's path, so CrewAI's) binds ``create``
  once per resource, the first time ``with_raw_response`` is touched: covered
  when that happens after ``instrument()``. A non-streamed raw response is
  parsed to read it (the SDK caches the parse, so the caller's ``parse()`` gets
  the same object). A streamed raw response comes back as a proxy whose
  ``parse()`` gives the stream as a recording proxy (:class:`RawStreamProxy`: Agent
  Framework streams the Responses API this way). ``with_streaming_response`` gives
  a span with the request side only: its body is the caller's, unread.

Patching the resource rather than the HTTP layer (OpenInference wraps
``OpenAI.request``) means the span sees typed parameters and typed responses,
with no re-parsing of request bodies, and only chat calls pay anything. The span
is current while the request runs, and its W3C ``traceparent`` is added to the
request headers unless the caller set one, so agl's gateway can key its token-id
record to this span; so is ``X-Agl-Agent``, the agent scope the call runs in
(:func:`agl_core.tracer.agent_scope`, percent-encoded), so a gateway training
several policies answers each agent with its own. agl's own spans are walked up
to the nearest that names an agent; under a user's SDK provider, whose spans do
not link to their parents, only the span the call starts under is read (a
LangChain chat span names its agent itself).

**The Responses API** goes through the same wrappers: ``responses.create`` (plain,
``stream=True``, and ``responses.stream(...)``, which calls ``create`` at call time)
and ``responses.parse`` (which posts on its own). Its span is a ``chat`` span like
any other, the input items and output items written as the chat messages they
stand for (:mod:`agl_core.openai_client.responses_items`, the same mapping agl's
gateway answers ``/v1/responses`` with), function calls as tool calls; a stream
ends its span at ``response.completed`` (or ``response.incomplete``) with that
event's whole ``Response``, and a stream that stops before it is a failed call.
The ``traceparent`` goes out the same way, so the gateway's token ids join.
Framework clients on the Responses API (Agent Framework's ``OpenAIResponsesClient``,
Pydantic AI's ``OpenAIResponsesModel``) call ``responses.create``: their plugin's
span is the outer one and this span nests in it, one transition between them.

Not covered: ``client.completions`` (legacy text completions), the Responses
websocket connection (``responses.connect``), raw ``client.post(...)`` calls, and
openai 1.x's separate ``client.beta.chat.completions.parse`` (gone from the 3.x line).
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_core import collector, semconv
from agl_core.encoding import set_on
from agl_core.guard import report
from agl_core.openai_client import attributes
from agl_core.plugin import Instrumentor
from agl_core.tracer import ClientRecord, agent_scope, client_record, context_with, start_with

_TRACEPARENT = "traceparent"
AGENT_HEADER = "X-Agl-Agent"
"""The header naming the agent scope of a call (percent-encoded): the gateway's key to that agent's policy."""

if TYPE_CHECKING:
    _Proxy = wrapt.ObjectProxy[Any]  # generic in wrapt 2's stubs; wrapt 1 cannot be subscripted at run time
else:
    _Proxy = wrapt.ObjectProxy


def _with_traceparent(headers: Any, span: trace.Span) -> Any:
    """``extra_headers`` with our ``traceparent`` added, unless the caller gave one; never mutates theirs."""
    ctx = span.get_span_context()
    if not ctx.is_valid:  # a no-op tracer's span: nothing for a gateway to join to
        return headers
    value = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{'01' if ctx.trace_flags & 1 else '00'}"  # the sampled bit
    if not headers:
        return {_TRACEPARENT: value}
    if isinstance(headers, Mapping):
        for key in headers:
            if key.lower() == _TRACEPARENT:
                return headers
        return {**headers, _TRACEPARENT: value}
    return headers


def _with_agent(headers: Any, agent: str | None) -> Any:
    """``extra_headers`` with ``X-Agl-Agent`` added when the call runs in an agent scope and the caller set none."""
    if agent is None:
        return headers
    if not headers:
        return {AGENT_HEADER: urllib.parse.quote(agent, safe="")}
    if not isinstance(headers, Mapping):
        return headers
    if any(key.lower() == AGENT_HEADER.lower() for key in headers):
        return headers
    return {**headers, AGENT_HEADER: urllib.parse.quote(agent, safe="")}


class _Call:
    """One in-flight call: its span and the context token that made it current."""

    __slots__ = ("span", "token", "stream", "record")

    def __init__(self, span: trace.Span, token: object, stream: bool) -> None:
        self.span = span
        self.token = token
        self.stream = stream
        self.record = client_record.get()  # a framework chat span's, told when this span recorded the request

    def detach(self) -> None:
        try:
            otel_context.detach(self.token)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            report("openai.detach", exc)

    def fail(self, exc: BaseException) -> None:
        """The call raised: record it on the span and end the span; the caller re-raises ``exc``."""
        _end_with_error(self.span, exc)


def _end_with_error(span: trace.Span, exc: BaseException) -> None:
    try:
        span.set_attribute(semconv.ERROR_TYPE, type(exc).__qualname__)
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.end()
    except Exception as fault:  # noqa: BLE001
        report("openai.error", fault)


STREAM_ENDED_UNFINISHED = "StreamEndedUnfinished"
"""``error.type`` of a stream whose server stopped sending before every choice had a ``finish_reason``."""
STREAM_CLOSED_UNFINISHED = "StreamClosedUnfinished"
"""``error.type`` of a stream closed, left or dropped by its caller before every choice had a ``finish_reason``."""


def _end_unfinished(span: trace.Span, error_type: str, message: str) -> None:
    try:
        span.set_attribute(semconv.ERROR_TYPE, error_type)
        span.set_status(Status(StatusCode.ERROR, message))
        span.end()
    except Exception as fault:  # noqa: BLE001
        report("openai.error", fault)


def _one_shot(value: Any) -> bool:
    """An iterable that may not survive being read twice (a generator, an iterator, a view of unknown kind)."""
    return hasattr(value, "__iter__") and not isinstance(value, (list, tuple, str, bytes, Mapping))


def _base_url(client: Any) -> Any:
    """The client's base URL, read where the SDK keeps it: openai 3 makes ``base_url`` a property that
    imports a module on every read, openai 1 and 2 hold it in ``_base_url``."""
    held = getattr(client, "__dict__", None) or {}
    return held.get("_configured_base_url") or held.get("_base_url") or client.base_url


def _start(resource: Any, kwargs: dict[str, Any], types: _Types) -> _Call | None:
    """Open the span for ``create(**kwargs)``; edits ``kwargs`` in place (headers, re-iterable messages)."""
    span = None
    try:
        for key in types.iterables:
            value = kwargs.get(key)
            if type(value) is not list and value is not None and _one_shot(value):
                kwargs[key] = list(value)  # we read it before openai does: it must not reach openai empty
        client = resource._client
        agent = agent_scope(trace.get_current_span())  # the span this call's starts under, and those above it
        attrs = types.request_attributes(kwargs, _base_url(client))
        span = start_with(collector.tracer(), semconv.chat_span_name(kwargs.get("model")), attrs, SpanKind.CLIENT)
        kwargs["extra_headers"] = _with_agent(_with_traceparent(kwargs.get("extra_headers"), span), agent)
        token = otel_context.attach(context_with(span))
        return _Call(span, token, kwargs.get("stream") is True)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("openai.request", exc)
        if span is not None:
            span.end()
        return None


class _Types:
    """The openai classes the wrappers tell apart, imported at attach time (never at module import), and how
    one API's requests, results and stream events become attributes: chat completions here, the Responses
    API in :class:`_ResponsesTypes`."""

    iterables: tuple[str, ...] = ("messages", "tools")

    def __init__(self) -> None:
        from openai import AsyncStream, Stream
        from openai._legacy_response import LegacyAPIResponse

        self.completion: type[Any] = self._result()
        self.stream: type[Any] = Stream
        self.async_stream: type[Any] = AsyncStream
        self.legacy_response: type[Any] = LegacyAPIResponse

    def _result(self) -> type[Any]:
        from openai.types.chat import ChatCompletion

        return ChatCompletion

    # looked up in the module at call time, so what the module holds is what runs
    def request_attributes(self, params: Mapping[str, Any], base_url: Any) -> dict[str, Any]:
        return attributes.request_attributes(params, base_url)

    def response_attributes(self, result: Any) -> dict[str, Any]:
        return attributes.response_attributes(result)

    def accumulator(self) -> Any:
        return attributes.StreamAccumulator()


class _ResponsesTypes(_Types):
    """``responses.create``: ``input`` items and a ``Response``; its stream is of Responses events."""

    iterables = ("input", "tools")

    def _result(self) -> type[Any]:
        from openai.types.responses import Response

        return Response

    def request_attributes(self, params: Mapping[str, Any], base_url: Any) -> dict[str, Any]:
        return attributes.responses_request_attributes(params, base_url)

    def response_attributes(self, result: Any) -> dict[str, Any]:
        return attributes.responses_response_attributes(result)

    def accumulator(self) -> Any:
        return attributes.ResponsesStreamAccumulator()


def _recorded(record: ClientRecord | None, span: trace.Span) -> None:
    """``span``, not ended yet, recorded its request whole (prompt and reply): the framework chat span around it
    need not. A span that records nothing (a user's sampler dropped it) leaves the chat span to record them."""
    if record is not None and span.is_recording():
        record.complete = True


def _finish(call: _Call, result: Any, types: _Types) -> Any:
    """Record the response on the span and end it, or hand back a stream proxy that will; never raises."""
    span = call.span
    try:
        if isinstance(result, types.completion):
            set_on(span, types.response_attributes(result))
            _recorded(call.record, span)
        elif isinstance(result, types.stream):
            return SyncStreamProxy(result, span, types.accumulator(), call.record)
        elif isinstance(result, types.async_stream):
            return AsyncStreamProxy(result, span, types.accumulator(), call.record)
        elif isinstance(result, types.legacy_response):
            if call.stream:
                return RawStreamProxy(result, span, types, call.record)
            parsed = result.parse()  # cached by the SDK: the caller's parse() returns this same object
            if isinstance(parsed, types.completion):
                set_on(span, types.response_attributes(parsed))
                _recorded(call.record, span)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("openai.response", exc)
    try:
        span.end()
    except Exception as exc:  # noqa: BLE001
        report("openai.response", exc)
    return result


class _StreamSpan:
    """The span of one streamed call and what its chunks said; ends exactly once."""

    __slots__ = ("span", "acc", "done", "record")

    def __init__(self, span: trace.Span, acc: Any, record: ClientRecord | None = None) -> None:
        self.span = span
        self.acc = acc
        self.done = False
        self.record = record

    def add(self, chunk: Any) -> None:
        try:
            self.acc.add(chunk)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai.stream_chunk", exc)

    def end(self, exc: BaseException | None = None, exhausted: bool = False) -> None:
        """End the span with what arrived (kept for debugging even when partial).

        A stream that raised, or that stopped before every choice had a ``finish_reason``
        (the server ended it early, or the caller closed, left or dropped it), is a failed
        call: status error with ``error.type``, so no transition is built from its partial text.
        """
        if self.done:
            return
        self.done = True
        try:
            set_on(self.span, self.acc.attributes())
        except Exception as fault:  # noqa: BLE001
            report("openai.stream_end", fault)
        if exc is not None:
            _end_with_error(self.span, exc)
            return
        try:
            finished = self.acc.finished()
        except Exception as fault:  # noqa: BLE001
            report("openai.stream_end", fault)
            finished = True
        if not finished:
            if exhausted:
                _end_unfinished(self.span, STREAM_ENDED_UNFINISHED,
                                "the stream ended before the model finished its answer (no finish_reason)")
            else:
                _end_unfinished(self.span, STREAM_CLOSED_UNFINISHED,
                                "the stream was closed before the model finished its answer (no finish_reason)")
            return
        try:
            _recorded(self.record, self.span)
            self.span.end()
        except Exception as fault:  # noqa: BLE001
            report("openai.stream_end", fault)


class _ResponseProxy(_Proxy):
    """The stream's HTTP response: closing it (as ``chat.completions.stream()`` does) ends the span."""

    def __init__(self, wrapped: Any, state: _StreamSpan) -> None:
        super().__init__(wrapped)
        self._self_state = state

    def close(self) -> None:
        try:
            self.__wrapped__.close()
        finally:
            self._self_state.end()

    async def aclose(self) -> None:
        try:
            await self.__wrapped__.aclose()
        finally:
            self._self_state.end()


class RawStreamProxy(_Proxy):
    """A streamed ``with_raw_response`` result: its ``parse()`` hands back the stream as a recording proxy.

    The SDK parses a streamed raw response into a ``Stream`` without reading it, so the stream's
    events still reach the span (Agent Framework streams the Responses API this way). A raw response
    parsed into a type of the caller's own (``parse(to=...)``), or never parsed, ends the span with
    the request side only.
    """

    def __init__(self, wrapped: Any, span: trace.Span, types: _Types, record: ClientRecord | None = None) -> None:
        super().__init__(wrapped)
        self._self_span = span
        self._self_types = types
        self._self_record = record
        self._self_stream: Any = None
        self._self_ended = False

    def parse(self, *args: Any, **kwargs: Any) -> Any:
        parsed = self.__wrapped__.parse(*args, **kwargs)
        if self._self_stream is not None or self._self_ended:
            return self._self_stream if self._self_stream is not None and not args and not kwargs else parsed
        try:
            types = self._self_types
            if not args and not kwargs and isinstance(parsed, types.stream):
                self._self_stream = SyncStreamProxy(parsed, self._self_span, types.accumulator(), self._self_record)
            elif not args and not kwargs and isinstance(parsed, types.async_stream):
                self._self_stream = AsyncStreamProxy(parsed, self._self_span, types.accumulator(), self._self_record)
            else:
                self._end()
                return parsed
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai.response", exc)
            self._end()
            return parsed
        return self._self_stream

    def _end(self) -> None:
        if not self._self_ended:
            self._self_ended = True
            try:
                self._self_span.end()
            except Exception as exc:  # noqa: BLE001
                report("openai.response", exc)

    def __del__(self) -> None:
        if getattr(self, "_self_stream", True) is None:
            self._end()  # never parsed: the request side is all there is


class SyncStreamProxy(_Proxy):
    """A ``Stream[ChatCompletionChunk]`` that records its chunks on the call's span."""

    def __init__(self, wrapped: Any, span: trace.Span, acc: Any, record: ClientRecord | None = None) -> None:
        super().__init__(wrapped)
        self._self_state = _StreamSpan(span, acc, record)

    def __iter__(self) -> SyncStreamProxy:
        return self  # Stream.__iter__ drains the same underlying iterator as __next__

    def __next__(self) -> Any:
        state = self._self_state
        try:
            chunk = self.__wrapped__.__next__()
        except StopIteration:
            state.end(exhausted=True)
            raise
        except BaseException as exc:
            state.end(exc)
            raise
        state.add(chunk)
        return chunk

    def __enter__(self) -> SyncStreamProxy:
        self.__wrapped__.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        try:
            return self.__wrapped__.__exit__(*exc_info)
        finally:
            self._self_state.end()

    def close(self) -> None:
        try:
            self.__wrapped__.close()
        finally:
            self._self_state.end()

    @property
    def response(self) -> Any:
        return _ResponseProxy(self.__wrapped__.response, self._self_state)

    def __del__(self) -> None:
        state = getattr(self, "_self_state", None)
        if state is not None:
            state.end()  # dropped unfinished: end with what arrived rather than leak the span


class AsyncStreamProxy(_Proxy):
    """An ``AsyncStream[ChatCompletionChunk]`` that records its chunks on the call's span."""

    def __init__(self, wrapped: Any, span: trace.Span, acc: Any, record: ClientRecord | None = None) -> None:
        super().__init__(wrapped)
        self._self_state = _StreamSpan(span, acc, record)

    def __aiter__(self) -> AsyncStreamProxy:
        return self

    async def __anext__(self) -> Any:
        state = self._self_state
        try:
            chunk = await self.__wrapped__.__anext__()
        except StopAsyncIteration:
            state.end(exhausted=True)
            raise
        except BaseException as exc:
            state.end(exc)
            raise
        state.add(chunk)
        return chunk

    async def __aenter__(self) -> AsyncStreamProxy:
        await self.__wrapped__.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> Any:
        try:
            return await self.__wrapped__.__aexit__(*exc_info)
        finally:
            self._self_state.end()

    async def close(self) -> None:
        try:
            await self.__wrapped__.close()
        finally:
            self._self_state.end()

    async def aclose(self) -> None:
        await self.close()

    @property
    def response(self) -> Any:
        return _ResponseProxy(self.__wrapped__.response, self._self_state)

    def __del__(self) -> None:
        state = getattr(self, "_self_state", None)
        if state is not None:
            state.end()


class OpenAIInstrumentor(Instrumentor):
    """Spans for ``openai`` chat completions and Responses calls: sync, async, streamed and parsed."""

    name: ClassVar[str] = "openai"
    framework: ClassVar[str] = "openai"
    requirements: ClassVar[tuple[str, ...]] = ("openai >= 1.40",)

    _active = False

    def _attach(self) -> None:
        from openai.resources.chat.completions import AsyncCompletions, Completions

        self._hook(Completions, AsyncCompletions, _Types())
        try:
            from openai.resources.responses import AsyncResponses, Responses
        except ImportError:  # an openai from before the Responses API
            pass
        else:
            self._hook(Responses, AsyncResponses, _ResponsesTypes())
        self._active = True

    def _hook(self, sync: type[Any], async_: type[Any], types: _Types) -> None:
        for method in ("create", "parse"):
            if hasattr(sync, method):
                self.patch(sync, method, functools.partial(self._sync_wrapper, types=types))
            if hasattr(async_, method):
                self.patch(async_, method, functools.partial(self._async_wrapper, types=types))

    def _detach(self) -> None:
        self._active = False  # helpers that bound our wrapper (with_raw_response) now pass straight through

    def _sync_wrapper(self, original: Callable[..., Any], types: _Types) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def create(resource: Any, *args: Any, **kwargs: Any) -> Any:
            call = _start(resource, kwargs, types) if plugin._active else None
            if call is None:
                return original(resource, *args, **kwargs)
            try:
                result = original(resource, *args, **kwargs)
            except BaseException as exc:
                call.detach()
                call.fail(exc)
                raise
            call.detach()
            return _finish(call, result, types)

        return create

    def _async_wrapper(self, original: Callable[..., Any], types: _Types) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def create(resource: Any, *args: Any, **kwargs: Any) -> Any:
            call = _start(resource, kwargs, types) if plugin._active else None
            if call is None:
                return await original(resource, *args, **kwargs)
            try:
                result = await original(resource, *args, **kwargs)
            except BaseException as exc:
                call.detach()
                call.fail(exc)
                raise
            call.detach()
            return _finish(call, result, types)

        return create


def traces_requests() -> bool:
    """Whether the ``openai`` plugin is on: every request through the SDK then gets a span of its own,
    current while it is sent, and that span's ``traceparent`` unless the caller set one (a framework's chat
    span around the request need not send its own: the gateway's record joins the span below it, which is
    the same transition)."""
    plugin = OpenAIInstrumentor._instance
    return plugin is not None and bool(plugin._active)
