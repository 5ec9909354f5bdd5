"""``agl train config.yaml``: a training run from a typed config (:mod:`agl_trainer.config`).

    agl train train.yaml
    agl train train.yaml --set algorithm.lr=3e-4 --set run.steps=20
    agl train train.yaml --check          # validate, load the data set, and stop

With the torch backend it starts, in this process: the agl server on
``server.host:port`` (SQLite store, task queue, gateway) serving ``backend.model``
from the built-in torch engine, ``workers.count`` worker threads (or Ray actors with
``workers.ray``) running the agent against the gateway, and the LightningRL loop
(:class:`agl_trainer.training.Trainer`). With ``server.url`` it trains against an
``agl serve`` that is already running, over HTTP (it first publishes ``backend.model``'s
weights to it, so the server's engine serves exactly the policy trained here). With
``backend.name: verl`` it hands
over to :func:`agl_trainer.verl_backend.launch` (a Ray cluster with GPUs).

It leaves in ``run.dir``: the checkpoint (a second run resumes from it), the reward and
loss curves (``reward_curve.png``, ``loss_curve.png``), ``summary.json``, and (with a
server of its own) the store ``server.db``. Every step's metrics also go to the server
(``GET /v1/metrics``, the dashboard). With a ``validation`` section the held-out set runs
before the first step and every ``validation.every`` steps, sampled with
``validation.sampling`` (greedy by default) and never trained on; its mean reward is
``validation_reward_mean`` at that step (server metrics, dashboard), a curve of the reward
PNG, and ``summary.json``'s ``validation``.

Exit status: 0 when the run finished its steps, 2 for a config error (printed as
``config error: KEY: PROBLEM`` before anything starts), 1 for a failure while running.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import click

from agl_trainer.config import (
    Config,
    ConfigError,
    code_builder,
    ignored_line,
    load_config,
    load_tasks,
    load_validation_tasks,
    refuse_earlier_run,
    transition_builder,
)

__all__ = ["TrainOutcome", "main", "run_training", "step_line", "train"]

logger = logging.getLogger("agl.trainer")


@dataclass
class TrainOutcome:
    """What a run did: its steps (as dicts), where its files are, and whether it resumed."""

    steps: list[dict[str, Any]]
    folder: str
    resumed: bool
    wall_s: float
    server_url: str
    files: dict[str, str] = field(default_factory=dict)
    validations: list[dict[str, Any]] = field(default_factory=list)
    summary_line: str | None = None
    """The closing console line, where it is not the reward of the first and last step (sft, rft)."""


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override one key of the config (dotted path; the value is read as YAML); repeatable")
@click.option("--check", is_flag=True, help="validate the config, load the data set, and stop")
@click.option("--quiet", is_flag=True, help="no progress line")
def train(config_path: str, overrides: tuple[str, ...], check: bool, quiet: bool) -> None:
    """Train the model behind an agent with LightningRL, as CONFIG (YAML) says."""
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    if config.algorithm.name == "apo":  # no model trained: a prompt searched for (docs/apo.md)
        from agl_trainer.apo import apo_command

        apo_command(config, check=check, progress=not quiet)
        return
    ignored = ignored_line(config)
    if ignored:
        click.echo(ignored, err=True)
    try:
        refuse_earlier_run(config)
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    if check and config.algorithm.name == "sft":
        click.echo(f"agl train: {config_path} is valid: sft on the store {config.sft.data or config.server.db}, "
                   f"backend {config.backend.name}")
        return
    if check:
        try:
            tasks = load_tasks(config)
            held_out = load_validation_tasks(config)
            verl = _check_verl(config) if config.backend.name == "verl" else ""
        except ConfigError as exc:
            click.echo(str(exc), err=True)
            sys.exit(2)
        validation = f", {len(held_out)} validation tasks every {config.validation.every} steps" \
            if config.validation is not None else ""
        click.echo(f"agl train: {config_path} is valid: {len(tasks)} tasks, backend {config.backend.name}, "
                   f"{config.run.steps} steps of {config.data.tasks_per_step} tasks x {config.data.group_size}"
                   f"{verl}{validation}")
        return
    try:
        outcome = run_training(config, progress=not quiet)
    except ConfigError as exc:  # found only once running (the agent's function, a module that raised on import)
        click.echo(str(exc), err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("agl train: interrupted; the same command resumes from the last checkpoint", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - one clear line, not a traceback, for what went wrong while running
        logger.debug("agl train failed", exc_info=True)
        click.echo(f"agl train: failed: {type(exc).__name__}: {exc}", err=True)
        sys.exit(1)
    steps = outcome.steps
    if outcome.summary_line:
        click.echo(outcome.summary_line)
    elif steps:
        first, last = steps[0], steps[-1]
        click.echo(f"agl train: {len(steps)} steps{' (resumed)' if outcome.resumed else ''}, reward "
                   f"{first['reward']:.3f} at step {first['step']} -> {last['reward']:.3f} at step {last['step']}, "
                   f"{outcome.wall_s:.0f} s")
        if outcome.validations:
            v0, v1 = outcome.validations[0], outcome.validations[-1]
            click.echo(f"agl train: validation reward {v0['reward']:.3f} at step {v0['step']} -> {v1['reward']:.3f} "
                       f"at step {v1['step']} ({len(outcome.validations)} validations)")
        warned = sum(1 for s in steps if s.get("warnings"))
        if warned:
            click.echo(f"agl train: {warned} of {len(steps)} steps warned about the training signal (summary.json "
                       "'warnings')", err=True)
    for name, path in outcome.files.items():
        click.echo(f"{name}: {path}")


def _check_verl(config: Config) -> str:
    """verl's own checks of the config it would run (:func:`~agl_trainer.verl_backend.check_verl_config`), where
    verl is installed; what the check line adds about them."""
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        return " (verl is not installed here: its own checks run as agl train starts on the cluster)"
    from agl_trainer.verl_backend import check_verl_config

    check_verl_config(config)
    return "; verl's validate_config passes it"


def main(argv: Sequence[str] | None = None) -> int:
    """``agl train ARGS``, for a caller that passes argv (exit status returned, never raised)."""
    try:
        train.main(args=list(sys.argv[1:] if argv is None else argv), prog_name="agl train", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


# ---------------------------------------------------------------------- the run


def run_training(config: Config, *, progress: bool = True) -> TrainOutcome:
    """Start what ``config`` asks for, train ``run.steps`` steps (or resume to it), stop it all; see the module."""
    assert config.backend is not None, "algorithm.name apo runs agl_trainer.apo.run_apo"
    refuse_earlier_run(config)
    if config.backend.name == "verl":
        from agl_trainer.verl_backend import launch

        return launch(config)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from agl_trainer.training import RemoteServer, Trainer

    if config.algorithm.name == "sft":
        return _sft(config, progress)
    started = time.monotonic()
    tasks = load_tasks(config)
    folder = config.path(config.run.dir)
    os.makedirs(folder, exist_ok=True)
    if config.backend.threads:
        torch.set_num_threads(config.backend.threads)
    torch.manual_seed(config.run.seed)
    builder = transition_builder(config, code_builder(config))
    token = config.server.token or os.environ.get("AGL_TOKEN") or None
    local = None
    engine: Any = None
    link: Any = None
    if config.server.url:  # before the model loads: a server that samples otherwise is refused at once
        weights = config.path(config.server.weights_dir) if config.server.weights_dir else \
            os.path.join(folder, "weights")
        link = RemoteServer(config.server.url, token, weights_dir=weights, builder=builder,
                            timeout=config.run.step_timeout_s)
        url = link.url
        _check_remote_sampling(link, float(config.algorithm.temperature or 1.0))
        _join_remote_builder(link, builder)
    backend, tokenizer = _torch_backend(config)
    if link is None and config.backend.vllm is not None:
        local, link = _vllm_server(config, builder, token, backend, folder)
        url = local.url
    elif link is None:
        local, engine = _local_server(config, builder, token, tokenizer, backend)
        link = local.server
        url = local.url
    worker = _start_workers(config, url, token)
    if config.algorithm.name == "rft":
        return _rft(config, backend, tokenizer, link, engine, tasks, progress, stop=(worker, local))
    trainer = Trainer(link, backend, engine, tasks, _train_config(config, folder))
    bar = _Progress(config.run.steps, enabled=progress)
    try:
        resumed = config.run.resume and trainer.resume()
        if resumed:
            bar.note(f"agl train: resuming at step {backend.step} from {trainer.config.checkpoint_dir}")
        elif config.server.url or config.backend.vllm is not None:
            # a remote server serves what its --engine loaded, vLLM no adapter yet: from now on each serves exactly
            # the weights trained here (a remote model of another shape fails now, naming the tensors that differ)
            trainer.publish()

        def stop(history: list[Any]) -> bool:
            last = history[-1]
            if last.rollouts and last.failed_rollouts == last.rollouts:
                raise RuntimeError(f"every rollout of step {last.step} failed; the first error: "
                                   f"{trainer.last_errors[0] if trainer.last_errors else 'none recorded'}")
            return False

        trainer.run(config.run.steps, on_step=bar.update, stop=stop, on_validation=bar.validation)
    except KeyboardInterrupt:
        trainer.save()
        raise
    finally:
        bar.close()
        worker.stop()
        if local is not None:
            local.stop()
        elif hasattr(link, "close"):
            link.close()
    steps = [r.to_dict() for r in trainer.history]
    validations = [v.to_dict() for v in trainer.validations]
    files = {"checkpoint": os.path.join(folder, "checkpoint"), "reward curve": os.path.join(folder, "reward_curve.png"),
             "loss curve": os.path.join(folder, "loss_curve.png"), "summary": os.path.join(folder, "summary.json")}
    if local is not None:
        files["store"] = config.path(config.server.db)
    outcome = TrainOutcome(steps=steps, folder=folder, resumed=bool(resumed), wall_s=time.monotonic() - started,
                           server_url=url, files=files, validations=validations)
    warnings = [f"step {s['step']}: {line}" for s in steps for line in s.get("warnings", [])]
    with open(files["summary"], "w", encoding="utf-8") as f:
        json.dump({"config": config.model_dump(mode="json"), "resumed": outcome.resumed, "wall_s": outcome.wall_s,
                   "server": url, "warnings": warnings, "steps": steps, "validation": validations}, f, indent=1)
    return outcome


def _sft(config: Config, progress: bool) -> TrainOutcome:
    """``algorithm: sft``: the torch backend fine-tuned on a store's transitions (:mod:`agl_trainer.sft`)."""
    import torch

    from agl_trainer.sft import run_sft

    if config.backend.threads:
        torch.set_num_threads(config.backend.threads)
    torch.manual_seed(config.run.seed)
    backend, tokenizer = _torch_backend(config)
    summary = run_sft(config, backend, tokenizer, progress=progress)
    steps, chosen = summary["steps"], summary["selection"]
    line = (f"agl train: sft {len(steps)} steps on {chosen['examples']} examples ({chosen['chat_template']} rendered "
            f"with the chat template), loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}, "
            f"{summary['wall_s']:.0f} s")
    return TrainOutcome(steps=steps, folder=config.path(config.run.dir), resumed=False, wall_s=summary["wall_s"],
                        server_url="", files=summary["files"], summary_line=line)


def _rft(config: Config, backend: Any, tokenizer: Any, link: Any, engine: Any, tasks: list[Any], progress: bool, *,
         stop: tuple[Any, Any]) -> TrainOutcome:
    """``algorithm: rft`` on the server, gateway and workers a grpo run would use (:mod:`agl_trainer.sft`)."""
    from agl_trainer.server import TrainerServer
    from agl_trainer.sft import run_rft
    from agl_trainer.training import LocalServer

    worker, local = stop
    server_url = local.url if local is not None else getattr(link, "url", "")
    try:
        rounds = LocalServer(link, engine) if isinstance(link, TrainerServer) else link
        summary = run_rft(config, backend, tokenizer, rounds, tasks, progress=progress)
    finally:
        worker.stop()
        if local is not None:
            local.stop()
        elif hasattr(link, "close"):
            link.close()
    r = summary["rounds"]
    line = (f"agl train: rft {len(r)} rounds, reward {r[0]['reward_mean']:.3f} in round 1 -> "
            f"{r[-1]['reward_mean']:.3f} in round {len(r)}, {summary['wall_s']:.0f} s")
    files = dict(summary["files"])
    if local is not None:
        files["store"] = config.path(config.server.db)
    return TrainOutcome(steps=summary["steps"], folder=config.path(config.run.dir), resumed=False,
                        wall_s=summary["wall_s"], server_url=server_url, files=files, summary_line=line)


def _check_remote_sampling(link: Any, temperature: float) -> None:
    """Refuse a server whose gateway lets calls sample from another distribution than the one trained here."""
    from agl_trainer.gateway import sampling_mismatch

    try:
        found = link.sampling()
    except Exception:
        link.close()
        raise
    wrong = sampling_mismatch(found, temperature)
    if wrong:
        link.close()
        shown = ", ".join(f"{k}={found[k]!r}" if k in found else f"{k} passed through from the agent" for k in wrong)
        raise ConfigError("server.url", f"the server's gateway does not sample as this run trains ({shown}): its "
                          f"recorded logprobs would not be of softmax(logits / {temperature:g}); start it with "
                          f"`agl serve ... --train-temperature {temperature:g}` (algorithm.temperature)")


def _join_remote_builder(link: Any, builder: Any) -> None:
    """The server builds the stored transitions its dashboard and exports show: with this run's builder, or refused."""
    from agl_core.errors import AglError

    try:
        link.join_builder(builder, "agl train's config and the agent's @agl.rollout_fn builder")
    except (AglError, ValueError) as exc:
        link.close()
        raise ConfigError("server.url", f"the server does not build transitions as this run trains: {exc}") from None


def _torch_backend(config: Config) -> tuple[Any, Any]:
    """The model being trained (loaded from ``backend.model``) in a TorchBackend, and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agl_trainer.torch_backend import LoraOptions, TorchBackend, TorchConfig

    b, a = config.backend, config.algorithm
    path = config.path(b.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, b.dtype))
    lora = LoraOptions(**b.lora.model_dump()) if b.lora is not None else None
    options = TorchConfig(lr=a.lr, weight_decay=a.weight_decay, clip_low=a.clip_epsilon,
                          clip_high=a.clip_epsilon_high if a.clip_epsilon_high is not None else a.clip_epsilon,
                          kl_coef=a.kl_coef, epochs=b.epochs, minibatches=b.minibatches, max_grad_norm=a.max_grad_norm,
                          max_tokens_per_forward=b.max_tokens_per_forward, lora=lora,
                          lora_above_params=b.lora_above_params, gradient_checkpointing=b.gradient_checkpointing,
                          logit_chunk_tokens=b.logit_chunk_tokens,
                          temperature=float(a.temperature or 1.0))
    pad = _pad_id(tokenizer)
    if config.policies:
        from agl_trainer.policies import MultiPolicyBackend, policies_of

        policies = policies_of(config)
        own = {p.name: (AutoModelForCausalLM.from_pretrained(config.path(p.model), dtype=getattr(torch, b.dtype)),
                        AutoTokenizer.from_pretrained(config.path(p.model))) for p in policies if p.model}
        return MultiPolicyBackend(model, policies, options, device=b.device, pad_id=pad,
                                  models={n: m for n, (m, _) in own.items()},
                                  tokenizers={n: t for n, (_, t) in own.items()},
                                  pad_ids={n: _pad_id(t) for n, (_, t) in own.items()},
                                  configs={n: replace(options, lr=p.lr) for n, p in config.policies.items()
                                           if p.lr is not None}), tokenizer
    return TorchBackend(model, options, device=b.device, pad_id=pad), tokenizer


def _pad_id(tokenizer: Any) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0))


class _Local:
    """The server this run started, in a thread of this process."""

    def __init__(self, server: Any, thread: Any) -> None:
        self.server = server
        self.thread = thread
        self.url: str = thread.url

    def stop(self) -> None:
        self.thread.stop()


def _local_server(config: Config, builder: Any, token: str | None, tokenizer: Any, backend: Any
                  ) -> tuple[_Local, Any]:
    """The server in this process; its engine serves the backend's model itself (one set of weights)."""
    from agl_trainer.gateway import GatewayConfig, training_sampling
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer, check_bind

    try:
        check_bind(config.server.host, token)
    except ValueError as exc:
        raise ConfigError("server.token", str(exc)) from None
    b = config.backend
    path = config.path(b.model)
    engine = backend.engine(copy.deepcopy(tokenizer), name=os.path.basename(os.path.normpath(path)),
                            max_batch=b.max_batch, seed=config.run.seed)
    overrides = training_sampling(float(config.algorithm.temperature or 1.0))
    server_config = ServerConfig(db_path=config.path(config.server.db), host=config.server.host,
                                 port=config.server.port, token=token, max_attempts=config.server.max_attempts,
                                 lease_timeout_s=config.server.lease_timeout_s, builder=builder,
                                 builder_source="agl train (its config and the agent's @agl.rollout_fn builder)",
                                 gateway=GatewayConfig(sampling_overrides=overrides,
                                                       upstreams=dict(config.server.upstreams),
                                                       policies=getattr(backend, "router", None)))
    server = TrainerServer(server_config, engine)
    return _Local(server, ServerThread(server).start()), engine


def _vllm_server(config: Config, builder: Any, token: str | None, backend: Any, folder: str) -> tuple[_Local, Any]:
    """The server in this process with vLLM behind its gateway, every call asking for the trained adapter."""
    from agl_trainer.gateway import GatewayConfig, OpenAIBackend, training_sampling
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer, check_bind
    from agl_trainer.vllm_lora import VllmAdapters, VllmLoraLink

    v = config.backend.vllm
    assert v is not None
    if config.policies:
        return _vllm_policies_server(config, builder, token, backend, folder)
    if backend.config.lora is None:
        raise ConfigError("backend.lora", "backend.vllm serves the policy as a LoRA adapter, and this model would be "
                          "fully fine-tuned: set backend.lora (r, alpha, target_modules)")
    try:
        check_bind(config.server.host, token)
    except ValueError as exc:
        raise ConfigError("server.token", str(exc)) from None
    overrides = training_sampling(float(config.algorithm.temperature or 1.0))
    server_config = ServerConfig(db_path=config.path(config.server.db), host=config.server.host,
                                 port=config.server.port, token=token, max_attempts=config.server.max_attempts,
                                 lease_timeout_s=config.server.lease_timeout_s, builder=builder,
                                 builder_source="agl train (its config and the agent's @agl.rollout_fn builder)",
                                 gateway=GatewayConfig(served_model=v.lora_name, sampling_overrides=overrides))
    server = TrainerServer(server_config, OpenAIBackend(v.url, v.api_key))
    adapters_dir = config.path(v.adapters_dir) if v.adapters_dir else os.path.join(folder, "adapters")
    os.makedirs(adapters_dir, exist_ok=True)
    link = VllmLoraLink(server, VllmAdapters(v.url, v.lora_name, api_key=v.api_key), adapters_dir)
    return _Local(server, ServerThread(server).start()), link


def _vllm_policies_server(config: Config, builder: Any, token: str | None, backend: Any, folder: str
                          ) -> tuple[_Local, Any]:
    """As :func:`_vllm_server`, with each policy's adapter served by vLLM under the policy's name."""
    from agl_trainer.gateway import GatewayConfig, OpenAIBackend, training_sampling
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer, check_bind
    from agl_trainer.vllm_lora import VllmAdapters, VllmPoliciesLink

    v = config.backend.vllm
    assert v is not None
    try:
        check_bind(config.server.host, token)
    except ValueError as exc:
        raise ConfigError("server.token", str(exc)) from None
    overrides = training_sampling(float(config.algorithm.temperature or 1.0))
    gateway = GatewayConfig(sampling_overrides=overrides, upstreams=dict(config.server.upstreams),
                            policies=backend.router)
    server_config = ServerConfig(db_path=config.path(config.server.db), host=config.server.host,
                                 port=config.server.port, token=token, max_attempts=config.server.max_attempts,
                                 lease_timeout_s=config.server.lease_timeout_s, builder=builder,
                                 builder_source="agl train (its config and the agent's @agl.rollout_fn builder)",
                                 gateway=gateway)
    server = TrainerServer(server_config, OpenAIBackend(v.url, v.api_key))
    adapters_dir = config.path(v.adapters_dir) if v.adapters_dir else os.path.join(folder, "adapters")
    os.makedirs(adapters_dir, exist_ok=True)
    adapters = {name: VllmAdapters(v.url, name, api_key=v.api_key) for name in backend.names}
    return _Local(server, ServerThread(server).start()), VllmPoliciesLink(server, adapters, adapters_dir)


class _Workers:
    """The run's workers: a :class:`Worker` in a thread, or Ray actors driven from a thread (``ray_stop``).

    Ray's are stopped, waited for and Ray shut down here, before the process exits: left to the
    interpreter's exit, Ray's own shutdown raced the thread still waiting on the actors, and the
    process ended with status 1 after a run that had finished ("core worker has already been shutdown").
    """

    def __init__(self, worker: Any = None, thread: threading.Thread | None = None, *,
                 ray_stop: threading.Event | None = None, shutdown_ray: bool = False) -> None:
        self.worker = worker
        self.thread = thread
        self.ray_stop = ray_stop
        self.shutdown_ray = shutdown_ray

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop(now=True)
        if self.ray_stop is not None:
            self.ray_stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
            if self.thread.is_alive():
                logger.warning("agl train: the workers did not stop within 30 s")
        if self.shutdown_ray:
            import ray

            ray.shutdown()


def _start_workers(config: Config, url: str, token: str | None) -> _Workers:
    """``workers.count`` slots running the agent against ``url``: threads here, or Ray actors."""
    w = config.workers
    if w.count == 0:
        return _Workers()
    # the worker's heartbeat can name a lease that finished a moment before as lost: harmless
    logging.getLogger("agl.worker").setLevel(logging.ERROR)
    if w.ray is not None:
        import ray

        from agl_core.worker import run_on_ray

        started_ray = not ray.is_initialized()
        if started_ray:  # here, in the main thread: ray.init installs signal handlers
            ray.init(address=None if w.ray == "local" else w.ray, log_to_driver=False)
        stop = threading.Event()

        def on_ray() -> None:
            try:
                run_on_ray(w.ray or "local", url, config.agent, actors=w.count, token=token, actor_cpus=w.actor_cpus,
                           stop=stop, poll_s=1.0, idle_exit_s=config.run.step_timeout_s)
            except Exception:  # noqa: BLE001 - the step timeout then says that no rollout came back
                if not stop.is_set():
                    logger.exception("agl train: the Ray workers stopped")

        thread = threading.Thread(target=on_ray, name="agl-train-ray", daemon=True)
        thread.start()
        return _Workers(None, thread, ray_stop=stop, shutdown_ray=started_ray)
    from agl_core.worker import Worker, point_openai_at

    point_openai_at(url, token)
    try:
        worker = Worker(url, config.agent, token=token, concurrency=w.count, poll_s=0.2, grace_s=5.0)
    except ValueError as exc:
        raise ConfigError("agent", str(exc)) from None
    thread = threading.Thread(target=worker.run, name="agl-train-worker", daemon=True)
    thread.start()
    return _Workers(worker, thread)


def _train_config(config: Config, folder: str) -> Any:
    from agl_trainer.training import TrainConfig, ValidationSpec

    a, v = config.algorithm, config.validation
    validation = ValidationSpec(load_validation_tasks(config), every=v.every, at_start=v.at_start, repeat=v.repeat,
                                sampling=v.sampling.overrides()) if v is not None else None
    # credit=None: the builder (``transition_builder``: credit.method, credit.gamma) credits every call of the run,
    # trained or not, before agent_match picks the trained ones; crediting here again would see the trained calls alone
    return TrainConfig(tasks_per_step=config.data.tasks_per_step, group_size=config.data.group_size, credit=None,
                       gamma=config.credit.gamma, scale_advantages=a.scale_advantages, row_mode=a.row_mode,
                       step_timeout_s=config.run.step_timeout_s, max_attempts=config.server.max_attempts,
                       checkpoint_dir=os.path.join(folder, "checkpoint"), checkpoint_every=config.run.checkpoint_every,
                       max_prompt_length=a.max_prompt_length, max_response_length=a.max_response_length,
                       curves_dir=folder, validation=validation)


def step_line(r: Any, steps: int, elapsed: float) -> str:
    """The console line of one step: reward and loss, and whether it trained anything.

    The grad norm ("-": no update ran), the transitions trained of those the step's rollouts
    selected, and the groups without spread (every rollout scored alike: no advantage to learn
    from), so a step that trains nothing does not read like one that does.
    """
    width = 24
    filled = int(round(min(1.0, r.step / max(steps, 1)) * width))
    m = r.metrics
    grad = f"{m['grad_norm']:7.4f}" if "grad_norm" in m else "      -"
    trained = f"{int(m.get('transitions_trained', 0))}/{r.transitions}"
    groups = f"{int(m.get('flat_groups', 0))}/{int(m.get('groups', 0))}"
    line = (f"step {r.step:>4}/{steps} [{'#' * filled}{'.' * (width - filled)}] reward {r.reward:6.3f} "
            f"loss {m.get('loss', 0.0):7.4f} grad {grad} trained {trained} transitions, {groups} groups "
            f"without spread {r.rollouts_per_s:5.1f} rollouts/s {elapsed:5.0f} s")
    policies = sorted({k.split("/")[1] for k in m if k.startswith("policy/") and k.count("/") == 2})
    for name in policies:  # several policies: each one's own reward and update
        p = f"policy/{name}/"
        line += (f" | {name}: reward {m.get(p + 'reward', 0.0):.3f} loss {m.get(p + 'loss', 0.0):.4f} "
                 f"kl {m.get(p + 'approx_kl', 0.0):.4f} ratio {m.get(p + 'ratio_mean', 1.0):.3f}"
                 f"{'' if m.get(p + 'rows') else ' (no step)'}")
    return line


class _Progress:
    """One line per step (redrawn in place on a terminal): :func:`step_line`."""

    def __init__(self, steps: int, *, enabled: bool) -> None:
        self.steps = steps
        self.enabled = enabled
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty() and not os.environ.get("CI")

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr, flush=True)

    def update(self, r: Any) -> None:
        if not self.enabled:
            return
        line = step_line(r, self.steps, time.monotonic() - self.started)
        print(line, end="\r" if self.tty else "\n", file=sys.stderr, flush=True)

    def validation(self, v: Any) -> None:
        if self.enabled:
            if self.tty:
                print(file=sys.stderr)
            print(f"validation at step {v.step}: reward {v.reward:6.3f} over {v.rollouts} rollouts "
                  f"({v.failed_rollouts} failed), {v.rollout_s:.1f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
