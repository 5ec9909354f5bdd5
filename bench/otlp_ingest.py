"""OTLP spans ingested per second: ``agl serve``'s ``POST /v1/traces``, side by side with Agent Lightning 0.3's.

The workload is what an instrumented agent exports: one rollout's spans per OTLP/HTTP protobuf request (the
SDK's own encoder), ``--calls`` OpenInference LLM spans (a prompt growing by a tool round each call, the
reply with a tool call), one TOOL span per call and an AGENT span around them, so ``2 * calls + 1`` spans.
The encoded requests are made once; each server then gets the same spans under its own rollout naming
(agl: the resource attribute ``agl.rollout.id``; Agent Lightning: its ``agentlightning.rollout_id`` /
``attempt_id`` / ``span_sequence_id`` resource attributes, its rollouts started before) from ``--clients``
threads on keep-alive connections, and finishes each rollout as its API says.

agl's figure includes what ingestion does beyond storing: mapping the convention to agl's spans, joining
the gateway's token records, and building the rollout's transitions (again when it is finished, with the
reward). Agent Lightning 0.3 stores the spans; it builds triplets only when a trainer asks. Reported: spans/s
(first request to last answer), the ratio, and agl's transitions per rollout (a check: one per LLM call).

    .venvs/otlp/bin/python bench/otlp_ingest.py [--rollouts 300] [--calls 5] [--clients 4] \\
        [--peer-python .venvs/bench-agl03/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx


def encoded_rollouts(n: int, calls: int, resource: Callable[[int], dict[str, Any]]) -> list[bytes]:
    """``n`` ExportTraceServiceRequests, one rollout each, as the OpenTelemetry SDK's exporter encodes them."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    out = []
    for i in range(n):
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create(resource(i)))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        tracer = provider.get_tracer("openinference.instrumentation.openai")
        with tracer.start_as_current_span("agent") as agent:
            agent.set_attributes({"openinference.span.kind": "AGENT", "agent.name": "solver"})
            prompt: list[tuple[str, str]] = [("system", "Be brief."), ("user", f"Question {i}: add the numbers.")]
            for c in range(calls):
                with tracer.start_as_current_span("ChatCompletion") as llm:
                    attrs: dict[str, Any] = {"openinference.span.kind": "LLM", "llm.model_name": "policy",
                                             "llm.token_count.prompt": 40 + 10 * c, "llm.token_count.completion": 8}
                    for k, (role, content) in enumerate(prompt):
                        attrs[f"llm.input_messages.{k}.message.role"] = role
                        attrs[f"llm.input_messages.{k}.message.content"] = content
                    base = "llm.output_messages.0.message"
                    attrs.update({f"{base}.role": "assistant",
                                  f"{base}.tool_calls.0.tool_call.id": f"call_{c}",
                                  f"{base}.tool_calls.0.tool_call.function.name": "add",
                                  f"{base}.tool_calls.0.tool_call.function.arguments": json.dumps({"a": c, "b": i})})
                    llm.set_attributes(attrs)
                with tracer.start_as_current_span("add") as tool:
                    tool.set_attributes({"openinference.span.kind": "TOOL", "tool.name": "add",
                                         "input.value": json.dumps({"a": c, "b": i}), "output.value": str(c + i)})
                prompt += [("assistant", f"calling add for step {c}"), ("tool", str(c + i))]
        out.append(bytes(encode_spans(memory.get_finished_spans()).SerializeToString()))
    return out


def _send_all(url: str, bodies: list[bytes], clients: int, headers: dict[str, str],
              after: Callable[[httpx.Client, int], None] | None = None) -> float:
    """POST every body from ``clients`` threads; seconds from the first request to the last answer."""
    nxt = iter(range(len(bodies)))
    lock = threading.Lock()
    failures: list[str] = []

    def work() -> None:
        with httpx.Client(timeout=60) as client:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                reply = client.post(url, content=bodies[i], headers=headers)
                if reply.status_code != 200:
                    failures.append(f"{reply.status_code} {reply.text[:200]}")
                    return
                if after is not None:
                    after(client, i)

    threads = [threading.Thread(target=work) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if failures:
        raise SystemExit(f"a request failed: {failures[0]}")
    return elapsed


def run_agl(rollouts: int, calls: int, clients: int) -> dict[str, Any]:
    from agl_core.testing import FakeOpenAI
    from agl_trainer.gateway import OpenAIBackend
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer

    bodies = encoded_rollouts(rollouts, calls, lambda i: {"agl.rollout.id": f"r{i}", "agl.task.id": f"t{i}"})
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAI() as fake:
        config = ServerConfig(db_path=os.path.join(tmp, "agl.db"), port=0)
        with ServerThread(TrainerServer(config, OpenAIBackend(fake.url))) as thread:
            def finish(client: httpx.Client, i: int) -> None:
                body = {"id": f"r{i}", "task_id": f"t{i}", "status": "succeeded", "rewards": [{"value": 1.0}]}
                reply = client.post(f"{thread.url}/v1/rollouts", json=body)
                assert reply.status_code == 201 and reply.json()["transitions"] == calls, reply.text

            elapsed = _send_all(f"{thread.url}/v1/traces", bodies, clients,
                                {"Content-Type": "application/x-protobuf"}, finish)
            stored = thread.server.store.transitions(rollout_id="r0")
    return {"spans_per_s": rollouts * (2 * calls + 1) / elapsed, "seconds": elapsed,
            "transitions_per_rollout": len(stored)}


# Agent Lightning 0.3, run by --peer-python (its own venv): its store server (in-memory store, as
# bench/store_throughput.py runs it) in a child process, the same spans under its resource attributes.
_PEER = r'''
import asyncio, json, logging, multiprocessing as mp, socket, sys
sys.path.insert(0, sys.argv[1])
import httpx
from otlp_ingest import encoded_rollouts, _send_all

def serve(port, ready, stop):
    from agentlightning.store.client_server import LightningStoreServer
    from agentlightning.store.memory import InMemoryLightningStore
    async def main():
        server = LightningStoreServer(InMemoryLightningStore(), host="127.0.0.1", port=port)
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop()
    asyncio.run(main())

if __name__ == "__main__":
    logging.disable(logging.WARNING)
    rollouts, calls, clients = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    ctx = mp.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=serve, args=(port, ready, stop))
    server.start()
    if not ready.wait(120):
        raise SystemExit("Agent Lightning's store server did not start")
    ids = []
    with httpx.Client(timeout=60) as client:
        for i in range(rollouts):
            attempted = client.post(f"{url}/agl/rollouts", json={"input": {"i": i}}).json()
            ids.append((attempted["rollout_id"], attempted["attempt"]["attempt_id"]))
    bodies = encoded_rollouts(rollouts, calls, lambda i: {"agentlightning.rollout_id": ids[i][0],
                                                          "agentlightning.attempt_id": ids[i][1]})
    def finish(client, i):
        reply = client.post(f"{url}/agl/rollouts/{ids[i][0]}/attempts/{ids[i][1]}", json={"status": "succeeded"})
        assert reply.status_code == 200, reply.text
    elapsed = _send_all(f"{url}/traces", bodies, clients, {"Content-Type": "application/x-protobuf"}, finish)
    with httpx.Client(timeout=60) as client:
        stored = client.get(f"{url}/agl/spans", params={"rollout_id": ids[0][0]}).json()
    stop.set()
    server.join(30)
    print(json.dumps({"spans_per_s": rollouts * (2 * calls + 1) / elapsed, "seconds": elapsed,
                      "spans_of_first_rollout": len(stored.get("items", stored))}))
'''


def run_peer(python: str, rollouts: int, calls: int, clients: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(_PEER)  # a file, not -c: its server process is forked from it
    try:
        done = subprocess.run([python, script.name, os.path.dirname(os.path.abspath(__file__)), str(rollouts),
                               str(calls), str(clients)], capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(script.name)
    if done.returncode != 0:
        raise SystemExit(f"Agent Lightning 0.3's run failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=300)
    parser.add_argument("--calls", type=int, default=5, help="LLM calls per rollout (each with a tool span)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--peer-python", help="the Python of a venv with agentlightning==0.3.0")
    args = parser.parse_args()
    spans = 2 * args.calls + 1
    print(f"{args.rollouts} rollouts x {spans} spans, one OTLP/HTTP protobuf request each, {args.clients} clients")
    ours = run_agl(args.rollouts, args.calls, args.clients)
    print(f"agl serve:          {ours['spans_per_s']:8.0f} spans/s ingested, mapped and built "
          f"({ours['transitions_per_rollout']} transitions per rollout)")
    if args.peer_python:
        peer = run_peer(args.peer_python, args.rollouts, args.calls, args.clients)
        print(f"Agent Lightning 0.3: {peer['spans_per_s']:8.0f} spans/s stored "
              f"({peer['spans_of_first_rollout']} spans in its first rollout)")
        print(f"ratio agl / Agent Lightning 0.3: {ours['spans_per_s'] / peer['spans_per_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
