"""The signal's health per step: what it measures on a scored batch, and the one-line warning per cause."""

from __future__ import annotations

import pytest

from agl_core.schema import Trajectory, Transition
from agl_trainer.signal_health import SignalBounds, signal_warnings
from agl_trainer.training import TrainConfig, score_batch


def _run(rid: str, task: str, final: float, calls: int = 1) -> Trajectory:
    steps = [Transition(rollout_id=rid, task_id=task, index=i, prompt=[{"role": "user", "content": "q"}],
                        response={"role": "assistant", "content": "a"}, prompt_token_ids=[1, 2, 3 + i],
                        response_token_ids=[7, 8], response_logprobs=[-0.5, -0.7], token_source="gateway",
                        credited_reward=final) for i in range(calls)]
    return Trajectory(rollout_id=rid, task_id=task, transitions=steps, reward=final)


def test_the_batch_side_of_the_signal() -> None:
    batch = [_run("a", "x#0", 1.0, calls=3), _run("b", "x#1", 0.0), _run("c", "y#0", 0.5), _run("d", "y#1", 0.5),
             Trajectory(rollout_id="e", task_id="z#0", transitions=[_run("e", "z#0", 0.0).transitions[0]])]
    batch[-1].transitions[0].credited_reward = None  # a rollout without any reward
    signal = score_batch(batch, TrainConfig(row_mode="transition", max_prompt_length=2)).signal()
    # as the loss weighs them: each rollout one unit, so +1 and -1 balance whatever the calls
    assert signal["advantage_mean"] == pytest.approx(0.0) and signal["advantage_max_abs"] == pytest.approx(1.0)
    assert signal["advantage_std"] == pytest.approx(1 / 2 ** 0.5)  # group y (no spread) weighs in with zeros
    assert (signal["groups"], signal["flat_groups"], signal["no_reward_rollouts"]) == (2, 1, 1)
    assert signal["truncated_rows"] == 6 and signal["recomputed_logprobs"] == 6  # every prompt cut to 2 tokens


def test_each_cause_is_one_line_that_names_it() -> None:
    healthy = {"ratio_first_mean": 1.0001, "ratio_first_min": 0.999, "ratio_first_max": 1.001,
               "advantage_max_abs": 2.6, "groups": 4.0, "flat_groups": 2.0}
    assert signal_warnings(healthy) == []
    drift = signal_warnings({**healthy, "ratio_first_mean": 0.9, "ratio_first_min": 0.2, "ratio_first_max": 3.0})
    assert len(drift) == 1 and drift[0].startswith("sampler/trainer mismatch: the first-pass importance ratio is "
                                                   "0.900 (min 0.200, max 3.000), not 1")
    large = signal_warnings({**healthy, "advantage_max_abs": 9e4})
    assert len(large) == 1 and large[0].startswith("large advantages: max |A| is 9e+04 (bound 10)")
    flat = signal_warnings({**healthy, "flat_groups": 3.0})
    assert len(flat) == 1 and flat[0].startswith("groups without spread: 3 of 4 groups scored every rollout alike")
    assert signal_warnings({**healthy, "advantage_max_abs": 2.6}, SignalBounds(max_abs_advantage=2.0))


def test_the_flags_the_dashboard_marks_a_step_by() -> None:
    from agl_trainer.signal_health import warning_flags

    values = {"ratio_first_mean": 0.8, "advantage_max_abs": 1.0, "groups": 2.0, "flat_groups": 2.0}
    assert warning_flags(values) == {"warn_ratio_drift": 1.0, "warn_large_advantages": 0.0, "warn_flat_groups": 1.0}
