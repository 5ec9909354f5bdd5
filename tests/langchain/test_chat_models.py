"""Chat-model runs: one transition per call on every path LangChain has, with what the call said."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from opentelemetry import trace
from pydantic import BaseModel

import agl_core as agl
from agl_core import guard, semconv
from agl_core.instrumentation import Instrumented
from agl_core.schema import Span, Trajectory
from agl_langchain import attributes
from agl_langchain.instrumentor import Hooks

from .fakes import FailingChat, FakeChat, SpyChat, ai, script


def _chat_spans(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.attributes.get(semconv.AGL_PLUGIN) == "langchain"
            and s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == "chat"]


def _texts(traj: Trajectory) -> list[str]:
    return [str(t.response.get("content")) for t in traj.transitions]


def _prompts(traj: Trajectory) -> list[str]:
    return [str(t.prompt[-1]["content"]) for t in traj.transitions]


def _model() -> FakeChat:
    return FakeChat(messages=script("r1", "r2", "r3"))


# --------------------------------------------------------------------------- every path


def _invoke(m: FakeChat) -> None:
    m.invoke("q1")
    m.invoke("q2")


def _batch(m: FakeChat) -> None:
    m.batch(["q1", "q2", "q3"])


def _stream(m: FakeChat) -> None:
    assert "".join(str(c.content) for c in m.stream("q1")) == "r1"
    assert "".join(str(c.content) for c in m.stream("q2")) == "r2"


def _generate(m: FakeChat) -> None:
    result = m.generate([[HumanMessage("q1")], [HumanMessage("q2")], [HumanMessage("q3")]])
    assert [g[0].text for g in result.generations] == ["r1", "r2", "r3"]


def _structured(m: FakeChat) -> None:
    class Answer(BaseModel):
        city: str

    m.messages = script(ai(calls=[("Answer", {"city": "Paris"}, "c1")]), ai(calls=[("Answer", {"city": "Rome"}, "c2")]))
    structured = m.with_structured_output(Answer)
    assert structured.invoke("q1") == Answer(city="Paris")
    assert structured.invoke("q2") == Answer(city="Rome")


async def _ainvoke(m: FakeChat) -> None:
    await m.ainvoke("q1")
    await m.ainvoke("q2")


async def _abatch(m: FakeChat) -> None:
    await m.abatch(["q1", "q2", "q3"])


async def _astream(m: FakeChat) -> None:
    assert "".join([str(c.content) async for c in m.astream("q1")]) == "r1"
    assert "".join([str(c.content) async for c in m.astream("q2")]) == "r2"


async def _astream_events(m: FakeChat) -> None:
    for question in ("q1", "q2"):
        events = [e["event"] async for e in m.astream_events(question, version="v2")]
        assert events[0] == "on_chat_model_start" and events[-1] == "on_chat_model_end"


async def _agenerate(m: FakeChat) -> None:
    result = await m.agenerate([[HumanMessage("q1")], [HumanMessage("q2")], [HumanMessage("q3")]])
    assert [g[0].text for g in result.generations] == ["r1", "r2", "r3"]


async def _astructured(m: FakeChat) -> None:
    class Answer(BaseModel):
        city: str

    m.messages = script(ai(calls=[("Answer", {"city": "Paris"}, "c1")]), ai(calls=[("Answer", {"city": "Rome"}, "c2")]))
    structured = m.with_structured_output(Answer)
    assert await structured.ainvoke("q1") == Answer(city="Paris")
    assert await structured.ainvoke("q2") == Answer(city="Rome")


ORDERED = {"invoke": _invoke, "stream": _stream, "generate": _generate}
ORDERED_ASYNC = {"ainvoke": _ainvoke, "astream": _astream, "astream_events": _astream_events}
CONCURRENT: dict[str, Callable[[FakeChat], Any]] = {"batch": _batch, "abatch": _abatch, "agenerate": _agenerate}


@pytest.mark.parametrize("path", sorted(ORDERED))
def test_sync_paths_make_one_transition_per_call_in_order(instrumented: Instrumented, hooks: Hooks, path: str) -> None:
    with agl.rollout("t") as run:
        ORDERED[path](_model())
    traj = run.trajectory()
    calls = 3 if path == "generate" else 2
    assert _texts(traj) == ["r1", "r2", "r3"][:calls]
    assert _prompts(traj) == ["q1", "q2", "q3"][:calls]
    assert len(_chat_spans(run.rollout.spans)) == calls and traj.skipped == []
    assert hooks.runs == {}


@pytest.mark.parametrize("path", sorted(ORDERED_ASYNC))
async def test_async_paths_make_one_transition_per_call_in_order(instrumented: Instrumented, hooks: Hooks,
                                                                 path: str) -> None:
    async with agl.rollout("t") as run:
        await ORDERED_ASYNC[path](_model())
    traj = run.trajectory()
    assert _texts(traj) == ["r1", "r2"] and _prompts(traj) == ["q1", "q2"]
    assert len(_chat_spans(run.rollout.spans)) == 2 and traj.skipped == []
    assert hooks.runs == {}


@pytest.mark.parametrize("path", sorted(CONCURRENT))
async def test_concurrent_paths_make_one_transition_per_call(instrumented: Instrumented, hooks: Hooks,
                                                             path: str) -> None:
    async with agl.rollout("t") as run:
        result = CONCURRENT[path](_model())
        if asyncio.iscoroutine(result):
            await result
    traj = run.trajectory()
    # the items run concurrently against one script: which answer each prompt got varies, the set does not
    assert sorted(_prompts(traj)) == ["q1", "q2", "q3"] and sorted(_texts(traj)) == ["r1", "r2", "r3"]
    assert len(_chat_spans(run.rollout.spans)) == 3 and traj.skipped == []
    assert hooks.runs == {}


@pytest.mark.parametrize("path", ["structured", "astructured"])
async def test_with_structured_output_is_captured(instrumented: Instrumented, path: str) -> None:
    async with agl.rollout("t") as run:
        if path == "structured":
            _structured(_model())
        else:
            await _astructured(_model())
    traj = run.trajectory()
    assert len(traj.transitions) == 2
    first = traj.transitions[0]
    assert first.response["tool_calls"][0]["function"] == {"name": "Answer", "arguments": '{"city": "Paris"}'}
    assert first.tools is not None and first.tools[0]["function"]["name"] == "Answer"


def test_streamed_and_invoked_runs_record_the_same_message(instrumented: Instrumented) -> None:
    reply = ai("Let me look.", calls=[("search", {"q": "x"}, "c1")], usage_metadata={
        "input_tokens": 9, "output_tokens": 4, "total_tokens": 13}, response_metadata={"finish_reason": "tool_calls"})
    model = FakeChat(messages=script(reply, reply))
    with agl.rollout("t") as run:
        model.invoke("q")
        list(model.stream("q"))
    invoked, streamed = run.trajectory().transitions
    assert invoked.response == streamed.response
    assert invoked.response["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]
    assert invoked.finish_reason == streamed.finish_reason == "tool_calls"
    usage = [(s.attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS], s.attributes[semconv.GEN_AI_USAGE_OUTPUT_TOKENS])
             for s in _chat_spans(run.rollout.spans)]
    assert usage == [(9, 4), (9, 4)]


# --------------------------------------------------------------------------- what a span says


def test_chat_span_records_request_and_response(instrumented: Instrumented) -> None:
    reply = ai("", calls=[("get_weather", {"city": "Paris"}, "call-1")],
               usage_metadata={"input_tokens": 21, "output_tokens": 7, "total_tokens": 28},
               response_metadata={"finish_reason": "tool_calls", "model_name": "fake-chat-0613", "id": "resp-1"})
    model = FakeChat(messages=script(reply))

    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    bound = model.bind_tools([get_weather]).bind(temperature=0.25, seed=7, max_tokens=64)
    with agl.rollout("t") as run:
        out = bound.invoke([("system", "Be brief."), ("user", "Weather in Paris?")])
    assert out.tool_calls[0]["id"] == "call-1"
    (span,) = _chat_spans(run.rollout.spans)
    a = span.attributes
    assert span.name == "chat fake-chat" and span.status == "unset"
    assert a[semconv.GEN_AI_OPERATION_NAME] == "chat" and a[semconv.AGL_PLUGIN] == "langchain"
    assert a[semconv.GEN_AI_PROVIDER_NAME] == "fake" and a[semconv.GEN_AI_REQUEST_MODEL] == "fake-chat"
    assert a[semconv.GEN_AI_REQUEST_TEMPERATURE] == 0.25 and a[semconv.GEN_AI_REQUEST_SEED] == 7
    assert a[semconv.GEN_AI_REQUEST_MAX_TOKENS] == 64
    assert a[semconv.GEN_AI_RESPONSE_MODEL] == "fake-chat-0613" and a[semconv.GEN_AI_RESPONSE_ID] == "resp-1"
    assert a[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == ["tool_calls"]
    assert (a[semconv.GEN_AI_USAGE_INPUT_TOKENS], a[semconv.GEN_AI_USAGE_OUTPUT_TOKENS]) == (21, 7)
    assert json.loads(a[semconv.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "system", "parts": [{"type": "text", "content": "Be brief."}]},
        {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]},
    ]
    assert json.loads(a[semconv.GEN_AI_OUTPUT_MESSAGES]) == [{
        "role": "assistant", "finish_reason": "tool_calls",
        "parts": [{"type": "tool_call", "id": "call-1", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
    }]
    tools = json.loads(a[semconv.GEN_AI_TOOL_DEFINITIONS])
    assert tools[0]["type"] == "function" and tools[0]["function"]["name"] == "get_weather"
    params = json.loads(a[semconv.AGL_LLM_INVOCATION_PARAMETERS])
    assert params["temperature"] == 0.25 and params["seed"] == 7 and "tools" not in params
    t = run.trajectory().transitions[0]
    assert t.model == "fake-chat-0613" and t.finish_reason == "tool_calls" and t.tools == tools


def test_conversation_with_tool_results_becomes_openai_messages(instrumented: Instrumented) -> None:
    from langchain_core.messages import AIMessage, SystemMessage, ToolMessage

    history = [
        SystemMessage("sys"),
        HumanMessage("add 1 and 2", name="alice"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1"}],
                  additional_kwargs={"tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}),
        ToolMessage("3", tool_call_id="c1"),
    ]
    with agl.rollout("t") as run:
        FakeChat(messages=script("It is 3.")).invoke(history)
    (t,) = run.trajectory().transitions
    assert t.prompt == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "add 1 and 2", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]  # the provider's raw argument string is kept, as the model produced it


def test_a_malformed_tool_call_is_seen_by_air(instrumented: Instrumented) -> None:
    bad = ai("", invalid_tool_calls=[{"name": "add", "args": "{'a': 1", "id": "c9", "error": "bad json",
                                      "type": "invalid_tool_call"}])
    with agl.rollout("t") as run:
        FakeChat(messages=script(bad)).invoke("q")
    traj = run.trajectory(builder=agl.TransitionBuilder(air=agl.AirRules(malformed_tool_call=-1.0)))
    (t,) = traj.transitions
    assert t.response["tool_calls"][0]["function"] == {"name": "add", "arguments": "{'a': 1"}
    assert t.reward == -1.0


# --------------------------------------------------------------------------- failures


def test_a_failing_model_marks_its_span_and_the_exception_passes_through(instrumented: Instrumented,
                                                                         hooks: Hooks) -> None:
    error = ValueError("model exploded")
    model = FailingChat(messages=script(), error=error)
    with agl.rollout("t") as run:
        with pytest.raises(ValueError) as caught:
            model.invoke("q")
    assert caught.value is error
    (span,) = _chat_spans(run.rollout.spans)
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == "ValueError"
    traj = run.trajectory()
    assert traj.transitions == [] and "failed (ValueError)" in traj.skipped[0].reason
    assert hooks.runs == {}


async def test_a_failing_async_stream_marks_its_span(instrumented: Instrumented, hooks: Hooks) -> None:
    model = FailingChat(messages=script(), error=RuntimeError("stream broke"))
    async with agl.rollout("t") as run:
        with pytest.raises(RuntimeError, match="stream broke"):
            async for _ in model.astream("q"):
                pass
    (span,) = _chat_spans(run.rollout.spans)
    assert span.status == "error" and span.attributes[semconv.ERROR_TYPE] == "RuntimeError"
    assert hooks.runs == {}


def test_a_stream_left_early_ends_its_span_with_what_arrived(instrumented: Instrumented, hooks: Hooks) -> None:
    model = FakeChat(messages=script("one two three"))
    with agl.rollout("t") as run:
        root = trace.get_current_span()
        chunks = model.stream("q")
        assert next(chunks).content == "one"
        assert trace.get_current_span() is root  # the caller never holds the chat span between chunks
        chunks.close()
        assert trace.get_current_span() is root
    (span,) = _chat_spans(run.rollout.spans)
    assert span.status == "unset"
    (t,) = run.trajectory().transitions
    assert t.response["content"] == "one"
    assert hooks.runs == {}


def test_generate_over_prompts_that_fails_part_way_leaves_nothing_behind(instrumented: Instrumented,
                                                                         hooks: Hooks) -> None:
    model = FakeChat(messages=script("r1"))  # the second prompt finds the script empty: StopIteration inside
    with agl.rollout("t") as run:
        with pytest.raises(Exception):  # noqa: B017 - whatever LangChain makes of the exhausted script
            model.generate([[HumanMessage("q1")], [HumanMessage("q2")], [HumanMessage("q3")]])
    spans = _chat_spans(run.rollout.spans)
    assert len(spans) == 3 and all(s.status == "error" for s in spans[1:])
    assert hooks.runs == {}


# --------------------------------------------------------------------------- the span is current while the model runs


def test_the_chat_span_is_current_while_the_model_runs_on_every_path(instrumented: Instrumented) -> None:
    model = SpyChat(messages=script(*[f"r{i} x" for i in range(8)]), seen=[])

    async def async_paths() -> None:
        await model.ainvoke("q")
        [c async for c in model.astream("q")]
        await model.agenerate([[HumanMessage("q")], [HumanMessage("q")]])

    with agl.rollout("t") as run:
        root = trace.get_current_span()
        model.invoke("q")
        list(model.stream("q"))
        model.generate([[HumanMessage("q")], [HumanMessage("q")]])
        asyncio.run(async_paths())
        assert trace.get_current_span() is root  # nothing left current afterwards
    spans = _chat_spans(run.rollout.spans)
    assert len(spans) == 8
    by_id = {s.span_id: s for s in spans}
    seen_ids = {format(s.get_span_context().span_id, "016x") for s in model.seen}
    assert seen_ids == set(by_id)  # every call saw its own span, and only chat spans


# --------------------------------------------------------------------------- threads


def test_a_thread_that_never_saw_instrument_is_covered(instrumented: Instrumented) -> None:
    import threading

    results: list[Trajectory] = []

    def worker() -> None:  # a fresh thread: an empty context, nothing inherited from the caller
        with agl.rollout("t") as run:
            FakeChat(messages=script("r1")).invoke("q1")
        results.append(run.trajectory())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert _texts(results[0]) == ["r1"]


# --------------------------------------------------------------------------- fail-open


def test_a_fault_in_agl_at_call_start_leaves_the_call_alone(instrumented: Instrumented, hooks: Hooks,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("agl bug")

    monkeypatch.setattr(attributes, "chat_start_attributes", broken)
    with agl.rollout("t") as run:
        assert _model().invoke("q1").content == "r1"
        assert "".join(str(c.content) for c in _model().stream("q1")) == "r1"
    assert guard.fault_counts()["langchain.chat_start"] == 2
    assert _chat_spans(run.rollout.spans) == [] and hooks.runs == {}


def test_a_fault_in_agl_at_call_end_still_ends_the_span(instrumented: Instrumented, hooks: Hooks,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("agl bug")

    monkeypatch.setattr(attributes, "chat_end_attributes", broken)

    async def call() -> str:
        return str((await _model().ainvoke("q1")).content)

    with agl.rollout("t") as run:
        assert _model().invoke("q1").content == "r1"
        assert asyncio.run(call()) == "r1"
    assert guard.fault_counts()["langchain.chat_end"] == 2
    spans = _chat_spans(run.rollout.spans)
    assert len(spans) == 2 and all(semconv.GEN_AI_INPUT_MESSAGES in s.attributes for s in spans)
    assert hooks.runs == {}
