"""A plain OpenAI-client agent with its own tool loop: an atlas assistant that looks countries up.

No agent framework: the agent calls ``client.chat.completions.create`` with one
tool, ``country_facts``, runs the tool itself when the model asks, and stops
when the model answers. agl's ``openai`` plugin captures every model call (with
token ids when the server returns them, and the ``traceparent`` agl's gateway
keys its own records by); the one agl line in the loop is ``agl.tool_call``
around the tool, which records its outcome. A lookup of a country not in the
atlas, or arguments that are not valid JSON, is a tool error: an AIR penalty on
the call that asked. The reward is 1.0 when the answer matches the gold answer
(case, punctuation and articles aside), else 0.0.

The atlas is built here (:data:`ATLAS`) so the answers are checkable and stable;
questions need one or two lookups (comparing two countries takes two).

The model is any OpenAI-compatible server: ``openai.OpenAI()`` reads
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``; ``AGL_MODEL`` or ``--model`` names it.

    python -m examples.openai_client_agent.agent --tasks 3
    python -m examples.openai_client_agent.agent --fake
    PYTHONPATH=. agl worker --server http://127.0.0.1:8000 --agent examples.openai_client_agent.agent:rollout
"""

from __future__ import annotations

import json
import re
import string
import sys
from pathlib import Path
from typing import Any

import openai

import agl_core as agl
from examples import runner
from examples.runner import model_name, read_tasks

__all__ = ["ATLAS", "BUILDER", "TASKS", "TOOL_ERROR_REWARD", "country_facts", "reward", "rollout", "run_agent"]

TOOL_ERROR_REWARD = -0.25
MAX_TURNS = 5

BUILDER = agl.TransitionBuilder(air=agl.AirRules(tool_error=TOOL_ERROR_REWARD, tool_exception=TOOL_ERROR_REWARD,
                                                 malformed_tool_call=TOOL_ERROR_REWARD))

ATLAS: dict[str, dict[str, Any]] = {
    "Norway": {"capital": "Oslo", "currency": "Norwegian krone", "population_millions": 5.5},
    "Portugal": {"capital": "Lisbon", "currency": "euro", "population_millions": 10.4},
    "Kenya": {"capital": "Nairobi", "currency": "Kenyan shilling", "population_millions": 55.1},
    "Chile": {"capital": "Santiago", "currency": "Chilean peso", "population_millions": 19.6},
    "Vietnam": {"capital": "Hanoi", "currency": "dong", "population_millions": 100.3},
    "Canada": {"capital": "Ottawa", "currency": "Canadian dollar", "population_millions": 40.1},
}

TASKS: list[dict[str, Any]] = read_tasks(Path(__file__).with_name("tasks.jsonl"))

TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "country_facts",
        "description": "A country's capital, currency and population (in millions).",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]},
    },
}]

SYSTEM = "You answer questions about countries. Look each country up with country_facts; never guess. " \
         "Reply with the answer alone: one name or phrase, no sentence."


class ToolError(Exception):
    """The model asked for something the tool cannot do; the model is told why."""


def country_facts(country: str) -> str:
    """The tool: the atlas entry as JSON; ``ToolError`` for a country the atlas does not have."""
    key = next((name for name in ATLAS if name.lower() == str(country).strip().lower()), None)
    if key is None:
        raise ToolError(f"no country {country!r} in the atlas; it has {', '.join(ATLAS)}")
    return json.dumps({"country": key, **ATLAS[key]})


def _call_tool(name: str, arguments: str) -> str:
    if name != "country_facts":
        raise ToolError(f"no tool {name!r}; the only tool is country_facts")
    try:
        args = json.loads(arguments or "{}")
    except ValueError as exc:
        raise ToolError(f"arguments are not JSON: {exc}") from None
    if not isinstance(args, dict) or "country" not in args:
        raise ToolError('arguments must be {"country": "<name>"}')
    return country_facts(args["country"])


def run_agent(client: openai.OpenAI, model: str, question: str) -> str:
    """The agent: ask, run the tools the model calls, repeat until it answers (or runs out of turns)."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                               temperature=0.7)
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            name, arguments = call.function.name, call.function.arguments  # type: ignore[union-attr]
            with agl.tool_call(name, call_id=call.id, arguments=arguments) as tool:
                try:
                    tool.result = _call_tool(name, arguments)
                except ToolError as exc:
                    tool.error(f"error: {exc}")  # a tool error the model sees, and an AIR reward for training
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(tool.result)})
    return ""


def _normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def reward(answer: str, gold: str) -> float:
    """1.0 when the answer is the gold answer (case, punctuation and articles aside), else 0.0."""
    return 1.0 if _normalize(answer) == _normalize(gold) else 0.0


@agl.rollout_fn(builder=BUILDER)
def rollout(task: dict[str, Any], model: str | None = None) -> float:
    """The entry point ``agl worker`` runs: one task ``{"id", "question", "answer"}`` -> its reward."""
    client = openai.OpenAI(max_retries=1, timeout=120)
    try:
        return reward(run_agent(client, model_name(model), task["question"]), task["answer"])
    finally:
        client.close()


# ------------------------------------------------------------------- python -m examples.openai_client_agent.agent


def fake_policy(request: dict[str, Any]) -> Any:
    """A scripted stand-in for a model (``--fake``): look up each country named, then answer from the facts."""
    messages = request["messages"]
    question = str(messages[1]["content"])
    named = [c for c in re.findall(r"[A-Z][a-z]+", question) if c in ATLAS]
    looked_up = [json.loads(m["content"]) for m in messages if m["role"] == "tool" and m["content"].startswith("{")]
    if len(looked_up) < len(named):
        return {"tool_calls": [{"name": "country_facts", "arguments": {"country": named[len(looked_up)]}}]}
    if not looked_up:
        return "unknown"
    if "more people" in question or "fewer people" in question:
        pick = max if "more" in question else min
        return str(pick(looked_up, key=lambda f: f["population_millions"])["country"])
    return str(looked_up[0]["capital" if "capital" in question else "currency"])


def main(argv: list[str] | None = None) -> int:
    return runner.main(__doc__ or "", rollout, TASKS, fake_policy, argv, default_tasks=3)


if __name__ == "__main__":
    sys.exit(main())
