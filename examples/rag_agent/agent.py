"""Retrieval-augmented QA with the OpenAI Agents SDK: a researcher that searches a local corpus with BM25.

The agent is an ordinary Agents SDK ``Agent`` with one ``@function_tool``,
``search``, over the Orrin Isles corpus built in :mod:`examples.rag_agent.corpus`
(BM25, no downloads). It searches as often as it needs (a question may take
two hops), then answers with the answer alone. The reward is SQuAD-style
answer match: 1.0 for an exact match, else the token F1 (0.0 when nothing
overlaps). A search that fails (an empty query) or a malformed tool call is an
AIR penalty on the call that made it.

The model is any OpenAI-compatible chat-completions server (a user's vLLM, or
agl's gateway), through ``OpenAIChatCompletionsModel`` on an ``AsyncOpenAI``
client that reads ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``; ``AGL_MODEL`` or
``--model`` names the model. The SDK's own trace export is switched off per run
(``RunConfig(tracing_disabled=True)``): agl captures the run either way, and a
vLLM key must not be sent to OpenAI's trace endpoint.

    python -m examples.rag_agent.agent --tasks 3
    python -m examples.rag_agent.agent --fake
    PYTHONPATH=. agl worker --server http://127.0.0.1:8000 --agent examples.rag_agent.agent:rollout
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from openai import AsyncOpenAI

import agl_core as agl
from examples import runner
from examples.rag_agent.corpus import BM25, DOCUMENTS, TASKS, reward
from examples.runner import model_name

__all__ = ["BUILDER", "INDEX", "TASKS", "build_agent", "rollout", "search", "solve"]

SEARCH_ERROR_REWARD = -0.2
MALFORMED_CALL_REWARD = -0.5
MAX_TURNS = 6

BUILDER = agl.TransitionBuilder(air=agl.AirRules(tool_exception=SEARCH_ERROR_REWARD, tool_error=SEARCH_ERROR_REWARD,
                                                 malformed_tool_call=MALFORMED_CALL_REWARD))

INSTRUCTIONS = """You answer questions about the Orrin Isles. You know nothing about them yourself: use the \
search tool, as many times as you need (a question may need two searches), and answer only from what it finds.
Reply with the answer alone: a name, a number or a short phrase, no sentence."""

INDEX = BM25(DOCUMENTS)


def _search_failed(ctx: Any, error: Exception) -> str:
    return f"search failed: {error}"  # the model sees why (the SDK's default message says only that it failed)


@function_tool(failure_error_function=_search_failed)
def search(query: str) -> str:
    """Search the Orrin Isles encyclopedia; returns the three best passages, each with its title."""
    if not query.strip():
        raise ValueError("the search query is empty")
    hits = INDEX.search(query, k=3)
    return "\n".join(f"[{h.title}] {h.text}" for h in hits) if hits else "no passage matches"


def build_agent(model: str | None = None) -> Agent[Any]:
    """The researcher agent on ``model``, talking to ``OPENAI_BASE_URL`` (a new client per event loop)."""
    client = AsyncOpenAI(max_retries=1, timeout=120)
    return Agent(name="researcher", instructions=INSTRUCTIONS, tools=[search],
                 model=OpenAIChatCompletionsModel(model_name(model), client),
                 model_settings=ModelSettings(temperature=0.7))


async def solve(task: dict[str, Any], model: str | None = None) -> tuple[str, float]:
    """Run the agent on one task: ``(answer, reward)``."""
    result = await Runner.run(build_agent(model), task["question"], max_turns=MAX_TURNS,
                              run_config=RunConfig(tracing_disabled=True))
    answer = str(result.final_output or "").strip()
    return answer, reward(answer, task["answers"])


@agl.rollout_fn(builder=BUILDER)
async def rollout(task: dict[str, Any], model: str | None = None) -> float:
    """The entry point ``agl worker`` runs: one task ``{"id", "question", "answers"}`` -> its reward."""
    return (await solve(task, model))[1]


# --------------------------------------------------------------------------- python -m examples.rag_agent.agent


def fake_policy(request: dict[str, Any]) -> Any:
    """A scripted stand-in for a model (``--fake``): search the question, then answer from the top passage."""
    last = request["messages"][-1]
    if last["role"] == "user":
        return {"tool_calls": [{"name": "search", "arguments": json.dumps({"query": last["content"]})}]}
    passage = str(last.get("content") or "")
    words = re.findall(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)?\b|\b\d+\b", passage.split("]", 1)[-1])
    question = next(m["content"] for m in request["messages"] if m["role"] == "user")
    return next((w for w in words if w.lower() not in question.lower() and w not in ("The", "It", "Its")), "unknown")


def main(argv: list[str] | None = None) -> int:
    return runner.main(__doc__ or "", rollout, TASKS, fake_policy, argv, default_tasks=3)


if __name__ == "__main__":
    sys.exit(main())
