"""Pages of the server's listings: ``GET /v1/tasks``, ``/v1/rollouts``, ``/v1/transitions``, ``/v1/trajectories``.

Each answers at most ``limit`` items (default :data:`DEFAULT_LIMIT`, at most
:data:`MAX_LIMIT`) and ``next``: the cursor to pass as ``after`` for the page
that follows, or null when nothing follows. A non-null ``next`` may lead to an
empty last page. Cursors are opaque: a task id, a rollout id, or for
transitions ``<position>:<rollout id>``; one the listing never gave is a 400.

Listings keep their order (queue order; rollouts by start time, then storage
order) and walk it from the cursor, so a page costs the same however deep it is.
A rollout stored during a walk with a start time before the cursor's is not
seen by that walk.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def _rollouts_after(store: SqliteStore, after: str | None, size: int, filters: dict[str, Any]) -> list[Rollout]:
    """Up to ``size`` rollouts matching ``filters`` that come after rollout ``after`` in listing order."""
    if after is None:
        return store.rollouts(limit=size, **filters)
    anchor = store.get_rollout(after, with_spans=False)
    if anchor is None:
        raise _bad_cursor(after)
    since = filters.get("since")
    until = filters.get("until")
    lower = anchor.start_time if since is None else max(since, anchor.start_time)
    if until is not None and lower >= until:
        return []
    rest = {k: v for k, v in filters.items() if k != "since"}
    extra = 64  # rollouts that started at the very same time as the anchor come first: skip them
    while True:
        batch = store.rollouts(since=lower, limit=size + extra, **rest)
        for i, rollout in enumerate(batch):
            if rollout.id == after:
                return batch[i + 1:i + 1 + size]
        if len(batch) < size + extra or batch[-1].start_time > anchor.start_time:
            # the anchor is not in this listing (its status changed since): start past its start time
            return [r for r in batch if r.start_time > anchor.start_time][:size]
        extra *= 4


def rollouts_page(store: SqliteStore, after: str | None, limit: int,
                  **filters: Any) -> tuple[list[Rollout], str | None]:
    """One page of ``store.rollouts(**filters)`` and the cursor of the next."""
    found = _rollouts_after(store, after, limit + 1, filters)
    if len(found) > limit:
        return found[:limit], found[limit - 1].id
    return found, None


def _walk(store: SqliteStore, after: str | None, limit: int, filters: dict[str, Any]) -> Any:
    """Batches of rollouts in listing order from ``after`` (exclusive): each a list, the last one short."""
    while True:
        batch = _rollouts_after(store, after, limit, filters)
        yield batch
        if len(batch) < limit:
            return
        after = batch[-1].id


def _stored(store: SqliteStore, ids: Sequence[str]) -> dict[str, Trajectory]:
    return {t.rollout_id: t for t in store.trajectories(rollout_ids=list(ids))} if ids else {}


def trajectories_page(store: SqliteStore, after: str | None, limit: int, *, task_id: str | None,
                      status: list[str] | None, rollout_ids: list[str] | None) -> tuple[list[Trajectory], str | None]:
    """One page of ``store.trajectories(...)`` (cursor: the rollout id of the last one) and the next cursor."""
    if rollout_ids:  # bounded by the request itself: page within what the store answers
        found = store.trajectories(task_id=task_id, status=status, rollout_ids=rollout_ids)
        start = 0
        if after is not None:
            start = next((i + 1 for i, t in enumerate(found) if t.rollout_id == after), -1)
            if start < 0:
                raise _bad_cursor(after)
        page = found[start:start + limit]
        return page, page[-1].rollout_id if start + limit < len(found) else None
    out: list[Trajectory] = []
    filters = {"task_id": task_id, "status": status}
    for batch in _walk(store, after, limit, filters):
        stored = _stored(store, [r.id for r in batch])
        for i, rollout in enumerate(batch):
            traj = stored.get(rollout.id)
            if traj is None:
                continue
            out.append(traj)
            if len(out) == limit:
                more = i + 1 < len(batch) or len(batch) == limit
                return out, rollout.id if more else None
    return out, None


def transitions_page(store: SqliteStore, after: str | None, limit: int, *, rollout_id: str | None,
                     task_id: str | None) -> tuple[list[Transition], str | None]:
    """One page of ``store.transitions(...)`` and the next cursor (``<position>:<rollout id>``)."""
    skip, resume = 0, None
    if after is not None:
        pos, sep, resume = after.partition(":")
        if not sep or not pos.isdigit() or store.get_rollout(resume, with_spans=False) is None \
                or (rollout_id is not None and resume != rollout_id):
            raise _bad_cursor(after)
        skip = int(pos)
    out: list[Transition] = []

    def take(rid: str, steps: list[Transition], start: int) -> str | None:
        """Add steps[start:] to the page; the cursor when the page filled up."""
        for pos in range(start, len(steps)):
            out.append(steps[pos])
            if len(out) == limit:
                return f"{pos + 1}:{rid}"
        return None

    if resume is not None:  # the rest of the rollout the last page stopped in
        traj = _stored(store, [resume]).get(resume)
        if traj is not None and (task_id is None or traj.task_id == task_id):
            cursor = take(resume, traj.transitions, skip)
            if cursor is not None:
                return out, cursor
    if rollout_id is not None:
        if resume is None:
            traj = _stored(store, [rollout_id]).get(rollout_id)
            if traj is not None and (task_id is None or traj.task_id == task_id):
                return out, take(rollout_id, traj.transitions, 0)
        return out, None
    for batch in _walk(store, resume, limit, {"task_id": task_id}):
        stored = _stored(store, [r.id for r in batch])
        for rollout in batch:
            traj = stored.get(rollout.id)
            if traj is not None:
                cursor = take(rollout.id, traj.transitions, 0)
                if cursor is not None:
                    return out, cursor
    return out, None
