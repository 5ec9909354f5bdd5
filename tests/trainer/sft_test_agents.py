"""The agent the SFT / RFT tests train: one call, rewarded by how many of its words are the task's answer.

It builds its OpenAI client from the environment (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``), which
``agl train``'s workers point at the gateway.
"""

from __future__ import annotations

from typing import Any

import openai

import agl_core as agl


@agl.rollout_fn
def pick(task: dict[str, Any]) -> float:
    """Ask ``task["q"]`` with ``task["max_tokens"]`` tokens (default 1); the reward is the share of the reply's
    words that are ``task["answer"]``."""
    client = openai.OpenAI(max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["q"]}],
                                           max_tokens=task.get("max_tokens", 1))
    words = (reply.choices[0].message.content or "").split()
    return sum(w == task["answer"] for w in words) / max(len(words), 1)
