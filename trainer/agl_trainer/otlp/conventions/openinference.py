"""OpenInference (Arize: ``openinference-instrumentation-*``, Phoenix) -> agl.

Its spans say what they are in ``openinference.span.kind`` (``LLM``, ``TOOL``, ``AGENT``, ``CHAIN``, ...).
An LLM span flattens its messages: ``llm.input_messages.N.message.role`` / ``.content`` /
``.contents.M.message_content.text`` / ``.tool_calls.K.tool_call.function.name`` (and ``.arguments``,
``.id``) / ``.tool_call_id``, the same under ``llm.output_messages``; the model is ``llm.model_name``,
the tools ``llm.tools.N.tool.json_schema``. A TOOL span has ``tool.name``, ``tool_call.id`` and its
input and output in ``input.value`` / ``output.value``; an AGENT span names the agent in ``agent.name``
(or its span name). LangGraph's node spans (CHAIN, ``metadata.langgraph_node``) stay chains.
"""

from __future__ import annotations

from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_trainer.otlp.conventions.flattened import indexed, json_or, message_attributes, text_of

__all__ = ["NAME", "attributes", "detect"]

NAME = "openinference"

_KIND = "openinference.span.kind"


def detect(span: Span, scope: str) -> bool:
    return _KIND in span.attributes or scope.startswith("openinference.")


def attributes(span: Span) -> dict[str, Any]:
    a = span.attributes
    kind = str(a.get(_KIND, "")).upper()
    out: dict[str, Any] = {}
    if kind == "LLM":
        out = _llm(a)
    elif kind == "TOOL":
        out = _tool(span)
    elif kind == "AGENT":
        out = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
               semconv.GEN_AI_AGENT_NAME: str(a.get("agent.name") or span.name)}
    agent = a.get("agent.name") or _metadata(a).get("lc_agent_name")  # LangChain's create_agent(name=...)
    if agent and semconv.GEN_AI_AGENT_NAME not in out:
        out[semconv.GEN_AI_AGENT_NAME] = str(agent)
    return out


def _metadata(a: dict[str, Any]) -> dict[str, Any]:
    metadata = json_or(a.get("metadata"))
    return metadata if isinstance(metadata, dict) else {}


def _llm(a: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT}
    model = a.get("llm.model_name")
    if model:
        out[semconv.GEN_AI_REQUEST_MODEL] = model
        out[semconv.GEN_AI_RESPONSE_MODEL] = model
    provider = a.get("llm.provider") or a.get("llm.system")
    if provider:
        out[semconv.GEN_AI_PROVIDER_NAME] = provider
    for theirs, ours in (("llm.token_count.prompt", semconv.GEN_AI_USAGE_INPUT_TOKENS),
                         ("llm.token_count.completion", semconv.GEN_AI_USAGE_OUTPUT_TOKENS)):
        if isinstance(a.get(theirs), int):
            out[ours] = a[theirs]
    prompt = [_message(m.get("message", {})) for m in indexed(a, "llm.input_messages")]
    response = [_message(m.get("message", {})) for m in indexed(a, "llm.output_messages")]
    tools = [json_or(t.get("tool", {}).get("json_schema")) for t in indexed(a, "llm.tools")]
    out.update(message_attributes(prompt or None, response or None,
                                  tools=[t for t in tools if isinstance(t, dict)] or None))
    return out


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.get("role") or "user"}
    if "content" in m:
        out["content"] = m["content"]
    elif m.get("contents"):
        parts = [c.get("message_content", {}) for c in m["contents"]]
        out["content"] = [{"type": "text", "text": p.get("text", "")} if p.get("type", "text") == "text"
                          else {"type": "image_url", "image_url": {"url": p.get("image", {}).get("image", {})
                                                                     .get("url")}}
                          for p in parts]
    else:
        out["content"] = None
    calls = []
    for call in m.get("tool_calls") or []:
        c = call.get("tool_call", {})
        fn = c.get("function", {})
        calls.append({"id": c.get("id"), "type": "function",
                      "function": {"name": fn.get("name"), "arguments": text_of(fn.get("arguments", ""))}})
    if calls:
        out["tool_calls"] = calls
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    if m.get("name") and out["role"] != "tool":
        out["name"] = m["name"]
    return out


def _tool(span: Span) -> dict[str, Any]:
    a = span.attributes
    out: dict[str, Any] = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
                           semconv.GEN_AI_TOOL_NAME: str(a.get("tool.name") or span.name)}
    result = a.get("output.value")
    # LangChain's instrumentor records the ToolMessage the tool became: its call id and content are inside
    message = json_or(result)
    data = message.get("data") if isinstance(message, dict) and message.get("type") == "tool" else None
    if not isinstance(data, dict):
        data = {}
    call_id = a.get("tool_call.id") or a.get("tool.id") or data.get("tool_call_id")
    if call_id:
        out[semconv.GEN_AI_TOOL_CALL_ID] = str(call_id)
    if "content" in data:
        result = data["content"]
        if data.get("status") == "error":
            out[semconv.AGL_TOOL_STATUS] = semconv.TOOL_ERROR
    args = a.get("tool.parameters") if a.get("input.value") is None else a.get("input.value")
    if args is not None:
        out[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] = text_of(args)
    if result is not None:
        out[semconv.GEN_AI_TOOL_CALL_RESULT] = text_of(result)
    return out
