"""Advantages per rollout, grouped by task: the bias a per-transition normalisation has, and that ours has not."""

from __future__ import annotations

import math

import pytest

from agl_core.schema import Trajectory, Transition
from agl_trainer.advantages import compute_advantages, task_group
from agl_trainer.rows import build_rows


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
    scored, stats = compute_advantages(group)
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
    ours = {s.rollout_id: s.advantages for s in compute_advantages(group)[0]}
    assert ours["win"][0] != pytest.approx(peer["win"][0], abs=0.1)


def test_intermediate_rewards_change_the_advantages() -> None:
    plain = [_trajectory("a", "t#0", 2, 1.0), _trajectory("b", "t#1", 2, 1.0), _trajectory("c", "t#2", 2, 0.0)]
    with_air = [_trajectory("a", "t#0", 2, 1.0, rewards=[-0.5, None]), _trajectory("b", "t#1", 2, 1.0),
                _trajectory("c", "t#2", 2, 0.0)]
    first = {s.rollout_id: s for s in compute_advantages(plain)[0]}
    second = {s.rollout_id: s for s in compute_advantages(with_air)[0]}
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
    scored, stats = compute_advantages(batch)
    assert {s.group for s in scored} == {"x", "y"}
    assert stats.no_reward == 1 and stats.no_transitions == 1 and stats.flat_groups == 1
    assert [s.advantages for s in scored if s.group == "y"] == [[0.0], [0.0]]
    unscaled = {s.rollout_id: s.advantages[0] for s in compute_advantages(batch, scale=False)[0]}
    assert unscaled["a"] == pytest.approx(0.5) and unscaled["b"] == pytest.approx(-0.5)
    assert task_group(batch[0]) == "x"
