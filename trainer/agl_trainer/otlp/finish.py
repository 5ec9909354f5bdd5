"""Finishing a rollout whose spans came over OTLP: ``POST /v1/rollouts`` with its id, a finished status and
``rewards``, no spans.

A posted reward that names no span becomes a reward span (:mod:`agl_trainer.rollout_calls`); here, the other
way round: a reward that came on a span alone (``agl.reward.value``) joins the rollout's ``rewards``, so its
final reward is the one its transitions were credited with.
"""

from __future__ import annotations

from agl_core import semconv
from agl_core.schema import Reward, Rollout

__all__ = ["span_rewards"]


def span_rewards(rollout: Rollout) -> None:
    """Add to ``rollout.rewards`` the reward spans' rewards it does not list yet, in time order."""
    listed = {r.span_id for r in rollout.rewards if r.span_id is not None}
    added = False
    for span in rollout.spans:
        a = span.attributes
        value = a.get(semconv.AGL_REWARD_VALUE)
        if (a.get(semconv.AGL_SPAN_KIND) != semconv.KIND_REWARD or span.span_id in listed
                or not isinstance(value, (int, float)) or isinstance(value, bool)):
            continue
        name = a.get(semconv.AGL_REWARD_NAME)
        rollout.rewards.append(Reward(value=float(value), name=name if isinstance(name, str) else None,
                                      span_id=span.span_id, time_ns=span.start_ns))
        added = True
    if added:  # as the builder reads them: the final reward is the last one given (a posted one: after all)
        last = max((s.end_ns for s in rollout.spans), default=0)
        rollout.rewards.sort(key=lambda r: r.time_ns or last + 1)
