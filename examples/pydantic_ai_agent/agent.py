"""A stationery shop's quote desk on Pydantic AI: a price tool and a structured ``Quote`` as the answer.

One ordinary Pydantic AI ``Agent`` named ``desk``, with nothing of agl in it:

- the ``price`` tool looks an item up in the shop's catalogue (built here,
  :data:`CATALOGUE`) and raises ``ModelRetry`` for an item the shop does not
  sell, so the model is told and can try again;
- its output type is :class:`Quote` (item, quantity, total in euro cents),
  which Pydantic AI asks the model for through an output tool and validates.

The reward is 1.0 when the quote's total is the catalogue price times the
quantity asked for, else 0.0 (a model that never produces a valid quote gets
0.0 too: the run itself is fine). AIR: an unknown item (the tool's retry) and a
quote that fails validation are each -0.2 on the call that made them.

The model is any OpenAI-compatible server through Pydantic AI's
``OpenAIChatModel`` on ``OPENAI_BASE_URL``; ``AGL_MODEL`` or ``--model`` names it.

    python -m examples.pydantic_ai_agent.agent --fake
    PYTHONPATH=. agl worker --server http://127.0.0.1:8000 --agent examples.pydantic_ai_agent.agent:rollout
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from pydantic_ai import Agent, ModelRetry
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

import agl_core as agl
from examples import runner
from examples.runner import model_name, read_tasks

__all__ = ["BUILDER", "CATALOGUE", "RETRY_REWARD", "TASKS", "Quote", "build_agent", "reward", "rollout", "solve"]

RETRY_REWARD = -0.2

BUILDER = agl.TransitionBuilder(air=agl.AirRules(tool_error=RETRY_REWARD, tool_exception=RETRY_REWARD))

CATALOGUE: dict[str, int] = {  # price in euro cents
    "notebook": 349, "fountain pen": 1890, "pencil": 45, "eraser": 120, "stapler": 875, "envelope": 30,
}

TASKS: list[dict[str, Any]] = read_tasks(Path(__file__).with_name("tasks.jsonl"))


class Quote(BaseModel):
    """The desk's answer: what was asked for and what it costs."""

    item: str
    quantity: int = Field(ge=1)
    total_cents: int = Field(ge=0, description="the price of the whole order, in euro cents")


def price(item: str) -> str:
    """The price of one item, in euro cents (items like 'notebook', 'fountain pen')."""
    cents = CATALOGUE.get(item.strip().lower().removesuffix("s"))
    if cents is None:
        raise ModelRetry(f"the shop sells no {item!r}; it sells: {', '.join(CATALOGUE)}")
    return json.dumps({"item": item.strip().lower(), "price_cents": cents})


def build_agent(model: Any) -> Agent[None, Quote]:
    """The quote desk on ``model``: ``run_sync(question).output`` is its :class:`Quote`."""
    return Agent(model, name="desk", output_type=Quote, tools=[price], retries=1,
                 instructions="You quote prices for a stationery shop. Look every item up with the price tool, "
                              "then give the quote for the quantity asked for.")


def model_for(model: str | None = None) -> OpenAIChatModel:
    """Pydantic AI's OpenAI chat model on ``OPENAI_BASE_URL``."""
    provider = OpenAIProvider(base_url=os.environ.get("OPENAI_BASE_URL"),
                              api_key=os.environ.get("OPENAI_API_KEY", "not-needed"))
    return OpenAIChatModel(model_name(model), provider=provider)


def reward(quote: Quote | None, task: dict[str, Any]) -> float:
    """1.0 when the quote's total is the catalogue price times the quantity asked for, else 0.0."""
    if quote is None:
        return 0.0
    return 1.0 if quote.total_cents == CATALOGUE[task["item"]] * task["quantity"] else 0.0


def solve(task: dict[str, Any], model: str | None = None) -> tuple[Quote | None, float]:
    """Run the desk on one task: ``(quote, reward)``; a model that never gives a valid quote gets None."""
    try:
        quote: Quote | None = build_agent(model_for(model)).run_sync(task["question"]).output
    except UnexpectedModelBehavior:  # the retries ran out: the policy's failure, scored, not a broken rollout
        quote = None
    return quote, reward(quote, task)


@agl.rollout_fn(builder=BUILDER)
def rollout(task: dict[str, Any], model: str | None = None) -> float:
    """The entry point ``agl worker`` runs: one task ``{"id", "question", "item", "quantity"}`` -> its reward."""
    return solve(task, model)[1]


# --------------------------------------------------------------------------- python -m examples.pydantic_ai_agent.agent


def fake_policy(request: dict[str, Any]) -> Any:
    """A scripted stand-in for a model (``--fake``): look the item up, then quote quantity times price."""
    messages = request["messages"]
    question = next(str(m["content"]) for m in messages if m["role"] == "user")
    found = re.search(r"(\d+) ([a-z ]+?)s?\b(?: cost| please|\.|\?|$)", question)
    quantity, item = (int(found.group(1)), found.group(2).strip()) if found else (1, "notebook")
    last = messages[-1]
    if last["role"] != "tool":
        return {"tool_calls": [{"name": "price", "arguments": {"item": item}}]}
    cents = json.loads(last["content"])["price_cents"]
    return {"tool_calls": [{"name": "final_result",
                            "arguments": {"item": item, "quantity": quantity, "total_cents": quantity * cents}}]}


def main(argv: list[str] | None = None) -> int:
    return runner.main(__doc__ or "", rollout, TASKS, fake_policy, argv, default_tasks=3)


if __name__ == "__main__":
    sys.exit(main())
