"""Rollout context: attribution across tasks and threads, rewards, failures."""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import agl_core as agl
from agl_core import collector, semconv


def _tool_span(name: str) -> None:
    """What a plugin does for a tool call: a GenAI execute_tool span on agl's tracer."""
    with collector.tracer().start_as_current_span(
        semconv.tool_span_name(name),
        attributes={semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL, semconv.GEN_AI_TOOL_NAME: name},
    ):
        pass


def test_sync_rollout_collects_spans_and_rewards() -> None:
    with agl.rollout("t-1", task={"q": "2+2"}) as run:
        _tool_span("calc")
        agl.emit_reward(0.25, name="tool_ok")
        agl.emit_reward(1.0)
    r = run.rollout
    assert r.status == "succeeded" and r.task == {"q": "2+2"} and r.end_time is not None
    assert [s.name for s in r.spans][0].startswith(semconv.SPAN_ROLLOUT)
    assert all(s.rollout_id == r.id for s in r.spans)
    root = r.spans[0]
    assert all(s.parent_id == root.span_id for s in r.spans[1:])
    assert [(w.name, w.value) for w in r.rewards] == [("tool_ok", 0.25), (None, 1.0)]
    assert r.final_reward == 1.0
    assert run.trajectory().reward == 1.0


def test_agent_exception_passes_through_and_marks_rollout_failed() -> None:
    class Boom(Exception):
        pass

    err = Boom("agent broke")
    with pytest.raises(Boom) as caught:
        with agl.rollout("t-fail") as run:
            raise err
    assert caught.value is err
    assert run.rollout.status == "failed" and "agent broke" in (run.rollout.error or "")
    assert run.rollout.spans[0].status == "error"


def test_trajectory_before_end_is_an_error() -> None:
    with agl.rollout("t-early") as run:
        with pytest.raises(RuntimeError, match="still running"):
            run.trajectory()


def test_spans_outside_rollouts_belong_to_none() -> None:
    _tool_span("outside")
    with agl.rollout("t-in") as run:
        _tool_span("inside")
    _tool_span("after")
    names = [s.name for s in run.rollout.spans]
    assert "execute_tool inside" in names
    assert not any("outside" in n or "after" in n for n in names)
    assert agl.current_rollout_id() is None


def test_bad_reward_is_rejected_with_field_name() -> None:
    with agl.rollout("t-bad"):
        with pytest.raises(agl.SchemaError, match="emit_reward.value"):
            agl.emit_reward(float("nan"))
        with pytest.raises(agl.SchemaError, match="emit_reward.value"):
            agl.emit_reward("1.0")  # type: ignore[arg-type]
        with pytest.raises(agl.SchemaError, match="emit_object.obj"):
            agl.emit_object({"x": object()})


def test_emit_message_object_exception_are_spans() -> None:
    with agl.rollout("t-emit") as run:
        agl.emit_message("hello")
        agl.emit_object({"answer": 4})
        agl.emit_exception(ValueError("handled"))
    kinds = {s.attributes.get(semconv.AGL_SPAN_KIND): s for s in run.rollout.spans}
    assert kinds["message"].attributes[semconv.AGL_MESSAGE_BODY] == "hello"
    assert kinds["object"].attributes[semconv.AGL_OBJECT_JSON] == '{"answer": 4}'
    assert kinds["exception"].status == "error" and kinds["exception"].events[0]["name"] == "exception"


def test_rollout_fn_sync_and_async() -> None:
    @agl.rollout_fn
    def agent(task: dict[str, int]) -> float:
        _tool_span("add")
        return float(task["a"] + task["b"] == 5)

    assert agent({"id": "sum-1", "a": 2, "b": 3}) == 1.0
    run = agent.last_run  # type: ignore[attr-defined]
    assert run.rollout.task_id == "sum-1" and run.trajectory().reward == 1.0

    @agl.rollout_fn
    async def aagent(task: dict[str, int]) -> float:
        await asyncio.sleep(0)
        return 0.0

    assert asyncio.run(aagent({"task_id": "sum-2"})) == 0.0
    assert aagent.last_run.rollout.task_id == "sum-2"  # type: ignore[attr-defined]
    assert aagent.last_run.rollout.final_reward == 0.0  # type: ignore[attr-defined]


async def _one_async_rollout(i: int) -> agl.RolloutRun:
    async with agl.rollout(f"task-{i}") as run:
        for _ in range(3):
            await asyncio.sleep(0)
            _tool_span(f"tool-{i}")
        child = asyncio.create_task(_child(i))  # a task created inside inherits the rollout
        await child
        agl.emit_reward(float(i))
    return run


async def _child(i: int) -> None:
    await asyncio.sleep(0)
    _tool_span(f"child-{i}")


def _check_isolated(run: agl.RolloutRun, i: int) -> None:
    r = run.rollout
    tools = [s.attributes[semconv.GEN_AI_TOOL_NAME] for s in r.spans if semconv.GEN_AI_TOOL_NAME in s.attributes]
    assert sorted(tools) == sorted([f"tool-{i}"] * 3 + [f"child-{i}"]), (i, tools)
    assert r.final_reward == float(i)
    assert {s.trace_id for s in r.spans} == {r.spans[0].trace_id}


def test_200_concurrent_asyncio_rollouts_have_no_cross_talk() -> None:
    async def main() -> list[agl.RolloutRun]:
        return await asyncio.gather(*(_one_async_rollout(i) for i in range(200)))

    runs = asyncio.run(main())
    for i, run in enumerate(runs):
        _check_isolated(run, i)
    assert not collector._open  # every buffer released


def test_8_threads_of_rollouts_and_context_copying_executors() -> None:
    results: dict[int, list[agl.RolloutRun]] = {}
    pool = ThreadPoolExecutor(4)

    def worker(t: int) -> None:
        runs = []
        for k in range(10):
            i = t * 100 + k
            with agl.rollout(f"task-{i}") as run:
                for _ in range(3):
                    _tool_span(f"tool-{i}")
                # work handed to another thread with the caller's context, as asyncio.to_thread does
                ctx = contextvars.copy_context()
                pool.submit(ctx.run, _tool_span, f"child-{i}").result()
                agl.emit_reward(float(i))
            runs.append(run)
        results[t] = runs

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pool.shutdown()
    for t, runs in results.items():
        for k, run in enumerate(runs):
            _check_isolated(run, t * 100 + k)


def test_to_thread_inside_async_rollout() -> None:
    async def main() -> agl.RolloutRun:
        async with agl.rollout("t-thread") as run:
            await asyncio.to_thread(_tool_span, "in-thread")
        return run

    run = asyncio.run(main())
    assert any(s.name == "execute_tool in-thread" for s in run.rollout.spans)


def test_nested_rollouts_keep_their_own_spans() -> None:
    with agl.rollout("outer") as outer:
        _tool_span("o")
        with agl.rollout("inner") as inner:
            _tool_span("i")
            agl.emit_reward(2.0)
        agl.emit_reward(1.0)
    assert outer.rollout.final_reward == 1.0 and inner.rollout.final_reward == 2.0
    assert "execute_tool i" not in [s.name for s in outer.rollout.spans]
    assert "execute_tool o" not in [s.name for s in inner.rollout.spans]


def test_user_provider_is_used_never_replaced() -> None:
    """A global SDK provider set by the user gets agl's processor and sees agl's spans (fresh process)."""
    code = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        import agl_core as agl

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        agl.instrument([])
        with agl.rollout("t") as run:
            agl.emit_reward(1.0)
        assert trace.get_tracer_provider() is provider
        names = sorted(s.name for s in exporter.get_finished_spans())
        assert names == ["agl.reward", "agl.rollout t"], names
        assert len(run.rollout.spans) == 2
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_provider_set_after_instrument_is_picked_up() -> None:
    code = textwrap.dedent(
        """
        import agl_core as agl
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        agl.instrument([])
        with agl.rollout("before") as run:
            agl.emit_reward(1.0)
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        with agl.rollout("after") as run2:
            agl.emit_reward(1.0)
        assert len(run.rollout.spans) == 2 and len(run2.rollout.spans) == 2
        assert sorted(s.name for s in exporter.get_finished_spans()) == ["agl.reward", "agl.rollout after"]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_tool_call_spans_record_outcomes() -> None:
    with agl.rollout("t-tools") as run:
        with agl.tool_call("calc", call_id="c1", arguments={"x": 1}) as ok:
            ok.result = 2
        with agl.tool_call("calc", call_id="c2") as bad:
            bad.error("division by zero")
        with pytest.raises(ZeroDivisionError):
            with agl.tool_call("calc", call_id="c3"):
                1 / 0  # noqa: B018
    tools = {s.attributes[semconv.GEN_AI_TOOL_CALL_ID]: s for s in run.rollout.spans
             if semconv.GEN_AI_TOOL_CALL_ID in s.attributes}
    assert tools["c1"].attributes[semconv.AGL_TOOL_STATUS] == "ok"
    assert tools["c1"].attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS] == '{"x": 1}'
    assert tools["c1"].attributes[semconv.GEN_AI_TOOL_CALL_RESULT] == "2"
    assert tools["c2"].attributes[semconv.AGL_TOOL_STATUS] == "error" and tools["c2"].status == "error"
    assert tools["c3"].attributes[semconv.AGL_TOOL_STATUS] == "exception"
    assert tools["c3"].attributes[semconv.ERROR_TYPE] == "ZeroDivisionError"


def test_light_spans_carry_the_span_contexts_the_api_would_build() -> None:
    """The light tracer builds its span contexts without the API's checks: they are the API's own, field for field,
    under agl's span, under another tracer's span and with no parent at all."""
    from opentelemetry import trace as api
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    from agl_core.tracer import LightTracer

    tracer = LightTracer()
    root = tracer.start_span("root")
    child = tracer.start_span("child", context=api.set_span_in_context(root))
    foreign = NonRecordingSpan(SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED)))
    under_foreign = tracer.start_span("under", context=api.set_span_in_context(foreign))
    with api.use_span(root):
        current_child = tracer.start_span("current")
    for span in (root, child, under_foreign, current_child):
        ctx = span.get_span_context()
        built = SpanContext(ctx.trace_id, ctx.span_id, False, TraceFlags(TraceFlags.SAMPLED))
        assert type(ctx) is SpanContext and tuple(ctx) == tuple(built) and ctx == built
        assert ctx.is_valid and not ctx.is_remote and ctx.trace_flags.sampled
    assert root.parent is None
    assert child.parent == root.context and child.context.trace_id == root.context.trace_id
    assert current_child.parent == root.context
    assert under_foreign.parent == foreign.get_span_context() and under_foreign.context.trace_id == 0xABC
