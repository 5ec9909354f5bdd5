"""What every agl store offers, embedded (``SqliteStore``) or remote (``HttpStore``).

Code that records or reads rollouts types against :class:`Store`, so the same
rollout context, worker loop or exporter runs on a local file and on a trainer
server alike. Both are structural protocols: nothing has to inherit from them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, TypeVar, runtime_checkable

from agl_core.schema import Rollout, Span, Trajectory, Transition

_S = TypeVar("_S", bound="Store")

EXPORT_FORMATS = ("jsonl", "parquet")
"""Values ``Store.export`` accepts for ``format``."""

EXPORT_WHATS = ("transitions", "rollouts", "spans")
"""Values ``Store.export`` accepts for ``what``."""


@runtime_checkable
class TrajectoryBuilder(Protocol):
    """Turns one rollout (with its spans) into its trajectory; ``agl_core.TransitionBuilder`` is one."""

    def build(self, rollout: Rollout) -> Trajectory: ...


@runtime_checkable
class Store(Protocol):
    """Where rollouts, their spans and their transitions are kept.

    Writes are atomic per call: after an error nothing already stored has changed.
    Lists come back in a stable order: rollouts by ``start_time``, spans by
    ``start_ns``, transitions by rollout and then by their order in the trajectory.
    """

    def put_rollout(self, rollout: Rollout, trajectory: Trajectory | None = None, *, validate: bool = True) -> None:
        """Store ``rollout`` with its spans, and its transitions when ``trajectory`` is given.

        A rollout id belongs to one task and attempt, and a finished rollout is final: storing it
        again under another task, attempt, status or rewards raises
        :class:`~agl_core.errors.RolloutConflict`; the same result again is accepted and only adds
        spans. A stored span is never dropped. ``validate=False`` skips re-checking records that agl
        has just built and validated itself.
        """
        ...

    def add_spans(self, rollout_id: str, spans: Sequence[Span]) -> None:
        """Append spans to a stored rollout; a span whose ``span_id`` is already there is left as it was."""
        ...

    def get_rollout(self, rollout_id: str, *, with_spans: bool = True) -> Rollout | None:
        """The rollout with this id, or None when there is none."""
        ...

    def rollouts(
        self,
        *,
        task_id: str | None = None,
        status: str | Sequence[str] | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = None,
        with_spans: bool = False,
    ) -> list[Rollout]:
        """Rollouts matching every filter given, ``since <= start_time < until``, oldest first."""
        ...

    def spans(self, rollout_id: str) -> list[Span]:
        """The spans of one rollout, by ``start_ns``."""
        ...

    def transitions(self, *, rollout_id: str | None = None, task_id: str | None = None) -> list[Transition]:
        """Stored transitions matching every filter given."""
        ...

    def trajectories(
        self,
        *,
        task_id: str | None = None,
        status: str | Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
        builder: TrajectoryBuilder | None = None,
    ) -> list[Trajectory]:
        """Stored trajectories, or, with ``builder``, trajectories rebuilt from the stored spans."""
        ...

    def export(self, path: str | os.PathLike[str], format: str = "jsonl", *, what: str = "transitions") -> int:
        """Write every stored record of kind ``what`` to ``path``; return how many were written."""
        ...

    def close(self) -> None:
        """Release the store's connections; using it afterwards raises ``StoreError``."""
        ...

    def __enter__(self: _S) -> _S: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
