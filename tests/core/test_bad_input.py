"""Bad input never crashes agl: each kind gets a clear error naming the field, or is recorded with a marker.

The rules (limits and markers live in :mod:`agl_core.encoding`, where they are configured):

- **Rewards**: NaN, infinities, ints beyond a float, bools and non-numbers raise ``SchemaError``
  naming ``emit_reward.value`` (and ``Transition.reward`` etc. in records).
- **emit_object / a rollout's task**: values JSON cannot hold (bytes, sets, objects, NaN,
  nesting past ``schema.MAX_DEPTH`` = 64, cycles) raise ``SchemaError`` with the path of the bad
  value (``emit_object.obj.x``).
- **Huge text** in messages and message attributes is kept whole (a cut prompt trains the wrong
  thing); a tool's arguments or result longer than ``encoding.limits.max_text_chars`` (default
  1,000,000, env ``AGL_MAX_TEXT_CHARS``) is cut and ends with ``…[agl: truncated N chars]``.
- **Binary** tool arguments or results become ``[agl: binary, N bytes]``; images as data URLs
  are text and kept.
- **Non-JSON tool arguments and results** are recorded as JSON where they can be, else their
  ``repr``, else ``[agl: unrepresentable <type>]``. Attribute values OpenTelemetry cannot hold
  (objects, dicts, nested lists given to ``emit_*(attributes=...)``) are recorded as their JSON
  text; NaN and infinite attribute values as the text ``"nan"``/``"inf"``.
- **Invalid unicode** (lone surrogates) in span text becomes U+FFFD when the rollout is recorded;
  a record built by hand with one is refused by the store with ``SchemaError`` and nothing is
  written.
- **The TransitionBuilder** lists an LLM span it cannot read (invalid, too deep or oddly shaped
  message JSON, bad token ids) in ``Trajectory.skipped`` with the reason, never raises.
- **JSON records** nested too deeply to parse raise ``SchemaError``, not ``RecursionError``.

And nothing stored before is ever lost.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import agl_core as agl
from agl_core import encoding, semconv
from agl_core.openai_client import OpenAIInstrumentor
from agl_core.schema import Rollout, Span, Transition
from agl_core.testing import FakeOpenAI


def _deep(levels: int) -> list[Any]:
    root: list[Any] = []
    node = root
    for _ in range(levels):
        child: list[Any] = []
        node.append(child)
        node = child
    return root


def _cycle() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


class Hostile:
    """An object whose every conversion raises."""

    def __iter__(self) -> Any:
        raise RuntimeError("no iteration")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    def __str__(self) -> str:
        raise RuntimeError("no str")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[agl.SqliteStore]:
    with agl.SqliteStore(tmp_path / "bad.db") as s:
        with agl.rollout("kept", store=s) as first:
            agl.emit_reward(1.0)
        assert first.store_error is None
        s.kept_id = first.id  # type: ignore[attr-defined]
        yield s
        kept = s.get_rollout(first.id)  # nothing already stored is lost, whatever a test did
        assert kept is not None and kept.rewards[0].value == 1.0


# --------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400, -(10**400), True, "1.0", None, [1.0]],
                         ids=repr)
def test_a_reward_that_is_not_a_finite_number_is_refused_by_name(value: Any) -> None:
    with agl.rollout("bad-reward") as run:
        with pytest.raises(agl.SchemaError, match=r"^emit_reward\.value: must be a (finite )?number"):
            agl.emit_reward(value)
    assert run.rollout.status == "succeeded" and run.trajectory().reward is None


@pytest.mark.parametrize("field", ["reward", "credited_reward"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_transition_with_a_non_finite_reward_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(agl.SchemaError, match=rf"^Transition\.{field}: must be a finite number"):
        Transition(rollout_id="r", task_id="t", index=0, prompt=[], response={"role": "assistant", "content": "x"},
                   **{field: value})


# --------------------------------------------------------------------------- emit_* and tasks


@pytest.mark.parametrize(("obj", "where"), [
    (b"\x00\x01", "emit_object.obj: is not JSON-serialisable: bytes"),
    ({1, 2}, "emit_object.obj: is not JSON-serialisable: set"),
    ({"x": object()}, "emit_object.obj.x: is not JSON-serialisable: object"),
    ({"x": math.nan}, "emit_object.obj.x: must be a finite number"),
    ({"x": [1, math.inf]}, r"emit_object.obj.x\[1\]: must be a finite number"),
    ({1: "int key"}, "emit_object.obj: object keys must be strings"),
    (_deep(10_000), "nested deeper than 64 levels"),
    (_cycle(), "nested deeper than 64 levels"),
], ids=["bytes", "set", "object", "nan", "inf-in-list", "int-key", "deep", "cycle"])
def test_emit_object_refuses_what_json_cannot_hold_naming_the_path(obj: Any, where: str) -> None:
    with agl.rollout("bad-object") as run:
        with pytest.raises(agl.SchemaError, match=where):
            agl.emit_object(obj)
    assert run.rollout.status == "succeeded"


@pytest.mark.parametrize("task", [b"bytes", {"x": math.nan}, _deep(200), {"x": Hostile()}],
                         ids=["bytes", "nan", "deep", "object"])
def test_a_task_json_cannot_hold_is_refused_before_the_agent_runs(task: Any) -> None:
    with pytest.raises(agl.SchemaError, match=r"^Rollout\.task"):
        agl.rollout("t", task=task)


def test_emit_message_takes_only_text_and_keeps_huge_text_whole(store: agl.SqliteStore) -> None:
    with agl.rollout("msg", store=store) as run:
        with pytest.raises(agl.SchemaError, match="emit_message.message: must be a string, got bytes"):
            agl.emit_message(b"binary")  # type: ignore[arg-type]
        huge = "x" * 5_000_000
        agl.emit_message(huge)
    assert run.store_error is None
    (span,) = [s for s in store.spans(run.id) if s.name == semconv.SPAN_MESSAGE]
    assert span.attributes[semconv.AGL_MESSAGE_BODY] == huge


def test_attribute_values_opentelemetry_cannot_hold_are_recorded_as_text(store: agl.SqliteStore) -> None:
    attributes = {"obj": object(), "dict": {"a": [1, {"b": 2}]}, "nested": [[1, 2], [3]], "nan": math.nan,
                  "inf": -math.inf, "deep": _deep(5000), "hostile": Hostile(), "bytes": b"\x00" * 10,
                  "mixed": [1, "a", None]}
    with agl.rollout("attrs", store=store) as run:
        agl.emit_message("m", attributes=attributes)
    assert run.store_error is None, run.store_error
    (span,) = [s for s in store.spans(run.id) if s.name == semconv.SPAN_MESSAGE]
    got = span.attributes
    assert json.loads(got["obj"]).startswith("<object object at") and json.loads(got["dict"]) == {"a": [1, {"b": 2}]}
    assert json.loads(got["nested"]) == [[1, 2], [3]]
    assert got["nan"] == "nan" and got["inf"] == "-inf"
    assert got["deep"] == "[agl: unrepresentable list]"
    assert json.loads(got["hostile"]) == "[agl: unrepresentable Hostile]"
    assert got["bytes"] == "[agl: binary, 10 bytes]" and json.loads(got["mixed"]) == [1, "a", None]


# --------------------------------------------------------------------------- tool arguments and results


@pytest.mark.parametrize(("arguments", "recorded"), [
    ({"when": object()}, lambda text: text.startswith('{"when": "<object object at')),
    ({"ids": {3, 1}}, lambda text: json.loads(text)["ids"] in ([1, 3], [3, 1], "{1, 3}")),
    (_cycle(), lambda text: text == "[[...]]"),
    (_deep(5000), lambda text: text == "[agl: unrepresentable list]"),
    (Hostile(), lambda text: text == "[agl: unrepresentable Hostile]"),
    (b"\x89PNG" + bytes(1000), lambda text: text == "[agl: binary, 1004 bytes]"),
    (bytearray(b"ab"), lambda text: text == "[agl: binary, 2 bytes]"),
    (memoryview(b"abc"), lambda text: text == "[agl: binary, 3 bytes]"),
    ({"x": math.nan}, lambda text: text == '{"x": NaN}'),
    ("bad \ud800 unicode", lambda text: text == "bad \ufffd\ufffd\ufffd unicode"),
], ids=["object", "set", "cycle", "deep", "hostile", "bytes", "bytearray", "memoryview", "nan", "surrogate"])
def test_tool_arguments_json_cannot_hold_are_recorded_with_a_marker(store: agl.SqliteStore, arguments: Any,
                                                                      recorded: Any) -> None:
    with agl.rollout("tool", store=store) as run:
        with agl.tool_call("t", arguments=arguments) as call:
            call.result = arguments
    assert run.store_error is None, run.store_error
    (span,) = [s for s in store.spans(run.id) if s.name == "execute_tool t"]
    args, result = span.attributes[semconv.GEN_AI_TOOL_CALL_ARGUMENTS], span.attributes[semconv.GEN_AI_TOOL_CALL_RESULT]
    assert recorded(args), args
    assert recorded(result), result


def test_a_huge_tool_result_is_cut_at_the_configured_limit_with_a_marker(store: agl.SqliteStore,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert encoding.limits.max_text_chars == 1_000_000  # the default
    big = "y" * 1_500_000
    with agl.rollout("big-tool", store=store) as run:
        with agl.tool_call("t", arguments={"q": "x"}) as call:
            call.result = big
    (span,) = [s for s in store.spans(run.id) if s.name == "execute_tool t"]
    text = span.attributes[semconv.GEN_AI_TOOL_CALL_RESULT]
    assert text == "y" * 1_000_000 + "…[agl: truncated 500000 chars]"
    monkeypatch.setattr(encoding.limits, "max_text_chars", 10)
    assert encoding.span_text("z" * 25) == "z" * 10 + "…[agl: truncated 15 chars]"
    assert encoding.span_text({"k": "v" * 20}) == '{"k":"vvvv…[agl: truncated 18 chars]'
    assert encoding.span_text("short") == "short"


# --------------------------------------------------------------------------- the openai plugin end to end


@pytest.fixture
def openai_on() -> Iterator[None]:
    plugin = OpenAIInstrumentor()
    if not plugin.is_instrumented_by_opentelemetry:
        plugin.instrument(skip_dep_check=True)
    yield
    plugin.uninstrument()


def test_huge_and_binary_messages_through_the_openai_plugin(openai_on: None,
                                                                           store: agl.SqliteStore) -> None:
    image = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n" + bytes(300_000)).decode()
    huge = "word " * 400_000  # 2 MB
    messages: list[Any] = [
        {"role": "system", "content": huge},
        {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                     {"type": "image_url", "image_url": {"url": image}}]},
    ]
    with FakeOpenAI(script=["A blank image."]) as srv, agl.rollout("big", store=store) as run:
        client = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=messages,
                                               extra_body={"return_token_ids": True})
    assert reply.choices[0].message.content == "A blank image."
    assert run.store_error is None, run.store_error
    (t,) = store.transitions(rollout_id=run.id)
    assert t.prompt[0]["content"] == huge  # kept whole
    parts = t.prompt[1]["content"]
    assert parts[1]["image_url"]["url"] == image and parts[0]["text"] == "What is in the picture?"
    assert t.response_token_ids and t.response == {"role": "assistant", "content": "A blank image."}


# --------------------------------------------------------------------------- schema and stores


def test_json_records_too_deep_or_malformed_get_a_schema_error() -> None:
    for cls in (Rollout, Span, Transition, agl.Trajectory):
        with pytest.raises(agl.SchemaError, match=rf"^{cls.__name__}: is nested deeper than 64 levels"):
            cls.from_json("[" * 100_000 + "]" * 100_000)
        with pytest.raises(agl.SchemaError, match=rf"^{cls.__name__}: is not valid JSON"):
            cls.from_json("{")
    with pytest.raises(agl.SchemaError, match=r"^Rollout.start_time: must be a finite number, got nan"):
        Rollout.from_json('{"id":"r","task_id":"t","attempt":1,"status":"succeeded","start_time":NaN}')
    with pytest.raises(agl.SchemaError, match=r"^Span.attributes.x"):
        Span(span_id="a", trace_id="b", name="n", start_ns=0, end_ns=1, attributes={"x": _deep(100)})


def test_the_store_refuses_invalid_unicode_clearly_and_loses_nothing(store: agl.SqliteStore) -> None:
    bad = Rollout(id="bad", task_id="t\ud800", attempt=1, status="succeeded", start_time=1.0,
                  spans=[Span(span_id="a", trace_id="b", name="n\udfff", start_ns=0, end_ns=1, rollout_id="bad")])
    with pytest.raises(agl.SchemaError, match="not valid unicode.*nothing was written"):
        store.put_rollout(bad)
    assert store.get_rollout("bad") is None
    with agl.rollout("t\ud800", store=store) as run:  # a task id from a broken decoder, in a live rollout
        agl.emit_reward(1.0)
    assert isinstance(run.store_error, agl.SchemaError) and run.trajectory().reward == 1.0


def test_a_huge_rollout_round_trips_through_the_store(store: agl.SqliteStore) -> None:
    with agl.rollout("huge", store=store) as run:
        for i in range(20):
            agl.emit_message(f"{i}" * 500_000)
    assert run.store_error is None
    back = store.get_rollout(run.id)
    assert back is not None and back.to_json() == run.rollout.to_json()


# --------------------------------------------------------------------------- the TransitionBuilder


def _llm(span_id: str, attrs: dict[str, Any], parent: str | None = None) -> Span:
    return Span(span_id=span_id, trace_id="t", name="chat", parent_id=parent, start_ns=1, end_ns=2,
                attributes={semconv.GEN_AI_OPERATION_NAME: "chat", **attrs})


IDS = {semconv.AGL_PROMPT_TOKEN_IDS: [1], semconv.AGL_RESPONSE_TOKEN_IDS: [2]}


@pytest.mark.parametrize(("attrs", "reason"), [
    ({semconv.GEN_AI_OUTPUT_MESSAGES: "{not json"}, "unreadable message attribute"),
    ({semconv.GEN_AI_OUTPUT_MESSAGES: "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
    ({semconv.GEN_AI_OUTPUT_MESSAGES: '{"a": 1}'}, "unreadable LLM span"),
    ({semconv.GEN_AI_OUTPUT_MESSAGES: "[5]"}, "unreadable LLM span"),
    ({semconv.GEN_AI_INPUT_MESSAGES: "5", **IDS}, "unreadable LLM span"),
    ({semconv.GEN_AI_INPUT_MESSAGES: '[{"role": 5, "parts": 7}]', **IDS}, "unreadable LLM span"),
    ({semconv.GEN_AI_TOOL_DEFINITIONS: "[1,", **IDS}, "unreadable message attribute"),
    ({semconv.AGL_PROMPT_TOKEN_IDS: ["a"], semconv.AGL_RESPONSE_TOKEN_IDS: ["b"]}, "prompt_token_ids[0]"),
    ({semconv.AGL_PROMPT_TOKEN_IDS: 5, semconv.AGL_RESPONSE_TOKEN_IDS: 6}, "unreadable LLM span"),
    ({**IDS, semconv.AGL_RESPONSE_LOGPROBS: ["nan"]}, "response_logprobs[0]"),
    ({}, "no response recorded"),
], ids=["invalid-json", "too-deep", "object-not-list", "number-message", "input-not-list", "bad-parts",
        "bad-tools", "string-ids", "scalar-ids", "nan-logprob", "nothing"])
def test_the_builder_lists_an_unreadable_llm_span_as_skipped_with_the_reason(attrs: dict[str, Any],
                                                                           reason: str) -> None:
    good = _llm("g", {**IDS, semconv.GEN_AI_OUTPUT_MESSAGES: '[{"role":"assistant","parts":[]}]'})
    traj = agl.TransitionBuilder().build_from_spans([good, _llm("b", attrs)], rollout_id="r", task_id="t")
    assert [t.span_id for t in traj.transitions] == ["g"]  # the readable call is still trained
    (skipped,) = traj.skipped
    assert skipped.span_id == "b" and reason in skipped.reason, skipped.reason
