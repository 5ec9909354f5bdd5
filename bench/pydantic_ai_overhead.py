"""Per-run overhead of tracing a Pydantic AI agent: no instrumentation vs Pydantic AI's own vs OpenInference vs agl.

The workload is one agent run with one tool: the model asks for the calculator, the agent
runs it, the model answers; so each run is two model requests and one tool call. Two
models: Pydantic AI's ``OpenAIChatModel`` against a fake OpenAI-compatible server on
127.0.0.1 (``agl_core.testing.FakeOpenAI``, vLLM-like token ids on, in a child process so
that the CPU figures are the client's), plain (``run``) and streamed (``run_stream``); and
``FunctionModel`` (no HTTP at all), where the framework's own work is all there is and the
instrumentations' costs stand out most.

Variants, run interleaved in rounds in one process (the order rotates each round, so
drift on a shared machine hits all alike); a variant's overhead is the median over rounds
of its round time minus the baseline's in the same round:

- ``none``: no instrumentation.
- ``pydantic-ai``: Pydantic AI's own instrumentation (``Agent.instrument_all(...)``, what
  ``logfire.instrument_pydantic_ai()`` switches on) on an SDK provider with a no-op exporter.
- ``openinference``: OpenInference's Pydantic AI integration, which is Pydantic AI's own
  instrumentation plus its ``OpenInferenceSpanProcessor`` on the same provider (it
  rewrites Pydantic AI's spans; it has no hooks of its own).
- ``openinference+openai`` (with the HTTP workloads): the same plus OpenInference's
  ``OpenAIInstrumentor``, a span of every HTTP request to the model with its wire
  messages: the like-for-like peer of ``agl``, whose ``openai`` plugin records that
  request too (with its token ids), which Pydantic AI's own instrumentation does not.
- ``agl``: what ``agl.instrument()`` gives a Pydantic AI user: the ``pydantic_ai`` plugin
  and the ``openai`` plugin beneath it (two nested LLM spans per request, merged into one
  transition, token ids included), inside an open ``agl.rollout``, with no SDK provider
  set (agl's own light tracer records the spans).
- ``agl-sdk``: the same, with the user's SDK provider set (no-op exporter): every agl span
  also goes through the OpenTelemetry SDK.
- ``agl-pydantic-ai``: the ``pydantic_ai`` plugin alone (no token ids), light tracer.

Run (from the repository root, in the Pydantic AI suite's environment)::

    make .venvs/pydantic_ai/.agl-installed
    .venvs/pydantic_ai/bin/pip install -r bench/requirements-pydantic_ai.txt
    .venvs/pydantic_ai/bin/python bench/pydantic_ai_overhead.py [--rounds 15] [--runs 30] [--no-http]

Target: agl's overhead at most 1/5 of Pydantic AI's own instrumentation's (and of OpenInference's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import statistics
import warnings
from collections.abc import Iterator, Sequence
from importlib.metadata import version
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings

import agl_core as agl
import harness
from agl_core import collector

SYSTEM = "You are a careful assistant. Use the calculator for arithmetic."
SCRIPT = [{"tool_calls": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]}, "6 * 7 = 42."]


def calculator(expression: str) -> str:
    """Evaluate a product of two integers such as '6 * 7'."""
    left, right = expression.split("*")
    return str(int(left) * int(right))


def scripted(messages: list[Any], info: AgentInfo) -> ModelResponse:
    """The FunctionModel's policy: ask for the calculator, then answer with its result."""
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart("calculator", {"expression": "6 * 7"}, tool_call_id="c1")])
    return ModelResponse(parts=[TextPart("6 * 7 = 42.")])


# --------------------------------------------------------------------------- variants


class PydanticAI(harness.Variant):
    """Pydantic AI's own instrumentation for every agent, on its own SDK provider (plus OpenInference's processor,
    and its OpenAI instrumentor for a span of each HTTP request, as agl's ``openai`` plugin makes)."""

    def __init__(self, name: str, openinference: bool, openai: bool = False) -> None:
        self.name = name
        self.provider = harness.sdk_provider()
        if openinference:
            from openinference.instrumentation.pydantic_ai import OpenInferenceSpanProcessor

            self.provider.add_span_processor(OpenInferenceSpanProcessor())
        self.settings = InstrumentationSettings(tracer_provider=self.provider)
        self.openai: Any = None
        if openai:
            from openinference.instrumentation.openai import OpenAIInstrumentor

            self.openai = OpenAIInstrumentor()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        Agent.instrument_all(self.settings)
        if self.openai is not None:
            self.openai.instrument(tracer_provider=self.provider, skip_dep_check=True)
        try:
            yield
        finally:
            if self.openai is not None:
                self.openai.uninstrument()
            Agent.instrument_all(False)


class Agl(harness.Variant):
    def __init__(self, name: str, plugins: list[str], sdk: bool) -> None:
        self.name = name
        self.plugins = plugins
        self.provider = harness.sdk_provider() if sdk else None
        self.spans: list[int] = []  # spans per round, from each round's rollout

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        collector.use_provider(self.provider)
        agl.instrument(self.plugins)
        run = agl.rollout(task_id="bench")
        run.__enter__()
        try:
            yield
        finally:
            run.__exit__(None, None, None)
            agl.uninstrument()
            collector.use_provider(None)
            self.spans.append(len(run.rollout.spans) - 1)


def variant(name: str) -> harness.Variant:
    """One of this benchmark's variants by its name (``opcodes.py`` and ``instructions.py`` count them one by one)."""
    if name == "none":
        return harness.Variant()
    if name == "agl":
        return Agl(name, ["pydantic_ai", "openai"], sdk=False)
    if name == "agl-pydantic-ai":
        return Agl(name, ["pydantic_ai"], sdk=False)
    if name in ("pydantic-ai", "openinference", "openinference+openai"):
        return PydanticAI(name, openinference=name != "pydantic-ai", openai=name == "openinference+openai")
    raise ValueError(f"no variant named {name!r}")


# --------------------------------------------------------------------------- the workloads


def _agent(model: Any) -> Agent[None, str]:
    return Agent(model, name="math", instructions=SYSTEM, tools=[calculator])


async def _round(agent: Agent[None, str], runs: int, stream: bool) -> harness.Timing:
    async def one() -> None:
        if stream:
            async with agent.run_stream("What is 6 * 7?") as result:
                await result.get_output()
        else:
            await agent.run("What is 6 * 7?")

    return await harness.time_calls_async(one, runs, warmup=1)


def _chat_model(url: str) -> Any:
    from openai import AsyncOpenAI
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    return OpenAIChatModel("fake-model", provider=OpenAIProvider(openai_client=client))


async def _main(args: argparse.Namespace) -> None:
    agl_default = Agl("agl", ["pydantic_ai", "openai"], sdk=False)
    variants: list[harness.Variant] = [
        harness.Variant(), PydanticAI("pydantic-ai", openinference=False), PydanticAI("openinference", True),
        agl_default, Agl("agl-sdk", ["pydantic_ai", "openai"], sdk=True),
        Agl("agl-pydantic-ai", ["pydantic_ai"], sdk=False)]
    if args.http:
        variants.insert(3, PydanticAI("openinference+openai", True, openai=True))
    peers = ("pydantic-ai", "openinference", "openinference+openai")
    turn = iter(range(10**9))

    def script(body: dict[str, Any]) -> Any:
        return SCRIPT[next(turn) % 2]

    with harness.server_process(script=script, return_token_ids=True) as url:
        workloads = [("FunctionModel, run (no HTTP)", FunctionModel(scripted), False),
                     ("OpenAIChatModel on the fake server, run", _chat_model(url), False),
                     ("OpenAIChatModel on the fake server, run_stream", _chat_model(url), True)]
        for label, model, stream in workloads if args.http else workloads[:1]:
            agent = _agent(model)
            times = await harness.interleave_async(variants, args.rounds,
                                                   functools.partial(_round, agent, args.runs, stream))
            harness.report(label, times, unit="agent run = 2 model requests + 1 tool call", peers=peers,
                           target=0.2, best_rounds=True)
    print(f"\nagl spans per run (HTTP rounds included): {statistics.median(agl_default.spans) / args.runs:.1f}"
          " (agent, 2 x 2 LLM spans merged into 2 transitions, 1 tool span)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=30, help="agent runs per variant per round")
    parser.add_argument("--no-http", dest="http", action="store_false",
                        help="only the FunctionModel workload (the framework's own work, no HTTP)")
    args = parser.parse_args(argv)
    logging.getLogger("pydantic_ai").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    packages = ("pydantic-ai-slim", "openai", "opentelemetry-sdk", "openinference-instrumentation-pydantic-ai",
                "openinference-instrumentation-openai")
    print(", ".join(f"{p} {version(p)}" for p in packages))
    print(f"{args.rounds} rounds x {args.runs} runs per variant")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
