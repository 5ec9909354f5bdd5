"""Errors agl raises on purpose: each names what was wrong and where."""

from __future__ import annotations


class AglError(Exception):
    """Base of every error agl raises deliberately."""


class SchemaError(AglError, ValueError):
    """A value does not fit the data model.

    ``field`` is the dotted path of the offending value, for example
    ``Trajectory.transitions[2].reward``, so a caller can point at it.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class StoreError(AglError):
    """The store cannot be opened or written; nothing already stored was changed."""


class RolloutConflict(StoreError):
    """A rollout was stored again in a way that would rewrite what is stored; nothing was changed.

    A rollout id belongs to one task and attempt, and a finished rollout is final: its status and
    rewards never change (it may gain spans). ``field`` names the conflicting field of the rollout
    (``task_id``, ``attempt``, ``status``, ``rewards``).
    """

    def __init__(self, rollout_id: str, field: str, problem: str) -> None:
        super().__init__(f"rollout {rollout_id!r}: {problem}")
        self.rollout_id = rollout_id
        self.field = field
        self.problem = problem


class PluginError(AglError, LookupError):
    """An instrumentor was asked for by a name no installed plugin carries."""
