"""A billing help desk on Microsoft Agent Framework: a ``triage`` agent hands the customer over to ``billing``.

Two ordinary Agent Framework ``Agent``s in a handoff workflow (``HandoffBuilder``
from ``agent-framework-orchestrations``): ``triage`` answers nothing itself and
hands the customer to ``billing`` (the ``handoff_to_billing`` tool the builder
adds), and ``billing`` looks the invoice up with ``lookup_invoice`` and replies
with its amount. The workflow ends at the first reply with text. The reward is
1.0 when the reply states the invoice's amount, else 0.0; a lookup that fails
(an invoice that does not exist) is an AIR penalty on the call that asked for
it. Both agents are trained (they share the policy); ``agent_match="billing"``
would train billing alone.

The model is any OpenAI-compatible server, through the framework's
``OpenAIChatCompletionClient`` with ``base_url=$OPENAI_BASE_URL`` and
``api_key=$OPENAI_API_KEY`` (Chat Completions: agl's ``openai`` plugin and
gateway give its calls exact token ids); ``AGL_MODEL`` or ``--model`` names it.

    python -m examples.agent_framework_agent.agent --fake
    PYTHONPATH=. agl worker --server http://127.0.0.1:8000 --agent examples.agent_framework_agent.agent:rollout
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from agent_framework import Agent, Message, tool
from agent_framework.openai import OpenAIChatCompletionClient
from agent_framework_orchestrations import HandoffBuilder
from openai import AsyncOpenAI

import agl_core as agl
from examples import runner
from examples.runner import model_name, read_tasks

__all__ = ["BUILDER", "INVOICES", "LOOKUP_ERROR_REWARD", "TASKS", "build_workflow", "lookup_invoice", "reward",
           "rollout", "solve"]

LOOKUP_ERROR_REWARD = -0.3
BUILDER = agl.TransitionBuilder(air=agl.AirRules(tool_exception=LOOKUP_ERROR_REWARD, tool_error=LOOKUP_ERROR_REWARD))
TASKS = read_tasks(Path(__file__).with_name("tasks.jsonl"))

INVOICES = {
    "INV-1001": ("Ada Lovelace", "2026-01-31", 120.00), "INV-1002": ("Alan Turing", "2026-02-28", 89.50),
    "INV-1003": ("Grace Hopper", "2026-03-31", 1042.75), "INV-1004": ("Edsger Dijkstra", "2026-04-30", 15.00),
    "INV-1005": ("Barbara Liskov", "2026-05-31", 300.00), "INV-1006": ("Donald Knuth", "2026-06-30", 2.56),
    "INV-1007": ("Frances Allen", "2026-07-31", 760.20), "INV-1008": ("John Backus", "2026-08-31", 45.45),
}

TRIAGE = "You are the first line of a billing help desk. Hand every invoice question over to billing."
BILLING = ("You answer questions about invoices. Look the invoice up with lookup_invoice, then reply with one short "
           "sentence giving its amount in dollars, such as: Invoice INV-1 is $12.00.")


@tool
def lookup_invoice(invoice_id: str) -> str:
    """The customer, due date and amount of an invoice such as 'INV-1001'."""
    record = INVOICES.get(invoice_id.strip().upper())
    if record is None:
        raise KeyError(f"no invoice {invoice_id!r}; invoice ids look like INV-1001")
    customer, due, amount = record
    return f"{invoice_id.strip().upper()}: {customer}, due {due}, amount ${amount:.2f}"


def reward(reply: str, invoice_id: str) -> float:
    """1.0 when ``reply`` states the invoice's amount (``$1,042.75``, ``1042.75`` or ``$120``), else 0.0."""
    amount = INVOICES[invoice_id][2]
    for found in re.findall(r"\$?\s*(\d[\d,]*(?:\.\d+)?)", reply):
        try:
            if abs(float(found.replace(",", "")) - amount) < 0.005:
                return 1.0
        except ValueError:
            continue
    return 0.0


def _answered(conversation: list[Message]) -> bool:
    """The workflow ends at the first agent reply with text (a handoff is a tool call, without text)."""
    return any(m.role == "assistant" and m.text.strip() for m in conversation)


def build_workflow(model: str | None = None) -> Any:
    """triage -> billing, both on one client for ``model`` at ``OPENAI_BASE_URL`` (one per run: it owns a loop)."""
    http = AsyncOpenAI(base_url=os.environ.get("OPENAI_BASE_URL"),
                       api_key=os.environ.get("OPENAI_API_KEY", "not-needed"), max_retries=1)
    client = OpenAIChatCompletionClient(model=model_name(model), async_client=http)
    options = {"temperature": 0.7}
    triage = Agent(client=client, name="triage", instructions=TRIAGE, description="Routes customers.",
                   default_options=options, require_per_service_call_history_persistence=True)
    billing = Agent(client=client, name="billing", instructions=BILLING, description="Knows every invoice.",
                    tools=[lookup_invoice], default_options=options,
                    require_per_service_call_history_persistence=True)
    return (HandoffBuilder(participants=[triage, billing], termination_condition=_answered)
            .with_start_agent(triage).add_handoff(triage, [billing]).add_handoff(billing, [triage]).build())


async def solve(task: dict[str, Any], model: str | None = None) -> tuple[str, float]:
    """Run the desk on one task: ``(the reply, reward)``."""
    result = await build_workflow(model).run(task["question"])
    reply = " ".join(str(getattr(o, "text", "")) for o in result.get_outputs()).strip()
    return reply, reward(reply, task["invoice"])


@agl.rollout_fn(builder=BUILDER)
async def rollout(task: dict[str, Any], model: str | None = None) -> float:
    """The entry point ``agl worker`` runs: one task ``{"id", "question", "invoice"}`` -> its reward."""
    return (await solve(task, model))[1]


# --------------------------------------------------------------------------- python -m examples.agent_framework_agent


def fake_policy(request: dict[str, Any]) -> Any:
    """A scripted stand-in for a model (``--fake``): triage hands over, billing looks up, then answers."""
    messages = request["messages"]
    last = messages[-1]
    tools = {t["function"]["name"] for t in request.get("tools") or []}
    if last["role"] == "tool":
        amount = re.search(r"amount (\$[\d.,]+)", str(last["content"]))
        if amount is None:
            return "I could not find that invoice."
        return f"That invoice is {amount.group(1)}."
    if "handoff_to_billing" in tools:
        return {"tool_calls": [{"name": "handoff_to_billing", "arguments": {}}]}
    question = next(str(m["content"]) for m in messages if m["role"] == "user")
    invoice = re.search(r"INV-\d+", question)
    return {"tool_calls": [{"name": "lookup_invoice", "arguments": {"invoice_id": invoice.group(0) if invoice
                                                                    else "unknown"}}]}


def main(argv: list[str] | None = None) -> int:
    return runner.main(__doc__ or "", rollout, TASKS, fake_policy, argv, default_tasks=3)


if __name__ == "__main__":
    sys.exit(main())
