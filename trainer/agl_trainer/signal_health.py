"""The health of a training step's signal: the numbers that show a step is learning from something, and warnings.

A step can go wrong while its loss goes down: the logprobs recorded while sampling are not
those of the distribution being trained (a temperature, a top_p cut, a prompt cut after
sampling), one group's advantages are large enough to set the step's direction, or most
groups scored every rollout alike and train on nothing. :func:`batch_signal` measures the
scored batch and its rows; the backend adds the update's side (``ratio_first_mean`` /
``_min`` / ``_max``: the importance ratio before the update's first optimizer step, which
is 1 when the trainer computes the sampler's own logprobs; ``sampler_kl``; ``clip_fraction``).
:func:`signal_warnings` turns them into one line per cause.

:func:`nothing_trained` is the loudest of them: a step that trained no transition, with the
agent names its rollouts' calls had and why each call was left out, since an ``agent_match`` that
selects nothing otherwise looks like any step (``reward 0.000 loss 0.0000``).

Every number goes to the server's metrics (the dashboard draws them) and into the run's
summary with the rest of the step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agl_core.schema import Trajectory
from agl_trainer.advantages import AdvantageStats
from agl_trainer.rows import Row, RowStats

__all__ = ["SignalBounds", "batch_signal", "nothing_trained", "signal_warnings", "warning_flags"]


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
        "transitions_trained": float(sum(row.transitions for row in rows)),
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


def nothing_trained(trajectories: Sequence[Trajectory], row_stats: RowStats, stats: AdvantageStats) -> str | None:
    """One line when the step trained no transition, naming the agents seen and why their calls were not trained."""
    if not trajectories or row_stats.transitions:
        return None
    agents: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    selected = 0
    for trajectory in trajectories:
        selected += len(trajectory.transitions)
        agents.update(str(t.agent_name) for t in trajectory.transitions)
        agents.update(str(s.agent_name) for s in trajectory.skipped)
        reasons.update(s.reason for s in trajectory.skipped)
    seen = ", ".join(f"{name!r} ({n})" for name, n in sorted(agents.items())) or "none (no LLM call was recorded)"
    if not selected:
        why = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(3))
        return (f"no transition trained: {len(trajectories)} rollouts, none of their LLM calls was selected; agent "
                f"names seen: {seen}" + (f"; left out: {why}" if why else "") +
                " (agent_match is a regex searched in the agent name)")
    return (f"no transition trained: {selected} transitions of {len(trajectories)} rollouts were selected (agent "
            f"names seen: {seen}) but none became a training row: {stats.no_reward} rollouts without a reward, "
            f"{row_stats.no_token_ids} transitions without token ids")
