"""Real rollouts for the dashboard to show: agents on the plain openai client, through the server's gateway.

Each rollout runs under ``agl.rollout`` with agl's openai plugin on, its LLM
calls answered by FakeOpenAI behind the real gateway, and is posted to the real
server through ``agl.HttpStore``. The mix has what the page must show: an
agent span above LLM calls, tool calls (one raising, one returning an error),
a model error that fails the rollout, and rewards; plus training metrics.
"""

from __future__ import annotations

import json
import math
from typing import Any

import openai

import agl_core as agl
from agl_core import collector, semconv
from agl_trainer.server import TrainerServer

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

N_STEPS = 12
MODEL = "fake-model"  # what FakeOpenAI serves: the policy, so agl serve has no other model to warn about


def script(request: dict[str, Any]) -> Any:
    """FakeOpenAI's replies: a tool call first, the answer once the tool has answered; 'boom' fails."""
    messages = request.get("messages") or []
    last = messages[-1] if messages else {}
    question = next((m.get("content") for m in messages if m.get("role") == "user"), "") or ""
    if "boom" in question:
        return {"status": 500, "error": "the model server fell over"}
    if request.get("tools") and last.get("role") == "user":
        expression = question.split(":", 1)[-1].strip()
        return {"tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}]}
    if last.get("role") == "tool":
        return f"The answer is {last.get('content')}."
    return "Checked: looks right."


def _calculator(expression: str) -> str:
    if "/ 0" in expression:
        raise ZeroDivisionError("division by zero")
    if not all(c in "0123456789+-*/ ()" for c in expression):
        return "error: only arithmetic is allowed"
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and operators only, checked above


def _agent_span(name: str) -> Any:
    return collector.tracer().start_as_current_span(
        semconv.agent_span_name(name),
        attributes={semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: name})


def _solve(client: openai.OpenAI, question: str) -> str:
    """The 'solver' agent: asks the model, runs the calculator it calls, asks again with the result."""
    with _agent_span("solver"):
        messages: list[Any] = [{"role": "user", "content": question}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        message = first.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            args = json.loads(call.function.arguments)  # type: ignore[union-attr]
            with agl.tool_call("calculator", call_id=call.id, arguments=args) as tool:
                tool.result = _calculator(args["expression"])
                if tool.result.startswith("error"):
                    tool.error(tool.result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(tool.result)})
        second = client.chat.completions.create(model=MODEL, messages=messages)
        return second.choices[0].message.content or ""


def _check(client: openai.OpenAI, answer: str) -> None:
    """The 'checker' agent: one LLM call over the solver's answer."""
    with _agent_span("checker"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Check: {answer}"}])


QUESTIONS = [
    ("calc-1", "compute: 2 + 3", 1.0),
    ("calc-2", "compute: 6 * 7", 1.0),
    ("calc-3", "compute: 1 / 0", None),            # the tool raises: the rollout fails
    ("calc-4", "compute: two plus two", 0.0),     # the tool returns an error result
    ("calc-5", "compute: boom", None),            # the model server answers 500: the rollout fails
    ("calc-6", "compute: 10 - 4", 0.5),
]


def fill(url: str, token: str | None = None) -> list[agl.RolloutRun]:
    """Run every question as one rollout against the server at ``url``; returns the runs, oldest first."""
    store = agl.HttpStore(url, token)
    client = openai.OpenAI(base_url=url + "/v1", api_key=token or "unused", max_retries=0)
    runs = []
    for task_id, question, reward in QUESTIONS:
        try:
            with agl.rollout(task_id=task_id, task={"question": question}, store=store) as run:
                answer = _solve(client, question)
                _check(client, answer)
                if reward is not None:
                    agl.emit_reward(reward)
        except (ZeroDivisionError, openai.APIStatusError):
            pass  # the rollout is stored as failed, with the error
        assert run.store_error is None, run.store_error
        runs.append(run)
    return runs


def record_curves(server: TrainerServer, steps: int = N_STEPS) -> None:
    """A plausible run: reward rising, loss falling, and a number the page shows only when asked (kl)."""
    for step in range(steps):
        server.record_metrics(step, {"reward_mean": round(0.2 + 0.6 * (1 - math.exp(-step / 4)), 4),
                                     "loss": round(0.9 * math.exp(-step / 5) + 0.05, 4),
                                     "kl": round(0.01 * step, 4)})
