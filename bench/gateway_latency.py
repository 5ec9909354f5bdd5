"""Latency a gateway adds over the bare model server: agl's and Agent Lightning 1.0's, side by side.

Four processes on 127.0.0.1:

- the bare backend: agl's fake vLLM-like server (``agl_core.testing.FakeOpenAI``,
  token ids on, a fixed answer), which never sleeps;
- agl's server in front of it (``python -m agl_trainer --backend ...``: uvicorn,
  the gateway recording token ids per ``traceparent``, a SQLite file);
- Agent Lightning 1.0's server in front of the same backend, in its own process
  under its own interpreter (it needs Python 3.12): its FastAPI app
  (``agentlightning.server.app.create_app`` with its shipped ``server.yaml``),
  on uvicorn as its ``python -m agentlightning.server`` runs it, with the
  backend registered through its ``POST /api/models`` and one rollout through
  ``POST /api/rollouts``; the agent's calls go to its proxy route
  ``/proxy/rollout/{id}/attempt/{id}/mode/train/openai/v1/chat/completions``,
  which records each call (token ids included) as an event of that rollout;
- this load generator: an asyncio HTTP/1.1 client on raw keep-alive sockets,
  so the client costs little and costs every target alike.

Every request is the same non-streamed chat completion (Agent Lightning's
gateway refuses ``stream=true``), with a ``traceparent`` of its own, so agl
records token ids for each call as Agent Lightning does. Both gateways run on
the same uvicorn stack (httptools and uvloop are installed beside each), with
no access log and their loggers at warning, so the figures compare the gateways'
own work. Rounds rotate the order of the targets, so drift on a noisy machine
hits all of them; the added latency is a gateway's percentile minus the bare
backend's, at each concurrency.

Set-up (once; Agent Lightning 1.0 needs Python 3.12)::

    /root/.pyenv/versions/3.12.1/bin/python -m venv .venvs/bench-agl1
    .venvs/bench-agl1/bin/pip install -r bench/requirements-agentlightning1.txt

Run::

    .venvs/trainer/bin/python bench/gateway_latency.py [--requests 2000] [--rounds 5]
        [--peer-python .venvs/bench-agl1/bin/python] [--no-peer]

Target: agl under 1 ms added at p50, concurrency 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO / ".venvs" / "bench-agl1" / "bin" / "python"
MODEL = "fake-model"
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And what river runs through it?"},
]
BODY = json.dumps({"model": MODEL, "messages": MESSAGES, "temperature": 0.7, "max_tokens": 64}).encode()
CHAT = "/v1/chat/completions"
PEER_CHAT = "/proxy/rollout/bench/attempt/attempt-1/mode/train/openai/v1/chat/completions"

BACKEND_SCRIPT = """
import sys
from http.server import ThreadingHTTPServer
from agl_core.testing import FakeOpenAI
ThreadingHTTPServer.request_queue_size = 1024  # 64 clients connect at once: the stdlib's backlog of 5 drops some
srv = FakeOpenAI(script=lambda body: "The Seine runs through Paris, as it has for a very long time.").start()
print(srv.url, flush=True)
sys.stdin.read()
"""

# Run under Agent Lightning's interpreter. The same as its `python -m agentlightning.server` (its shipped
# server.yaml, create_app, uvicorn.run with workers=1 and timeout_keep_alive=120), with host, port and model
# set, and without the access log and debug logging that agl's server does not write either.
PEER_SCRIPT = """
import logging, sys
from pathlib import Path
import structlog, uvicorn
import agentlightning
from omegaconf import OmegaConf
from agentlightning.server.app import create_app

port, model = int(sys.argv[1]), sys.argv[2]
config = OmegaConf.load(Path(agentlightning.__file__).parent / "config" / "server.yaml")
config.host, config.port, config.key = "127.0.0.1", port, ""
config.default_proxy.model_name = model
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
print(agentlightning.__version__, flush=True)
uvicorn.run(create_app(config), host=config.host, port=config.port, workers=1, timeout_keep_alive=120,
            access_log=False, log_level="warning")
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "trainer"), env.get("PYTHONPATH", "")])
    return env


def _drain(stream: IO[str] | None) -> None:
    """Read a child's pipe to its end in the background, so a chatty child never blocks on a full pipe."""
    if stream is not None:
        threading.Thread(target=stream.read, daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - 127.0.0.1 only
        return json.loads(response.read() or b"null")


def _wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _http("GET", url + "/healthz", timeout=2.0)
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server at {url} exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server at {url} did not come up in {timeout:g} s") from None
            time.sleep(0.2)


def start_peer(python: str, backend_url: str) -> tuple[subprocess.Popen[str], str, str]:
    """Agent Lightning 1.0's server before the backend, with the backend and one rollout registered."""
    port = _free_port()
    proc = subprocess.Popen([python, "-c", PEER_SCRIPT, str(port), MODEL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items()
                                                                    if k != "PYTHONPATH"})
    assert proc.stdout is not None
    version = proc.stdout.readline().strip()
    _drain(proc.stdout)
    _drain(proc.stderr)
    if not version:
        proc.wait(timeout=10)
        raise RuntimeError(f"Agent Lightning's server did not start under {python} (exit {proc.returncode}); "
                           f"see the set-up in this script's docstring")
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc)
    _http("POST", url + "/api/models", [{"model": MODEL, "endpoint": backend_url, "version": 0}])
    _http("POST", url + "/api/rollouts", [{"rollout_id": "bench", "input": {"question": "bench"}}])
    return proc, url, version


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
    per_conn = max(1, total // concurrency)

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


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per round, target and concurrency")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--peer-python", default=os.environ.get("AGL_BENCH_AGENTLIGHTNING1_PYTHON", str(PEER_PYTHON)),
                        help="a Python 3.12 with bench/requirements-agentlightning1.txt installed")
    parser.add_argument("--no-peer", action="store_true", help="measure agl's gateway alone")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to this file")
    args = parser.parse_args()
    if not args.no_peer and not Path(args.peer_python).exists():
        parser.error(f"no Agent Lightning interpreter at {args.peer_python}: set it up as this script's docstring "
                     f"says, pass --peer-python, or --no-peer")

    procs: list[subprocess.Popen[str]] = []
    backend = subprocess.Popen([sys.executable, "-c", BACKEND_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=_env())
    procs.append(backend)
    try:
        assert backend.stdout is not None
        backend_url = backend.stdout.readline().strip()
        tmp = tempfile.mkdtemp(prefix="agl-bench-")
        ours = subprocess.Popen([sys.executable, "-m", "agl_trainer", "--db", f"{tmp}/bench.db", "--port", "0",
                                 "--backend", backend_url, "--model", MODEL],
                                stdout=subprocess.PIPE, text=True, env=_env())
        procs.append(ours)
        assert ours.stdout is not None
        ours_url = ours.stdout.readline().split()[-1]
        _drain(ours.stdout)
        targets = {"backend": (backend_url, CHAT), "agl": (ours_url, CHAT)}
        names = {"agl": "agl"}
        if not args.no_peer:
            peer, peer_url, version = start_peer(args.peer_python, backend_url)
            procs.append(peer)
            targets["agentlightning"] = (peer_url, PEER_CHAT)
            names["agentlightning"] = f"Agent Lightning {version}"

        results: dict[tuple[str, int], list[float]] = {}
        order = list(targets)
        for concurrency in args.concurrency:
            for r in range(args.rounds):
                for name in order[r % len(order):] + order[:r % len(order)]:
                    url, path = targets[name]
                    host, port = _hostport(url)
                    lat = asyncio.run(_load(host, port, path, concurrency, args.requests))
                    results.setdefault((name, concurrency), []).extend(lat)
        summary = _report(results, args.concurrency, names)
        n = statistics.mean(len(v) for v in results.values())
        print(f"({int(n)} requests per cell, {args.rounds} rounds; added = through the gateway minus straight "
              f"to the backend)")
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _report(results: dict[tuple[str, int], list[float]], concurrencies: list[int], names: dict[str, str]
            ) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    header = f"{'concurrency':>11} {'backend p50':>11} {'p99':>7}"
    for name in names:
        header += f" | {names[name] + ' added p50':>28} {'p99':>7}"
    if "agentlightning" in names:
        header += f" | {'ratio p50':>9} {'p99':>6}"
    print(header + "   (ms)")
    for concurrency in concurrencies:
        b = results[("backend", concurrency)]
        row: dict[str, float] = {"backend_p50": _pct(b, 0.5) * 1e3, "backend_p99": _pct(b, 0.99) * 1e3}
        line = f"{concurrency:>11} {row['backend_p50']:>11.3f} {row['backend_p99']:>7.3f}"
        for name in names:
            g = results[(name, concurrency)]
            row[f"{name}_p50"] = _pct(g, 0.5) * 1e3
            row[f"{name}_p99"] = _pct(g, 0.99) * 1e3
            row[f"{name}_added_p50"] = row[f"{name}_p50"] - row["backend_p50"]
            row[f"{name}_added_p99"] = row[f"{name}_p99"] - row["backend_p99"]
            line += f" | {row[f'{name}_added_p50']:>28.3f} {row[f'{name}_added_p99']:>7.3f}"
        if "agentlightning" in names:
            for q in ("p50", "p99"):
                ours = row[f"agl_added_{q}"]
                row[f"ratio_{q}"] = row[f"agentlightning_added_{q}"] / ours if ours > 0 else float("inf")
            line += f" | {row['ratio_p50']:>9.1f} {row['ratio_p99']:>6.1f}"
        print(line)
        summary[str(concurrency)] = row
    if "agentlightning" in names:
        print("ratio: Agent Lightning's added latency over agl's (higher: agl adds less)")
    c1 = summary.get("1")
    if c1 is not None:
        verdict = "meets" if c1["agl_added_p50"] < 1.0 else "misses"
        print(f"target: agl's added p50 at concurrency 1 under 1 ms: {verdict} ({c1['agl_added_p50']:.3f} ms)")
    return summary


if __name__ == "__main__":
    main()
