"""agl's own minimal tracer, used when the user has no OpenTelemetry SDK provider.

A span made by the OpenTelemetry SDK costs tens of microseconds: attribute
validation, locks, span limits, the processor chain. When nobody but agl will
ever read the spans (no SDK ``TracerProvider`` is set), that work buys nothing,
so agl records spans with this tracer instead: it implements the OpenTelemetry
*API* (``Tracer``, ``Span``), so context propagation, ``use_span``,
``get_current_span`` and other instrumentations' parent lookups work as usual,
and it hands each finished span straight to the rollout it belongs to. Outside
a rollout a span is dropped when it ends; nothing is kept.

As soon as the user sets an SDK provider, the collector switches to it and
spans go through the SDK and the user's exporters (see ``collector``).
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.span import DEFAULT_TRACE_STATE
from opentelemetry.util.types import Attributes, AttributeValue

from agl_core import encoding, semconv
from agl_core.collector import current_rollout

if TYPE_CHECKING:
    from agl_core.collector import RolloutBuffer

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_bits = random.getrandbits
_new_tuple = tuple.__new__


def _runtime_var() -> Any:
    """The ``ContextVar`` behind OpenTelemetry's default runtime context, or None under another runtime context."""
    try:
        from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext

        runtime = otel_context._RUNTIME_CONTEXT
        if type(runtime) is ContextVarsRuntimeContext:
            return runtime, runtime._current_context
    except Exception:  # noqa: BLE001 - another release's layout: the API's functions
        pass
    return None, None


_runtime, _context_var = _runtime_var()
_otel_context_logger = logging.getLogger(otel_context.__name__)


def current_context() -> Context:
    """``opentelemetry.context.get_current()``, one ``ContextVar.get`` under the API's default runtime context."""
    if _context_var is not None and otel_context._RUNTIME_CONTEXT is _runtime:
        return _context_var.get()  # type: ignore[no-any-return]
    return otel_context.get_current()


def attach_context(context: Context) -> Any:
    """``opentelemetry.context.attach(context)``, without its two calls down to the ``ContextVar`` (hooks make
    a span current around every model call, tool call and streamed pull)."""
    if _context_var is not None and otel_context._RUNTIME_CONTEXT is _runtime:
        return _context_var.set(context)
    return otel_context.attach(context)


def detach_context(token: Any) -> None:
    """``opentelemetry.context.detach(token)``: the same reset, and on failure the API's own log line."""
    if _context_var is not None and otel_context._RUNTIME_CONTEXT is _runtime:
        try:
            _context_var.reset(token)
        except Exception:  # noqa: BLE001 - as the API does: logged, never raised
            _otel_context_logger.exception("Failed to detach context")
        return
    otel_context.detach(token)


def _context_maker() -> Any:
    """``SpanContext(trace_id, span_id, False, SAMPLED)`` for ids known valid, without the API's range checks.

    The API's ``SpanContext`` is a tuple of six fields; the shortcut builds that tuple directly, and is used
    only when it gives exactly what the constructor gives on this release of the API.
    """

    def fast(trace_id: int, span_id: int) -> SpanContext:
        return _new_tuple(SpanContext, (trace_id, span_id, False, _SAMPLED, DEFAULT_TRACE_STATE, True))

    def slow(trace_id: int, span_id: int) -> SpanContext:
        return SpanContext(trace_id, span_id, False, _SAMPLED)

    try:
        probe, made = fast(3, 5), slow(3, 5)
        if (tuple(probe) == tuple(made) and probe.trace_id == 3 and probe.span_id == 5 and probe.is_valid
                and probe.trace_flags == _SAMPLED and probe.trace_state is made.trace_state):
            return fast
    except Exception:  # noqa: BLE001 - another layout: the constructor
        pass
    return slow


_span_context = _context_maker()


class Event(NamedTuple):
    name: str
    timestamp: int
    attributes: Mapping[str, Any]


class LightSpan(trace.Span):
    """A recording span with the fields ``collector.to_record`` reads (as the SDK's ``ReadableSpan`` has)."""

    __slots__ = ("name", "context", "parent", "kind", "attributes", "events", "status", "start_time", "end_time",
                 "_buffer", "_up")

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
                 attributes: dict[str, Any], buffer: RolloutBuffer | None, start_time: int,
                 up: trace.Span | None = None) -> None:
        self.name = name
        self._up = up  # the span that was current when this one started: where agent_scope() looks next
        self.context = context
        self.parent = parent
        self.kind = kind
        self.attributes = attributes
        self.events: Sequence[Event] = ()  # a list from the first event on: most spans have none
        self.status = _UNSET
        self.start_time = start_time
        self.end_time: int | None = None
        self._buffer = buffer

    def get_span_context(self) -> SpanContext:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        if self.end_time is None:
            self.attributes.update(attributes if encoding.capture_content else encoding.redact(attributes))

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        if self.end_time is None and (encoding.capture_content or key not in encoding.CONTENT_ATTRIBUTES):
            self.attributes[key] = value

    def add_event(self, name: str, attributes: Attributes = None, timestamp: int | None = None) -> None:
        if self.end_time is None:
            event = Event(name, timestamp or time.time_ns(), dict(attributes or {}))
            if type(self.events) is list:
                self.events.append(event)
            else:
                self.events = [event]

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        return None  # links are not part of agl's records

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time is not None:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if self.status.status_code is not StatusCode.OK:  # OK is final, as in the SDK
            self.status = status

    def record_exception(self, exception: BaseException, attributes: Attributes = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        attrs: dict[str, Any] = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        attrs.update(attributes or {})
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or time.time_ns()
        buffer = self._buffer
        if buffer is not None:
            self._buffer = None
            if buffer.closed:
                from agl_core.collector import count_late

                count_late(buffer.rollout_id)
            else:
                buffer.spans.append(self)  # type: ignore[arg-type]


class LightTracer(trace.Tracer):
    """Makes :class:`LightSpan` s attributed to the current rollout."""

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> LightSpan:
        if attributes:
            attrs = dict(attributes) if encoding.capture_content else encoding.redact(attributes)
        else:
            attrs = {}
        return self.start_owned(name, kind, attrs, context, start_time)

    def start_owned(self, name: str, kind: SpanKind, attrs: dict[str, Any], context: Context | None = None,
                    start_time: int | None = None) -> LightSpan:
        """``start_span`` with ``attrs`` handed over, not copied: a dict the caller built for this span alone,
        content attributes already left out where content capture is off (see :func:`start_with`)."""
        current = (current_context() if context is None else context).get(_SPAN_KEY)
        if type(current) is LightSpan:  # agl's own span (the common case): no ABC check, always valid
            parent: SpanContext | None = current.context
            ctx = _span_context(current.context.trace_id, _bits(64) or 1)
        else:
            if current is None or not isinstance(current, trace.Span):
                current = trace.INVALID_SPAN
            parent = current.get_span_context()
            if parent.is_valid:
                ctx = _span_context(parent.trace_id, _bits(64) or 1)
            else:
                parent = None
                ctx = _span_context(_bits(128) or 1, _bits(64) or 1)
        buffer = current_rollout.get()
        if buffer is not None:
            if buffer.closed:
                buffer = None
            else:
                attrs[semconv.AGL_ROLLOUT_ID] = buffer.rollout_id
        return LightSpan(name, ctx, parent, kind, attrs, buffer, start_time or time.time_ns(),
                         current if parent is not None else None)

    @contextmanager  # the API types this with its own private decorator, hence the ignore
    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                            set_status_on_exception=set_status_on_exception) as current:
            yield current


def start_with(tracer: trace.Tracer, name: str, attrs: dict[str, Any], kind: SpanKind = SpanKind.INTERNAL) -> Any:
    """Start a span carrying ``attrs``, a dict the caller built for this span alone (it is handed over).

    On agl's light tracer the dict becomes the span's attributes as it is. On another tracer (the SDK's)
    the span starts with the attributes a sampler looks at (:func:`encoding.sampler_attributes`) and takes
    the rest through :func:`encoding.set_on`, which spares the SDK's per-value checks.
    """
    if type(tracer) is LightTracer:
        return tracer.start_owned(name, kind, attrs if encoding.capture_content else encoding.redact(attrs))
    span = tracer.start_span(name, kind=kind, attributes=encoding.sampler_attributes(attrs))
    encoding.set_on(span, attrs)
    return span


def context_with(span: trace.Span) -> Context:
    """``trace.set_span_in_context(span)``: the current context with ``span`` as its span, built in one step
    under the API's default runtime context (hooks make one for every model call, tool call and agent run)."""
    if _context_var is not None and otel_context._RUNTIME_CONTEXT is _runtime:
        values = dict(_context_var.get())
        values[_SPAN_KEY] = span
        return Context(values)
    return trace.set_span_in_context(span)


class ClientRecord:
    """Whether agl's span of the HTTP request under a framework's chat span recorded that request whole.

    A framework plugin whose model classes send their requests through a client agl also traces (Pydantic
    AI's OpenAI models through the ``openai`` SDK) makes one of these current, in :data:`client_record`,
    while its chat span's request runs. agl's ``openai`` plugin sets ``complete`` when its span of the
    request ended well with the prompt and the reply it recorded (the wire messages, which the token ids
    are of). The chat span then leaves its own copy of the messages out: the transition builder reads the
    messages of a request from the first of its spans that has them, the two spans being one transition.
    A request that failed, was cut short or went another way (a model on another client, the ``openai``
    plugin off) leaves ``complete`` False, and the chat span records the messages itself.
    """

    __slots__ = ("complete",)

    def __init__(self) -> None:
        self.complete = False


client_record: ContextVar[ClientRecord | None] = ContextVar("agl_client_record", default=None)
"""The :class:`ClientRecord` of the framework model request running now, None outside one."""


def agent_scope(span: trace.Span | None) -> str | None:
    """The agent a span runs in: its own ``gen_ai.agent.name``, else that of the nearest span it started under.

    The same answer the transition builder gives from the finished spans (the nearest ancestor naming an
    agent), known while the call is still running, so a client can tell the gateway which agent calls.
    """
    hops = 0
    while span is not None and hops < 256:
        attributes = getattr(span, "attributes", None)
        name = attributes.get(semconv.GEN_AI_AGENT_NAME) if isinstance(attributes, Mapping) else None
        if isinstance(name, str) and name:
            return name
        span = getattr(span, "_up", None)
        hops += 1
    return None
