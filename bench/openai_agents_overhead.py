"""Per-turn overhead of tracing an OpenAI Agents SDK agent: no instrumentation vs OpenInference vs agl.

One process; the workload is one agent turn with one tool: the model asks for
the tool, the tool runs, the model answers (two model calls, one tool call),
through ``Runner.run_sync`` (sync) and ``await Runner.run`` (async). Two models:

- ``http``: ``OpenAIChatCompletionsModel`` talking to the fake OpenAI-compatible
  server on 127.0.0.1 (``agl_core.testing.FakeOpenAI``), as a real agent does;
- ``in-process``: a ``Model`` subclass answering at once from a script, with the
  same ``generation_span`` the SDK's own models open, so no network time hides
  the instrumentation's cost (the steadier figure on a noisy machine).

Variants, interleaved in rounds (the order is shuffled each round) so drift on a
shared machine hits all of them alike; each round gives µs per turn per
variant, and a variant's overhead is the median over rounds of its round time
minus the baseline's in the same round:

- ``none``: the SDK as a user has it, tracing on, with no trace processor
  (nothing is exported anywhere);
- ``openinference``: ``openinference-instrumentation-openai-agents`` (a trace
  processor) on an OpenTelemetry SDK provider with a no-op exporter;
- ``agl``: the agl ``openai_agents`` plugin alone, spans collected into an open
  rollout, on an SDK provider with the same no-op exporter;
- ``agl-own-tracer``: the same, with no SDK provider: what a user who has set
  none gets (agl then records its spans with its own light tracer).

Run (the suite's environment has the SDK; the bench adds OpenInference)::

    make .venvs/openai_agents/.agl-installed
    .venvs/openai_agents/bin/pip install -r bench/requirements-openai_agents.txt
    .venvs/openai_agents/bin/python bench/openai_agents_overhead.py [--rounds 15] [--turns 40] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import agents
from agents import (
    Agent,
    ModelResponse,
    OpenAIChatCompletionsModel,
    Runner,
    Usage,
    function_tool,
    generation_span,
    set_trace_processors,
)
from agents.models.interface import Model
from openai import AsyncOpenAI
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor as OIInstrumentor

import harness
from agl_core import collector, rollout
from agl_core.testing import FakeOpenAI
from agl_openai_agents import OpenAIAgentsInstrumentor

QUESTION = "What is the weather in Paris today?"
ANSWER = "It is sunny in Paris, 21 degrees."


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 C."


def script(body: dict[str, Any]) -> Any:
    """The fake server's replies for every turn: the tool call, then (once the tool answered) the answer."""
    if body["messages"][-1]["role"] == "tool":
        return ANSWER
    return {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}


class InProcessModel(Model):
    """A model answering at once from the same script, opening the generation span the SDK's models open."""

    model = "in-process"

    async def get_response(self, system_instructions: str | None, input: Any, model_settings: Any, tools: Any,
                           output_schema: Any, handoffs: Any, tracing: Any, **kwargs: Any) -> ModelResponse:
        asked = isinstance(input, list) and any(
            (item.get("type") if isinstance(item, dict) else None) == "function_call_output" for item in input)
        if asked:
            output: list[Any] = [ResponseOutputMessage(
                id="msg_1", type="message", role="assistant", status="completed",
                content=[ResponseOutputText(type="output_text", text=ANSWER, annotations=[])])]
        else:
            output = [ResponseFunctionToolCall(type="function_call", id="fc_1", call_id=f"call_{id(input)}",
                                               name="get_weather", arguments='{"city": "Paris"}',
                                               status="completed")]
        with generation_span(model=self.model, input=input if isinstance(input, list) else [],
                             disabled=tracing.is_disabled()) as span:
            span.span_data.output = [o.model_dump() for o in output]
            span.span_data.usage = {"input_tokens": 40, "output_tokens": 12}
        return ModelResponse(output=output, usage=Usage(requests=1, input_tokens=40, output_tokens=12,
                                                        total_tokens=52), response_id=None)

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError
        yield


# --------------------------------------------------------------------------- variants


class OpenInference(harness.OpenInference):
    """OpenInference's trace processor; once it is off, the SDK is left with no processor, as for ``none``."""

    def __init__(self) -> None:
        super().__init__("openinference", [OIInstrumentor()])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        try:
            with super().active():
                yield
        finally:
            set_trace_processors([])


class Agl(harness.Variant):
    """agl's plugin; ``sdk_provider`` False is agl's default when the user set no SDK provider: its own tracer."""

    def __init__(self, sdk_provider: bool = True) -> None:
        self.name = "agl" if sdk_provider else "agl-own-tracer"
        self.instrumentor = OpenAIAgentsInstrumentor()
        self.provider = harness.sdk_provider() if sdk_provider else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        collector.use_provider(self.provider)
        self.instrumentor.instrument(skip_dep_check=True)
        try:
            with rollout(task_id="bench"):  # spans are collected as in a real rollout (store=None)
                yield
        finally:
            self.instrumentor.uninstrument()


# --------------------------------------------------------------------------- timing


def _round_sync(agent: Agent[Any], turns: int) -> harness.Timing:
    return harness.time_calls(lambda: Runner.run_sync(agent, QUESTION), turns)


async def _round_async(agent: Agent[Any], turns: int) -> harness.Timing:
    return await harness.time_calls_async(lambda: Runner.run(agent, QUESTION), turns)


def _report(title: str, times: harness.Times) -> None:
    harness.report(title, times, unit="agent turn = 2 model calls + 1 tool call", best_rounds=True)


def _profile(agent: Agent[Any], agl: Agl, turns: int) -> None:
    profiler = cProfile.Profile()
    with agl.active():
        profiler.enable()
        _round_sync(agent, turns)
        profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(r"agl_core|agl_openai_agents|opentelemetry", 25)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--turns", type=int, default=40, help="agent turns per variant per round")
    parser.add_argument("--profile", action="store_true", help="also cProfile the agl variant (in-process model)")
    parser.add_argument("--no-http", action="store_true", help="only the in-process model")
    args = parser.parse_args(argv)

    os.environ.pop("OPENAI_API_KEY", None)  # nothing may ever be exported to the vendor ...
    set_trace_processors([])  # ... and tracing stays on with no processor: the SDK's default exporter is gone
    variants: list[harness.Variant] = [harness.Variant(), OpenInference(), Agl(), Agl(sdk_provider=False)]
    print(f"openai-agents {agents.__version__}, {args.rounds} rounds x {args.turns} turns per variant")

    in_process = Agent(name="Forecaster", instructions="Answer briefly.", tools=[get_weather],
                       model=InProcessModel())
    _report("in-process model, sync (Runner.run_sync)",
            harness.interleave(variants, args.rounds, lambda: _round_sync(in_process, args.turns)))
    _report("in-process model, async (await Runner.run)",
            asyncio.run(harness.interleave_async(variants, args.rounds, lambda: _round_async(in_process, args.turns))))

    if not args.no_http:
        with FakeOpenAI(script=script) as srv:
            async def http_round() -> harness.Times:  # the client's connections belong to this one loop
                client = AsyncOpenAI(base_url=srv.url, api_key="not-a-key", max_retries=0)
                agent = Agent(name="Forecaster", instructions="Answer briefly.", tools=[get_weather],
                              model=OpenAIChatCompletionsModel("fake-model", client))
                return await harness.interleave_async(variants, args.rounds, lambda: _round_async(agent, args.turns))

            _report("OpenAIChatCompletionsModel over HTTP to the fake server, async (await Runner.run)",
                    asyncio.run(http_round()))
    if args.profile:
        _profile(in_process, variants[2], args.turns)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
