"""What every example shares: its task file, the model it asks, and its ``python -m`` command.

Each example's tasks live in ``tasks.jsonl`` next to its agent (one JSON task
a line), the same file ``agl train`` reads as ``data.path``. The model's
address and key come from ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (what
every OpenAI client reads, and what ``agl worker`` points at agl's gateway);
its name from ``--model``, else ``AGL_MODEL``, else ``policy`` (agl's gateway
serves its policy under any name).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
from collections.abc import Callable
from typing import Any

import agl_core as agl

__all__ = ["DEFAULT_MODEL", "main", "model_name", "read_tasks", "show"]

DEFAULT_MODEL = "policy"


def model_name(model: str | None = None) -> str:
    """The model to ask: ``model``, else ``$AGL_MODEL``, else ``policy``."""
    return model or os.environ.get("AGL_MODEL") or DEFAULT_MODEL


def read_tasks(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The tasks in a JSONL file, one JSON object a line (blank lines skipped)."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                task = json.loads(line)
                if not isinstance(task, dict) or "id" not in task:
                    raise ValueError(f"{path} line {number}: a task must be a JSON object with an 'id'")
                tasks.append(task)
    return tasks


def show(task_id: str, reward: float, traj: agl.Trajectory) -> None:
    """Print one rollout: its reward, then each transition with its token ids and rewards."""
    print(f"\n== {task_id}: reward {reward}  (final reward in the trace: {traj.reward})")
    for t in traj.transitions:
        said = t.response.get("content") or json.dumps([c["function"] for c in t.response.get("tool_calls") or []])
        ids = t.response_token_ids
        print(f"  #{t.index} [{t.agent_name or 'agent'} / {t.model}] {len(t.prompt)} prompt msgs, "
              f"{len(t.prompt_token_ids or [])} prompt ids ({t.token_source}) -> {said[:70]!r}")
        print(f"      {len(ids) if ids is not None else 'no'} response ids, reward {t.reward}, "
              f"credited {t.credited_reward}")
    for s in traj.skipped:
        print(f"  not trained: {s.reason}")


def main(doc: str, rollout: Any, tasks: list[dict[str, Any]], fake_policy: Callable[[dict[str, Any]], Any],
         argv: list[str] | None = None, *, default_tasks: int = 3) -> int:
    """``python -m examples.<name>.agent [--model M] [--tasks N] [--fake]``: run tasks, print their transitions.

    ``--fake`` answers with ``fake_policy`` from a fake OpenAI-compatible server on
    127.0.0.1 (token ids included, as vLLM returns them), so the example runs offline.
    """
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--model", help="model name (default $AGL_MODEL, else 'policy')")
    parser.add_argument("--tasks", type=int, default=default_tasks, help="how many tasks to run")
    parser.add_argument("--fake", action="store_true", help="answer with a scripted fake model on 127.0.0.1")
    args = parser.parse_args(argv)
    active = agl.instrument()
    print(f"agl: capturing {', '.join(active)}")
    server = None
    if args.fake:
        from agl_core.testing import FakeOpenAI

        server = FakeOpenAI(fake_policy, return_token_ids=True).start()
        os.environ.update(OPENAI_BASE_URL=server.url, OPENAI_API_KEY="not-needed")
    elif not os.environ.get("OPENAI_BASE_URL"):
        print("OPENAI_BASE_URL is not set: the OpenAI client's default server will be asked (use --fake to "
              "run offline)")
    try:
        for task in tasks[:args.tasks]:
            if inspect.iscoroutinefunction(rollout):
                reward = asyncio.run(rollout(task, model=args.model))
            else:
                reward = rollout(task, model=args.model)
            show(str(task["id"]), reward, rollout.last_run.trajectory())
    finally:
        if server is not None:
            server.stop()
    return 0

