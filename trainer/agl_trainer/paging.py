"""Pages of the server's listings: ``GET /v1/tasks``, ``/v1/rollouts``, ``/v1/transitions``, ``/v1/trajectories``.

Each answers at most ``limit`` items (default :data:`DEFAULT_LIMIT`, at most
:data:`MAX_LIMIT`) and ``next``: the cursor to pass as ``after`` for the page
that follows, or null on the last page. Cursors are opaque; one the listing
never gave is a 400.

Each listing walks one total order with a unique key, and its cursor is a
place in that order, not an item: tasks in queue order (the task id, whose
queue position never changes), rollouts and trajectories by start time and
then insertion order, transitions by their rollout's place and then their
position in its trajectory (:meth:`SqliteStore.rollouts_page` and its kin).
So every item is listed exactly once however many rollouts share a start time
(all posted without one share 0.0), and an item stored during a walk is
listed when it falls after the cursor; a rollout stored during a walk with a
start time before the cursor's is seen by the next walk. A page costs the
same however deep it is.
"""

from __future__ import annotations

from typing import Any

from agl_core.schema import Rollout, Trajectory, Transition
from agl_core.store.sqlite import SqliteStore
from agl_trainer.api import ApiError

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "limit_param", "rollouts_page", "trajectories_page", "transitions_page"]

DEFAULT_LIMIT = 1000
"""Items in one page when the request gives no ``limit``."""
MAX_LIMIT = 10_000
"""The largest ``limit`` a listing accepts."""


def limit_param(q: Any) -> int:
    """The request's ``limit``: 1 to :data:`MAX_LIMIT`, :data:`DEFAULT_LIMIT` when absent; else a 400."""
    raw = q.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter 'limit' must be an integer, got {raw!r}", "limit") from None
    if not 1 <= value <= MAX_LIMIT:
        raise ApiError(400, f"query parameter 'limit' must be an integer from 1 to {MAX_LIMIT}, got {value}", "limit")
    return value


def _bad_cursor(after: str) -> ApiError:
    return ApiError(400, f"query parameter 'after' is not a cursor of this listing: {after[:200]!r} "
                         "(pass the 'next' of the page before)", "after")


def rollouts_page(store: SqliteStore, after: str | None, limit: int,
                  **filters: Any) -> tuple[list[Rollout], str | None]:
    """One page of ``store.rollouts(**filters)`` and the cursor of the next."""
    try:
        return store.rollouts_page(limit=limit, after=after, **filters)
    except ValueError:
        if after is None:
            raise
        raise _bad_cursor(after) from None


def trajectories_page(store: SqliteStore, after: str | None, limit: int, *, task_id: str | None,
                      status: list[str] | None, rollout_ids: list[str] | None) -> tuple[list[Trajectory], str | None]:
    """One page of ``store.trajectories(...)`` and the cursor of the next."""
    try:
        return store.trajectories_page(limit=limit, after=after, task_id=task_id, status=status,
                                       rollout_ids=rollout_ids)
    except ValueError:
        if after is None:
            raise
        raise _bad_cursor(after) from None


def transitions_page(store: SqliteStore, after: str | None, limit: int, *, rollout_id: str | None,
                     task_id: str | None) -> tuple[list[Transition], str | None]:
    """One page of ``store.transitions(...)`` and the cursor of the next."""
    try:
        return store.transitions_page(limit=limit, after=after, rollout_id=rollout_id, task_id=task_id)
    except ValueError:
        if after is None:
            raise
        raise _bad_cursor(after) from None
