"""Resident memory over a 10,000-rollout soak through one process: agl vs Agent Lightning 0.3's tracer.

One worker process runs an OpenAI-client agent loop again and again against the
fake vLLM-like server (``agl_core.testing.FakeOpenAI``, token ids and logprobs on,
served from the parent process so its request log does not count): per rollout a
chat call that asks for a tool, the tool, an intermediate reward, a second chat
call with the tool's result, and the final reward. Every ``--every`` rollouts the
worker samples its resident set size (``VmRSS``).

- **agl**: ``agl.instrument(["openai"])``; each run is an ``agl.rollout`` writing
  its rollout, spans and transitions to a ``SqliteStore`` file; the tool runs in
  ``agl.tool_call``; rewards through ``agl.emit_reward``.
- **Agent Lightning 0.3** (``--peer-python``): its ``AgentOpsTracer`` (AgentOps'
  OpenAI instrumentation, as its runner sets it up), one ``trace_context`` per run;
  the tool is an AgentOps ``@tool``; rewards through ``agentlightning.emit_reward``;
  after each run its spans go through ``TracerTraceToTriplet``, as its runner and
  algorithm would. It writes no store (its stores keep spans in memory, which grows
  by design), so what grows there is the tracer's own state.

Reported per side: RSS after warm-up (the first ``--warmup`` rollouts) and at the
end, and the slope of a least-squares line through the samples after warm-up, in
KiB per 1,000 rollouts.

    PYTHONPATH=src .venv/bin/python bench/memory_soak.py [--rollouts 10000] [--every 500] \\
        [--peer-python .venvs/bench-agl03/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = "fake-model"
TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _script(body: dict[str, Any]) -> dict[str, Any]:
    """The fake server's reply: a tool call first, then an answer once a tool result is in the conversation."""
    messages = body.get("messages") or []
    if any(m.get("role") == "tool" for m in messages):
        return {"content": "The river is the Seine, about 777 km long."}
    n = sum(1 for m in messages if m.get("role") == "user")
    return {"tool_calls": [{"id": f"call_{n}", "name": "search", "arguments": {"query": "river through Paris"}}]}


def _messages(i: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You answer questions about geography. Use search when unsure."},
            {"role": "user", "content": f"Which river runs through Paris, and how long is it? (run {i})"}]


def _report(name: str, samples: list[tuple[int, int]], warmup: int, seconds: float) -> dict[str, Any]:
    after = [(n, kib) for n, kib in samples if n >= warmup] or samples
    xs = [n for n, _ in after]
    ys = [kib for _, kib in after]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return {"name": name, "samples": samples, "start_kib": after[0][1], "end_kib": after[-1][1],
            "slope_kib_per_1000": slope * 1000, "seconds": seconds, "python": sys.version.split()[0]}


# --------------------------------------------------------------------------- agl


def soak_agl(url: str, rollouts: int, every: int, warmup: int) -> dict[str, Any]:
    import openai

    import agl_core as agl

    agl.instrument(["openai"])
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    samples = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        store = agl.SqliteStore(os.path.join(tmp, "soak.db"))
        for i in range(rollouts):
            with agl.rollout(f"task-{i % 100}", task={"i": i}, store=store):
                messages = _messages(i)
                first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, logprobs=True,
                                                       extra_body={"return_token_ids": True})
                reply = first.choices[0].message
                messages.append(reply.model_dump(exclude_none=True))
                for call in reply.tool_calls or ():
                    with agl.tool_call(call.function.name, call_id=call.id, arguments=call.function.arguments) as tc:
                        tc.result = "The Seine flows through Paris; it is 777 km long."
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": tc.result})
                agl.emit_reward(0.1, name="tool_ok")
                client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, logprobs=True,
                                               extra_body={"return_token_ids": True})
                agl.emit_reward(1.0)
            if (i + 1) % every == 0:
                samples.append((i + 1, rss_kib()))
        stored = len(store.rollouts())
        store.close()
    if stored != rollouts:
        raise SystemExit(f"agl stored {stored} rollouts of {rollouts}")
    return _report("agl", samples, warmup, time.perf_counter() - start)


# --------------------------------------------------------------------------- Agent Lightning 0.3


def soak_peer(url: str, rollouts: int, every: int, warmup: int) -> dict[str, Any]:
    import asyncio
    import logging

    logging.disable(logging.WARNING)
    os.environ.setdefault("AGENTOPS_API_KEY", "dummy")
    import agentlightning
    import openai
    from agentlightning import TracerTraceToTriplet
    from agentlightning.tracer.agentops import AgentOpsTracer
    from agentops.sdk.decorators import tool

    tracer = AgentOpsTracer()
    tracer.init_worker(0)
    adapter = TracerTraceToTriplet()
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)

    @tool
    def search(query: str) -> str:
        return "The Seine flows through Paris; it is 777 km long."

    async def one(i: int) -> int:
        async with tracer.trace_context(f"rollout-{i}"):
            messages = _messages(i)
            first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, logprobs=True,
                                                   extra_body={"return_token_ids": True})
            reply = first.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            for call in reply.tool_calls or ():
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": search(**json.loads(call.function.arguments))})
            agentlightning.emit_reward(0.1)
            client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, logprobs=True,
                                           extra_body={"return_token_ids": True})
            agentlightning.emit_reward(1.0)
        return len(adapter.adapt(tracer.get_last_trace()))

    async def main() -> tuple[list[tuple[int, int]], int]:
        samples = []
        transitions = 0
        for i in range(rollouts):
            transitions += await one(i)
            if (i + 1) % every == 0:
                samples.append((i + 1, rss_kib()))
        return samples, transitions

    start = time.perf_counter()
    samples, transitions = asyncio.run(main())
    result = _report("agentlightning 0.3", samples, warmup, time.perf_counter() - start)
    result["transitions"] = transitions
    tracer.teardown_worker(0)
    return result


# --------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=500, help="sample RSS every this many rollouts")
    parser.add_argument("--warmup", type=int, default=1000, help="rollouts left out of the slope")
    parser.add_argument("--peer-python", default=None,
                        help="python of an Agent Lightning 0.3 venv, e.g. .venvs/bench-agl03/bin/python")
    parser.add_argument("--side", choices=("agl", "peer"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        soak = soak_agl if args.side == "agl" else soak_peer
        print(json.dumps(soak(args.url, args.rollouts, args.every, args.warmup)))
        return

    from agl_core.testing import FakeOpenAI

    sides = [("agl", sys.executable)] + ([("peer", args.peer_python)] if args.peer_python else [])
    results = []
    with FakeOpenAI(script=_script, return_token_ids=True) as srv:
        for side, python in sides:
            cmd = [os.path.abspath(python), os.path.abspath(__file__), "--side", side, "--url", srv.url, "--rollouts",
                   str(args.rollouts), "--every", str(args.every), "--warmup", str(args.warmup)]
            env = dict(os.environ)
            if side == "peer":
                env.pop("PYTHONPATH", None)
                env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
            else:
                env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "src"), env.get("PYTHONPATH", "")])
            with tempfile.TemporaryDirectory() as cwd:  # AgentOps writes agentops.log where it runs
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
            srv.requests.clear()
            if proc.returncode != 0:
                print(f"{side} side failed:\n{proc.stderr[-3000:]}")
                continue
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)  # each side's raw figures as soon as it is done

    print(f"\nmemory soak: {args.rollouts} rollouts in one process (2 chat calls, 1 tool, 2 rewards each); "
          f"RSS every {args.every}; slope after the first {args.warmup}")
    print(f"  {'side':<20} {'RSS start MiB':>14} {'RSS end MiB':>12} {'slope KiB/1000':>15} {'rollouts/s':>11}")
    for r in results:
        print(f"  {r['name']:<20} {r['start_kib'] / 1024:>14.1f} {r['end_kib'] / 1024:>12.1f} "
              f"{r['slope_kib_per_1000']:>15.1f} {args.rollouts / r['seconds']:>11.0f}")
        print("    samples (rollouts: MiB): " + ", ".join(f"{n}: {k / 1024:.1f}" for n, k in r["samples"]))


if __name__ == "__main__":
    main()
