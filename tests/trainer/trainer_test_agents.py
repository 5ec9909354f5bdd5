"""Agents the worker tests run, imported by ``pkg.module:function`` as a user's agent would be.

They build their OpenAI client from the environment (``OPENAI_BASE_URL``,
``OPENAI_API_KEY``), which the worker points at the gateway.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import openai

import agl_core as agl


def solve(task: dict[str, Any]) -> float:
    """A plain function (the worker makes it a rollout): one LLM call, reward 1 when the answer is in it."""
    client = openai.OpenAI(max_retries=0)
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": task["q"]}])
    return 1.0 if task["answer"] in (reply.choices[0].message.content or "") else 0.0


@agl.rollout_fn
async def solve_async(task: dict[str, Any]) -> float:
    """An async rollout function: two calls, the second one streamed."""
    client = openai.AsyncOpenAI(max_retries=0)
    messages: list[Any] = [{"role": "user", "content": task["q"]}]
    first = await client.chat.completions.create(model="m", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    return 1.0 if text else 0.0


def _flag(name: str) -> Path:
    return Path(os.environ["AGL_TEST_DIR"]) / name


def blocking(task: dict[str, Any]) -> float:
    """One LLM call, then waits for the file ``go`` in AGL_TEST_DIR (so a test can kill or stop it mid-run)."""
    client = openai.OpenAI(max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}])
    _flag(f"started-{task['id']}-{os.getpid()}").touch()
    while not _flag("go").exists():
        time.sleep(0.02)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"] + " again"}])
    return 1.0
