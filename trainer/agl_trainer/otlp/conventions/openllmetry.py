"""OpenLLMetry (Traceloop: ``opentelemetry-instrumentation-openai`` and its siblings, the Traceloop SDK) -> agl.

An LLM span (``llm.request.type`` ``chat`` or ``completion``) flattens its messages into
``gen_ai.prompt.N.role`` / ``.content`` / ``.tool_calls.K.{id,name,arguments}`` / ``.tool_call_id`` and
``gen_ai.completion.N.role`` / ``.content`` / ``.finish_reason`` / ``.tool_calls.K.*``; its tools are
``llm.request.functions.N.{name,description,parameters}``. The Traceloop SDK's own spans
(``traceloop.span.kind``: ``workflow``, ``task``, ``agent``, ``tool``) name their entity in
``traceloop.entity.name`` and hold its input and output in ``traceloop.entity.input`` / ``.output``.
"""

from __future__ import annotations

from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_trainer.otlp.conventions import genai
from agl_trainer.otlp.conventions.flattened import indexed, json_or, message_attributes, text_of

__all__ = ["NAME", "attributes", "detect"]

NAME = "openllmetry"

_PROMPT, _COMPLETION = "gen_ai.prompt", "gen_ai.completion"


# the scopes of OpenLLMetry's instrumentors that write the GenAI form (the contrib project's own are ``*_v2``)
_SCOPES = ("opentelemetry.instrumentation.openai.v1", "opentelemetry.instrumentation.anthropic",
           "opentelemetry.instrumentation.langchain", "opentelemetry.instrumentation.bedrock")


def detect(span: Span, scope: str) -> bool:
    a = span.attributes
    return (scope in _SCOPES or "llm.request.type" in a or "traceloop.span.kind" in a
            or any(k.startswith(("gen_ai.prompt.", "gen_ai.completion.", "traceloop.")) for k in a))


def attributes(span: Span) -> dict[str, Any]:
    a = span.attributes
    kind = a.get("traceloop.span.kind")
    if a.get(semconv.GEN_AI_INPUT_MESSAGES) is not None or a.get(semconv.GEN_AI_OUTPUT_MESSAGES) is not None:
        return genai.attributes(span)  # releases from 0.50 on write the GenAI attribute form
    if a.get("llm.request.type") in ("chat", "completion") or any(k.startswith(_PROMPT + ".") for k in a):
        return _llm(a)
    name = str(a.get("traceloop.entity.name") or span.name)
    if kind == "agent":
        return {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: name}
    if kind == "tool":
        out: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
                               semconv.GEN_AI_TOOL_NAME: name}
        if a.get("traceloop.entity.input") is not None:
            out[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = text_of(a["traceloop.entity.input"])
        if a.get("traceloop.entity.output") is not None:
            out[semconv.GEN_AI_TOOL_CALL_RESULT] = text_of(a["traceloop.entity.output"])
        return out
    return {}


def _llm(a: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT if a.get("llm.request.type") != "completion"
                           else semconv.OP_TEXT_COMPLETION}
    for old, new in (("gen_ai.usage.prompt_tokens", semconv.GEN_AI_USAGE_INPUT_TOKENS),
                     ("gen_ai.usage.completion_tokens", semconv.GEN_AI_USAGE_OUTPUT_TOKENS)):
        if isinstance(a.get(old), int) and new not in a:
            out[new] = a[old]
    if semconv.GEN_AI_PROVIDER_NAME not in a and a.get(semconv.GEN_AI_SYSTEM):
        out[semconv.GEN_AI_PROVIDER_NAME] = a[semconv.GEN_AI_SYSTEM]
    prompt = [_message(m) for m in indexed(a, _PROMPT)]
    completions = indexed(a, _COMPLETION)
    response = [_message(m) for m in completions[:1]]
    finish = completions[0].get("finish_reason") if completions else None
    tools = [{"type": "function", "function": {k: json_or(v) for k, v in f.items()}}
             for f in indexed(a, "llm.request.functions")]
    out.update(message_attributes(prompt or None, response or None, str(finish) if finish else None,
                                  tools or None))
    return out


def _message(m: dict[str, Any]) -> dict[str, Any]:
    role = m.get("role") or "user"
    out: dict[str, Any] = {"role": role, "content": _content(m.get("content"))}
    calls = [{"id": c.get("id"), "type": "function",
              "function": {"name": c.get("name"), "arguments": text_of(c.get("arguments", ""))}}
             for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        out["tool_calls"] = calls
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _content(content: Any) -> Any:
    """A message's content: a string, or content parts the instrumentor wrote as JSON text."""
    parsed = json_or(content)
    if isinstance(parsed, list) and all(isinstance(p, dict) and "type" in p for p in parsed):
        return parsed
    return content
