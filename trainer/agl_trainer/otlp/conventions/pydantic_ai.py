"""Pydantic AI's own instrumentation (``Agent.instrument_all()``, ``agent.instrument = True``, Logfire) -> agl.

Its spans (scope ``pydantic-ai``) are GenAI spans (``chat {model}``, ``execute_tool {tool}``,
``invoke_agent {agent}``, with ``gen_ai.agent.name`` on every one) and its messages are in the parts
format, with three differences from agl's reading of it, mapped here: the system prompt is apart in
``gen_ai.system_instructions``; a tool's result is a ``tool_call_response`` part with ``result`` inside
the *user* message that returns it (OpenAI sends it as a ``tool`` message); the model's reasoning is a
``thinking`` part. Its instrumentation version 2 (``InstrumentationSettings(version=2)``) names a tool's span
``running tool`` with no operation and its arguments and result ``tool_arguments`` / ``tool_response``, and the
agent's span ``agent run`` with ``agent_name``; versions 3 to 6 use the GenAI names.
"""

from __future__ import annotations

import json
from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_trainer.otlp.conventions import genai
from agl_trainer.otlp.conventions.flattened import json_or, text_of

__all__ = ["NAME", "attributes", "detect"]

NAME = "pydantic_ai"

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def detect(span: Span, scope: str) -> bool:
    return scope == "pydantic-ai" or "pydantic_ai.all_messages" in span.attributes


def attributes(span: Span) -> dict[str, Any]:
    a = span.attributes
    operation = a.get(semconv.GEN_AI_OPERATION_NAME)
    if operation == semconv.OP_EXECUTE_TOOL or (operation is None and semconv.GEN_AI_TOOL_NAME in a):
        out: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL}  # version 2: "running tool"
        # instrumentation versions before 3 named the arguments and result their own way
        for old, new in (("tool_arguments", semconv.GEN_AI_TOOL_CALL_ARGUMENTS),
                         ("tool_response", semconv.GEN_AI_TOOL_CALL_RESULT)):
            if a.get(old) is not None and new not in a:
                out[new] = text_of(a[old])
        return out
    if operation == semconv.OP_INVOKE_AGENT or (operation is None and a.get("agent_name")):
        return {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
                semconv.GEN_AI_AGENT_NAME: str(a.get(semconv.GEN_AI_AGENT_NAME) or a.get("agent_name"))}
    out = genai.attributes(span)
    for key in (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES):
        messages = json_or(out.get(key, a.get(key)))
        if isinstance(messages, list):
            out[key] = _dumps([m for message in messages for m in _as_agl(message)])
    return out


def _as_agl(message: Any) -> list[dict[str, Any]]:
    """One Pydantic AI message in agl's parts format: tool results split out as ``tool`` messages."""
    if not isinstance(message, dict):
        return []
    parts = [_part(p) for p in message.get("parts") or [] if isinstance(p, dict)]
    results = [p for p in parts if p.get("type") == "tool_call_response"]
    rest = [p for p in parts if p.get("type") != "tool_call_response"]
    out = [{"role": "tool", "parts": [p]} for p in results]
    if rest or not results:
        out.append({**message, "parts": rest})
    return out


def _part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") == "tool_call_response":
        return {"type": "tool_call_response", "id": part.get("id"),
                "response": part.get("response", part.get("result"))}
    if part.get("type") == "thinking":
        return {"type": "reasoning", "content": part.get("content", "")}
    return part
