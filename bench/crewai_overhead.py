"""Per-kickoff overhead of tracing a CrewAI crew: no instrumentation vs OpenInference vs agl.

The workload is one crew with one agent, one task and one tool: each kickoff
makes two LLM calls (the model asks for the tool, then answers) and one tool
call. Two LLMs serve it:

- ``http``: crewai's native OpenAI provider against the fake OpenAI-compatible
  server on 127.0.0.1 (``agl_core.testing.FakeOpenAI``, vLLM-like token ids on),
  as a user's crew talks to a model server;
- ``offline``: a ``BaseLLM`` subclass that answers at once, so the figure is
  crewai's own machinery plus the instrumentation, with no HTTP noise.

Variants, interleaved in rounds in one process (the order is shuffled each round,
so drift on a noisy machine hits all alike); a variant's overhead is the median
over rounds of its round time minus the baseline's in the same round:

- ``none``: crewai as is;
- ``openinference``: ``openinference-instrumentation-crewai`` (crew, task,
  agent and tool spans; no LLM spans, as it ships) on an SDK provider with a
  no-op exporter;
- ``oi+openai``: the same plus ``openinference-instrumentation-openai``, the
  way an OpenInference user gets LLM spans (``http`` only: the offline LLM
  makes no client call);
- ``agl``: agl's ``crewai`` and ``openai`` plugins inside an open
  ``agl.rollout``, on agl's own tracer (no SDK provider set, as most users run);
- ``agl+sdk``: the same beside a user's SDK provider with the no-op exporter.

Sync (``crew.kickoff()``) and async (``await crew.akickoff()``) both run.
CrewAI's telemetry and tracing are off (``CREWAI_DISABLE_TELEMETRY``,
``CREWAI_TRACING_ENABLED``), and its app data goes to a temporary folder, as in
the test suite. The end-to-end figures move by a few milliseconds from round to
round on a shared machine (a kickoff is tens of milliseconds of crewai's own
work), so the hooks-alone figure is the one to compare instrumentations by.

Run it in the CrewAI suite's environment::

    make .venvs/crewai/.agl-installed
    .venvs/crewai/bin/pip install -r bench/requirements-crewai.txt
    .venvs/crewai/bin/python bench/crewai_overhead.py [--rounds 15] [--kickoffs 10] [--profile]

Target: agl's overhead at most that of OpenInference, though agl records more
(an LLM span per call, with messages, for training).
"""

from __future__ import annotations

import os
import tempfile

os.environ["CREWAI_DISABLE_TELEMETRY"] = "true"
os.environ["CREWAI_TRACING_ENABLED"] = "false"
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ.setdefault("XDG_DATA_HOME", tempfile.mkdtemp(prefix="agl-crewai-bench-"))  # crewai's kickoff records

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import logging  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from datetime import datetime  # noqa: E402
from importlib.metadata import version  # noqa: E402
from typing import Any  # noqa: E402

from crewai.agent.core import Agent  # noqa: E402
from crewai.crew import Crew  # noqa: E402
from crewai.llm import LLM  # noqa: E402
from crewai.llms.base_llm import BaseLLM  # noqa: E402
from crewai.task import Task  # noqa: E402
from crewai.tools import tool  # noqa: E402
from openinference.instrumentation.crewai import CrewAIInstrumentor as OICrewAI  # noqa: E402
from openinference.instrumentation.openai import OpenAIInstrumentor as OIOpenAI  # noqa: E402

import agl_core as agl  # noqa: E402
import harness  # noqa: E402
from agl_core import collector  # noqa: E402
from agl_core.openai_client import OpenAIInstrumentor  # noqa: E402
from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_crewai import CrewAIInstrumentor  # noqa: E402

ANSWER = "The answer is 42."
TOOL_CALL = {"tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]}


@tool("multiply")
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def _reply(body: dict[str, Any]) -> Any:
    """The fake model: ask for the tool on a fresh task, answer once the tool result is in."""
    return TOOL_CALL if body["messages"][-1]["role"] == "user" else ANSWER


class InstantLLM(BaseLLM):
    """An LLM that answers at once, in the native tool-call shape crewai's executor expects from OpenAI."""

    def supports_function_calling(self) -> bool:
        return True

    def call(self, messages: Any, tools: Any = None, callbacks: Any = None, available_functions: Any = None,
             from_task: Any = None, from_agent: Any = None, response_model: Any = None) -> Any:
        if messages[-1]["role"] == "user":
            return [{"id": "call_1", "type": "function",
                     "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]
        return ANSWER

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)


def _crew(llm: Any) -> Crew:
    agent = Agent(role="Calculator", goal="compute exactly", backstory="A careful mathematician.", llm=llm,
                  tools=[multiply])
    task = Task(description="What is 6*7?", expected_output="a number", agent=agent, name="multiply")
    return Crew(agents=[agent], tasks=[task], name="calc crew")


# --------------------------------------------------------------------------- variants


def _openinference(with_openai: bool) -> harness.Variant:
    """OpenInference's crewai instrumentor, plus its openai one: the way an OpenInference user gets LLM spans."""
    if with_openai:
        return harness.OpenInference("oi+openai", [OICrewAI(), OIOpenAI()])
    return harness.OpenInference("openinference", [OICrewAI()])


class Agl(harness.Variant):
    """agl's ``crewai`` and ``openai`` plugins inside one open ``agl.rollout`` per round."""

    def __init__(self, sdk: bool) -> None:
        self.name = "agl+sdk" if sdk else "agl"
        self.provider = harness.sdk_provider() if sdk else None
        self.plugins = [CrewAIInstrumentor(), OpenAIInstrumentor()]
        self.spans: list[int] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        collector.use_provider(self.provider)
        for plugin in self.plugins:
            plugin.instrument(tracer_provider=self.provider, skip_dep_check=True)
        run = agl.rollout("bench")
        try:
            with run:
                yield
        finally:
            for plugin in self.plugins:
                plugin.uninstrument()
            collector.use_provider(None)
            self.spans.append(len(run.rollout.spans))


# --------------------------------------------------------------------------- hooks alone


def _hooks_alone(srv: FakeOpenAI, calls: int) -> None:
    """Each instrumentation's own work for one kickoff: crewai's real objects, nothing of crewai running.

    A kickoff's call tree is replayed with stand-ins that return at once what crewai would return, once bare
    and once through each instrumentation's wrappers; the difference is that instrumentation's cost.
    OpenInference wraps ``Crew.kickoff``, ``Task._execute_core`` and ``BaseTool.run``. agl wraps
    ``Crew.kickoff``, ``Task._execute_core``, ``Agent.execute_task`` and the LLM's ``call`` (twice), and
    reads the events crewai emits (about twenty per kickoff; it acts on four of them here). Far steadier
    than the end-to-end difference, which a crew's own tens of milliseconds per kickoff drown.
    """
    from crewai.events.types.llm_events import LLMCallCompletedEvent, LLMCallStartedEvent, LLMCallType
    from crewai.events.types.tool_usage_events import ToolUsageFinishedEvent, ToolUsageStartedEvent
    from openinference.instrumentation import OITracer, TraceConfig
    from openinference.instrumentation.crewai._wrappers import (
        _BaseToolRunWrapper,
        _CrewKickoffWrapper,
        _ExecuteCoreWrapper,
    )

    from agl_crewai import instrumentor as hooks

    crew = _crew(LLM(model="gpt-4o", base_url=srv.url, api_key="x", max_retries=0))
    output = crew.kickoff()  # a real run: its output, and its two requests' messages and tools
    task, agent = crew.tasks[0], crew.agents[0]
    llm, tool_obj = agent.llm, agent.tools[0]
    first, second = (r.body for r in srv.requests[-2:])
    tools = first["tools"]
    now = datetime.now()
    noise = LLMCallStartedEvent(messages=first["messages"], model="gpt-4o", call_id="c")
    replies = ([{"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": '{"a":6,"b":7}'}}],
               ANSWER)
    completed = [LLMCallCompletedEvent(response=r, call_type=LLMCallType.LLM_CALL, model="gpt-4o", call_id="c",
                                       usage={"prompt_tokens": 40, "completion_tokens": 6}, finish_reason="stop",
                                       response_id="chatcmpl-1") for r in replies]
    tool_started = ToolUsageStartedEvent(tool_name="multiply", tool_args={"a": 6, "b": 7}, agent_key="k")
    tool_finished = ToolUsageFinishedEvent(tool_name="multiply", tool_args={"a": 6, "b": 7}, agent_key="k",
                                           output="42", started_at=now, finished_at=now)

    def agl_tree(wrap: bool) -> Callable[[], Any]:
        plugin = CrewAIInstrumentor()
        plugin._events = {LLMCallCompletedEvent: hooks._on_llm_completed,
                          ToolUsageStartedEvent: hooks._on_tool_started,
                          ToolUsageFinishedEvent: hooks._on_tool_finished}
        plugin._sanitize = str
        plugin._active = True

        def span(fn: Callable[..., Any], describe: Any) -> Callable[..., Any]:
            return plugin._span_wrapper(fn, describe=describe, site="bench") if wrap else fn

        def bare_emit(bus: Any, source: Any, event: Any) -> None:
            return None

        emit = plugin._emit_wrapper(bare_emit) if wrap else bare_emit

        def llm_call(model: Any, messages: Any, tools: Any = None, from_agent: Any = None, turn: int = 0) -> Any:
            emit(None, model, noise)
            emit(None, model, completed[turn])
            return replies[turn]

        llm_traced = plugin._llm_sync_wrapper(llm_call) if wrap else llm_call

        def execute_task(a: Any, t: Any, context: Any = None, tools_: Any = None) -> Any:
            for _ in range(16):  # the other events crewai emits during a kickoff: agl only looks them up
                emit(None, a, noise)
            llm_traced(llm, first["messages"], tools=tools, from_agent=a, turn=0)
            emit(None, a, tool_started)
            emit(None, a, tool_finished)
            llm_traced(llm, second["messages"], tools=tools, from_agent=a, turn=1)
            return ANSWER

        agent_traced = span(execute_task, hooks._describe_agent_task)

        def execute_core(t: Any, a: Any, context: Any = None, tools_: Any = None) -> Any:
            return agent_traced(a, t)

        task_traced = span(execute_core, hooks._describe_task)

        def kickoff(c: Any, inputs: Any = None) -> Any:
            task_traced(task, agent)
            return output

        crew_traced = span(kickoff, hooks._describe_crew)
        return lambda: crew_traced(crew)

    def oi_tree(wrap: bool) -> Callable[[], Any]:
        tracer: Any = OITracer(harness.sdk_provider().get_tracer("bench"), config=TraceConfig())
        crew_hook, task_hook, tool_hook = (_CrewKickoffWrapper(tracer), _ExecuteCoreWrapper(tracer),
                                           _BaseToolRunWrapper(tracer))

        def tool_run(*args: Any, **kwargs: Any) -> Any:
            return 42

        def execute_core(agent: Any, context: Any, tools_: Any) -> Any:
            if wrap:
                tool_hook(tool_run, tool_obj, (), {"a": 6, "b": 7})
            else:
                tool_run(a=6, b=7)
            return task.output

        def kickoff(inputs: Any = None) -> Any:
            if wrap:
                task_hook(execute_core, task, (agent, None, None), {})
            else:
                execute_core(agent, None, None)
            return output

        return (lambda: crew_hook(kickoff, crew, (), {})) if wrap else kickoff

    trees = {"openinference": (oi_tree(False), oi_tree(True)), "agl": (agl_tree(False), agl_tree(True))}
    cost: dict[str, list[float]] = {"openinference": [], "agl": [], "agl+sdk": []}
    for _ in range(5):
        bare, traced = trees["openinference"]
        cost["openinference"].append(harness.median_us(traced, calls) - harness.median_us(bare, calls))
        bare, traced = trees["agl"]
        for name, sdk in (("agl", None), ("agl+sdk", harness.sdk_provider())):
            collector.use_provider(sdk)
            with agl.rollout("hooks"):
                cost[name].append(harness.median_us(traced, calls) - harness.median_us(bare, calls))
            collector.use_provider(None)
    oi = statistics.median(cost["openinference"])
    print(f"\nhooks alone, µs per kickoff (crewai's objects, nothing of crewai running):  openinference {oi:.1f}")
    for name in ("agl", "agl+sdk"):
        ours = statistics.median(cost[name])
        print(f"  {name:<8} {ours:7.1f}   {name} / openinference = {ours / oi:.2f}"
              "   (agl also records 2 LLM calls: messages, tools, reply, usage)")


# --------------------------------------------------------------------------- timing


def _kickoff(crew: Crew) -> None:
    if crew.kickoff().raw != ANSWER:
        raise RuntimeError("the crew did not finish its task")


async def _akickoff(crew: Crew) -> None:
    if (await crew.akickoff()).raw != ANSWER:
        raise RuntimeError("the crew did not finish its task")


def _round(make: Callable[[], Crew], kickoffs: int) -> harness.Timing:
    crew = make()  # built with the variant on: crewai's OpenAI provider binds the client's create on its first call
    return harness.time_calls(lambda: _kickoff(crew), kickoffs)


async def _around(make: Callable[[], Crew], kickoffs: int) -> harness.Timing:
    crew = make()
    return await harness.time_calls_async(lambda: _akickoff(crew), kickoffs)


def _report(title: str, times: harness.Times) -> None:
    harness.report(title, times, unit="kickoff: 2 LLM calls + 1 tool call", decimals=0,
                   peers=("openinference", "oi+openai"))


def _profile(make: Callable[[], Crew], variant: Agl, kickoffs: int) -> None:
    profiler = cProfile.Profile()
    with variant.active():
        profiler.enable()
        _round(make, kickoffs)
        profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(r"agl_core|agl_crewai|opentelemetry", 25)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--kickoffs", type=int, default=10, help="kickoffs per variant per round")
    parser.add_argument("--profile", action="store_true", help="also cProfile agl on the offline crew")
    parser.add_argument("--no-async", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger("crewai").setLevel(logging.ERROR)  # its per-call token-estimate warning is not the workload

    agl.uninstrument()

    def offline() -> Crew:
        return _crew(InstantLLM(model="instant"))

    print(f"crewai {version('crewai')}, openai {version('openai')}, "
          f"openinference-instrumentation-crewai {version('openinference-instrumentation-crewai')}; "
          f"{args.rounds} rounds x {args.kickoffs} kickoffs per variant")
    with FakeOpenAI(_reply) as srv:
        def http() -> Crew:
            return _crew(LLM(model="gpt-4o", base_url=srv.url, api_key="x", max_retries=0,
                             extra_body={"return_token_ids": True}))

        _hooks_alone(srv, args.kickoffs * 20)
        full: list[harness.Variant] = [harness.Variant(), _openinference(False), _openinference(True), Agl(False),
                                       Agl(True)]
        _report("http, sync", harness.interleave(full, args.rounds, lambda: _round(http, args.kickoffs)))
        if not args.no_async:
            _report("http, async", asyncio.run(harness.interleave_async(full, args.rounds,
                                                                        lambda: _around(http, args.kickoffs))))
    bare: list[harness.Variant] = [harness.Variant(), _openinference(False), Agl(False), Agl(True)]
    _report("offline LLM, sync", harness.interleave(bare, args.rounds, lambda: _round(offline, args.kickoffs)))
    if not args.no_async:
        _report("offline LLM, async", asyncio.run(harness.interleave_async(bare, args.rounds,
                                                                           lambda: _around(offline, args.kickoffs))))
    for variant in full:
        if isinstance(variant, Agl) and variant.spans:
            print(f"\n{variant.name}: {statistics.median(variant.spans) / args.kickoffs:.1f} spans per kickoff"
                  " collected (crew, task, agent, 2 LLM x 2 plugins, tool)")
    if args.profile:
        _profile(offline, Agl(False), args.kickoffs * 5)


if __name__ == "__main__":
    main()
