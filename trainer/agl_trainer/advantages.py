"""Advantages (LightningRL): one per rollout, grouped by task (GRPO), shared by every step and token of it.

A rollout's transitions first get their credited rewards (:func:`agl_core.credit.assign`:
``final``, ``discounted`` or a function, over the transitions' immediate rewards, so AIR
and other intermediate rewards count), then

    A_i,t = (c_i,t - mean_g) / (std_g + eps)

where ``c_i,t`` is the credited reward of step ``t`` of rollout ``i``, and ``mean_g``,
``std_g`` are taken over the *rollouts* of the task group ``g``, one value each: the
rollout's return ``R_i = c_i,0``. With ``final`` credit every step of a rollout has
the same advantage, ``(R_i - mean_g) / (std_g + eps)``.

Why per rollout and not per transition: a peer normalises over transitions, so a
rollout that made three calls puts three samples into the mean and the std. In a
group where a success takes one call and a failure three, the baseline is dragged
towards the failure, and the success ends up with a larger advantage than the
failure's (1.73 against -0.58 for rewards 1 and 0), only because failing took more
calls. Here each rollout is one sample: +1 and -1. The loss is normalised per rollout
too (:attr:`ScoredRollout.weight`, used by row building): each rollout's tokens share
one unit of weight, so a run with more calls does not weigh more in the update either.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from agl_core import credit as credit_mod
from agl_core.schema import Trajectory

__all__ = ["AdvantageStats", "ScoredRollout", "compute_advantages", "task_group"]

GroupOf = Callable[[Trajectory], str]


def task_group(trajectory: Trajectory) -> str:
    """The GRPO group of a rollout: its task id before any ``#k`` repeat suffix (the queue's convention)."""
    return trajectory.task_id.split("#", 1)[0]


@dataclass
class ScoredRollout:
    """A rollout's trajectory with its group, return and per-step advantages."""

    trajectory: Trajectory
    group: str
    credited: list[float]
    """The credited reward of each transition."""
    advantages: list[float]
    """The advantage of each transition (one value for all of them with ``final`` credit)."""
    weight: float = 1.0
    """This rollout's share of the loss: spread over its response tokens, whatever their number."""

    @property
    def ret(self) -> float:
        """The rollout's return: the credited reward of its first step."""
        return self.credited[0]

    @property
    def rollout_id(self) -> str:
        return self.trajectory.rollout_id


@dataclass
class AdvantageStats:
    """What went into one batch of advantages, for logs and tests."""

    rollouts: int = 0
    groups: int = 0
    no_reward: int = 0
    """Rollouts left out: they had no reward at all (nothing to learn from)."""
    no_transitions: int = 0
    """Rollouts left out: no LLM call of theirs was selected for training."""
    flat_groups: int = 0
    """Groups whose rollouts all had the same return: zero advantage, no signal."""
    mean_return: float = 0.0
    group_sizes: dict[int, int] = field(default_factory=dict)


def compute_advantages(
    trajectories: Iterable[Trajectory],
    *,
    credit: credit_mod.Credit | None = "final",
    gamma: float = 1.0,
    group_of: GroupOf = task_group,
    scale: bool = True,
    eps: float = 1e-6,
) -> tuple[list[ScoredRollout], AdvantageStats]:
    """Score each trajectory; see the module docstring.

    ``credit``: the credit assignment run over each trajectory's transitions (their
    immediate ``reward`` and the trajectory's final reward); None keeps the
    ``credited_reward`` the server's ``TransitionBuilder`` stored (credited over every
    call of the run, trained or not). ``scale``: divide by the group's std (GRPO); off,
    only the mean is taken away (Dr. GRPO). ``group_of``: a rollout's group, by default
    its task id before ``#``.
    """
    stats = AdvantageStats()
    groups: dict[str, list[tuple[Trajectory, list[float]]]] = {}
    for trajectory in trajectories:
        if not trajectory.transitions:
            stats.no_transitions += 1
            continue
        credited = _credited(trajectory, credit, gamma)
        if credited is None:
            stats.no_reward += 1
            continue
        groups.setdefault(group_of(trajectory), []).append((trajectory, credited))
    scored: list[ScoredRollout] = []
    returns: list[float] = []
    for group, members in groups.items():
        values = [c[0] for _, c in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if std == 0.0:
            stats.flat_groups += 1
        divisor = (std + eps) if scale else 1.0
        stats.group_sizes[len(members)] = stats.group_sizes.get(len(members), 0) + 1
        for trajectory, credited in members:
            advantages = [(c - mean) / divisor for c in credited]
            scored.append(ScoredRollout(trajectory, group, credited, advantages))
            returns.append(credited[0])
    stats.rollouts = len(scored)
    stats.groups = len(groups)
    stats.mean_return = sum(returns) / len(returns) if returns else 0.0
    return scored, stats


def _credited(trajectory: Trajectory, credit: credit_mod.Credit | None, gamma: float) -> list[float] | None:
    """Each transition's credited reward, or None when the rollout has no reward at all."""
    if credit is None:
        stored: Sequence[float | None] = [t.credited_reward for t in trajectory.transitions]
    else:
        stored = credit_mod.assign([t.reward for t in trajectory.transitions], trajectory.reward, credit, gamma)
    if all(v is None for v in stored):
        return None
    return [0.0 if v is None else float(v) for v in stored]
