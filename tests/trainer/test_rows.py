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


def test_long_prompts_keep_their_last_tokens_and_long_responses_are_cut_and_counted() -> None:
    long = _t(0, [1, 2, 3, 4, 5, 6], [10, 11, 12, 13], [-0.1, -0.2, -0.3, -0.4])
    short = _t(1, [7, 8], [14])
    rows, stats = build_rows([_scored(long), _scored(short)], "transition", max_prompt_length=4,
                             max_response_length=3)
    assert rows[0].input_ids == [3, 4, 5, 6, 10, 11, 12] and rows[0].prompt_len == 4
    assert rows[0].loss_mask == [0, 0, 0, 0, 1, 1, 1]
    # the gateway's logprobs saw the two prompt tokens the cut removed: the backend recomputes them
    assert rows[0].old_logprobs is None and stats.recomputed_logprobs == 1
    assert rows[1].input_ids == [7, 8, 14] and rows[1].old_logprobs is not None  # within both limits: untouched
    assert stats.truncated_rows == 1 and stats.truncated_prompts == 1 and stats.truncated_responses == 1
    assert stats.dropped_loss_tokens == 1
    # the rollout still weighs one unit, spread over the loss tokens that are left
    assert sum(rows[0].token_weights) == pytest.approx(1.0) and rows[0].token_weights[-1] == pytest.approx(1 / 3)


def test_a_merge_that_would_pass_the_response_limit_starts_a_new_row_instead() -> None:
    # merged, the response part would be [10 11 20 21 12]: 5 tokens; the limit is 4
    rows, stats = build_rows([_scored(FIRST, SECOND, advantages=[0.5, -2.0])], "trajectory", max_response_length=4)
    assert [r.input_ids for r in rows] == [[1, 2, 3, 10, 11], [1, 2, 3, 10, 11, 20, 21, 12]]
    assert rows[1].loss_mask == [0] * 7 + [1] and rows[1].advantages[-1] == -2.0
    assert stats.length_splits == 1 and stats.merged == 0 and stats.prefix_mismatches == 0
    assert stats.truncated_rows == 0 and stats.dropped_loss_tokens == 0
    # cutting the end changes no kept token's logprob: they stay
    rows, stats = build_rows([_scored(FIRST)], "transition", max_response_length=1)
    assert rows[0].old_logprobs == pytest.approx([0, 0, 0, -0.1]) and stats.recomputed_logprobs == 0
    # a prompt limit then cuts the second row's long prompt from the left
    rows, stats = build_rows([_scored(FIRST, SECOND)], "trajectory", max_prompt_length=5, max_response_length=4)
    assert rows[1].input_ids == [3, 10, 11, 20, 21, 12] and rows[1].prompt_len == 5
    assert stats.truncated_rows == 1 and stats.truncated_prompts == 1


def test_length_limits_must_be_positive_integers() -> None:
    with pytest.raises(ValueError, match="max_prompt_length must be a positive integer or None, got 0"):
        build_rows([], "transition", max_prompt_length=0)
    with pytest.raises(ValueError, match="max_response_length"):
        build_rows([], "transition", max_response_length=2.5)  # type: ignore[arg-type]
