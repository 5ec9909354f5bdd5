"""Property-based fuzzing (hypothesis) of the schema, the TransitionBuilder and credit assignment.

``test_schema.py`` fuzzes valid records' round trips and arbitrary ``Transition``
dicts; this adds every record class from arbitrary dicts and arbitrary JSON text,
and the builders:

- ``TransitionBuilder`` over arbitrary span trees (random parents, including
  missing ones and cycles; random kinds; missing, malformed or oddly typed
  attributes; out-of-order and equal times) never raises, and every LLM span is
  accounted for: the call it belongs to (its outermost LLM ancestor) is either a
  transition or listed in ``Trajectory.skipped``; transitions are numbered 0..n-1
  in call order and survive their own JSON round trip.
- ``credit.assign`` gives one finite value per step (or None throughout when the
  rollout has no reward), the episode return for ``final``, and return-to-go for
  ``discounted``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import agl_core as agl
from agl_core import credit, semconv
from agl_core.errors import SchemaError
from agl_core.schema import Reward, Rollout, Skipped, Span, Trajectory, Transition

RECORDS = [Span, Rollout, Transition, Trajectory, Reward, Skipped]

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                        st.text(max_size=20))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=25)


def _field_names(cls: type[Any]) -> list[str]:
    from dataclasses import fields

    return [f.name for f in fields(cls)]


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_dict_gives_a_record_or_a_schema_error(cls: type[Any], data: st.DataObject) -> None:
    keys = st.sampled_from(_field_names(cls) + ["extra", "span_id", "reward"])
    raw = data.draw(st.dictionaries(keys, json_value, max_size=12))
    try:
        record = cls.from_dict(raw)
    except SchemaError as exc:
        assert exc.field and str(exc).startswith(exc.field)
        return
    assert cls.from_json(record.to_json()) == record  # a record it accepts is one it can write and read back


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=100, deadline=None)
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                      json_value.map(json.dumps)))
def test_any_json_text_gives_a_record_or_a_schema_error(cls: type[Any], text: str) -> None:
    try:
        cls.from_json(text)
    except SchemaError:
        pass


# --------------------------------------------------------------------------- span trees

KINDS = ["llm", "llm", "llm", "tool", "reward", "agent", "other"]
MESSAGE_JSON = st.one_of(
    st.none(),
    st.just('[{"role":"assistant","parts":[{"type":"text","content":"hi"}]}]'),
    st.just('[{"role":"assistant","parts":[{"type":"tool_call","id":"c1","name":"f","arguments":{"a":1}}]}]'),
    st.just('[{"role":"user","parts":[{"type":"text","content":"q"}]}]'),
    st.just("[]"), st.just("{broken"), st.just("[5]"), st.just('{"a":1}'), st.just("[" * 3000 + "]" * 3000),
    json_value.map(lambda v: json.dumps(v, allow_nan=True)),
    st.integers(),
)
TOKEN_IDS = st.one_of(st.none(), st.lists(st.integers(min_value=0, max_value=10**6), max_size=5),
                      st.lists(st.text(max_size=2), min_size=1, max_size=2), st.integers())


@st.composite
def span_trees(draw: st.DrawFn) -> list[Span]:
    n = draw(st.integers(min_value=0, max_value=14))
    ids = [f"{i:016x}" for i in range(1, n + 1)]
    spans = []
    for span_id in ids:
        kind = draw(st.sampled_from(KINDS))
        attrs: dict[str, Any] = {}
        if kind == "llm":
            attrs[semconv.GEN_AI_OPERATION_NAME] = draw(st.sampled_from(sorted(semconv.LLM_OPERATIONS)))
            for key in (semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES,
                        semconv.GEN_AI_TOOL_DEFINITIONS):
                value = draw(MESSAGE_JSON)
                if value is not None:
                    attrs[key] = value
            for key in (semconv.AGL_PROMPT_TOKEN_IDS, semconv.AGL_RESPONSE_TOKEN_IDS):
                value = draw(TOKEN_IDS)
                if value is not None:
                    attrs[key] = value
            if draw(st.booleans()):
                attrs[semconv.AGL_TOKEN_SOURCE] = draw(st.sampled_from(["gateway", "response", "retokenized", "x"]))
            if draw(st.booleans()):
                attrs[semconv.AGL_RESPONSE_LOGPROBS] = draw(st.lists(st.floats(allow_nan=False, allow_infinity=False),
                                                                    max_size=5))
            if draw(st.booleans()):
                attrs[semconv.GEN_AI_REQUEST_MODEL] = draw(st.one_of(st.text(max_size=5), st.integers()))
        elif kind == "tool":
            attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_EXECUTE_TOOL
            if draw(st.booleans()):
                attrs[semconv.GEN_AI_TOOL_CALL_ID] = draw(st.sampled_from(["c1", "c2", ""]))
            if draw(st.booleans()):
                attrs[semconv.AGL_TOOL_STATUS] = draw(st.sampled_from(["ok", "error", "exception", "timeout", ""]))
            if draw(st.booleans()):
                attrs[semconv.ERROR_TYPE] = draw(st.sampled_from(["TimeoutError", "ValueError"]))
        elif kind == "reward":
            attrs[semconv.AGL_SPAN_KIND] = semconv.KIND_REWARD
            if draw(st.booleans()):
                attrs[semconv.AGL_REWARD_VALUE] = draw(st.one_of(
                    st.floats(min_value=-1e6, max_value=1e6), st.text(max_size=3), st.booleans()))
            if draw(st.booleans()):
                attrs[semconv.AGL_REWARD_NAME] = draw(st.sampled_from(["step", "tool_ok"]))
        elif kind == "agent":
            attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_INVOKE_AGENT
            if draw(st.booleans()):
                attrs[semconv.GEN_AI_AGENT_NAME] = draw(st.sampled_from(["writer", "checker", ""]))
        parent = draw(st.one_of(st.none(), st.sampled_from(ids), st.just("ffffffffffffffff")))  # cycles, missing
        start = draw(st.integers(min_value=0, max_value=50))
        end = draw(st.integers(min_value=start, max_value=60))
        spans.append(Span(span_id=span_id, trace_id="0" * 32, name=kind, parent_id=parent, start_ns=start,
                          end_ns=end, attributes=attrs,
                          status=draw(st.sampled_from(["unset", "ok", "error"]))))
    return draw(st.permutations(spans))


def _outermost(span: Span, by_id: dict[str, Span]) -> str:
    from agl_core.transitions import is_llm_span

    outer = span
    parent = by_id.get(span.parent_id) if span.parent_id else None
    hops = 0
    while parent is not None and hops < 10_000:
        if is_llm_span(parent):
            outer = parent
        parent = by_id.get(parent.parent_id) if parent.parent_id else None
        hops += 1
    return outer.span_id


BUILDERS = [
    agl.TransitionBuilder(),
    agl.TransitionBuilder(agent_match="writer", credit="discounted", gamma=0.9,
                          air=agl.AirRules(tool_exception=-1.0, tool_error=-0.5, tool_timeout=-0.2,
                                           malformed_tool_call=-1.0, tool_ok=0.1)),
]


@pytest.mark.parametrize("builder", BUILDERS, ids=["default", "selective"])
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spans=span_trees())
def test_the_builder_accounts_for_every_llm_span_of_any_tree(builder: agl.TransitionBuilder,
                                                             spans: list[Span]) -> None:
    from agl_core.transitions import is_llm_span

    traj = builder.build_from_spans(spans, rollout_id="r", task_id="t")
    by_id = {s.span_id: s for s in spans}
    made = [t.span_id for t in traj.transitions]
    skipped = [s.span_id for s in traj.skipped]
    assert not set(made) & set(skipped)
    calls = {_outermost(s, by_id) for s in spans if is_llm_span(s)}
    assert set(made) | set(skipped) == calls, "an LLM call is neither a transition nor listed as skipped"
    assert len(made) + len(skipped) == len(calls)
    assert [t.index for t in traj.transitions] == list(range(len(made)))
    starts = [by_id[i].start_ns for i in made]
    assert starts == sorted(starts)
    for t in traj.transitions:
        assert t.credited_reward is None or math.isfinite(t.credited_reward)
    assert Trajectory.from_json(traj.to_json()) == traj
    assert all(s.reason for s in traj.skipped)


# --------------------------------------------------------------------------- credit

finite = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False)
step_rewards = st.lists(st.one_of(st.none(), finite), max_size=30)


@settings(max_examples=300, deadline=None)
@given(rewards=step_rewards, final=st.one_of(st.none(), finite), gamma=st.floats(min_value=0.0, max_value=1.0))
def test_credit_assignment_is_one_finite_value_per_step(rewards: list[float | None], final: float | None,
                                                        gamma: float) -> None:
    no_reward = final is None and all(r is None for r in rewards)
    total = sum(r for r in rewards if r is not None) + (final or 0.0)
    out_final = credit.assign(rewards, final, "final")
    out_disc = credit.assign(rewards, final, "discounted", gamma)
    for out in (out_final, out_disc):
        assert len(out) == len(rewards)
        if no_reward:
            assert out == [None] * len(rewards)
        else:
            assert all(v is not None and math.isfinite(v) for v in out)
    if rewards and not no_reward:
        assert out_final == [pytest.approx(total)] * len(rewards)
        assert credit.assign(rewards, final, "discounted", 1.0)[0] == pytest.approx(total, rel=1e-9, abs=1e-6)
        last = (rewards[-1] or 0.0) + (final or 0.0)
        assert out_disc[-1] == pytest.approx(last)
        for t in range(len(rewards) - 1):  # the return-to-go recursion, step by step
            assert out_disc[t] == pytest.approx((rewards[t] or 0.0) + gamma * out_disc[t + 1], rel=1e-9, abs=1e-6)


@given(rewards=step_rewards, final=st.one_of(st.none(), finite),
       bad=st.one_of(st.just(math.nan), st.just(math.inf), st.just("x"), st.just(True)))
def test_a_credit_function_returning_non_numbers_is_refused_by_step(rewards: list[float | None],
                                                                    final: float | None, bad: Any) -> None:
    assume(rewards)
    with pytest.raises(SchemaError, match=r"^credit\[\d+\]: must be a finite number or None"):
        credit.assign(rewards, final, lambda r, f: [bad] * len(r))
    with pytest.raises(SchemaError, match="returned"):
        credit.assign(rewards, final, lambda r, f: [0.0] * (len(r) + 1))


@given(gamma=st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.000001), st.just(math.nan)))
def test_gamma_outside_zero_to_one_is_refused(gamma: float) -> None:
    with pytest.raises(SchemaError, match="^gamma: must be between 0 and 1"):
        credit.assign([1.0], None, "discounted", gamma)


@given(rewards=st.lists(st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False)), min_size=1,
                        max_size=10),
       final=st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False)))
def test_rewards_near_a_floats_limit_give_finite_credit_or_a_clear_error(rewards: list[float | None],
                                                                         final: float | None) -> None:
    for method in ("final", "discounted"):
        try:
            out = credit.assign(rewards, final, method)  # type: ignore[arg-type]
        except SchemaError as exc:
            assert str(exc).startswith("credit: the rewards add up to")
        else:
            assert all(v is None or math.isfinite(v) for v in out)
