"""Advantages per rollout, grouped by task: bounded in every credit mode, against a per-position baseline, of
credit assigned over the whole run; and the bias a per-transition normalisation has, and ours has not."""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

import pytest

from agl_core import semconv
from agl_core.messages import many_to_genai, to_genai
from agl_core.schema import Rollout, Span, Trajectory, Transition
from agl_core.transitions import AirRules, TransitionBuilder
from agl_trainer.advantages import compute_advantages, task_group
from agl_trainer.rows import build_rows
from agl_trainer.training import TrainConfig


def _transition(rollout: str, task: str, i: int, reward: float | None = None) -> Transition:
    return Transition(rollout_id=rollout, task_id=task, index=i, prompt=[{"role": "user", "content": "q"}],
                      response={"role": "assistant", "content": "a"}, prompt_token_ids=[1, 2, 3 + i],
                      response_token_ids=[7, 8], response_logprobs=[-0.5, -0.7], token_source="gateway",
                      reward=reward)


def _trajectory(rollout: str, task: str, calls: int, final: float | None,
                rewards: list[float | None] | None = None) -> Trajectory:
    rewards = rewards or [None] * calls
    return Trajectory(rollout_id=rollout, task_id=task,
                      transitions=[_transition(rollout, task, i, rewards[i]) for i in range(calls)], reward=final)


def _per_transition_peer(trajectories: list[Trajectory]) -> dict[str, list[float]]:
    """What a peer does: every transition is a sample of the group's mean and std, with the final reward."""
    values = [t.reward or 0.0 for t in trajectories for _ in t.transitions]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {t.rollout_id: [((t.reward or 0.0) - mean) / (std + 1e-6) for _ in t.transitions] for t in trajectories}


def test_a_success_in_one_call_and_a_failure_in_three_get_advantages_of_equal_size() -> None:
    group = [_trajectory("win", "task-1#0", calls=1, final=1.0), _trajectory("lose", "task-1#1", calls=3, final=0.0)]
    scored, stats = compute_advantages(group, credit="final")
    by_id = {s.rollout_id: s for s in scored}
    assert stats.groups == 1 and stats.rollouts == 2
    assert by_id["win"].advantages == [pytest.approx(1.0, abs=1e-5)]
    assert by_id["lose"].advantages == [pytest.approx(-1.0, abs=1e-5)] * 3  # every call of the rollout shares it
    assert abs(by_id["win"].advantages[0]) == pytest.approx(abs(by_id["lose"].advantages[0]))

    # and in the loss: each rollout is one unit of weight, however many calls and tokens it made
    rows, _ = build_rows(scored, "transition")
    weight = {rid: sum(sum(r.token_weights) for r in rows if r.rollout_id == rid) for rid in ("win", "lose")}
    assert weight == {"win": pytest.approx(1.0), "lose": pytest.approx(1.0)}
    push = {rid: sum(w * a for r in rows if r.rollout_id == rid for w, a in zip(r.token_weights, r.advantages,
                                                                               strict=True)) for rid in weight}
    assert push["win"] == pytest.approx(-push["lose"], abs=1e-5)  # the update pulls up as hard as it pushes down


def test_the_per_transition_peer_is_biased_towards_long_failures() -> None:
    group = [_trajectory("win", "task-1#0", calls=1, final=1.0), _trajectory("lose", "task-1#1", calls=3, final=0.0)]
    peer = _per_transition_peer(group)
    # the failure's three calls drag the baseline to 0.25: the success gets +1.73, the failure -0.58
    assert peer["win"] == [pytest.approx(math.sqrt(3), abs=1e-4)]
    assert peer["lose"] == [pytest.approx(-1 / math.sqrt(3), abs=1e-4)] * 3
    assert abs(peer["win"][0]) / abs(peer["lose"][0]) == pytest.approx(3.0, abs=1e-3)
    # and a token-mean loss over its transitions then counts the failure three times: total push 1.73 vs -1.73
    assert sum(peer["win"]) == pytest.approx(-sum(peer["lose"]), abs=1e-4)
    ours = {s.rollout_id: s.advantages for s in compute_advantages(group, credit="final")[0]}
    assert ours["win"][0] != pytest.approx(peer["win"][0], abs=0.1)


def test_intermediate_rewards_change_the_advantages() -> None:
    plain = [_trajectory("a", "t#0", 2, 1.0), _trajectory("b", "t#1", 2, 1.0), _trajectory("c", "t#2", 2, 0.0)]
    with_air = [_trajectory("a", "t#0", 2, 1.0, rewards=[-0.5, None]), _trajectory("b", "t#1", 2, 1.0),
                _trajectory("c", "t#2", 2, 0.0)]
    first = {s.rollout_id: s for s in compute_advantages(plain, credit="final")[0]}
    second = {s.rollout_id: s for s in compute_advantages(with_air, credit="final")[0]}
    assert first["a"].advantages == first["b"].advantages
    assert second["a"].ret == pytest.approx(0.5)  # final credit: the return counts the AIR penalty
    assert second["a"].advantages[0] < second["b"].advantages[0]
    # discounted: return-to-go, so the step before the penalty and the one after it differ
    disc = {s.rollout_id: s for s in compute_advantages(with_air, credit="discounted", gamma=0.9)[0]}
    assert disc["a"].credited == pytest.approx([-0.5 + 0.9 * 1.0, 1.0])
    assert disc["a"].advantages[0] != pytest.approx(disc["a"].advantages[1])


def test_a_credit_function_and_the_stored_credit() -> None:
    group = [_trajectory("a", "t#0", 2, 1.0), _trajectory("b", "t#1", 2, 0.0)]
    last_only = compute_advantages(group, credit=lambda rewards, final: [0.0] * (len(rewards) - 1) + [final])[0]
    assert [s.credited for s in last_only] == [[0.0, 1.0], [0.0, 0.0]]
    for t in group:
        for step in t.transitions:
            step.credited_reward = 2.0 if t.rollout_id == "a" else 1.0
    stored = {s.rollout_id: s for s in compute_advantages(group, credit=None)[0]}
    assert stored["a"].ret == 2.0 and stored["a"].advantages[0] > 0 > stored["b"].advantages[0]


def test_groups_rollouts_without_reward_and_flat_groups() -> None:
    batch = [_trajectory("a", "x#0", 1, 1.0), _trajectory("b", "x#1", 1, 0.0),
             _trajectory("c", "y#0", 1, 0.5), _trajectory("d", "y#1", 1, 0.5),
             _trajectory("e", "z#0", 1, None), Trajectory(rollout_id="f", task_id="z#1", reward=1.0)]
    scored, stats = compute_advantages(batch, credit="final")
    assert {s.group for s in scored} == {"x", "y"}
    assert stats.no_reward == 1 and stats.no_transitions == 1 and stats.flat_groups == 1
    assert [s.advantages for s in scored if s.group == "y"] == [[0.0], [0.0]]
    unscaled = {s.rollout_id: s.advantages[0] for s in compute_advantages(batch, credit="final", scale=False)[0]}
    assert unscaled["a"] == pytest.approx(0.5) and unscaled["b"] == pytest.approx(-0.5)
    assert task_group(batch[0]) == "x"


# ---------------------------------------------------------------------- bounded, per-position advantages


def _rollouts_with(credited: list[list[float]], task: str = "t") -> list[Trajectory]:
    """Trajectories whose transitions carry these credited rewards (as a builder stores them)."""
    out = []
    for k, values in enumerate(credited):
        traj = _trajectory(f"r{k}", f"{task}#{k}", len(values), 1.0)
        for step, value in zip(traj.transitions, values, strict=True):
            step.credited_reward = value
        out.append(traj)
    return out


def _last_call_only(rewards: list[float | None], final: float | None) -> list[float | None]:
    return [0.0] * (len(rewards) - 1) + [final]  # docs/credit-assignment.md's credit function


def test_advantages_stay_bounded_when_a_groups_returns_agree() -> None:
    # every rollout solves the task in three calls, gamma 0.9: credited 0.81, 0.9, 1.0 in each (before: up to 1.9e5)
    agree = [_trajectory(f"r{k}", f"t#{k}", 3, 1.0) for k in range(4)]
    scored, stats = compute_advantages(agree, credit="discounted", gamma=0.9)
    assert scored[0].credited == pytest.approx([0.81, 0.9, 1.0])
    assert max(abs(a) for s in scored for a in s.advantages) == 0.0
    assert stats.flat_groups == 1 and stats.groups == 1
    # a group of one has nothing to compare with (before: 9e4)
    scored, stats = compute_advantages([_trajectory("solo", "u#0", 3, 1.0)], credit="discounted", gamma=0.9)
    assert scored[0].advantages == [0.0, 0.0, 0.0] and stats.flat_groups == 1
    # the docs' custom credit function, one rollout (before: 1e6)
    doc = [_trajectory("d", "v#0", 3, 1.0, rewards=[None, -0.1, None])]
    assert compute_advantages(doc, credit=_last_call_only)[0][0].advantages == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("credit", ["final", "discounted", _last_call_only])
@pytest.mark.parametrize("scale", [True, False])
def test_bounded_rewards_give_bounded_advantages_in_every_credit_mode(credit: Any, scale: bool) -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 8)
        group = []
        for k in range(n):
            calls = rng.randint(1, 5)
            rewards = [rng.choice([None, -0.1, 0.2]) for _ in range(calls)]
            group.append(_trajectory(f"r{k}", f"t#{k}", calls, rng.choice([0.0, 1.0, 1.0 + 1e-12]), rewards))
        scored, stats = compute_advantages(group, credit=credit, gamma=0.9, scale=scale)
        top = max(abs(a) for s in scored for a in s.advantages)
        # GRPO's z-scores stay within sqrt(n - 1); Dr. GRPO's within the credited rewards' spread
        spread = max(c for s in scored for c in s.credited) - min(c for s in scored for c in s.credited)
        assert top <= (math.sqrt(n - 1) if scale else spread) + 1e-9, (n, top)
        assert stats.flat_groups == (1 if top == 0.0 else 0)


def test_each_call_is_compared_with_the_same_call_of_the_other_runs() -> None:
    # return-to-go with gamma 0.9: a run that solved it in three calls, one that failed in three
    scored, _ = compute_advantages(_rollouts_with([[0.81, 0.9, 1.0], [0.0, 0.0, 0.0]]))
    assert [s.advantages for s in scored] == [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
    # an AIR penalty after the first call of one run: the first calls differ, the last ones agree
    scored, _ = compute_advantages(_rollouts_with([[-0.1, 1.0], [0.9, 1.0]]))
    assert [s.advantages for s in scored] == [[-1.0, 0.0], [1.0, 0.0]]
    # a run that ended earlier stays in the comparison with its last value: the long failure's later calls
    # are compared with the short success's result, not left without a baseline
    scored, _ = compute_advantages(_rollouts_with([[1.0], [0.0, 0.0, 0.0]]))
    assert [s.advantages for s in scored] == [[1.0], [-1.0, -1.0, -1.0]]


def test_discounted_with_gamma_one_and_only_a_final_reward_gives_finals_advantages() -> None:
    group = [_trajectory("a", "t#0", 1, 1.0), _trajectory("b", "t#1", 3, 0.0), _trajectory("c", "t#2", 2, 0.5)]
    final = [s.advantages for s in compute_advantages(group, credit="final")[0]]
    discounted = [s.advantages for s in compute_advantages(group, credit="discounted", gamma=1.0)[0]]
    assert discounted == final


# ---------------------------------------------------------------------- credit over the whole run

_ids = itertools.count(1)
_clock = itertools.count(1_000, 10)


def _span(name: str, parent: Span | None = None, status: str = "unset", **attrs: Any) -> Span:
    start = next(_clock)
    return Span(span_id=f"{next(_ids):016x}", trace_id="ab" * 16, name=name, parent_id=parent.span_id if parent
                else None, start_ns=start, end_ns=start + 5, attributes=attrs, status=status)  # type: ignore[arg-type]


def _agent(name: str) -> Span:
    return _span(f"invoke_agent {name}", **{semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT,
                                            semconv.GEN_AI_AGENT_NAME: name})


def _llm(parent: Span, prompt: list[int], response: list[int], message: dict[str, Any] | None = None) -> Span:
    out = message or {"role": "assistant", "content": "ok"}
    return _span("chat m", parent, **{
        semconv.GEN_AI_OPERATION_NAME: semconv.OP_CHAT, semconv.GEN_AI_REQUEST_MODEL: "m",
        semconv.GEN_AI_INPUT_MESSAGES: json.dumps(many_to_genai([{"role": "user", "content": "q"}])),
        semconv.GEN_AI_OUTPUT_MESSAGES: json.dumps([to_genai(out, finish_reason="stop")]),
        semconv.AGL_PROMPT_TOKEN_IDS: prompt, semconv.AGL_RESPONSE_TOKEN_IDS: response,
        semconv.AGL_RESPONSE_LOGPROBS: [-0.5] * len(response), semconv.AGL_TOKEN_SOURCE: "gateway"})


def _reward(value: float, name: str | None = None) -> Span:
    attrs: dict[str, Any] = {semconv.AGL_SPAN_KIND: semconv.KIND_REWARD, semconv.AGL_REWARD_VALUE: value}
    if name:
        attrs[semconv.AGL_REWARD_NAME] = name
    return _span("agl.reward", **attrs)


def writer_checker_run(k: int, *, checker_fails: bool, named: bool = False) -> Rollout:
    """writer writes, checker (not trained) checks with its tool, writer revises; final reward 1.

    ``checker_fails``: the checker's tool returns an error (AIR ``tool_error``); ``named``: instead, a named
    reward of -1 is emitted right after the checker's call.
    """
    writer, checker = _agent("writer"), _agent("checker")
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{k}", "type": "function", "function": {"name": "run_sql", "arguments": "{}"}}]}
    spans = [writer, _llm(writer, [1, 2], [3, 4]), checker, _llm(checker, [5, 6], [7], call)]
    if named:
        spans.append(_reward(-1.0, name="check_failed"))
    status = {semconv.AGL_TOOL_STATUS: "error" if checker_fails and not named else "ok"}
    spans += [_span("execute_tool run_sql", checker, **{semconv.GEN_AI_OPERATION_NAME: semconv.OP_EXECUTE_TOOL,
                                                        semconv.GEN_AI_TOOL_NAME: "run_sql",
                                                        semconv.GEN_AI_TOOL_CALL_ID: f"c{k}", **status}),
              _llm(writer, [1, 2, 3, 4, 8], [9, 10]), _reward(1.0)]
    return Rollout(id=f"run{k}", task_id=f"task#{k}", spans=spans, status="succeeded")


def test_a_penalty_on_a_call_that_is_not_trained_reaches_the_trained_calls() -> None:
    builder = TransitionBuilder(agent_match="writer", air=AirRules(tool_error=-1.0))
    runs = [builder.build(writer_checker_run(0, checker_fails=True)), builder.build(writer_checker_run(1,
                                                                                                  checker_fails=False))]
    assert [len(t.transitions) for t in runs] == [2, 2] and all(len(t.skipped) == 1 for t in runs)
    assert [t.credited_reward for t in runs[0].transitions] == [0.0, 0.0]  # 1 - 1: the builder saw the penalty
    # the training loop scores them as its config says (before: re-credited without the checker: 0 and 0)
    scored, stats = compute_advantages(runs, credit=TrainConfig().credit, gamma=TrainConfig().gamma)
    by_id = {s.rollout_id: s.advantages for s in scored}
    assert by_id == {"run0": [pytest.approx(-1.0), pytest.approx(-1.0)], "run1": [pytest.approx(1.0)] * 2}
    assert stats.flat_groups == 0
    # a named reward on the untrained call counts the same
    named = [builder.build(writer_checker_run(2, checker_fails=True, named=True)), runs[1]]
    assert [s.advantages[0] for s in compute_advantages(named)[0]] == [pytest.approx(-1.0), pytest.approx(1.0)]
    # and re-crediting the trained calls alone is refused, not done quietly
    with pytest.raises(ValueError, match="left out"):
        compute_advantages(runs, credit="final")


def test_discounted_credit_over_the_whole_run_lands_the_penalty_before_it() -> None:
    builder = TransitionBuilder(agent_match="writer", air=AirRules(tool_error=-1.0), credit="discounted", gamma=0.9)
    bad, good = builder.build(writer_checker_run(0, checker_fails=True)), builder.build(writer_checker_run(1,
                                                                                                      checker_fails=False))
    # whole run: writer, checker (-1), writer (+1 final): G = [0.9 * (-1 + 0.9), -1 + 0.9, 1]; trained: 1st and 3rd
    assert [t.credited_reward for t in bad.transitions] == [pytest.approx(-0.09), pytest.approx(1.0)]
    assert [t.credited_reward for t in good.transitions] == [pytest.approx(0.81), pytest.approx(1.0)]
    scored, _ = compute_advantages([bad, good])
    assert [s.advantages for s in scored] == [[pytest.approx(-1.0), 0.0], [pytest.approx(1.0), 0.0]]
