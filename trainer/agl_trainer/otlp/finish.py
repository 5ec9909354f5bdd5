"""Finishing a rollout whose spans came over OTLP: ``POST /v1/rollouts`` with its id, a finished status and
``rewards``, no spans.

The builder reads rewards from reward spans, so each posted reward that names no span becomes one
(``agl.reward <name>``, as ``agl.emit_reward`` makes), with an id drawn from the rollout id and the reward's
place: the same post twice adds it once.
"""

from __future__ import annotations

import hashlib

from agl_core import semconv
from agl_core.schema import Reward, Rollout, Span

__all__ = ["reward_spans", "settle_rewards", "span_rewards"]

_POSTED = "agl.reward.posted"
"""On a reward span made here: the reward came with the finishing post, after every span the rollout had."""


def reward_spans(rollout: Rollout) -> list[Span]:
    """A reward span for each of ``rollout.rewards`` that has none (its ``span_id`` is then set to it), at the
    reward's time, else the rollout's end, else just after its last span: the same post twice makes the same."""
    out = []
    known = {s.span_id for s in rollout.spans}
    last = max((s.end_ns for s in rollout.spans if not s.attributes.get(_POSTED)), default=0)
    for i, reward in enumerate(rollout.rewards):
        if reward.span_id is not None:
            continue
        digest = hashlib.sha256(f"{rollout.id}\x00{rollout.attempt}\x00{i}\x00{reward.name}".encode()).hexdigest()
        at = reward.time_ns or (int(rollout.end_time * 1e9) if rollout.end_time else last + 1)
        reward.span_id, reward.time_ns = digest[:16], at
        if reward.span_id in known:
            continue  # posted before: its span is stored
        attrs: dict[str, object] = {semconv.AGL_SPAN_KIND: semconv.KIND_REWARD, _POSTED: True,
                                    semconv.AGL_REWARD_VALUE: reward.value, semconv.AGL_ROLLOUT_ID: rollout.id}
        if reward.name is not None:
            attrs[semconv.AGL_REWARD_NAME] = reward.name
        name = f"{semconv.SPAN_REWARD} {reward.name}" if reward.name else semconv.SPAN_REWARD
        out.append(Span(span_id=digest[:16], trace_id=digest[16:48], name=name, start_ns=at, end_ns=at,
                        attributes=attrs, rollout_id=rollout.id))
    return out


def settle_rewards(rollout: Rollout) -> None:
    """Rewards and reward spans agree: a posted reward without a span gets one (:func:`reward_spans`), and a
    reward that came on a span alone is listed (:func:`span_rewards`)."""
    rollout.spans += reward_spans(rollout)
    span_rewards(rollout)


def span_rewards(rollout: Rollout) -> None:
    """Add to ``rollout.rewards`` the reward spans' rewards it does not list yet (``agl.reward.value`` on a
    span that came over OTLP): the rollout's final reward is then the one its transitions were credited with."""
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
    if added:  # in time order, as the builder reads them: the final reward is the last one given
        rollout.rewards.sort(key=lambda r: r.time_ns)
