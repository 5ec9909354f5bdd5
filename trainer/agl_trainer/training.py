"""The LightningRL training loop on one machine: rollouts through the server, updates with the torch backend.

Each step reads as its stages:

1. **enqueue**: ``tasks_per_step`` tasks, each ``group_size`` times, one GRPO group per
   task (ids ``{run}-s{step}-t{j}#{k}``, so a resumed run never collides with a step
   that was cut off);
2. **collect**: workers (``agl worker``, threads or Ray actors) lease them and run the
   unchanged agent against the gateway; wait until every task of the step is done or
   has failed for good, and read their trajectories from the store (the server's
   ``TransitionBuilder`` chose the trained agent's calls and the AIR rewards);
3. **score**: per-rollout group advantages of the credited rewards the server's
   ``TransitionBuilder`` assigned over the whole run
   (:func:`agl_trainer.advantages.compute_advantages`);
4. **rows**: :func:`agl_trainer.rows.build_rows`, per transition or per trajectory
   (3 and 4 are :func:`score_batch`, which the verl backend runs too);
5. **update**: :meth:`agl_trainer.torch_backend.TorchBackend.update`;
6. **publish**: the new weights into the serving engine, and the server's model version
   moves on, so the next step's calls are sampled from (and recorded as) the new policy;
7. **validate** (every ``validation.every`` steps, at the start and after the last step, with a
   :class:`ValidationSpec`): the held-out tasks go through the same queue and workers, each
   call sampled with the validation's own settings (the gateway's sampling overrides are
   swapped for the time of the validation: greedy by default), and only their final rewards
   are read: a validation rollout is never scored, never a row, never trained on;
8. **record**: the step's metrics (reward, loss, KL, rollouts/s, and the signal's health:
   :mod:`agl_trainer.signal_health`) go to the server (``record_metrics``: its dashboard
   and ``GET /v1/metrics`` draw them), each health warning is logged as one line
   (:attr:`StepResult.warnings`), and with ``curves_dir`` the curves are redrawn as PNG.

The server is reached through a link: :class:`LocalServer` (a :class:`TrainerServer`
in this process, its queue and store used directly, new weights copied into its
engine in memory) or :class:`RemoteServer` (``agl serve`` anywhere, over HTTP: tasks
enqueued with ``POST /v1/tasks``, trajectories read back and rebuilt here from the
stored spans with this run's ``TransitionBuilder``, new weights written as a
safetensors file the server can read and announced with ``POST /v1/model``).

A checkpoint (weights, optimizer, step, history) is written every ``checkpoint_every``
steps and at the end; :meth:`Trainer.resume` picks it up.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol

from agl_core.credit import Credit
from agl_core.schema import Trajectory
from agl_trainer.advantages import AdvantageStats, ScoredRollout, compute_advantages
from agl_trainer.policies import MultiPolicyBackend
from agl_trainer.rows import Row, RowMode, RowStats, build_rows
from agl_trainer.server import TrainerServer
from agl_trainer.signal_health import SignalBounds, batch_signal, nothing_trained, signal_warnings, warning_flags
from agl_trainer.torch_backend import TorchBackend

__all__ = ["LocalServer", "RemoteServer", "ServerLink", "StepBatch", "StepResult", "TrainConfig", "Trainer",
           "ValidationResult", "ValidationSpec", "collect", "joined_batches", "load_history", "score_batch",
           "write_curves"]

logger = logging.getLogger("agl.trainer")


@dataclass
class ValidationSpec:
    """A held-out set the loop runs without training on it (``agl train``'s ``validation`` section)."""

    tasks: list[Any]
    every: int = 10
    """After every this many steps, and after the last one."""
    at_start: bool = True
    """Once before the first step (a run that resumes does it again only if its last validation is missing)."""
    repeat: int = 1
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0})
    """The gateway's sampling overrides while the validation runs."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("ValidationSpec.tasks is empty: nothing to validate on")
        if self.every < 1 or self.repeat < 1:
            raise ValueError(f"ValidationSpec.every and .repeat must be 1 or more, got {self.every}, {self.repeat}")


@dataclass
class ValidationResult:
    """One validation: the mean final reward of the held-out rollouts, at the training step it followed."""

    step: int
    """The training steps done before it (0: before any)."""
    reward: float
    """Mean final reward of the rollouts that have one."""
    rollouts: int
    failed_rollouts: int
    failed_tasks: int
    no_reward: int
    """Rollouts that ended without a final reward (left out of ``reward``)."""
    rollout_s: float
    version: int
    time: float
    sampling: dict[str, Any] = field(default_factory=dict)
    rollout_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidationResult:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def values(self) -> dict[str, float]:
        """As the server's ``record_metrics`` stores them, next to the training step's own numbers."""
        return {"validation_reward_mean": self.reward, "validation_rollouts": float(self.rollouts),
                "validation_failed_rollouts": float(self.failed_rollouts),
                "validation_failed_tasks": float(self.failed_tasks),
                "validation_no_reward_rollouts": float(self.no_reward), "validation_s": self.rollout_s}


@dataclass
class TrainConfig:
    """What one training run does per step."""

    tasks_per_step: int = 4
    group_size: int = 8
    credit: Credit | None = None
    """None (the default): each transition's ``credited_reward``, which the server's ``TransitionBuilder``
    assigned over every call of the run, trained or not (set the method there). A method here credits the
    trained transitions alone: only for trajectories that hold every call of their run (see
    :func:`agl_trainer.advantages.compute_advantages`, which refuses the others)."""
    gamma: float = 1.0
    scale_advantages: bool = True
    row_mode: RowMode = "trajectory"
    step_timeout_s: float = 600.0
    max_attempts: int = 2
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    max_prompt_length: int | None = None
    """Rows' prompts keep their last this many tokens (:func:`agl_trainer.rows.build_rows`)."""
    max_response_length: int | None = None
    """Rows' responses (with the tool tokens between them) are cut at this many tokens."""
    curves_dir: str | None = None
    """Where ``reward_curve.png`` and ``loss_curve.png`` are redrawn after each step; None: not drawn."""
    signal_bounds: SignalBounds = field(default_factory=SignalBounds)
    """When a step's signal health is worth a warning (:func:`agl_trainer.signal_health.signal_warnings`)."""
    validation: ValidationSpec | None = None
    """A held-out set run at the start and every ``validation.every`` steps; None: no validation."""


@dataclass
class StepBatch:
    """A step's scored rollouts and training rows, with what scoring and row building counted."""

    scored: list[ScoredRollout]
    advantage_stats: AdvantageStats
    rows: list[Row]
    row_stats: RowStats

    def signal(self) -> dict[str, float]:
        """The batch's side of the signal health (:func:`agl_trainer.signal_health.batch_signal`)."""
        return batch_signal(self.advantage_stats, self.rows, self.row_stats)


def score_batch(trajectories: Sequence[Trajectory], config: TrainConfig) -> StepBatch:
    """Stages 3 and 4 of a step (score, rows) as ``config`` sets them; the torch and verl backends both run this."""
    scored, stats = compute_advantages(trajectories, credit=config.credit, gamma=config.gamma,
                                       scale=config.scale_advantages)
    rows, row_stats = build_rows(scored, config.row_mode, max_prompt_length=config.max_prompt_length,
                                 max_response_length=config.max_response_length)
    return StepBatch(scored, stats, rows, row_stats)


def joined_batches(batches: Sequence[StepBatch]) -> StepBatch:
    """Several policies' batches as one: their scored rollouts and rows, and their counts added (a rollout that
    several policies share counts once in each); ``mean_return`` is not joined (0: the step's own is the run's)."""
    stats, row_stats = AdvantageStats(), RowStats()
    scored: list[ScoredRollout] = []
    rows: list[Row] = []
    for b in batches:
        scored += b.scored
        rows += b.rows
        for total, part in ((stats, b.advantage_stats), (row_stats, b.row_stats)):
            for f in fields(total):
                mine, theirs = getattr(total, f.name), getattr(part, f.name)
                if isinstance(mine, dict):
                    for key, n in theirs.items():
                        mine[key] = mine.get(key, 0) + n
                elif f.name != "mean_return":
                    setattr(total, f.name, mine + theirs)
    return StepBatch(scored, stats, rows, row_stats)


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
    truncated_rows: int = 0
    """Rows cut to ``max_prompt_length`` / ``max_response_length``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The update's numbers (``loss``, ``pg``, ``kl``, ``clip_fraction``, ``approx_kl``, ``grad_norm``, ...) and the
    signal's health (``ratio_first_mean``, ``sampler_kl``, ``advantage_max_abs``, ``flat_groups``, ...)."""
    warnings: list[str] = field(default_factory=list)
    """One line per signal-health problem of this step (:func:`agl_trainer.signal_health.signal_warnings`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepResult:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def values(self) -> dict[str, float]:
        """The step as flat named numbers, as the server's ``record_metrics`` stores them."""
        out = {"reward_mean": self.reward, "final_reward_mean": self.final_reward, "rollouts": float(self.rollouts),
               "failed_rollouts": float(self.failed_rollouts), "failed_tasks": float(self.failed_tasks),
               "transitions": float(self.transitions), "rows": float(self.rows), "merged": float(self.merged),
               "prefix_mismatches": float(self.prefix_mismatches), "truncated_rows": float(self.truncated_rows),
               "rollout_s": self.rollout_s, "update_s": self.update_s, "rollouts_per_s": self.rollouts_per_s,
               "version": float(self.version)}
        for key, value in self.metrics.items():
            out.setdefault(key, float(value))
        return out


class ServerLink(Protocol):
    """What the training loop needs from the agl server, wherever it runs."""

    def enqueue(self, tasks: Sequence[Any], task_ids: Sequence[str], *, repeat: int, max_attempts: int
                ) -> list[str]: ...

    def finished(self, task_ids: Sequence[str]) -> dict[str, str | None]:
        """Of ``task_ids``, those done (-> their rollout id) or failed for good (-> None)."""
        ...

    def trajectories(self, rollout_ids: Sequence[str]) -> tuple[list[Trajectory], list[str]]:
        """The rollouts' trajectories, and the errors of those whose agent raised."""
        ...

    def publish(self, backend: TorchBackend) -> int:
        """Serve the backend's weights from now on; return their version."""
        ...

    def rebuilt(self, rollout_ids: Sequence[str], credit: Any) -> list[Trajectory]:
        """The rollouts' trajectories built again from their spans by the run's builder, credited as ``credit``
        (a policy's own, :func:`agl_trainer.policies.credited_as`)."""
        ...

    def record_metrics(self, step: int, values: dict[str, float]) -> None: ...

    def set_sampling(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """Sample every call with ``overrides`` from now on (the gateway's); return the overrides before."""
        ...


def post_builder(client: Any, builder: Any, source: str) -> None:
    """Have the agl serve behind ``client`` (an ``HttpClient``) build the stored transitions with ``builder`` too
    (``POST /v1/builder``); it refuses a builder whose keys it sets otherwise (``ServerError`` 409, naming both
    values). A builder that sets nothing is not posted."""
    settings = builder.settings() if builder is not None else {}
    if settings:
        client.request("POST", "/v1/builder", {"settings": settings, "source": source})


class LocalServer:
    """A :class:`TrainerServer` in this process, serving the policy from ``engine`` (a TorchEngine)."""

    def __init__(self, server: TrainerServer, engine: Any) -> None:
        self.server = server
        self.engine = engine

    def enqueue(self, tasks: Sequence[Any], task_ids: Sequence[str], *, repeat: int, max_attempts: int
                ) -> list[str]:
        from agl_trainer.queue import TaskSpec

        specs = [TaskSpec(task, task_id) for task, task_id in zip(tasks, task_ids, strict=True)]
        return self.server.queue.enqueue(specs, repeat=repeat, max_attempts=max_attempts)

    def finished(self, task_ids: Sequence[str]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for task_id in task_ids:
            info = self.server.queue.get(task_id)
            if info is None or info.state in ("done", "failed"):
                out[task_id] = info.rollout_id if info is not None and info.state == "done" else None
        return out

    def trajectories(self, rollout_ids: Sequence[str]) -> tuple[list[Trajectory], list[str]]:
        errors = []
        for rollout_id in rollout_ids:
            rollout = self.server.store.get_rollout(rollout_id, with_spans=False)
            if rollout is not None and rollout.status != "succeeded":
                errors.append(rollout.error or rollout.status)
        return self.server.store.trajectories(rollout_ids=list(rollout_ids)), errors

    def rebuilt(self, rollout_ids: Sequence[str], credit: Any) -> list[Trajectory]:
        from agl_trainer.policies import credited_as

        builder = credited_as(self.server.builder, credit)
        return self.server.store.trajectories(rollout_ids=list(rollout_ids), builder=builder)

    def publish(self, backend: TorchBackend) -> int:
        version = backend.publish(self.engine, version=max(self.server.model.version + 1, backend.step))
        self.server.model.set(version, None)
        return version

    def record_metrics(self, step: int, values: dict[str, float]) -> None:
        self.server.record_metrics(step, values)

    def set_sampling(self, overrides: dict[str, Any]) -> dict[str, Any]:
        config = self.server.gateway.config
        before = config.sampling_overrides
        config.sampling_overrides = dict(overrides)  # one assignment: each call reads the whole mapping once
        return before


class RemoteServer:
    """``agl serve`` at ``url``, over HTTP; its engine loads the weights this trainer writes into ``weights_dir``.

    ``weights_dir`` must be a folder the server can read at the same path (this machine, or a
    shared file system). Each publish writes ``v{version}.safetensors`` there, posts
    ``{"version", "weights": path}`` to ``/v1/model`` (the server answers once its engine has
    swapped them in), then deletes the file of the version before, so one copy stays on disk.
    ``builder`` (a ``TransitionBuilder``) rebuilds each rollout's trajectory from its stored spans,
    which carry the gateway's token ids, so this run's ``agent_match`` and AIR rules decide what
    is trained whatever the server was started with; None: the server's own transitions.
    """

    def __init__(self, url: str, token: str | None = None, *, weights_dir: str | os.PathLike[str],
                 builder: Any = None, poll_s: float = 0.25, timeout: float = 600.0) -> None:
        from agl_core.store.http import HttpStore
        from agl_core.worker import TaskClient

        self.tasks = TaskClient(url, token, timeout=timeout)
        self.store = HttpStore(url, token, timeout=timeout)
        self.weights_dir = os.path.abspath(os.fspath(weights_dir))
        self.builder = builder
        self.poll_s = poll_s
        self._last_weights: str | None = None

    @property
    def url(self) -> str:
        return self.tasks.url

    def enqueue(self, tasks: Sequence[Any], task_ids: Sequence[str], *, repeat: int, max_attempts: int
                ) -> list[str]:
        return self.tasks.enqueue(list(tasks), repeat=repeat, max_attempts=max_attempts, task_ids=list(task_ids))

    def finished(self, task_ids: Sequence[str]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for task_id in task_ids:
            info = self.tasks.task(task_id)
            if info.get("state") in ("done", "failed"):
                out[task_id] = info.get("rollout_id") if info.get("state") == "done" else None
        if len(out) < len(task_ids):
            time.sleep(self.poll_s)  # each poll is a request per task: not faster than this
        return out

    def trajectories(self, rollout_ids: Sequence[str]) -> tuple[list[Trajectory], list[str]]:
        runs = [r for r in (self.store.get_rollout(i, with_spans=self.builder is not None) for i in rollout_ids)
                if r is not None]
        errors = [r.error or r.status for r in runs if r.status != "succeeded"]
        if self.builder is None:
            return self.store.trajectories(rollout_ids=[r.id for r in runs]) if runs else [], errors
        return [self.builder.build(r) for r in runs], errors

    def rebuilt(self, rollout_ids: Sequence[str], credit: Any) -> list[Trajectory]:
        from agl_trainer.policies import credited_as

        if self.builder is None:
            raise ValueError("a policy's own credit rebuilds the rollouts with the run's builder: give RemoteServer "
                             "builder= (the run's TransitionBuilder)")
        runs = [r for r in (self.store.get_rollout(i, with_spans=True) for i in rollout_ids) if r is not None]
        own = credited_as(self.builder, credit)
        return [own.build(r) for r in runs]

    def join_builder(self, builder: Any, source: str) -> None:
        """Have the server build the stored transitions with ``builder`` too (:func:`post_builder`)."""
        post_builder(self.tasks.client, builder, source)

    def current_version(self) -> int:
        _, data = self.tasks.client.request("GET", "/v1/model")
        return int(data.get("version") or 0)

    def sampling(self) -> dict[str, Any]:
        """The server's gateway sampling overrides (``GET /v1/model``): what every call is sampled with."""
        _, data = self.tasks.client.request("GET", "/v1/model")
        found = data.get("sampling")
        return dict(found) if isinstance(found, dict) else {}

    def publish(self, backend: TorchBackend) -> int:
        from safetensors.torch import save_file

        version = max(self.current_version() + 1, backend.step)
        os.makedirs(self.weights_dir, exist_ok=True)
        path = os.path.join(self.weights_dir, f"v{version}.safetensors")
        # clones: safetensors refuses tensors that share memory (tied embeddings)
        state = {k: v.detach().to("cpu").clone().contiguous() for k, v in backend.serving_state_dict().items()}
        save_file(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        self.tasks.client.request("POST", "/v1/model", {"version": version, "weights": path})
        backend.version = version
        if self._last_weights is not None and self._last_weights != path:
            try:
                os.remove(self._last_weights)
            except OSError:
                pass
        self._last_weights = path
        return version

    def record_metrics(self, step: int, values: dict[str, float]) -> None:
        self.tasks.client.request("POST", "/v1/metrics", {"step": step, "values": values})

    def set_sampling(self, overrides: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("validation against a remote agl serve is not supported: its gateway pins the training "
                           "sampling on every call and offers no way to change it for a validation; validate with a "
                           "server of this process (agl train without server.url)")

    def close(self) -> None:
        self.tasks.close()
        self.store.close()


class Trainer:
    """Trains the policy behind the server's gateway on ``tasks`` (each a JSON payload the agent understands).

    ``server`` is a :class:`TrainerServer` in this process (then ``engine`` is the
    :class:`~agl_trainer.engine.TorchEngine` it serves the policy from) or any
    :class:`ServerLink`, such as :class:`RemoteServer` (then ``engine`` is unused);
    ``backend`` holds the copy being trained.
    """

    def __init__(self, server: TrainerServer | ServerLink, backend: TorchBackend | MultiPolicyBackend, engine: Any,
                 tasks: Sequence[Any], config: TrainConfig | None = None) -> None:
        if not tasks:
            raise ValueError("tasks is empty: nothing to train on")
        self.link: ServerLink = LocalServer(server, engine) if isinstance(server, TrainerServer) else server
        self.server = server
        self.backend = backend
        self.engine = engine
        self.tasks = list(tasks)
        self.config = config or TrainConfig()
        self.run_id = uuid.uuid4().hex[:6]
        self.history: list[StepResult] = []
        self.last_errors: list[str] = []
        """The errors of the last step's rollouts whose agent raised."""
        self.last_batch: StepBatch | None = None
        """The last step's scored rollouts and rows (what the update trained on)."""
        self.validations: list[ValidationResult] = []
        """Every validation of this run (and of the run it resumed), in order."""

    # ------------------------------------------------------------------ the loop

    def run(self, steps: int, *, on_step: Callable[[StepResult], None] | None = None,
            stop: Callable[[list[StepResult]], bool] | None = None,
            on_validation: Callable[[ValidationResult], None] | None = None) -> list[StepResult]:
        """Train until ``backend.step`` reaches ``steps`` or ``stop(history)`` says so; return the history.

        With ``config.validation`` the held-out set runs first and after every ``every``-th and the last step.
        """
        spec = self.config.validation

        def validate() -> None:
            result = self.validate()
            if on_validation is not None:
                on_validation(result)

        if spec is not None and self.backend.step < steps and self._validation_due(steps, start=True):
            validate()
        while self.backend.step < steps:
            result = self.step()
            if on_step is not None:
                on_step(result)
            if spec is not None and self._validation_due(steps):
                validate()
            done = stop is not None and stop(self.history)
            if self.config.checkpoint_dir and (done or self.backend.step % self.config.checkpoint_every == 0
                                               or self.backend.step >= steps):
                self.save()
            if done:
                break
        return self.history

    def step(self) -> StepResult:
        """One step: enqueue, collect, score, rows, update, publish, record."""
        cfg = self.config
        step = self.backend.step
        started = time.perf_counter()
        task_ids = self._enqueue(step)
        trajectories, errors, failed = self._collect(task_ids)
        self.last_errors = errors
        collected = time.perf_counter()
        batch = score_batch(trajectories, cfg)
        adv_stats, rows, row_stats = batch.advantage_stats, batch.rows, batch.row_stats
        self.last_batch = batch
        if isinstance(self.backend, MultiPolicyBackend):  # each policy scored and stepped on its own calls
            ids = [t.rollout_id for t in trajectories]
            credited = {p.name: self.link.rebuilt(ids, p) for p in self.backend.router.policies
                        if p.credit is not None}
            metrics = self.backend.update_policies(trajectories, lambda share: score_batch(share, cfg),
                                                   credited=credited)
            # what was trained is the policies' batches: their rows, flat groups and advantages (a joint batch
            # credited the run's way says nothing of a policy credited its own, and counts calls twice)
            trained = joined_batches(list(self.backend.last_batches.values()))
            adv_stats = replace(trained.advantage_stats, mean_return=adv_stats.mean_return)
            rows, row_stats = trained.rows, trained.row_stats
            batch = StepBatch(batch.scored, adv_stats, rows, row_stats)
        else:
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
            time=time.time(), truncated_rows=row_stats.truncated_rows,
            metrics={**metrics, **batch.signal(), "no_token_ids": float(row_stats.no_token_ids),
                     "dropped_loss_tokens": float(row_stats.dropped_loss_tokens)})
        result.warnings = signal_warnings(result.metrics, cfg.signal_bounds)
        result.metrics.update(warning_flags(result.metrics, cfg.signal_bounds))
        idle = nothing_trained(trajectories, row_stats, adv_stats)
        result.metrics["warn_nothing_trained"] = 1.0 if idle else 0.0
        if idle:
            result.warnings.insert(0, idle)
        for line in result.warnings:
            logger.warning("agl train: step %d: %s", result.step, line)
        self.history.append(result)
        self._record(result)
        return result

    def publish(self) -> int:
        """Serve the trained weights from now on, under the next model version."""
        return self.link.publish(self.backend)

    def validate(self) -> ValidationResult:
        """Run the validation set now, with its own sampling, and record its reward at the current step.

        Its rollouts are read for their final rewards only: they never reach :func:`score_batch`, so no
        validation call is ever a training row. The gateway's sampling is the validation's while it
        runs (the loop waits for every training rollout of the step first, so none is sampled so).
        """
        spec = self.config.validation
        if spec is None:
            raise ValueError("TrainConfig.validation is not set")
        step = self.backend.step
        started = time.perf_counter()
        ids = [f"{self.run_id}-v{step}-t{j}" for j in range(len(spec.tasks))]
        before = self.link.set_sampling(spec.sampling)
        try:
            task_ids = self.link.enqueue(spec.tasks, ids, repeat=spec.repeat, max_attempts=self.config.max_attempts)
            trajectories, errors, failed = self._collect(task_ids)
        finally:
            self.link.set_sampling(before)
        finals = [t.reward for t in trajectories if t.reward is not None]
        rollout_s = time.perf_counter() - started
        result = ValidationResult(step=step, reward=sum(finals) / len(finals) if finals else 0.0,
                                  rollouts=len(trajectories), failed_rollouts=len(errors), failed_tasks=failed,
                                  no_reward=len(trajectories) - len(finals), rollout_s=rollout_s,
                                  version=int(getattr(self.backend, "version", step)), time=time.time(),
                                  sampling=dict(spec.sampling), rollout_ids=[t.rollout_id for t in trajectories])
        self.validations = [v for v in self.validations if v.step != step] + [result]
        logger.info("agl train: validation at step %d: reward %.3f over %d rollouts", step, result.reward,
                    result.rollouts)
        try:
            self.link.record_metrics(step, result.values())
        except Exception as exc:  # noqa: BLE001 - as for a training step: a dashboard that is down costs nothing
            logger.warning("agl train: could not record the validation of step %d: %s", step, exc)
        if self.config.curves_dir:
            try:
                write_curves(self.config.curves_dir, self.history, validations=self.validations)
            except Exception as exc:  # noqa: BLE001
                logger.warning("agl train: could not draw the curves: %s", exc)
        return result

    def _validation_due(self, steps: int, *, start: bool = False) -> bool:
        spec = self.config.validation
        step = self.backend.step
        if spec is None or any(v.step == step for v in self.validations):
            return False
        if start:
            return spec.at_start if step == 0 else step % spec.every == 0  # a resumed run's validation that was cut off
        return step % spec.every == 0 or step >= steps

    def _record(self, result: StepResult) -> None:
        """The step's metrics to the server, and the curves redrawn; neither may stop the training."""
        try:
            self.link.record_metrics(result.step, result.values())
        except Exception as exc:  # noqa: BLE001 - a dashboard that is down must not cost a training step
            logger.warning("agl train: could not record the metrics of step %d: %s", result.step, exc)
        if self.config.curves_dir:
            try:
                write_curves(self.config.curves_dir, self.history, validations=self.validations)
            except Exception as exc:  # noqa: BLE001 - a full disk is reported, the training goes on
                logger.warning("agl train: could not draw the curves: %s", exc)

    # ------------------------------------------------------------------ stages

    def _enqueue(self, step: int) -> list[str]:
        cfg = self.config
        n = len(self.tasks)
        tasks = [self.tasks[(step * cfg.tasks_per_step + j) % n] for j in range(cfg.tasks_per_step)]
        ids = [f"{self.run_id}-s{step}-t{j}" for j in range(cfg.tasks_per_step)]
        return self.link.enqueue(tasks, ids, repeat=cfg.group_size, max_attempts=cfg.max_attempts)

    def _collect(self, task_ids: list[str]) -> tuple[list[Trajectory], list[str], int]:
        return collect(self.link, task_ids, timeout_s=self.config.step_timeout_s)

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        folder = self.config.checkpoint_dir
        if folder is None:
            raise ValueError("TrainConfig.checkpoint_dir is not set")
        self.backend.save(folder, extra={"history": [r.to_dict() for r in self.history],
                                         "validations": [v.to_dict() for v in self.validations]})

    def resume(self) -> bool:
        """Load the checkpoint in ``checkpoint_dir`` when there is one, and serve its weights; True if loaded."""
        folder = self.config.checkpoint_dir
        if folder is None or not self.backend.has_checkpoint(folder):
            return False
        extra = self.backend.load(folder)
        self.history = [StepResult.from_dict(r) for r in extra.get("history", [])]
        self.validations = [ValidationResult.from_dict(v) for v in extra.get("validations", [])]
        self.publish()
        return True


def collect(link: ServerLink, task_ids: Sequence[str], *, timeout_s: float) -> tuple[list[Trajectory], list[str], int]:
    """Wait for ``task_ids``: their trajectories, the errors of the rollouts whose agent raised, and the tasks that
    failed for good; :class:`TimeoutError` when some are still pending after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending = list(task_ids)
    rollout_ids: list[str] = []
    failed = 0
    while pending:
        finished = link.finished(pending)
        for rollout_id in finished.values():
            if rollout_id:
                rollout_ids.append(rollout_id)
            else:
                failed += 1
        pending = [t for t in pending if t not in finished]
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} rollouts of this step did not finish within "
                                   f"{timeout_s:g} s: are workers running?")
            time.sleep(0.02)
    trajectories, errors = link.trajectories(rollout_ids)
    return trajectories, errors, failed


def write_curves(folder: str | os.PathLike[str], history: Sequence[StepResult], *, title: str = "",
                 target: float | None = None, validations: Sequence[ValidationResult] = ()) -> tuple[str, str]:
    """Draw ``reward_curve.png`` (with the validation reward, at its own steps) and ``loss_curve.png`` of
    ``history`` into ``folder``; return their paths."""
    from agl_trainer.demo.curve import write_curve

    os.makedirs(folder, exist_ok=True)
    steps = [r.step for r in history]
    reward = os.path.join(folder, "reward_curve.png")
    rewards: dict[str, Any] = {"reward (return)": [r.reward for r in history],
                               "final reward": [r.final_reward for r in history]}
    if validations:
        rewards["validation reward"] = ([v.step for v in validations], [v.reward for v in validations])
    policies = dict.fromkeys(k.split("/")[1] for r in history for k in r.metrics
                             if k.startswith("policy/") and k.endswith("/reward"))
    for name in policies:  # several policies: each one's calls, credited
        rewards[f"policy {name}"] = [r.metrics.get(f"policy/{name}/reward", 0.0) for r in history]
    write_curve(reward, steps, rewards,
                title=title or "agl train: mean reward per rollout", target=target, ylabel="mean per rollout")
    loss = os.path.join(folder, "loss_curve.png")
    series = {"loss": [r.metrics.get("loss", 0.0) for r in history],
              "kl to reference": [r.metrics.get("kl", 0.0) for r in history],
              "approx kl to sampler": [r.metrics.get("approx_kl", 0.0) for r in history]}
    if not any(series["kl to reference"]):
        del series["kl to reference"]  # no reference model (kl_coef 0): a flat line says nothing
    write_curve(loss, steps, series, title=(title + ": loss") if title else "agl train: policy loss",
                ylabel="per rollout")
    return reward, loss


def load_history(folder: str | os.PathLike[str]) -> list[StepResult]:
    """The step history saved with a checkpoint (empty when there is none)."""
    path = os.path.join(folder, "trainer.json")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [StepResult.from_dict(r) for r in json.load(f).get("history", [])]
