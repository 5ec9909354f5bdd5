"""Where the ``openai_agents`` plugin attaches to the OpenAI Agents SDK, and why there.

Two layers, because neither alone sees everything:

**Model calls: every ``Model`` implementation's ``get_response`` and
``stream_response``.** ``Model`` is the SDK's public interface to an LLM; the
runner (``Runner.run``, ``run_sync`` and ``run_streamed`` alike, every turn,
every retry) asks the agent's model for a response through exactly these two
methods, whatever the model is: ``OpenAIChatCompletionsModel``,
``OpenAIResponsesModel``, ``LitellmModel`` or a user's own subclass. The SDK's
trace data cannot replace this: a custom ``Model`` emits no generation span at
all, the Responses model's span holds no input messages, and with tracing
disabled there is no trace data. So the plugin wraps the method on every class
that defines it: the subclasses that exist at ``instrument()``, and through
``Model.__init_subclass__`` each one defined later (a user's model class, or
``LitellmModel`` imported after ``instrument()``). A subclass that calls
``super().get_response()`` makes one span, not two (the wrapper steps aside
while the same model object is already in a call). The chat span is current
while the model runs, so the ``openai`` plugin's span for the HTTP request
nests under it and the two merge into one transition (token ids from the inner
one); its W3C ``traceparent`` goes out in ``ModelSettings.extra_headers``, so a
gateway in front of the model can join its records to the span whichever client
the model uses (chat completions, responses, LiteLLM). ``LitellmModel`` drops the
token ids a vLLM-style server returns when it converts LiteLLM's reply; LiteLLM
keeps them, and :mod:`agl_core.litellm_tokens` puts them on the chat span.

**Agents, tools, handoffs, guardrails: the SDK's own spans, at the span
classes.** The runner opens an SDK span for each agent turn, function tool,
handoff and guardrail, on the sync, async and streamed paths alike, and marks
it current; ``agents.tracing.get_current_span()`` therefore says, at any point
of a run, which agent and tool the code runs under. A ``TracingProcessor``
would hear about those spans only while tracing is on: with
``set_tracing_disabled(True)``, ``OPENAI_AGENTS_DISABLE_TRACING=1`` or
``RunConfig(tracing_disabled=True)`` the SDK hands out ``NoOpSpan`` objects and
calls no processor, and ``set_trace_processors([...])`` after ``instrument()``
would drop it. So the plugin wraps ``start``, ``finish`` and ``set_error`` of
both span classes, ``SpanImpl`` and ``NoOpSpan``: the SDK's spans and any
processors (the user's, the default exporter's) work exactly as before, and
agl sees the same events traced or not, without adding or removing a processor.
``set_error`` is also how a failing function tool shows: the SDK turns the
tool's exception into a string for the model by default, but reports it on the
tool's span from inside its ``except`` block, where the exception itself is
still at hand; the tool span gets ``agl.tool.status`` from it. The tool call id
comes from ``ToolContext.from_agent_context``, which the runner calls inside
the tool's span.

``RunConfig(trace_include_sensitive_data=False)`` keeps tool arguments and
results out of the SDK's span data, so agl's tool spans carry only the call id
and the outcome; the chat spans keep their messages whatever that setting,
since they are what a trainer learns from (the SDK setting governs its own
traces; agl's spans go only to the rollout and to the user's own provider).

Each agl span (``invoke_agent``, ``execute_tool``, handoff, guardrail) is made
current in OpenTelemetry exactly while the SDK's span is current in the SDK, so
the chat spans of an agent nest under its ``invoke_agent`` span, and a tool that
runs another agent nests that agent under the tool. The chat span also carries
``gen_ai.agent.name`` itself. Nothing is left behind when a span ends.

An SDK release whose classes are not where this plugin looks makes
``instrument()`` skip the plugin with a message naming the missing piece and
the tested range, instead of failing.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
from collections.abc import AsyncIterator, Callable
from contextvars import Token
from typing import Any, ClassVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_core import collector, litellm_tokens, semconv, tools
from agl_core.encoding import set_on
from agl_core.guard import report
from agl_core.plugin import Instrumentor
from agl_core.tracer import context_with, start_with
from agl_openai_agents import attributes

TESTED = "openai-agents >= 0.2.11, < 0.25"
"""The SDK releases this plugin is tested against (the ``instruments`` extra of agl-openai-agents)."""

_MODEL_KEY = otel_context.create_key("agl.openai_agents.model")  # the model object whose call is current
_TRACEPARENT = "traceparent"
_MAX_OPEN = 10_000  # SDK spans open at once beyond which agl assumes leaked ones and starts over


class UnsupportedLayout(NotImplementedError):
    """The installed ``agents`` package lacks a class or method this plugin hooks."""


# --------------------------------------------------------------------------- the SDK, located once


class _Sdk:
    """The SDK classes the plugin hooks, imported and checked at attach time (never at module import)."""

    def __init__(self) -> None:
        try:
            from agents import tracing
            from agents.exceptions import AgentsException
            from agents.models.interface import Model
            from agents.tool_context import ToolContext
            from agents.tracing import span_data, spans
        except ImportError as exc:
            raise UnsupportedLayout(self._unknown(f"cannot import {exc.name or exc}")) from None
        self.model: type[Any] = Model
        self.exception: type[Any] = AgentsException
        self.tool_context: type[Any] = ToolContext
        self.get_current_span: Callable[[], Any] = self._need(tracing, "get_current_span")
        self.span_classes: tuple[type[Any], ...] = (self._need(spans, "SpanImpl"), self._need(spans, "NoOpSpan"))
        for owner, methods in ((Model, ("get_response", "stream_response")),
                               *((cls, ("start", "finish", "set_error")) for cls in self.span_classes),
                               (ToolContext, ("from_agent_context",))):
            for method in methods:
                self._need(owner, method)
        if "__init__" not in AgentsException.__dict__:
            raise UnsupportedLayout(self._unknown("AgentsException no longer defines __init__"))
        if not isinstance(ToolContext.__dict__.get("from_agent_context"), classmethod):
            raise UnsupportedLayout(self._unknown("ToolContext.from_agent_context is no longer a classmethod"))
        self.kinds: dict[type[Any], int] = {
            self._need(span_data, "AgentSpanData"): _AGENT,
            self._need(span_data, "FunctionSpanData"): _TOOL,
            self._need(span_data, "HandoffSpanData"): _HANDOFF,
            self._need(span_data, "GuardrailSpanData"): _GUARDRAIL,
        }
        # human in the loop (tool approvals; releases before it have none): what a paused or refused call
        # produces, and the call that refuses one
        self.tool_result: type[Any] | None = None
        self.approval_item: type[Any] | None = None
        self.run_context: type[Any] | None = None
        try:
            from agents.items import ToolApprovalItem
            from agents.run_context import RunContextWrapper
            from agents.tool import FunctionToolResult
        except ImportError:
            pass
        else:
            if "__init__" in FunctionToolResult.__dict__ and callable(getattr(RunContextWrapper, "reject_tool", None)):
                self.tool_result, self.approval_item, self.run_context = (FunctionToolResult, ToolApprovalItem,
                                                                          RunContextWrapper)
        for name in ("GenerationSpanData", "ResponseSpanData", "MCPListToolsSpanData", "TranscriptionSpanData",
                     "SpeechSpanData", "SpeechGroupSpanData"):
            cls = getattr(span_data, name, None)
            if cls is not None:
                self.kinds[cls] = _SKIP  # leaves: what happens inside a model call is the chat span's

    def _need(self, owner: Any, name: str) -> Any:
        value = getattr(owner, name, None)
        if value is None:
            where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
            raise UnsupportedLayout(self._unknown(f"{where}.{name} is missing"))
        return value

    @staticmethod
    def _unknown(what: str) -> str:
        try:
            from importlib.metadata import version

            installed = version("openai-agents")
        except Exception:  # noqa: BLE001 - only for the message
            installed = "?"
        return (f"unsupported OpenAI Agents SDK layout (openai-agents {installed}: {what}); "
                f"agl-openai-agents is tested with {TESTED}")


# --------------------------------------------------------------------------- SDK spans -> agl spans

_SCOPE, _AGENT, _TOOL, _HANDOFF, _GUARDRAIL, _SKIP = range(6)


class _Node:
    """One open SDK span that matters to agl: its agl span (None for plain scopes) and the agent it runs under."""

    __slots__ = ("sdk", "kind", "span", "agent", "parent", "token", "error", "exc", "raised", "call_id", "outcome")

    def __init__(self, sdk: Any, kind: int, span: trace.Span | None, agent: str | None,
                 parent: _Node | None = None) -> None:
        self.sdk = sdk
        self.kind = kind
        self.span = span
        self.agent = agent
        self.parent = parent  # the node current when this one started
        self.token: Token[Context] | None = None
        self.error: Any = None
        self.exc: BaseException | None = None
        self.raised: BaseException | None = None  # an SDK exception made while this span was current
        self.call_id: str | None = None
        self.outcome: str | None = None  # a tool call the SDK answered without running it: pending | rejected


class _Bridge:
    """Mirrors the SDK's open spans as agl spans; every entry point is fail-open."""

    def __init__(self, sdk: _Sdk) -> None:
        self.kinds = dict(sdk.kinds)
        self.approval_item = sdk.approval_item
        self.current_sdk_span = sdk.get_current_span
        self.nodes: dict[int, _Node] = {}  # id(SDK span) -> node, only while the SDK span is open

    def kind_of(self, data: Any) -> int:
        kind = self.kinds.get(type(data))
        if kind is None:
            kind = next((k for cls, k in self.kinds.items() if isinstance(data, cls)), _SCOPE)
            self.kinds[type(data)] = kind
        return kind

    def node(self, sdk_span: Any) -> _Node | None:
        node = self.nodes.get(id(sdk_span))
        return node if node is not None and node.sdk is sdk_span else None

    def current(self) -> _Node | None:
        """The node of the SDK span current here (an agent, a turn, a tool), if agl follows it."""
        sdk_span = self.current_sdk_span()
        return self.node(sdk_span) if sdk_span is not None else None

    def start(self, sdk_span: Any, mark_current: bool) -> None:
        try:
            data = sdk_span.span_data
            kind = self.kind_of(data)
            if kind == _SKIP or self.node(sdk_span) is not None:
                return
            parent = self.current()
            agent = parent.agent if parent is not None else None
            span: trace.Span | None = None
            if kind == _AGENT:
                agent = data.name if isinstance(data.name, str) else agent
                span = collector.tracer().start_span(semconv.agent_span_name(agent),
                                                     attributes=attributes.agent_attributes(agent))
            elif kind == _TOOL:
                span = collector.tracer().start_span(semconv.tool_span_name(data.name),
                                                     attributes=attributes.tool_start_attributes(data.name, agent))
            elif kind == _HANDOFF:
                span = collector.tracer().start_span(attributes.handoff_span_name(None))
            elif kind == _GUARDRAIL:
                span = collector.tracer().start_span(attributes.guardrail_span_name(data.name))
            node = _Node(sdk_span, kind, span, agent, parent)
            if span is not None and mark_current:
                node.token = otel_context.attach(context_with(span))
            if len(self.nodes) >= _MAX_OPEN:
                self.nodes.clear()  # SDK spans that were never finished: forget them rather than grow
            self.nodes[id(sdk_span)] = node
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai_agents.span_start", exc)

    @staticmethod
    def _traced(node: _Node | None) -> _Node | None:
        """``node``, or the nearest node above it that has an agl span: an error the SDK reports on a span agl
        does not mirror (a turn: a tripped input guardrail) belongs to the agent the turn is part of."""
        while node is not None and node.span is None:
            node = node.parent
        return node

    def error(self, sdk_span: Any, error: Any) -> None:
        try:
            node = self.node(sdk_span)
            if node is not None and node.span is None:
                node = self._traced(node)
                if node is None or node.error is not None:
                    return
            if node is not None:
                node.error = error
                # the SDK reports a failed tool from inside its `except` block: the exception is still current
                node.exc = sys.exc_info()[1]
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai_agents.span_error", exc)

    def raising(self, exc: BaseException) -> None:
        """The SDK made one of its exceptions (a tripped guardrail, too many turns) where the failing span is
        current: it reports that span's error without the exception at hand and raises it after, so the span
        takes its class as ``error.type``, as spans of the other plugins do."""
        try:
            node = self._traced(self.current())
            if node is not None and node.raised is None:
                node.raised = exc
        except Exception as fault:  # noqa: BLE001 - fail-open
            report("openai_agents.exception", fault)

    def finish(self, sdk_span: Any, reset_current: bool) -> None:
        node = self.nodes.get(id(sdk_span))
        if node is None or node.sdk is not sdk_span:
            return
        del self.nodes[id(sdk_span)]
        span = node.span
        if span is None:
            return
        try:
            if node.token is not None and (reset_current or trace.get_current_span() is span):
                otel_context.detach(node.token)
            self._end(node, span, sdk_span.span_data)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai_agents.span_end", exc)
            span.end()

    def _end(self, node: _Node, span: trace.Span, data: Any) -> None:
        kind = node.kind
        if kind == _TOOL and node.outcome is not None:
            set_on(span, attributes.tool_end_attributes(data.input, None, node.call_id, None, None))
            if node.outcome == semconv.TOOL_PENDING:
                tools.pause(span, data.name)
            else:
                tools.reject(span, attributes.error_message(node.error) if node.error is not None else None)
            span.end()
            return
        if kind == _TOOL:
            set_on(span, attributes.tool_end_attributes(data.input, data.output, node.call_id, node.error,
                                                        node.exc))
        elif kind == _HANDOFF:
            span.update_name(attributes.handoff_span_name(data.to_agent))
            set_on(span, attributes.handoff_attributes(data.from_agent, data.to_agent))
        elif kind == _GUARDRAIL:
            set_on(span, attributes.guardrail_attributes(data.name, data.triggered, node.agent))
        if node.error is not None:
            exc = node.exc or node.raised
            if kind != _TOOL:
                span.set_attribute(semconv.ERROR_TYPE, type(exc).__qualname__ if exc is not None
                                   else attributes.error_type(node.error))
            if exc is not None:
                span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, attributes.error_message(node.error)))
        span.end()

    def answered_unrun(self, result: Any) -> None:
        """The SDK made a ``FunctionToolResult`` while a tool's span is current: it answers the call without running
        it (a tool that ran gets its result made after its span ends). A ``ToolApprovalItem`` (or no item yet) is a
        pause for approval, anything else the output of a refusal (a rejected approval, a tool input guardrail)."""
        try:
            node = self.current()
            if node is not None and node.kind == _TOOL and node.outcome is None:
                item = getattr(result, "run_item", None)
                paused = item is None or (self.approval_item is not None and isinstance(item, self.approval_item))
                node.outcome = semconv.TOOL_PENDING if paused else semconv.TOOL_REJECTED
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai_agents.tool_result", exc)

    def rejected(self, item: Any, message: Any) -> None:
        """``reject_tool``: a "no" to a call's approval request. Inside the call's own span it marks that span; for
        a call that paused in an earlier run (its state saved, the decision made between runs) the SDK answers it
        on resuming without a span, so the rejection gets its ``execute_tool`` span here: the call's one outcome."""
        try:
            call_id = _field(getattr(item, "raw_item", None), "call_id")
            node = self.current()
            if node is not None and node.kind == _TOOL and (node.call_id is None or node.call_id == call_id):
                node.outcome = semconv.TOOL_REJECTED
                return
            name = getattr(item, "name", None) or getattr(item, "tool_name", None)
            agent = getattr(getattr(item, "agent", None), "name", None)
            span = collector.tracer().start_span(
                semconv.tool_span_name(name if isinstance(name, str) else None),
                attributes=attributes.tool_start_attributes(name if isinstance(name, str) else None,
                                                            agent if isinstance(agent, str) else None))
            set_on(span, attributes.tool_end_attributes(getattr(item, "arguments", None), None, call_id, None, None))
            tools.reject(span, message if isinstance(message, str) else None)
            span.end()
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai_agents.tool_rejected", exc)

    def note_call_id(self, call_id: Any) -> None:
        """The runner made the ``ToolContext`` of the tool call whose span is current: remember its call id."""
        try:
            node = self.current()
            if node is not None and node.kind == _TOOL and node.call_id is None and isinstance(call_id, str):
                node.call_id = call_id
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai_agents.tool_context", exc)


# --------------------------------------------------------------------------- model calls


_ARG_NAMES = ("system_instructions", "input", "model_settings", "tools", "output_schema", "handoffs")


def _field(obj: Any, name: str) -> Any:
    """A field of an SDK item that is a model object, or a plain dict once a run state was loaded from JSON."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> Any:
    return args[index] if len(args) > index else kwargs.get(_ARG_NAMES[index])


def _traceparent(span: trace.Span) -> str | None:
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{'01' if ctx.trace_flags & 1 else '00'}"


def _with_traceparent(settings: Any, span: trace.Span) -> Any:
    """A copy of ``ModelSettings`` whose ``extra_headers`` carry our ``traceparent``, unless the caller set one."""
    headers = getattr(settings, "extra_headers", None)
    if headers:
        for key in headers:
            if isinstance(key, str) and key.lower() == _TRACEPARENT:
                return settings
    value = _traceparent(span)
    if value is None:
        return settings
    settings = _copy(settings)  # never edit the caller's (often the agent's own) settings object
    settings.extra_headers = {**headers, _TRACEPARENT: value} if headers else {_TRACEPARENT: value}
    return settings


def _copy(obj: Any) -> Any:
    """A shallow copy of a plain dataclass like ``ModelSettings`` (its fields are its ``__dict__``), made
    without the pickle-protocol round trip of ``copy.copy``, which is what anything else gets."""
    cls = type(obj)
    state = getattr(obj, "__dict__", None)
    if type(state) is not dict or "__dataclass_fields__" not in cls.__dict__ or hasattr(cls, "__slots__"):
        return copy.copy(obj)
    new = object.__new__(cls)
    new.__dict__.update(state)
    return new


class _Call:
    """One model call in flight: its span, the context that makes it current, and the arguments to pass on."""

    __slots__ = ("span", "context", "args", "kwargs", "model_name")

    def __init__(self, span: trace.Span, context: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 model_name: str | None) -> None:
        self.span = span
        self.context = context
        self.args = args
        self.kwargs = kwargs
        self.model_name = model_name

    def end(self, attrs: Callable[[], dict[str, Any]]) -> None:
        try:
            set_on(self.span, attrs())
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("openai_agents.model_response", exc)
        self.span.end()

    def fail(self, exc: BaseException) -> None:
        try:
            span = self.span
            span.set_attribute(semconv.ERROR_TYPE, type(exc).__qualname__)
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            span.end()
        except Exception as fault:  # noqa: BLE001
            report("openai_agents.model_error", fault)


def _start_call(bridge: _Bridge, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                stream: bool) -> _Call | None:
    """Open the chat span of one model call, or None when agl stays out (a ``super()`` call, or a fault)."""
    if otel_context.get_value(_MODEL_KEY) is model:
        return None  # a subclass's get_response calling super(): its span is open already
    span = None
    try:
        litellm_tokens.ensure()  # a LitellmModel's first call: LiteLLM is loaded now
        attrs = attributes.request_attributes(model, _arg(args, kwargs, 0), _arg(args, kwargs, 1),
                                              _arg(args, kwargs, 2), _arg(args, kwargs, 3), _arg(args, kwargs, 5),
                                              stream)
        node = bridge.current()
        if node is not None and node.agent:
            attrs[semconv.GEN_AI_AGENT_NAME] = node.agent
        name = attrs.get(semconv.GEN_AI_REQUEST_MODEL)
        span = start_with(collector.tracer(), semconv.chat_span_name(name), attrs, SpanKind.CLIENT)
        settings = _arg(args, kwargs, 2)
        if settings is not None:
            settings = _with_traceparent(settings, span)
            if len(args) > 2:
                args = (*args[:2], settings, *args[3:])
            else:
                kwargs = {**kwargs, "model_settings": settings}
        context = trace.set_span_in_context(span, otel_context.set_value(_MODEL_KEY, model))
        return _Call(span, context, args, kwargs, name)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("openai_agents.model_request", exc)
        if span is not None:
            span.end()
        return None


_FINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})


def _completed_response(event: Any) -> Any:
    """The final ``Response`` of a stream, carried by its ``response.completed`` (or ``incomplete``) event."""
    return event.response if getattr(event, "type", None) in _FINAL_EVENTS else None


# --------------------------------------------------------------------------- the plugin


class OpenAIAgentsInstrumentor(Instrumentor):
    """Spans for OpenAI Agents SDK runs: model calls of every ``Model``, agents, tools, handoffs, guardrails."""

    name: ClassVar[str] = "openai_agents"
    framework: ClassVar[str] = "agents"
    requirements: ClassVar[tuple[str, ...]] = ("openai-agents >= 0.2.11",)

    _active = False
    _bridge: _Bridge | None = None

    def _attach(self) -> None:
        sdk = _Sdk()
        bridge = self._bridge = _Bridge(sdk)
        self._model_base = sdk.model
        for cls in (sdk.model, *_subclasses(sdk.model)):
            self._wrap_model_class(cls)
        self.patch(sdk.model, "__init_subclass__", self._subclass_hook)
        for span_class in sdk.span_classes:
            self.patch(span_class, "start", functools.partial(_span_start, bridge=bridge))
            self.patch(span_class, "finish", functools.partial(_span_finish, bridge=bridge))
            self.patch(span_class, "set_error", functools.partial(_span_error, bridge=bridge))
        self.patch(sdk.tool_context, "from_agent_context", functools.partial(_tool_context, bridge=bridge))
        self.patch(sdk.exception, "__init__", functools.partial(_exception_init, bridge=bridge))
        litellm_tokens.hold(self)  # LitellmModel: the token ids of a vLLM-style server, which LiteLLM keeps
        if sdk.tool_result is not None and sdk.run_context is not None:
            self.patch(sdk.tool_result, "__init__", functools.partial(_tool_result_init, bridge=bridge))
            self.patch(sdk.run_context, "reject_tool", functools.partial(_reject_tool, bridge=bridge))
        self._active = True

    def _detach(self) -> None:
        self._active = False
        litellm_tokens.release(self)
        if self._bridge is not None:
            self._bridge.nodes.clear()

    # -- model classes ---------------------------------------------------------------------

    def _wrap_model_class(self, cls: type[Any]) -> None:
        """Wrap the model methods ``cls`` defines itself (inherited ones are wrapped where they are defined)."""
        for attr, make in (("get_response", self._get_response_wrapper),
                           ("stream_response", self._stream_response_wrapper)):
            method = cls.__dict__.get(attr)
            if (isinstance(method, types.FunctionType) and not getattr(method, "__isabstractmethod__", False)
                    and not getattr(method, "__agl_wrapped__", False)):
                self.patch(cls, attr, make)

    def _subclass_hook(self, original: Any) -> Any:
        plugin = self
        base = self._model_base
        own = base.__dict__.get("__init_subclass__")  # a hook the SDK defines itself, if any

        def __init_subclass__(cls: type[Any], /, **kwargs: Any) -> None:
            if own is not None:
                own.__get__(None, cls)(**kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)
            if plugin._active:
                try:
                    plugin._wrap_model_class(cls)
                except Exception as exc:  # noqa: BLE001 - fail-open
                    report("openai_agents.model_subclass", exc)

        return classmethod(__init_subclass__)

    def _get_response_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def get_response(model: Any, *args: Any, **kwargs: Any) -> Any:
            bridge = plugin._bridge
            call = _start_call(bridge, model, args, kwargs, False) if plugin._active and bridge else None
            if call is None:
                return await original(model, *args, **kwargs)
            token = otel_context.attach(call.context)
            try:
                response = await original(model, *call.args, **call.kwargs)
            except BaseException as exc:
                otel_context.detach(token)
                call.fail(exc)
                raise
            otel_context.detach(token)
            call.end(lambda: attributes.response_attributes(response, call.model_name))
            return response

        get_response.__agl_wrapped__ = True  # type: ignore[attr-defined]
        return get_response

    def _stream_response_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def stream_response(model: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            bridge = plugin._bridge
            call = _start_call(bridge, model, args, kwargs, True) if plugin._active and bridge else None
            if call is None:
                events = original(model, *args, **kwargs)
            else:
                events = _traced_stream(call, original(model, *call.args, **call.kwargs))
            try:
                async for event in events:
                    yield event
            finally:  # stopped early (or exhausted: then a no-op): close what we iterate, as the caller closes us
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()

        stream_response.__agl_wrapped__ = True  # type: ignore[attr-defined]
        return stream_response


async def _traced_stream(call: _Call, stream: Any) -> AsyncIterator[Any]:
    """The model's events, passed on as they come; the chat span is current only while the model runs."""
    completed = None
    iterator = stream.__aiter__()
    try:
        while True:
            token = otel_context.attach(call.context)
            try:
                event = await iterator.__anext__()
            except StopAsyncIteration:
                break
            finally:
                otel_context.detach(token)
            try:
                response = _completed_response(event)
                if response is not None:
                    completed = response
            except Exception as exc:  # noqa: BLE001 - fail-open
                report("openai_agents.stream_event", exc)
            yield event
    except GeneratorExit:  # the consumer stopped early: end with what arrived
        call.end(lambda: attributes.stream_attributes(completed, call.model_name))
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
        raise
    except BaseException as exc:
        call.fail(exc)
        raise
    call.end(lambda: attributes.stream_attributes(completed, call.model_name))


def _subclasses(cls: type[Any]) -> list[type[Any]]:
    found: list[type[Any]] = []
    stack = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in found:
            found.append(sub)
            stack.extend(sub.__subclasses__())
    return found


# --------------------------------------------------------------------------- span-class and tool-context wrappers


def _span_start(original: Callable[..., Any], bridge: _Bridge) -> Callable[..., Any]:
    @functools.wraps(original)
    def start(span: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(span, "started_at", None) is None:  # a SpanImpl started twice only warns: follow it once
            bridge.start(span, bool(args[0] if args else kwargs.get("mark_as_current", False)))
        return original(span, *args, **kwargs)

    return start


def _span_finish(original: Callable[..., Any], bridge: _Bridge) -> Callable[..., Any]:
    @functools.wraps(original)
    def finish(span: Any, *args: Any, **kwargs: Any) -> Any:
        if bridge.nodes:
            bridge.finish(span, bool(args[0] if args else kwargs.get("reset_current", False)))
        return original(span, *args, **kwargs)

    return finish


def _span_error(original: Callable[..., Any], bridge: _Bridge) -> Callable[..., Any]:
    @functools.wraps(original)
    def set_error(span: Any, error: Any, *args: Any, **kwargs: Any) -> Any:
        if bridge.nodes:
            bridge.error(span, error)
        return original(span, error, *args, **kwargs)

    return set_error


def _exception_init(original: Callable[..., Any], bridge: _Bridge) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(exc: BaseException, *args: Any, **kwargs: Any) -> None:
        original(exc, *args, **kwargs)
        if bridge.nodes:
            bridge.raising(exc)

    return __init__


def _tool_result_init(original: Callable[..., Any], bridge: _Bridge) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(result: Any, *args: Any, **kwargs: Any) -> None:
        original(result, *args, **kwargs)
        if bridge.nodes:
            bridge.answered_unrun(result)

    return __init__


def _reject_tool(original: Callable[..., Any], bridge: _Bridge) -> Callable[..., Any]:
    @functools.wraps(original)
    def reject_tool(context: Any, approval_item: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(context, approval_item, *args, **kwargs)
        message = kwargs.get("rejection_message", args[1] if len(args) > 1 else None)
        bridge.rejected(approval_item, message)
        return out

    return reject_tool


def _tool_context(original: Any, bridge: _Bridge) -> Any:
    func = original.__func__  # a classmethod: wrap the function, re-wrap as a classmethod

    @functools.wraps(func)
    def from_agent_context(cls: type[Any], *args: Any, **kwargs: Any) -> Any:
        tool_context = func(cls, *args, **kwargs)
        if bridge.nodes:
            bridge.note_call_id(getattr(tool_context, "tool_call_id", None))
        return tool_context

    return classmethod(from_agent_context)
