"""The ``agent_framework`` plugin: a ``chat {model}`` span per model request and an ``execute_tool`` span per tool call.

Microsoft Agent Framework's API is async-only (there is no sync ``run``); every
path below is awaited or streamed. Hooks, and why each catches every path:

- **Model calls**: ``_inner_get_response`` on every ``BaseChatClient`` class,
  and ``ChatTelemetryLayer.get_response``. ``_inner_get_response`` is the one
  method a chat client must implement (the base class's ``get_response`` calls
  it once per request, after compaction), so hooking it on every subclass that
  defines it catches the OpenAI Chat Completions and Responses clients, Azure,
  Anthropic, Ollama, Foundry and the user's own clients, awaited or streamed;
  subclasses are found through ``__subclasses__`` at ``instrument()`` and
  classes defined later are hooked as they are created, through a hook on
  ``BaseChatClient.__init_subclass__``. Patching ``get_response`` instead would
  miss nothing but trace the whole tool loop of ``FunctionInvocationLayer`` as
  one call. The framework's full clients also run ``ChatTelemetryLayer``, whose
  ``get_response`` wraps each request in the framework's own ``chat`` span when
  its instrumentation is on: agl's span starts there, so it is the outer one and
  the framework's span nests inside it, and the request's messages are recorded
  where ``_inner_get_response`` receives them (what is really sent). One request
  is one span: a client calling another one, or a subclass calling
  ``super()._inner_get_response``, adds none. The span is current while the
  client runs (for a stream: around each chunk's pull, through the stream's own
  pull context managers, inside the framework's one), so the span of agl's
  ``openai`` plugin for the HTTP request nests in it and they become one
  transition that takes the agent from this span and the token ids and the
  ``traceparent`` join from that one. A stream's span ends when the stream is
  exhausted (with the final response the framework builds from its updates),
  fails, is closed early (with what arrived) or is dropped unread.
- **Agent identity**: ``run`` of every ``BaseAgent`` class (``Agent``,
  ``RawAgent``, ``WorkflowAgent``, A2A and the user's own, found and hooked the
  same way) keeps the agent in a ``ContextVar`` while its run goes on, its
  stream's pulls included, and the LLM and tool spans carry its name as
  ``gen_ai.agent.name``. Workflows, handoff and group-chat orchestrations and
  Magentic all run their participants and managers through ``agent.run``, so
  each call is named after the agent that made it, and an agent used as a tool
  names its own calls inside the caller's.
- **Tool calls**: ``agent_framework._tools._auto_invoke_function``, the one
  place where a model's function call is run (with or without function
  middleware, approved or not, in parallel or not); its result is what the
  model is shown. A call whose arguments do not validate or that names no
  known tool is an ``error``; a tool that raised (seen by the hook on
  ``FunctionTool.invoke``, which the framework turns into an error result) is
  ``exception``, or ``timeout`` for ``TimeoutError``. A handoff (the
  orchestrations' ``handoff_to_<agent>`` tools, short-circuited by their
  middleware) is ``ok`` and names both agents. ``FunctionTool.invoke`` called
  anywhere else (the user's code) gets a span of its own.
- **The framework's own spans**: with its instrumentation on, the framework
  makes ``invoke_agent``, ``chat``, ``execute_tool`` and workflow spans on the
  global provider, and the user's exporters keep them. Its ``chat`` span nests
  inside agl's and merges into the same transition; its ``execute_tool`` span
  would make each tool call count twice for AIR, so while agl's tool span is
  current ``get_function_span`` hands back agl's span (with the framework's
  attributes set on it) instead of starting its own: one span per tool call,
  which the user's exporters still see.

Every hook body is fail-open: a fault in agl's own code is reported through
:func:`agl_core.guard.report` and the framework call goes on unchanged.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import weakref
from collections.abc import AsyncGenerator, Callable, Mapping
from contextvars import ContextVar, Token
from typing import Any, ClassVar

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_agent_framework import attributes
from agl_core import collector, semconv
from agl_core.encoding import set_on
from agl_core.guard import report
from agl_core.plugin import Instrumentor
from agl_core.tracer import attach_context, context_with, detach_context, start_with

_MARK = "_agl_agent_framework_original"  # set on every wrapper, holding what it wraps


class _Framework:
    """The framework's classes the hooks need, bound by ``instrument()`` (this module never imports the framework)."""

    ResponseStream: Any = None
    ChatResponse: Any = None
    AgentResponse: Any = None
    MiddlewareTermination: Any = None
    UserInputRequired: Any = None  # a tool asking for the user's input: a pause, not a failure
    BadArguments: Any = ()  # the framework's argument-validation error: the model's call was bad, the tool never ran


def _attach(ctx: Any, site: str) -> Any:
    """Make ``ctx`` current; None (nothing to undo) when that failed, which is reported."""
    try:
        return attach_context(ctx)
    except Exception as exc:  # noqa: BLE001 - fail-open: the call goes on, its span just is not current
        report(site, exc)
        return None


def _leave(ctx_token: object, var: ContextVar[Any], var_token: Token[Any]) -> None:
    """Undo what entering a call made current; never raises (a stream may be closed from another context)."""
    try:
        var.reset(var_token)
    except ValueError:
        var.set(None)
    if ctx_token is None:  # never attached
        return
    try:
        detach_context(ctx_token)
    except Exception as exc:  # noqa: BLE001
        report("agent_framework.detach", exc)


def _end_with_error(span: trace.Span, exc: BaseException, site: str) -> None:
    try:
        span.set_attribute(semconv.ERROR_TYPE, type(exc).__qualname__)
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.end()
    except Exception as fault:  # noqa: BLE001
        report(site, fault)


# --------------------------------------------------------------------------- agent identity


class _AgentScope:
    """An agent's run: its name is current while the run's own code runs (a context manager, entered per pull)."""

    __slots__ = ("agent", "name", "_token")

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.name = _name_of(agent)

    def __enter__(self) -> _AgentScope:
        self._token = _agent.set(self)
        return self

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            _agent.reset(self._token)
        except ValueError:  # entered in another context (a stream pulled from a copied one)
            _agent.set(None)


_agent: ContextVar[_AgentScope | None] = ContextVar("agl_agent_framework_agent", default=None)
"""The agent whose run is going on now."""


def _agent_name() -> str | None:
    scope = _agent.get()
    return scope.name if scope is not None else None


def _name_of(agent: Any) -> str | None:
    try:
        name = agent.name
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("agent_framework.agent_name", exc)
        return None
    return name if isinstance(name, str) and name else None


async def _named_await(scope: _AgentScope, awaitable: Any) -> Any:
    with scope:
        result = await awaitable
    if type(result) is _Framework.AgentResponse:  # the usual answer, told apart before the ABC checks
        return result
    return _follow_run(scope, result)


async def _named_stream(scope: _AgentScope, stream: Any) -> AsyncGenerator[Any, None]:
    """A plain async generator's items (a custom agent's stream), with the agent current while each is produced."""
    try:
        while True:
            with scope:
                try:
                    item = await stream.__anext__()
                except StopAsyncIteration:
                    return
            yield item
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            with scope:
                await close()


class _Nested:
    """The stream's one pull context factory: the framework's own context manager (outer), agl's inside it.

    What ``ResponseStream`` does with several factories (an ``ExitStack`` around each pull), without the
    stack's machinery, and without a new object per pull: this is its own factory and context manager,
    and agl's context manager (the model call or the agent's scope, entered on every pull of the stream)
    is the same object each time. The pulls of one stream never overlap (an async iterator is pulled one
    step at a time), so one of these serves them all.
    """

    __slots__ = ("outer_factory", "inner", "outer")

    def __init__(self, outer_factory: Callable[[], Any], inner: Any) -> None:
        self.outer_factory = outer_factory
        self.inner = inner
        self.outer: Any = None

    def __call__(self) -> _Nested:
        self.outer = self.outer_factory()
        return self

    def __enter__(self) -> Any:
        outer = self.outer
        value = outer.__enter__()
        try:
            self.inner.__enter__()
        except BaseException:
            outer.__exit__(*sys.exc_info())
            raise
        return value

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        suppressed = False
        if self.inner.__exit__(et, exc, tb):
            et = exc = tb = None
            suppressed = True
        return bool(self.outer.__exit__(et, exc, tb)) or suppressed


def _pull_around(stream: Any, inner: Any) -> Any:
    """``stream.with_pull_context_manager(lambda: inner)``; merged into the stream's one factory where it has one.

    The framework's streams already carry a pull context manager of their own (its telemetry layers add
    one, tracing on or off); a second one sends every pull of the stream through an ``ExitStack``, which
    costs more than the rest of agl's work on the pull. Entering both through one :class:`_Nested` keeps
    the order (the framework's first, agl's inside it) and the stream on its one-factory path.
    """
    factories = getattr(stream, "_pull_context_manager_factories", None)
    if type(factories) is list and len(factories) == 1:
        factories[0] = _Nested(factories[0], inner)
        return stream
    return stream.with_pull_context_manager(lambda: inner)


def _follow_run(scope: _AgentScope, result: Any) -> Any:
    """``result`` of an agent's ``run``, made to keep the agent current while the caller awaits or pulls it."""
    try:
        if type(result) is types.CoroutineType:  # an awaited run (the ABC checks below cost more than this one)
            return _named_await(scope, result)
        if isinstance(result, _Framework.ResponseStream):
            return _pull_around(result, scope)
        if inspect.isawaitable(result):
            return _named_await(scope, result)
        if inspect.isasyncgen(result):
            return _named_stream(scope, result)
    except Exception as exc:  # noqa: BLE001 - fail-open: the run goes on without a name
        report("agent_framework.agent_run", exc)
    return result


# --------------------------------------------------------------------------- model calls


class _LlmCall:
    """One traced model request: its span, current (with the call) while entered; a stream's pull context."""

    __slots__ = ("span", "ctx", "client", "request", "recorded", "stream", "ended", "awaits_result", "exhausted",
                 "_ctx_token", "_call_token", "__weakref__")

    def __init__(self, span: trace.Span, client: Any, request: tuple[Any, Any] | None) -> None:
        self.span = span
        self.ctx = context_with(span)
        self.client = client
        self.request = request  # (messages, options) not recorded yet: _inner_get_response records what it sends
        self.recorded: dict[str, Any] | None = None  # the request's attributes, set on the span with the response's
        self.stream: Any = None  # a weak reference to the stream this call's result is
        self.ended = False
        self.awaits_result = False  # the stream hands its final response to on_result
        self.exhausted: Any = None  # the stream's updates, once it reached its end (for on_result or abandon)

    # Entered around the call and around every pull of its stream: _attach and _leave, inlined.
    def __enter__(self) -> _LlmCall:
        try:
            self._ctx_token = attach_context(self.ctx)
        except Exception as exc:  # noqa: BLE001 - fail-open: the call goes on, its span just is not current
            report("agent_framework.attach", exc)
            self._ctx_token = None
        self._call_token = _call.set(self)
        return self

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            _call.reset(self._call_token)
        except ValueError:  # entered in another context (a stream closed from another one)
            _call.set(None)
        if self._ctx_token is not None:
            try:
                detach_context(self._ctx_token)
            except Exception as fault:  # noqa: BLE001
                report("agent_framework.detach", fault)
        if exc is None or self.ended:
            return
        if et is StopAsyncIteration:
            if self.awaits_result:  # the framework builds the response from the updates next: on_result
                self.exhausted = self._updates()
            else:
                self.finish(self._updates_so_far())
        elif et is not GeneratorExit:
            self.fail(exc)

    def record_request(self, messages: Any, options: Any) -> None:
        """Take the request's attributes from what is sent now; they reach the span when it ends, in one step."""
        self.request = None
        try:
            self.recorded = attributes.request_messages_attributes(messages, options)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("agent_framework.request", exc)

    def _updates(self) -> Any:
        stream = self.stream() if self.stream is not None else None
        return None if stream is None else stream.updates

    def _updates_so_far(self, updates: Any = None) -> Any:
        if updates is None:
            updates = self._updates()
            if updates is None:
                return None
        try:
            return _Framework.ChatResponse.from_updates(updates)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("agent_framework.stream_response", exc)
            return None

    def on_result(self, response: Any) -> None:
        """The stream's final response, as the framework built it from the updates once they were all in."""
        if not self.ended:
            self.finish(response if isinstance(response, _Framework.ChatResponse)
                        else self._updates_so_far(self.exhausted))

    def finish(self, response: Any) -> None:
        if self.ended:
            return
        self.ended = True
        span = self.span
        if self.request is not None:
            self.record_request(*self.request)
        attrs = self.recorded or {}
        try:
            if response is not None:
                attrs.update(attributes.response_attributes(response))
        except Exception as exc:  # noqa: BLE001 - fail-open: the request's attributes still go on
            report("agent_framework.response", exc)
        try:
            if attrs:
                set_on(span, attrs)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("agent_framework.response", exc)
        try:
            span.end()
        except Exception as exc:  # noqa: BLE001
            report("agent_framework.response", exc)

    def fail(self, exc: BaseException) -> None:
        if self.ended:
            return
        self.ended = True
        if self.request is not None:
            self.record_request(*self.request)
        try:
            if self.recorded:
                set_on(self.span, self.recorded)
        except Exception as fault:  # noqa: BLE001 - fail-open
            report("agent_framework.request", fault)
        _end_with_error(self.span, exc, "agent_framework.error")

    def on_cleanup(self) -> None:
        """The stream was consumed or closed: a stream closed before its end keeps what arrived.

        A stream consumed to its end goes on to build its final response, which ``on_result`` records.
        """
        if not self.ended and self.exhausted is None:
            self.finish(self._updates_so_far())

    def abandon(self) -> None:
        """The stream was dropped without being consumed to its end or closed (or without its final response)."""
        if not self.ended:
            self.finish(self._updates_so_far(self.exhausted) if self.exhausted is not None else None)


_call: ContextVar[_LlmCall | None] = ContextVar("agl_agent_framework_call", default=None)
"""The model request being traced now: a request made inside it is part of it."""


def _start_llm(client: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> _LlmCall | None:
    """Open the span of ``client.get_response(...)`` / ``client._inner_get_response(...)`` (not yet current)."""
    span = None
    try:
        messages = kwargs["messages"] if "messages" in kwargs else (args[0] if args else None)
        options = kwargs.get("options")
        client_kwargs = kwargs.get("client_kwargs")
        attrs = attributes.request_attributes(client, options, client_kwargs, bool(kwargs.get("stream")),
                                              _agent_name())
        span = start_with(collector.tracer(), semconv.chat_span_name(attrs.get(semconv.GEN_AI_REQUEST_MODEL)),
                          attrs, SpanKind.CLIENT)
        return _LlmCall(span, client, (messages, options))
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("agent_framework.request", exc)
        if span is not None:
            span.end()
        return None


def _follow_call(call: _LlmCall, result: Any) -> Any:
    """``result`` of a traced request, made to end the span when the response (or the stream's end) arrives."""
    try:
        if type(result) is types.CoroutineType:  # an awaited request (before the ABC checks below)
            return _traced_await(call, result)
        if isinstance(result, _Framework.ResponseStream):
            call.stream = weakref.ref(result)
            weakref.finalize(result, call.abandon)
            stream = _pull_around(result, call).with_cleanup_hook(call.on_cleanup)
            try:  # the response the framework builds once at the end, rather than agl building it again
                stream = stream.with_result_hook(call.on_result)
                call.awaits_result = True
            except Exception:  # noqa: BLE001 - no result hook on this stream: the updates, at their end
                pass
            return stream
        if inspect.isawaitable(result):
            return _traced_await(call, result)
        call.finish(result if isinstance(result, _Framework.ChatResponse) else None)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("agent_framework.response", exc)
        call.finish(None)
    return result


async def _traced_await(call: _LlmCall, awaitable: Any) -> Any:
    with call:
        result = await awaitable
    if type(result) is _Framework.ChatResponse:  # the usual answer, told apart before the ABC checks
        call.finish(result)
        return result
    if isinstance(result, _Framework.ResponseStream):  # an async client method that resolves to a stream
        return _follow_call(call, result)
    call.finish(result if isinstance(result, _Framework.ChatResponse) else None)
    return result


# --------------------------------------------------------------------------- tool calls


class _ToolRun:
    """One traced tool call: its span, and what the tool did (filled in by the hooks below it)."""

    __slots__ = ("span", "ctx", "raised", "claimed", "shadowed", "name")

    def __init__(self, span: trace.Span, name: str) -> None:
        self.span = span
        self.ctx = context_with(span)
        self.name = name
        self.raised: BaseException | None = None  # the tool raised this (the framework made it an error result)
        self.claimed = False  # a FunctionTool.invoke below already reports to this span
        self.shadowed = False  # the framework's own tool span was replaced by this one

    def finish(self, result: Any, is_error: bool, handoff: str | None = None) -> None:
        span = self.span
        try:
            raised = self.raised
            if raised is not None:
                status = semconv.TOOL_TIMEOUT if isinstance(raised, TimeoutError) else semconv.TOOL_EXCEPTION
                error_type: str | None = type(raised).__qualname__
            elif is_error:
                status, error_type = semconv.TOOL_ERROR, "tool_error"
            else:
                status, error_type = semconv.TOOL_OK, None
            attrs = attributes.tool_end_attributes(result, status, error_type)
            if handoff is not None:
                attrs[semconv.AGL_HANDOFF_TO_AGENT] = handoff
                from_agent = _agent_name()
                if from_agent:
                    attrs[semconv.AGL_HANDOFF_FROM_AGENT] = from_agent
            set_on(span, attrs)
            if error_type is not None:
                if raised is not None:
                    span.record_exception(raised)
                span.set_status(Status(StatusCode.ERROR, str(result if result is not None else error_type)))
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("agent_framework.tool_result", exc)
        try:
            span.end()
        except Exception as exc:  # noqa: BLE001
            report("agent_framework.tool_result", exc)

    def fail(self, exc: BaseException) -> None:
        try:
            status = semconv.TOOL_TIMEOUT if isinstance(exc, TimeoutError) else semconv.TOOL_EXCEPTION
            self.span.set_attribute(semconv.AGL_TOOL_STATUS, status)
        except Exception as fault:  # noqa: BLE001
            report("agent_framework.tool_error", fault)
        _end_with_error(self.span, exc, "agent_framework.tool_error")


_tool_run: ContextVar[_ToolRun | None] = ContextVar("agl_agent_framework_tool_run", default=None)
"""The tool call being traced now (inherited by the tasks that run its tool)."""


def _start_tool(name: Any, call_id: Any, arguments: Any) -> _ToolRun | None:
    span = None
    try:
        tool = str(name)
        attrs = attributes.tool_start_attributes(tool, call_id if isinstance(call_id, str) else None, arguments,
                                                 _agent_name())
        span = start_with(collector.tracer(), semconv.tool_span_name(tool), attrs)
        return _ToolRun(span, tool)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("agent_framework.tool_request", exc)
        if span is not None:
            span.end()
        return None


def _start_tool_for_call(content: Any) -> _ToolRun | None:
    """The span of ``_auto_invoke_function(function_call_content, ...)``: a function call, or an approved one."""
    try:
        call = content
        if getattr(call, "type", None) == "function_approval_response" and call.function_call is not None:
            call = call.function_call
        return _start_tool(call.name, call.call_id, call.arguments)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("agent_framework.tool_request", exc)
        return None


def _finish_with_result(run: _ToolRun, result: Any) -> None:
    """End ``run`` with the ``Content`` the framework hands back to the model for it."""
    try:
        kind = getattr(result, "type", None)
        if kind == "function_result":
            text = result.result
            run.finish(text, result.exception is not None, attributes.handoff_target(run.name, text)
                       if result.exception is None else None)
        else:  # an approval request, a user-input pause: the tool did not run, nothing failed
            run.finish(None, False)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("agent_framework.tool_result", exc)
        run.finish(None, False)


class _Shadow:
    """Stands in for the framework's ``get_function_span`` while agl's span of the same call is current."""

    __slots__ = ("run", "attrs")

    def __init__(self, run: _ToolRun, attrs: Any) -> None:
        self.run = run
        self.attrs = attrs

    def __enter__(self) -> trace.Span:
        try:
            if isinstance(self.attrs, Mapping):
                own = self.run.span.attributes if hasattr(self.run.span, "attributes") else {}
                set_on(self.run.span, {k: v for k, v in self.attrs.items() if k not in (own or {})})
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("agent_framework.tool_span", exc)
        return self.run.span

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, Exception) and self.run.raised is None:
            self.run.raised = exc


# --------------------------------------------------------------------------- the plugin


class AgentFrameworkInstrumentor(Instrumentor):
    """Spans for Microsoft Agent Framework: model requests (awaited and streamed), tool calls, agent identity."""

    name: ClassVar[str] = "agent_framework"
    framework: ClassVar[str] = "agent_framework"
    requirements: ClassVar[tuple[str, ...]] = ("agent-framework-core >= 1.23, < 2",)

    wrapper_mark: ClassVar[str] = _MARK

    def _attach(self) -> None:
        import agent_framework
        import agent_framework._tools as tools_module
        from agent_framework import BaseAgent, BaseChatClient, ChatResponse, FunctionTool, ResponseStream
        from agent_framework._middleware import MiddlewareTermination
        from agent_framework.exceptions import UserInputRequiredException
        from agent_framework.observability import ChatTelemetryLayer

        _Framework.ResponseStream = ResponseStream
        _Framework.ChatResponse = ChatResponse
        _Framework.AgentResponse = getattr(agent_framework, "AgentResponse", None)  # only a fast path: may be absent
        _Framework.MiddlewareTermination = MiddlewareTermination
        _Framework.UserInputRequired = UserInputRequiredException
        _Framework.BadArguments = getattr(tools_module, "_FunctionArgumentValidationError", ())
        self._active = True
        self.hook_family(BaseChatClient, {"_inner_get_response": self._wrap_model_call})
        self.patch(ChatTelemetryLayer, "get_response", self._wrap_model_call)
        self.hook_family(BaseAgent, {"run": self._wrap_run})
        self.patch(tools_module, "_auto_invoke_function", self._wrap_auto_invoke)
        self.patch(FunctionTool, "invoke", self._wrap_invoke)
        for module in ("agent_framework._tools", "agent_framework.observability"):
            owner = sys.modules.get(module)
            if owner is not None and hasattr(owner, "get_function_span"):
                self.patch(owner, "get_function_span", self._wrap_get_function_span)

    def _detach(self) -> None:
        self._active = False  # wrappers that someone still holds now pass straight through

    # -- model clients -----------------------------------------------------------------------

    def _wrap_model_call(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``ChatTelemetryLayer.get_response`` and each ``_inner_get_response``: one span per model request."""
        plugin = self
        inner = original.__name__ == "_inner_get_response"

        @functools.wraps(original)
        def model_call(client: Any, *args: Any, **kwargs: Any) -> Any:
            if not plugin._active:
                return original(client, *args, **kwargs)
            current = _call.get()
            if current is not None:  # part of a request traced above: record what is really sent
                if inner and current.request is not None and current.client is client:
                    current.record_request(kwargs.get("messages"), kwargs.get("options"))
                return original(client, *args, **kwargs)
            call = _start_llm(client, args, kwargs)
            if call is None:
                return original(client, *args, **kwargs)
            with call:
                result = original(client, *args, **kwargs)
            return _follow_call(call, result)

        setattr(model_call, _MARK, original)
        return model_call

    # -- agent identity ----------------------------------------------------------------------

    def _wrap_run(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def run(agent: Any, *args: Any, **kwargs: Any) -> Any:
            if not plugin._active:
                return original(agent, *args, **kwargs)
            current = _agent.get()
            if current is not None and current.agent is agent:  # a layer of this agent's own run
                return original(agent, *args, **kwargs)
            scope = _AgentScope(agent)
            with scope:
                result = original(agent, *args, **kwargs)
            return _follow_run(scope, result)

        setattr(run, _MARK, original)
        return run

    # -- tools ---------------------------------------------------------------------------------

    def _wrap_auto_invoke(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def _auto_invoke_function(function_call_content: Any, *args: Any, **kwargs: Any) -> Any:
            run = _start_tool_for_call(function_call_content) if plugin._active else None
            if run is None:
                return await original(function_call_content, *args, **kwargs)
            ctx_token, run_token = _attach(run.ctx, "agent_framework.attach"), _tool_run.set(run)
            try:
                result = await original(function_call_content, *args, **kwargs)
            except BaseException as exc:
                _leave(ctx_token, _tool_run, run_token)
                if isinstance(exc, _Framework.MiddlewareTermination):  # a handoff, or middleware ending the loop
                    _finish_with_result(run, exc.result)
                elif isinstance(exc, _Framework.UserInputRequired):
                    run.finish(None, False)
                else:
                    run.fail(exc)
                raise
            _leave(ctx_token, _tool_run, run_token)
            _finish_with_result(run, result)
            return result

        setattr(_auto_invoke_function, _MARK, original)
        return _auto_invoke_function

    def _wrap_invoke(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def invoke(tool: Any, *args: Any, **kwargs: Any) -> Any:
            if not plugin._active:
                return await original(tool, *args, **kwargs)
            outer = _tool_run.get()
            if outer is not None and not outer.claimed:  # _auto_invoke_function's span reports this run
                outer.claimed = True
                try:
                    return await original(tool, *args, **kwargs)
                except Exception as exc:
                    if not isinstance(exc, _Framework.BadArguments):
                        outer.raised = outer.raised or exc
                    raise
            run = _start_tool_for_invoke(tool, kwargs)
            if run is None:
                return await original(tool, *args, **kwargs)
            run.claimed = True
            ctx_token, run_token = _attach(run.ctx, "agent_framework.attach"), _tool_run.set(run)
            try:
                value = await original(tool, *args, **kwargs)
            except BaseException as exc:
                _leave(ctx_token, _tool_run, run_token)
                run.fail(exc)
                raise
            _leave(ctx_token, _tool_run, run_token)
            run.finish(_invoke_result_text(value), False)
            return value

        setattr(invoke, _MARK, original)
        return invoke

    def _wrap_get_function_span(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def get_function_span(*args: Any, **kwargs: Any) -> Any:
            run = _tool_run.get()
            if run is None or run.shadowed or not plugin._active:
                return original(*args, **kwargs)
            run.shadowed = True
            return _Shadow(run, kwargs["attributes"] if "attributes" in kwargs else (args[0] if args else None))

        setattr(get_function_span, _MARK, original)
        return get_function_span


def _start_tool_for_invoke(tool: Any, kwargs: Mapping[str, Any]) -> _ToolRun | None:
    """The span of ``tool.invoke(arguments=..., tool_call_id=...)`` run outside a model's function call."""
    try:
        arguments = kwargs.get("arguments")
        if arguments is None:
            arguments = {k: v for k, v in kwargs.items() if k not in ("context", "tool_call_id", "skip_parsing")}
        elif hasattr(arguments, "model_dump"):
            arguments = arguments.model_dump()
        return _start_tool(tool.name, kwargs.get("tool_call_id"),
                           dict(arguments) if isinstance(arguments, Mapping) else arguments)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("agent_framework.tool_request", exc)
        return None


def _invoke_result_text(value: Any) -> Any:
    """``FunctionTool.invoke``'s value (a list of ``Content``, or the raw value) as the text the model would see."""
    try:
        if isinstance(value, list) and all(hasattr(c, "type") for c in value):
            return "".join(c.text or "" for c in value if c.type == "text")
        return value
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("agent_framework.tool_result", exc)
        return None
