"""The one-token demo (``agl demo --one-token``) end to end, short: a real LangChain agent through the gateway,
trained a few steps, then resumed.

What it checks: the reward went up, the weights the gateway serves changed (and later
calls were answered by later model versions), only the ``solver`` agent was trained
(``reporter``'s calls are skipped), trajectory rows merged the agent's consecutive
calls with no prefix mismatch, and a second run resumes from the checkpoint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("langchain_openai")
pytest.importorskip("langgraph")

import agl_core as agl  # noqa: E402
from agl_trainer.demo.run import DemoOptions, run_demo  # noqa: E402
from agl_trainer.token_records import MODEL_VERSION_ATTRIBUTE  # noqa: E402

STEPS = 14


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DemoOptions, object]]:
    folder = tmp_path_factory.mktemp("demo")
    # two lockers and groups of 16: a clear rise within a few steps whatever the seed (four lockers need ~50)
    options = DemoOptions(folder=str(folder), steps=STEPS, minutes=4, lockers=2, group_size=16, workers=16, lr=2e-3,
                          target=2.0, progress=False, checkpoint_every=STEPS, one_token=True)
    yield options, run_demo(options)
    agl.uninstrument(["langchain"])  # the worker turned it on; the suite's other tests run without it


def test_the_reward_goes_up_and_the_served_weights_change(demo: tuple[DemoOptions, object]) -> None:
    options, result = demo
    steps = result.steps  # type: ignore[attr-defined]
    assert len(steps) == STEPS
    first = sum(s["reward"] for s in steps[:3]) / 3
    last = sum(s["reward"] for s in steps[-3:]) / 3
    assert last > first + 0.15, [round(s["reward"], 2) for s in steps]
    assert result.weights_changed  # type: ignore[attr-defined]
    assert steps[-1]["version"] >= STEPS
    assert all(s["prefix_mismatches"] == 0 and s["failed_rollouts"] == 0 for s in steps)
    assert sum(s["merged"] for s in steps) > 0


def test_the_store_holds_the_runs_with_only_the_solver_trained(demo: tuple[DemoOptions, object]) -> None:
    options, result = demo
    store = agl.SqliteStore(os.path.join(options.folder, "agl.db"))
    try:
        rollouts = store.rollouts()
        assert len(rollouts) == result.store_rollouts > 0  # type: ignore[attr-defined]
        last_step = store.trajectories(rollout_ids=[r.id for r in rollouts[-32:]])
        transitions = [t for traj in last_step for t in traj.transitions]
        assert transitions and {t.agent_name for t in transitions} == {"solver"}
        assert {t.token_source for t in transitions} == {"gateway"}
        # reporter's calls are traced and skipped (a solver that ran out of steps never reaches reporter)
        assert any("reporter" in s.reason for traj in last_step for s in traj.skipped)
        versions = {s.attributes.get(MODEL_VERSION_ATTRIBUTE) for s in store.spans(rollouts[-1].id)} - {None}
        assert versions and min(versions) >= STEPS - 1  # answered by the weights of the last steps
    finally:
        store.close()
    assert Path(result.curve).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # type: ignore[attr-defined]
    summary = Path(options.folder, "summary.md").read_text()
    ratio = re.search(r"- training signal \(last step\): first-pass ratio ([\d.]+) \(should be 1\)", summary)
    assert "mean reward" in summary and ratio and abs(float(ratio.group(1)) - 1) < 1e-2, summary


def test_a_second_run_resumes_from_the_checkpoint(demo: tuple[DemoOptions, object]) -> None:
    options, result = demo
    again = run_demo(DemoOptions(**{**options.__dict__, "steps": STEPS + 2}))
    assert again.resumed
    assert [s["step"] for s in again.steps] == list(range(1, STEPS + 3))
    assert again.steps[:STEPS] == result.steps  # type: ignore[attr-defined]
    assert again.store_rollouts == result.store_rollouts + 2 * 32  # type: ignore[attr-defined]
    assert all(s["failed_rollouts"] == 0 and s["rows"] > 0 for s in again.steps[STEPS:])
