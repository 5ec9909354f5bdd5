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


class PluginError(AglError, LookupError):
    """An instrumentor was asked for by a name no installed plugin carries."""
