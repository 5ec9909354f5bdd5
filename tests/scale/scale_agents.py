"""The agents of the scale and crash tests, the fake model they talk to, and what each one must leave behind.

Each task carries a ``nonce`` that goes into the agent's prompts; the fake
model (:func:`model_reply`) answers deterministically from the last message,
echoing the nonce, so every transition can be traced back to the one rollout
that made it. Three frameworks, each in a sync and an async form:

- ``openai``: the plain OpenAI client, ``steps`` chat turns (the async form streams);
- ``langchain``: LangChain's ``ChatOpenAI`` with a bound tool, call, run the tool, call again;
- ``agents``: an OpenAI Agents SDK ``Agent`` with a function tool, through ``Runner.run``.

A *poison* task (``"poison": "big" | "many"``) makes a rollout no server can
store: one message, or 3,000 smaller ones, over the crash test server's body
limit (413). Its task must end ``failed`` with that reason within
``max_attempts`` tries, never leased over and over. (Text with a lone surrogate
is no poison here: agl's collector stores it as U+FFFD.)

The agents build their clients from ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``,
which the worker points at the server's gateway, with the clients' default
retries, as users keep them: at 64 concurrent slots on two busy cores a
keep-alive connection that the server closes just as a client reuses it is
retried by the client (same traceparent, so still one record and one transition).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

KINDS = ("openai", "langchain", "agents")
_NONCE = re.compile(r"nonce=([0-9a-f]+)")


# --------------------------------------------------------------------------- the fake model


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def model_reply(body: dict[str, Any]) -> Any:
    """FakeOpenAI's script: a tool call when tools are offered and the user just spoke, else an echo."""
    messages = body.get("messages") or []
    if not messages:
        return _text(body.get("prompt"))
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    found = [m for m in (_NONCE.search(_text(m.get("content"))) for m in messages if isinstance(m, dict)) if m]
    nonce = found[0].group(1) if found else "none"
    if last.get("role") == "tool":
        return f"answer nonce={nonce} {_text(last.get('content'))}"
    if body.get("tools") and last.get("role") == "user":
        return {"tool_calls": [{"name": "lookup", "arguments": json.dumps({"nonce": nonce}),
                                "id": f"call_{nonce}"}]}
    return f"reply {_text(last.get('content'))}"


def lookup_value(nonce: str) -> str:
    return f"value-{nonce}"


# --------------------------------------------------------------------------- the agents


def _question(task: dict[str, Any], step: int) -> str:
    return f"nonce={task['nonce']} step={step}: what is {step}?"


def _pause(task: dict[str, Any]) -> None:
    if task.get("delay"):
        time.sleep(task["delay"])


def _openai_sync(task: dict[str, Any]) -> None:
    import openai

    client = openai.OpenAI()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly."}]
    for step in range(task["steps"]):
        messages.append({"role": "user", "content": _question(task, step)})
        reply = client.chat.completions.create(model="policy", messages=messages)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        _pause(task)


async def _openai_async(task: dict[str, Any]) -> None:
    import openai

    client = openai.AsyncOpenAI()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly."}]
    for step in range(task["steps"]):
        messages.append({"role": "user", "content": _question(task, step)})
        stream = await client.chat.completions.create(model="policy", messages=messages, stream=True)  # type: ignore
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        messages.append({"role": "assistant", "content": text})
        if task.get("delay"):
            await asyncio.sleep(task["delay"])


def _langchain_parts() -> tuple[Any, Any]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lookup(nonce: str) -> str:
        """Look up the value stored under a nonce."""
        return lookup_value(nonce)

    return ChatOpenAI(model="policy").bind_tools([lookup]), lookup


def _langchain_sync(task: dict[str, Any]) -> None:
    from langchain_core.messages import HumanMessage

    llm, lookup = _langchain_parts()
    messages: list[Any] = [HumanMessage(f"nonce={task['nonce']} look it up")]
    ai = llm.invoke(messages)
    messages.append(ai)
    _pause(task)
    for call in ai.tool_calls:
        messages.append(lookup.invoke(call))
    llm.invoke(messages)


async def _langchain_async(task: dict[str, Any]) -> None:
    from langchain_core.messages import HumanMessage

    llm, lookup = _langchain_parts()
    messages: list[Any] = [HumanMessage(f"nonce={task['nonce']} look it up")]
    ai = await llm.ainvoke(messages)
    messages.append(ai)
    if task.get("delay"):
        await asyncio.sleep(task["delay"])
    for call in ai.tool_calls:
        messages.append(await lookup.ainvoke(call))
    await llm.ainvoke(messages)


async def _agents_async(task: dict[str, Any]) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
    from openai import AsyncOpenAI

    @function_tool
    def lookup(nonce: str) -> str:
        """Look up the value stored under a nonce."""
        return lookup_value(nonce)

    model = OpenAIChatCompletionsModel("policy", AsyncOpenAI())
    agent = Agent(name="lookup agent", instructions="Use the lookup tool.", tools=[lookup], model=model)
    await Runner.run(agent, f"nonce={task['nonce']} look it up")


def _poison(task: dict[str, Any]) -> None:
    import agl_core as agl

    if task["poison"] == "big":
        agl.emit_message("x" * 1_500_000)  # over the crash test server's 1 MiB body limit
    else:
        for i in range(3_000):
            agl.emit_message(f"step {i} " + "y" * 400)


def agent(task: dict[str, Any]) -> float:
    """The sync agent a worker runs in its threads (the OpenAI Agents SDK on a loop of its own)."""
    if task.get("poison"):
        _poison(task)
        return 1.0
    kind = task["kind"]
    if kind == "openai":
        _openai_sync(task)
    elif kind == "langchain":
        _langchain_sync(task)
    else:
        asyncio.run(_agents_async(task))
    return 1.0


async def agent_async(task: dict[str, Any]) -> float:
    """The async agent (the worker runs it with ``asyncio.run``; the asyncio driver awaits many at once)."""
    if task.get("poison"):
        _poison(task)
        return 1.0
    kind = task["kind"]
    if kind == "openai":
        await _openai_async(task)
    elif kind == "langchain":
        await _langchain_async(task)
    else:
        await _agents_async(task)
    return 1.0
