"""The agent test_apo.py optimises, imported by ``pkg.module:function`` as a user's agent would be."""

from __future__ import annotations

import os
from typing import Any

import openai

import agl_core as agl


@agl.rollout_fn(resources={"system_prompt": "unused default"})
def agent(task: dict[str, Any], resources: Any) -> float:
    """One model call with the served system prompt; right only when the model answered in French."""
    url = os.environ.get("APO_TEST_MODEL_URL")  # unset: OPENAI_BASE_URL (the gateway, with apo.gateway_model)
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0) if url else openai.OpenAI(max_retries=0)
    reply = client.chat.completions.create(model="agent-model", messages=[
        {"role": "system", "content": resources["system_prompt"]}, {"role": "user", "content": task["q"]}])
    return 1.0 if reply.choices[0].message.content == "bonjour" else 0.0


@agl.rollout_fn
def raising(task: dict[str, Any]) -> float:
    """As :func:`agent`, through ``agl.resources()``, but a wrong answer raises instead of scoring 0."""
    client = openai.OpenAI(base_url=os.environ["APO_TEST_MODEL_URL"], api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="agent-model", messages=[
        {"role": "system", "content": agl.resources()["system_prompt"]}, {"role": "user", "content": task["q"]}])
    if reply.choices[0].message.content != "bonjour":
        raise ValueError(f"expected French, got {reply.choices[0].message.content!r}")
    return 1.0
