"""Spans written and read per second: agl's SqliteStore under 8 writer processes and concurrent readers.

The rollouts written are agent runs recorded through agl's own instrumentation
(``transitions_throughput.rollout_specs``: 2-6 chat calls with token ids and
logprobs, tools, nested agents, rewards; about 12 spans and 4 transitions each).
A pool of them is recorded once; each writer process writes ``--rollouts /
--writers`` of them under fresh ids, each one as ``agl.rollout`` writes a finished
run: one ``put_rollout(rollout, trajectory)`` (rollout row, spans, transitions, one
transaction). Meanwhile ``--readers`` reader processes read the spans of random
rollouts (``store.spans(rollout_id)``) as a trainer or dashboard would. After the
writers finish, the readers read every rollout once more with no writer running.

Reported: spans written per second (all writers, first start to last end), rollouts
per second, p50/p99 latency of one rollout's write, spans read per second while
the writers run and after.

Agent Lightning 0.3 has no SQLite store (its ``store/sqlite.py`` is empty); its
store for several processes is ``LightningStoreServer`` over its in-memory store,
which worker processes reach through ``LightningStoreClient``. ``--peer-python``
runs that set-up with the same numbers of writers, readers and spans: per rollout
``start_rollout``, ``add_many_spans`` and ``update_attempt(status="succeeded")``;
readers call ``query_spans``. Different architectures (an embedded file vs a
server holding everything in memory); both are what each project offers several
worker processes.

    PYTHONPATH=src .venv/bin/python bench/store_throughput.py [--writers 8] [--readers 2] [--rollouts 4000] \\
        [--peer-python .venvs/bench-agl03/bin/python] [--peer-rollouts 800]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# --------------------------------------------------------------------------- the agl side


def _pool(n: int) -> list[tuple[str, str]]:
    """``n`` recorded rollouts with their trajectories, as JSON (what crosses into the writer processes)."""
    sys.path.insert(0, HERE)
    from agl_core.transitions import TransitionBuilder
    from transitions_throughput import _record_agl, rollout_specs

    builder = TransitionBuilder()
    return [(r.to_json(), builder.build(r).to_json()) for r in _record_agl(rollout_specs(n, seed=1))]


def _agl_writer(path: str, pool: list[tuple[str, str]], w: int, count: int, start: Any, out: Any) -> None:
    import dataclasses

    from agl_core.schema import Rollout, Trajectory
    from agl_core.store.sqlite import SqliteStore

    store = SqliteStore(path)
    work = []
    for i in range(count):
        rollout_json, traj_json = pool[(w * count + i) % len(pool)]
        rid = f"w{w}-{i}"
        rollout = Rollout.from_json(rollout_json)
        rollout = dataclasses.replace(rollout, id=rid, spans=[dataclasses.replace(s, rollout_id=rid)
                                                              for s in rollout.spans])
        traj = Trajectory.from_json(traj_json)
        traj = dataclasses.replace(traj, rollout_id=rid, transitions=[dataclasses.replace(t, rollout_id=rid)
                                                                      for t in traj.transitions])
        work.append((rollout, traj))
    start.wait()
    latencies = []
    spans = 0
    t0 = time.perf_counter()
    for rollout, traj in work:
        t = time.perf_counter()
        store.put_rollout(rollout, traj, validate=False)  # as agl.rollout writes a run it has just built
        latencies.append(time.perf_counter() - t)
        spans += len(rollout.spans)
    out.put(("write", w, spans, latencies, t0, time.perf_counter()))
    store.close()


def _agl_reader(path: str, ids: list[str], r: int, start: Any, writers_done: Any, out: Any) -> None:
    from agl_core.store.sqlite import SqliteStore

    store = SqliteStore(path)
    rng = random.Random(r)
    start.wait()
    spans = calls = 0
    t0 = time.perf_counter()
    while not writers_done.is_set():
        spans += len(store.spans(rng.choice(ids)))
        calls += 1
    out.put(("read_during", r, spans, calls, t0, time.perf_counter()))
    t0 = time.perf_counter()
    spans = 0
    for rid in ids[r::2] if len(ids) > 1 else ids:
        spans += len(store.spans(rid))
    out.put(("read_after", r, spans, 0, t0, time.perf_counter()))
    store.close()


def run_agl(args: argparse.Namespace) -> dict[str, Any]:
    from agl_core.store.sqlite import SqliteStore

    pool = _pool(args.pool)
    per = args.rollouts // args.writers
    ids = [f"w{w}-{i}" for w in range(args.writers) for i in range(per)]
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        SqliteStore(path).close()  # create the file and its tables before the race
        start = ctx.Barrier(args.writers + args.readers + 1)
        writers_done = ctx.Event()
        out = ctx.Queue()
        procs = [ctx.Process(target=_agl_writer, args=(path, pool, w, per, start, out)) for w in range(args.writers)]
        readers = [ctx.Process(target=_agl_reader, args=(path, ids, r, start, writers_done, out))
                   for r in range(args.readers)]
        for p in procs + readers:
            p.start()
        start.wait()
        results = [out.get() for _ in procs]
        writers_done.set()
        results += [out.get() for _ in range(2 * len(readers))]
        for p in procs + readers:
            p.join()
        db_mb = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)) / 1e6
    return _summary("agl SqliteStore", results, db_mb)


def _summary(name: str, results: list[tuple[Any, ...]], db_mb: float | None = None) -> dict[str, Any]:
    writes = [r for r in results if r[0] == "write"]
    latencies = sorted(lat for r in writes for lat in r[3])
    span_total = sum(r[2] for r in writes)
    wall = max(r[5] for r in writes) - min(r[4] for r in writes)

    def read_rate(kind: str) -> float | None:
        rows = [r for r in results if r[0] == kind]
        if not rows:
            return None
        return sum(r[2] for r in rows) / (max(r[5] for r in rows) - min(r[4] for r in rows))

    return {
        "name": name, "rollouts": len(latencies), "spans": span_total, "wall_s": wall,
        "write_spans_s": span_total / wall, "write_rollouts_s": len(latencies) / wall,
        "p50_ms": latencies[len(latencies) // 2] * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
        "read_during_spans_s": read_rate("read_during"), "read_after_spans_s": read_rate("read_after"),
        "db_mb": db_mb,
    }


# --------------------------------------------------------------------------- Agent Lightning 0.3


def _peer_pool(pool_json: str) -> list[list[dict[str, Any]]]:
    """The same recorded rollouts, each span as the fields agentlightning.Span needs."""
    pool: list[list[dict[str, Any]]] = json.loads(pool_json)
    return pool


def _peer_writer(url: str, pool: list[list[dict[str, Any]]], w: int, count: int, start: Any, out: Any) -> None:
    import asyncio

    from agentlightning import Span
    from agentlightning.store.client_server import LightningStoreClient

    async def main() -> None:
        client = LightningStoreClient(url)
        start.wait()
        latencies = []
        spans_written = 0
        t0 = time.perf_counter()
        for i in range(count):
            t = time.perf_counter()
            attempted = await client.start_rollout(input={"task": f"w{w}-{i}"})
            rid, aid = attempted.rollout_id, attempted.attempt.attempt_id
            spans = [Span.from_attributes(rollout_id=rid, attempt_id=aid, sequence_id=n, **fields)
                     for n, fields in enumerate(pool[(w * count + i) % len(pool)])]
            await client.add_many_spans(spans)
            await client.update_attempt(rid, aid, status="succeeded")
            latencies.append(time.perf_counter() - t)
            spans_written += len(spans)
        out.put(("write", w, spans_written, latencies, t0, time.perf_counter()))
        await client.close()

    asyncio.run(main())


def _peer_reader(url: str, r: int, start: Any, writers_done: Any, out: Any) -> None:
    import asyncio

    from agentlightning.store.client_server import LightningStoreClient

    async def main() -> None:
        client = LightningStoreClient(url)
        rng = random.Random(r)
        start.wait()
        spans = calls = 0
        ids: list[str] = []
        t0 = time.perf_counter()
        while not writers_done.is_set():
            if calls % 20 == 0:  # the server names the rollouts: learn some of their ids now and then
                ids = [ro.rollout_id for ro in await client.query_rollouts(limit=200)]
            if ids:
                spans += len(await client.query_spans(rng.choice(ids)))
            else:
                await asyncio.sleep(0.01)
            calls += 1
        out.put(("read_during", r, spans, calls, t0, time.perf_counter()))
        ids = [ro.rollout_id for ro in await client.query_rollouts()]
        t0 = time.perf_counter()
        spans = 0
        for rid in ids[r::2] if len(ids) > 1 else ids:
            spans += len(await client.query_spans(rid))
        out.put(("read_after", r, spans, 0, t0, time.perf_counter()))
        await client.close()

    asyncio.run(main())


def _peer_server(port: int, ready: Any, stop: Any) -> None:
    import asyncio

    from agentlightning.store.client_server import LightningStoreServer
    from agentlightning.store.memory import InMemoryLightningStore

    async def main() -> None:
        server = LightningStoreServer(InMemoryLightningStore(), host="127.0.0.1", port=port)
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop()

    asyncio.run(main())


def run_peer(args: argparse.Namespace) -> dict[str, Any]:
    import logging
    import socket

    logging.disable(logging.WARNING)
    pool = _peer_pool(sys.stdin.read())
    per = args.peer_rollouts // args.writers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    ctx = mp.get_context("fork")
    ready, stop, writers_done = ctx.Event(), ctx.Event(), ctx.Event()
    server = ctx.Process(target=_peer_server, args=(port, ready, stop))
    server.start()
    if not ready.wait(120):
        raise SystemExit("Agent Lightning's store server did not start")
    start = ctx.Barrier(args.writers + args.readers + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=_peer_writer, args=(url, pool, w, per, start, out)) for w in range(args.writers)]
    readers = [ctx.Process(target=_peer_reader, args=(url, r, start, writers_done, out)) for r in range(args.readers)]
    for p in procs + readers:
        p.start()
    start.wait()
    results = [out.get() for _ in procs]
    writers_done.set()
    results += [out.get() for _ in range(2 * len(readers))]
    for p in procs + readers:
        p.join()
    stop.set()
    server.join(30)
    return _summary("agentlightning 0.3 server", results)


def _peer_spans_json(args: argparse.Namespace) -> str:
    """The pool's spans in the fields agentlightning.Span.from_attributes takes (same names, attributes, times)."""
    from agl_core.schema import Rollout

    pool = []
    for rollout_json, _ in _pool(args.pool):
        rollout = Rollout.from_json(rollout_json)
        pool.append([{"trace_id": s.trace_id, "span_id": s.span_id, "parent_id": s.parent_id, "name": s.name,
                      "attributes": {k: v for k, v in s.attributes.items() if v is not None},
                      "start_time": s.start_ns / 1e9, "end_time": s.end_ns / 1e9} for s in rollout.spans])
    return json.dumps(pool)


# --------------------------------------------------------------------------- report


def _print(result: dict[str, Any]) -> None:
    during = result["read_during_spans_s"]
    after = result["read_after_spans_s"]
    print(f"  {result['name']:<28} {result['write_spans_s']:>10.0f} {result['write_rollouts_s']:>10.0f} "
          f"{result['p50_ms']:>8.2f} {result['p99_ms']:>8.2f} {during or 0:>12.0f} {after or 0:>12.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=4000, help="rollouts written, over all writers")
    parser.add_argument("--peer-rollouts", type=int, default=800,
                        help="rollouts the Agent Lightning side writes (it writes a few per second here)")
    parser.add_argument("--pool", type=int, default=200, help="distinct recorded rollouts the writers cycle through")
    parser.add_argument("--peer-python", default=None,
                        help="python of an Agent Lightning 0.3 venv, e.g. .venvs/bench-agl03/bin/python")
    parser.add_argument("--side", choices=("peer",), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "peer":
        print(json.dumps(run_peer(args)))
        return

    results = [run_agl(args)]
    if args.peer_python:
        cmd = [os.path.abspath(args.peer_python), os.path.abspath(__file__), "--side", "peer",
               "--writers", str(args.writers), "--readers", str(args.readers),
               "--peer-rollouts", str(args.peer_rollouts), "--pool", str(args.pool)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
        proc = subprocess.run(cmd, input=_peer_spans_json(args), capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"Agent Lightning 0.3 side failed:\n{proc.stderr[-3000:]}")
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    first = results[0]
    print(f"\nstore throughput: {args.writers} writer processes, {args.readers} reader processes; "
          + "; ".join(f"{r['name']}: {r['rollouts']} rollouts, {r['spans']} spans" for r in results))
    print(f"  {'store':<28} {'spans/s w':>10} {'rollout/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'read/s during':>12} {'read/s after':>12}")
    for result in results:
        _print(result)
    if first.get("db_mb"):
        print(f"  agl file size: {first['db_mb']:.1f} MB")
    if len(results) > 1:
        peer = results[1]
        print(f"  agl / agentlightning: write spans/s {first['write_spans_s'] / peer['write_spans_s']:.1f}x, "
              f"p99 write {first['p99_ms'] / peer['p99_ms']:.2f}x, read spans/s after "
              f"{(first['read_after_spans_s'] or 0) / (peer['read_after_spans_s'] or 1):.1f}x")


if __name__ == "__main__":
    main()
