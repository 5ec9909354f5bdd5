"""Row building: one row per call, or consecutive calls merged with the tool's tokens out of the loss."""

from __future__ import annotations

import pytest

from agl_core.schema import Trajectory, Transition
from agl_trainer.advantages import ScoredRollout
from agl_trainer.rows import build_rows


def _t(i: int, prompt: list[int], response: list[int], logprobs: list[float] | None = None) -> Transition:
    return Transition(rollout_id="r", task_id="t", index=i, prompt=[{"role": "user", "content": "q"}],
                      response={"role": "assistant", "content": "a"}, prompt_token_ids=prompt,
                      response_token_ids=response,
                      response_logprobs=logprobs if logprobs is not None else [-0.1 * (k + 1) for k in
                                                                               range(len(response))],
                      token_source="gateway")


def _scored(*transitions: Transition, advantages: list[float] | None = None) -> ScoredRollout:
    traj = Trajectory(rollout_id="r", task_id="t", transitions=list(transitions), reward=1.0)
    adv = advantages or [1.0] * len(transitions)
    return ScoredRollout(traj, "t", [1.0] * len(transitions), adv)


# call 1: prompt [1 2 3], response [10 11]; the tool answers [20 21]; call 2 continues the same sequence
FIRST = _t(0, [1, 2, 3], [10, 11])
SECOND = _t(1, [1, 2, 3, 10, 11, 20, 21], [12], [-0.3])


def test_transition_rows_one_per_call_with_the_loss_on_the_response() -> None:
    rows, stats = build_rows([_scored(FIRST, SECOND, advantages=[0.5, -2.0])], "transition")
    assert [r.input_ids for r in rows] == [[1, 2, 3, 10, 11], [1, 2, 3, 10, 11, 20, 21, 12]]
    assert rows[0].loss_mask == [0, 0, 0, 1, 1] and rows[1].loss_mask == [0] * 7 + [1]
    assert rows[0].advantages == [0, 0, 0, 0.5, 0.5] and rows[1].advantages[-1] == -2.0
    assert rows[0].old_logprobs == [0, 0, 0, -0.1, -0.2]
    assert sum(sum(r.token_weights) for r in rows) == pytest.approx(1.0)  # the rollout's one unit, over 3 tokens
    assert stats.rows == 2 and stats.merged == 0 and stats.loss_tokens == 3


def test_trajectory_rows_merge_calls_and_mask_the_tool_tokens() -> None:
    rows, stats = build_rows([_scored(FIRST, SECOND, advantages=[0.5, -2.0])], "trajectory")
    (row,) = rows
    assert row.input_ids == [1, 2, 3, 10, 11, 20, 21, 12]
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]  # the tool's answer [20 21] is context, not trained on
    assert row.advantages == [0, 0, 0, 0.5, 0.5, 0, 0, -2.0]  # each response keeps its own step's advantage
    assert row.old_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert row.transitions == 2 and row.prompt_len == 3
    assert stats.merged == 1 and stats.prefix_mismatches == 0 and stats.tokens == 8


def test_a_prompt_that_does_not_extend_the_sequence_starts_a_row_and_is_counted() -> None:
    rewritten = _t(1, [1, 2, 99, 10, 11, 20], [12], [-0.3])  # the agent rewrote its history
    third = _t(2, [1, 2, 99, 10, 11, 20, 12, 30], [13], [-0.4])
    rows, stats = build_rows([_scored(FIRST, rewritten, third)], "trajectory")
    assert [len(r.input_ids) for r in rows] == [5, 9]
    assert stats.prefix_mismatches == 1 and stats.merged == 1


def test_missing_ids_are_counted_and_missing_logprobs_left_for_the_backend() -> None:
    no_ids = Transition(rollout_id="r", task_id="t", index=1, prompt=[{"role": "user", "content": "q"}],
                        response={"role": "assistant", "content": "a"})
    no_lp = _t(2, [5, 6], [7])
    no_lp.response_logprobs = None
    rows, stats = build_rows([_scored(FIRST, no_ids, no_lp)], "trajectory")
    assert stats.no_token_ids == 1 and stats.no_logprobs == 1
    assert len(rows) == 2 and rows[1].old_logprobs is None
    with pytest.raises(ValueError, match="mode"):
        build_rows([], "per-token")  # type: ignore[arg-type]
