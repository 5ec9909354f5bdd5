"""The health of a training step's signal: the numbers that show a step is learning from something, and warnings.

A step can go wrong while its loss goes down: the logprobs recorded while sampling are not
those of the distribution being trained (a temperature, a top_p cut, a prompt cut after
sampling), one group's advantages are large enough to set the step's direction, or most
groups scored every rollout alike and train on nothing. :func:`batch_signal` measures the
scored batch and its rows; the backend adds the update's side (``ratio_first_mean`` /
``_min`` / ``_max``: the importance ratio before the update's first optimizer step, which
is 1 when the trainer computes the sampler's own logprobs; ``sampler_kl``; ``clip_fraction``).
:func:`signal_warnings` turns them into one line per cause.

Every number goes to the server's metrics (the dashboard draws them) and into the run's
summary with the rest of the step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agl_trainer.advantages import AdvantageStats
from agl_trainer.rows import Row, RowStats

__all__ = ["SignalBounds", "batch_signal", "signal_warnings", "warning_flags"]


@dataclass
class SignalBounds:
    """When :func:`signal_warnings` speaks up."""

    ratio_drift: float = 0.05
    """Largest ``|ratio_first_mean - 1|`` that is numerics; beyond it the sampler and the trainer disagree."""
    max_abs_advantage: float = 10.0
    """Largest ``max |A|`` before one rollout's advantage dominates the step (GRPO's stay within sqrt(n - 1))."""
    flat_group_share: float = 0.5
    """Share of groups without spread beyond which most of the step trains on nothing."""


def batch_signal(stats: AdvantageStats, rows: Sequence[Row], row_stats: RowStats) -> dict[str, float]:
    """The scored batch's side of the signal: advantages as the loss weighs them, and what was lost or changed."""
    total = mean = square = 0.0
    top = 0.0
    for row in rows:
        for w, a, m in zip(row.token_weights, row.advantages, row.loss_mask, strict=True):
            if m:
                total += w
                mean += w * a
                square += w * a * a
                top = max(top, abs(a))
    mean = mean / total if total else 0.0
    std = math.sqrt(max(square / total - mean * mean, 0.0)) if total else 0.0
    return {
        "advantage_mean": mean, "advantage_std": std, "advantage_max_abs": top,
        "groups": float(stats.groups), "flat_groups": float(stats.flat_groups),
        "no_reward_rollouts": float(stats.no_reward), "truncated_rows": float(row_stats.truncated_rows),
        "recomputed_logprobs": float(row_stats.recomputed_logprobs),
        "prefix_mismatches": float(row_stats.prefix_mismatches),
    }


def signal_warnings(values: Mapping[str, float], bounds: SignalBounds | None = None) -> list[str]:
    """One line per cause found in a step's ``values`` (:func:`batch_signal` and the update's metrics)."""
    return list(_causes(values, bounds or SignalBounds()).values())


def warning_flags(values: Mapping[str, float], bounds: SignalBounds | None = None) -> dict[str, float]:
    """``warn_ratio_drift``, ``warn_large_advantages``, ``warn_flat_groups``: 1 where :func:`signal_warnings` warns.

    Numbers, so they go to the server's metrics with the rest and the dashboard marks the step.
    """
    causes = _causes(values, bounds or SignalBounds())
    return {f"warn_{key}": 1.0 if key in causes else 0.0 for key in ("ratio_drift", "large_advantages", "flat_groups")}


def _causes(values: Mapping[str, float], bounds: SignalBounds) -> dict[str, str]:
    out = {}
    ratio = values.get("ratio_first_mean")
    if ratio is not None and abs(ratio - 1.0) > bounds.ratio_drift:
        out["ratio_drift"] = (f"sampler/trainer mismatch: the first-pass importance ratio is {ratio:.3f} (min "
                   f"{values.get('ratio_first_min', ratio):.3f}, max {values.get('ratio_first_max', ratio):.3f}), "
                   f"not 1: the recorded logprobs are not of the distribution being trained (temperature, top_p/top_k, "
                   f"dtype, or weights the engine was not served)")
    top = values.get("advantage_max_abs")
    if top is not None and top > bounds.max_abs_advantage:
        out["large_advantages"] = (f"large advantages: max |A| is {top:.3g} (bound {bounds.max_abs_advantage:g}): a "
                                   f"few rollouts set this step's direction; check the reward scale and the credit "
                                   f"function")
    groups, flat = values.get("groups") or 0.0, values.get("flat_groups") or 0.0
    if groups and flat / groups > bounds.flat_group_share:
        out["flat_groups"] = (f"groups without spread: {flat:.0f} of {groups:.0f} groups scored every rollout alike "
                              f"and train on nothing; the tasks are too easy or too hard for the policy, or "
                              f"group_size is too small")
    return out
