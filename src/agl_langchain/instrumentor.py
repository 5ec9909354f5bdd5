"""The ``langchain`` plugin: a ``chat {model}`` span per chat-model run, an ``execute_tool`` span per tool run,
and an ``invoke_agent`` span per agent, for LangChain and LangGraph.

Hook: one callback handler, added to every callback manager LangChain builds,
through ``langchain_core``'s configure hook (``register_configure_hook`` with a
``ContextVar`` whose *default* is the handler, so it is there in every thread
and task without anyone setting it). ``CallbackManager.configure`` runs for
every runnable call, so the handler sees every chat-model run however it was
started: ``invoke``/``ainvoke``, ``batch``/``abatch`` (one run per input, in
threads or tasks), ``stream``/``astream``, ``astream_events``, ``generate``
with several prompts, the model inside ``with_structured_output``, inside
LangGraph nodes and prebuilt agents, and any ``BaseChatModel`` subclass,
including third-party ones. The alternatives miss paths: patching
``BaseChatModel.invoke`` misses ``stream``/``astream`` and ``generate`` (and
subclasses that override ``invoke``); patching each provider's ``_generate``
misses providers we do not know; wrapping ``BaseCallbackManager.__init__`` (as
OpenInference does) sees the same runs as the configure hook but pays on every
one of the many managers LangChain makes (each ``get_child`` too). The handler
sets ``run_inline = True``: without it the async callback manager runs each
event of a non-inline handler in the default thread pool, a thread hop per
event, and in a copied context.

Spans nest by LangChain's own run tree (``parent_run_id``), kept in one map of
in-flight runs that each run leaves when it ends or fails; a run with no known
parent nests under the OpenTelemetry context current when it starts (the
``agl.rollout`` span, or the user's own span).

What a callback cannot do is make the chat span *current* while the model
runs: async end events run in a copied context (``@shielded``), and a stream's
events fire inside a generator that the caller drives. So four methods of
``BaseChatModel`` are patched as well, each only to attach the run's span for
the time the model's own code runs: ``_generate_with_cache`` and
``_agenerate_with_cache`` (every non-streamed path, one call per prompt) and
``stream``/``astream`` (while each chunk is produced, never while the caller
holds it), plus ``_iter_v2_events``/``_aiter_v2_events`` where they exist (the
protocol-event streams of langchain-core 1.8). So a ``ChatOpenAI`` call's
request, made through the ``openai`` client, gets the span of agl's ``openai``
plugin nested in the LangChain span, and the two become one transition that
takes the agent from this span and the token ids and ``traceparent`` join
from that one. Agent and tool spans are made current by the handler itself
(their start and end events run where the run does), so the user's own spans
and raw client calls inside a node or a tool nest in them; for an async chain,
whose end event runs in a copied context, ``AsyncCallbackManagerForChainRun``'s
``on_chain_end``/``on_chain_error`` are wrapped to put the caller's context
back once the handlers are done.

Agent identity (``gen_ai.agent.name`` on an ``invoke_agent`` span, and on each
chat span): each LangGraph node is an agent scope named after the node, so in
a hand-built writer / checker / rewriter graph each node's calls carry its
name. A prebuilt agent is one scope named after the agent, and its own steps
(``model``/``agent``, ``tools``, hooks) are not scopes of their own: an agent
made with ``create_agent(name=...)`` (LangChain marks its graph with
``lc_agent_name``), or a named graph whose first node is a prebuilt agent's
entry step (``create_react_agent(name=...)``, and ``create_agent`` of releases
that do not mark the graph). The innermost scope names a call. LangGraph's own
nodes (``__start__``, a step of its own when the entry is a conditional edge, as
in ``create_swarm``) are never scopes.

Tool outcomes: a tool that raised is ``exception`` (``timeout`` for a
``TimeoutError``); one whose result is a ``ToolMessage`` with
``status="error"`` (what ``handle_tool_error`` and ``handle_validation_error``
make, or what the tool returned) is ``error``; anything else ``ok``. A tool that
calls ``interrupt()`` (LangGraph's approval step) stops to wait for a decision:
its span becomes a ``tool_pause`` span, not an outcome, and the run resumed with
``Command(resume=...)`` runs the tool again under the same call id, whose
``execute_tool`` span is the call's one outcome.

Every hook body is fail-open: a fault in agl's own code is reported through
:func:`agl_core.guard.report` and LangChain goes on unchanged.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any, ClassVar
from uuid import UUID

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from agl_core import collector, semconv, tools
from agl_core.encoding import set_on
from agl_core.guard import report
from agl_core.plugin import Instrumentor
from agl_langchain import attributes

_RUN_KEY = otel_context.create_key("agl-langchain-run")  # in a context agl made current: the run it belongs to

# kinds of run
_CHAIN = 0  # any other runnable: no span, only its place in the tree
_AGENT = 1
_CHAT = 2
_TOOL = 3

# how a chat run was executed, for a generate() call over several prompts that fails part way
_SYNC = 1
_ASYNC = 2

_DEFAULT_GRAPH_NAME = "LangGraph"  # a compiled graph's name when nobody named it
# the first node of a prebuilt agent's graph: create_react_agent's, or create_agent's (its model, or a middleware hook)
_PREBUILT_ENTRIES = frozenset({"agent", "pre_model_hook", "model"})
_PREBUILT_HOOKS = (".before_agent", ".before_model")
_CREATE_AGENT = "langchain_create_agent"  # create_agent's ls_integration metadata
_MAX_RUNS = 100_000  # in-flight runs; past it the oldest are dropped (a run LangChain never ended)


class _Run:
    """One in-flight LangChain run: its span (if it has one) and what its children inherit."""

    __slots__ = ("kind", "span", "ctx", "agent", "name", "prebuilt", "nodes", "start_ns", "prev", "done", "batch",
                 "ran")

    def __init__(self, kind: int, ctx: Context, agent: str | None) -> None:
        self.kind = kind
        self.span: Any = None
        self.ctx = ctx  # the context children start their spans in
        self.agent = agent  # the innermost agent scope
        self.name: str | None = None  # a tool's name; a plain chain's: a graph root that may turn out to be an agent
        self.prebuilt = False  # an agent built by create_agent / create_react_agent: its nodes are its own steps
        self.nodes = False  # a graph whose first node has started
        self.start_ns = 0
        self.prev: Context | None = None  # the context that was current before this run's span was made current
        self.done = False
        self.batch: Any = None  # chat runs of one generate() call over several prompts share this token
        self.ran = 0


class _Slot:
    """Where the first chat run started inside a wrapped ``stream``/``astream`` step reports itself."""

    __slots__ = ("run", "token")

    def __init__(self) -> None:
        self.run: _Run | None = None
        self.token: object = None


_capture: ContextVar[_Slot | None] = ContextVar("agl_langchain_stream_slot", default=None)


def _is_step(tags: Iterable[str]) -> bool:
    return any(tag.startswith("graph:step:") for tag in tags)


def _is_internal(name: str) -> bool:
    """LangGraph's own nodes (``__start__``, which runs as a step when the entry is a conditional edge, as in
    ``create_swarm``; ``__end__``): never agents, and never a graph's first node."""
    return name.startswith("__") and name.endswith("__")


def _is_bubble_up(error: BaseException) -> bool:
    """LangGraph's control-flow exceptions (interrupts, ``Command(graph=PARENT)``): not failures."""
    return any(cls.__name__ == "GraphBubbleUp" for cls in type(error).__mro__)


def _is_interrupt(error: BaseException) -> bool:
    """``interrupt()`` (LangGraph's ``GraphInterrupt``): the run stops to wait for a decision."""
    return any(cls.__name__ == "GraphInterrupt" for cls in type(error).__mro__)


def _fail(span: Any, error: BaseException) -> None:
    span.set_attribute(semconv.ERROR_TYPE, type(error).__qualname__)
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


class Hooks:
    """The callback handler's behaviour; :func:`handler_class` mixes it into LangChain's ``BaseCallbackHandler``."""

    run_inline = True  # called in the caller's task: no thread-pool hop per event on the async path
    raise_error = False
    ignore_retriever = True
    ignore_retry = True
    ignore_custom_event = True

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[UUID, _Run] = {}
        self.active = True

    # a configure hook hands LangChain this one object; copies of a config must not multiply it
    def __copy__(self) -> Hooks:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Hooks:
        return self

    # -- the run tree and the current context ------------------------------------------

    def _parent(self, parent_run_id: UUID | None) -> tuple[Context, str | None, _Run | None]:
        parent = self.runs.get(parent_run_id) if parent_run_id is not None else None
        if parent is not None:
            return parent.ctx, parent.agent, parent
        ctx = _unwind(otel_context.get_current())
        owner = ctx.get(_RUN_KEY)
        return ctx, owner.agent if isinstance(owner, _Run) else None, None

    def _add(self, run_id: UUID, run: _Run) -> None:
        runs = self.runs
        if len(runs) >= _MAX_RUNS:
            self._drop_oldest()
        runs[run_id] = run

    def _drop_oldest(self) -> None:
        try:
            for run_id in list(self.runs)[: _MAX_RUNS // 10]:
                run = self.runs.pop(run_id, None)
                if run is not None and run.span is not None:
                    run.span.set_attribute(semconv.ERROR_TYPE, "abandoned")
                    run.span.end()
        except RuntimeError:  # another thread changed the map meanwhile: try again on a later insert
            pass

    # -- chains: the run tree and agent scopes -----------------------------------------

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       tags: list[str] | None = None, metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self.active:
            return
        try:
            self._chain_start(run_id, parent_run_id, tags, metadata, kwargs.get("name"))
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("langchain.chain_start", exc)

    def _chain_start(self, run_id: UUID, parent_run_id: UUID | None, tags: list[str] | None,
                     metadata: dict[str, Any] | None, name: Any) -> None:
        meta = metadata or {}
        node = (isinstance(name, str) and meta.get("langgraph_node") == name and _is_step(tags or ())
                and not _is_internal(name))
        if node and parent_run_id is not None:
            graph = self.runs.get(parent_run_id)  # a node's parent run is its graph's
            if graph is not None and not graph.nodes:
                graph.nodes = True
                if name in _PREBUILT_ENTRIES or name.endswith(_PREBUILT_HOOKS):
                    self._adopt(graph)  # before the node inherits from it
        ctx, agent, parent = self._parent(parent_run_id)
        run = _Run(_CHAIN, ctx, agent)
        self._add(run_id, run)
        if node:
            # a LangGraph node: an agent scope of its own, unless it is a step of a prebuilt agent
            if parent is None or not parent.prebuilt:
                self._open_agent(run, name)
        elif isinstance(name, str) and (meta.get("lc_agent_name") == name or (
                name == _DEFAULT_GRAPH_NAME and meta.get("ls_integration") == _CREATE_AGENT)):
            run.prebuilt = True  # the root of a create_agent graph
            if name != _DEFAULT_GRAPH_NAME and agent != name:
                self._open_agent(run, name)
        elif isinstance(name, str) and name != _DEFAULT_GRAPH_NAME:
            run.name = name  # maybe the root of a prebuilt agent's graph: see _adopt
            run.start_ns = time.time_ns()

    def _open_agent(self, run: _Run, name: str) -> None:
        span = collector.tracer().start_span(semconv.agent_span_name(name), context=run.ctx,
                                             attributes=attributes.agent_attributes(name))
        run.kind = _AGENT
        run.span = span
        run.agent = name
        _enter(run)

    def _adopt(self, graph: _Run) -> None:
        """A named graph whose first node is a prebuilt agent's entry step (``agent``, ``model``, a middleware's
        ``before_*`` hook) is a ``create_react_agent(name=...)``, or a ``create_agent(name=...)`` of a release that
        does not mark its graph: one agent, its nodes its own steps. Its span starts when the graph did."""
        name = graph.name
        if graph.kind != _CHAIN or name is None:
            return
        graph.prebuilt = True
        if graph.agent != name:
            span = collector.tracer().start_span(semconv.agent_span_name(name), context=graph.ctx,
                                                 attributes=attributes.agent_attributes(name),
                                                 start_time=graph.start_ns)
            graph.kind = _AGENT
            graph.span = span
            graph.agent = name
            graph.ctx = trace.set_span_in_context(span, graph.ctx)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self.runs.pop(run_id, None)
        if run is None or run.span is None:
            return
        try:
            run.span.end()
            _leave(run)
        except Exception as exc:  # noqa: BLE001
            report("langchain.chain_end", exc)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        run = self.runs.pop(run_id, None)
        if run is None or run.span is None:
            return
        try:
            if not _is_bubble_up(error):
                _fail(run.span, error)
            run.span.end()
            _leave(run)
        except Exception as exc:  # noqa: BLE001
            report("langchain.chain_error", exc)

    # -- chat models -------------------------------------------------------------------

    def on_chat_model_start(self, serialized: Any, messages: list[list[Any]], *, run_id: UUID,
                            parent_run_id: UUID | None = None, tags: list[str] | None = None,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self.active:
            return
        try:
            self._chat_start(messages, run_id, parent_run_id, metadata, kwargs)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("langchain.chat_start", exc)

    def _chat_start(self, messages: list[list[Any]], run_id: UUID, parent_run_id: UUID | None,
                    metadata: dict[str, Any] | None, kwargs: dict[str, Any]) -> None:
        ctx, agent, _ = self._parent(parent_run_id)
        params = kwargs.get("invocation_params") or {}
        start, attrs = attributes.chat_start_attributes(messages[0] if messages else (), params, metadata or {}, agent)
        span = collector.tracer().start_span(semconv.chat_span_name(start.get(semconv.GEN_AI_REQUEST_MODEL)),
                                             context=ctx, kind=SpanKind.CLIENT, attributes=start)
        run = _Run(_CHAT, ctx, agent)
        run.span = span
        if (kwargs.get("batch_size") or 1) > 1:
            run.batch = params  # the same dict for every prompt of the call
        self._add(run_id, run)
        set_on(span, attrs)
        slot = _capture.get()
        if slot is not None and slot.run is None:  # the first run inside a wrapped stream step: current from now on
            slot.run = run
            slot.token = otel_context.attach(trace.set_span_in_context(span))

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self.runs.pop(run_id, None)
        if run is None or run.span is None:
            return
        span = run.span
        try:
            set_on(span, attributes.chat_end_attributes(response))
        except Exception as exc:  # noqa: BLE001 - fail-open: the span still ends
            report("langchain.chat_end", exc)
        self._end(run)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        run = self.runs.pop(run_id, None)
        if run is None or run.span is None:
            return
        span = run.span
        try:
            set_on(span, attributes.partial_output_attributes(kwargs.get("response")))
            if not isinstance(error, GeneratorExit):  # a stream its caller stopped reading: not a failure
                _fail(span, error)
        except Exception as exc:  # noqa: BLE001
            report("langchain.chat_error", exc)
        self._end(run)
        if run.batch is not None and run.ran == _SYNC:
            try:
                self._abort_batch(run.batch)
            except Exception as exc:  # noqa: BLE001
                report("langchain.chat_error", exc)

    def _abort_batch(self, batch: Any) -> None:
        """A sync ``generate()`` over several prompts stops at the first failure and ends none of the others."""
        for run_id, run in list(self.runs.items()):
            if run.batch is batch and self.runs.pop(run_id, None) is not None:
                run.span.set_attribute(semconv.ERROR_TYPE, "generate_aborted")
                run.span.set_status(Status(StatusCode.ERROR, "another prompt of the same generate() call failed"))
                run.span.end()
                run.done = True

    def chat_run(self, run_manager: Any, how: int) -> _Run | None:
        """The chat run a ``_generate_with_cache`` call executes, if it is one of ours."""
        if run_manager is None or not self.active:
            return None
        run = self.runs.get(run_manager.run_id)
        if run is None or run.kind != _CHAT:
            return None
        run.ran = how
        return run

    # -- tools -------------------------------------------------------------------------

    def on_tool_start(self, serialized: Any, input_str: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                      tags: list[str] | None = None, metadata: dict[str, Any] | None = None,
                      inputs: Any = None, **kwargs: Any) -> None:
        if not self.active:
            return
        try:
            ctx, agent, _ = self._parent(parent_run_id)
            name = attributes.tool_name(serialized, kwargs.get("name"))
            start, attrs = attributes.tool_start_attributes(name, input_str, inputs, kwargs.get("tool_call_id"))
            span = collector.tracer().start_span(semconv.tool_span_name(name), context=ctx, attributes=start)
            run = _Run(_TOOL, ctx, agent)
            run.span = span
            run.name = name
            self._add(run_id, run)
            set_on(span, attrs)
            _enter(run)
        except Exception as exc:  # noqa: BLE001 - fail-open
            report("langchain.tool_start", exc)

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        run = self.runs.pop(run_id, None)
        if run is None or run.span is None:
            return
        span = run.span
        try:
            attrs, status = attributes.tool_end_attributes(output)
            set_on(span, attrs)
            if status != semconv.TOOL_OK:
                span.set_status(Status(StatusCode.ERROR, attrs.get(semconv.GEN_AI_TOOL_CALL_RESULT) or status))
        except Exception as exc:  # noqa: BLE001 - fail-open: the span still ends
            report("langchain.tool_end", exc)
        self._end(run)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        run = self.runs.pop(run_id, None)
        if run is None or run.span is None:
            return
        try:
            if _is_interrupt(error):  # resumed, LangGraph runs the tool again: that run is the call's outcome
                tools.pause(run.span, run.name)
            elif _is_bubble_up(error):  # Command(graph=PARENT) raised by the tool: a handoff, not a failure
                run.span.set_attribute(semconv.AGL_TOOL_STATUS, semconv.TOOL_OK)
            else:
                run.span.set_attribute(semconv.AGL_TOOL_STATUS, attributes.tool_error_status(error))
                _fail(run.span, error)
        except Exception as exc:  # noqa: BLE001
            report("langchain.tool_error", exc)
        self._end(run)

    def _end(self, run: _Run) -> None:
        try:
            run.span.end()
            if run.prev is not None:  # it was made current
                _leave(run)
            else:
                run.done = True
        except Exception as exc:  # noqa: BLE001
            report("langchain.run_end", exc)

    # -- switching off -------------------------------------------------------------------

    def close(self) -> None:
        """Stop recording; runs still in flight are forgotten (their spans never end, so nothing stores them)."""
        self.active = False
        self.runs.clear()


def _enter(run: _Run) -> None:
    """Make the run's span current, remembering what was current before; :func:`_leave` undoes it.

    Not a token-based ``attach``/``detach``: LangChain may end a run in another
    context than it started it in (async end events run in a copied context),
    or out of order (two streams read in turns), where a token cannot be reset.
    The context we attach carries the run, so whoever finds it current later
    can tell that it is ours and finished, and put back what was before it.
    """
    prev = otel_context.get_current()
    mine = otel_context.set_value(_RUN_KEY, run, trace.set_span_in_context(run.span, prev))
    run.prev = prev
    run.ctx = trace.set_span_in_context(run.span, run.ctx)
    otel_context.attach(mine)


def _leave(run: _Run) -> None:
    run.done = True
    _unwind(otel_context.get_current())  # this run, and any finished one left above it by an end in another context


def _unwind(cur: Context) -> Context:
    """Put back what was current before every finished run of ours that is still current; the context now current."""
    start = cur
    while True:
        run = cur.get(_RUN_KEY)
        if not isinstance(run, _Run) or not run.done or run.prev is None or trace.get_current_span(cur) is not run.span:
            break
        cur = run.prev
    if cur is not start:
        otel_context.attach(cur)
    return cur


# --------------------------------------------------------------------------- patches: the chat span current


def _run_manager(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # _generate_with_cache(self, messages, stop=None, run_manager=None, **kwargs); LangChain passes it by keyword
    return kwargs["run_manager"] if "run_manager" in kwargs else (args[2] if len(args) > 2 else None)


def _attach_run(hooks: Hooks, run_manager: Any, how: int) -> object:
    """Make the chat run's span current; the token, or None when it is not ours. Never raises."""
    try:
        run = hooks.chat_run(run_manager, how)
        return otel_context.attach(trace.set_span_in_context(run.span)) if run is not None else None
    except Exception as exc:  # noqa: BLE001 - fail-open
        report("langchain.current", exc)
        return None


def _detach(token: object) -> None:
    try:
        otel_context.detach(token)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001
        report("langchain.current", exc)


def _wrap_generate(hooks: Hooks) -> Callable[[Any], Any]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _generate_with_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            token = _attach_run(hooks, _run_manager((self, *args), kwargs), _SYNC)
            if token is None:
                return original(self, *args, **kwargs)
            try:
                return original(self, *args, **kwargs)
            finally:
                _detach(token)

        return _generate_with_cache

    return wrap


def _wrap_agenerate(hooks: Hooks) -> Callable[[Any], Any]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def _agenerate_with_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            token = _attach_run(hooks, _run_manager((self, *args), kwargs), _ASYNC)
            if token is None:
                return await original(self, *args, **kwargs)
            try:
                return await original(self, *args, **kwargs)
            finally:
                _detach(token)

        return _agenerate_with_cache

    return wrap


def _step_context(slot: _Slot) -> object:
    """Attach the captured run's span for one step of a stream; the token, or None."""
    run = slot.run
    if run is None or run.span is None:
        return None
    try:
        return otel_context.attach(trace.set_span_in_context(run.span))
    except Exception as exc:  # noqa: BLE001
        report("langchain.current", exc)
        return None


def _first_step_done(slot: _Slot, capture: object) -> None:
    try:
        _capture.reset(capture)  # type: ignore[arg-type]
        if slot.token is not None:
            otel_context.detach(slot.token)  # type: ignore[arg-type]
            slot.token = None
    except Exception as exc:  # noqa: BLE001
        report("langchain.current", exc)


def _wrap_stream(hooks: Hooks) -> Callable[[Any], Any]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def stream(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            inner = original(self, *args, **kwargs)
            if not hooks.active:
                yield from inner
                return
            slot = _Slot()
            try:
                while True:
                    if slot.run is None:  # the run starts inside this step: its start event makes it current
                        capture = _capture.set(slot)
                        try:
                            chunk = next(inner)
                        except StopIteration:
                            return
                        finally:
                            _first_step_done(slot, capture)
                    else:
                        token = _step_context(slot)
                        try:
                            chunk = next(inner)
                        except StopIteration:
                            return
                        finally:
                            if token is not None:
                                _detach(token)
                    yield chunk
            finally:
                inner.close()

        return stream

    return wrap


def _wrap_astream(hooks: Hooks) -> Callable[[Any], Any]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def astream(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            inner = original(self, *args, **kwargs)
            if not hooks.active:
                async for chunk in inner:
                    yield chunk
                return
            slot = _Slot()
            try:
                while True:
                    if slot.run is None:
                        capture = _capture.set(slot)
                        try:
                            chunk = await inner.__anext__()
                        except StopAsyncIteration:
                            return
                        finally:
                            _first_step_done(slot, capture)
                    else:
                        token = _step_context(slot)
                        try:
                            chunk = await inner.__anext__()
                        except StopAsyncIteration:
                            return
                        finally:
                            if token is not None:
                                _detach(token)
                    yield chunk
            finally:
                await inner.aclose()

        return astream

    return wrap


def _wrap_events(hooks: Hooks) -> Callable[[Any], Any]:
    """``_iter_v2_events(messages, *, run_manager, ...)``: the run is known up front; current during each step."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _iter_v2_events(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            inner = original(self, *args, **kwargs)
            slot = _Slot()
            try:
                slot.run = hooks.chat_run(kwargs.get("run_manager"), _SYNC)
            except Exception as exc:  # noqa: BLE001
                report("langchain.current", exc)
            try:
                while True:
                    token = _step_context(slot)
                    try:
                        event = next(inner)
                    except StopIteration:
                        return
                    finally:
                        if token is not None:
                            _detach(token)
                    yield event
            finally:
                inner.close()

        return _iter_v2_events

    return wrap


def _wrap_aevents(hooks: Hooks) -> Callable[[Any], Any]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def _aiter_v2_events(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            inner = original(self, *args, **kwargs)
            slot = _Slot()
            try:
                slot.run = hooks.chat_run(kwargs.get("run_manager"), _ASYNC)
            except Exception as exc:  # noqa: BLE001
                report("langchain.current", exc)
            try:
                while True:
                    token = _step_context(slot)
                    try:
                        event = await inner.__anext__()
                    except StopAsyncIteration:
                        return
                    finally:
                        if token is not None:
                            _detach(token)
                    yield event
            finally:
                await inner.aclose()

        return _aiter_v2_events

    return wrap


def _wrap_async_end(original: Callable[..., Any]) -> Callable[..., Any]:
    """``AsyncCallbackManagerForChainRun.on_chain_end``/``on_chain_error`` run the handlers in a copied context
    (``@shielded``), where an agent span made current at the run's start cannot be put back; this wrapper puts it
    back in the caller's own context once they are done, so nothing stays current after ``await graph.ainvoke()``."""

    @functools.wraps(original)
    async def end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, *args, **kwargs)
        finally:
            try:
                _unwind(otel_context.get_current())
            except Exception as exc:  # noqa: BLE001
                report("langchain.current", exc)

    return end


# --------------------------------------------------------------------------- the plugin


def handler_class() -> type[Hooks]:
    """The callback handler class: :class:`Hooks` on LangChain's ``BaseCallbackHandler`` (imported here, lazily)."""
    from langchain_core.callbacks import BaseCallbackHandler

    return type("AglCallbackHandler", (Hooks, BaseCallbackHandler), {"__module__": __name__})


class LangChainInstrumentor(Instrumentor):
    """Spans for LangChain and LangGraph: chat-model runs, tool runs and agents, on every path."""

    name: ClassVar[str] = "langchain"
    framework: ClassVar[str] = "langchain_core"
    requirements: ClassVar[tuple[str, ...]] = ("langchain-core >= 1.0",)

    handler: Hooks | None = None
    _hook_var: ContextVar[Any] | None = None

    def _attach(self) -> None:
        from langchain_core.callbacks.manager import AsyncCallbackManagerForChainRun
        from langchain_core.language_models.chat_models import BaseChatModel
        from langchain_core.tracers.context import register_configure_hook

        handler = handler_class()()
        var: ContextVar[Any] = ContextVar("agl_langchain_handler", default=handler)
        self.patch(BaseChatModel, "_generate_with_cache", _wrap_generate(handler))
        self.patch(BaseChatModel, "_agenerate_with_cache", _wrap_agenerate(handler))
        self.patch(BaseChatModel, "stream", _wrap_stream(handler))
        self.patch(BaseChatModel, "astream", _wrap_astream(handler))
        if "_iter_v2_events" in BaseChatModel.__dict__:
            self.patch(BaseChatModel, "_iter_v2_events", _wrap_events(handler))
        if "_aiter_v2_events" in BaseChatModel.__dict__:
            self.patch(BaseChatModel, "_aiter_v2_events", _wrap_aevents(handler))
        self.patch(AsyncCallbackManagerForChainRun, "on_chain_end", _wrap_async_end)
        self.patch(AsyncCallbackManagerForChainRun, "on_chain_error", _wrap_async_end)
        register_configure_hook(var, True)  # inheritable: child runs' managers carry it too
        self.handler = handler
        self._hook_var = var

    def _detach(self) -> None:
        var, handler = self._hook_var, self.handler
        self._hook_var = self.handler = None
        if handler is not None:
            handler.close()  # managers made before now still hold it: it does nothing from here on
        if var is None:
            return
        from langchain_core.tracers import context as lc_context

        hooks: list[Any] = getattr(lc_context, "_configure_hooks", [])
        hooks[:] = [entry for entry in hooks if entry[0] is not var]
