"""The OpenTelemetry GenAI semantic conventions (``gen_ai.*``, as agl writes them) -> agl, in both their forms.

The attribute form is agl's own: ``gen_ai.operation.name`` with ``gen_ai.input.messages`` /
``gen_ai.output.messages`` as JSON in the parts format (``opentelemetry-instrumentation-openai-v2`` with
``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``, agl's plugins, Microsoft Agent Framework);
``gen_ai.system_instructions``, when the instrumentation keeps the system prompt apart, becomes the first
prompt message. The event forms put the messages on span events instead:

- ``gen_ai.client.inference.operation.details`` (the current conventions): the same two attributes;
- one event per message (conventions 1.28 to 1.36): ``gen_ai.system.message``, ``gen_ai.user.message``,
  ``gen_ai.assistant.message``, ``gen_ai.tool.message`` (``content``, ``tool_calls``, ``id``) and
  ``gen_ai.choice`` (``message``, ``finish_reason``);
- ``gen_ai.content.prompt`` / ``gen_ai.content.completion`` (1.26 and 1.27): ``gen_ai.prompt`` /
  ``gen_ai.completion`` hold the OpenAI-format messages as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_trainer.otlp.conventions.flattened import json_or, message_attributes, text_of

__all__ = ["NAME", "attributes", "detect"]

NAME = "genai"

_DETAILS = "gen_ai.client.inference.operation.details"
_MESSAGE_EVENTS = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                   "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def detect(span: Span, scope: str) -> bool:
    return semconv.GEN_AI_OPERATION_NAME in span.attributes


def attributes(span: Span) -> dict[str, Any]:
    a = span.attributes
    if a.get(semconv.GEN_AI_OPERATION_NAME) not in semconv.LLM_OPERATIONS:
        return {}
    out: dict[str, Any] = {}
    if semconv.GEN_AI_PROVIDER_NAME not in a and a.get(semconv.GEN_AI_SYSTEM):
        out[semconv.GEN_AI_PROVIDER_NAME] = a[semconv.GEN_AI_SYSTEM]
    for event in span.events:
        if event.get("name") == _DETAILS:
            for key in (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES,
                        semconv.GEN_AI_SYSTEM_INSTRUCTIONS):
                if key in event.get("attributes", {}) and key not in a:
                    out[key] = text_of(event["attributes"][key])
    if semconv.GEN_AI_INPUT_MESSAGES not in a and semconv.GEN_AI_INPUT_MESSAGES not in out:
        out.update(_from_message_events(span))
    instructions = out.get(semconv.GEN_AI_SYSTEM_INSTRUCTIONS, a.get(semconv.GEN_AI_SYSTEM_INSTRUCTIONS))
    prompt = json_or(out.get(semconv.GEN_AI_INPUT_MESSAGES, a.get(semconv.GEN_AI_INPUT_MESSAGES)))
    if instructions is not None and isinstance(prompt, list) \
            and not any(isinstance(m, dict) and m.get("role") == "system" for m in prompt):
        parts = json_or(instructions)
        parts = parts if isinstance(parts, list) else [{"type": "text", "content": str(parts)}]
        out[semconv.GEN_AI_INPUT_MESSAGES] = _dumps([{"role": "system", "parts": parts}, *prompt])
    tools = json_or(a.get(semconv.GEN_AI_TOOL_DEFINITIONS))
    if isinstance(tools, list) and any(isinstance(t, dict) and "function" not in t and "name" in t for t in tools):
        out[semconv.GEN_AI_TOOL_DEFINITIONS] = _dumps([_openai_tool(t) for t in tools])
    return out


def _openai_tool(tool: Any) -> Any:
    """A flat tool definition (``{"type", "name", "parameters"}``, as the conventions' examples write it) in
    the OpenAI request's shape, which a chat template reads."""
    if not isinstance(tool, dict) or "function" in tool or "name" not in tool:
        return tool
    function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")}
    return {"type": tool.get("type") or "function", "function": function}


def _from_message_events(span: Span) -> dict[str, Any]:
    prompt: list[dict[str, Any]] = []
    response: list[dict[str, Any]] = []
    finish: str | None = None
    for event in span.events:
        name, attrs = event.get("name"), event.get("attributes") or {}
        if name in _MESSAGE_EVENTS:
            prompt.append(_message(attrs, _MESSAGE_EVENTS[name]))
        elif name == "gen_ai.choice":
            message = json_or(attrs.get("message"))
            response.append(_message(message if isinstance(message, dict) else attrs, "assistant"))
            finish = finish or attrs.get("finish_reason")
        elif name == "gen_ai.content.prompt":
            listed = json_or(attrs.get("gen_ai.prompt"))
            if isinstance(listed, list):
                prompt.extend(m for m in listed if isinstance(m, dict))
        elif name == "gen_ai.content.completion":
            listed = json_or(attrs.get("gen_ai.completion"))
            if isinstance(listed, list):
                response.extend(m for m in listed if isinstance(m, dict))
                finish = finish or next((m.get("finish_reason") for m in listed if isinstance(m, dict)), None)
    if not prompt and not response:
        return {}
    return message_attributes(prompt or None, response or None, str(finish) if finish else None)


def _message(attrs: dict[str, Any], role: str) -> dict[str, Any]:
    out: dict[str, Any] = {"role": attrs.get("role") or role, "content": json_or(attrs.get("content"))}
    if isinstance(out["content"], (dict, int, float)):
        out["content"] = text_of(out["content"])
    calls = json_or(attrs.get("tool_calls"))
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": (c.get("function") or {}).get("name"),
                                           "arguments": text_of((c.get("function") or {}).get("arguments", ""))}}
                             for c in calls if isinstance(c, dict)]
    if out["role"] == "tool" and attrs.get("id"):
        out["tool_call_id"] = attrs["id"]
    return out
