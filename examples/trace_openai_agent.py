"""End-to-end: trace a calculator agent written on the plain ``openai`` client and print its transitions.

The agent is ordinary code: it asks the model, runs the calculator when the
model calls it, and answers. agl adds three lines around it (``instrument``,
``rollout``, ``emit_reward``) and one around the tool (``tool_call``), and turns
each run into training transitions with exact token ids, intermediate rewards
from tool outcomes (AIR) and credited rewards.

The model is a local fake OpenAI-compatible server on 127.0.0.1 that answers
like vLLM with ``return_token_ids``; point ``base_url`` at your own vLLM server
(or agl's gateway) to trace a real model. Run: ``make demo``.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import sys
import tempfile
from typing import Any

import openai

import agl_core as agl
from agl_core.testing.fake_openai import FakeOpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]

TASKS = [
    {"id": "calc-1", "question": "What is 17 * 23?", "answer": 391},
    {"id": "calc-2", "question": "What is 1024 / 0?", "answer": None},  # the tool fails: AIR penalises
    {"id": "calc-3", "question": "What is (7 + 5) * 3?", "answer": 36},
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> float:
    """Arithmetic only: the model's text is parsed, never evaluated as code."""
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")
    return walk(ast.parse(expression, mode="eval").body)


def fake_model(request: dict[str, Any]) -> Any:
    """A scripted policy: call the calculator on the question, then state the tool's result."""
    last = request["messages"][-1]
    if last["role"] == "user":
        expression = re.sub(r"^What is |\?$", "", last["content"])
        return {"tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}]}
    return f"The answer is {last['content']}."


def agent(client: openai.OpenAI, question: str) -> str:
    """The user's agent, unchanged by agl: a tool loop on chat.completions.create."""
    messages: list[Any] = [{"role": "system", "content": "Use the calculator."},
                           {"role": "user", "content": question}]
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                               extra_body={"return_token_ids": True, "logprobs": True})
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message)
        for call in message.tool_calls:
            with agl.tool_call(call.function.name, call_id=call.id, arguments=call.function.arguments) as tool:
                try:
                    tool.result = str(calculator(**json.loads(call.function.arguments)))
                except ZeroDivisionError as exc:
                    tool.error(f"error: {exc}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(tool.result)})
    return ""


def main() -> int:
    active = agl.instrument()
    print(f"agl: capturing {', '.join(active)}")
    for name, why in active.skipped.items():
        print(f"     not {name}: {why}")
    builder = agl.TransitionBuilder(air=agl.AirRules(tool_error=-0.5, tool_exception=-0.5, malformed_tool_call=-1.0))
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAI(fake_model) as server:
        store = agl.SqliteStore(os.path.join(tmp, "runs.db"))
        client = openai.OpenAI(base_url=server.url, api_key="not-needed")
        for task in TASKS:
            with agl.rollout(task["id"], task=task, store=store, builder=builder) as run:
                answer = agent(client, task["question"])
                expected = task["answer"]
                agl.emit_reward(1.0 if expected is not None and str(expected) in answer else 0.0)
            traj = run.trajectory()
            print(f"\n== {task['id']}: {task['question']!r} -> {answer!r}  final reward {traj.reward}")
            for t in traj.transitions:
                said = t.response.get("content") or json.dumps([c["function"] for c in t.response["tool_calls"]])
                print(f"  #{t.index} [{t.agent_name or 'agent'} / {t.model}] prompt {len(t.prompt)} msgs, "
                      f"{len(t.prompt_token_ids or [])} tokens ({t.token_source}) -> {said[:60]}")
                print(f"      response ids {t.response_token_ids[:6] if t.response_token_ids else None}..., "
                      f"reward {t.reward}, credited {t.credited_reward}")
            for s in traj.skipped:
                print(f"  skipped {s.span_id}: {s.reason}")
        stored = store.trajectories()
        print(f"\nstore: {len(store.rollouts())} rollouts, {sum(len(t.transitions) for t in stored)} transitions")
        out = os.path.join(tmp, "transitions.jsonl")
        print(f"exported {store.export(out)} transitions to JSONL; first line:")
        with open(out, encoding="utf-8") as f:
            print("  " + f.readline()[:200] + "...")
        traceparents = [r.headers.get("traceparent") for r in server.requests]
        print(f"gateway side: {sum(1 for t in traceparents if t)} of {len(traceparents)} requests carried traceparent")
        store.close()
    agl.uninstrument()
    return 0


if __name__ == "__main__":
    sys.exit(main())
