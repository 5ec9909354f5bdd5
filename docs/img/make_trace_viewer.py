"""Regenerate ``docs/img/trace-viewer.svg``: what ``agl traces show`` prints for one rollout of the demo's agent.

The rollout is real: the two-agent LangGraph of ``agl_trainer.demo.lockers``
(``solver``, a ``create_agent`` with an ``unlock`` tool, then ``reporter``),
traced by agl's langchain and openai plugins, with the AIR rules of ``agl demo``.
Only the model is scripted (the fake vLLM-like server on 127.0.0.1): the solver
first tries a wrong code (a tool error, -0.05), then the right one (+0.5), then
answers; the reporter reports. The tree is rendered by the same function as
``agl traces show`` (:func:`agl_core.cli.traces.rollout_tree`) into a recording
rich console, saved as SVG.

    .venvs/trainer/bin/python docs/img/make_trace_viewer.py     # needs the trainer's environment (LangChain)
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

import agl_core as agl
from agl_core.cli.traces import rollout_tree
from agl_core.testing import FakeOpenAI

OUT = Path(__file__).with_name("trace-viewer.svg")


def main() -> int:
    from agl_trainer.demo.lockers import SYSTEM, TOOL_ERROR_REWARD, TOOL_OK_REWARD, Lockers, solve

    task = Lockers(n=4, seed=0).tasks()[0]
    wrong = next(c for c in Lockers(n=4, seed=0).codes if c != task["code"])

    def model(request: dict[str, Any]) -> Any:
        messages = request["messages"]
        if messages[0].get("content") != SYSTEM:  # the reporter
            return task["thing"]
        last = messages[-1]
        if last["role"] == "user":
            return {"tool_calls": [{"name": "unlock", "arguments": {"code": wrong}}]}
        if "wrong code" in str(last.get("content")):
            return {"tool_calls": [{"name": "unlock", "arguments": {"code": task["code"]}}]}
        return task["thing"]

    agl.instrument(["langchain", "openai"])
    builder = agl.TransitionBuilder(agent_match="solver",
                                    air=agl.AirRules(tool_ok=TOOL_OK_REWARD, tool_error=TOOL_ERROR_REWARD))
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAI(model, return_token_ids=True) as srv:
        os.environ["OPENAI_BASE_URL"] = srv.url
        os.environ["OPENAI_API_KEY"] = "not-needed"
        store = agl.SqliteStore(os.path.join(tmp, "agl.db"))
        with agl.rollout(task_id=f"locker-{task['locker']}", task=task, store=store, builder=builder) as run:
            agl.emit_reward(solve(task))
        rollout = store.get_rollout(run.id)
        assert rollout is not None
        (trajectory,) = store.trajectories(rollout_ids=[run.id])
        transitions, skipped = trajectory.transitions, trajectory.skipped
        store.close()
    agl.uninstrument()

    console = Console(record=True, width=172, force_terminal=True, color_system="truecolor", highlight=False,
                      file=io.StringIO())  # the recording is what is kept
    console.print(f"$ agl traces show {rollout.id[:8]}", style="bold")
    console.print(rollout_tree(rollout, transitions, skipped))
    console.save_svg(str(OUT), title="agl traces show")
    print(f"wrote {OUT} ({len(rollout.spans)} spans, {len(transitions)} transitions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
