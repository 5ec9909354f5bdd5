"""OpenAI chat messages <-> the GenAI semantic conventions' message parts.

Spans carry messages in the conventions' format (``{"role", "parts": [...]}``) so
any OpenTelemetry GenAI backend renders them; transitions carry OpenAI-format
messages because that is what chat templates and trainers consume. Both
directions keep tool-call ids and the model's raw argument strings, which the
trainer needs to reproduce the exact tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

Message = dict[str, Any]

_AS_PARTS = "agl.content_parts"
"""Set on a conventions-format message whose content was sent as a one-text-part list, which the
parts format alone cannot tell from a plain string; ``from_genai`` gives the list back."""


def as_dict(obj: Any) -> dict[str, Any]:
    """A framework message object (dict, pydantic model, attrs-like) as a plain dict."""
    if isinstance(obj, dict):
        return obj
    dump = getattr(obj, "model_dump", None)
    if dump is not None:
        result: dict[str, Any] = dump(exclude_none=True)
        return result
    if isinstance(obj, Mapping):
        return dict(obj)
    return {"role": "user", "content": str(obj)}


def _content_parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    parts: list[dict[str, Any]] = []
    for raw in content:
        part = as_dict(raw)
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "content": part.get("text", "")})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append({"type": "uri", "modality": "image", "uri": url})
        elif kind == "input_audio":
            audio = part.get("input_audio") or {}
            parts.append({"type": "blob", "modality": "audio", "mime_type": f"audio/{audio.get('format', '')}",
                          "content": audio.get("data")})
        elif kind == "refusal":
            parts.append({"type": "refusal", "content": part.get("refusal", "")})
        else:
            parts.append(dict(part))
    return parts


_PLAIN_KEYS = frozenset({"role", "content", "tool_calls", "reasoning_content", "tool_call_id", "name"})


def _plain_to_genai(msg: dict[str, Any], finish_reason: str | None) -> dict[str, Any] | None:
    """``to_genai`` for a dict with text (or no) content and dict tool calls; None for any other shape.

    Every plugin converts each new message of a call on the call's path, and nearly all of them are
    this shape: the same parts the general conversion below gives, with fewer steps.
    """
    role = msg.get("role") or "user"
    content = msg.get("content")
    parts: list[dict[str, Any]]
    if role == "tool":
        parts = [{"type": "tool_call_response", "id": msg.get("tool_call_id"), "response": content}]
    elif content is None:
        parts = []
    elif type(content) is str:
        parts = [{"type": "text", "content": content}]
    else:
        return None
    reasoning = msg.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        parts.insert(0, {"type": "reasoning", "content": reasoning})
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") if type(call) is dict else None
        if type(fn) is not dict:
            return None
        parts.append({"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
                      "arguments": fn.get("arguments")})
    out: dict[str, Any] = {"role": role, "parts": parts}
    if msg.get("name"):
        out["name"] = msg["name"]
    if finish_reason is not None:
        out["finish_reason"] = finish_reason
    return out


def to_genai(message: Any, finish_reason: str | None = None) -> dict[str, Any]:
    """One OpenAI chat message (dict or SDK object) in the conventions' parts format."""
    if type(message) is dict and message.keys() <= _PLAIN_KEYS:
        plain = _plain_to_genai(message, finish_reason)
        if plain is not None:
            return plain
    msg = as_dict(message)
    role = msg.get("role") or "user"
    one_text_listed = False
    if role == "tool":
        parts: list[dict[str, Any]] = [
            {"type": "tool_call_response", "id": msg.get("tool_call_id"), "response": msg.get("content")}
        ]
    else:
        content = msg.get("content")
        parts = _content_parts(content)
        one_text_listed = isinstance(content, list) and len(parts) == 1 and parts[0].get("type") == "text"
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        parts.insert(0, {"type": "reasoning", "content": reasoning})
    for call in msg.get("tool_calls") or ():
        call = as_dict(call)
        fn = as_dict(call.get("function") or {})
        parts.append({"type": "tool_call", "id": call.get("id"), "name": fn.get("name"),
                      "arguments": fn.get("arguments")})
    legacy = msg.get("function_call")
    if legacy:
        fn = as_dict(legacy)
        parts.append({"type": "tool_call", "id": None, "name": fn.get("name"), "arguments": fn.get("arguments")})
    out: dict[str, Any] = {"role": role, "parts": parts}
    if one_text_listed:
        out[_AS_PARTS] = True
    if msg.get("name"):
        out["name"] = msg["name"]
    if finish_reason is not None:
        out["finish_reason"] = finish_reason
    return out


def many_to_genai(messages: Iterable[Any]) -> list[dict[str, Any]]:
    return [to_genai(m) for m in messages]


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tool_content(response: Any) -> Any:
    """A tool message's content as sent: a string, or the list of content parts it was (MCP results);
    only a framework's structured result that was never chat content (a dict) becomes JSON text."""
    if response is None or isinstance(response, str):
        return response
    if isinstance(response, list) and all(isinstance(p, dict) and "type" in p for p in response):
        return response
    return _as_text(response)


def from_genai(message: Mapping[str, Any]) -> Message:
    """One conventions-format message back as an OpenAI chat message."""
    role = message.get("role") or "user"
    parts = message.get("parts") or []
    out: Message = {"role": role}
    if role == "tool":
        response = next((p for p in parts if p.get("type") == "tool_call_response"), None)
        if response is not None:
            out["tool_call_id"] = response.get("id")
            out["content"] = _tool_content(response.get("response"))
            if message.get("name"):
                out["name"] = message["name"]
            return out
    content: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type")
        if kind == "text":
            content.append({"type": "text", "text": part.get("content", "")})
        elif kind == "tool_call":
            calls.append({"id": part.get("id"), "type": "function",
                          "function": {"name": part.get("name"), "arguments": _as_text(part.get("arguments"))}})
        elif kind == "reasoning":
            out["reasoning_content"] = part.get("content")
        elif kind == "uri" and part.get("modality") == "image":
            content.append({"type": "image_url", "image_url": {"url": part.get("uri")}})
        elif kind == "refusal":
            out["refusal"] = part.get("content")
        else:
            content.append(dict(part))
    if len(content) == 1 and content[0].get("type") == "text" and not message.get(_AS_PARTS):
        out["content"] = content[0]["text"]
    elif content:
        out["content"] = content
    else:
        out["content"] = None if calls else ""
    if calls:
        out["tool_calls"] = calls
    if message.get("name"):
        out["name"] = message["name"]
    return out


def many_from_genai(messages: Iterable[Mapping[str, Any]]) -> list[Message]:
    return [from_genai(m) for m in messages]
