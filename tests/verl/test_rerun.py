"""A rerun or a resume of the verl loop over the same ``server.db``: its task ids are its own.

The verl loop's roll-out stage (:class:`agl_trainer.verl_backend.RolloutStage`) on agl's real server,
queue, store and worker, twice over one SQLite file as two ``agl train`` runs would (each a server of
its own, its steps from 1 again). Only the model server is fake. No verl or GPU needed.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from agl_core.testing import FakeOpenAI
from agl_core.worker import Worker
from agl_trainer.gateway import OpenAIBackend
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer
from agl_trainer.training import LocalServer
from agl_trainer.verl_backend import RolloutStage

TASKS = [{"q": f"question {i}"} for i in range(3)]


def _ask(task: dict[str, Any]) -> float:
    client = openai.OpenAI(max_retries=0)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["q"]}])
    return 1.0 if reply.choices[0].message.content else 0.0


def _one_run(db: Path, fake: FakeOpenAI, steps: int) -> tuple[RolloutStage, list[int]]:
    """A run: its own server over ``db``, a worker, and ``steps`` steps of the verl loop's roll-out stage."""
    server = TrainerServer(ServerConfig(db_path=str(db), port=0), OpenAIBackend(fake.url, timeout_s=30.0))
    thread = ServerThread(server).start()
    worker = Worker(thread.url, _ask, concurrency=2, poll_s=0.05, instrument=False)
    running = threading.Thread(target=worker.run, daemon=True)
    running.start()
    try:
        stage = RolloutStage(LocalServer(server, engine=None), TASKS, tasks_per_step=2, group_size=2,
                             max_attempts=2, timeout_s=60.0, poll_s=0.02)
        counts = []
        for step in range(1, steps + 1):
            trajectories, errors, failed = stage.step(step)
            assert errors == [] and failed == 0
            counts.append(len(trajectories))
        return stage, counts
    finally:
        worker.stop(now=True)
        running.join(timeout=10)
        thread.stop()


def test_a_second_run_over_the_same_db_enqueues_and_finishes_its_steps(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    db = tmp_path / "server.db"
    with FakeOpenAI() as fake:
        first, counts = _one_run(db, fake, steps=2)
        assert counts == [4, 4]
        # the rerun (or a resume from verl's checkpoint): steps from 1 again, over the rows the first run left
        second, counts = _one_run(db, fake, steps=2)
        assert counts == [4, 4]
    assert first.run_id != second.run_id and first.task_ids(1) != second.task_ids(1)
    assert all(i.startswith(f"{second.run_id}-s1-") for i in second.task_ids(1))
    with sqlite3.connect(db) as conn:  # nothing of the first run was lost
        assert conn.execute("SELECT count(*) FROM rollouts WHERE status = 'succeeded'").fetchone()[0] == 16
