"""Per-call overhead of tracing OpenAI chat calls: no instrumentation vs OpenInference vs agl.

One process, one fake OpenAI-compatible server (``agl_core.testing.FakeOpenAI``,
vLLM-like token ids on), one plain ``openai`` client; each call sends a short
conversation whose last user turn is new, as an agent loop does. The variants run
interleaved in rounds (the order is shuffled each round), so drift on a noisy
machine hits all of them alike; each round gives µs/call per variant, and the
overhead of a variant is the median over rounds of its round time minus the
baseline's in the same round.

- ``none``: the client as is.
- ``openinference``: ``openinference-instrumentation-openai`` on an SDK provider
  with a no-op exporter (instrumented for its rounds only).
- ``agl``: the agl ``openai`` plugin, spans collected into an open rollout
  buffer, on an SDK provider with the same no-op exporter.

Then, separately, the cost per call of turning a finished rollout's spans into
records (``collector.to_record``), and of the agl hook alone with no network.

Run: ``PYTHONPATH=src python bench/openai_overhead.py [--rounds 20] [--calls 200] [--profile]``.
Target: agl's overhead at most 1/5 of OpenInference's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import itertools
import os
import pstats
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import openai
from openinference.instrumentation.openai import OpenAIInstrumentor as OIInstrumentor
from opentelemetry import context as otel_context
from opentelemetry import trace

import harness
from agl_core import collector
from agl_core.openai_client import OpenAIInstrumentor
from agl_core.rollouts import rollout
from agl_core.store.sqlite import SqliteStore
from agl_core.testing import FakeOpenAI, render_prompt, tokenize

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And what river runs through it?"},
]
REQUEST: dict[str, Any] = {"model": "fake-model", "messages": MESSAGES, "temperature": 0.7, "max_tokens": 64,
                           "extra_body": {"return_token_ids": True}}
_turn = itertools.count()


def request() -> dict[str, Any]:
    """One call of an agent loop: the conversation so far (the same message objects) plus a new user turn."""
    question = {"role": "user", "content": f"And what river runs through it? (turn {next(_turn)})"}
    return {**REQUEST, "messages": [*MESSAGES[:-1], question]}


# --------------------------------------------------------------------------- variants


class Agl(harness.Variant):
    """The agl plugin inside an open ``agl.rollout``.

    ``sdk=False`` is agl as most users run it: no OpenTelemetry SDK provider is set, so agl records
    spans with its own minimal tracer. ``sdk=True`` is agl beside a user's SDK provider (the same
    set-up OpenInference gets): spans go through the SDK and its exporters too.
    """

    def __init__(self, sdk: bool) -> None:
        self.name = "agl+sdk" if sdk else "agl"
        self.instrumentor = OpenAIInstrumentor()
        self.provider = harness.sdk_provider() if sdk else None
        self.end_us: list[float] = []  # per call: closing the rollout (spans -> records), no store
        self.store_us: list[float] = []  # per call: closing the rollout with the SQLite store write
        self._tmp = tempfile.TemporaryDirectory()
        self.store = SqliteStore(os.path.join(self._tmp.name, "bench.db"))
        self._rounds = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        collector.use_provider(self.provider)
        self.instrumentor.instrument(tracer_provider=self.provider, skip_dep_check=True)
        try:
            with self._rollout():
                yield
        finally:
            self.instrumentor.uninstrument()
            collector.use_provider(None)

    @contextlib.contextmanager
    def _rollout(self) -> Iterator[None]:
        """One open rollout around a round of calls; its end is timed separately, not counted per call.

        Rounds alternate between a rollout without a store (the cost of turning spans into records)
        and one with the SQLite store (records plus transitions plus the write).
        """
        self._rounds += 1
        with_store = self._rounds % 2 == 0
        run = rollout(task_id="bench", store=self.store if with_store else None)
        run.__enter__()
        try:
            yield
        finally:
            start = time.perf_counter()
            run.__exit__(None, None, None)
            calls = len(run.rollout.spans) - 1  # less the rollout's own span
            if calls > 0:
                (self.store_us if with_store else self.end_us).append((time.perf_counter() - start) / calls * 1e6)


# --------------------------------------------------------------------------- timing


# create is looked up each round: the agl plugin wraps it on the class while its variant is active


def _round_sync(client: openai.OpenAI, calls: int) -> harness.Timing:
    create = client.chat.completions.create
    return harness.time_calls(lambda: create(**request()), calls)


async def _round_async(client: openai.AsyncOpenAI, calls: int) -> harness.Timing:
    create = client.chat.completions.create
    return await harness.time_calls_async(lambda: create(**request()), calls)


async def _interleave_async(variants: Sequence[harness.Variant], rounds: int, url: str, calls: int) -> harness.Times:
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    return await harness.interleave_async(variants, rounds, lambda: _round_async(client, calls))


def _rollout_end_cost(variants: Sequence[harness.Variant]) -> None:
    for v in variants:
        if isinstance(v, Agl) and v.end_us and v.store_us:
            print(f"\n{v.name}: closing the rollout, per call: spans -> records {statistics.median(v.end_us):.1f} µs;"
                  f" with transitions + SQLite write {statistics.median(v.store_us):.1f} µs"
                  f" (medians of {len(v.end_us)} and {len(v.store_us)} rollouts)")


def _canned_completion() -> Any:
    from openai.types.chat import ChatCompletion

    reply = "The Seine runs through Paris."
    return ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "fake-model",
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": tokenize(reply),
                     "message": {"role": "assistant", "content": reply}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
        "prompt_token_ids": tokenize(render_prompt(MESSAGES)),
    })


def _hooks_alone(calls: int) -> dict[str, float]:
    """Each instrumentation around a call that returns a canned response at once: no HTTP, no server.

    OpenInference wraps ``OpenAI.request`` and agl wraps ``Completions.create``; each hook is
    called directly with a stand-in for what it wraps, so only the instrumentation's own work is
    timed, which is far steadier on a noisy machine than the end-to-end difference above.
    """
    from openinference.instrumentation import OITracer, TraceConfig
    from openinference.instrumentation.openai._request import _Request

    from agl_core.openai_client import instrumentor as agl_hook

    completion = _canned_completion()
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")
    resource = client.chat.completions

    # capture the exact (args, kwargs) that create() hands to OpenAI.request
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    original_request = openai.OpenAI.request

    def capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        captured.append((args, kwargs))
        return completion

    openai.OpenAI.request = capture  # type: ignore[method-assign]
    try:
        resource.create(**request())
    finally:
        openai.OpenAI.request = original_request  # type: ignore[method-assign]
    args, kwargs = captured[0]

    def bare_request(*a: Any, **k: Any) -> Any:
        return completion

    oi_provider = harness.sdk_provider()
    oi_tracer: Any = OITracer(oi_provider.get_tracer("bench"), config=TraceConfig())
    oi_hook = _Request(tracer=oi_tracer, openai=openai)

    def bare_create(res: Any, **k: Any) -> Any:
        return completion

    plugin = OpenAIInstrumentor()
    plugin._active = True
    agl_create = plugin._sync_wrapper(bare_create, agl_hook._Types())
    start_attrs = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "m"}

    def span_only() -> Any:
        """What any span-per-call instrumentation pays on agl's tracer: start, make current, end."""
        span = collector.tracer().start_span("chat m", kind=trace.SpanKind.CLIENT, attributes=start_attrs)
        token = otel_context.attach(trace.set_span_in_context(span))
        otel_context.detach(token)
        span.end()
        return completion

    modes = [Agl(sdk=False), Agl(sdk=True)]
    costs: dict[str, float] = {}
    times: dict[str, list[float]] = {"none": [], "openinference": [], "none_create": []}
    for mode in modes:
        times[mode.name] = []
        times[mode.name + " span"] = []
    for _ in range(5):
        times["none"].append(harness.median_us(lambda: bare_request(*args, **kwargs), calls))
        times["none_create"].append(harness.median_us(lambda: bare_create(resource, **request()), calls))
        times["openinference"].append(harness.median_us(lambda: oi_hook(bare_request, client, args, kwargs), calls))
        for mode in modes:
            collector.use_provider(mode.provider)
            with mode._rollout():
                times[mode.name].append(harness.median_us(lambda: agl_create(resource, **request()), calls))
                times[mode.name + " span"].append(harness.median_us(span_only, calls))
            collector.use_provider(None)
    base = statistics.median(times["none"])
    oi = statistics.median(times["openinference"]) - base
    print(f"\nhooks alone (canned response, no network), µs per call:  openinference {oi:.1f}")
    for mode in modes:
        ours = statistics.median(times[mode.name]) - statistics.median(times["none_create"])
        span_cost = statistics.median(times[mode.name + " span"]) - base
        print(f"  {mode.name:<8} {ours:6.1f}   {mode.name} / openinference = {ours / oi:.2f}"
              f"   (of which the bare span: start, make current, end: {span_cost:.1f})")
        costs[mode.name] = ours
    costs["openinference"] = oi
    return costs


def _with_store(variants: Sequence[harness.Variant], hooks: dict[str, float]) -> None:
    """agl's whole cost per call: its hook plus its share of closing the rollout with the SQLite write."""
    oi = hooks["openinference"]
    print("\nper call including the store write (hook + rollout close with transitions + SQLite), µs:")
    for v in variants:
        if isinstance(v, Agl) and v.store_us:
            total = hooks[v.name] + statistics.median(v.store_us)
            print(f"  {v.name:<8} {total:6.1f}   / openinference's hook {oi:.1f} = {total / oi:.2f}  (target <= 0.50)")


def _profile(client: openai.OpenAI, agl: Agl, calls: int) -> None:
    profiler = cProfile.Profile()
    with agl.active():
        profiler.enable()
        _round_sync(client, calls)
        profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(r"agl_core|opentelemetry", 25)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200, help="calls per variant per round")
    parser.add_argument("--profile", action="store_true", help="also cProfile the agl variant (agl and OTel frames)")
    parser.add_argument("--no-async", action="store_true")
    args = parser.parse_args(argv)

    agl = Agl(sdk=False)
    openinference = harness.OpenInference("openinference", [OIInstrumentor()])
    variants: list[harness.Variant] = [harness.Variant(), openinference, agl, Agl(sdk=True)]
    with FakeOpenAI() as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
        print(f"openai {openai.__version__}, {args.rounds} rounds x {args.calls} calls per variant")
        harness.report("sync", harness.interleave(variants, args.rounds, lambda: _round_sync(client, args.calls)),
                       target=0.2)
        if not args.no_async:
            harness.report("async", asyncio.run(_interleave_async(variants, args.rounds, srv.url, args.calls)),
                           target=0.2)
        _rollout_end_cost(variants)
        _with_store(variants, _hooks_alone(args.calls))
        if args.profile:
            _profile(client, agl, args.calls)


if __name__ == "__main__":
    main()
