"""Property-based fuzzing (hypothesis) of the trainer's advantage and row builders over arbitrary trajectories.

Random task groups, any number of transitions per rollout, token ids that sometimes
extend the previous call (so trajectory mode merges) and sometimes do not, logprobs
present or not, rewards missing or not, and random length limits. Never a crash, and:

- every trajectory is scored exactly once, or counted as having no reward or no
  transitions; advantages are finite; with ``final`` credit a rollout's steps share
  one advantage, and with GRPO scaling a group's advantages sum to about zero;
- every row's lists are aligned, the loss mask is 0/1 and 0 on the prompt, advantages
  and weights are 0 off the loss, the limits hold, and each rollout's loss weight adds
  up to one unit over all its rows.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl_core.schema import Trajectory, Transition
from agl_trainer.advantages import compute_advantages
from agl_trainer.rows import build_rows

token = st.integers(min_value=0, max_value=50_000)
reward = st.one_of(st.none(), st.floats(min_value=-10, max_value=10))


@st.composite
def trajectories(draw: st.DrawFn) -> list[Trajectory]:
    out = []
    for r in range(draw(st.integers(min_value=0, max_value=8))):
        task = draw(st.sampled_from(["a", "b", "c#1", "a#2"]))
        transitions = []
        context: list[int] = draw(st.lists(token, min_size=1, max_size=6))
        for i in range(draw(st.integers(min_value=0, max_value=4))):
            has_ids = draw(st.integers(min_value=0, max_value=9)) > 0
            response = draw(st.lists(token, min_size=0 if draw(st.booleans()) else 1, max_size=6))
            logprobs = [-0.5] * len(response) if draw(st.booleans()) else None
            transitions.append(Transition(
                rollout_id=f"r{r}", task_id=task, index=i, prompt=[], response={"role": "assistant", "content": "x"},
                prompt_token_ids=list(context) if has_ids else None, response_token_ids=response if has_ids else None,
                response_logprobs=logprobs if has_ids and response else None,
                token_source="gateway" if has_ids else None, reward=draw(reward)))
            if draw(st.booleans()):  # the next call extends this one (a chat template's append) ...
                context = context + response + draw(st.lists(token, max_size=3))
            else:  # ... or rewrites its history
                context = draw(st.lists(token, min_size=1, max_size=6))
        out.append(Trajectory(rollout_id=f"r{r}", task_id=task, transitions=transitions, reward=draw(reward)))
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajs=trajectories(), credit=st.sampled_from(["final", "discounted", None]),
       scale=st.booleans(), mode=st.sampled_from(["transition", "trajectory"]),
       max_prompt=st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
       max_response=st.one_of(st.none(), st.integers(min_value=1, max_value=8)))
def test_advantages_and_rows_of_any_batch(trajs: list[Trajectory], credit: Any, scale: bool, mode: Any,
                                          max_prompt: int | None, max_response: int | None) -> None:
    scored, stats = compute_advantages(trajs, credit=credit, gamma=0.9, scale=scale)
    assert stats.rollouts + stats.no_reward + stats.no_transitions == len(trajs)
    assert len({s.rollout_id for s in scored}) == len(scored)
    groups: dict[str, list[float]] = {}
    for s in scored:
        assert len(s.advantages) == len(s.credited) == len(s.trajectory.transitions)
        assert all(math.isfinite(a) for a in s.advantages)
        if credit == "final":
            assert len(set(s.advantages)) == 1
        groups.setdefault(s.group, []).append(s.advantages[0])
    if credit == "final" and scale:
        for values in groups.values():
            assert abs(sum(values)) < 1e-6  # (R - mean) / (std + eps) sums to ~0

    rows, row_stats = build_rows(scored, mode, max_prompt_length=max_prompt, max_response_length=max_response)
    assert row_stats.rows == len(rows)
    weight: dict[str, float] = {}
    for row in rows:
        n = len(row.input_ids)
        assert len(row.loss_mask) == len(row.advantages) == len(row.token_weights) == n
        assert row.old_logprobs is None or len(row.old_logprobs) == n
        assert set(row.loss_mask) <= {0, 1} and row.loss_tokens > 0
        assert not any(row.loss_mask[:row.prompt_len])
        assert all(a == 0.0 and w == 0.0 for a, w, m in zip(row.advantages, row.token_weights, row.loss_mask,
                                                              strict=True) if not m)
        assert all(math.isfinite(a) for a in row.advantages)
        if max_prompt is not None:
            assert row.prompt_len <= max_prompt
        if max_response is not None:
            assert n - row.prompt_len <= max_response
        weight[row.rollout_id] = weight.get(row.rollout_id, 0.0) + sum(row.token_weights)
    for rid, total in weight.items():
        assert math.isclose(total, 1.0, rel_tol=1e-9), (rid, total)
    assert row_stats.rollouts == len(weight)
