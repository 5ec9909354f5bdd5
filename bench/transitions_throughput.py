"""Spans -> transitions per second: agl's TransitionBuilder vs Agent Lightning 0.3's TracerTraceToTriplet.

The same 10,000 agent rollouts are recorded once per side, each side in its own
interpreter, each through its own instrumentation's code, then turned into
transitions again and again while the clock runs.

The rollouts (``rollout_specs``, seeded, so both processes make the same ones) are
what an OpenAI-client agent does on a vLLM-like server: 2-6 chat calls per run, the
conversation growing call by call, every call but the last asking for one or two
tools (search, calculator, read_page) whose results go back into the prompt, some
tools failing, prompt and response token ids with per-token logprobs on every
response, a few intermediate rewards and a final reward; 40% of the runs are a
"planner" agent handing part of the work to a nested "researcher" agent.

- **agl** (this interpreter, ``PYTHONPATH=src``): each run is an ``agl.rollout``;
  each chat call goes through the agl ``openai`` plugin's own wrapper around a
  ``create`` that returns the canned ``ChatCompletion`` (no HTTP), tools through
  ``agl.tool_call``, rewards through ``agl.emit_reward``, agent spans as the agent
  plugins write them (``invoke_agent {name}``). Timed: ``TransitionBuilder.build``
  over the stored form, ``Rollout`` records read back from their JSON.
- **Agent Lightning 0.3** (``--peer-python``, its own venv): each chat call is an
  ``openai.chat.completion`` span with the attributes AgentOps' OpenAI
  instrumentation writes (``handle_chat_attributes``, as patched by
  ``agentlightning.instrumentation.agentops`` to add token ids and logprobs), tool
  spans as AgentOps' ``@tool`` writes them, rewards through
  ``agentlightning.emit_reward``; agent spans carry ``agent.name``. The SDK's
  ``ReadableSpan`` s are converted to ``agentlightning.Span`` as its store keeps
  them (``Span.from_opentelemetry``). Timed: ``TracerTraceToTriplet().adapt``.

Recording is not timed. Each side times ``--repeats`` passes over all rollouts and
reports its best pass (the least disturbed on a shared machine) and the median; the
two processes run one after the other, ``--rounds`` times in alternating order.
Both sides' transition counts are compared per rollout with what the agents did.

    python3.11 -m venv .venvs/bench-agl03
    .venvs/bench-agl03/bin/pip install -r bench/requirements-agentlightning03.txt
    PYTHONPATH=src .venv/bin/python bench/transitions_throughput.py \\
        --peer-python .venvs/bench-agl03/bin/python [--rollouts 10000] [--repeats 3] [--rounds 1] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = "Qwen2.5-0.5B-Instruct"
SYSTEM = "You are a research assistant. Use the tools when a fact needs checking, then answer in one paragraph."
WORDS = ("river capital market energy policy graph method result paper city price model data history season "
         "network protein battery engine harbor theory climate ratio signal").split()
TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the web and return the top snippets.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "read_page", "description": "Fetch a page and return its text.",
        "parameters": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}}},
]


# --------------------------------------------------------------------------- the rollouts (both sides)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(151_000) for _ in range(n)]


def rollout_specs(n: int, seed: int = 0, numeric: bool = False) -> list[dict[str, Any]]:
    """``n`` agent runs as plain data: per call its request, its canned response JSON, the tools it runs.

    ``numeric``: the calculator returns a bare number (``"1234.5"``) instead of a sentence.
    """
    rng = random.Random(seed)
    specs = []
    for r in range(n):
        nested = rng.random() < 0.4
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": _text(rng, 15, 60) + "?"}]
        prompt_ids = _ids(rng, rng.randint(80, 200))
        n_calls = rng.randint(2, 6)
        calls = []
        for i in range(n_calls):
            last = i == n_calls - 1
            response_ids = _ids(rng, rng.randint(12, 60))
            logprobs = [-round(rng.random() * 3, 4) for _ in response_ids]
            tool_calls, tools_run = [], []
            if not last:
                for j in range(rng.choice((1, 1, 2))):
                    tool = rng.choice(TOOLS)["function"]["name"]
                    arg = {"search": "query", "calculator": "expression", "read_page": "url"}[tool]
                    call_id = f"call_{r}_{i}_{j}"
                    tool_calls.append({"id": call_id, "type": "function",
                                       "function": {"name": tool, "arguments": json.dumps({arg: _text(rng, 2, 6)})}})
                    roll = rng.random()
                    outcome = "exception" if roll < 0.04 else "error" if roll < 0.12 else "ok"
                    result = _text(rng, 10, 60)
                    if tool == "calculator":
                        value = round(rng.uniform(0, 10_000), 2)
                        result = str(value) if numeric else f"The expression evaluates to {value}."
                    tools_run.append({"name": tool, "id": call_id, "arguments": {arg: "x"}, "outcome": outcome,
                                      "result": result,
                                      "reward": 0.1 if outcome == "ok" and rng.random() < 0.3 else None})
            content = None if tool_calls else _text(rng, 20, 80)
            completion = {
                "id": f"chatcmpl-{r}-{i}", "object": "chat.completion", "created": 1_700_000_000, "model": MODEL,
                "choices": [{"index": 0, "finish_reason": "tool_calls" if tool_calls else "stop",
                             "message": {"role": "assistant", "content": content,
                                         **({"tool_calls": tool_calls} if tool_calls else {})},
                             "logprobs": {"content": [
                                 {"token": f"t{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                 for t, lp in zip(response_ids, logprobs, strict=True)]},
                             "token_ids": response_ids}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(response_ids),
                          "total_tokens": len(prompt_ids) + len(response_ids)},
                "prompt_token_ids": prompt_ids,
            }
            agent = "researcher" if nested and 0 < i < n_calls - 1 else ("planner" if nested else "solver")
            calls.append({"agent": agent, "messages": [dict(m) for m in messages], "completion": completion,
                          "tools": tools_run})
            messages.append({"role": "assistant", "content": content,
                             **({"tool_calls": tool_calls} if tool_calls else {})})
            prompt_ids = prompt_ids + response_ids
            for t in tools_run:
                messages.append({"role": "tool", "tool_call_id": t["id"], "content": t["result"]})
                prompt_ids = prompt_ids + _ids(rng, rng.randint(10, 40))
        specs.append({"task_id": f"task-{r % 500}", "rollout_id": f"ro-{r}", "calls": calls,
                      "reward": round(rng.random(), 3)})
    return specs


def _agent_runs(spec: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The calls grouped into consecutive runs of one agent (nested ones inside the outer agent's span)."""
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    for call in spec["calls"]:
        if runs and runs[-1][0] == call["agent"]:
            runs[-1][1].append(call)
        else:
            runs.append((call["agent"], [call]))
    return runs


# --------------------------------------------------------------------------- agl side


def _record_agl(specs: list[dict[str, Any]]) -> list[Any]:
    import openai
    from openai.types.chat import ChatCompletion
    from opentelemetry import trace

    import agl_core as agl
    from agl_core import collector, semconv
    from agl_core.openai_client import OpenAIInstrumentor
    from agl_core.openai_client.instrumentor import _Types
    from agl_core.schema import Rollout

    plugin = OpenAIInstrumentor()
    plugin._active = True
    canned: list[Any] = []
    create = plugin._sync_wrapper(lambda resource, **kwargs: canned.pop(), _Types())
    resource = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x").chat.completions

    def agent_span(name: str) -> Any:
        return collector.tracer().start_as_current_span(
            f"{semconv.OP_INVOKE_AGENT} {name}",
            attributes={semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: name})

    def run_calls(calls: list[dict[str, Any]]) -> None:
        for call in calls:
            canned.append(ChatCompletion.model_validate(call["completion"]))
            create(resource, model=MODEL, messages=call["messages"], tools=TOOLS, temperature=0.7, max_tokens=512,
                   extra_body={"return_token_ids": True}, logprobs=True)
            for tool in call["tools"]:
                try:
                    with agl.tool_call(tool["name"], call_id=tool["id"], arguments=tool["arguments"]) as tc:
                        if tool["outcome"] == "exception":
                            raise RuntimeError("tool crashed")
                        if tool["outcome"] == "error":
                            tc.error(tool["result"])
                        else:
                            tc.result = tool["result"]
                except RuntimeError:
                    pass
                if tool["reward"] is not None:
                    agl.emit_reward(tool["reward"], name="tool_ok")

    rollouts = []
    for spec in specs:
        with agl.rollout(spec["task_id"], rollout_id=spec["rollout_id"]) as run:
            runs = _agent_runs(spec)
            outer = runs[0][0]
            with agent_span(outer):
                for name, calls in runs:
                    if name == outer:
                        run_calls(calls)
                    else:
                        with agent_span(name):
                            run_calls(calls)
            agl.emit_reward(spec["reward"])
        rollouts.append(Rollout.from_json(run.rollout.to_json()))  # the stored form, as a store reads it back
    assert trace.get_tracer_provider() is not None
    return rollouts


def _side_agl(args: argparse.Namespace) -> dict[str, Any]:
    from agl_core.transitions import TransitionBuilder

    t0 = time.perf_counter()
    rollouts = _record_agl(rollout_specs(args.rollouts, args.seed, args.numeric_results))
    record_s = time.perf_counter() - t0
    builder = TransitionBuilder()
    counts = [len(builder.build(r).transitions) for r in rollouts]  # warm-up pass, and the per-rollout counts

    def one_pass() -> int:
        total = 0
        for r in rollouts:
            total += len(builder.build(r).transitions)
        return total

    return _time_passes("agl", one_pass, counts, record_s, sum(len(r.spans) for r in rollouts), args)


# --------------------------------------------------------------------------- Agent Lightning 0.3 side


def _record_peer(specs: list[dict[str, Any]]) -> list[list[Any]]:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import agentlightning
    from agentlightning.emitter.annotation import flatten_attributes, sanitize_attributes
    from agentlightning.instrumentation import agentops as al_agentops
    from agentlightning.semconv import AGL_ANNOTATION, LightningSpanAttributes
    from agentops.instrumentation.providers.openai.wrappers import chat as agentops_chat
    from openai.types.chat import ChatCompletion
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanKind, Status, StatusCode

    al_agentops._patch_new_agentops()  # what AgentOpsTracer does: token ids and logprobs on the chat span
    handle_chat_attributes = agentops_chat.handle_chat_attributes

    finished: list[ReadableSpan] = []

    class Collect(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            finished.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Collect()))
    trace.set_tracer_provider(provider)
    tracer = provider.get_tracer("agentops")

    def reward_span(value: float) -> None:
        # agentlightning.emit_reward's attributes, on a plain span (its own emitter wants a live Tracer object)
        attrs = sanitize_attributes(flatten_attributes(
            {LightningSpanAttributes.REWARD.value: [{"name": "primary", "value": float(value)}]},
            expand_leaf_lists=False))
        with tracer.start_as_current_span(AGL_ANNOTATION, attributes=attrs):
            pass

    def run_calls(calls: list[dict[str, Any]]) -> None:
        for call in calls:
            completion = ChatCompletion.model_validate(call["completion"])
            kwargs = {"model": MODEL, "messages": call["messages"], "tools": TOOLS, "temperature": 0.7,
                      "max_tokens": 512, "extra_body": {"return_token_ids": True}, "logprobs": True}
            with tracer.start_as_current_span("openai.chat.completion", kind=SpanKind.CLIENT) as span:
                attrs = handle_chat_attributes(kwargs=kwargs, return_value=completion, span=span)
                span.set_attributes({k: v for k, v in attrs.items() if v is not None})  # as AgentOps' wrapper does
            for tool in call["tools"]:
                with tracer.start_as_current_span(f"{tool['name']}.tool") as span:
                    # AgentOps' @tool: input as JSON, a str output as it is (its safe_serialize)
                    span.set_attributes({"agentops.span.kind": "tool", "operation.name": tool["name"],
                                         "agentops.entity.input": json.dumps({"args": [],
                                                                              "kwargs": tool["arguments"]})})
                    if tool["outcome"] == "ok":
                        span.set_attribute("agentops.entity.output", tool["result"])
                    else:
                        span.set_status(Status(StatusCode.ERROR, tool["result"]))
                if tool["reward"] is not None:
                    reward_span(tool["reward"])

    out = []
    for n, spec in enumerate(specs):
        finished.clear()
        runs = _agent_runs(spec)
        outer = runs[0][0]
        with tracer.start_as_current_span(f"{outer}.agent", attributes={"agent.name": outer,
                                                                         "agentops.span.kind": "agent"}):
            for name, calls in runs:
                if name == outer:
                    run_calls(calls)
                else:
                    with tracer.start_as_current_span(f"{name}.agent", attributes={"agent.name": name,
                                                                                    "agentops.span.kind": "agent"}):
                        run_calls(calls)
        reward_span(spec["reward"])
        # the stored form: agentlightning.Span, as its LightningStore keeps them, read back from JSON
        spans = [agentlightning.Span.from_opentelemetry(s, spec["rollout_id"], "at-1", i)
                 for i, s in enumerate(finished)]
        out.append([agentlightning.Span.model_validate_json(s.model_dump_json()) for s in spans])
        if n == 0:
            assert any(s.name == "openai.chat.completion" and "prompt_token_ids" in s.attributes for s in spans)
    return out


def _side_peer(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    logging.disable(logging.WARNING)  # its adapter logs a warning per unexpected attribute; not what is timed
    from agentlightning import TracerTraceToTriplet

    t0 = time.perf_counter()
    rollouts = _record_peer(rollout_specs(args.rollouts, args.seed, args.numeric_results))
    record_s = time.perf_counter() - t0
    adapter = TracerTraceToTriplet()
    failures: dict[str, int] = {}

    def adapt(spans: list[Any]) -> int:
        try:
            return len(adapter.adapt(spans))
        except Exception as exc:  # noqa: BLE001 - a rollout the adapter cannot read yields no transitions
            reason = f"{type(exc).__name__}: {exc}"
            failures[reason] = failures.get(reason, 0) + 1
            return 0

    counts = [adapt(spans) for spans in rollouts]
    failed = dict(failures)

    def one_pass() -> int:
        total = 0
        for spans in rollouts:
            total += adapt(spans)
        return total

    result = _time_passes("agentlightning 0.3", one_pass, counts, record_s, sum(map(len, rollouts)), args)
    result["failures"] = failed
    return result


# --------------------------------------------------------------------------- timing and report


def _time_passes(name: str, one_pass: Any, counts: list[int], record_s: float, spans: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    rates, cpu_rates = [], []
    for _ in range(args.repeats):
        start, cpu = time.perf_counter(), time.process_time()
        total = one_pass()
        rates.append(total / (time.perf_counter() - start))
        cpu_rates.append(total / (time.process_time() - cpu))
    if args.profile:
        _profile(one_pass, name)
    return {"name": name, "python": sys.version.split()[0], "rates": rates, "cpu_rates": cpu_rates, "counts": counts,
            "record_s": record_s, "spans": spans, "transitions": sum(counts)}


def _profile(one_pass: Any, name: str) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    one_pass()
    prof.disable()
    print(f"--- profile of one pass, {name}", file=sys.stderr)
    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)


def _run_side(side: str, python: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [os.path.abspath(python), os.path.abspath(__file__), "--side", side, "--rollouts", str(args.rollouts),
           "--repeats", str(args.repeats), "--seed", str(args.seed)]
    cmd += (["--numeric-results"] if args.numeric_results else []) + (["--profile"] if args.profile else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]))
    if side == "peer":
        env.pop("PYTHONPATH")  # agl is not needed there, and its OpenTelemetry must not shadow the peer's
        env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-20000:] if args.profile else "")
    if proc.returncode != 0:
        raise SystemExit(f"{side} side failed ({python}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over all rollouts, per process")
    parser.add_argument("--rounds", type=int, default=1, help="process runs per side, in alternating order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-python", default=os.path.join(REPO, ".venvs", "bench-agl03", "bin", "python"))
    parser.add_argument("--numeric-results", action="store_true",
                        help="the calculator tool returns a bare number, as most calculators do (see the README)")
    parser.add_argument("--profile", action="store_true", help="cProfile one more pass of each side (to stderr)")
    parser.add_argument("--side", choices=("agl", "peer"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:
        result = _side_agl(args) if args.side == "agl" else _side_peer(args)
        print(json.dumps(result))
        return

    specs = rollout_specs(args.rollouts, args.seed, args.numeric_results)
    expected = [len(s["calls"]) for s in specs]
    sides = {"agl": sys.executable, "peer": args.peer_python}
    if not os.path.exists(args.peer_python):
        print(f"Agent Lightning 0.3 not found at {args.peer_python}: build its venv (see this file's docstring); "
              "running agl alone")
        del sides["peer"]
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            results[side].append(_run_side(side, sides[side], args))

    print(f"\nspans -> transitions, {args.rollouts} rollouts, {sum(expected)} LLM calls "
          f"({args.repeats} passes x {args.rounds} process runs per side; transitions/s)")
    print(f"  {'side':<20} {'python':<7} {'spans':>8} {'transitions':>11} {'wall best':>10} {'wall median':>11} "
          f"{'CPU best':>9} {'CPU median':>10}")
    best: dict[str, tuple[float, float]] = {}
    for side, runs in results.items():
        rates = [rate for run in runs for rate in run["rates"]]
        cpu = [rate for run in runs for rate in run["cpu_rates"]]
        best[side] = (max(rates), max(cpu))
        run = runs[0]
        print(f"  {run['name']:<20} {run['python']:<7} {run['spans']:>8} {run['transitions']:>11} "
              f"{max(rates):>10.0f} {statistics.median(rates):>11.0f} {max(cpu):>9.0f} {statistics.median(cpu):>10.0f}")
    if "peer" in best:
        print(f"  agl / Agent Lightning 0.3 throughput: {best['agl'][0] / best['peer'][0]:.1f}x wall, "
              f"{best['agl'][1] / best['peer'][1]:.1f}x CPU (best passes; CPU = transitions per second of the "
              "process's own CPU time, which leaves out what other processes take)")
    for runs in results.values():
        counts = runs[0]["counts"]
        short = [(i, c, e) for i, (c, e) in enumerate(zip(counts, expected, strict=True)) if c != e]
        verdict = "every LLM call became one transition" if not short else (
            f"{len(short)} rollouts differ from the calls made, {sum(e - c for _, c, e in short)} transitions "
            f"missing (first: rollout {short[0][0]}, {short[0][1]} of {short[0][2]})")
        print(f"  {runs[0]['name']}: {sum(counts)} transitions for {sum(expected)} calls: {verdict}")
        for reason, n in (runs[0].get("failures") or {}).items():
            print(f"    {n} rollouts raised in the adapter and gave no transitions: {reason}")


if __name__ == "__main__":
    main()
