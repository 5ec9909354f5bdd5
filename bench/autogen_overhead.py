"""Per-turn overhead of tracing an AutoGen agent: no instrumentation vs OpenInference vs agl.

The workload is one agent turn with one tool: ``AssistantAgent.run(task=...)`` on
``autogen_ext``'s ``OpenAIChatCompletionClient`` against a fake OpenAI-compatible
server on 127.0.0.1 (``agl_core.testing.FakeOpenAI``, vLLM-like token ids on): the
model asks for the calculator, the agent runs it and answers with the tool's
summary; so each turn is one model request and one tool call. The agent's context
is reset between turns. AutoGen is async-only, so the two modes are the agent's
two model paths: ``create`` and ``create_stream`` (``model_client_stream=True``).

Variants, run interleaved in rounds in one process (the order is shuffled each round,
so drift on a shared machine hits all alike); a variant's overhead is the median
over rounds of its round time minus the baseline's in the same round:

- ``none``: no instrumentation.
- ``openinference``: ``openinference-instrumentation-autogen-agentchat`` (agent,
  tool and OpenAI-client spans) on an SDK provider with a no-op exporter.
- ``agl``: what ``agl.instrument()`` gives an AutoGen user: the ``autogen`` plugin
  and the ``openai`` plugin beneath it (two nested LLM spans per request, merged
  into one transition, token ids included), inside an open ``agl.rollout``, with
  no SDK provider set (agl's own light tracer records the spans).
- ``agl-sdk``: the same, with the user's SDK provider set (no-op exporter): every
  agl span also goes through the OpenTelemetry SDK.
- ``agl-autogen``: the ``autogen`` plugin alone (no token ids), light tracer.

Run (from the repository root, in the AutoGen suite's environment)::

    make .venvs/autogen/.agl-installed
    .venvs/autogen/bin/pip install -r bench/requirements-autogen.txt
    .venvs/autogen/bin/python bench/autogen_overhead.py [--rounds 15] [--turns 40] [--profile]

On a shared machine the end-to-end differences (a few hundred µs on a turn of
several ms) drown in noise, so the bench then times the hooks alone, each around a
stand-in that answers at once (no HTTP, no AutoGen internals): an agent's
``on_messages_stream`` that makes one model call and one tool call, as a turn does,
with agl's and OpenInference's wrappers on the same three methods.

Target: agl's hooks at most 1/5 of OpenInference's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import logging
import pstats
import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from importlib.metadata import version
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_core import CancellationToken
from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient
from openinference.instrumentation.autogen_agentchat import AutogenAgentChatInstrumentor

import agl_core as agl
import harness
from agl_core import collector
from agl_core.testing import FakeOpenAI

INFO = ModelInfo(vision=False, function_calling=True, json_output=False, family=ModelFamily.UNKNOWN,
                 structured_output=False)
SYSTEM = "You are a careful assistant. Use the calculator for arithmetic."
TOOL_CALL = {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]}


def calculator(expression: str) -> str:
    """Evaluate a product of two integers such as '6 * 7'."""
    left, right = expression.split("*")
    return str(int(left) * int(right))


# --------------------------------------------------------------------------- variants


class Agl(harness.Variant):
    def __init__(self, name: str, plugins: list[str], sdk: bool) -> None:
        self.name = name
        self.plugins = plugins
        self.provider = harness.sdk_provider() if sdk else None
        self.spans: list[int] = []  # spans per turn, from each round's rollout

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


# --------------------------------------------------------------------------- timing


async def _round(agent: AssistantAgent, turns: int) -> harness.Timing:
    token = CancellationToken()

    async def turn() -> None:
        await agent.run(task="What is 6 * 7?")
        await agent.on_reset(token)

    return await harness.time_calls_async(turn, turns)


def _agent(url: str, stream: bool) -> AssistantAgent:
    client = OpenAIChatCompletionClient(model="fake-model", base_url=url, api_key="x", max_retries=0,
                                        model_info=INFO, extra_body={"return_token_ids": True})
    return AssistantAgent("math", model_client=client, tools=[calculator], system_message=SYSTEM,
                          model_client_stream=stream)


# --------------------------------------------------------------------------- the hooks alone


def stand_in_turns() -> dict[str, Any]:
    """One turn per instrumentation, made of its wrappers around stand-ins of the three methods a turn calls."""
    from autogen_agentchat.base import Response
    from autogen_agentchat.messages import TextMessage, ToolCallExecutionEvent, ToolCallRequestEvent
    from autogen_core import FunctionCall
    from autogen_core.models import (
        AssistantMessage,
        CreateResult,
        FunctionExecutionResult,
        FunctionExecutionResultMessage,
        RequestUsage,
        SystemMessage,
        UserMessage,
    )
    from autogen_core.tools import FunctionTool
    from openinference.instrumentation import OITracer, TraceConfig
    from openinference.instrumentation.autogen_agentchat import _wrappers as oi

    from agl_autogen import AutoGenInstrumentor

    client = OpenAIChatCompletionClient(model="fake-model", base_url="http://127.0.0.1:9/v1", api_key="x",
                                        model_info=INFO)
    agent = AssistantAgent("math", model_client=client, tools=[calculator])
    tools = [FunctionTool(calculator, description="calculator").schema]
    call = FunctionCall(id="call_1", name="calculator", arguments='{"expression": "6 * 7"}')
    history = [SystemMessage(content=SYSTEM), UserMessage(content="What is 2 * 3?", source="user"),
               AssistantMessage(content=[call], source="math"),
               FunctionExecutionResultMessage(content=[FunctionExecutionResult(content="6", name="calculator",
                                                                               call_id="call_1")]),
               AssistantMessage(content="6", source="math")]
    usage = RequestUsage(prompt_tokens=40, completion_tokens=12)
    result = CreateResult(finish_reason="function_calls", content=[call], usage=usage, cached=False)
    outcome = (call, FunctionExecutionResult(content="42", name="calculator", call_id="call_1", is_error=False))
    events = [ToolCallRequestEvent(content=[call], source="math"),
              ToolCallExecutionEvent(content=[outcome[1]], source="math")]
    response = Response(chat_message=TextMessage(content="42", source="math"))
    counter = iter(range(10**9))

    async def create(self: Any, messages: Any, *, tools: Any = (), tool_choice: Any = "auto", json_output: Any = None,
                     extra_create_args: Any = {}, cancellation_token: Any = None) -> Any:  # noqa: B006
        return result

    async def execute_tool_call(**kwargs: Any) -> Any:
        return outcome

    def make_turn(create_: Any, tool_: Any, wrap_stream: Any) -> Any:
        async def on_messages_stream(self: Any, messages: Any, cancellation_token: Any) -> Any:
            question = UserMessage(content=f"What is 6 * 7? (turn {next(counter)})", source="user")
            await create_(client, [*history, question], tools=tools)
            yield events[0]
            await tool_(tool_call=call, workbench=[], handoff_tools=[], agent_name="math",
                        cancellation_token=None, stream=None)
            yield events[1]
            yield response

        stream = wrap_stream(on_messages_stream)
        task = [TextMessage(content="What is 6 * 7?", source="user")]

        async def turn() -> None:
            async for _ in stream(agent, task, None):
                pass

        return turn

    plain = make_turn(create, execute_tool_call, lambda fn: fn)

    oi_tracer: Any = OITracer(harness.sdk_provider().get_tracer("bench"), config=TraceConfig())
    oi_create_hook = oi._BaseOpenAIChatCompletionClientCreateWrapper(oi_tracer)
    oi_tool_hook = oi._AssistantAgentExecuteToolCallWrapper(oi_tracer)
    oi_stream_hook = oi._AssistantAgentOnMessagesStreamWrapper(oi_tracer)

    async def oi_create(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await oi_create_hook(create.__get__(self), self, args, kwargs)

    async def oi_tool(**kwargs: Any) -> Any:
        return await oi_tool_hook(execute_tool_call, None, (), kwargs)

    def oi_wrap_stream(fn: Any) -> Any:
        return lambda self, *args: oi_stream_hook(fn.__get__(self), self, args, {})

    openinference = make_turn(oi_create, oi_tool, oi_wrap_stream)

    plugin = AutoGenInstrumentor()  # its wrappers, made directly: only plugin._active must be on to time them
    ours = make_turn(plugin._wrap_create(create), plugin._wrap_execute_tool_call(execute_tool_call),
                     plugin._wrap_on_messages_stream)
    return {"none": plain, "openinference": openinference, "agl": ours}


async def _hooks_alone(turns: int, rounds: int) -> None:
    """Each instrumentation's wrappers around stand-ins of the three methods a turn goes through."""
    from agl_autogen import AutoGenInstrumentor

    made = stand_in_turns()
    plain, openinference, ours = made["none"], made["openinference"], made["agl"]
    plugin = AutoGenInstrumentor()
    was_active = plugin._active
    plugin._active = True
    sdk = harness.sdk_provider()

    async def timed(turn: Any) -> float:
        start = time.perf_counter()
        for _ in range(turns):
            await turn()
        return (time.perf_counter() - start) / turns * 1e6

    times: dict[str, list[float]] = {"none": [], "openinference": [], "agl": [], "agl-sdk": []}
    try:
        for r in range(rounds + 1):
            samples = {"none": await timed(plain), "openinference": await timed(openinference)}
            for name, provider in (("agl", None), ("agl-sdk", sdk)):
                collector.use_provider(provider)
                async with agl.rollout(task_id="bench-hooks"):
                    samples[name] = await timed(ours)
                collector.use_provider(None)
            if r:
                for name, value in samples.items():
                    times[name].append(value)
    finally:
        plugin._active = was_active
    base = statistics.median(times["none"])
    oi_cost = statistics.median(times["openinference"]) - base
    print(f"\nhooks alone (stand-ins, no HTTP; one turn = agent stream + model call + tool call), µs per turn:"
          f"  none {base:.1f}")
    print(f"  openinference {oi_cost:+.1f}")
    for name in ("agl", "agl-sdk"):
        cost = statistics.median(times[name]) - base
        print(f"  {name:<13} {cost:+.1f}   {name} / openinference = {cost / oi_cost:.2f}")


async def _profile(agent: AssistantAgent, variant: harness.Variant, turns: int) -> None:
    profiler = cProfile.Profile()
    with variant.active():
        profiler.enable()
        await _round(agent, turns)
        profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(r"agl_autogen|agl_core", 30)


async def _main(args: argparse.Namespace) -> None:
    agl_default = Agl("agl", ["autogen", "openai"], sdk=False)
    openinference = harness.OpenInference("openinference", [AutogenAgentChatInstrumentor()])
    variants: list[harness.Variant] = [harness.Variant(), openinference, agl_default,
                                       Agl("agl-sdk", ["autogen", "openai"], sdk=True),
                                       Agl("agl-autogen", ["autogen"], sdk=False)]
    if args.hooks_only:
        await _hooks_alone(args.turns * 10, args.rounds)
        return
    with FakeOpenAI(script=lambda body: TOOL_CALL) as srv:
        for stream in (False, True):
            agent = _agent(srv.url, stream)
            times = await harness.interleave_async(variants, args.rounds, functools.partial(_round, agent, args.turns))
            harness.report("create_stream (model_client_stream=True)" if stream else "create", times,
                           unit="agent turn = 1 model request + 1 tool call")
        print(f"\nagl spans per turn: {statistics.median(agl_default.spans) / args.turns:.1f}"
              " (2 LLM spans merged into one transition, 1 tool span)")
        await _hooks_alone(args.turns * 10, args.rounds)
        if args.profile:
            await _profile(_agent(srv.url, False), agl_default, args.turns)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--turns", type=int, default=40, help="agent turns per variant per round")
    parser.add_argument("--profile", action="store_true", help="also cProfile the agl variant (agl frames)")
    parser.add_argument("--hooks-only", action="store_true", help="time the hooks alone, skip the end-to-end rounds")
    args = parser.parse_args(argv)
    logging.getLogger("autogen_core").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    packages = ("autogen-agentchat", "autogen-core", "autogen-ext", "openai", "opentelemetry-sdk",
                "openinference-instrumentation-autogen-agentchat")
    print(", ".join(f"{p} {version(p)}" for p in packages))
    print(f"{args.rounds} rounds x {args.turns} turns per variant")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
