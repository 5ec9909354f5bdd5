"""Where the ``pydantic_ai`` plugin attaches to Pydantic AI, and why there.

Hooks, and why each catches every path:

- **Model calls: ``request`` and ``request_stream`` of every ``Model`` class.**
  ``Model`` is Pydantic AI's one interface to an LLM: an agent run
  (``run``, ``run_sync``, ``run_stream``, ``run_stream_events``, ``iter``, every
  step, every retry), ``pydantic_ai.direct.model_request*`` and a graph node
  calling a model all end in one of these two methods, whatever the model is:
  ``OpenAIChatModel``, ``OpenAIResponsesModel``, any other provider's class,
  ``FunctionModel``, ``TestModel`` or a user's own subclass. Wrapping the OpenAI
  client alone would miss every model that is not on it; the agent graph's
  nodes are private and change between releases. So the plugin wraps the
  methods on every subclass that defines them: those that exist at
  ``instrument()``, and through ``Model.__init_subclass__`` each one defined
  later (a user's model class, a provider imported after ``instrument()``). A
  model that calls another one (``FallbackModel``, ``InstrumentedModel``, any
  ``WrapperModel``, a subclass calling ``super().request``) makes one span, the
  outer one. The chat span is current while the model sends its request (for a
  stream: while the stream opens and closes, never while the consumer holds
  it), so the span of agl's ``openai`` plugin for the HTTP request nests in it
  and the two become one transition, with the token ids of that one; that span
  then holds the request's messages and tools as they went over the wire, and
  the chat span does not encode them again (it does where the request failed or
  went by no client agl traces: :class:`agl_core.tracer.ClientRecord`). The
  ``openai`` plugin's span sends its own ``traceparent``, which agl's gateway
  joins its token-id record to; with that plugin off, models of Pydantic AI's
  OpenAI classes (and their subclasses) get the chat span's ``traceparent`` in
  ``ModelSettings.extra_headers`` instead, for chat completions and the
  Responses API alike (the caller's own ``traceparent`` wins either way).
- **Agent identity: ``Agent.iter``.** Every way of running an agent goes
  through it (``run`` and ``run_stream`` call it; ``run_sync`` and
  ``run_stream_events`` call ``run``; a ``WrapperAgent`` or a durable agent
  calls its wrapped agent's). Its span (``invoke_agent {name}``) is current for
  the whole run, and the agent's name is kept in a ``ContextVar`` the chat and
  tool spans read, so an agent that another agent runs inside a tool nests
  under that tool with its own name (delegation), and the outer agent's name
  comes back when it returns.
- **Graphs: ``pydantic_graph.Step.call``.** A graph runs every node, a
  ``BaseNode`` subclass or a builder step, by calling its step's ``call``;
  each node of a user's graph becomes an agent scope named after the node
  (``invoke_agent {node id}``), so a model called directly in a node carries the
  node's name and an agent run in it nests under it. The nodes of Pydantic AI's
  own agent graph are left out (the agent's span already covers them).
- **Tools: ``ToolManager.execute_tool_call``**, the one place where a run
  executes a function tool, sequential or parallel, streamed or not, including a
  call whose arguments failed validation or that names no known tool (Pydantic
  AI raises its retry there), and **``execute_output_tool_call`` /
  ``validate_output_tool_call``** for output tools (structured output). The
  outcome is what the model is told: ``ok``; ``error`` for a retry
  (``ModelRetry``, ``ToolFailed``, invalid arguments, an unknown tool, an output
  that failed validation); ``timeout`` for a tool that ran past its ``timeout``;
  ``exception`` for anything else it raised.
- **Pydantic AI's own instrumentation** (``Agent(instrument=True)``,
  ``Agent.instrument_all()``, Logfire) is left alone: its spans go to the
  user's exporters as before. With an OpenTelemetry SDK provider set, agl
  collects them in the rollout too; its ``chat`` span wraps agl's and the
  builder merges the two into one transition (content and ids from agl's), and
  its ``execute_tool`` spans are not counted for AIR where agl's span of the
  same tool call is there, so nothing is doubled.

Every hook body is fail-open: a fault in agl's own code is reported through
:func:`agl_core.guard.report` and the framework call goes on unchanged.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token
from typing import Any, ClassVar

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_core import collector, semconv
from agl_core.encoding import set_on
from agl_core.guard import report
from agl_core.openai_client.instrumentor import traces_requests
from agl_core.plugin import Instrumentor
from agl_core.tracer import ClientRecord, attach_context, client_record, context_with, detach_context, start_with
from agl_pydantic_ai import attributes

TESTED = "pydantic-ai-slim >= 2.60, < 3"
"""The Pydantic AI releases this plugin is tested against (the ``instruments`` extra of agl-pydantic-ai)."""

_TRACEPARENT = "traceparent"

_scope: ContextVar[_Scope | None] = ContextVar("agl_pydantic_ai_scope", default=None)
"""The agent run (or graph node) whose code is running now (one variable: the framework copies every one set)."""


class UnsupportedLayout(NotImplementedError):
    """The installed ``pydantic_ai`` lacks a class or method this plugin hooks."""


# --------------------------------------------------------------------------- the framework, located once


class _Framework:
    """The Pydantic AI classes the plugin hooks, imported and checked at attach time (never at module import)."""

    def __init__(self) -> None:
        try:
            from pydantic_ai import exceptions
            from pydantic_ai.agent import Agent
            from pydantic_ai.models import Model
            from pydantic_ai.tool_manager import ToolManager
        except ImportError as exc:
            raise UnsupportedLayout(self._unknown(f"cannot import {exc.name or exc}")) from None
        self.model: type[Any] = Model
        self.agent: type[Any] = Agent
        self.tool_manager: type[Any] = ToolManager
        for owner, name in ((Model, "request"), (Model, "request_stream"), (Model, "__init_subclass__"),
                            (Agent, "iter"), (ToolManager, "execute_tool_call"),
                            (ToolManager, "execute_output_tool_call"), (ToolManager, "validate_output_tool_call")):
            if getattr(owner, name, None) is None:
                raise UnsupportedLayout(self._unknown(f"{owner.__qualname__}.{name} is missing"))
        self.retry_types: tuple[type[BaseException], ...] = tuple(
            t for t in (getattr(exceptions, n, None) for n in ("ModelRetry", "ToolFailed", "ToolRetryError",
                                                                 "ToolFailedError"))
            if isinstance(t, type))
        self.deferral_types: tuple[type[BaseException], ...] = tuple(
            t for t in (getattr(exceptions, n, None) for n in ("CallDeferred", "ApprovalRequired"))
            if isinstance(t, type))
        self.openai_models: tuple[type[Any], ...] = ()
        try:
            from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel

            self.openai_models = (OpenAIChatModel, OpenAIResponsesModel)
        except ImportError:  # pydantic-ai-slim without the openai extra: no model to send a traceparent through
            pass
        self.step: type[Any] | None = None
        try:
            from pydantic_graph import Step

            if isinstance(Step.__dict__.get("call"), property):
                self.step = Step
        except ImportError:
            pass

    @staticmethod
    def _unknown(what: str) -> str:
        try:
            from importlib.metadata import version

            installed = version("pydantic-ai-slim")
        except Exception:  # noqa: BLE001 - only for the message
            installed = "?"
        return (f"unsupported Pydantic AI layout (pydantic-ai-slim {installed}: {what}); "
                f"agl-pydantic-ai is tested with {TESTED}")


# --------------------------------------------------------------------------- shared span helpers


def _fail(span: trace.Span, exc: BaseException, site: str, error_type: str | None = None) -> None:
    try:
        span.set_attribute(semconv.ERROR_TYPE, error_type or type(exc).__qualname__)
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end()
    except Exception as fault:  # noqa: BLE001
        report(site, fault)


def _attach(context: Any, site: str) -> Any:
    """Make ``context`` current; None (nothing to undo) when that failed, which is reported."""
    try:
        return attach_context(context)
    except Exception as exc:  # noqa: BLE001 - fail-open: the call goes on, its span just is not current
        report(site, exc)
        return None


def _detach(token: Any, site: str) -> None:
    if token is None:  # never attached
        return
    try:
        detach_context(token)
    except Exception as exc:  # noqa: BLE001 - e.g. a context closed from another task
        report(site, exc)


def _reset(var: ContextVar[Any], token: Token[Any], default: Any) -> None:
    try:
        var.reset(token)
    except ValueError:  # reset from another context (a generator closed elsewhere)
        var.set(default)


def _traceparent(span: trace.Span) -> str | None:
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{'01' if ctx.trace_flags & 1 else '00'}"


def _with_traceparent(settings: Any, span: trace.Span) -> Any:
    """The call's ``ModelSettings``, copied, with our ``traceparent`` in ``extra_headers`` (the caller's wins)."""
    headers = settings.get("extra_headers") if isinstance(settings, Mapping) else None
    if isinstance(headers, Mapping):
        if any(isinstance(k, str) and k.lower() == _TRACEPARENT for k in headers):
            return settings
    elif headers is not None or (settings is not None and not isinstance(settings, Mapping)):
        return settings  # a shape we do not know: leave it as it is
    value = _traceparent(span)
    if value is None:
        return settings
    return {**(settings or {}), "extra_headers": {**(headers or {}), _TRACEPARENT: value}}


# --------------------------------------------------------------------------- model calls

_ARG_NAMES = ("messages", "model_settings", "model_request_parameters")


def _request_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(messages, model_settings, model_request_parameters)`` of a model call, passed by position or by name."""
    if len(args) == 3:  # how Pydantic AI calls a model
        return args  # type: ignore[return-value]
    given = (*args, *(kwargs.get(name) for name in _ARG_NAMES[len(args):]))
    return given[0], given[1], given[2]


class _Call:
    """One model call in flight: its span, the context that makes it current, the arguments to pass on, and
    what its messages are recorded from when it ends.

    The messages sent and the tools offered are written when the call ends, and only when agl's span of the
    HTTP request (the ``openai`` plugin's, nested in this one) did not record the request whole
    (:class:`~agl_core.tracer.ClientRecord`): the builder takes a request's messages from the first of its
    spans that has them, so encoding them twice buys nothing. A call that failed records them, as does
    every call of a model on no client agl traces.
    """

    __slots__ = ("span", "context", "args", "kwargs", "model_name", "memo", "history", "params", "record")

    def __init__(self, span: trace.Span, context: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 model_name: str | None, memo: attributes.RunMemo | None, history: list[Any], params: Any) -> None:
        self.span = span
        self.context = context
        self.args = args
        self.kwargs = kwargs
        self.model_name = model_name
        self.memo = memo
        self.history = history  # the messages as sent: the framework appends to its own list afterwards
        self.params = params
        self.record = ClientRecord()

    def enter(self) -> tuple[Any, Token[ClientRecord | None]]:
        return _attach(self.context, "pydantic_ai.attach"), client_record.set(self.record)

    @staticmethod
    def leave(tokens: tuple[Any, Token[ClientRecord | None]]) -> None:
        _reset(client_record, tokens[1], None)
        _detach(tokens[0], "pydantic_ai.detach")

    def _response(self, response: Any) -> dict[str, Any]:
        """The attributes to end with: the response's, and the prompt's unless the span below recorded both."""
        if self.record.complete:
            return attributes.response_attributes(response, self.model_name, self.memo, reply=False)
        attrs = attributes.prompt_attributes(self.history, self.params, self.memo)
        attrs.update(attributes.response_attributes(response, self.model_name, self.memo))
        return attrs

    def end(self, response: Any) -> None:
        try:
            set_on(self.span, self._response(response))
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("pydantic_ai.model_response", exc)
        self.span.end()

    def end_stream(self, stream: Any) -> None:
        """Record what the stream delivered; a stream that stopped before the model finished is a failed call."""
        try:
            if self.record.complete:
                # the span below saw the model finish and recorded the reply: the stream's own fields give the
                # rest, without building the whole response (``get()`` assembles every part again)
                set_on(self.span, attributes.response_attributes(stream, self.model_name, reply=False))
            else:
                response = stream.get()
                set_on(self.span, self._response(response))
                if attributes.unfinished(response):
                    self.span.set_attribute(semconv.ERROR_TYPE, "StreamClosedUnfinished")
                    self.span.set_status(Status(StatusCode.ERROR, "the stream was closed before the model finished"))
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("pydantic_ai.stream_response", exc)
        self.span.end()

    def fail(self, exc: BaseException) -> None:
        if not self.record.complete:
            try:  # a failed request keeps the prompt and the tools it sent
                set_on(self.span, attributes.prompt_attributes(self.history, self.params, self.memo))
            except Exception as fault:  # noqa: BLE001 - fail-open
                report("pydantic_ai.model_request", fault)
        _fail(self.span, exc, "pydantic_ai.model_error")


class _Plugin:
    """What the hooks share: whether the plugin is on and the framework's classes."""

    def __init__(self, framework: _Framework) -> None:
        self.framework = framework
        self.active = True

    def start_call(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], stream: bool) -> _Call | None:
        """Open the chat span of one model call, or None when agl stays out (a nested call, or a fault)."""
        if not self.active or client_record.get() is not None:  # a model inside a traced one
            return None
        span = None
        try:
            scope = _scope.get()
            memo = scope.memo if scope is not None else None
            messages, settings, params = _request_args(args, kwargs)
            attrs = attributes.call_attributes(model, settings, stream)
            if scope is not None and scope.name:
                attrs[semconv.GEN_AI_AGENT_NAME] = scope.name
            name = attrs.get(semconv.GEN_AI_REQUEST_MODEL)
            span = start_with(collector.tracer(), semconv.chat_span_name(name), attrs, SpanKind.CLIENT)
            if self.framework.openai_models and isinstance(model, self.framework.openai_models) \
                    and not traces_requests() \
                    and "extra_headers" not in (getattr(model, "unsupported_settings", None) or ()):
                settings = _with_traceparent(settings, span)
                if len(args) > 1:
                    args = (args[0], settings, *args[2:])
                else:
                    kwargs = {**kwargs, "model_settings": settings}
            return _Call(span, context_with(span), args, kwargs, name, memo, list(messages or ()), params)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("pydantic_ai.model_request", exc)
            if span is not None:
                span.end()
            return None


class _StreamCall:
    """``model.request_stream(...)``: the model's own async context manager, with the chat span around it."""

    __slots__ = ("plugin", "model", "original", "args", "kwargs", "call", "inner", "stream")

    def __init__(self, plugin: _Plugin, model: Any, original: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.plugin = plugin
        self.model = model
        self.original = original
        self.args = args
        self.kwargs = kwargs
        self.call: _Call | None = None
        self.inner: Any = None
        self.stream: Any = None

    async def __aenter__(self) -> Any:
        call = self.call = self.plugin.start_call(self.model, self.args, self.kwargs, True)
        if call is None:
            self.inner = self.original(self.model, *self.args, **self.kwargs)
            return await self.inner.__aenter__()
        tokens = call.enter()
        try:
            self.inner = self.original(self.model, *call.args, **call.kwargs)
            self.stream = await self.inner.__aenter__()
        except BaseException as exc:
            call.leave(tokens)
            call.fail(exc)
            raise
        call.leave(tokens)
        return self.stream

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool | None:
        call = self.call
        if call is None:
            return await self.inner.__aexit__(exc_type, exc, tb)  # type: ignore[no-any-return]
        tokens = call.enter()
        try:
            suppressed = await self.inner.__aexit__(exc_type, exc, tb)
        except BaseException as err:
            call.leave(tokens)
            call.fail(err)
            raise
        call.leave(tokens)
        if exc is not None and not suppressed:
            call.fail(exc)
        else:
            call.end_stream(self.stream)
        return suppressed  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- agent runs and graph nodes


class _Scope:
    """An agent run (or a graph node) as an ``invoke_agent`` span, current (with itself as ``_scope``) while it runs.

    It carries what the model and tool calls in it read: the agent's (or node's) name, the ``Agent`` (an agent
    subclass calling ``super().iter`` makes one span; None for a node) and the JSON of the messages the run has
    encoded (:class:`attributes.RunMemo`), which goes with the scope when the run ends.
    """

    __slots__ = ("span", "name", "agent", "memo", "tokens")

    def __init__(self) -> None:
        self.span: trace.Span | None = None
        self.name: str | None = None
        self.agent: Any = None
        self.memo: attributes.RunMemo | None = None
        self.tokens: tuple[Any, Token[_Scope | None]] | None = None

    def open(self, name: str, attrs: dict[str, Any], agent: Any) -> None:
        try:
            span = start_with(collector.tracer(), semconv.agent_span_name(name), attrs)
            self.span, self.name, self.agent, self.memo = span, name, agent, attributes.RunMemo()
            self.tokens = (_attach(context_with(span), "pydantic_ai.agent_start"), _scope.set(self))
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("pydantic_ai.agent_start", exc)

    def close(self, exc: BaseException | None) -> None:
        tokens, span = self.tokens, self.span
        self.tokens = self.span = self.memo = None
        if tokens is not None:
            _reset(_scope, tokens[1], None)
            _detach(tokens[0], "pydantic_ai.agent_detach")
        if span is not None:
            if exc is not None:
                _fail(span, exc, "pydantic_ai.agent_end")
            else:
                span.end()


class _AgentRun:
    """``agent.iter(...)``: the agent's own async context manager, with the agent's span around the run."""

    __slots__ = ("agent", "inner", "scope")

    def __init__(self, agent: Any, inner: Any) -> None:
        self.agent = agent
        self.inner = inner
        self.scope = _Scope()

    async def __aenter__(self) -> Any:
        outer = _scope.get()
        if outer is None or outer.agent is not self.agent:  # an Agent subclass calling super().iter(): one span
            try:
                name = attributes.agent_name(self.agent)
                self.scope.open(name, attributes.agent_attributes(name), self.agent)
            except Exception as exc:  # noqa: BLE001 - fail-open
                report("pydantic_ai.agent_start", exc)
        try:
            return await self.inner.__aenter__()
        except BaseException as exc:
            self.scope.close(exc)
            raise

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool | None:
        try:
            suppressed = await self.inner.__aexit__(exc_type, exc, tb)
        except BaseException as err:
            self.scope.close(err)
            raise
        self.scope.close(exc if exc is not None and not suppressed else None)
        return suppressed  # type: ignore[no-any-return]


_framework_types: dict[Any, bool] = {}  # node class -> whether it is one of Pydantic AI's own (a few, long-lived)


def _framework_node(step: Any) -> bool:
    """A node of Pydantic AI's own agent graph (the agent's span covers it)."""
    node_type = getattr(step, "node_type", None)
    known = _framework_types.get(node_type)
    if known is None:
        known = (getattr(node_type, "__module__", "") or "").startswith("pydantic_ai.")
        if len(_framework_types) < 1024:
            _framework_types[node_type] = known
    return known


def _node_call(fn: Callable[..., Any], node_id: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def call(ctx: Any) -> Any:
        scope = _Scope()
        try:
            scope.open(node_id, attributes.node_attributes(node_id), None)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("pydantic_ai.graph_node", exc)
        try:
            result = await fn(ctx)
        except BaseException as exc:
            scope.close(exc)
            raise
        scope.close(None)
        return result

    return call


# --------------------------------------------------------------------------- tools


class _ToolRun:
    """One tool call in flight: its span and the context that makes it current."""

    __slots__ = ("span", "token")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.token = _attach(context_with(span), "pydantic_ai.tool_start")

    def ok(self, result: Any) -> None:
        _detach(self.token, "pydantic_ai.tool_detach")
        try:
            set_on(self.span, attributes.tool_ok_attributes(result))
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("pydantic_ai.tool_result", exc)
        self.span.end()

    def fail(self, exc: BaseException, framework: _Framework) -> None:
        _detach(self.token, "pydantic_ai.tool_detach")
        end_failed(self.span, exc, framework)


def end_failed(span: trace.Span, exc: BaseException, framework: _Framework) -> None:
    """End a tool span with the outcome ``exc`` stands for (see :func:`attributes.tool_failure`)."""
    try:
        status, error_type, told = attributes.tool_failure(exc, framework.retry_types, framework.deferral_types)
        if status is None:  # deferred, not failed
            set_on(span, {semconv.AGL_TOOL_STATUS: semconv.TOOL_OK, attributes.TOOL_DEFERRED: True})
            span.end()
            return
        attrs: dict[str, Any] = {semconv.AGL_TOOL_STATUS: status}
        if told is not None:
            attrs[semconv.GEN_AI_TOOL_CALL_RESULT] = told
        set_on(span, attrs)
        _fail(span, exc, "pydantic_ai.tool_error", error_type)
    except Exception as fault:  # noqa: BLE001 - fail-open
        report("pydantic_ai.tool_error", fault)
        span.end()


def _start_tool(call: Any, kind: str) -> _ToolRun | None:
    try:
        scope = _scope.get()
        attrs = attributes.tool_start_attributes(call, kind, scope.name if scope is not None else None)
        span = start_with(collector.tracer(), semconv.tool_span_name(attrs.get(semconv.GEN_AI_TOOL_NAME)), attrs)
        return _ToolRun(span)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("pydantic_ai.tool_start", exc)
        return None


# --------------------------------------------------------------------------- the plugin


class PydanticAIInstrumentor(Instrumentor):
    """Spans for Pydantic AI: model calls of every ``Model``, agent runs, graph nodes, tool calls with outcomes."""

    name: ClassVar[str] = "pydantic_ai"
    framework: ClassVar[str] = "pydantic_ai"
    requirements: ClassVar[tuple[str, ...]] = ("pydantic-ai-slim >= 2.60",)

    _plugin: _Plugin | None = None

    def _attach(self) -> None:
        framework = _Framework()
        plugin = self._plugin = _Plugin(framework)
        self._model_base = framework.model
        for cls in _subclasses(framework.model):
            self._wrap_model_class(cls)
        self.patch(framework.model, "__init_subclass__", self._subclass_hook)
        for cls in (framework.agent, *_subclasses(framework.agent)):
            if isinstance(cls.__dict__.get("iter"), types.FunctionType):
                self.patch(cls, "iter", self._iter_wrapper)
        manager = framework.tool_manager
        self.patch(manager, "execute_tool_call", functools.partial(_execute_tool_wrapper, plugin=plugin))
        self.patch(manager, "execute_output_tool_call", functools.partial(_execute_output_wrapper, plugin=plugin))
        self.patch(manager, "validate_output_tool_call", functools.partial(_validate_output_wrapper, plugin=plugin))
        if framework.step is not None:
            self.patch(framework.step, "call", functools.partial(_step_call_property, plugin=plugin))

    def _detach(self) -> None:
        if self._plugin is not None:
            self._plugin.active = False

    # -- model classes ---------------------------------------------------------------------

    def _wrap_model_class(self, cls: type[Any]) -> None:
        """Wrap the model methods ``cls`` defines itself (inherited ones are wrapped where they are defined)."""
        for attr, make in (("request", self._request_wrapper), ("request_stream", self._request_stream_wrapper)):
            method = cls.__dict__.get(attr)
            if (isinstance(method, types.FunctionType) and not getattr(method, "__isabstractmethod__", False)
                    and not getattr(method, "__agl_wrapped__", False)):
                self.patch(cls, attr, make)

    def _subclass_hook(self, original: Any) -> Any:
        plugin = self
        base = self._model_base
        own = base.__dict__.get("__init_subclass__")  # Model's own hook (it wraps request methods itself)

        def __init_subclass__(cls: type[Any], /, **kwargs: Any) -> None:
            if own is not None:
                own.__get__(None, cls)(**kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)
            if plugin._plugin is not None and plugin._plugin.active:
                try:
                    plugin._wrap_model_class(cls)
                except Exception as exc:  # noqa: BLE001 - fail-open
                    report("pydantic_ai.model_subclass", exc)

        return classmethod(__init_subclass__)

    def _request_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        owner = self

        @functools.wraps(original)
        async def request(model: Any, *args: Any, **kwargs: Any) -> Any:
            plugin = owner._plugin
            call = plugin.start_call(model, args, kwargs, False) if plugin is not None else None
            if call is None:
                return await original(model, *args, **kwargs)
            tokens = call.enter()
            try:
                response = await original(model, *call.args, **call.kwargs)
            except BaseException as exc:
                call.leave(tokens)
                call.fail(exc)
                raise
            call.leave(tokens)
            call.end(response)
            return response

        request.__agl_wrapped__ = True  # type: ignore[attr-defined]
        return request

    def _request_stream_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        owner = self

        @functools.wraps(original)
        def request_stream(model: Any, *args: Any, **kwargs: Any) -> Any:
            plugin = owner._plugin
            if plugin is None or not plugin.active:
                return original(model, *args, **kwargs)
            return _StreamCall(plugin, model, original, args, kwargs)

        request_stream.__agl_wrapped__ = True  # type: ignore[attr-defined]
        return request_stream

    # -- agents ----------------------------------------------------------------------------

    def _iter_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        owner = self

        @functools.wraps(original)
        def iter(agent: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - the framework's name
            inner = original(agent, *args, **kwargs)
            plugin = owner._plugin
            if plugin is None or not plugin.active:
                return inner
            return _AgentRun(agent, inner)

        return iter


def _subclasses(cls: type[Any]) -> list[type[Any]]:
    found: list[type[Any]] = []
    stack = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in found:
            found.append(sub)
            stack.extend(sub.__subclasses__())
    return found


# --------------------------------------------------------------------------- tool-manager and step wrappers


def _execute_tool_wrapper(original: Callable[..., Any], plugin: _Plugin) -> Callable[..., Any]:
    @functools.wraps(original)
    async def execute_tool_call(manager: Any, validated: Any, *args: Any, **kwargs: Any) -> Any:
        run = _start_tool(validated.call, "function") if plugin.active else None
        if run is None:
            return await original(manager, validated, *args, **kwargs)
        try:
            result = await original(manager, validated, *args, **kwargs)
        except BaseException as exc:
            run.fail(exc, plugin.framework)
            raise
        run.ok(result)
        return result

    return execute_tool_call


def _partial(validated: Any) -> bool:
    """A streamed output validated while it is still arriving: not the model's final call."""
    return getattr(getattr(validated, "ctx", None), "partial_output", False) is True


def _execute_output_wrapper(original: Callable[..., Any], plugin: _Plugin) -> Callable[..., Any]:
    @functools.wraps(original)
    async def execute_output_tool_call(manager: Any, validated: Any, *args: Any, **kwargs: Any) -> Any:
        run = _start_tool(validated.call, "output") if plugin.active and not _partial(validated) else None
        if run is None:
            return await original(manager, validated, *args, **kwargs)
        try:
            result = await original(manager, validated, *args, **kwargs)
        except BaseException as exc:
            run.fail(exc, plugin.framework)
            raise
        run.ok(result)
        return result

    return execute_output_tool_call


def _validate_output_wrapper(original: Callable[..., Any], plugin: _Plugin) -> Callable[..., Any]:
    """An output tool call whose arguments fail validation is never executed: its span is made here."""

    @functools.wraps(original)
    async def validate_output_tool_call(manager: Any, call: Any, *args: Any, **kwargs: Any) -> Any:
        if not plugin.active or kwargs.get("allow_partial"):
            return await original(manager, call, *args, **kwargs)
        try:
            validated = await original(manager, call, *args, **kwargs)
        except BaseException as exc:
            _output_rejected(call, exc, plugin)
            raise
        error = getattr(validated, "validation_error", None)
        if getattr(validated, "args_valid", True) is False and isinstance(error, BaseException):
            _output_rejected(call, error, plugin)
        return validated

    return validate_output_tool_call


def _output_rejected(call: Any, exc: BaseException, plugin: _Plugin) -> None:
    run = _start_tool(call, "output")
    if run is not None:
        run.fail(exc, plugin.framework)


def _step_call_property(original: property, plugin: _Plugin) -> property:
    fget = original.fget
    assert fget is not None

    def call(step: Any) -> Any:
        fn = fget(step)
        if not plugin.active or _framework_node(step):
            return fn
        try:
            node_id = str(step.id)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("pydantic_ai.graph_node", exc)
            return fn
        return _node_call(fn, node_id)

    return property(call, doc=original.__doc__)
