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

The variants run interleaved in rounds, in one process (the order rotates each
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
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import langchain_core
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.runnables import Runnable
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

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


class NullExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _provider() -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(NullExporter()))
    return provider


# --------------------------------------------------------------------------- variants


class Variant:
    name = "none"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        yield


class OpenInference(Variant):
    name = "openinference"

    def __init__(self) -> None:
        from openinference.instrumentation.langchain import LangChainInstrumentor as OIInstrumentor

        self.instrumentor = OIInstrumentor()
        self.provider = _provider()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.instrumentor.instrument(tracer_provider=self.provider, skip_dep_check=True)
        try:
            yield
        finally:
            self.instrumentor.uninstrument()


class Agl(Variant):
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


# --------------------------------------------------------------------------- timing


Timing = tuple[float, float]  # (wall, process CPU) µs per call of one round


def _round_sync(calls: int) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    return (time.perf_counter() - wall) / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


async def _round_async(calls: int) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        await acall()
    return (time.perf_counter() - wall) / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


Times = dict[str, list[Timing]]


def _interleave(variants: Sequence[Variant], rounds: int, run: Callable[[], Timing]) -> Times:
    times: Times = {v.name: [] for v in variants}
    for r in range(rounds + 1):  # round 0 warms up every variant and is dropped
        for i in range(len(variants)):
            variant = variants[(r + i) % len(variants)]
            with variant.active():
                timing = run()
            if r:
                times[variant.name].append(timing)
    return times


async def _interleave_async(variants: Sequence[Variant], rounds: int, calls: int) -> Times:
    # the same loop, with each variant switched on inside the task that makes the calls,
    # so the rollout context agl reads is the one the calls run in
    times: Times = {v.name: [] for v in variants}
    for r in range(rounds + 1):
        for i in range(len(variants)):
            variant = variants[(r + i) % len(variants)]
            with variant.active():
                timing = await _round_async(calls)
            if r:
                times[variant.name].append(timing)
    return times


def _report(title: str, times: Times) -> None:
    """Per variant: median µs/call, and its overhead as the median over rounds of (variant - baseline) in the
    same round, in wall time and in the process's CPU time (the steadier figure on a shared machine)."""
    base = times["none"]
    base_wall, base_cpu = (statistics.median(b[k] for b in base) for k in (0, 1))
    print(f"\n{title}  ({len(base)} rounds; µs per chat+tool call)")
    print(f"  {'variant':<14} {'wall median':>12} {'wall overhead':>22} {'CPU overhead':>22}")
    overhead: dict[str, tuple[float, float]] = {}
    for name, values in times.items():
        wall = statistics.median(v[0] for v in values)
        if name == "none":
            print(f"  {name:<14} {wall:12.1f}")
            continue
        extra = tuple(statistics.median(v[k] - b[k] for v, b in zip(values, base, strict=True)) for k in (0, 1))
        overhead[name] = (extra[0], extra[1])
        print(f"  {name:<14} {wall:12.1f} {extra[0]:+13.1f} ({extra[0] / base_wall:+6.1%})"
              f" {extra[1]:+13.1f} ({extra[1] / base_cpu:+6.1%})")
    oi = overhead.get("openinference")
    for name in ("agl", "agl-sdk"):
        if name in overhead and oi is not None:
            ratios = [f"{label} {overhead[name][k] / oi[k]:.2f}" for k, label in ((0, "wall"), (1, "CPU")) if oi[k] > 0]
            print(f"  {name} overhead / OpenInference overhead: {', '.join(ratios)}  (target <= 0.20)")


def _profile(agl: Agl, calls: int) -> None:
    profiler = cProfile.Profile()
    with agl.active():
        profiler.enable()
        _round_sync(calls)
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

    agl, agl_sdk = Agl(), Agl(_provider())
    variants: list[Variant] = [Variant(), OpenInference(), agl, agl_sdk]
    print(f"langchain-core {langchain_core.__version__}, openinference-instrumentation-langchain "
          f"{getattr(oi, '__version__', '?')}; {args.rounds} rounds x {args.calls} calls per variant")
    _report("sync: invoke + tool.invoke", _interleave(variants, args.rounds, lambda: _round_sync(args.calls)))
    if not args.no_async:
        _report("async: ainvoke + tool.ainvoke", asyncio.run(_interleave_async(variants, args.rounds, args.calls)))
    calls = (args.rounds + 1) * args.calls * (1 if args.no_async else 2)
    leftover = len(agl.instrumentor.handler.runs) if agl.instrumentor.handler is not None else 0
    print(f"\nagl's in-flight run map after {2 * calls} chat+tool calls: peak between rounds "
          f"{max(agl.peak_runs, agl_sdk.peak_runs)}, now {leftover}")
    if args.profile:
        _profile(agl, args.calls)


if __name__ == "__main__":
    main()
