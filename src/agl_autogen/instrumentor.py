"""The ``autogen`` plugin: a ``chat {model}`` span per model-client call and an ``execute_tool`` span per tool call.

Hooks, and why each catches every path:

- **Model calls**: ``create`` and ``create_stream`` on every concrete
  ``ChatCompletionClient`` class. Patching the abstract base alone catches
  nothing (each client defines its own methods), and patching the OpenAI client
  alone (as OpenInference does) misses Azure AI, Anthropic, Ollama, the replay
  client, caches and the user's own clients. So every subclass that defines
  either method is patched, found through ``__subclasses__`` recursively at
  ``instrument()``, and classes defined later are patched as they are created,
  through a hook on ``ChatCompletionClient.__init_subclass__``. Every agent,
  team selector and user script reaches a model through these two methods,
  awaited or streamed (AutoGen's model API is async-only, with no batch call).
  The span is current while the client runs (for a stream: from the first chunk
  asked for, while each chunk is produced, never while the consumer holds it), so the span
  of agl's ``openai`` plugin for the underlying HTTP request nests in it and the
  two become one transition that takes the agent from this span and the token
  ids and the ``traceparent`` join from that one. A client calling another one
  (``ChatCompletionCache``, a subclass calling ``super().create``) gives one
  span, the outer one.
- **Agent identity**: ``on_messages`` and ``on_messages_stream`` of every
  ``BaseChatAgent`` class (found and hooked the same way) keep the agent's name
  in a ``ContextVar`` while the agent's own code runs, and the LLM and tool
  spans carry it as ``gen_ai.agent.name``. ``run``/``run_stream``, a team's
  container and a direct ``on_messages`` call all go through these two
  methods. ``SelectorGroupChatManager.select_speaker`` runs under the name
  ``selector`` (the ``source`` AutoGen itself gives the selector's messages),
  so the selector's own model calls are never taken for a member's.
- **Tool calls**: ``AssistantAgent._execute_tool_call``, the one place where
  an ``AssistantAgent`` runs a model's tool call, whatever runs it: the
  streaming ``StaticStreamWorkbench`` it builds from ``tools=`` (wrapping
  ``StaticWorkbench.call_tool`` alone misses it), a plain or MCP workbench, a
  handoff; and its outcome there is what the model sees, ``is_error``
  included, as well as a call whose arguments are not JSON or that names no
  known tool. ``BaseTool.run_json`` / ``BaseStreamTool.run_json_stream`` are
  hooked too, for tools run elsewhere (``ToolAgent``, the user's code); under
  ``_execute_tool_call`` they only tell it whether the tool raised (a raising
  tool is ``exception``, an error result without one is ``error``).
- **AutoGen's own spans**: autogen-core makes ``execute_tool`` spans of its own
  (``trace_tool_span``) on the global provider. With an SDK provider set, agl
  collects them too, and each tool call would count twice for AIR. So while an
  agl tool span is current, ``trace_tool_span`` hands back agl's span instead of
  starting its own: one span per tool call, which the user's exporters still
  see. Its ``invoke_agent`` and ``create_agent`` spans are left alone, and it
  makes no ``chat`` spans, so it adds no LLM transitions; if it did, the
  builder merges nested LLM spans into one transition.

Every hook body is fail-open: a fault in agl's own code is reported through
:func:`agl_core.guard.report` and the framework call goes on unchanged.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncGenerator, Callable, Mapping
from contextvars import ContextVar, Token
from typing import Any, ClassVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_autogen import attributes
from agl_core import collector, semconv
from agl_core.encoding import set_on
from agl_core.guard import report
from agl_core.plugin import Instrumentor
from agl_core.tracer import context_with, start_with

SELECTOR = "selector"
"""The agent name of ``SelectorGroupChat``'s own model calls (the ``source`` AutoGen gives the selector's messages)."""

_MARK = "_agl_autogen_original"  # set on every wrapper, holding what it wraps

_agent: ContextVar[str | None] = ContextVar("agl_autogen_agent", default=None)
"""The agent whose own code is running now."""
_in_llm: ContextVar[bool] = ContextVar("agl_autogen_in_llm", default=False)
"""True while a traced model-client call runs: a client called inside another one is not traced again."""


def _leave(ctx_token: object, var: ContextVar[Any], var_token: Token[Any]) -> None:
    """Undo what entering a call made current; never raises (a generator may be closed from another context)."""
    try:
        var.reset(var_token)
    except ValueError:
        var.set(None if var is not _in_llm else False)
    try:
        otel_context.detach(ctx_token)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001
        report("autogen.detach", exc)


def _end_with_error(span: trace.Span, exc: BaseException, site: str) -> None:
    try:
        span.set_attribute(semconv.ERROR_TYPE, type(exc).__qualname__)
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        span.end()
    except Exception as fault:  # noqa: BLE001
        report(site, fault)


async def _passthrough(stream: Any, run: _ToolRun | None = None) -> AsyncGenerator[Any, None]:
    """``stream``'s items untouched; an error it raises is noted on ``run``; closing this closes ``stream``."""
    try:
        while True:
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:
                if run is not None and run.raised is None:
                    run.raised = exc
                raise
            yield item
    finally:
        await stream.aclose()


# --------------------------------------------------------------------------- model calls


class _LlmCall:
    """One traced model-client call: its span and the context that makes the span current."""

    __slots__ = ("span", "ctx")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.ctx = context_with(span)

    def enter(self) -> tuple[object, Token[bool]]:
        return otel_context.attach(self.ctx), _in_llm.set(True)

    def finish(self, result: Any) -> None:
        span = self.span
        try:
            if result is not None:
                set_on(span, attributes.result_attributes(result))
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("autogen.response", exc)
        try:
            span.end()
        except Exception as exc:  # noqa: BLE001
            report("autogen.response", exc)

    def fail(self, exc: BaseException) -> None:
        _end_with_error(self.span, exc, "autogen.error")


def _start_llm(client: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], stream: bool) -> _LlmCall | None:
    """Open the span of ``client.create(*args, **kwargs)`` (not yet current); None when it could not be made."""
    span = None
    try:
        messages = args[0] if args else kwargs.get("messages")
        attrs = attributes.request_attributes(client, messages, kwargs.get("tools"), kwargs.get("extra_create_args"),
                                              stream, _agent.get())
        span = start_with(collector.tracer(), semconv.chat_span_name(attrs.get(semconv.GEN_AI_REQUEST_MODEL)),
                          attrs, SpanKind.CLIENT)
        return _LlmCall(span)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("autogen.request", exc)
        if span is not None:
            span.end()
        return None


async def _traced_stream(stream: Any, client: Any, args: tuple[Any, ...],
                         kwargs: Mapping[str, Any]) -> AsyncGenerator[Any, None]:
    """``stream``'s items, traced as one call from the first item asked for (a stream never read makes no span).

    The span is current while each item is produced, never while the consumer holds it; it ends with the
    final ``CreateResult``, with the error the stream raised, or with what arrived when the consumer stops.
    """
    call = None if _in_llm.get() else _start_llm(client, args, kwargs, True)
    if call is None:
        async for item in _passthrough(stream):
            yield item
        return
    result = None
    try:
        while True:
            ctx_token, flag = call.enter()
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                break
            finally:
                _leave(ctx_token, _in_llm, flag)
            if type(item) is not str:
                result = item  # the final CreateResult (the chunks before it are str)
            yield item
    except GeneratorExit:  # the consumer stopped early: close the client's stream, keep what arrived
        ctx_token, flag = call.enter()
        try:
            await stream.aclose()
        finally:
            _leave(ctx_token, _in_llm, flag)
            call.finish(result)
        raise
    except BaseException as exc:
        call.fail(exc)
        raise
    call.finish(result)


# --------------------------------------------------------------------------- tool calls


class _ToolRun:
    """One traced tool call: its span, and what the tool did (filled in by the hooks below it)."""

    __slots__ = ("span", "ctx", "raised", "claimed", "shadowed")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.ctx = context_with(span)
        self.raised: BaseException | None = None  # the tool raised this (the workbench turned it into a result)
        self.claimed = False  # a run_json below already reports to this span
        self.shadowed = False  # autogen-core's own tool span was replaced by this one

    def finish(self, result: Any, is_error: bool) -> None:
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
            set_on(span, attributes.tool_end_attributes(result, status, error_type))
            if error_type is not None:
                if raised is not None:
                    span.record_exception(raised)
                span.set_status(Status(StatusCode.ERROR, str(result if result is not None else error_type)))
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("autogen.tool_result", exc)
        try:
            span.end()
        except Exception as exc:  # noqa: BLE001
            report("autogen.tool_result", exc)

    def fail(self, exc: BaseException) -> None:
        try:
            status = semconv.TOOL_TIMEOUT if isinstance(exc, TimeoutError) else semconv.TOOL_EXCEPTION
            self.span.set_attribute(semconv.AGL_TOOL_STATUS, status)
        except Exception as fault:  # noqa: BLE001
            report("autogen.tool_error", fault)
        _end_with_error(self.span, exc, "autogen.tool_error")


_tool_run: ContextVar[_ToolRun | None] = ContextVar("agl_autogen_tool_run", default=None)
"""The tool call being traced now (inherited by the tasks a workbench starts to run the tool)."""


def _start_tool(name: Any, call_id: Any, arguments: Any, agent: str | None) -> _ToolRun | None:
    span = None
    try:
        attrs = attributes.tool_start_attributes(str(name), call_id if isinstance(call_id, str) else None,
                                                 arguments, agent)
        span = collector.tracer().start_span(semconv.tool_span_name(attrs[semconv.GEN_AI_TOOL_NAME]),
                                             kind=SpanKind.INTERNAL)
        set_on(span, attrs)
        return _ToolRun(span)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("autogen.tool_request", exc)
        if span is not None:
            span.end()
        return None


class _Shadow:
    """Stands in for autogen-core's ``trace_tool_span`` while agl's span of the same call is current."""

    __slots__ = ("run",)

    def __init__(self, run: _ToolRun) -> None:
        self.run = run

    def __enter__(self) -> trace.Span:
        return self.run.span

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and self.run.raised is None:
            self.run.raised = exc


# --------------------------------------------------------------------------- the plugin


def _positional(args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


class AutoGenInstrumentor(Instrumentor):
    """Spans for AutoGen agentchat: model-client calls (awaited and streamed), tool calls, agent identity."""

    name: ClassVar[str] = "autogen"
    framework: ClassVar[str] = "autogen_agentchat"
    requirements: ClassVar[tuple[str, ...]] = ("autogen-agentchat >= 0.7, < 0.8",)

    wrapper_mark: ClassVar[str] = _MARK

    def _attach(self) -> None:
        from autogen_agentchat.agents import AssistantAgent, BaseChatAgent
        from autogen_core.models import ChatCompletionClient
        from autogen_core.tools import BaseStreamTool, BaseTool

        self._active = True
        self.hook_family(ChatCompletionClient, {"create": self._wrap_create,
                                                 "create_stream": self._wrap_create_stream})
        self.hook_family(BaseChatAgent, {"on_messages": self._wrap_on_messages,
                                           "on_messages_stream": self._wrap_on_messages_stream})
        self.patch(AssistantAgent, "_execute_tool_call", lambda fn: staticmethod(self._wrap_execute_tool_call(fn)))
        self.patch(BaseTool, "run_json", self._wrap_run_json)
        self.patch(BaseStreamTool, "run_json_stream", self._wrap_run_json_stream)
        for module in ("autogen_core", "autogen_core._telemetry", "autogen_core.tools._base",
                       "autogen_ext.tools.mcp._workbench"):
            owner = sys.modules.get(module)
            if owner is not None and hasattr(owner, "trace_tool_span"):
                self.patch(owner, "trace_tool_span", self._wrap_trace_tool_span)
        try:
            from autogen_agentchat.teams._group_chat._selector_group_chat import SelectorGroupChatManager
        except ImportError:  # moved in a later release: the selector's calls then carry no agent name
            pass
        else:
            self.patch(SelectorGroupChatManager, "select_speaker", self._wrap_select_speaker)

    def _detach(self) -> None:
        self._active = False  # wrappers that someone still holds now pass straight through

    # -- model clients -----------------------------------------------------------------------

    def _wrap_create(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def create(client: Any, *args: Any, **kwargs: Any) -> Any:
            if not plugin._active or _in_llm.get():
                return await original(client, *args, **kwargs)
            call = _start_llm(client, args, kwargs, False)
            if call is None:
                return await original(client, *args, **kwargs)
            ctx_token, flag = call.enter()
            try:
                result = await original(client, *args, **kwargs)
            except BaseException as exc:
                _leave(ctx_token, _in_llm, flag)
                call.fail(exc)
                raise
            _leave(ctx_token, _in_llm, flag)
            call.finish(result)
            return result

        setattr(create, _MARK, original)
        return create

    def _wrap_create_stream(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def create_stream(client: Any, *args: Any, **kwargs: Any) -> Any:
            stream = original(client, *args, **kwargs)
            if not plugin._active or _in_llm.get():
                return stream
            return _traced_stream(stream, client, args, kwargs)

        setattr(create_stream, _MARK, original)
        return create_stream

    # -- agent identity ----------------------------------------------------------------------

    def _wrap_on_messages(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def on_messages(agent: Any, *args: Any, **kwargs: Any) -> Any:
            token = _agent.set(_name_of(agent))
            try:
                return await original(agent, *args, **kwargs)
            finally:
                try:
                    _agent.reset(token)
                except ValueError:
                    _agent.set(None)

        setattr(on_messages, _MARK, original)
        return on_messages

    def _wrap_on_messages_stream(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def on_messages_stream(agent: Any, *args: Any, **kwargs: Any) -> Any:
            stream = original(agent, *args, **kwargs)
            if not plugin._active:
                return stream
            return _named_stream(stream, _name_of(agent))

        setattr(on_messages_stream, _MARK, original)
        return on_messages_stream

    def _wrap_select_speaker(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def select_speaker(manager: Any, *args: Any, **kwargs: Any) -> Any:
            token = _agent.set(SELECTOR)
            try:
                return await original(manager, *args, **kwargs)
            finally:
                try:
                    _agent.reset(token)
                except ValueError:
                    _agent.set(None)

        setattr(select_speaker, _MARK, original)
        return select_speaker

    # -- tools ---------------------------------------------------------------------------------

    def _wrap_execute_tool_call(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def _execute_tool_call(*args: Any, **kwargs: Any) -> Any:
            run = None
            if plugin._active:
                try:
                    call = _positional(args, kwargs, 0, "tool_call")
                    agent = _positional(args, kwargs, 3, "agent_name")
                    run = _start_tool(call.name, call.id, call.arguments, agent if isinstance(agent, str) else None)
                except Exception as exc:  # noqa: BLE001 - fail-open
                    report("autogen.tool_request", exc)
            if run is None:
                return await original(*args, **kwargs)
            ctx_token, run_token = otel_context.attach(run.ctx), _tool_run.set(run)
            try:
                outcome = await original(*args, **kwargs)
            except BaseException as exc:
                _leave(ctx_token, _tool_run, run_token)
                run.fail(exc)
                raise
            _leave(ctx_token, _tool_run, run_token)
            try:
                result = outcome[1]  # (FunctionCall, FunctionExecutionResult)
                run.finish(result.content, bool(result.is_error))
            except Exception as exc:  # noqa: BLE001 - fail-open
                report("autogen.tool_result", exc)
                run.finish(None, False)
            return outcome

        setattr(_execute_tool_call, _MARK, original)
        return _execute_tool_call

    def _wrap_run_json(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        async def run_json(tool: Any, *args: Any, **kwargs: Any) -> Any:
            outer = _tool_run.get()
            if not plugin._active:
                return await original(tool, *args, **kwargs)
            if outer is not None and not outer.claimed:  # _execute_tool_call's span reports this run
                outer.claimed = True
                try:
                    return await original(tool, *args, **kwargs)
                except Exception as exc:
                    outer.raised = outer.raised or exc
                    raise
            run = _start_tool_for(tool, args, kwargs)
            if run is None:
                return await original(tool, *args, **kwargs)
            run.claimed = True
            ctx_token, run_token = otel_context.attach(run.ctx), _tool_run.set(run)
            try:
                value = await original(tool, *args, **kwargs)
            except BaseException as exc:
                _leave(ctx_token, _tool_run, run_token)
                run.fail(exc)
                raise
            _leave(ctx_token, _tool_run, run_token)
            run.finish(_result_text(tool, value), False)
            return value

        setattr(run_json, _MARK, original)
        return run_json

    def _wrap_run_json_stream(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def run_json_stream(tool: Any, *args: Any, **kwargs: Any) -> Any:
            stream = original(tool, *args, **kwargs)
            if not plugin._active:
                return stream
            return _tool_stream(stream, tool, args, kwargs)

        setattr(run_json_stream, _MARK, original)
        return run_json_stream

    def _wrap_trace_tool_span(self, original: Callable[..., Any]) -> Callable[..., Any]:
        plugin = self

        @functools.wraps(original)
        def trace_tool_span(*args: Any, **kwargs: Any) -> Any:
            run = _tool_run.get()
            if run is None or run.shadowed or not plugin._active:
                return original(*args, **kwargs)
            run.shadowed = True
            return _Shadow(run)

        setattr(trace_tool_span, _MARK, original)
        return trace_tool_span


def _name_of(agent: Any) -> str | None:
    try:
        name = agent.name
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("autogen.agent_name", exc)
        return None
    return name if isinstance(name, str) else None


async def _named_stream(stream: Any, name: str | None) -> AsyncGenerator[Any, None]:
    """``stream``'s items, with ``name`` as the current agent while each is produced (never while it is held)."""
    try:
        while True:
            token = _agent.set(name)
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return
            finally:
                try:
                    _agent.reset(token)
                except ValueError:
                    _agent.set(None)
            yield item
    finally:
        token = _agent.set(name)
        try:
            await stream.aclose()  # a no-op once exhausted; runs the agent's cleanup when closed early
        finally:
            try:
                _agent.reset(token)
            except ValueError:
                _agent.set(None)


def _start_tool_for(tool: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> _ToolRun | None:
    """The span of ``tool.run_json(args, cancellation_token, call_id=...)`` run outside an agent's tool call."""
    try:
        arguments = _positional(args, kwargs, 0, "args")
        call_id = _positional(args, kwargs, 2, "call_id")
        return _start_tool(tool.name, call_id, dict(arguments) if isinstance(arguments, Mapping) else arguments,
                           _agent.get())
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("autogen.tool_request", exc)
        return None


def _result_text(tool: Any, value: Any) -> str | None:
    try:
        text = tool.return_value_as_string(value)
        return text if isinstance(text, str) else str(text)
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("autogen.tool_result", exc)
        return None


async def _tool_stream(stream: Any, tool: Any, args: tuple[Any, ...],
                       kwargs: Mapping[str, Any]) -> AsyncGenerator[Any, None]:
    """``tool.run_json_stream(...)``'s items; traced as one tool call unless an agent's tool call already is."""
    outer = _tool_run.get()
    if outer is not None and not outer.claimed:  # _execute_tool_call's span reports this run
        outer.claimed = True
        async for item in _passthrough(stream, outer):
            yield item
        return
    run = _start_tool_for(tool, args, kwargs)
    if run is None:
        async for item in _passthrough(stream):
            yield item
        return
    run.claimed = True
    last = None
    try:
        while True:
            ctx_token, run_token = otel_context.attach(run.ctx), _tool_run.set(run)
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                break
            finally:
                _leave(ctx_token, _tool_run, run_token)
            last = item
            yield item
    except GeneratorExit:
        try:
            await stream.aclose()
        finally:
            run.finish(None, False)
        raise
    except BaseException as exc:
        run.fail(exc)
        raise
    run.finish(_result_text(tool, last) if last is not None else None, False)
