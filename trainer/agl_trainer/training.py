"""The LightningRL training loop on one machine: rollouts through the server, updates with the torch backend.

Each step reads as its stages:

1. **enqueue**: ``tasks_per_step`` tasks, each ``group_size`` times, one GRPO group per
   task (ids ``{run}-s{step}-t{j}#{k}``, so a resumed run never collides with a step
   that was cut off);
2. **collect**: workers (``agl worker``, threads or Ray actors) lease them and run the
   unchanged agent against the gateway; wait until every task of the step is done or
   has failed for good, and read their trajectories from the store (the server's
   ``TransitionBuilder`` chose the trained agent's calls and the AIR rewards);
3. **score**: credit assignment and per-rollout group advantages
   (:func:`agl_trainer.advantages.compute_advantages`);
4. **rows**: :func:`agl_trainer.rows.build_rows`, per transition or per trajectory;
5. **update**: :meth:`agl_trainer.torch_backend.TorchBackend.update`;
6. **publish**: the new weights into the serving engine, and the server's model version
   moves on, so the next step's calls are sampled from (and recorded as) the new policy.

A checkpoint (weights, optimizer, step, history) is written every ``checkpoint_every``
steps and at the end; :meth:`Trainer.resume` picks it up.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agl_core.credit import Credit
from agl_core.schema import Trajectory
from agl_trainer.advantages import compute_advantages
from agl_trainer.rows import RowMode, build_rows
from agl_trainer.server import TrainerServer
from agl_trainer.torch_backend import TorchBackend

__all__ = ["StepResult", "TrainConfig", "Trainer"]


@dataclass
class TrainConfig:
    """What one training run does per step."""

    tasks_per_step: int = 4
    group_size: int = 8
    credit: Credit | None = "final"
    """Credit assignment over the trained transitions; None: the server builder's ``credited_reward``."""
    gamma: float = 1.0
    scale_advantages: bool = True
    row_mode: RowMode = "trajectory"
    step_timeout_s: float = 600.0
    max_attempts: int = 2
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10


@dataclass
class StepResult:
    """One step's numbers: what the rollouts scored, what the update did, how long it took."""

    step: int
    reward: float
    """Mean return of the step's rollouts (final reward plus intermediate rewards)."""
    final_reward: float
    """Mean final reward (without the intermediate ones)."""
    rollouts: int
    failed_rollouts: int
    """Rollouts whose agent raised (stored with status ``failed``; their reward, if any, still counts)."""
    failed_tasks: int
    """Tasks that ran out of attempts (their worker died or never posted)."""
    transitions: int
    rows: int
    merged: int
    prefix_mismatches: int
    rollout_s: float
    update_s: float
    rollouts_per_s: float
    version: int
    time: float
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Trainer:
    """Trains the policy behind ``server``'s gateway on ``tasks`` (each a JSON payload the agent understands).

    ``engine`` is the :class:`~agl_trainer.engine.TorchEngine` serving the policy (the
    server's backend); ``backend`` holds the copy being trained.
    """

    def __init__(self, server: TrainerServer, backend: TorchBackend, engine: Any, tasks: Sequence[Any],
                 config: TrainConfig | None = None) -> None:
        if not tasks:
            raise ValueError("tasks is empty: nothing to train on")
        self.server = server
        self.backend = backend
        self.engine = engine
        self.tasks = list(tasks)
        self.config = config or TrainConfig()
        self.run_id = uuid.uuid4().hex[:6]
        self.history: list[StepResult] = []
        self.last_errors: list[str] = []
        """The errors of the last step's rollouts whose agent raised."""

    # ------------------------------------------------------------------ the loop

    def run(self, steps: int, *, on_step: Callable[[StepResult], None] | None = None,
            stop: Callable[[list[StepResult]], bool] | None = None) -> list[StepResult]:
        """Train until ``backend.step`` reaches ``steps`` or ``stop(history)`` says so; return the history."""
        while self.backend.step < steps:
            result = self.step()
            if on_step is not None:
                on_step(result)
            done = stop is not None and stop(self.history)
            if self.config.checkpoint_dir and (done or self.backend.step % self.config.checkpoint_every == 0
                                               or self.backend.step >= steps):
                self.save()
            if done:
                break
        return self.history

    def step(self) -> StepResult:
        """One step: enqueue, collect, score, rows, update, publish."""
        cfg = self.config
        step = self.backend.step
        started = time.perf_counter()
        task_ids = self._enqueue(step)
        trajectories, errors, failed = self._collect(task_ids)
        self.last_errors = errors
        collected = time.perf_counter()
        scored, adv_stats = compute_advantages(trajectories, credit=cfg.credit, gamma=cfg.gamma,
                                               scale=cfg.scale_advantages)
        rows, row_stats = build_rows(scored, cfg.row_mode)
        metrics = self.backend.update(rows) if rows else {}
        if not rows:
            self.backend.step += 1  # nothing to learn from (every group flat or empty): the step still counts
        version = self.publish()
        finals = [t.reward for t in trajectories if t.reward is not None]
        rollout_s = collected - started
        result = StepResult(
            step=self.backend.step, reward=adv_stats.mean_return,
            final_reward=sum(finals) / len(finals) if finals else 0.0, rollouts=len(trajectories),
            failed_rollouts=len(errors), failed_tasks=failed,
            transitions=row_stats.transitions, rows=row_stats.rows, merged=row_stats.merged,
            prefix_mismatches=row_stats.prefix_mismatches, rollout_s=rollout_s,
            update_s=time.perf_counter() - collected,
            rollouts_per_s=len(trajectories) / rollout_s if rollout_s > 0 else 0.0, version=version,
            time=time.time(), metrics={**metrics, "flat_groups": float(adv_stats.flat_groups),
                                       "no_token_ids": float(row_stats.no_token_ids)})
        self.history.append(result)
        return result

    def publish(self) -> int:
        """Serve the trained weights from now on, under the next model version."""
        version = self.backend.publish(self.engine, version=max(self.server.model.version + 1, self.backend.step))
        self.server.model.set(version, None)
        return version

    # ------------------------------------------------------------------ stages

    def _enqueue(self, step: int) -> list[str]:
        from agl_trainer.queue import TaskSpec

        cfg = self.config
        n = len(self.tasks)
        specs = [TaskSpec(self.tasks[(step * cfg.tasks_per_step + j) % n], f"{self.run_id}-s{step}-t{j}")
                 for j in range(cfg.tasks_per_step)]
        return self.server.queue.enqueue(specs, repeat=cfg.group_size, max_attempts=cfg.max_attempts)

    def _collect(self, task_ids: list[str]) -> tuple[list[Trajectory], list[str], int]:
        """The step's trajectories, the errors of the rollouts whose agent raised, and the tasks that failed."""
        deadline = time.monotonic() + self.config.step_timeout_s
        pending = set(task_ids)
        rollout_ids: list[str] = []
        failed = 0
        while pending:
            for task_id in list(pending):
                info = self.server.queue.get(task_id)
                if info is None or info.state in ("done", "failed"):
                    pending.discard(task_id)
                    if info is not None and info.state == "done" and info.rollout_id:
                        rollout_ids.append(info.rollout_id)
                    else:
                        failed += 1
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} rollouts of this step did not finish within "
                                       f"{self.config.step_timeout_s:g} s: are workers running?")
                time.sleep(0.02)
        errors = []
        for rollout_id in rollout_ids:
            rollout = self.server.store.get_rollout(rollout_id, with_spans=False)
            if rollout is not None and rollout.status != "succeeded":
                errors.append(rollout.error or rollout.status)
        return self.server.store.trajectories(rollout_ids=rollout_ids), errors, failed

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        folder = self.config.checkpoint_dir
        if folder is None:
            raise ValueError("TrainConfig.checkpoint_dir is not set")
        self.backend.save(folder, extra={"history": [r.to_dict() for r in self.history]})

    def resume(self) -> bool:
        """Load the checkpoint in ``checkpoint_dir`` when there is one, and serve its weights; True if loaded."""
        folder = self.config.checkpoint_dir
        if folder is None or not TorchBackend.has_checkpoint(folder):
            return False
        extra = self.backend.load(folder)
        self.history = [StepResult(**r) for r in extra.get("history", [])]
        self.publish()
        return True


def load_history(folder: str | os.PathLike[str]) -> list[StepResult]:
    """The step history saved with a checkpoint (empty when there is none)."""
    path = os.path.join(folder, "trainer.json")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [StepResult(**r) for r in json.load(f).get("history", [])]
