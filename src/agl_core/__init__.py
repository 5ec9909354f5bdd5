"""agl: train any agent with reinforcement learning, unchanged.

``import agl_core`` is cheap and safe anywhere: it imports no framework, no
OpenTelemetry SDK, no torch and no server library. Public names are loaded on
first use (PEP 562), so ``agl.rollout`` costs nothing until it is called.

    import agl_core as agl

    agl.instrument()
    store = agl.SqliteStore("runs.db")
    with agl.rollout(task_id="q-17", task={"question": "..."}, store=store) as run:
        answer = my_agent.invoke(...)
        agl.emit_reward(1.0)
    traj = run.trajectory()
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "instrument": "agl_core.instrumentation",
    "uninstrument": "agl_core.instrumentation",
    "Instrumented": "agl_core.instrumentation",
    "rollout": "agl_core.rollouts",
    "rollout_fn": "agl_core.rollouts",
    "RolloutRun": "agl_core.rollouts",
    "emit_reward": "agl_core.rollouts",
    "emit_message": "agl_core.rollouts",
    "emit_object": "agl_core.rollouts",
    "emit_exception": "agl_core.rollouts",
    "current_rollout_id": "agl_core.rollouts",
    "resources": "agl_core.rollouts",
    "tool_call": "agl_core.tools",
    "ToolCall": "agl_core.tools",
    "TransitionBuilder": "agl_core.transitions",
    "AirRules": "agl_core.transitions",
    "Span": "agl_core.schema",
    "Reward": "agl_core.schema",
    "Rollout": "agl_core.schema",
    "Transition": "agl_core.schema",
    "Trajectory": "agl_core.schema",
    "Skipped": "agl_core.schema",
    "SCHEMA_VERSION": "agl_core.schema",
    "SqliteStore": "agl_core.store.sqlite",
    "HttpStore": "agl_core.store.http",
    "AglError": "agl_core.errors",
    "SchemaError": "agl_core.errors",
    "StoreError": "agl_core.errors",
    "PluginError": "agl_core.errors",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agl_core' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from agl_core.errors import AglError, PluginError, SchemaError, StoreError
    from agl_core.instrumentation import Instrumented, instrument, uninstrument
    from agl_core.rollouts import (
        RolloutRun,
        current_rollout_id,
        emit_exception,
        emit_message,
        emit_object,
        emit_reward,
        resources,
        rollout,
        rollout_fn,
    )
    from agl_core.schema import SCHEMA_VERSION, Reward, Rollout, Skipped, Span, Trajectory, Transition
    from agl_core.store.http import HttpStore
    from agl_core.store.sqlite import SqliteStore
    from agl_core.tools import ToolCall, tool_call
    from agl_core.transitions import AirRules, TransitionBuilder
