"""Math with a calculator tool on AutoGen agentchat (Calc-X style): a solver that computes with a safe calculator.

The agent is an ordinary AutoGen ``AssistantAgent`` named ``solver`` with one
tool, ``calculator`` (:func:`examples.calc_agent.calculator.calculate`: parsed
with :mod:`ast`, never evaluated). It may call the calculator several times
(``max_tool_iterations``), then answers ending with ``Answer: <number>``. The
reward is 1.0 when that number is the problem's answer, else 0.0. A calculator
call that fails (not arithmetic, division by zero) is an AIR penalty on the
model call that asked for it.

The model is any OpenAI-compatible server, through autogen-ext's
``OpenAIChatCompletionClient`` with ``base_url=$OPENAI_BASE_URL`` and
``api_key=$OPENAI_API_KEY``; ``AGL_MODEL`` or ``--model`` names it (AutoGen
needs a ``model_info`` for a model it does not know: function calling on).

    python -m examples.calc_agent.agent --tasks 3
    python -m examples.calc_agent.agent --fake
    PYTHONPATH=. agl worker --server http://127.0.0.1:8000 --agent examples.calc_agent.agent:rollout
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_core.models import ModelFamily, ModelInfo
from autogen_core.tools import FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient

import agl_core as agl
from examples import runner
from examples.calc_agent.calculator import TASKS, calculate, reward
from examples.runner import model_name

__all__ = ["BUILDER", "CALCULATOR_ERROR_REWARD", "TASKS", "build_agent", "model_client", "rollout", "solve"]

CALCULATOR_ERROR_REWARD = -0.2
MAX_TOOL_ITERATIONS = 4

BUILDER = agl.TransitionBuilder(air=agl.AirRules(tool_exception=CALCULATOR_ERROR_REWARD,
                                                 tool_error=CALCULATOR_ERROR_REWARD))

SYSTEM = """You solve arithmetic word problems. Do every computation with the calculator tool, one expression \
at a time (numbers, + - * / // % ** and parentheses only). When you are done, reply with one short sentence \
ending with: Answer: <number>"""

MODEL_INFO = ModelInfo(vision=False, function_calling=True, json_output=False, family=ModelFamily.UNKNOWN,
                       structured_output=False)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '(24 * 7) - 13'."""
    return calculate(expression)


def model_client(model: str | None = None) -> OpenAIChatCompletionClient:
    """A client for ``model`` at ``OPENAI_BASE_URL`` (one per run: an async client belongs to one event loop)."""
    return OpenAIChatCompletionClient(model=model_name(model), base_url=os.environ.get("OPENAI_BASE_URL"),
                                      api_key=os.environ.get("OPENAI_API_KEY", "not-needed"),
                                      model_info=MODEL_INFO, temperature=0.7, max_retries=1)


def build_agent(client: OpenAIChatCompletionClient) -> AssistantAgent:
    """The solver: one ``AssistantAgent`` with the calculator, answering after at most a few tool rounds."""
    tool = FunctionTool(calculator, description=calculator.__doc__ or "", name="calculator")
    return AssistantAgent("solver", model_client=client, tools=[tool], system_message=SYSTEM,
                          max_tool_iterations=MAX_TOOL_ITERATIONS, reflect_on_tool_use=True)


async def solve(task: dict[str, Any], model: str | None = None) -> tuple[str, float]:
    """Run the agent on one task: ``(final reply, reward)``."""
    client = model_client(model)
    try:
        result = await build_agent(client).run(task=task["question"])
    finally:
        await client.close()
    reply = str(result.messages[-1].content) if result.messages else ""
    return reply, reward(reply, task["answer"])


@agl.rollout_fn(builder=BUILDER)
async def rollout(task: dict[str, Any], model: str | None = None) -> float:
    """The entry point ``agl worker`` runs: one task ``{"id", "question", "answer"}`` -> its reward."""
    return (await solve(task, model))[1]


# --------------------------------------------------------------------------- python -m examples.calc_agent.agent

_EXPRESSIONS = {"calc-01": "24 * 7 - 13", "calc-02": "12.50 * (28 + 3)", "calc-03": "1200 - 35 * 18",
                "calc-04": "147 / 3 + 4", "calc-05": "342 / 4.5", "calc-06": "2 * (17 + 9) * 6",
                "calc-07": "250 * (1.25 - 0.80)", "calc-08": "4380 / 12 * 5", "calc-09": "640 * (1 - 15 / 100)",
                "calc-10": "45 * 16 * 2 / 3"}


def fake_policy(request: dict[str, Any]) -> Any:
    """A scripted stand-in for a model (``--fake``): one calculator call per problem, then the answer."""
    messages = request["messages"]
    last = messages[-1]
    if last["role"] == "tool":
        return f"The result is {last['content']}. Answer: {last['content']}"
    question = str(last["content"])
    task = next((t for t in TASKS if t["question"] == question), None)
    expression = _EXPRESSIONS[task["id"]] if task else re.sub(r"[^\d+\-*/(). ]", "", question) or "0"
    return {"tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}]}


def main(argv: list[str] | None = None) -> int:
    return runner.main(__doc__ or "", rollout, TASKS, fake_policy, argv, default_tasks=3)


if __name__ == "__main__":
    sys.exit(main())
