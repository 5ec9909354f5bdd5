"""Per-rollout state is released when a rollout ends, so a long-running worker keeps flat memory.

Each rollout runs the real ``openai`` client through the agl plugin, with a tool
call and two rewards, and writes to a ``SqliteStore``. The network edge is an
in-process transport answering as a vLLM-like server would (token ids and
logprobs), so thousands of rollouts run in seconds.

Memory is measured with ``tracemalloc`` (Python allocations only, counted exactly,
so other processes on a busy machine do not move the figure), after ``gc.collect()``,
as growth per rollout after a warm-up: whatever agl keeps per rollout (a buffer, a
span, a context token, a cache entry) shows up there, multiplied by the count.
CI measures 1,000 rollouts (after 300 untraced and 200 traced ones); ``AGL_FULL=1`` measures 10,000.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import tracemalloc
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import agl_core as agl
from agl_core import collector
from agl_core.openai_client import OpenAIInstrumentor

FULL = os.environ.get("AGL_FULL") == "1"
ROLLOUTS = 10_000 if FULL else 1_000  # measured; tracemalloc makes each rollout ~4x dearer
WARMUP = 300
SETTLE = 200
"""Rollouts traced before the measure starts: allocations that fill once after tracing starts land there."""
MAX_BYTES_PER_ROLLOUT = 64
"""A leak of one small object per rollout (a dict entry, a span, a token) is over 64 bytes."""

_ids = itertools.count()


def _reply(request: httpx.Request) -> httpx.Response:
    """A vLLM-like chat completion: a tool call first, the answer once a tool result is in the conversation."""
    body = json.loads(request.content)
    n = next(_ids)
    answered = any(m.get("role") == "tool" for m in body["messages"])
    message: dict[str, Any] = (
        {"role": "assistant", "content": "The Seine."} if answered else
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {"name": "search", "arguments": '{"q": "Paris"}'}}]}
    )
    tokens = [11, 22, 33, 44]
    return httpx.Response(200, json={
        "id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": body["model"],
        "choices": [{"index": 0, "finish_reason": "stop" if answered else "tool_calls", "message": message,
                     "token_ids": tokens,
                     "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                              for _ in tokens]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
        "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9],
    })


@pytest.fixture
def client() -> Iterator[openai.OpenAI]:
    plugin = OpenAIInstrumentor()
    plugin.instrument()
    http = httpx.Client(transport=httpx.MockTransport(_reply))
    try:
        yield openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x", http_client=http, max_retries=0)
    finally:
        http.close()
        plugin.uninstrument()


def _one(client: openai.OpenAI, store: agl.SqliteStore, i: int) -> agl.RolloutRun:
    with agl.rollout(f"task-{i % 50}", task={"i": i}, store=store) as run:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Which river runs through Paris? ({i})"}]
        first = client.chat.completions.create(model="m", messages=messages, logprobs=True)
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        with agl.tool_call("search", call_id=call.id, arguments=call.function.arguments) as tool:  # type: ignore[union-attr]
            tool.result = "The Seine flows through Paris."
        messages.append({"role": "tool", "tool_call_id": call.id, "content": tool.result})
        agl.emit_reward(0.1, name="tool_ok")
        client.chat.completions.create(model="m", messages=messages, logprobs=True)
        agl.emit_reward(1.0)
    return run


def test_rollout_state_is_released_when_the_rollout_ends(client: openai.OpenAI, tmp_path: Any) -> None:
    with agl.SqliteStore(tmp_path / "runs.db") as store:
        run = _one(client, store, 0)
        assert run.store_error is None
        assert len(run.trajectory().transitions) == 2
        assert collector._open == {}, "the rollout's buffer is still registered after its block ended"
        assert collector.current_rollout.get() is None
        rid = run.id
        rollout = weakref.ref(run.rollout)
        stored = store.get_rollout(rid)
        assert stored is not None and len(stored.spans) == len(run.rollout.spans) == 6  # root, 2 chats, tool, 2 rewards
        del run, stored
        gc.collect()
        assert rollout() is None, f"the Rollout record outlived its run: held by {gc.get_referrers(rollout())}"
        left = _live_state_of(rid)
        assert left == [], f"per-rollout objects still alive after the run was dropped: {left}"


def _live_state_of(rollout_id: str) -> list[str]:
    """Every live buffer, span or record (of agl's tracer or the OpenTelemetry SDK) belonging to ``rollout_id``."""
    from agl_core.tracer import LightSpan

    found = []
    for obj in gc.get_objects():
        kind = type(obj)
        if kind is collector.RolloutBuffer and obj.rollout_id == rollout_id:
            found.append("RolloutBuffer")
        elif isinstance(obj, LightSpan) and (obj.attributes or {}).get("agl.rollout.id") == rollout_id:
            found.append(f"LightSpan {obj.name!r}")
        elif kind is agl.Span and obj.rollout_id == rollout_id:
            found.append(f"Span record {obj.name!r}")
    return found


def test_traced_memory_stays_flat_over_many_rollouts(client: openai.OpenAI, tmp_path: Any) -> None:
    with agl.SqliteStore(tmp_path / "runs.db") as store:
        for i in range(WARMUP):  # caches, lazily built wrappers, interned names, the store's statements
            _one(client, store, i)
        gc.collect()
        tracemalloc.start()
        try:
            for i in range(WARMUP, WARMUP + SETTLE):
                _one(client, store, i)
            gc.collect()
            before = tracemalloc.take_snapshot()
            start, _ = tracemalloc.get_traced_memory()
            for i in range(WARMUP + SETTLE, WARMUP + SETTLE + ROLLOUTS):
                _one(client, store, i)
            gc.collect()
            end, _ = tracemalloc.get_traced_memory()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        assert len(store.rollouts()) == WARMUP + SETTLE + ROLLOUTS
    per_rollout = (end - start) / ROLLOUTS
    top = "\n".join(str(s) for s in after.compare_to(before, "lineno")[:8])
    assert per_rollout < MAX_BYTES_PER_ROLLOUT, (
        f"traced memory grew {end - start} bytes over {ROLLOUTS} rollouts ({per_rollout:.0f} B each); "
        f"top growth:\n{top}"
    )
    assert collector._open == {}
