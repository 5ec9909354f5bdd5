"""An order-desk crew on CrewAI: a researcher looks an order up with a tool, a writer answers the customer.

Two ordinary CrewAI agents in a sequential crew:

- ``Order researcher`` has the ``order_lookup`` tool over the shop's order
  table (built here, :data:`ORDERS`) and reports the order's facts;
- ``Support writer`` turns those facts into the reply to the customer.

The reward is 1.0 when the reply states every fact the customer asked about
(the order's status and its delivery date, or that it was cancelled), else
0.0. Looking up an order that does not exist raises in the tool: an AIR
penalty on the researcher's call that asked for it. Both agents' calls are
transitions (``agent_match`` could keep only one: their names are the roles).

The model is any OpenAI-compatible server, through CrewAI's native OpenAI
provider (``LLM(model="openai/<name>", base_url=$OPENAI_BASE_URL,
api_key=$OPENAI_API_KEY)``); ``AGL_MODEL`` or ``--model`` names it. CrewAI's
own telemetry is for the user to switch off (``CREWAI_DISABLE_TELEMETRY=true``).

    python -m examples.crewai_agent.agent --tasks 2
    python -m examples.crewai_agent.agent --fake
    PYTHONPATH=. agl worker --server http://127.0.0.1:8000 --agent examples.crewai_agent.agent:rollout
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from crewai import LLM, Agent, Crew, Process, Task
from crewai.tools import tool

import agl_core as agl
from examples import runner
from examples.runner import model_name, read_tasks

__all__ = ["BUILDER", "LOOKUP_ERROR_REWARD", "ORDERS", "TASKS", "build_crew", "reward", "rollout", "solve"]

LOOKUP_ERROR_REWARD = -0.3

BUILDER = agl.TransitionBuilder(air=agl.AirRules(tool_exception=LOOKUP_ERROR_REWARD, tool_error=LOOKUP_ERROR_REWARD))

ORDERS: dict[str, dict[str, str]] = {
    "A-1001": {"status": "shipped", "carrier": "Nordpost", "delivery": "3 December"},
    "A-1002": {"status": "processing", "carrier": "none yet", "delivery": "9 December"},
    "A-1003": {"status": "delivered", "carrier": "Nordpost", "delivery": "27 November"},
    "A-1004": {"status": "cancelled", "carrier": "none", "delivery": "none"},
    "B-2001": {"status": "shipped", "carrier": "Rapidex", "delivery": "1 December"},
}

TASKS: list[dict[str, Any]] = read_tasks(Path(__file__).with_name("tasks.jsonl"))


@tool("order_lookup")
def order_lookup(order_id: str) -> str:
    """Look up an order by its id (like A-1001): status, carrier and delivery date."""
    order = ORDERS.get(order_id.strip().upper())
    if order is None:
        raise KeyError(f"no order {order_id!r}; ids look like A-1001")
    return f"order {order_id.strip().upper()}: " + ", ".join(f"{k} {v}" for k, v in order.items())


def reward(reply: str, facts: list[str]) -> float:
    """1.0 when the reply states every fact (case and spacing aside), else 0.0."""
    text = " ".join(reply.lower().split())
    return 1.0 if all(" ".join(f.lower().split()) in text for f in facts) else 0.0


def build_crew(llm: Any) -> Crew:
    """The researcher -> writer crew on ``llm``; ``kickoff(inputs={"question": ...})`` runs it."""
    researcher = Agent(role="Order researcher", goal="Find the facts about the customer's order",
                       backstory="You work the order desk and always check the order table.",
                       llm=llm, tools=[order_lookup], max_iter=4, max_retry_limit=0, verbose=False)
    writer = Agent(role="Support writer", goal="Answer the customer clearly and correctly",
                   backstory="You write short, friendly replies that state the facts exactly.",
                   llm=llm, max_iter=2, max_retry_limit=0, verbose=False)
    research = Task(description="A customer wrote: {question}\nLook the order up with the order_lookup tool and "
                                "report its status and delivery date.",
                    expected_output="The order's status and delivery date.", agent=researcher, name="research")
    reply = Task(description="Write the reply to the customer who wrote: {question}\nState the status and the "
                             "delivery date exactly as the research found them.",
                 expected_output="A two-sentence reply to the customer.", agent=writer, context=[research],
                 name="reply")
    return Crew(agents=[researcher, writer], tasks=[research, reply], process=Process.sequential,
                name="order desk", verbose=False)


def llm_for(model: str | None = None) -> Any:
    """CrewAI's native OpenAI provider on ``OPENAI_BASE_URL``."""
    return LLM(model=f"openai/{model_name(model)}", base_url=os.environ.get("OPENAI_BASE_URL"),
               api_key=os.environ.get("OPENAI_API_KEY", "not-needed"), temperature=0.7, max_retries=1)


def solve(task: dict[str, Any], model: str | None = None) -> tuple[str, float]:
    """Run the crew on one task: ``(reply, reward)``."""
    output = build_crew(llm_for(model)).kickoff(inputs={"question": task["question"]})
    reply = str(output.raw)
    return reply, reward(reply, task["facts"])


@agl.rollout_fn(builder=BUILDER)
def rollout(task: dict[str, Any], model: str | None = None) -> float:
    """The entry point ``agl worker`` runs: one task ``{"id", "question", "facts"}`` -> its reward."""
    return solve(task, model)[1]


# --------------------------------------------------------------------------- python -m examples.crewai_agent.agent


def fake_policy(request: dict[str, Any]) -> Any:
    """A scripted stand-in for a model (``--fake``): the researcher looks up, the writer repeats the facts."""
    messages = request["messages"]
    system, last = str(messages[0]["content"]), messages[-1]
    if "Order researcher" in system:
        if last["role"] == "tool":
            return f"Facts: {last['content']}"
        order_id = re.search(r"[A-Z]-\d{4}", str(last["content"]))
        return {"tool_calls": [{"name": "order_lookup",
                                "arguments": {"order_id": order_id.group(0) if order_id else "unknown"}}]}
    facts = re.search(r"status (\w+), carrier [^,]+, delivery ([\w ]+)", str(last["content"]))
    if facts is None:
        return "Sorry, I could not find your order."
    return f"Your order is {facts.group(1)}; delivery: {facts.group(2).strip()}. Thank you for waiting!"


def main(argv: list[str] | None = None) -> int:
    logging.getLogger("crewai.llms.base_llm").setLevel(logging.ERROR)  # token-count estimates for unknown models
    return runner.main(__doc__ or "", rollout, TASKS, fake_policy, argv, default_tasks=2)


if __name__ == "__main__":
    sys.exit(main())
