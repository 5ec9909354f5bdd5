"""The fake OpenAI-compatible server that the plugin tests, demo and benchmarks run against."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

import agl_core.testing
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(agl_core.testing.__file__))))


def _python(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": _SRC, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _client(srv: FakeOpenAI) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)


def test_default_reply_echoes_the_last_user_message() -> None:
    with FakeOpenAI() as srv:
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": "be brief"}, *USER]
        response = _client(srv).chat.completions.create(model="m", messages=messages)
    assert response.choices[0].message.content == "hello there"
    assert response.choices[0].finish_reason == "stop"
    assert response.usage is not None and response.usage.prompt_tokens == len(tokenize(render_prompt(messages)))


def test_script_is_consumed_in_order_then_echoes() -> None:
    with FakeOpenAI(script=["one", "two"]) as srv:
        client = _client(srv)
        replies = [client.chat.completions.create(model="m", messages=USER).choices[0].message.content
                   for _ in range(3)]
    assert replies == ["one", "two", "hello there"]


def test_callable_script_sees_the_request() -> None:
    def reply(request: dict[str, Any]) -> str:
        return f"{request['model']} got {len(request['messages'])} message(s)"

    with FakeOpenAI(script=reply) as srv:
        response = _client(srv).chat.completions.create(model="m", messages=USER)
    assert response.choices[0].message.content == "m got 1 message(s)"


def test_tool_call_reply() -> None:
    with FakeOpenAI(script=[{"tool_calls": [{"name": "f", "arguments": {"x": 1}}]}]) as srv:
        response = _client(srv).chat.completions.create(model="m", messages=USER)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "f" and json.loads(call.function.arguments) == {"x": 1}


def test_token_ids_and_logprobs_only_when_asked() -> None:
    with FakeOpenAI(script=["a b c", "a b c"]) as srv:
        client = _client(srv)
        plain = client.chat.completions.create(model="m", messages=USER)
        rich = client.chat.completions.create(model="m", messages=USER, logprobs=True,
                                              extra_body={"return_token_ids": True})
    assert not plain.model_extra and not plain.choices[0].model_extra and plain.choices[0].logprobs is None
    assert rich.model_extra == {"prompt_token_ids": tokenize(render_prompt(USER))}
    assert rich.choices[0].model_extra == {"token_ids": tokenize("a b c")}
    assert rich.choices[0].logprobs is not None and rich.choices[0].logprobs.content is not None
    assert [t.token for t in rich.choices[0].logprobs.content] == ["a", " b", " c"]


@pytest.mark.parametrize("reply", [
    "one two three",
    {"content": "let me check", "tool_calls": [{"name": "f", "arguments": '{"q": "x"}'},
                                               {"name": "g", "arguments": "{}"}]},
    {"tool_calls": [{"name": "f", "arguments": "{}"}]},
])
def test_stream_says_what_the_plain_reply_says(reply: Any) -> None:
    kwargs: dict[str, Any] = {"model": "m", "messages": USER, "logprobs": True,
                              "extra_body": {"return_token_ids": True}}
    with FakeOpenAI(script=[reply, reply]) as srv:
        client = _client(srv)
        plain = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [i for c in chunks for ch in c.choices for i in (ch.model_extra or {}).get("token_ids", [])]
    logprobs = [t.logprob for c in chunks for ch in c.choices if ch.logprobs and ch.logprobs.content
                for t in ch.logprobs.content]
    arguments: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            for call in ch.delta.tool_calls or ():
                fragment = call.function.arguments if call.function is not None else None
                arguments[call.index] = arguments.get(call.index, "") + (fragment or "")
    message = plain.choices[0].message
    assert content == (message.content or "")
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in message.tool_calls or ()]
    assert ids == (plain.choices[0].model_extra or {})["token_ids"]
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content is not None
    assert logprobs == [t.logprob for t in plain.choices[0].logprobs.content]
    assert chunks[0].model_extra == {"prompt_token_ids": (plain.model_extra or {})["prompt_token_ids"]}
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason


def test_usage_chunk_only_with_include_usage() -> None:
    with FakeOpenAI() as srv:
        chunks = list(_client(srv).chat.completions.create(model="m", messages=USER, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)


def test_requests_are_recorded_with_headers_and_body() -> None:
    with FakeOpenAI() as srv:
        _client(srv).chat.completions.create(model="m", messages=USER, extra_headers={"traceparent": "00-x"})
    (request,) = srv.requests
    assert request.method == "POST" and request.path == "/v1/chat/completions"
    assert request.headers["traceparent"] == "00-x" and request.body == {"model": "m", "messages": USER}


def test_models_and_completions_endpoints() -> None:
    with FakeOpenAI(model="toy") as srv:
        client = _client(srv)
        assert [m.id for m in client.models.list()] == ["toy"]
        completion = client.completions.create(model="toy", prompt="say hi", extra_body={"return_token_ids": True})
    assert completion.choices[0].text == "say hi"
    assert (completion.choices[0].model_extra or {})["prompt_token_ids"] == tokenize("say hi")


def test_told_to_fail() -> None:
    with FakeOpenAI(status=500) as srv, pytest.raises(openai.InternalServerError):
        _client(srv).chat.completions.create(model="m", messages=USER)
    with FakeOpenAI(script=[{"status": 429, "error": "slow down"}]) as srv, pytest.raises(openai.RateLimitError) as e:
        _client(srv).chat.completions.create(model="m", messages=USER)
    assert "slow down" in str(e.value)


def test_tokenizer_is_deterministic_across_processes() -> None:
    code = "from agl_core.testing import tokenize; print(tokenize('The Seine, in Paris.'))"
    assert json.loads(_python(code, PYTHONHASHSEED="123")) == tokenize("The Seine, in Paris.")


def test_importing_the_fake_pulls_in_no_server_library() -> None:
    code = ("import sys, agl_core.testing; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'flask', 'aiohttp', 'openai') "
            "if m in sys.modules))")
    assert _python(code) == "[]"
