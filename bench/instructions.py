"""CPU instructions each variant adds to one Pydantic AI agent run, counted by valgrind: the same on a busy machine.

Over HTTP the clock of ``pydantic_ai_overhead.py`` moves by a tenth or two of its ratios from one run
to the next on a shared machine, more than a cut of agl's work changes them. ``opcodes.py`` counts
Python byte codes, which hold still but leave out what runs in C (``json`` encoding, dict building,
allocation, the garbage collector). This counts machine instructions (valgrind's callgrind), the C
work included: each variant runs in a process of its own under callgrind, which counts only inside
the measured runs (they are called through ``functools.reduce``, on which callgrind toggles counting),
after 5 warm-up runs and ``gc.freeze()`` (what the warm-up made is not scanned again by every
variant's full collections alike). The fake server runs outside valgrind, in a process of its own,
answering by what it was sent (so the variants' processes can share it).

It reports instructions per run for each variant, what each adds over ``none``, and the ratio of agl's
addition to each peer's: the same variants as ``pydantic_ai_overhead.py``. The count does not charge
cache misses, which the clock does; the clock stays the judge of time, this one of work.

Run (from the repository root; valgrind from the system's packages)::

    .venvs/pydantic_ai/bin/python bench/instructions.py [--http] [--stream] [--runs 30] [--jobs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ["none", "pydantic-ai", "openinference", "openinference+openai", "agl", "agl-pydantic-ai"]
PEERS = ["pydantic-ai", "openinference", "openinference+openai"]
OURS = ["agl", "agl-pydantic-ai"]


def child(variant: str, runs: int, url: str | None, stream: bool) -> None:
    """One variant's runs, in this process (under callgrind): 5 warm-up runs, then ``runs`` counted ones."""
    from pydantic_ai.models.function import FunctionModel

    import pydantic_ai_overhead as bench

    warnings.simplefilter("ignore")
    logging.getLogger("pydantic_ai").setLevel(logging.ERROR)
    agent = bench._agent(bench._chat_model(url) if url else FunctionModel(bench.scripted))

    async def many(n: int) -> None:
        for _ in range(n):
            if stream:
                async with agent.run_stream("What is 6 * 7?") as result:
                    await result.get_output()
            else:
                await agent.run("What is 6 * 7?")

    loop = asyncio.new_event_loop()
    with bench.variant(variant).active():
        loop.run_until_complete(many(5))
        gc.collect()
        gc.freeze()
        functools.reduce(lambda acc, _: loop.run_until_complete(many(runs)), [0], None)  # counted


def _script(body: dict[str, Any]) -> Any:
    """The benchmark's two answers, picked by what was sent: the tool call first, the answer after its result."""
    import pydantic_ai_overhead as bench

    last = (body.get("messages") or [{}])[-1]
    return bench.SCRIPT[1] if isinstance(last, dict) and last.get("role") == "tool" else bench.SCRIPT[0]


def count(variant: str, runs: int, url: str | None, stream: bool) -> float:
    """Instructions per counted run of ``variant``, from callgrind's total."""
    command = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
               "--callgrind-out-file=/dev/null", sys.executable, str(Path(__file__).resolve()), "--child",
               variant, "--runs", str(runs), *(["--url", url] if url else []), *(["--stream"] if stream else [])]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{variant}: valgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1)) / runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--http", action="store_true", help="OpenAIChatModel on the fake server (else FunctionModel)")
    parser.add_argument("--stream", action="store_true", help="run_stream (with --http)")
    parser.add_argument("--runs", type=int, default=30, help="counted runs per variant")
    parser.add_argument("--jobs", type=int, default=2, help="variants counted at once")
    parser.add_argument("--child", metavar="VARIANT", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.child:
        child(args.child, args.runs, args.url, args.stream)
        return
    import harness

    label = ("OpenAIChatModel on the fake server, " + ("run_stream" if args.stream else "run")) if args.http \
        else "FunctionModel, run (no HTTP)"
    with harness.server_process(script=_script, return_token_ids=True) if args.http \
            else contextlib.nullcontext() as url:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            counts = pool.map(lambda v: count(v, args.runs, url, args.stream), VARIANTS)
            per_run = dict(zip(VARIANTS, counts, strict=True))
    base = per_run["none"]
    print(f"{label}: instructions per agent run (2 model requests + 1 tool call), {args.runs} counted runs each")
    for name in VARIANTS:
        added = per_run[name] - base
        extra = "" if name == "none" else f"   {added:+12,.0f} ({added / base:+.1%})"
        print(f"  {name:22} {per_run[name]:14,.0f}{extra}")
    for ours in OURS:
        ratios = ", ".join(f"{peer} {(per_run[ours] - base) / (per_run[peer] - base):.3f}" for peer in PEERS)
        print(f"  {ours} added / peer's added: {ratios}  (target <= 0.20)")


if __name__ == "__main__":
    main()
