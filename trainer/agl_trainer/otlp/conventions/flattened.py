"""Reading flattened attributes (``prefix.0.role``, ``prefix.0.tool_calls.1.name``) back into lists of dicts,
and writing agl's message attributes: what the conventions that flatten (OpenInference, OpenLLMetry) share."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from agl_core import semconv
from agl_core.messages import to_genai

__all__ = ["indexed", "json_or", "message_attributes", "text_of"]

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def indexed(attrs: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """``{prefix.0.a: 1, prefix.0.b.0.c: 2, prefix.1.a: 3}`` -> ``[{"a": 1, "b": [{"c": 2}]}, {"a": 3}]``."""
    head = prefix + "."
    tree: dict[int, Any] = {}
    for key, value in attrs.items():
        if key.startswith(head):
            _put(tree, key[len(head):].split("."), value)
    return _listed(tree)


def _put(node: dict[Any, Any], path: list[str], value: Any) -> None:
    first, *rest = path
    key: Any = int(first) if first.isascii() and first.isdigit() else first
    if not rest:
        node[key] = value
        return
    child = node.setdefault(key, {})
    if isinstance(child, dict):
        _put(child, rest, value)


def _listed(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        return [_listed(node[k]) for k in sorted(node)]
    return {k: _listed(v) for k, v in node.items()}


def json_or(value: Any) -> Any:
    """A JSON-text attribute decoded, or the value as it is when it is not JSON."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def text_of(value: Any) -> str:
    return value if isinstance(value, str) else _dumps(value)


def message_attributes(prompt: Iterable[Mapping[str, Any]] | None, response: Iterable[Mapping[str, Any]] | None,
                       finish_reason: str | None = None, tools: list[Any] | None = None) -> dict[str, Any]:
    """agl's LLM-call message attributes from OpenAI-format messages (None: that side was not recorded)."""
    out: dict[str, Any] = {}
    if prompt is not None:
        out[semconv.GEN_AI_INPUT_MESSAGES] = _dumps([to_genai(dict(m)) for m in prompt])
    if response is not None:
        listed = list(response)
        if listed:
            out[semconv.GEN_AI_OUTPUT_MESSAGES] = _dumps(
                [to_genai(dict(m), finish_reason if i == 0 else None) for i, m in enumerate(listed)])
    if tools:
        out[semconv.GEN_AI_TOOL_DEFINITIONS] = _dumps(tools)
    return out
