"""The ``crewai`` plugin: a ``chat {model}`` span per LLM call, an ``execute_tool`` span per tool use, and the
crew, task, agent and flow spans that enclose them.

Hooks, and why each catches every path:

- **LLM calls**: ``call`` and ``acall`` on every concrete ``BaseLLM`` class.
  Whatever ``crewai.LLM(...)`` returns (the native OpenAI provider, the other
  native providers, the LiteLLM fallback ``LLM``) and a user's own ``BaseLLM``
  subclass all answer through these two methods, and so does every caller: the
  agent executors, ``Agent.kickoff``, guardrails, converters, planning, a flow
  step calling ``llm.call`` itself, ``stream_events``. Every subclass that
  defines one is patched, found through ``__subclasses__`` recursively at
  ``instrument()``; classes defined or imported later (a provider module crewai
  loads on first use, a user's class) are patched as they are created, through
  a hook on ``BaseLLM.__init_subclass__``, which crewai itself uses to put its
  retry wrapper on the same two methods. Streaming needs nothing more: crewai's
  providers consume the stream inside ``call`` and return the whole reply. The
  span is current while the provider runs, so the span of agl's ``openai``
  plugin for the HTTP request (the native OpenAI provider and its
  OpenAI-compatible kin) nests in it and the two become one transition: the
  agent from this span, the token ids and the ``traceparent`` join from that one. A ``call`` reached
  again for the same LLM inside its own call (``super().call()``, crewai's own
  retry) is not traced twice. crewai's event bus cannot carry LLM spans: its
  handlers run later, on a thread pool or its event-loop thread, so a span made
  there is never current during the call, and a ``BaseLLM`` subclass need not
  emit events at all.
- **What crewai knows about a reply**: ``CrewAIEventsBus.emit``. Every provider
  emits ``LLMCallCompletedEvent`` inside its ``call``, on the calling thread,
  with the reply before crewai's after-call hooks rewrite it, the provider's
  usage, finish reason and response id. The hook reads the event where it is
  emitted, in the call's own context (never in a deferred handler), so it sees
  the call it belongs to. A class that emits nothing still gets its span, from
  ``call``'s arguments and return value.
- **Tool calls**: the same ``emit`` hook, on ``ToolUsageStartedEvent`` and its
  closing ``ToolUsageFinishedEvent`` / ``ToolUsageErrorEvent``. crewai runs
  tools on half a dozen paths (native tool calls, in sequence or on a thread
  pool; ReAct text actions; the planning step executor; a tool an LLM runs
  itself through ``available_functions``; MCP and delegation tools) and each
  emits that pair around the tool, on the thread that runs it; wrapping the
  tools themselves would miss cache hits, usage limits and unknown-tool
  failures, which never reach the tool. The span opens at the start event and
  is current until the closing one, so a coworker an agent delegates to runs
  inside the delegation tool's span. ``ToolFailure`` results (a tool that
  returned a failure without raising, a usage limit, an unknown tool) are
  ``error``, a raising tool is ``exception``. Cache hits come from
  ``CacheHandler.read``. The two functions that run a model's native tool call
  (``AgentExecutor._execute_single_native_tool_call``, the step executor's
  ``execute_single_native_tool_call``) give the span the model's tool-call id,
  and end it when something raises between the two events (an after-tool-call
  hook), where crewai emits no closing event.
- **The gateway's join for LiteLLM**: ``LLM._prepare_completion_params``.
  LiteLLM (1.110) sends OpenAI-route requests with the client's raw ``post``,
  which agl's ``openai`` plugin does not see, so nothing would carry a
  ``traceparent`` to agl's gateway. The hook adds this call's ``traceparent``
  to the request's ``extra_headers`` (unless the caller set one), so the
  gateway's token-id record joins the crewai span itself. Talking to a
  vLLM-style server directly, LiteLLM's reply keeps the server's token ids,
  which :mod:`agl_core.litellm_tokens` puts on the crewai span.
- **Agent identity and enclosing spans**: ``Agent.execute_task`` /
  ``aexecute_task`` (crew tasks, delegated work), ``Agent.kickoff`` /
  ``kickoff_async`` (an agent on its own) make ``invoke_agent {role}`` spans;
  ``Task._execute_core`` / ``_aexecute_core`` task spans (sync, async and
  ``async_execution`` tasks all run through them); ``Crew.kickoff`` /
  ``akickoff`` crew spans (``kickoff_async`` runs ``kickoff`` on a thread,
  streaming runs an inner ``kickoff``); ``Flow.kickoff_async`` flow spans for the
  user's flows (``kickoff`` runs it; crewai's own executor flows are skipped).
  Each LLM span also carries its caller's role (``from_agent``) as
  ``gen_ai.agent.name``.

Context across threads: crewai 1.15 copies the ``contextvars`` context into
every thread it starts (flow steps, ``async_execution`` tasks, parallel tool
calls, ``max_execution_time``, streamed kickoffs, event handlers), and agl's
rollout and the OpenTelemetry context are context variables, so spans land in
the rollout that started the crew with nothing added here. Nothing is taken from the event bus's deferred handlers, so
closing a rollout never waits on ``crewai_event_bus.flush()``. Per-call state
lives only in context variables: nothing outlives the call.

Every hook body is fail-open: a fault in agl's own code is reported through
:func:`agl_core.guard.report` and crewai goes on unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any, ClassVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_core import collector, litellm_tokens, semconv
from agl_core.encoding import set_on
from agl_core.guard import report
from agl_core.plugin import Instrumentor
from agl_core.tracer import context_with, start_with
from agl_crewai import attributes

_MARK = "_agl_crewai_original"  # set on every wrapper, holding what it wraps
_UNSET: Any = object()


class _LLMCall:
    """One traced LLM call: its span and what crewai reported about it while it ran."""

    __slots__ = ("llm", "span", "token", "var_token", "reply", "usage", "finish_reason", "response_id", "asked")

    def __init__(self, llm: Any, span: trace.Span) -> None:
        self.llm = llm
        self.span = span
        self.token: object = None
        self.var_token: Token[_LLMCall | None] | None = None
        self.reply: Any = _UNSET
        self.usage: Any = None
        self.finish_reason: Any = None
        self.response_id: Any = None
        self.asked: list[tuple[str, Any]] | None = None  # tools the LLM ran itself (available_functions)

    def end(self, result: Any, exc: BaseException | None) -> None:
        span = self.span
        try:
            if self.var_token is not None:
                _llm_call.reset(self.var_token)
        except Exception:  # noqa: BLE001 - ended in another context than it started in
            _llm_call.set(None)
        _restore(self.token)
        try:
            if exc is None:
                if self.asked:
                    message = attributes.asked_tools_message(self.asked)
                else:
                    message = attributes.reply_message(result if self.reply is _UNSET else self.reply)
                set_on(span, attributes.llm_response_attributes(message, self.usage, self.finish_reason,
                                                                self.response_id))
            else:
                _record_error(span, exc)
        except Exception as fault:  # noqa: BLE001 - fail-open
            report("crewai.llm_end", fault)
        try:
            span.end()
        except Exception as fault:  # noqa: BLE001
            report("crewai.llm_end", fault)


class _ToolSpan:
    """The span of one tool use, open from its start event to its closing event."""

    __slots__ = ("span", "token", "name", "prev", "cache_hit")

    def __init__(self, span: trace.Span, token: object, name: str, prev: _ToolSpan | None) -> None:
        self.span = span
        self.token = token
        self.name = name
        self.prev = prev
        self.cache_hit = False


_llm_call: ContextVar[_LLMCall | None] = ContextVar("agl_crewai_llm_call", default=None)
"""The traced LLM call running now."""
_tool: ContextVar[_ToolSpan | None] = ContextVar("agl_crewai_tool", default=None)
"""The innermost open tool span."""
_native_call: ContextVar[tuple[str, str] | None] = ContextVar("agl_crewai_native_call", default=None)
"""(tool-call id, tool name) of the model's native tool call being run now, until its start event takes it."""


def _restore(token: object) -> None:
    """Put back the context from before a span made current in this same frame (whatever the call left behind)."""
    try:
        if token is not None:
            otel_context.detach(token)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001
        report("crewai.detach", exc)


def _detach(span: trace.Span, token: object) -> None:
    """Detach the token of a span opened by an earlier event, when that span is still current here.

    The opening and closing events of a tool come from one crewai function, so this holds; if the
    context has moved on (a tool that aborted the run left its span open), there is nothing to restore.
    """
    try:
        if token is not None and trace.get_current_span() is span:
            otel_context.detach(token)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001
        report("crewai.detach", exc)


def _traceparent(span: trace.Span) -> str | None:
    ctx = span.get_span_context()
    if not ctx.is_valid:  # a no-op tracer's span: nothing for a gateway to join to
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{'01' if ctx.trace_flags & 1 else '00'}"


def _with_traceparent(params: Any, span: trace.Span) -> None:
    """Add ``span``'s ``traceparent`` to LiteLLM's ``extra_headers`` in ``params``, unless the caller gave one."""
    if not isinstance(params, dict):
        return
    headers = params.get("extra_headers")
    if headers is not None and (not isinstance(headers, dict)
                                or any(str(k).lower() == "traceparent" for k in headers)):
        return
    value = _traceparent(span)
    if value is not None:
        params["extra_headers"] = {**(headers or {}), "traceparent": value}  # never mutates the caller's dict


def _record_error(span: trace.Span, exc: BaseException) -> None:
    span.set_attribute(semconv.ERROR_TYPE, type(exc).__qualname__)
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _start_llm(llm: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _LLMCall | None:
    """Open and make current the span of ``llm.call(*args, **kwargs)``; None when that failed."""
    span = None
    try:
        attrs = attributes.llm_request_attributes(llm, _arg(args, kwargs, 0, "messages"),
                                                  _arg(args, kwargs, 1, "tools"), _arg(args, kwargs, 5, "from_agent"))
        span = start_with(collector.tracer(), semconv.chat_span_name(attrs.get(semconv.GEN_AI_REQUEST_MODEL)),
                          attrs, SpanKind.CLIENT)
        call = _LLMCall(llm, span)
        call.token = otel_context.attach(context_with(span))
        call.var_token = _llm_call.set(call)
        return call
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("crewai.llm_start", exc)
        if span is not None:
            span.end()
        return None


# --------------------------------------------------------------------------- events, read where they are emitted


def _on_llm_completed(source: Any, event: Any) -> None:
    call = _llm_call.get()
    if call is None or call.llm is not source:
        return
    if not call.asked:
        call.reply = event.response
    if event.usage is not None:
        call.usage = event.usage
    if event.finish_reason is not None:
        call.finish_reason = event.finish_reason
    if event.response_id is not None:
        call.response_id = event.response_id


def _on_tool_started(source: Any, event: Any) -> None:
    name = str(event.tool_name)
    call_id = None
    native = _native_call.get()
    if native is not None and native[1] == name:
        call_id = native[0]
        _native_call.set(None)  # taken: a tool run inside this one (a coworker's) must not reuse it
    llm = _llm_call.get()
    if llm is not None and trace.get_current_span() is llm.span:  # an LLM running the tool it asked for itself
        if llm.asked is None:
            llm.asked = []
        llm.asked.append((name, event.tool_args))
    span = collector.tracer().start_span(semconv.tool_span_name(name),
                                         attributes=attributes.tool_start_attributes(name, call_id, event.tool_args))
    token = otel_context.attach(context_with(span))
    _tool.set(_ToolSpan(span, token, name, _tool.get()))


def _take_tool(event: Any) -> _ToolSpan | None:
    """The open tool span that ``event`` closes, no longer open; None when it is not ours."""
    state = _tool.get()
    if state is None or state.name != str(event.tool_name):
        return None
    _tool.set(state.prev)
    return state


Outcome = tuple[str, Any, "tuple[str, str] | None"]  # (agl.tool.status, result, (error.type, message) or None)


def _end_tool(state: _ToolSpan, outcome: Callable[[], Outcome]) -> None:
    """Detach and end a tool span with ``outcome()``; the span ends even when reading the outcome fails."""
    span = state.span
    _detach(span, state.token)
    try:
        status, result, error = outcome()
        attrs = attributes.tool_end_attributes(status, result, state.cache_hit)
        if error is not None:
            attrs[semconv.ERROR_TYPE] = error[0]
            span.set_status(Status(StatusCode.ERROR, error[1]))
        set_on(span, attrs)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("crewai.tool_end", exc)
    span.end()


def _finished(event: Any) -> Outcome:
    failure = getattr(event, "failure", None)
    if failure is None:
        return semconv.TOOL_OK, event.output, None
    status, error_type, message = attributes.failure_status(failure)
    return status, event.output, (error_type, message)


def _raised(error: Any) -> Outcome:
    if isinstance(error, BaseException):
        message = f"{type(error).__name__}: {error}"
        return semconv.TOOL_EXCEPTION, message, (type(error).__qualname__, message)
    return semconv.TOOL_EXCEPTION, str(error), ("ToolError", str(error))


def _on_tool_finished(source: Any, event: Any) -> None:
    state = _take_tool(event)
    if state is not None:
        if getattr(event, "from_cache", False):
            state.cache_hit = True
        _end_tool(state, lambda: _finished(event))


def _on_tool_error(source: Any, event: Any) -> None:
    state = _take_tool(event)
    if state is not None:
        if isinstance(event.error, BaseException):
            state.span.record_exception(event.error)
        _end_tool(state, lambda: _raised(event.error))


def _end_open_tools(outer: _ToolSpan | None, exc: BaseException) -> None:
    """End, as raised by ``exc``, the tool spans opened since ``outer`` that no closing event will end."""
    try:
        state = _tool.get()
        while state is not None and state is not outer:
            _tool.set(state.prev)
            state.span.record_exception(exc)
            _end_tool(state, lambda: _raised(exc))
            state = state.prev
    except Exception as fault:  # noqa: BLE001 - fail-open: the crew's own exception goes on unchanged
        report("crewai.tool_abort", fault)


# --------------------------------------------------------------------------- enclosing spans

Describe = Callable[[Any, tuple[Any, ...], dict[str, Any]], "tuple[str, attributes.Attributes] | None"]


def _open(describe: Describe, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          site: str) -> tuple[trace.Span, object] | None:
    try:
        described = describe(instance, args, kwargs)
        if described is None:
            return None
        span = collector.tracer().start_span(described[0], attributes=described[1])
        return span, otel_context.attach(context_with(span))
    except Exception as exc:  # noqa: BLE001 - fail-open
        report(site, exc)
        return None


def _close(opened: tuple[trace.Span, object], exc: BaseException | None, site: str) -> None:
    span, token = opened
    _restore(token)
    try:
        if exc is not None:
            _record_error(span, exc)
        span.end()
    except Exception as fault:  # noqa: BLE001
        report(site, fault)


def _describe_crew(crew: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[str, attributes.Attributes] | None:
    if getattr(crew, "stream", False):  # a streamed kickoff runs an unstreamed one inside: that one is traced
        return None
    name = getattr(crew, "name", None) or "crew"
    return f"crewai.crew {name}", attributes.crew_attributes(crew)


def _describe_task(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, attributes.Attributes]:
    name = getattr(task, "name", None)
    return (f"crewai.task {name}" if name else "crewai.task"), attributes.task_attributes(task)


def _describe_agent_task(agent: Any, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> tuple[str, attributes.Attributes]:
    task = _arg(args, kwargs, 0, "task")
    return semconv.agent_span_name(attributes.agent_role(agent)), attributes.agent_attributes(agent, task)


def _describe_agent_kickoff(agent: Any, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> tuple[str, attributes.Attributes] | None:
    if asyncio._get_running_loop() is not None:  # inside a loop, kickoff hands back kickoff_async(): traced there
        return None
    return semconv.agent_span_name(attributes.agent_role(agent)), attributes.agent_attributes(agent, None)


def _describe_agent_kickoff_async(agent: Any, args: tuple[Any, ...],
                                  kwargs: dict[str, Any]) -> tuple[str, attributes.Attributes]:
    return semconv.agent_span_name(attributes.agent_role(agent)), attributes.agent_attributes(agent, None)


def _describe_flow(flow: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[str, attributes.Attributes] | None:
    if type(flow).__module__.startswith("crewai.") or getattr(flow, "stream", False):
        return None  # crewai's own executor flows, and a streamed kickoff (its inner run is traced)
    return f"crewai.flow {attributes.flow_name(flow)}", attributes.flow_attributes(flow)


class CrewAIInstrumentor(Instrumentor):
    """Spans for CrewAI: LLM calls of every provider class, tool uses, and the agents, tasks, crews and flows."""

    name: ClassVar[str] = "crewai"
    framework: ClassVar[str] = "crewai"
    requirements: ClassVar[tuple[str, ...]] = ("crewai >= 1.15, < 2",)

    _active = False

    def _attach(self) -> None:
        from crewai.agent.core import Agent
        from crewai.agents.cache.cache_handler import CacheHandler
        from crewai.crew import Crew
        from crewai.events.event_bus import CrewAIEventsBus
        from crewai.events.types.llm_events import LLMCallCompletedEvent
        from crewai.events.types.tool_usage_events import (
            ToolUsageErrorEvent,
            ToolUsageFinishedEvent,
            ToolUsageStartedEvent,
        )
        from crewai.flow.flow import Flow
        from crewai.llm import LLM
        from crewai.llms.base_llm import BaseLLM
        from crewai.task import Task

        self._events: dict[type[Any], Callable[[Any, Any], None]] = {
            LLMCallCompletedEvent: _on_llm_completed,
            ToolUsageStartedEvent: _on_tool_started,
            ToolUsageFinishedEvent: _on_tool_finished,
            ToolUsageErrorEvent: _on_tool_error,
        }
        self._sanitize = _tool_name_sanitizer()
        self._active = True
        self._attach_llm_classes(BaseLLM)
        self.patch(CrewAIEventsBus, "emit", self._emit_wrapper)
        self.patch(CacheHandler, "read", self._cache_read_wrapper)
        if hasattr(LLM, "_prepare_completion_params"):
            self.patch(LLM, "_prepare_completion_params", self._litellm_params_wrapper)
            litellm_tokens.hold(self)
        self._attach_native_tool_calls()
        enclosing: list[tuple[Any, str, Describe, bool]] = [
            (Crew, "kickoff", _describe_crew, False),
            (Crew, "akickoff", _describe_crew, True),
            (Task, "_execute_core", _describe_task, False),
            (Task, "_aexecute_core", _describe_task, True),
            (Agent, "execute_task", _describe_agent_task, False),
            (Agent, "aexecute_task", _describe_agent_task, True),
            (Agent, "kickoff", _describe_agent_kickoff, False),
            (Agent, "kickoff_async", _describe_agent_kickoff_async, True),
            (Flow, "kickoff_async", _describe_flow, True),
        ]
        for cls, attr, describe, is_async in enclosing:
            owner = next((c for c in cls.__mro__ if attr in c.__dict__), None)  # patched where it is defined
            if owner is not None:
                site = f"crewai.{cls.__name__}.{attr}"
                make = self._async_span_wrapper if is_async else self._span_wrapper
                self.patch(owner, attr, functools.partial(make, describe=describe, site=site))

    def _detach(self) -> None:
        self._active = False  # wrappers that outlive uninstrument() (none should) pass straight through
        litellm_tokens.release(self)

    # -- LLM classes ----------------------------------------------------------------------

    def _attach_llm_classes(self, base: type[Any]) -> None:
        seen: set[type[Any]] = set()
        stack = [base]
        while stack:
            for sub in stack.pop().__subclasses__():
                if sub not in seen:
                    seen.add(sub)
                    self._wrap_llm_class(sub)
                    stack.append(sub)
        hook = base.__dict__.get("__init_subclass__")
        original = hook.__func__ if isinstance(hook, classmethod) else hook
        plugin = self

        def init_subclass(cls: type[Any], /, **kwargs: Any) -> None:
            if original is not None:
                original(cls, **kwargs)
            else:  # a crewai whose BaseLLM defines no hook of its own: what it would inherit
                super(base, cls).__init_subclass__(**kwargs)
            if plugin._active:
                try:
                    plugin._wrap_llm_class(cls)
                except Exception as exc:  # noqa: BLE001 - a class we cannot trace still works
                    report("crewai.llm_subclass", exc)

        self.patch(base, "__init_subclass__", lambda current: classmethod(init_subclass))

    def _wrap_llm_class(self, cls: type[Any]) -> None:
        for name in ("call", "acall"):
            method = cls.__dict__.get(name)
            if method is None or not callable(method) or hasattr(method, _MARK) or _is_abstract(method):
                continue
            make = self._llm_async_wrapper if inspect.iscoroutinefunction(method) else self._llm_sync_wrapper
            self.patch(cls, name, make)

    def _llm_sync_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def call(llm: Any, *args: Any, **kwargs: Any) -> Any:
            if not plugin._active:
                return original(llm, *args, **kwargs)
            current = _llm_call.get()
            state = _start_llm(llm, args, kwargs) if current is None or current.llm is not llm else None
            if state is None:
                return original(llm, *args, **kwargs)
            try:
                result = original(llm, *args, **kwargs)
            except BaseException as exc:
                state.end(None, exc)
                raise
            state.end(result, None)
            return result

        setattr(call, _MARK, original)
        return call

    def _llm_async_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def acall(llm: Any, *args: Any, **kwargs: Any) -> Any:
            if not plugin._active:
                return await original(llm, *args, **kwargs)
            current = _llm_call.get()
            state = _start_llm(llm, args, kwargs) if current is None or current.llm is not llm else None
            if state is None:
                return await original(llm, *args, **kwargs)
            try:
                result = await original(llm, *args, **kwargs)
            except BaseException as exc:
                state.end(None, exc)
                raise
            state.end(result, None)
            return result

        setattr(acall, _MARK, original)
        return acall

    # -- events, cache, tool-call ids --------------------------------------------------------

    def _emit_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self
        handlers = self._events

        @functools.wraps(original)
        def emit(bus: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(bus, *args, **kwargs)
            if plugin._active:
                event = kwargs["event"] if "event" in kwargs else (args[1] if len(args) > 1 else None)
                handler = handlers.get(type(event))
                if handler is not None:
                    try:
                        handler(kwargs["source"] if "source" in kwargs else args[0], event)
                    except Exception as exc:  # noqa: BLE001 - fail-open
                        report(f"crewai.event.{type(event).__name__}", exc)
            return result

        setattr(emit, _MARK, original)
        return emit

    def _cache_read_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def read(handler: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(handler, *args, **kwargs)
            if result is not None and plugin._active:
                state = _tool.get()
                if state is not None:
                    state.cache_hit = True
            return result

        setattr(read, _MARK, original)
        return read

    def _litellm_params_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def prepare(llm: Any, *args: Any, **kwargs: Any) -> Any:
            params = original(llm, *args, **kwargs)
            call = _llm_call.get() if plugin._active else None
            if call is not None and call.llm is llm:
                try:
                    _with_traceparent(params, call.span)
                except Exception as exc:  # noqa: BLE001 - fail-open
                    report("crewai.litellm_traceparent", exc)
                litellm_tokens.ensure()  # LiteLLM is loaded by now: its reply's token ids go on call.span
            return params

        setattr(prepare, _MARK, original)
        return prepare

    def _attach_native_tool_calls(self) -> None:
        try:
            from crewai.agents import agent_executor
        except ImportError:
            agent_executor = None  # type: ignore[assignment]
        executor = getattr(agent_executor, "AgentExecutor", None)
        if executor is not None and hasattr(executor, "_execute_single_native_tool_call"):
            self.patch(executor, "_execute_single_native_tool_call",
                       functools.partial(self._native_call_wrapper, index=1))
        try:
            from crewai.agents import step_executor
        except ImportError:
            return
        if hasattr(step_executor, "execute_single_native_tool_call"):
            self.patch(step_executor, "execute_single_native_tool_call",
                       functools.partial(self._native_call_wrapper, index=0))

    def _native_call_wrapper(self, original: Callable[..., Any], index: int) -> Callable[..., Any]:
        """Run one native tool call: its id in reach of the tool's start event, and its span closed if it raises.

        crewai emits no closing event when something between the two raises (an after-tool-call hook, a
        tool-failure policy of ``raise`` before its event), so a tool span still open then ends here.
        """
        plugin = self

        @functools.wraps(original)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not plugin._active:
                return original(*args, **kwargs)
            token = None
            outer = _tool.get()
            try:
                call = attributes.tool_call(_arg(args, kwargs, index, "tool_call"))
                if call is not None and call["id"]:
                    token = _native_call.set((str(call["id"]), plugin._sanitize(call["function"]["name"])))
            except Exception as exc:  # noqa: BLE001 - fail-open
                report("crewai.native_tool_call", exc)
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                _end_open_tools(outer, exc)
                raise
            finally:
                if token is not None:
                    _native_call.reset(token)

        setattr(run, _MARK, original)
        return run

    # -- enclosing spans --------------------------------------------------------------------

    def _span_wrapper(self, original: Callable[..., Any], describe: Describe, site: str) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def traced(instance: Any, *args: Any, **kwargs: Any) -> Any:
            opened = _open(describe, instance, args, kwargs, site) if plugin._active else None
            if opened is None:
                return original(instance, *args, **kwargs)
            try:
                result = original(instance, *args, **kwargs)
            except BaseException as exc:
                _close(opened, exc, site)
                raise
            _close(opened, None, site)
            return result

        setattr(traced, _MARK, original)
        return traced

    def _async_span_wrapper(self, original: Callable[..., Any], describe: Describe, site: str) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def traced(instance: Any, *args: Any, **kwargs: Any) -> Any:
            opened = _open(describe, instance, args, kwargs, site) if plugin._active else None
            if opened is None:
                return await original(instance, *args, **kwargs)
            try:
                result = await original(instance, *args, **kwargs)
            except BaseException as exc:
                _close(opened, exc, site)
                raise
            _close(opened, None, site)
            return result

        setattr(traced, _MARK, original)
        return traced


def _is_abstract(method: Any) -> bool:
    return bool(getattr(method, "__isabstractmethod__", False))


def _tool_name_sanitizer() -> Callable[[str], str]:
    """crewai's own tool-name normaliser (tool events carry names through it), or the identity."""
    try:
        from crewai.utilities.string_utils import sanitize_tool_name
    except ImportError:
        return str
    return sanitize_tool_name
