"""Per-turn overhead of tracing a Microsoft Agent Framework agent: none vs the framework's own vs OpenInference vs agl.

The workload is one agent turn with one tool: ``Agent.run(...)`` where the model
asks for the ``multiply`` tool, the agent runs it and the model answers; so each
turn is two model requests and one tool call, awaited or streamed (the
framework's API is async-only). Two model clients:

- ``http``: the framework's ``OpenAIChatCompletionClient`` against a fake
  OpenAI-compatible server on 127.0.0.1 (``agl_core.testing.FakeOpenAI``,
  vLLM-like token ids on, in a child process so that the CPU figures are the
  client's);
- ``in-process``: a chat client built from the framework's own layers
  (``FunctionInvocationLayer``, ``ChatMiddlewareLayer``, ``ChatTelemetryLayer``
  on ``BaseChatClient``, as its OpenAI clients are) that answers at once, so the
  differences are not lost in the HTTP round trip's noise.

Variants, run interleaved in rounds in one process (the order is shuffled each round,
so drift on a shared machine hits all alike); a variant's overhead is the median
over rounds of its round time minus the baseline's in the same round:

- ``none``: the framework's instrumentation switched off, nothing else.
- ``framework``: the framework's own OpenTelemetry instrumentation (``invoke_agent``,
  ``chat``, ``execute_tool`` spans, sensitive data on, as a user tracing with
  Phoenix or Jaeger has it) on an SDK provider with a no-op exporter.
- ``openinference``: the same plus OpenInference's
  ``AgentFrameworkToOpenInferenceProcessor``, which is how OpenInference traces
  this framework (it rewrites the framework's spans; it has no hooks of its own).
- ``agl``: what ``agl.instrument()`` gives a user: the ``agent_framework`` plugin
  and the ``openai`` plugin beneath it (two nested LLM spans per request over HTTP,
  merged into one transition, token ids included), inside an open ``agl.rollout``,
  the framework's instrumentation off, no SDK provider (agl's own light tracer).
- ``agl-sdk``: the same with the user's SDK provider set (no-op exporter).
- ``agl+framework``: agl on top of the framework's own tracing, both on one SDK
  provider: its overhead minus ``framework``'s is what agl adds to a user who
  already traces.

Run (from the repository root, in the Agent Framework suite's environment)::

    make .venvs/agent_framework/.agl-installed
    .venvs/agent_framework/bin/pip install -r bench/requirements-agent_framework.txt
    .venvs/agent_framework/bin/python bench/agent_framework_overhead.py [--rounds 15] [--turns 30]

Target: agl's overhead at most 1/5 of the peer's (the framework's own tracing,
and OpenInference's on top of it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import warnings
from collections.abc import AsyncIterable, Iterator, Mapping, Sequence
from importlib.metadata import version
from typing import Any

from agent_framework import (
    Agent,
    BaseChatClient,
    ChatMiddlewareLayer,
    ChatResponse,
    ChatResponseUpdate,
    Content,
    FunctionInvocationLayer,
    Message,
    tool,
)
from agent_framework.observability import OBSERVABILITY_SETTINGS, ChatTelemetryLayer
from agent_framework.openai import OpenAIChatCompletionClient
from openai import AsyncOpenAI
from openinference.instrumentation.agent_framework import AgentFrameworkToOpenInferenceProcessor
from opentelemetry import trace

import agl_core as agl
import harness
from agl_core import collector

SYSTEM = "You are a careful assistant. Use the multiply tool for products."
TOOL_CALL = {"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]}


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def http_policy(body: dict[str, Any]) -> Any:
    return "6 * 7 = 42" if body["messages"][-1]["role"] == "tool" else TOOL_CALL


class InProcessClient(FunctionInvocationLayer, ChatMiddlewareLayer, ChatTelemetryLayer, BaseChatClient):
    """The framework's layers on a client that answers at once: a tool call, then the answer after the tool result."""

    OTEL_PROVIDER_NAME = "in-process"

    def __init__(self) -> None:
        super().__init__()
        self.model = "in-process"

    def _reply(self, messages: Sequence[Message]) -> Message:
        if messages and messages[-1].role == "tool":
            return Message("assistant", ["6 * 7 = 42"])
        return Message("assistant", [Content.from_function_call(call_id=f"call-{len(messages)}", name="multiply",
                                                                arguments='{"a": 6, "b": 7}')])

    def _inner_get_response(self, *, messages: Sequence[Message], stream: bool, options: Mapping[str, Any],
                            **kwargs: Any) -> Any:
        reply = self._reply(messages)
        usage = {"input_token_count": 40, "output_token_count": 8}
        if stream:
            async def updates() -> AsyncIterable[ChatResponseUpdate]:
                yield ChatResponseUpdate(role="assistant", contents=reply.contents)
                yield ChatResponseUpdate(role="assistant", contents=[Content.from_usage(usage)],
                                         finish_reason="stop")

            return self._build_response_stream(updates())

        async def respond() -> ChatResponse:
            return ChatResponse(messages=[reply], usage_details=usage, model="in-process",
                                finish_reason="tool_calls" if reply.contents[0].type == "function_call" else "stop")

        return respond()


# --------------------------------------------------------------------------- variants


@contextlib.contextmanager
def _global_provider(provider: Any) -> Iterator[None]:
    """``provider`` as the global one (the framework's tracer reads it), put back afterwards."""
    from opentelemetry.util._once import Once

    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    if provider is not None:
        trace.set_tracer_provider(provider)
    try:
        yield
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


@contextlib.contextmanager
def _framework_tracing(on: bool) -> Iterator[None]:
    OBSERVABILITY_SETTINGS.enable_instrumentation = on
    OBSERVABILITY_SETTINGS.enable_sensitive_data = on
    try:
        yield
    finally:
        OBSERVABILITY_SETTINGS.enable_instrumentation = False
        OBSERVABILITY_SETTINGS.enable_sensitive_data = False


class Framework(harness.Variant):
    """The framework's own tracing on an SDK provider (with OpenInference's processor on it, when asked)."""

    def __init__(self, name: str, openinference: bool) -> None:
        self.name = name
        self.provider = harness.sdk_provider()
        if openinference:
            self.provider.add_span_processor(AgentFrameworkToOpenInferenceProcessor())

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with _global_provider(self.provider), _framework_tracing(True):
            yield


class Agl(harness.Variant):
    def __init__(self, name: str, sdk: bool, framework: bool = False) -> None:
        self.name = name
        self.provider = harness.sdk_provider() if sdk or framework else None
        self.framework = framework
        self.spans: list[int] = []  # spans per round, from each round's rollout

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with _global_provider(self.provider if self.framework else None), _framework_tracing(self.framework):
            collector.use_provider(self.provider)
            agl.instrument(["agent_framework", "openai"])
            run = agl.rollout(task_id="bench")
            run.__enter__()
            try:
                yield
            finally:
                run.__exit__(None, None, None)
                agl.uninstrument()
                collector.use_provider(None)
                self.spans.append(len(run.rollout.spans) - 1)


class Baseline(harness.Variant):
    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with _framework_tracing(False):
            yield


# --------------------------------------------------------------------------- timing


async def _round(agent: Agent, stream: bool, turns: int) -> harness.Timing:
    async def turn() -> None:
        if stream:
            async for _ in agent.run("What is 6 * 7?", stream=True):
                pass
        else:
            await agent.run("What is 6 * 7?")

    return await harness.time_calls_async(turn, turns, warmup=1)


async def _main(args: argparse.Namespace) -> None:
    agl_default = Agl("agl", sdk=False)
    variants: list[harness.Variant] = [Baseline(), Framework("framework", False), Framework("openinference", True),
                                       agl_default, Agl("agl-sdk", sdk=True),
                                       Agl("agl+framework", sdk=True, framework=True)]
    with harness.server_process(script=http_policy, return_token_ids=True) as url:
        http = OpenAIChatCompletionClient(model="fake-model",
                                          async_client=AsyncOpenAI(base_url=url, api_key="x", max_retries=0))
        clients = {"in-process": InProcessClient(), "http": http}
        for client_name in args.clients:
            for stream in (False, True):
                agent = Agent(client=clients[client_name], name="math", instructions=SYSTEM, tools=[multiply])
                turns = args.turns * (4 if client_name == "in-process" else 1)
                times = await harness.interleave_async(variants, args.rounds, lambda a=agent, s=stream, n=turns:
                                                       _round(a, s, n))
                harness.report(f"{client_name}, {'streamed' if stream else 'awaited'}", times,
                               unit="agent turn = 2 model requests + 1 tool call",
                               peers=("framework", "openinference"), target=0.2)
                if "agl+framework" in times and "framework" in times:
                    added = statistics.median(a[1] - f[1] for a, f in zip(times["agl+framework"], times["framework"],
                                                                          strict=True))
                    print(f"  agl on top of the framework's tracing adds {added:+.1f} µs CPU per turn")
    print(f"\nagl spans per round: {statistics.median(agl_default.spans):.0f}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--turns", type=int, default=30, help="agent turns per variant per round (x4 in-process)")
    parser.add_argument("--clients", nargs="+", default=["in-process", "http"], choices=["in-process", "http"])
    args = parser.parse_args(argv)
    logging.getLogger("agent_framework").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    packages = ("agent-framework-core", "agent-framework-openai", "openai", "opentelemetry-sdk",
                "openinference-instrumentation-agent-framework")
    print(", ".join(f"{p} {version(p)}" for p in packages))
    print(f"{args.rounds} rounds x {args.turns} turns per variant (x4 in-process)")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
