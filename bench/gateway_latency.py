"""Latency the agl gateway adds over the bare model server, at concurrency 1 and 64.

Three processes on 127.0.0.1: the fake vLLM-like backend (``agl_core.testing.FakeOpenAI``,
token ids on), the agl server in front of it (``python -m agl_trainer --backend ...``,
a real uvicorn process writing to a SQLite file), and this load generator, an
asyncio HTTP/1.1 client on raw keep-alive sockets (so the client costs little
and costs both targets alike). Every request is a non-streamed chat completion
with a ``traceparent`` of its own, so the gateway records token ids for each.

Rounds alternate between the bare backend and the gateway (so drift on a noisy
machine hits both); the added latency is the gateway's percentile minus the
backend's, at each concurrency.

Run: ``.venvs/trainer/bin/python bench/gateway_latency.py [--requests 2000] [--rounds 5]``.
Target: under 1 ms added at p50, concurrency 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And what river runs through it?"},
]
BODY = json.dumps({"model": "fake-model", "messages": MESSAGES, "temperature": 0.7, "max_tokens": 64}).encode()

BACKEND_SCRIPT = """
import sys
from http.server import ThreadingHTTPServer
from agl_core.testing import FakeOpenAI
ThreadingHTTPServer.request_queue_size = 1024  # 64 clients connect at once: the stdlib's backlog of 5 drops some
srv = FakeOpenAI(script=lambda body: "The Seine runs through Paris, as it has for a very long time.").start()
print(srv.url, flush=True)
sys.stdin.read()
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "trainer"), env.get("PYTHONPATH", "")])
    return env


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> float:
    span = f"{random.getrandbits(64) or 1:016x}"
    request = head.replace(b"SPANID0000000000", span.encode()) + BODY
    start = time.perf_counter()
    writer.write(request)
    header = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in header.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await reader.readexactly(length)
    elapsed = time.perf_counter() - start
    if not header.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{header[:200]!r} {body[:300]!r}")
    return elapsed


async def _load(host: str, port: int, path: str, concurrency: int, total: int) -> list[float]:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"traceparent: 00-{random.getrandbits(128):032x}-SPANID0000000000-01\r\n"
            f"Content-Length: {len(BODY)}\r\n\r\n").encode()
    latencies: list[float] = []
    per_conn = total // concurrency

    async def conn() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        for _ in range(3):  # warm the connection
            await _one(reader, writer, head)
        for _ in range(per_conn):
            latencies.append(await _one(reader, writer, head))
        writer.close()

    await asyncio.gather(*(conn() for _ in range(concurrency)))
    return latencies


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per round and concurrency")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()

    backend = subprocess.Popen([sys.executable, "-c", BACKEND_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=_env())
    assert backend.stdout is not None
    backend_url = backend.stdout.readline().strip()
    tmp = tempfile.mkdtemp(prefix="agl-bench-")
    gateway = subprocess.Popen([sys.executable, "-m", "agl_trainer", "--db", f"{tmp}/bench.db", "--port", "0",
                                "--backend", backend_url, "--model", "fake-model"],
                               stdout=subprocess.PIPE, text=True, env=_env())
    assert gateway.stdout is not None
    gateway_url = gateway.stdout.readline().split()[-1]
    try:
        targets = {"backend": (backend_url.split("//")[1].split("/")[0], "/v1/chat/completions"),
                   "gateway": (gateway_url.split("//")[1], "/v1/chat/completions")}
        results: dict[tuple[str, int], list[float]] = {}
        for concurrency in args.concurrency:
            for r in range(args.rounds):
                order = ["backend", "gateway"] if r % 2 == 0 else ["gateway", "backend"]
                for name in order:
                    hostport, path = targets[name]
                    host, port = hostport.rsplit(":", 1)
                    lat = asyncio.run(_load(host, int(port), path, concurrency, args.requests))
                    results.setdefault((name, concurrency), []).extend(lat)
        print(f"{'concurrency':>11} {'backend p50':>12} {'gateway p50':>12} {'added p50':>10} "
              f"{'backend p99':>12} {'gateway p99':>12} {'added p99':>10}   (ms)")
        summary: dict[str, Any] = {}
        for concurrency in args.concurrency:
            b, g = results[("backend", concurrency)], results[("gateway", concurrency)]
            row = {"backend_p50": _pct(b, 0.5), "gateway_p50": _pct(g, 0.5), "backend_p99": _pct(b, 0.99),
                   "gateway_p99": _pct(g, 0.99)}
            row = {k: v * 1000 for k, v in row.items()}
            row["added_p50"] = row["gateway_p50"] - row["backend_p50"]
            row["added_p99"] = row["gateway_p99"] - row["backend_p99"]
            summary[str(concurrency)] = row
            cells = [f"{row[k]:>{12 if k.startswith(('backend', 'gateway')) else 10}.3f}" for k in
                     ("backend_p50", "gateway_p50", "added_p50", "backend_p99", "gateway_p99", "added_p99")]
            print(f"{concurrency:>11} " + " ".join(cells))
        c1 = summary.get("1")
        if c1 is not None:
            verdict = "meets" if c1["added_p50"] < 1.0 else "misses"
            print(f"target: added p50 at concurrency 1 under 1 ms: {verdict} ({c1['added_p50']:.3f} ms)")
        n = statistics.mean(len(v) for v in results.values())
        print(f"({int(n)} requests per cell, {args.rounds} rounds)")
    finally:
        gateway.terminate()
        backend.terminate()
        gateway.wait(timeout=20)
        backend.wait(timeout=20)


if __name__ == "__main__":
    main()
