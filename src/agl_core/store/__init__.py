"""Where rollouts, spans and transitions are kept: ``SqliteStore`` embedded, any ``Store`` alike."""

from __future__ import annotations

from agl_core.store.base import Store, TrajectoryBuilder
from agl_core.store.sqlite import SqliteStore

__all__ = ["SqliteStore", "Store", "TrajectoryBuilder"]
