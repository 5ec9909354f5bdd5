"""Which stored transitions a consumer takes: by task, rollout status, agent and reward.

One selection for every reader of a store, so ``agl export --agent 'writer' --task T``
and ``agl train`` with ``algorithm: sft`` (``sft.agent``, ``sft.task_ids``,
``sft.min_reward``) pick the same transitions from the same store.

The agent is a regex *searched* in the transition's agent name, as ``agent_match``:
``write`` keeps ``write_query`` and ``rewrite_query``, ``^writer$`` one name. The reward is
the transition's ``credited_reward`` (with ``final`` credit, its rollout's return); with
``min_reward`` a transition without one is left out, never taken as passing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agl_core.schema import Rollout, Transition

if TYPE_CHECKING:
    from agl_core.store.base import Store

__all__ = ["Selection"]


@dataclass(frozen=True)
class Selection:
    """A filter over a store's transitions; every field left None keeps everything."""

    task_ids: Sequence[str] | None = None
    """Only these tasks' rollouts."""
    status: Sequence[str] | None = None
    """Only rollouts with one of these statuses (``succeeded``, ``failed``, ...)."""
    agent: str | None = None
    """A regex searched in the transition's agent name."""
    min_reward: float | None = None
    """Only transitions whose ``credited_reward`` is at least this."""
    _match: re.Pattern[str] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.agent is not None:
            try:
                object.__setattr__(self, "_match", re.compile(self.agent))
            except re.error as exc:
                raise ValueError(f"agent: {self.agent!r} is not a valid regular expression: {exc}") from None

    def rollouts(self, store: Store) -> list[Rollout]:
        """The rollouts whose transitions are read: by task and status, oldest first."""
        status = list(self.status) if self.status else None
        if self.task_ids is None:
            return store.rollouts(status=status)
        out: list[Rollout] = []
        for task_id in dict.fromkeys(self.task_ids):
            out.extend(store.rollouts(task_id=task_id, status=status))
        return out

    def keeps(self, t: Transition) -> bool:
        """Whether one transition passes the agent and reward filters."""
        if self._match is not None and not self._match.search(t.agent_name or ""):
            return False
        if self.min_reward is not None and (t.credited_reward is None or t.credited_reward < self.min_reward):
            return False
        return True

    def transitions(self, store: Store, rollout_ids: Sequence[str] | None = None,
                    on_rollout: Callable[[], None] | None = None) -> Iterator[Transition]:
        """The selected transitions of ``rollout_ids`` (default: :meth:`rollouts`), in rollout then call order."""
        ids = [r.id for r in self.rollouts(store)] if rollout_ids is None else list(rollout_ids)
        for rollout_id in ids:
            for t in store.transitions(rollout_id=rollout_id):
                if self.keeps(t):
                    yield t
            if on_rollout is not None:
                on_rollout()
