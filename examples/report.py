"""What every example's ``__main__`` prints: a rollout's transitions and rewards, and the model settings."""

from __future__ import annotations

import json
import os

import agl_core as agl

DEFAULT_MODEL = "policy"  # agl's gateway serves its policy under any name (its default --model-rule override)


def model_name(model: str | None = None) -> str:
    """The model to ask: ``model``, else ``$AGL_MODEL``, else ``policy``."""
    return model or os.environ.get("AGL_MODEL") or DEFAULT_MODEL


def show(task_id: str, answer: object, traj: agl.Trajectory) -> None:
    """Print one rollout: its answer, final reward, then each transition with its ids and rewards."""
    print(f"\n== {task_id} -> {str(answer)[:80]!r}  final reward {traj.reward}")
    for t in traj.transitions:
        said = t.response.get("content") or json.dumps([c["function"] for c in t.response.get("tool_calls") or []])
        ids = t.response_token_ids
        print(f"  #{t.index} [{t.agent_name or 'agent'} / {t.model}] {len(t.prompt)} prompt msgs, "
              f"{len(t.prompt_token_ids or [])} prompt ids ({t.token_source}) -> {said[:70]!r}")
        print(f"      {len(ids) if ids is not None else 'no'} response ids, reward {t.reward}, "
              f"credited {t.credited_reward}")
    for s in traj.skipped:
        print(f"  not trained: {s.reason}")
