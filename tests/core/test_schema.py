"""The data model: JSON round-trip, the shipped JSON Schema, and field-named rejections."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_core.errors import SchemaError
from agl_core.schema import (
    MAX_DEPTH,
    SCHEMA_VERSION,
    Reward,
    Rollout,
    Span,
    Trajectory,
    Transition,
    json_schema,
    load_json_schema,
)

SCHEMA = load_json_schema()

text = st.text(max_size=20)
ids = st.text(alphabet="0123456789abcdef", min_size=16, max_size=16)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
json_leaf = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | finite | text
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=10
)
roles = st.sampled_from(["system", "user", "assistant", "tool"])
message = st.fixed_dictionaries({"role": roles, "content": text})
token_ids = st.lists(st.integers(0, 200_000), max_size=8)

spans = st.builds(
    Span, span_id=ids, trace_id=ids.map(lambda s: s * 2), name=text, parent_id=st.none() | ids,
    start_ns=st.integers(0, 2**62), end_ns=st.just(0), attributes=st.dictionaries(text, json_value, max_size=4),
    status=st.sampled_from(["unset", "ok", "error"]), status_message=st.none() | text,
    events=st.lists(st.dictionaries(text, json_value, max_size=2), max_size=2), rollout_id=st.none() | text,
)
rewards = st.builds(Reward, value=finite, name=st.none() | text, span_id=st.none() | ids, time_ns=st.integers(0, 2**62))
rollouts = st.builds(
    Rollout, id=text, task_id=text, attempt=st.integers(1, 5),
    status=st.sampled_from(["running", "succeeded", "failed", "timeout", "cancelled"]), task=json_value,
    spans=st.lists(spans, max_size=3), rewards=st.lists(rewards, max_size=3), start_time=finite,
    end_time=st.none() | finite, error=st.none() | text, metadata=st.dictionaries(text, json_value, max_size=3),
)


@st.composite
def transitions(draw: st.DrawFn) -> Transition:
    response_ids = draw(st.none() | token_ids)
    has_ids = response_ids is not None
    return Transition(
        rollout_id=draw(text), task_id=draw(text), index=draw(st.integers(0, 100)),
        prompt=draw(st.lists(message, max_size=3)), response={"role": "assistant", "content": draw(text)},
        attempt=draw(st.integers(1, 3)), agent_name=draw(st.none() | text), model=draw(st.none() | text),
        prompt_token_ids=draw(token_ids) if has_ids else None, response_token_ids=response_ids,
        response_logprobs=[draw(finite) for _ in response_ids] if has_ids and draw(st.booleans()) else None,
        token_source=draw(st.sampled_from(["gateway", "response", "retokenized"])) if has_ids else None,
        reward=draw(st.none() | finite), credited_reward=draw(st.none() | finite),
        span_id=draw(st.none() | ids), trace_id=draw(st.none() | ids),
    )


trajectories = st.builds(Trajectory, rollout_id=text, task_id=text, transitions=st.lists(transitions(), max_size=3),
                         reward=st.none() | finite)


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**SCHEMA, "$ref": f"#/$defs/{name}"})


@settings(max_examples=60, deadline=None)
@given(st.one_of(spans, rewards, rollouts, transitions(), trajectories))
def test_json_round_trip_and_schema(record: Any) -> None:
    cls = type(record)
    text_form = record.to_json()
    back = cls.from_json(text_form)
    assert back == record
    assert back.to_json() == text_form
    _validator(cls.__name__).validate(json.loads(text_form))


def test_shipped_schema_matches_the_types() -> None:
    assert SCHEMA == json_schema()
    assert SCHEMA["$id"] == f"agl.schema.v{SCHEMA_VERSION}.json"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def _transition_dict(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "rollout_id": "r", "task_id": "t", "index": 0,
        "prompt": [{"role": "user", "content": "hi"}], "response": {"role": "assistant", "content": "yo"},
    }
    base.update(changes)
    return base


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"reward": math.nan}, "Transition.reward"),
        ({"reward": math.inf}, "Transition.reward"),
        ({"reward": "1.0"}, "Transition.reward"),
        ({"reward": True}, "Transition.reward"),
        ({"index": 1.5}, "Transition.index"),
        ({"prompt": "hi"}, "Transition.prompt"),
        ({"prompt": [{"role": "wizard", "content": "x"}]}, "Transition.prompt[0].role"),
        ({"prompt_token_ids": [1, "2"], "response_token_ids": [3]}, "Transition.prompt_token_ids[1]"),
        ({"token_source": "guess"}, "Transition.token_source"),
        ({"response_token_ids": [1, 2], "prompt_token_ids": [1], "response_logprobs": [0.1]},
         "Transition.response_logprobs"),
        ({"extra_field": 1}, "Transition.extra_field"),
        ({"rollout_id": None}, "Transition.rollout_id"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(SchemaError) as err:
        Transition.from_dict(_transition_dict(**changes))
    assert err.value.field == field
    assert field in str(err.value)


def test_missing_field_is_named() -> None:
    data = _transition_dict()
    del data["response"]
    with pytest.raises(SchemaError, match=r"Transition\.response: is required"):
        Transition.from_dict(data)


def test_constructor_validates_too() -> None:
    with pytest.raises(SchemaError, match="Transition.reward"):
        Transition(rollout_id="r", task_id="t", index=0, prompt=[], response={"role": "assistant"},
                   reward=float("nan"))
    with pytest.raises(SchemaError, match="Rollout.attempt"):
        Rollout(id="r", task_id="t", attempt=0)


def test_nested_errors_carry_the_path() -> None:
    bad = {"rollout_id": "r", "task_id": "t", "transitions": [_transition_dict(), _transition_dict(reward=math.nan)]}
    with pytest.raises(SchemaError) as err:
        Trajectory.from_dict(bad)
    assert err.value.field == "Trajectory.transitions[1].reward"


def test_not_json_and_not_serialisable() -> None:
    with pytest.raises(SchemaError, match="not valid JSON"):
        Transition.from_json("{nope")
    with pytest.raises(SchemaError, match=r"Span\.attributes\.x: is not JSON-serialisable: object"):
        Span(span_id="a", trace_id="b", name="n", attributes={"x": object()})
    deep: Any = 1
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(SchemaError, match="nested deeper"):
        Span(span_id="a", trace_id="b", name="n", attributes={"x": deep})


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(list(_transition_dict()) + ["reward", "attempt", "tools"]), json_value))
def test_arbitrary_input_gives_a_record_or_a_schema_error(data: dict[str, Any]) -> None:
    try:
        record = Transition.from_dict(data)
    except SchemaError as err:
        assert err.field.startswith("Transition")
    else:
        _validator("Transition").validate(json.loads(record.to_json()))
