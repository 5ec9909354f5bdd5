"""Per-call overhead of tracing LangChain: no instrumentation vs OpenInference vs agl.

The workload, run the same way for every variant: one chat-model call that
answers with a tool call (``GenericFakeChatModel`` with tools bound, so the
run carries tool definitions and a tool-call answer) plus one ``@tool``
invocation of that call, sync (``invoke``) and async (``ainvoke``). No network:
what is timed is LangChain plus the instrumentation.

- ``none``: LangChain as is.
- ``openinference``: ``openinference-instrumentation-langchain`` on an SDK
  provider with a no-op exporter (instrumented for its rounds only).
- ``agl``: the agl ``langchain`` plugin as ``agl.instrument()`` sets it up with
  no provider of the user's (agl's own tracer), spans collected into an open
  ``agl.rollout``.
- ``agl-sdk``: the same, on an SDK provider with the same no-op exporter as
  OpenInference's (what a user who set a provider gets).

Both record the same content per call: input and output messages, tool
definitions, invocation parameters, model and provider, and a tool span with
its arguments and result.

The variants run interleaved in rounds, in one process (the order is shuffled each
round), so drift on a noisy machine hits all of them alike; the overhead of a
variant is the median over rounds of its round time minus the baseline's in the
same round. Afterwards, agl's map of in-flight runs is checked to be empty.

Run (from the repository root, after ``make .venvs/langchain/.agl-installed``)::

    .venvs/langchain/bin/pip install -r bench/requirements-langchain.txt
    .venvs/langchain/bin/python bench/langchain_overhead.py [--rounds 15] [--calls 200] [--profile]

Target: agl's overhead at most 1/5 of OpenInference's, sync and async.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import itertools
import pstats
from collections.abc import Iterator, Sequence
from typing import Any

import langchain_core
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.runnables import Runnable
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from openinference.instrumentation.langchain import LangChainInstrumentor as OIInstrumentor
from opentelemetry.sdk.trace import TracerProvider

import harness
from agl_core import collector
from agl_core.rollouts import rollout
from agl_langchain import LangChainInstrumentor


class ToolChat(GenericFakeChatModel):
    """``GenericFakeChatModel`` that binds tools, as provider models do."""

    model: str = "fake-chat"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, AIMessage]:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."


ANSWER = AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call-1",
                                            "type": "tool_call"}])
MODEL = ToolChat(messages=itertools.repeat(ANSWER)).bind_tools([get_weather], temperature=0.2)
PROMPT = [("system", "You are a helpful assistant. Use tools when needed."), ("user", "Weather in Paris?")]


def call() -> None:
    message = MODEL.invoke(PROMPT)
    get_weather.invoke(message.tool_calls[0])


async def acall() -> None:
    message = await MODEL.ainvoke(PROMPT)
    await get_weather.ainvoke(message.tool_calls[0])


# --------------------------------------------------------------------------- variants


class Agl(harness.Variant):
    name = "agl"

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.instrumentor = LangChainInstrumentor()
        self.provider = provider
        if provider is not None:
            self.name = "agl-sdk"
        self.peak_runs = 0  # in-flight runs seen between calls: must stay 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        collector.use_provider(self.provider)  # None: agl's own tracer, as with no provider of the user's
        self.instrumentor.instrument(skip_dep_check=True)
        run = rollout(task_id="bench")
        run.__enter__()
        try:
            yield
        finally:
            handler = self.instrumentor.handler
            self.peak_runs = max(self.peak_runs, len(handler.runs) if handler is not None else 0)
            run.__exit__(None, None, None)  # spans -> records: after the timed calls, not counted
            self.instrumentor.uninstrument()
            collector.use_provider(None)


def _profile(agl: Agl, calls: int) -> None:
    profiler = cProfile.Profile()
    with agl.active():
        profiler.enable()
        harness.time_calls(call, calls)
        profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(r"agl_core|agl_langchain|opentelemetry", 25)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="chat+tool calls per variant per round")
    parser.add_argument("--profile", action="store_true", help="also cProfile the agl variant (agl and OTel frames)")
    parser.add_argument("--no-async", action="store_true")
    args = parser.parse_args(argv)

    import openinference.instrumentation.langchain as oi

    agl, agl_sdk = Agl(), Agl(harness.sdk_provider())
    openinference = harness.OpenInference("openinference", [OIInstrumentor()])
    variants: list[harness.Variant] = [harness.Variant(), openinference, agl, agl_sdk]
    print(f"langchain-core {langchain_core.__version__}, openinference-instrumentation-langchain "
          f"{getattr(oi, '__version__', '?')}; {args.rounds} rounds x {args.calls} calls per variant")
    times = harness.interleave(variants, args.rounds, lambda: harness.time_calls(call, args.calls))
    harness.report("sync: invoke + tool.invoke", times, unit="chat+tool call", target=0.2)
    if not args.no_async:
        times = asyncio.run(harness.interleave_async(variants, args.rounds,
                                                     lambda: harness.time_calls_async(acall, args.calls)))
        harness.report("async: ainvoke + tool.ainvoke", times, unit="chat+tool call", target=0.2)
    calls = (args.rounds + 1) * args.calls * (1 if args.no_async else 2)
    leftover = len(agl.instrumentor.handler.runs) if agl.instrumentor.handler is not None else 0
    print(f"\nagl's in-flight run map after {2 * calls} chat+tool calls: peak between rounds "
          f"{max(agl.peak_runs, agl_sdk.peak_runs)}, now {leftover}")
    if args.profile:
        _profile(agl, args.calls)


if __name__ == "__main__":
    main()
