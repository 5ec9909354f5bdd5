"""``to_genai``'s short way for plain-dict messages gives what its general conversion gives."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agl_core.messages import to_genai


@pytest.mark.parametrize("msg", [
    {"role": "user", "content": "hi"},
    {"role": "system", "content": "be brief", "name": "rules"},
    {"role": "user", "content": None},
    {"role": "", "content": "no role"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
    {"role": "assistant", "content": "sure", "reasoning_content": "think", "name": "bot",
     "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "assistant", "content": "x", "reasoning_content": ""},
    {"role": "assistant", "content": None, "tool_calls": []},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": None}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}], "name": "calc"},
    {"role": "user", "content": [{"type": "text", "text": "one part"}]},
    {"role": "user", "content": "hi", "reasoning": "legacy key: the general path"},
])
@pytest.mark.parametrize("finish", [None, "stop"])
def test_the_short_conversion_of_a_plain_dict_is_the_general_one(msg: dict[str, Any], finish: str | None) -> None:
    """``to_genai`` takes a short way for plain dicts (every plugin's own messages): same parts, same key order."""
    import types

    general = to_genai(types.MappingProxyType(msg), finish)  # not a dict: the general conversion
    short = to_genai(msg, finish)
    assert short == general and list(short) == list(general)
    assert json.dumps(short) == json.dumps(general)
