"""The span collector: which tracer agl writes to, and which rollout a span belongs to.

Provider rule: when the user has set an OpenTelemetry SDK ``TracerProvider`` as
the global one (or passed one to ``instrument``), agl adds its span processor to
it and creates its spans there, so the user's exporters see them; agl never
sets or replaces the global provider. Without one, nobody but agl reads the
spans, so agl records them with its own minimal tracer (``agl_core.tracer``),
which skips the SDK's per-span machinery. The global provider is re-checked
each time a tracer is asked for (an identity check), so a provider the user
sets after ``instrument()`` is picked up.

Attribution: the current rollout lives in a ``ContextVar``. A span started
inside a rollout is stamped with ``agl.rollout.id`` (the processor's
``on_start`` runs in the context that creates the span, so this holds across
asyncio tasks and context-copying executors, and for spans of other
instrumentations on the same provider); when it ends, it goes to that rollout's
buffer. Spans started outside any rollout are never held, so nothing grows
without bound.

Fail-open with the user's provider: agl's processor never exports, flushes or
waits; it only appends a finished span to its rollout's buffer, so a slow or
hung exporter can delay the agent only through the user's own processor (the
SDK's ``SimpleSpanProcessor`` exports on the caller's thread by design; the
``BatchSpanProcessor`` does not). A user span processor that raises when a span
starts is reported (``guard``) and the span is recorded by agl's own tracer
instead; one that raises when a span ends is reported and the span still goes
to its rollout, so the rollout stays complete and the agent never sees either.
"""

from __future__ import annotations

import logging
import math
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from agl_core import encoding, semconv
from agl_core.guard import report
from agl_core.schema import Span

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace import Span as SdkSpan
    from opentelemetry.trace import Tracer

logger = logging.getLogger("agl")

class RolloutBuffer:
    """Finished spans of one open rollout, in end order."""

    __slots__ = ("rollout_id", "task_id", "attempt", "spans", "closed")

    def __init__(self, rollout_id: str, task_id: str, attempt: int) -> None:
        self.rollout_id = rollout_id
        self.task_id = task_id
        self.attempt = attempt
        self.spans: list[ReadableSpan] = []
        self.closed = False


current_rollout: ContextVar[RolloutBuffer | None] = ContextVar("agl_current_rollout", default=None)
_open: dict[str, RolloutBuffer] = {}  # rollout id -> buffer, only while the rollout is open
late_spans = 0  # spans of a rollout that ended after its block had closed (their rollout was written without them)


def open_buffer(buffer: RolloutBuffer) -> None:
    _open[buffer.rollout_id] = buffer


def close_buffer(buffer: RolloutBuffer) -> list[ReadableSpan]:
    buffer.closed = True
    _open.pop(buffer.rollout_id, None)
    if not _open:
        encoding.forget_messages()  # the memos' conversations ended with their rollouts
    return buffer.spans


def count_late(rollout_id: str) -> None:
    global late_spans
    late_spans += 1
    if late_spans == 1:
        logger.warning("agl: a span of rollout %s ended after the rollout closed; such spans are counted in "
                       "agl_core.collector.late_spans and not stored", rollout_id)


def _make_processor() -> Any:
    from opentelemetry.sdk.trace import SpanProcessor

    class AglSpanProcessor(SpanProcessor):
        """Stamps spans with the current rollout and collects them when they end."""

        def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
            buffer = current_rollout.get()
            if buffer is not None and not buffer.closed:
                try:
                    span.set_attribute(semconv.AGL_ROLLOUT_ID, buffer.rollout_id)
                except Exception as exc:  # noqa: BLE001
                    report("collector.on_start", exc)

        def on_end(self, span: ReadableSpan) -> None:
            attrs = span.attributes
            rollout_id = attrs.get(semconv.AGL_ROLLOUT_ID) if attrs else None
            if rollout_id is None:
                return
            buffer = _open.get(str(rollout_id))
            if buffer is None:
                count_late(str(rollout_id))
                return
            buffer.spans.append(span)

        def shutdown(self) -> None:
            return None

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return AglSpanProcessor()


class _Telemetry:
    """Which provider and tracer agl uses now."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.processor: Any = None
        self.attached: list[Any] = []  # providers our processor is on (kept alive: few, long-lived)
        self.explicit: Any = None
        self.seen_global: Any = object()
        self.seen_raw: Any = object()  # the API's global-provider slot when the tracer was chosen
        self.tracer: Tracer | None = None
        self.provider: Any = None


_t = _Telemetry()


def _attach(provider: Any) -> None:
    if _t.processor is None:
        _t.processor = _make_processor()
    if not any(p is provider for p in _t.attached):
        provider.add_span_processor(_t.processor)
        _t.attached.append(provider)


def _fail_open_tracer(inner: Tracer) -> Tracer:
    from contextlib import contextmanager

    from opentelemetry import trace as trace_api

    class FailOpenTracer(trace_api.Tracer):
        """The user's SDK tracer, for agl's spans: content left out when capture is off, never raising."""

        def start_span(self, name: str, context: Any = None, kind: Any = trace_api.SpanKind.INTERNAL,
                       attributes: Any = None, links: Any = None, start_time: int | None = None,
                       record_exception: bool = True, set_status_on_exception: bool = True) -> Any:
            if attributes and not encoding.capture_content:
                attributes = encoding.redact(attributes)
            try:
                span = inner.start_span(name, context, kind, attributes, links, start_time, record_exception,
                                        set_status_on_exception)
            except Exception as exc:  # noqa: BLE001 - e.g. a user span processor that raises in on_start
                report("collector.start_span", exc)
                from agl_core.tracer import LightTracer

                return LightTracer().start_span(name, context, kind, attributes, links, start_time)
            end = span.end

            def fail_open_end(end_time: int | None = None) -> None:
                try:
                    end(end_time)
                except Exception as exc:  # noqa: BLE001 - a user span processor that raises in on_end
                    report("collector.span_end", exc)
                    _deliver(span)  # processors after the raising one never saw it: agl's may be among them

            span.end = fail_open_end  # type: ignore[method-assign]
            return span

        @contextmanager
        def start_as_current_span(self, name: str, context: Any = None,  # type: ignore[override]
                                  kind: Any = trace_api.SpanKind.INTERNAL, attributes: Any = None,
                                  links: Any = None, start_time: int | None = None, record_exception: bool = True,
                                  set_status_on_exception: bool = True, end_on_exit: bool = True) -> Any:
            span = self.start_span(name, context, kind, attributes, links, start_time)
            with trace_api.use_span(span, end_on_exit=end_on_exit, record_exception=record_exception,
                                    set_status_on_exception=set_status_on_exception) as current:
                yield current

    return FailOpenTracer()


def _deliver(span: Any) -> None:
    """Put an ended span in its rollout's buffer unless agl's processor already did (it appends last)."""
    attrs = span.attributes
    buffer = _open.get(str(attrs.get(semconv.AGL_ROLLOUT_ID))) if attrs else None
    if buffer is not None and (not buffer.spans or buffer.spans[-1] is not span):
        buffer.spans.append(span)


def _refresh(global_provider: Any) -> Tracer:
    from opentelemetry.sdk.trace import TracerProvider

    with _t.lock:
        provider = _t.explicit
        if provider is None and isinstance(global_provider, TracerProvider):
            provider = global_provider
        if provider is None:
            from agl_core.tracer import LightTracer

            _t.tracer = LightTracer()
        else:
            _attach(provider)
            _t.tracer = _fail_open_tracer(provider.get_tracer(semconv.TRACER_NAME))
        _t.provider = provider
        _t.seen_global = global_provider
        return _t.tracer


def install(tracer_provider: Any = None) -> None:
    """Make agl's processor part of ``tracer_provider`` (or the global/private one)."""
    from opentelemetry import trace

    if tracer_provider is not None:
        _t.explicit = tracer_provider
    _refresh(trace.get_tracer_provider())


def use_provider(tracer_provider: Any) -> None:
    """Send agl's spans to ``tracer_provider`` (an SDK provider); None goes back to the provider rule above."""
    with _t.lock:
        _t.explicit = tracer_provider
        _t.tracer = None


_UNSET = object()
_trace_api: Any = None  # ``opentelemetry.trace``, imported on the first call (a ``from`` import per call costs)


def _load_trace_api() -> Any:
    global _trace_api
    from opentelemetry import trace

    _trace_api = trace
    return trace


def tracer() -> Tracer:
    """agl's tracer on the provider chosen by the rule above; cheap enough for every call.

    ``trace.get_tracer_provider()`` reads ``os.environ`` on every call while no provider is set,
    so the hot path compares the API's global slot by identity and asks the API only on a change.
    """
    trace = _trace_api or _load_trace_api()
    raw = getattr(trace, "_TRACER_PROVIDER", _UNSET)
    t = _t.tracer
    if t is not None and raw is not _UNSET and raw is _t.seen_raw:
        return t
    t = _refresh(trace.get_tracer_provider())
    _t.seen_raw = raw
    return t


def provider() -> Any:
    """The SDK provider agl's spans go to now, or None when agl's own tracer records them."""
    tracer()
    return _t.provider


# --------------------------------------------------------------------------- to records


def _finite(value: Any) -> Any:
    return value if math.isfinite(value) else str(value)  # keep the fact without breaking JSON


_SCALARS = frozenset({str, bool, int, float})


def _text(value: str) -> str:
    """A string that can be stored as UTF-8: lone surrogates (invalid unicode) become U+FFFD."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return value


def _plain(value: Any) -> Any:
    """An attribute value as JSON: sequences (token ids: thousands long) as lists, non-finite floats as text.

    agl's own tracer does not police attribute values as the SDK does, so a value OpenTelemetry
    cannot hold (an object, a dict, a nested list) is recorded as its JSON text, cut and marked as
    ``encoding.span_text`` does, rather than breaking the rollout's record when it is stored.
    """
    kind = type(value)
    if kind is str:
        return _text(value)
    if kind is tuple or kind is list:
        types = set(map(type, value))
        if not types <= _SCALARS:
            return encoding.span_text(value)
        if float in types:
            return [_finite(v) if type(v) is float else v for v in value]
        if str in types:
            return [_text(v) if type(v) is str else v for v in value]
        return list(value)
    if kind is float:
        return _finite(value)
    if kind is bool or kind is int or value is None:
        return value
    return encoding.span_text(value)


def to_record(span: ReadableSpan, rollout_id: str | None = None) -> Span:
    """An SDK span as agl's plain ``Span`` record."""
    ctx = span.context
    parent = span.parent
    status = span.status
    attrs = {k: _plain(v) for k, v in (span.attributes or {}).items()}
    if not encoding.capture_content:
        attrs = encoding.redact(attrs)
    events = [
        {"name": e.name, "time_ns": e.timestamp, "attributes": {k: _plain(v) for k, v in (e.attributes or {}).items()}}
        for e in span.events
    ]
    # trusted: OpenTelemetry attribute values are scalars or sequences of them, and _plain made them JSON-safe
    return Span.trusted(
        span_id=format(ctx.span_id, "016x") if ctx else "",
        trace_id=format(ctx.trace_id, "032x") if ctx else "",
        name=_text(span.name),
        parent_id=format(parent.span_id, "016x") if parent is not None else None,
        start_ns=span.start_time or 0,
        end_ns=span.end_time or span.start_time or 0,
        attributes=attrs,
        status=status.status_code.name.lower(),
        status_message=status.description,
        events=events,
        rollout_id=rollout_id if rollout_id is not None else attrs.get(semconv.AGL_ROLLOUT_ID),
    )
