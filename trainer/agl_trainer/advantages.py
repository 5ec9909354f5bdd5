"""Advantages (LightningRL): credited rewards against a per-position group baseline, grouped by task (GRPO).

Each transition arrives with its credited reward ``c_i,t`` (call ``t`` of rollout ``i``),
assigned by the ``TransitionBuilder`` over **every** call of the run, trained or not
(:func:`agl_core.credit.assign`: ``final``, ``discounted`` or a function), so an AIR
penalty or a named reward on a call that ``agent_match`` leaves out still reaches the
trained calls. Then, within the task group ``g`` (the rollouts of one task):

    A_i,t = (c_i,t - mean_t) / std_t              (0 where std_t is 0: no spread, no signal)

where ``mean_t`` and ``std_t`` are taken over the group's rollouts at the same **position**
``t`` (the ``t``-th trained call of each), one value per rollout; a rollout that ended
before call ``t`` stays in the comparison with its last credited value (what that run
ended up with). Why this baseline:

- ``final`` credit: every call of a rollout holds its return ``R_i``, so every position
  sees the group's returns and this is GRPO on returns, ``(R_i - mean R) / std R``, the
  same for every call of a rollout.
- ``discounted`` (return-to-go) and credit functions: ``c_i,t`` is what follows call
  ``t``, so it is compared with what followed the same call in the other runs of the
  task. The first call of every rollout starts from the same state (the task), which is
  exactly the situation GRPO's baseline is made for; the same position is the closest
  match the group has for later calls. A group whose rollouts agree (every run solved
  the task in three calls) has no spread at any position: its advantages are all 0, and
  it is counted (:attr:`AdvantageStats.flat_groups`). Taking one baseline from the
  rollouts' first values and applying it to every call (what this module did before)
  divides the calls' own differences (0.81, 0.9, 1.0 with gamma 0.9) by a zero spread.
- With gamma 1 and only a final reward, ``discounted`` gives exactly ``final``'s
  advantages (every value of a rollout is its return).

Bounds: with ``scale`` (GRPO) ``|A| <= sqrt(n - 1)`` for a group of ``n`` rollouts,
whatever the rewards; without (Dr. GRPO) ``|A|`` is at most the spread of the credited
rewards. A group of one rollout has nothing to compare with: 0.

Why per rollout and not per transition: a peer normalises over transitions, so a rollout
that made three calls puts three samples into the mean and the std. In a group where a
success takes one call and a failure three, the baseline is dragged towards the failure,
and the success ends up with a larger advantage than the failure's (1.73 against -0.58
for rewards 1 and 0), only because failing took more calls. Here each rollout is one
sample at each position: +1 and -1. The loss is normalised per rollout too
(:attr:`ScoredRollout.weight`, used by row building): each rollout's tokens share one
unit of weight, so a run with more calls does not weigh more in the update either.
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
    """Groups without spread: every rollout's credited rewards agreed, so every advantage is 0 (no signal)."""
    mean_return: float = 0.0
    group_sizes: dict[int, int] = field(default_factory=dict)


def compute_advantages(
    trajectories: Iterable[Trajectory],
    *,
    credit: credit_mod.Credit | None = None,
    gamma: float = 1.0,
    group_of: GroupOf = task_group,
    scale: bool = True,
    eps: float = 1e-6,
) -> tuple[list[ScoredRollout], AdvantageStats]:
    """Score each trajectory; see the module docstring.

    ``credit``: None (the default) takes each transition's ``credited_reward``, as the
    ``TransitionBuilder`` assigned it over every call of the run, trained or not. A method
    (``"final"``, ``"discounted"``, a function) credits the transitions here instead, from
    their immediate ``reward`` and the trajectory's final reward: only for trajectories
    that hold every call of their run (made by hand, or built without ``agent_match``);
    one whose builder left calls out (``Trajectory.skipped``) raises ``ValueError``, since
    their rewards and places would be lost. ``scale``: divide by the spread (GRPO); off,
    only the baseline is taken away (Dr. GRPO). ``eps``: spreads up to ``eps`` times the
    values' size count as none. ``group_of``: a rollout's group, by default its task id
    before ``#``.
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
    for group, members in groups.items():
        advantages = _group_advantages([c for _, c in members], scale=scale, eps=eps)
        if not any(a for row in advantages for a in row):
            stats.flat_groups += 1
        stats.group_sizes[len(members)] = stats.group_sizes.get(len(members), 0) + 1
        for (trajectory, credited), adv in zip(members, advantages, strict=True):
            scored.append(ScoredRollout(trajectory, group, credited, adv))
    stats.rollouts = len(scored)
    stats.groups = len(groups)
    stats.mean_return = sum(s.ret for s in scored) / len(scored) if scored else 0.0
    return scored, stats


def _group_advantages(credited: Sequence[Sequence[float]], *, scale: bool, eps: float) -> list[list[float]]:
    """Each rollout's advantages against the group's baseline at the same position (see the module docstring)."""
    out = [[0.0] * len(c) for c in credited]
    for t in range(max(len(c) for c in credited)):
        # a rollout that ended before call t stays in the comparison with its last credited value
        values = [c[min(t, len(c) - 1)] for c in credited]
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
        if std <= eps * max(1.0, max(abs(v) for v in values)):
            continue  # no spread at this position: nothing to learn from it
        for i, c in enumerate(credited):
            if t < len(c):
                out[i][t] = (c[t] - mean) / std if scale else c[t] - mean
    return out


def _credited(trajectory: Trajectory, credit: credit_mod.Credit | None, gamma: float) -> list[float] | None:
    """Each transition's credited reward, or None when the rollout has no reward at all."""
    if credit is None:
        stored: Sequence[float | None] = [t.credited_reward for t in trajectory.transitions]
    else:
        if trajectory.skipped:
            raise ValueError(
                f"rollout {trajectory.rollout_id}: credit={credit!r} would credit its {len(trajectory.transitions)} "
                f"trained calls alone, losing the rewards and places of the {len(trajectory.skipped)} calls its "
                f"builder left out (Trajectory.skipped); use credit=None, the credit the TransitionBuilder "
                f"assigned over the whole run (set it there: TransitionBuilder(credit=..., gamma=...))")
        stored = credit_mod.assign([t.reward for t in trajectory.transitions], trajectory.reward, credit, gamma)
    if all(v is None for v in stored):
        return None
    return [0.0 if v is None else float(v) for v in stored]
