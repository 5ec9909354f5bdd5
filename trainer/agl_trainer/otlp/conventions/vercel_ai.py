"""The Vercel AI SDK's telemetry (``experimental_telemetry: {isEnabled: true}``, attributes ``ai.*``) -> agl.

Each span names its step in ``ai.operationId``. The model calls are ``ai.generateText.doGenerate`` and
``ai.streamText.doStream`` (and the ``generateObject`` / ``streamObject`` pair): the prompt as sent is
``ai.prompt.messages`` (JSON, the SDK's own message format: content parts ``text``, ``tool-call``,
``tool-result``), the answer ``ai.response.text`` with ``ai.response.toolCalls`` (JSON) and
``ai.response.finishReason``, the tools ``ai.prompt.tools`` (one JSON text per tool), the model
``ai.model.id``. A tool call is ``ai.toolCall`` (``ai.toolCall.name``, ``.id``, ``.args`` or ``.input``,
``.result`` or ``.output``); the outer ``ai.generateText`` / ``ai.streamText`` span is the agent, named by
``ai.telemetry.functionId`` when the app gives one.
"""

from __future__ import annotations

from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_trainer.otlp.conventions.flattened import json_or, message_attributes, text_of

__all__ = ["NAME", "attributes", "detect"]

NAME = "vercel_ai"

_CALLS = ("ai.generateText.doGenerate", "ai.streamText.doStream", "ai.generateObject.doGenerate",
          "ai.streamObject.doStream")
_RUNS = ("ai.generateText", "ai.streamText", "ai.generateObject", "ai.streamObject")


def detect(span: Span, scope: str) -> bool:
    return "ai.operationId" in span.attributes


def attributes(span: Span) -> dict[str, Any]:
    a = span.attributes
    operation = a.get("ai.operationId")
    if operation in _CALLS:
        return _llm(a)
    if operation == "ai.toolCall":
        out: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
                               semconv.GEN_AI_TOOL_NAME: str(a.get("ai.toolCall.name") or span.name)}
        if a.get("ai.toolCall.id"):
            out[semconv.GEN_AI_TOOL_CALL_ID] = str(a["ai.toolCall.id"])
        for key, ours in (("args", semconv.GEN_AI_TOOL_CALL_ARGUMENTS), ("input", semconv.GEN_AI_TOOL_CALL_ARGUMENTS),
                          ("result", semconv.GEN_AI_TOOL_CALL_RESULT), ("output", semconv.GEN_AI_TOOL_CALL_RESULT)):
            if a.get(f"ai.toolCall.{key}") is not None:
                out[ours] = text_of(a[f"ai.toolCall.{key}"])
        return out
    if operation in _RUNS and a.get("ai.telemetry.functionId"):
        return {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
                semconv.GEN_AI_AGENT_NAME: str(a["ai.telemetry.functionId"])}
    return {}


def _llm(a: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT}
    model = a.get("ai.response.model") or a.get("ai.model.id")
    if a.get("ai.model.id"):
        out[semconv.GEN_AI_REQUEST_MODEL] = a["ai.model.id"]
    if model:
        out[semconv.GEN_AI_RESPONSE_MODEL] = model
    if a.get("ai.model.provider"):
        out[semconv.GEN_AI_PROVIDER_NAME] = a["ai.model.provider"]
    for theirs, ours in (("ai.usage.inputTokens", semconv.GEN_AI_USAGE_INPUT_TOKENS),
                         ("ai.usage.promptTokens", semconv.GEN_AI_USAGE_INPUT_TOKENS),
                         ("ai.usage.outputTokens", semconv.GEN_AI_USAGE_OUTPUT_TOKENS),
                         ("ai.usage.completionTokens", semconv.GEN_AI_USAGE_OUTPUT_TOKENS)):
        if isinstance(a.get(theirs), int):
            out[ours] = a[theirs]
    raw = json_or(a.get("ai.prompt.messages"))
    prompt = [m for message in raw for m in _messages(message)] if isinstance(raw, list) else None
    response: list[dict[str, Any]] | None = None
    if "ai.response.text" in a or "ai.response.toolCalls" in a or "ai.response.object" in a:
        text = a.get("ai.response.text", a.get("ai.response.object"))
        reply: dict[str, Any] = {"role": "assistant", "content": text_of(text) if text is not None else None}
        calls = json_or(a.get("ai.response.toolCalls"))
        if isinstance(calls, list) and calls:
            reply["tool_calls"] = [_call(c) for c in calls if isinstance(c, dict)]
        response = [reply]
    tools = [json_or(t) for t in a.get("ai.prompt.tools") or []]
    finish = a.get("ai.response.finishReason")
    out.update(message_attributes(prompt, response, str(finish) if finish else None,
                                  [_tool(t) for t in tools if isinstance(t, dict)] or None))
    return out


def _call(c: dict[str, Any]) -> dict[str, Any]:
    args = c.get("input", c.get("args", ""))
    return {"id": c.get("toolCallId"), "type": "function",
            "function": {"name": c.get("toolName"), "arguments": text_of(args)}}


def _tool(t: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                             "parameters": t.get("inputSchema", t.get("parameters"))}}


def _messages(m: Any) -> list[dict[str, Any]]:
    """One AI SDK message as OpenAI chat messages (its tool results are one message per result)."""
    if not isinstance(m, dict):
        return []
    role, content = m.get("role") or "user", m.get("content")
    if isinstance(content, str) or content is None:
        return [{"role": role, "content": content}]
    if role == "tool":
        return [{"role": "tool", "tool_call_id": p.get("toolCallId"), "content": _result(p)}
                for p in content if isinstance(p, dict) and p.get("type") == "tool-result"]
    texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    calls = [_call(p) for p in content if isinstance(p, dict) and p.get("type") == "tool-call"]
    out: dict[str, Any] = {"role": role}
    if role == "assistant":
        out["content"] = "".join(texts) if texts else None
    else:
        out["content"] = [{"type": "text", "text": t} for t in texts] if len(texts) != 1 else texts[0]
    if calls:
        out["tool_calls"] = calls
    return [out]


def _result(part: dict[str, Any]) -> str:
    output = part.get("output", part.get("result"))
    if isinstance(output, dict) and output.get("type") in ("text", "json") and "value" in output:
        output = output["value"]  # AI SDK 5's typed tool output
    return text_of(output)
