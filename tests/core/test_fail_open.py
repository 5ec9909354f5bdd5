"""Fail-open, for the ``openai`` plugin and agl_core itself: no fault inside agl changes what the agent gets.

The faults are found by introspection, so a hook added later is covered without
editing this file: every function and method of ``agl_core.openai_client.attributes``
(its own and the agl_core helpers it imports: ``dumps``, ``to_genai``, ...), the
agl_core helpers the instrumentor imports (``set_on``, ``sampler_attributes``) and
``collector.tracer`` are each made to raise in turn while a small agent runs sync,
async, streamed and tool-calling requests. Besides those: a user SDK provider whose
exporter raises or blocks, or whose processor raises, and a store that is full or
locked when the rollout ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

import agl_core as agl
from agl_core import collector, encoding, guard, semconv
from agl_core.errors import StoreError
from agl_core.openai_client import OpenAIInstrumentor, attributes
from agl_core.openai_client import instrumentor as openai_instrumentor
from agl_core.testing import FakeOpenAI
from agl_core.testing.faults import (
    blocking_exporter,
    check_reported,
    fault_id,
    hook_faults,
    inject,
    raising_exporter,
    raising_processor,
)

USER = [{"role": "user", "content": "What is the capital of France?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
RESPONSES_TOOL: Any = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
SCRIPT = ["Paris.", "Paris, streamed.",
          {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
          {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Lyon"}}]},
          "Async Paris."]


# --------------------------------------------------------------------------- the faults, by introspection


FAULTS = hook_faults(attributes, openai_instrumentor)


def test_the_introspection_finds_the_hooks_that_matter() -> None:
    names = {fault_id(f) for f in FAULTS}
    for must in ("agl_core.openai_client.attributes.request_attributes",
                 "agl_core.openai_client.attributes.response_attributes",
                 "agl_core.openai_client.attributes.dumps", "StreamAccumulator.add", "StreamAccumulator.attributes",
                 "agl_core.openai_client.instrumentor.set_on", "agl_core.collector.tracer"):
        assert must in names, sorted(names)


# --------------------------------------------------------------------------- the agent


def _client(srv: FakeOpenAI) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)


def agent(srv: FakeOpenAI, during: Callable[[], None] = lambda: None,
          after: Callable[[], None] = lambda: None) -> list[Any]:
    """Plain, streamed, tool-calling (plain and streamed) and async requests; what the agent got back.

    ``during`` runs inside the rollout block before the calls and ``after`` after them (to arm a fault
    only while hooks run, one that would also break ``agl.rollout`` and ``emit_reward``, not hooks).
    """
    client = _client(srv)
    extra = {"return_token_ids": True}
    out: list[Any] = []
    with agl.rollout("fail-open") as run:
        during()
        fresh = [{"role": "user", "content": f"new to the message memo: {uuid.uuid4()}"}]
        r = client.chat.completions.create(model="m", messages=fresh, logprobs=True, extra_body=extra)
        out.append(r.choices[0].message.content)
        stream = client.chat.completions.create(model="m", messages=USER, stream=True, extra_body=extra,
                                                stream_options={"include_usage": True})
        out.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        r = client.chat.completions.create(model="m", messages=[*USER, {"role": "assistant", "content": "x"}],
                                           tools=[TOOL], extra_body=extra)
        out.append([(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []])
        with client.chat.completions.create(model="m", messages=USER, tools=[TOOL], stream=True) as stream:
            out.append([(d.function.name if d.function else None) for c in stream if c.choices
                        for d in c.choices[0].delta.tool_calls or []])

        async def call() -> Any:
            aclient = openai.AsyncOpenAI(base_url=srv.url, api_key="x", max_retries=0)
            r = await aclient.chat.completions.create(model="m", messages=USER)
            await aclient.close()
            return r.choices[0].message.content

        out.append(asyncio.run(call()))
        items = [{"role": "user", "content": "Weather?"},
                 {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
        answer = client.responses.create(model="m", input=items, tools=[RESPONSES_TOOL], extra_body=extra)
        out.append(answer.output_text)
        events = client.responses.create(model="m", input="Streamed weather?", stream=True)
        out.append("".join(e.delta for e in events if e.type == "response.output_text.delta"))
        after()
        agl.emit_reward(1.0)
    assert run.rollout.status == "succeeded"
    assert trace.get_current_span() is trace.INVALID_SPAN, "a span of ours was left current"
    out.append(run.trajectory().reward)
    return out


def failing_agent(srv: FakeOpenAI) -> tuple[type[BaseException], str]:
    with pytest.raises(openai.APIStatusError) as caught:
        _client(srv).chat.completions.create(model="m", messages=USER)
    return type(caught.value), str(caught.value)


@pytest.fixture(params=["light", "sdk"])
def plugin(request: pytest.FixtureRequest) -> Iterator[TracerProvider | None]:
    """The openai plugin on, with agl's own tracer or with a user SDK provider."""
    saved = collector._t.explicit
    provider = TracerProvider() if request.param == "sdk" else None
    p = OpenAIInstrumentor()
    if p.is_instrumented_by_opentelemetry:
        p.uninstrument()
    collector.use_provider(provider)
    p.instrument(tracer_provider=provider, skip_dep_check=True)
    guard.reset_fault_counts()
    try:
        yield provider
    finally:
        p.uninstrument()
        collector._t.explicit = saved
        collector._t.tracer = None
        guard.reset_fault_counts()


def _baseline() -> tuple[list[Any], tuple[type[BaseException], str]]:
    with FakeOpenAI(script=SCRIPT) as srv:
        good = agent(srv)
    with FakeOpenAI(status=500) as srv:
        bad = failing_agent(srv)
    return good, bad


@pytest.mark.parametrize("fault", FAULTS, ids=fault_id)
def test_a_fault_in_any_hook_function_never_changes_what_the_agent_gets(
        plugin: TracerProvider | None, fault: tuple[Any, str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    good, bad = _baseline()
    assert guard.fault_counts() == {}
    hits: list[int] = []
    arm = inject(monkeypatch, fault, hits)
    caplog.set_level(logging.WARNING, logger="agl")
    with FakeOpenAI(script=SCRIPT) as srv:
        if fault[0] is collector:  # agl.rollout() itself needs the tracer: arm the fault inside the block
            got = agent(srv, during=arm, after=monkeypatch.undo)
        else:
            arm()
            got = agent(srv)
    assert got == good
    if fault[0] is not collector:
        with FakeOpenAI(status=500) as srv:
            assert failing_agent(srv) == bad  # the agent's own error passes through unchanged
    monkeypatch.undo()

    assert hits, f"the agent never reached {fault_id(fault)}: this case tests nothing"
    check_reported(caplog)


def test_a_fault_is_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    guard.reset_fault_counts()
    caplog.set_level(logging.WARNING, logger="agl")
    for i in range(100):
        guard.report("test.site", ValueError(f"fault {i}"))

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str")

    guard.report("test.other", Unprintable())  # a report never raises, whatever it is given
    assert guard.fault_counts() == {"test.site": 100, "test.other": 1}
    assert guard.fault_summary() == "test.other: 1\ntest.site: 100"
    assert [r.args[0] for r in caplog.records] == ["test.site", "test.other"]  # type: ignore[index]
    assert "ValueError: fault 0" in caplog.records[0].getMessage()
    caplog.clear()
    guard._log_totals()  # what the process logs at exit
    assert [r.getMessage() for r in caplog.records] == [
        "agl: 100 faults in test.site in this process (the first was logged with its traceback)"]
    guard.reset_fault_counts()


# --------------------------------------------------------------------------- the user's provider misbehaves


@contextlib.contextmanager
def _with_user_provider(provider: TracerProvider | None) -> Iterator[None]:
    saved = collector._t.explicit
    p = OpenAIInstrumentor()
    if p.is_instrumented_by_opentelemetry:
        p.uninstrument()
    collector.use_provider(provider)
    p.instrument(tracer_provider=provider, skip_dep_check=True)
    try:
        yield
    finally:
        p.uninstrument()
        collector._t.explicit = saved
        collector._t.tracer = None


def test_a_raising_exporter_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with FakeOpenAI(script=SCRIPT) as srv:
        expected = agent(srv)  # agl's own tracer: no exporter at all
    provider = TracerProvider()
    exporter = raising_exporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with _with_user_provider(provider):
        with FakeOpenAI(script=SCRIPT) as srv:
            assert agent(srv) == expected
    assert exporter.calls > 0


def test_a_blocking_exporter_does_not_hold_the_agent() -> None:
    """The rule: agl never exports, flushes or waits on an exporter on the agent's path.

    agl's own processor only appends the finished span to its rollout's buffer. Exporting is the
    user's processor's job; with the SDK's ``BatchSpanProcessor`` (the one to use with a remote
    backend) a backend that never answers costs the agent nothing, and agl's rollout is complete.
    """
    def twenty_calls(srv: FakeOpenAI) -> tuple[float, agl.RolloutRun]:
        started = time.monotonic()
        with agl.rollout("calls") as run:
            for _ in range(20):
                _client(srv).chat.completions.create(model="m", messages=USER)
        return time.monotonic() - started, run

    provider = TracerProvider()
    exporter = blocking_exporter()  # each export waits 60 s for a backend that never answers
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1, max_export_batch_size=1))
    try:
        with FakeOpenAI(script=SCRIPT) as srv:
            with _with_user_provider(None):
                unblocked, _ = twenty_calls(srv)
            with _with_user_provider(provider):
                agent(srv)  # the first export starts and blocks
                assert exporter.entered.wait(10)
                blocked, run = twenty_calls(srv)
        assert not exporter.release.is_set()  # the exporter was still blocked when the agent finished
        # timings on a shared machine are noisy: the bound is loose, but far below one blocked export
        assert blocked < 3 * unblocked + 5, f"the agent waited {blocked:.1f} s (vs {unblocked:.1f} s unblocked)"
        assert len([s for s in run.rollout.spans if s.name == "chat m"]) == 20
    finally:
        exporter.release.set()
        provider.shutdown()


@pytest.mark.parametrize("on", ["start", "end", "both"])
def test_a_raising_user_processor_never_reaches_the_agent_and_the_rollout_stays_complete(on: str) -> None:
    """A user processor added before agl's raises: the SDK stops its chain there, agl still gets every span."""
    provider = TracerProvider()
    provider.add_span_processor(raising_processor(on))
    guard.reset_fault_counts()
    with _with_user_provider(provider):
        with FakeOpenAI(script=["Paris."]) as srv:
            with agl.rollout("raising-processor") as run:
                r = _client(srv).chat.completions.create(model="m", messages=USER)
                with agl.tool_call("lookup", arguments={"q": 1}) as call:
                    call.result = "ok"
                agl.emit_reward(1.0)
            assert r.choices[0].message.content == "Paris."
            with FakeOpenAI(status=500) as failing:
                with pytest.raises(openai.InternalServerError):
                    _client(failing).chat.completions.create(model="m", messages=USER)
    assert sorted(s.name for s in run.rollout.spans) == ["agl.reward", "agl.rollout raising-processor", "chat m",
                                                          "execute_tool lookup"]
    assert run.rollout.status == "succeeded" and run.trajectory().reward == 1.0
    counts = guard.fault_counts()
    assert counts and set(counts) <= {"collector.start_span", "collector.span_end"}, counts
    guard.reset_fault_counts()


# --------------------------------------------------------------------------- the store misbehaves at rollout end


def _run_into(store: agl.SqliteStore, srv: FakeOpenAI, task_id: str, big: int = 0) -> tuple[Any, Any]:
    client = _client(srv)
    with agl.rollout(task_id, store=store, metadata={"pad": "x" * big}) as run:
        r = client.chat.completions.create(model="m", messages=USER)
        agl.emit_reward(1.0)
    return r.choices[0].message.content, run


@pytest.fixture
def openai_on() -> Iterator[None]:
    with _with_user_provider(None):
        yield


def test_a_full_store_keeps_the_result_and_what_was_stored(tmp_path: Any, openai_on: None) -> None:
    path = tmp_path / "full.db"
    store = agl.SqliteStore(path)
    with FakeOpenAI(script=["Paris."] * 10) as srv:
        answer, first = _run_into(store, srv, "kept")
        assert answer == "Paris." and first.store_error is None
        conn = sqlite3.connect(path)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        store.close()
        store = agl.SqliteStore(path)
        # every connection of the store is capped at the pages it has now: the next big write cannot fit
        for conn_ in [store._checkout()[0]]:
            conn_.execute(f"PRAGMA max_page_count = {pages + 1}")
        guard.reset_fault_counts()
        answer, full = _run_into(store, srv, "too-big", big=200_000)
    assert answer == "Paris."  # the agent's result is unchanged
    assert full.rollout.status == "succeeded" and full.trajectory().reward == 1.0  # and still in memory
    assert isinstance(full.store_error, StoreError)
    assert "full" in str(full.store_error) and str(path) in str(full.store_error)
    assert guard.fault_counts().get("rollout store write") == 1
    kept = store.get_rollout(first.id)  # nothing already stored is lost
    assert kept is not None and kept.status == "succeeded" and len(kept.spans) == len(first.rollout.spans)
    assert store.get_rollout(full.id) is None  # and no half-written rollout
    assert [t.rollout_id for t in store.transitions()] == [first.id]
    store.close()
    guard.reset_fault_counts()


def test_a_locked_store_keeps_the_result_and_what_was_stored(tmp_path: Any, openai_on: None) -> None:
    path = tmp_path / "locked.db"
    store = agl.SqliteStore(path, timeout=0.3)
    with FakeOpenAI(script=["Paris."] * 10) as srv:
        _, first = _run_into(store, srv, "kept")
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another process holds the file
        try:
            guard.reset_fault_counts()
            started = time.monotonic()
            answer, locked = _run_into(store, srv, "locked-out")
            waited = time.monotonic() - started
        finally:
            holder.execute("ROLLBACK")
            holder.close()
    assert answer == "Paris."
    assert waited < 3, "the agent waited past the store's timeout"
    assert isinstance(locked.store_error, StoreError) and "locked" in str(locked.store_error)
    assert guard.fault_counts().get("rollout store write") == 1
    kept = store.get_rollout(first.id)
    assert kept is not None and len(kept.spans) == len(first.rollout.spans)
    assert store.get_rollout(locked.id) is None
    store.put_rollout(locked.rollout, locked.trajectory())  # the caller can store it once the lock is gone
    assert store.get_rollout(locked.id) is not None
    store.close()
    guard.reset_fault_counts()


def test_encoding_never_raises_on_odd_values() -> None:
    class Hostile:
        def __iter__(self) -> Any:
            raise RuntimeError("no iteration")

        def __repr__(self) -> str:
            return "<Hostile>"

    assert encoding.span_text(Hostile())  # falls back to repr, never raises
    assert semconv.GEN_AI_INPUT_MESSAGES  # the module's names stay importable
