"""The harness the overhead benchmarks share: variants, interleaved rounds, paired overheads, the report.

A benchmark times one workload under several variants (``none``, the baseline with no
instrumentation; OpenInference; agl in its set-ups), each switched on by its ``active()``
context manager for one round at a time. On a shared machine the speed of the process
drifts over seconds (other jobs, CPU frequency, caches), by more than the overheads
measured, so the variants are never timed one after another in blocks. Instead every
round runs each variant once, in an order shuffled anew each round, and a
variant's overhead is the median over rounds of its time minus the baseline's *in the same
round*: drift moves both sides of each difference alike and cancels, a round that a burst
of noise hit is outvoted by the median, and no variant always runs first or last. Round 0
warms every variant up (imports, caches, lazily built wrappers) and is dropped, so ratios
between overheads (agl's over OpenInference's) hold steady from run to run.

Each round is timed in wall time, what an agent waits, and in the process's CPU time,
which leaves out what other processes take from this one and so is the steadier figure.

Each timed stretch starts with ``gc.collect()``: the garbage of the variant timed before (an SDK's
spans, a stream's chunks) is collected then, not charged to whichever variant comes next (over HTTP,
where a run makes many more objects, that spill-over moved agl's ratios by a tenth or two).

Two more guards against a busy machine, the same for every variant: a benchmark may have
each round start with ``warmup`` untimed calls (``time_calls(..., warmup=1)``), so the
first call after a variant is switched on (cold caches, lazily built state) is not charged
to that variant's round; and ``report`` prints, beside the ratio of the median overheads,
the median over rounds of the ratio of two variants' overheads *in the same round*
(``round_ratios``), which a slow stretch of the run moves less, since it slows both sides
of each ratio alike.

Scripts run as ``python bench/<name>.py`` put this folder on the path, so ``import harness``.
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

Timing = tuple[float, float]  # (wall, process CPU) µs per call of one round
Times = dict[str, list[Timing]]  # per variant name, one Timing per kept round


class NullExporter(SpanExporter):
    """Drops every span: the SDK's whole per-span path runs, and nothing leaves the process."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def sdk_provider() -> TracerProvider:
    """An OpenTelemetry SDK provider exporting to ``NullExporter``, as a user's provider would, minus the I/O."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(NullExporter()))
    return provider


class Variant:
    """One way of running the workload; this base is the baseline, ``none``, with nothing switched on."""

    name = "none"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        yield


class _Instrumentor(Protocol):
    def instrument(self, **kwargs: Any) -> Any: ...

    def uninstrument(self, **kwargs: Any) -> Any: ...


class OpenInference(Variant):
    """OpenInference instrumentors on their own SDK provider, instrumented for this variant's rounds only."""

    def __init__(self, name: str, instrumentors: Sequence[_Instrumentor]) -> None:
        self.name = name
        self.instrumentors = list(instrumentors)
        self.provider = sdk_provider()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for instrumentor in self.instrumentors:
            instrumentor.instrument(tracer_provider=self.provider, skip_dep_check=True)
        try:
            yield
        finally:
            for instrumentor in reversed(self.instrumentors):
                instrumentor.uninstrument()


@contextlib.contextmanager
def server_process(**fake_openai: Any) -> Iterator[str]:
    """``agl_core.testing.FakeOpenAI(**fake_openai)`` in a child process (forked, so a script closure needs no
    pickling), for its URL. In a thread of this process the server's own work would be counted in this
    process's CPU time, alike for every variant but with its own noise, larger than the overheads measured
    over HTTP; in a child it is left out, and the CPU figures are the client's alone (wall time still waits
    for the server)."""
    import multiprocessing

    from agl_core.testing import FakeOpenAI

    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()

    def serve() -> None:
        with FakeOpenAI(**fake_openai) as server:
            theirs.send(server.url)
            try:
                theirs.recv()  # until this process says stop, or ends
            except EOFError:
                pass

    child = context.Process(target=serve, name="FakeOpenAI", daemon=True)
    child.start()
    try:
        yield ours.recv()
    finally:
        ours.send("stop")
        child.join(5)
        if child.is_alive():
            child.kill()


# --------------------------------------------------------------------------- timing


def time_calls(call: Callable[[], object], calls: int, warmup: int = 0) -> Timing:
    """µs per call of ``calls`` calls, in wall and in process CPU time (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        call()
    gc.collect()  # what the variant timed before this one left behind is not collected in this one's time
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    return (time.perf_counter() - wall) / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


async def time_calls_async(call: Callable[[], Awaitable[object]], calls: int, warmup: int = 0) -> Timing:
    """``time_calls`` for a coroutine function, awaited one call after another."""
    for _ in range(warmup):
        await call()
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        await call()
    return (time.perf_counter() - wall) / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


def median_us(fn: Callable[[], object], calls: int, repeats: int = 3) -> float:
    """Median over ``repeats`` runs of µs per call of ``fn`` (wall time), for the hooks-alone figures."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def _order(variants: Sequence[Variant], rounds: int) -> Iterator[tuple[int, Variant]]:
    """(round, variant) for ``rounds`` + 1 rounds, each round in an order of its own, shuffled (seeded, so every
    run of a benchmark times the same orders). A rotation would keep the cyclic order, so that one variant
    always ran right after the same other one and took over what that one left in the caches and the heap."""
    rng = random.Random(len(variants) * 1000 + rounds)
    for r in range(rounds + 1):
        order = list(variants)
        rng.shuffle(order)
        for variant in order:
            yield r, variant


def interleave(variants: Sequence[Variant], rounds: int, run: Callable[[], Timing]) -> Times:
    """Time ``run`` once per variant per round, in shuffled order; round 0 warms up and is dropped."""
    times: Times = {v.name: [] for v in variants}
    for r, variant in _order(variants, rounds):
        with variant.active():
            timing = run()
        if r:
            times[variant.name].append(timing)
    return times


async def interleave_async(variants: Sequence[Variant], rounds: int, run: Callable[[], Awaitable[Timing]]) -> Times:
    """``interleave`` for async workloads: each variant is switched on inside the task that makes the calls,
    so the rollout context agl reads is the one the calls run in."""
    times: Times = {v.name: [] for v in variants}
    for r, variant in _order(variants, rounds):
        with variant.active():
            timing = await run()
        if r:
            times[variant.name].append(timing)
    return times


# --------------------------------------------------------------------------- report


def report(title: str, times: Times, *, unit: str = "call", decimals: int = 1, best_rounds: bool = False,
           peers: Sequence[str] = ("openinference",), target: float | None = None) -> None:
    """Print per variant its median µs per ``unit`` and its overhead over ``none``, then agl's overhead over each
    peer's, for every variant whose name starts with ``agl``.

    The overhead is the median over rounds of (variant - baseline) in the same round, in wall and in CPU time.
    ``best_rounds`` adds the CPU overhead of the best rounds (fastest variant round - fastest baseline round),
    which also leaves out what other processes take from this one's caches.
    """
    base = times["none"]
    base_wall, base_cpu = (statistics.median(b[k] for b in base) for k in (0, 1))
    best_base = min(b[1] for b in base)
    d = decimals
    columns = ["wall overhead", "CPU overhead"] + (["CPU, best rounds"] if best_rounds else [])
    print(f"\n{title}  ({len(base)} rounds; µs per {unit})")
    print(f"  {'variant':<15} {'wall median':>12}" + "".join(f" {c:>22}" for c in columns))
    overhead: dict[str, list[float]] = {}
    for name, values in times.items():
        wall = statistics.median(v[0] for v in values)
        if name == "none":
            print(f"  {name:<15} {wall:12.{d}f}")
            continue
        extra = [statistics.median(v[k] - b[k] for v, b in zip(values, base, strict=True)) for k in (0, 1)]
        shares = [base_wall, base_cpu]
        if best_rounds:
            extra.append(min(v[1] for v in values) - best_base)
            shares.append(best_base)
        overhead[name] = extra
        cells = "".join(f" {e:+13.{d}f} ({e / s:+6.1%})" for e, s in zip(extra, shares, strict=True))
        print(f"  {name:<15} {wall:12.{d}f}{cells}")
    labels = ["wall", "CPU"] + (["CPU best rounds"] if best_rounds else [])
    for ours in (name for name in overhead if name.startswith("agl")):
        for peer in (p for p in peers if p in overhead):
            ratios = [f"{label} {mine / theirs:.2f}"
                      for mine, theirs, label in zip(overhead[ours], overhead[peer], labels, strict=True) if theirs > 0]
            per_round = [f"{label} {r:.2f}" for label, r in zip(("wall", "CPU"), round_ratios(times, ours, peer),
                                                                  strict=True) if r is not None]
            if per_round:
                ratios.append(f"median of per-round ratios: {', '.join(per_round)}")
            peer_label = "OpenInference" if peer == "openinference" else peer
            goal = f"  (target <= {target:.2f})" if target is not None else ""
            print(f"  {ours} overhead / {peer_label} overhead: {', '.join(ratios) or 'n/a (peer overhead <= 0)'}{goal}")


def round_ratios(times: Times, ours: str, peer: str) -> tuple[float | None, float | None]:
    """The median over rounds of ``ours``'s overhead over ``peer``'s in the same round, in wall and CPU time.

    Each round's two overheads are taken against that round's baseline, so the round's drift is in both and
    cancels in their ratio; a round where the peer's overhead came out at zero or below is left out.
    """
    out: list[float | None] = []
    for k in (0, 1):
        ratios = [(a[k] - b[k]) / (p[k] - b[k])
                  for a, p, b in zip(times[ours], times[peer], times["none"], strict=True) if p[k] - b[k] > 0]
        out.append(statistics.median(ratios) if ratios else None)
    return out[0], out[1]
