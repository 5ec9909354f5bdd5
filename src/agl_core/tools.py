"""``agl.tool_call``: a tool span for agents written from scratch.

Framework plugins record tool calls themselves; an agent that runs its own tool
loop on the plain ``openai`` client wraps each tool execution instead::

    with agl.tool_call("calculator", call_id=tc.id, arguments=tc.function.arguments) as call:
        call.result = calculator(**json.loads(tc.function.arguments))

An exception raised in the block marks the span as a tool exception (and
passes through); ``call.error(...)`` marks a tool that returned an error
result; either becomes an intermediate reward through ``AirRules``.
"""

from __future__ import annotations

import functools
import json
from types import TracebackType
from typing import Any

from agl_core import collector, semconv
from agl_core.encoding import set_on, span_text
from agl_core.guard import report

# json.dumps's own spacing, and repr for what it cannot encode: what user-recorded tool spans have always held
_spaced = functools.partial(json.dumps, ensure_ascii=False, default=repr)


class ToolCall:
    """The span of one tool execution; set ``result`` or call ``error()`` inside the block."""

    def __init__(self, name: str, call_id: str | None, arguments: Any) -> None:
        self.name = name
        self.call_id = call_id
        self.arguments = arguments
        self.result: Any = None
        self.status = semconv.TOOL_OK
        self._span: Any = None
        self._token: Any = None

    def error(self, message: str | None = None, *, timeout: bool = False) -> None:
        """Mark the call as failed without raising (the tool returned an error result)."""
        self.status = semconv.TOOL_TIMEOUT if timeout else semconv.TOOL_ERROR
        if message is not None:
            self.result = message

    def __enter__(self) -> ToolCall:
        try:
            from opentelemetry import context, trace

            attrs: dict[str, Any] = {
                semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
                semconv.GEN_AI_TOOL_NAME: self.name,
                semconv.GEN_AI_TOOL_TYPE: "function",
            }
            if self.call_id:
                attrs[semconv.GEN_AI_TOOL_CALL_ID] = self.call_id
            if self.arguments is not None:
                attrs[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = span_text(self.arguments, _spaced)
            self._span = collector.tracer().start_span(semconv.tool_span_name(self.name), attributes=attrs)
            self._token = context.attach(trace.set_span_in_context(self._span))
        except Exception as exc:  # noqa: BLE001
            report("tool_call enter", exc)
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._span is None:
            return
        try:
            from opentelemetry import context
            from opentelemetry.trace import Status, StatusCode

            span = self._span
            if exc is not None:
                timeout = isinstance(exc, TimeoutError)
                self.status = semconv.TOOL_TIMEOUT if timeout else semconv.TOOL_EXCEPTION
                span.record_exception(exc)
                span.set_attribute(semconv.ERROR_TYPE, type(exc).__name__)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            elif self.status != semconv.TOOL_OK:
                span.set_attribute(semconv.ERROR_TYPE, "tool_error" if self.status == semconv.TOOL_ERROR else "timeout")
                span.set_status(Status(StatusCode.ERROR, str(self.result or self.status)))
            if self.result is not None:
                set_on(span, {semconv.GEN_AI_TOOL_CALL_RESULT: span_text(self.result, _spaced)})  # redacts
            span.set_attribute(semconv.AGL_TOOL_STATUS, self.status)
            span.end()
            context.detach(self._token)
        except Exception as err:  # noqa: BLE001
            report("tool_call exit", err)


def tool_call(name: str, *, call_id: str | None = None, arguments: Any = None) -> ToolCall:
    """Record one tool execution as an ``execute_tool`` span (see the module docstring)."""
    return ToolCall(name, call_id, arguments)


def pause(span: Any, tool: str | None) -> None:
    """Make the open ``execute_tool`` span of a call that paused for a decision (an approval request, LangGraph's
    ``interrupt()``) the pause it is: ``tool_pause {tool}``, ``agl.tool.status`` pending, no error. A pause is not
    an outcome: the call's outcome is the span of the run that follows the decision (the resumed run's
    ``execute_tool`` of the same call id, or its rejection)."""
    span.update_name(semconv.tool_pause_span_name(tool))
    span.set_attribute(semconv.GEN_AI_OPERATION_NAME, semconv.OP_TOOL_PAUSE)
    span.set_attribute(semconv.AGL_TOOL_STATUS, semconv.TOOL_PENDING)


def reject(span: Any, message: str | None = None) -> None:
    """Mark the open ``execute_tool`` span of a call that was refused before it ran (a "no" to its approval
    request): ``agl.tool.status`` rejected, error status with ``error.type`` rejected."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute(semconv.AGL_TOOL_STATUS, semconv.TOOL_REJECTED)
    span.set_attribute(semconv.ERROR_TYPE, semconv.TOOL_REJECTED)
    span.set_status(Status(StatusCode.ERROR, message or "tool call rejected"))
