"""verl, for everything beyond one machine: agl's rows as verl's ``DataProto``.

:func:`to_data_proto` turns :class:`~agl_trainer.rows.Row` s into the batch verl's
PPO/GRPO trainer takes after its rollout stage (the keys its agent loop produces):

- ``prompts`` ``(B, P)``: the first call's prompt, **left**-padded;
- ``responses`` ``(B, R)``: everything after it, **right**-padded: the responses and,
  in trajectory rows, the tool/environment tokens between them;
- ``response_mask`` ``(B, R)``: 1 on the tokens the policy sampled, 0 on tool tokens and padding;
- ``input_ids``, ``attention_mask``, ``position_ids`` ``(B, P + R)``;
- ``rollout_log_probs`` ``(B, R)``: the sampling policy's logprobs, as the gateway recorded them
  (verl's "bypass" mode uses them as the old policy's);
- ``token_level_scores`` ``(B, R)``: the credited reward of the row's first call (the one the
  ``TransitionBuilder`` assigned over the whole run; in transition rows each call's own) on the
  row's last response token, so verl's own estimators (``grpo``, ``rloo``, ...) can run;
- ``advantages`` ``(B, R)``: agl's per-rollout group advantages (LightningRL), for a trainer that
  keeps them instead of re-estimating;
- ``token_weights`` ``(B, R)``: each loss token's share of its rollout's unit of loss weight,
  divided by the rollouts of its mini-batch (0 on padding): what agl's per-rollout loss
  (:mod:`agl_trainer.verl_loss`) sums with, so verl weighs each rollout as the torch backend does;
- non-tensor ``uid`` (the task group), ``rollout_id``; ``meta_info["agl"]``: what was truncated,
  padded and laid out.

verl's GRPO treats each row as one sample of its group: with ``row_mode="transition"`` a
rollout of three calls is three samples there, the per-transition bias that
:mod:`agl_trainer.advantages` avoids. Use trajectory rows (one row per rollout when the
agent's calls extend each other) or keep agl's ``advantages``.

**The launch path** (``agl train`` with ``backend.name: verl``, :func:`launch`): verl's own
worker groups (FSDP actor, optional reference) and vLLM replicas on its Ray cluster, set up
as verl's ``main_ppo`` does, and one training loop in a Ray actor that reads as its stages:

1. **serve**: agl's server starts next to verl's rollout replicas, its gateway in front of
   every replica's OpenAI-compatible endpoint (:class:`~agl_trainer.replicas.ReplicaBackend`: a
   rollout's calls on one replica, rollouts on the least loaded; it records token ids and logprobs
   per call);
2. **roll out**: agl workers (Ray actors) run the unchanged agent against the gateway, one
   GRPO group of ``data.group_size`` rollouts per task;
3. **score, rows**: :func:`agl_trainer.training.score_batch`, the torch backend's own stage (the
   builder's whole-run credit, per-position group advantages, rows);
4. **DataProto**: :func:`to_data_proto`, whole rollouts per mini-batch of verl's, each filled up
   with loss-free rows (:func:`data_proto_fields` ``pad_to_multiple``, ``dp_size``);
5. **update**: the replicas sleep, verl recomputes the old logprobs at ``rollout.temperature`` (or,
   in its bypass mode, takes the gateway's: vLLM's ``processed_logprobs`` at the temperature the
   gateway pinned), the reference's with a KL loss, the advantages (agl's, or verl's estimator on
   ``token_level_rewards``), and updates the actor with agl's per-rollout loss
   (``policy_loss.loss_mode=agl_per_rollout``, :mod:`agl_trainer.verl_loss`); the ratio of
   verl's old logprobs to the gateway's is the step's ``ratio_first_*`` health metric;
6. **publish**: verl syncs the new weights into the replicas and wakes them, and agl's server
   moves its model version on.

:func:`verl_overrides` turns an ``agl train`` config into verl's Hydra overrides and
:func:`compose_verl_config` composes them with verl's own ``ppo_trainer`` config, so a
wrong key fails on a laptop, not on the cluster. docs/verl.md is the step-by-step recipe.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agl_trainer.rows import Row

if TYPE_CHECKING:
    from agl_trainer.config import Config
    from agl_trainer.train_cli import TrainOutcome

logger = logging.getLogger("agl.trainer")

__all__ = ["LOSS_MODE", "DataProtoStats", "RolloutStage", "batch_problems", "check_verl_config",
           "compose_verl_config", "data_proto_fields", "gateway_url", "launch", "sampler_agreement",
           "signal_problems", "step_config", "to_data_proto", "tool_call_overrides", "verl_gateway_config",
           "verl_overrides"]

LOSS_MODE = "agl_per_rollout"
"""agl's per-rollout policy loss in verl's registry (:mod:`agl_trainer.verl_loss`, which needs verl to import)."""

PAD_UID = "agl-pad"
"""The ``uid`` of the loss-free rows that fill a batch up to verl's mini-batch multiple."""


@dataclass
class DataProtoStats:
    """What fitting rows into ``(P, R)`` and verl's mini-batches cost."""

    rows: int = 0
    prompt_length: int = 0
    response_length: int = 0
    truncated_prompts: int = 0
    truncated_responses: int = 0
    dropped_loss_tokens: int = 0
    pad_rows: int = 0
    """Loss-free rows that fill each of verl's mini-batches up to ``pad_to_multiple`` rows."""
    mini_batches: int = 1
    split_rollouts: int = 0
    """Rollouts with more rows than a mini-batch holds, spread over several (each part weighs its share)."""
    no_rollout_logprobs: int = 0
    """Rows without the gateway's logprobs (not recorded, or recomputed after a prompt cut): zeros in
    ``rollout_log_probs``; verl recomputes its old logprobs, but its bypass mode would take these."""


def data_proto_fields(rows: Sequence[Row], *, pad_id: int = 0, max_prompt_length: int | None = None,
                      max_response_length: int | None = None, pad_to_multiple: int | None = None,
                      dp_size: int = 1) -> tuple[dict[str, Any], dict[str, Any], DataProtoStats]:
    """The tensors and non-tensor arrays of :func:`to_data_proto`, without verl (torch and numpy only).

    A prompt longer than ``max_prompt_length`` keeps its last tokens; a response part longer than
    ``max_response_length`` is cut at the end (its loss tokens beyond are counted as dropped).

    ``pad_to_multiple``: the rows of one of verl's mini-batches (``ppo_mini_batch_size x
    rollout.n``). The rows are laid out in mini-batches of that many rows that hold whole
    rollouts (a rollout with more rows than that is spread over several), each filled up with
    loss-free rows (a one-token prompt and response, ``response_mask`` 0, ``uid``
    ``agl-pad-<i>``), in the order verl's ``dp_size`` data-parallel ranks take them (each rank a
    contiguous chunk, each of its mini-batches a contiguous part of that). None: one mini-batch,
    no padding. ``token_weights`` are each row's weights divided by the rollouts of its
    mini-batch, so that summed (:mod:`agl_trainer.verl_loss`) every rollout weighs one unit of its
    mini-batch and padding weighs nothing, as in the torch backend.
    """
    import numpy as np
    import torch

    if not rows:
        raise ValueError("no rows: nothing to put in a DataProto")
    if pad_to_multiple is not None and (isinstance(pad_to_multiple, bool) or pad_to_multiple < 1):
        raise ValueError(f"pad_to_multiple must be a positive integer, got {pad_to_multiple!r}")
    if dp_size < 1 or (pad_to_multiple is not None and pad_to_multiple % dp_size):
        raise ValueError(f"pad_to_multiple ({pad_to_multiple}) must be a multiple of dp_size ({dp_size}): verl gives "
                         "each data-parallel rank an equal part of every mini-batch")
    stats = DataProtoStats()
    rows, scales = _laid_out(list(rows), pad_to_multiple, dp_size, pad_id, stats)
    stats.rows = len(rows)
    prompts = [r.input_ids[:r.prompt_len] for r in rows]
    P = max(len(p) for p in prompts)
    R = max(len(r.input_ids) - r.prompt_len for r in rows)
    if max_prompt_length is not None and P > max_prompt_length:
        P = max_prompt_length
    if max_response_length is not None and R > max_response_length:
        R = max_response_length
    B = len(rows)
    t_prompts = torch.full((B, P), pad_id, dtype=torch.long)
    t_prompt_mask = torch.zeros((B, P), dtype=torch.long)
    t_responses = torch.full((B, R), pad_id, dtype=torch.long)
    t_response_attn = torch.zeros((B, R), dtype=torch.long)
    t_mask = torch.zeros((B, R), dtype=torch.long)
    t_logprobs = torch.zeros((B, R), dtype=torch.float32)
    t_scores = torch.zeros((B, R), dtype=torch.float32)
    t_adv = torch.zeros((B, R), dtype=torch.float32)
    t_weights = torch.zeros((B, R), dtype=torch.float32)
    for i, r in enumerate(rows):
        prompt = prompts[i]
        cut = len(prompt) > P
        if cut:
            prompt = prompt[-P:]
            stats.truncated_prompts += 1
        t_prompts[i, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        t_prompt_mask[i, P - len(prompt):] = 1
        start = r.prompt_len
        ids = r.input_ids[start:]
        mask = r.loss_mask[start:]
        if len(ids) > R:
            stats.truncated_responses += 1
            stats.dropped_loss_tokens += sum(mask[R:])
        n = min(len(ids), R)
        if n == 0:
            continue
        t_responses[i, :n] = torch.tensor(ids[:n], dtype=torch.long)
        t_response_attn[i, :n] = 1
        t_mask[i, :n] = torch.tensor(mask[:n], dtype=torch.long)
        if r.old_logprobs is not None and not cut:  # a cut prompt: the gateway's logprobs saw what was cut
            t_logprobs[i, :n] = torch.tensor(r.old_logprobs[start:start + n], dtype=torch.float32)
        elif any(mask):
            stats.no_rollout_logprobs += 1
        t_adv[i, :n] = torch.tensor(r.advantages[start:start + n], dtype=torch.float32)
        t_weights[i, :n] = torch.tensor(r.token_weights[start:start + n], dtype=torch.float32) * scales[i]
        last = max((k for k in range(n) if mask[k]), default=None)
        if last is not None:
            t_scores[i, last] = r.reward
    attention = torch.cat([t_prompt_mask, t_response_attn], dim=1)
    tensors = {
        "prompts": t_prompts,
        "responses": t_responses,
        "response_mask": t_mask,
        "input_ids": torch.cat([t_prompts, t_responses], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "rollout_log_probs": t_logprobs,
        "token_level_scores": t_scores,
        "advantages": t_adv,
        "token_weights": t_weights,
    }
    non_tensors = {"uid": np.array([r.group for r in rows], dtype=object),
                   "rollout_id": np.array([r.rollout_id for r in rows], dtype=object)}
    stats.prompt_length, stats.response_length = P, R
    return tensors, non_tensors, stats


def _laid_out(rows: list[Row], mini: int | None, dp_size: int, pad_id: int, stats: DataProtoStats
              ) -> tuple[list[Row], list[float]]:
    """``rows`` in verl's mini-batch and rank order, padded, with each row's ``1 / rollouts`` of its mini-batch."""
    if mini is None:
        total = sum(sum(r.token_weights) for r in rows) or 1.0
        return rows, [1.0 / total] * len(rows)
    rollouts: dict[str, list[Row]] = {}
    for r in rows:
        rollouts.setdefault(r.rollout_id, []).append(r)
    batches: list[list[Row]] = [[]]
    for own in rollouts.values():
        if len(batches[-1]) + len(own) > mini and batches[-1]:
            batches.append([])
        if len(own) > mini:
            stats.split_rollouts += 1
        for r in own:
            if len(batches[-1]) == mini:
                batches.append([])
            batches[-1].append(r)
    out: list[list[tuple[Row, float]]] = []
    for batch in batches:
        total = sum(sum(r.token_weights) for r in batch) or 1.0
        filled = [(r, 1.0 / total) for r in batch]
        while len(filled) < mini:
            filled.append((Row(rollout_id="", group=f"{PAD_UID}-{stats.pad_rows}", input_ids=[pad_id, pad_id],
                               loss_mask=[0, 0], advantages=[0.0, 0.0], token_weights=[0.0, 0.0],
                               old_logprobs=[0.0, 0.0], prompt_len=1), 0.0))
            stats.pad_rows += 1
        out.append(filled)
    stats.mini_batches = len(out)
    share = mini // dp_size
    ordered = [item for rank in range(dp_size) for batch in out for item in batch[rank * share:(rank + 1) * share]]
    return [r for r, _ in ordered], [scale for _, scale in ordered]


def to_data_proto(rows: Sequence[Row], *, pad_id: int = 0, max_prompt_length: int | None = None,
                  max_response_length: int | None = None, meta_info: dict[str, Any] | None = None,
                  pad_to_multiple: int | None = None, dp_size: int = 1) -> Any:
    """verl's ``DataProto`` of ``rows`` (see the module docstring for its keys). Needs ``verl``."""
    from verl import DataProto

    tensors, non_tensors, stats = data_proto_fields(rows, pad_id=pad_id, max_prompt_length=max_prompt_length,
                                                    max_response_length=max_response_length,
                                                    pad_to_multiple=pad_to_multiple, dp_size=dp_size)
    meta = dict(meta_info or {})
    meta["agl"] = dict(stats.__dict__)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


# ---------------------------------------------------------------------- verl's config from agl's


def verl_overrides(config: Config) -> list[str]:
    """verl's Hydra overrides (for its ``ppo_trainer`` config) that say what ``config`` says; its own last."""
    b, v, a = config.backend, config.backend.verl, config.algorithm

    def flag(value: bool) -> str:
        return "true" if value else "false"

    log_prob_micro = v.log_prob_micro_batch_size_per_gpu or v.ppo_micro_batch_size_per_gpu

    out = [
        f"actor_rollout_ref.model.path={b.model}",
        f"actor_rollout_ref.rollout.name={v.rollout_engine}",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={config.data.group_size}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={v.tensor_parallel_size}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={v.gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.temperature={a.temperature if a.temperature is not None else 1.0}",
        # the replicas report the logprobs of the distribution they sampled from (the gateway's recorded ones)
        "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs",
        f"actor_rollout_ref.actor.optim.lr={a.lr}",
        f"actor_rollout_ref.actor.optim.weight_decay={a.weight_decay}",
        f"actor_rollout_ref.actor.clip_ratio_low={a.clip_epsilon}",
        f"actor_rollout_ref.actor.clip_ratio_high={a.clip_epsilon_high or a.clip_epsilon}",
        f"actor_rollout_ref.actor.use_kl_loss={flag(a.kl_coef > 0)}",
        f"actor_rollout_ref.actor.kl_loss_coef={a.kl_coef}",
        f"actor_rollout_ref.actor.ppo_epochs={b.epochs}",
        # a mini-batch holds at most the step's tasks: verl refuses one larger than its train_batch_size
        f"actor_rollout_ref.actor.ppo_mini_batch_size={min(v.ppo_mini_batch_size, config.data.tasks_per_step)}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={v.ppo_micro_batch_size_per_gpu}",
        # the old and the reference logprobs: verl's validate_config wants a micro-batch for each
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={log_prob_micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={log_prob_micro}",
        # each rollout one unit of loss however many rows it has, padding none (agl_trainer.verl_loss); verl's
        # own KL and entropy terms are token means; mini-batches keep the order data_proto_fields laid out
        f"actor_rollout_ref.actor.policy_loss.loss_mode={LOSS_MODE}",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.shuffle=false",
        f"algorithm.adv_estimator={'grpo' if v.advantages == 'agl' else v.advantages}",
        f"algorithm.norm_adv_by_std_in_grpo={flag(a.scale_advantages)}",
        f"data.train_batch_size={config.data.tasks_per_step}",
        f"data.max_prompt_length={a.max_prompt_length or 4096}",
        f"data.max_response_length={a.max_response_length or 4096}",
        f"trainer.nnodes={v.nnodes}",
        f"trainer.n_gpus_per_node={v.n_gpus_per_node}",
        f"trainer.total_training_steps={config.run.steps}",
        f"trainer.save_freq={config.run.checkpoint_every}",
        f"trainer.default_local_dir={os.path.join(config.path(config.run.dir), 'verl')}",
        "trainer.val_before_train=false",
        "trainer.use_v1=false",
        "trainer.logger=[console]",
    ]
    if a.max_grad_norm is not None:
        out.append(f"actor_rollout_ref.actor.grad_clip={a.max_grad_norm}")
    if b.lora is not None:
        out += [f"actor_rollout_ref.model.lora_rank={b.lora.r}", f"actor_rollout_ref.model.lora_alpha={b.lora.alpha}",
                f"actor_rollout_ref.model.target_modules=[{','.join(b.lora.target_modules)}]"]
    return out + tool_call_overrides(v) + list(v.overrides)


def tool_call_overrides(v: Any) -> list[str]:
    """The replicas' tool-call parsing, as verl passes ``rollout.engine_kwargs.<engine>`` to the engine's server.

    Without it vLLM answers an agent's ``tools`` with the calls left as text in ``content`` (or a 400
    for ``tool_choice: auto``): its OpenAI server parses tool calls only when started with
    ``--enable-auto-tool-choice --tool-call-parser NAME``. SGLang needs the parser alone.
    """
    if v.tool_call_parser is None:
        return []
    kwargs = f"++actor_rollout_ref.rollout.engine_kwargs.{v.rollout_engine}"
    out = [f"{kwargs}.tool_call_parser={v.tool_call_parser}"]
    if v.rollout_engine == "vllm":
        out.insert(0, f"{kwargs}.enable_auto_tool_choice=true")
    return out


def signal_problems(verl_cfg: Any, config: Config) -> list[str]:
    """What in verl's composed config (``backend.verl.overrides`` included) would train on another signal than agl's.

    The sampling temperature must be the one the gateway pins (verl computes its logprobs at
    ``rollout.temperature``), the replicas must report the logprobs they sampled with, and the
    mini-batches must keep the layout :func:`data_proto_fields` made for the per-rollout loss.
    """
    rollout, actor = verl_cfg.actor_rollout_ref.rollout, verl_cfg.actor_rollout_ref.actor
    out = []
    if float(rollout.temperature) != float(config.algorithm.temperature or 1.0):
        out.append(f"actor_rollout_ref.rollout.temperature={rollout.temperature} differs from algorithm.temperature "
                   f"{config.algorithm.temperature}: verl would compute its logprobs at another temperature than the "
                   "gateway samples at; set algorithm.temperature instead")
    if rollout.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
        out.append(f"actor_rollout_ref.rollout.logprobs_mode={rollout.logprobs_mode}: the recorded logprobs would not "
                   "be of the distribution sampled from; leave it at processed_logprobs")
    if actor.policy_loss.loss_mode != LOSS_MODE:
        out.append(f"actor_rollout_ref.actor.policy_loss.loss_mode={actor.policy_loss.loss_mode}: verl's own losses "
                   f"weigh rows and count padding, not one unit per rollout; leave it at {LOSS_MODE}")
    if actor.shuffle:
        out.append("actor_rollout_ref.actor.shuffle=true would mix the mini-batches agl lays out whole rollouts in; "
                   "leave it false")
    return out


def batch_problems(verl_cfg: Any) -> list[str]:
    """What in verl's batch sizes the first update would stop on after the cluster started (verl checks it late).

    Each of verl's mini-batches (``ppo_mini_batch_size x rollout.n`` rows, as :func:`data_proto_fields`
    lays them out) is split evenly over its data-parallel ranks.
    """
    actor, rollout, trainer = verl_cfg.actor_rollout_ref.actor, verl_cfg.actor_rollout_ref.rollout, verl_cfg.trainer
    gpus = int(trainer.nnodes) * int(trainer.n_gpus_per_node)
    dp_size = max(1, gpus // int(actor.get("ulysses_sequence_parallel_size", 1) or 1))
    rows = int(actor.ppo_mini_batch_size) * int(rollout.n)
    if rows % dp_size:
        return [f"a mini-batch of {actor.ppo_mini_batch_size} tasks x {rollout.n} rollouts is {rows} rows, which "
                f"{dp_size} data-parallel GPUs cannot share evenly; make backend.verl.ppo_mini_batch_size x "
                "data.group_size a multiple of nnodes x n_gpus_per_node"]
    return []


def check_verl_config(config: Config) -> Any:
    """verl's composed config of ``config``, checked as verl's own trainer checks it; :class:`ConfigError` if not.

    Hydra's compose (a key verl lacks), :func:`signal_problems`, :func:`batch_problems`, then verl's own
    ``validate_config`` (batch and micro-batch sizes of the actor, rollout and reference): what verl would
    refuse inside its Ray actor after the cluster started fails here, on any machine with verl. Needs verl.
    """
    import importlib.util

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from agl_trainer.config import ConfigError

    try:
        verl_cfg = compose_verl_config(verl_overrides(config))
    except Exception as exc:  # noqa: BLE001 - Hydra's errors name verl's key; say which agl key carried it
        raise ConfigError("backend.verl.overrides", f"verl's config refused it: {exc}") from None
    for key, problems in (("backend.verl.overrides", signal_problems(verl_cfg, config)),
                          ("backend.verl", batch_problems(verl_cfg))):
        if problems:
            raise ConfigError(key, "; ".join(problems))
    if config.backend.lora is not None and config.backend.verl.rollout_engine == "vllm" \
            and importlib.util.find_spec("vllm") is None:
        # verl's check rounds the rank up to one vLLM supports, importing vLLM's rollout package to ask
        raise ConfigError("backend.lora", "verl checks the LoRA rank against the vLLM it runs, and vllm is not "
                          "installed here: check this config where verl's vLLM is (the cluster)")
    try:
        validate_config(config=verl_cfg, use_reference_policy=need_reference_policy(verl_cfg),
                        use_critic=need_critic(verl_cfg))
    except (AssertionError, ValueError) as exc:
        raise ConfigError("backend.verl", f"verl's validate_config refused it: {exc}") from None
    return verl_cfg


def step_config(config: Config) -> Any:
    """The :class:`~agl_trainer.training.TrainConfig` of the score and rows stages, as the torch backend's."""
    from agl_trainer.training import TrainConfig

    a = config.algorithm
    # credit=None: the builder credited every call of the run; the loop takes its credited rewards as they are
    return TrainConfig(tasks_per_step=config.data.tasks_per_step, group_size=config.data.group_size, credit=None,
                       gamma=config.credit.gamma, scale_advantages=a.scale_advantages, row_mode=a.row_mode,
                       max_prompt_length=a.max_prompt_length, max_response_length=a.max_response_length)


def verl_gateway_config(config: Config) -> Any:
    """agl's gateway in front of verl's replicas: every call sampled at ``algorithm.temperature``, as verl trains."""
    from agl_trainer.gateway import GatewayConfig, training_sampling

    return GatewayConfig(sampling_overrides=training_sampling(float(config.algorithm.temperature or 1.0)))


def gateway_url(config: Config, port: int) -> str:
    """The URL agl's workers, Ray actors on any node, reach the gateway at: ``backend.verl.gateway_host``,
    else Ray's address of this node (the one other nodes' raylets reach it by).

    The host name's own address is not it: many hosts map their name to 127.0.0.1 in
    ``/etc/hosts``. A loopback address on a cluster of more than one node is a :class:`ConfigError`
    before any worker starts (the workers elsewhere would fail every call). Needs Ray.
    """
    import ipaddress

    import ray.util

    from agl_trainer.config import ConfigError

    host = config.backend.verl.gateway_host or ray.util.get_node_ip_address()
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: loopback when it is localhost's
        loopback = host == "localhost"
    if loopback and config.backend.verl.nnodes > 1:
        raise ConfigError("backend.verl.gateway_host",
                          f"the gateway's address {host} is this machine's loopback, which the workers on the other "
                          f"{config.backend.verl.nnodes - 1} node(s) cannot reach; set it to an address they can")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def compose_verl_config(overrides: Sequence[str]) -> Any:
    """verl's ``ppo_trainer`` config with ``overrides`` (Hydra's compose: an unknown key fails here). Needs verl."""
    import verl.trainer.config as verl_config
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    folder = os.path.dirname(os.path.abspath(verl_config.__file__))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=folder, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


# ---------------------------------------------------------------------- the launch path


def launch(config: Config) -> TrainOutcome:
    """``agl train`` with ``backend.name: verl``: the loop in the module docstring, on verl's Ray cluster.

    Needs verl (with vLLM or SGLang) and GPUs. Runs the loop in a Ray actor (:func:`_run_in_ray`) and
    returns what it did. What it cannot know on this machine (no GPU, a key verl lacks) fails before
    Ray starts.
    """
    from agl_trainer.config import ConfigError, load_tasks
    from agl_trainer.train_cli import TrainOutcome

    try:
        import ray

        import verl  # noqa: F401
    except ImportError as exc:
        raise ConfigError("backend.name", f"verl needs the verl and ray packages on this machine ({exc}); "
                                          "see docs/verl.md") from None
    verl_cfg = check_verl_config(config)
    tasks = load_tasks(config)
    started = time.monotonic()
    if not ray.is_initialized():
        # verl's workers import agl's per-rollout loss as they start: its registry is per process
        ray.init(address=config.backend.verl.ray_address,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"},
                              "worker_process_setup_hook": "agl_trainer.verl_loss.register"})
    runner: Any = ray.remote(num_cpus=1)(_VerlRunner).remote()
    steps = ray.get(runner.run.remote(config.model_dump(mode="json"), config.base_dir, verl_cfg, tasks))
    folder = config.path(config.run.dir)
    return TrainOutcome(steps=steps, folder=folder, resumed=False, wall_s=time.monotonic() - started,
                        server_url="", files={"curves": folder})


class _VerlRunner:
    """The training loop as a Ray actor (verl's worker groups are driven from one actor, as its TaskRunner does)."""

    def run(self, agl: dict[str, Any], base_dir: str, verl_cfg: Any, tasks: list[Any]) -> list[dict[str, Any]]:
        from omegaconf import OmegaConf

        from agl_trainer.config import validate

        config = validate(agl, base_dir=base_dir)
        OmegaConf.resolve(verl_cfg)
        trainer = _build_verl_trainer(verl_cfg)
        trainer.init_workers()
        return _fit(trainer, config, verl_cfg, tasks)


def _build_verl_trainer(verl_cfg: Any) -> Any:
    """verl's ``RayPPOTrainer`` set up as verl's ``main_ppo_v0.TaskRunner.run`` does, with no data set of its own."""
    from verl.trainer.main_ppo_v0 import BaseTaskRunner
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.dataset.rl_dataset import collate_fn

    setup = BaseTaskRunner()  # the worker-group set-up of verl's TaskRunner, without its Ray actor
    actor_rollout_cls, worker_group_cls = setup.add_actor_rollout_worker(verl_cfg)
    setup.add_critic_worker(verl_cfg)
    setup.add_reward_model_resource_pool(verl_cfg)
    setup.add_teacher_model_resource_pool(verl_cfg)
    setup.add_ref_policy_worker(verl_cfg, actor_rollout_cls)
    validate_config(config=verl_cfg, use_reference_policy=need_reference_policy(verl_cfg),
                    use_critic=need_critic(verl_cfg))
    model_config = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.model)
    placeholder = _Placeholder(verl_cfg.data.train_batch_size)  # the tasks come from agl's queue, not verl's loader
    return RayPPOTrainer(config=verl_cfg, tokenizer=model_config.tokenizer, processor=model_config.processor,
                         role_worker_mapping=setup.role_worker_mapping,
                         resource_pool_manager=setup.init_resource_pool_mgr(verl_cfg),
                         ray_worker_group_cls=worker_group_cls, train_dataset=placeholder, val_dataset=placeholder,
                         collate_fn=collate_fn, train_sampler=None)


class _Placeholder:
    """A data set of ``n`` empty items: verl sizes its loader from one; agl's loop never reads it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {}


class RolloutStage:
    """Stage 2, roll out: one GRPO group of ``group_size`` rollouts per task of the step, on agl's task queue.

    Task ids carry this run's id (``{run_id}-s{step}-t{j}``), new for every ``agl train``: the
    queue keeps every id it was given, so a rerun or a resume over the same ``server.db`` (whose
    steps start again at 1, or at verl's checkpoint) enqueues ids of its own.
    """

    def __init__(self, link: Any, tasks: Sequence[Any], *, tasks_per_step: int, group_size: int, max_attempts: int,
                 timeout_s: float, run_id: str | None = None, poll_s: float = 0.1) -> None:
        import uuid

        if not tasks:
            raise ValueError("tasks is empty: nothing to roll out")
        self.link = link
        self.tasks = list(tasks)
        self.tasks_per_step = tasks_per_step
        self.group_size = group_size
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.poll_s = poll_s

    def task_ids(self, step: int) -> list[str]:
        return [f"{self.run_id}-s{step}-t{j}" for j in range(self.tasks_per_step)]

    def step(self, step: int) -> tuple[list[Any], list[str], int]:
        """Step ``step``'s (from 1) trajectories, the errors of the rollouts whose agent raised, the failed tasks."""
        j0 = (step - 1) * self.tasks_per_step
        batch = [self.tasks[(j0 + j) % len(self.tasks)] for j in range(self.tasks_per_step)]
        ids = self.link.enqueue(batch, self.task_ids(step), repeat=self.group_size, max_attempts=self.max_attempts)
        pending, done = list(ids), []
        deadline = time.monotonic() + self.timeout_s
        while pending:
            finished = self.link.finished(pending)
            done += [r for r in finished.values() if r]
            pending = [t for t in pending if t not in finished]
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} rollouts of step {step} did not finish within "
                                       f"{self.timeout_s:g} s: are the workers running?")
                time.sleep(self.poll_s)
        trajectories, errors = self.link.trajectories(done)
        return trajectories, errors, len(ids) - len(done)


def sampler_agreement(trainer_logp: Any, sampler_logp: Any, mask: Any, *, recorded: Any = None) -> dict[str, float]:
    """``ratio_first_mean``/``_min``/``_max`` and ``sampler_kl`` of verl's old logprobs against the gateway's.

    Both are of the policy before the update, so the ratio is 1 up to numerics when sampler and
    trainer compute the same distribution; ``recorded`` leaves out tokens without a recorded logprob.
    """
    from agl_trainer.loss import policy_loss

    keep = mask.bool() if recorded is None else mask.bool() & recorded.bool()
    if not bool(keep.any()):
        return {}
    parts = policy_loss(trainer_logp.float(), sampler_logp.float(), trainer_logp.new_zeros(trainer_logp.shape).float(),
                        keep.float(), rollouts=1.0)
    return {"ratio_first_mean": parts.ratio_mean, "ratio_first_min": parts.ratio_min,
            "ratio_first_max": parts.ratio_max, "sampler_kl": parts.sampler_kl}


def _fit(trainer: Any, config: Config, verl_cfg: Any, tasks: list[Any]) -> list[dict[str, Any]]:
    """The stages of the module docstring, once per step; returns each step's numbers."""
    import threading

    import torch
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from agl_core.worker import run_on_ray
    from agl_trainer.config import code_builder, transition_builder
    from agl_trainer.gateway import OpenAIBackend
    from agl_trainer.replicas import ReplicaBackend
    from agl_trainer.server import ServerConfig, ServerThread, TrainerServer
    from agl_trainer.signal_health import nothing_trained, signal_warnings, warning_flags
    from agl_trainer.training import LocalServer, StepResult, score_batch, write_curves

    # 1. serve: agl's gateway in front of every rollout replica verl started, a rollout's calls on one
    addresses = trainer.llm_server_manager.get_addresses()
    logger.info("agl train: the gateway spreads the rollouts over %d replica(s): %s", len(addresses),
                ", ".join(addresses))
    token = config.server.token or os.environ.get("AGL_TOKEN") or os.urandom(16).hex()
    host = "0.0.0.0"  # the workers run on other nodes: reachable beyond this one, so always with a token
    folder = config.path(config.run.dir)
    os.makedirs(folder, exist_ok=True)
    builder = transition_builder(config, code_builder(config))  # the code's and the config's: one, or an error
    server = TrainerServer(ServerConfig(db_path=config.path(config.server.db), host=host, port=config.server.port,
                                        token=token, builder=builder, max_attempts=config.server.max_attempts,
                                        gateway=verl_gateway_config(config)),
                           ReplicaBackend([OpenAIBackend(f"http://{address}/v1") for address in addresses]))
    thread = ServerThread(server).start()
    url = gateway_url(config, int(thread.url.rsplit(":", 1)[1]))
    link = LocalServer(server, engine=None)
    rollouts = RolloutStage(link, tasks, tasks_per_step=config.data.tasks_per_step, group_size=config.data.group_size,
                            max_attempts=config.server.max_attempts, timeout_s=config.run.step_timeout_s)
    # 2. the agent's workers, as Ray actors on the cluster
    threading.Thread(target=run_on_ray, args=("auto", url, config.agent), daemon=True,
                     kwargs={"actors": config.workers.count, "token": token, "actor_cpus": config.workers.actor_cpus,
                             "poll_s": 1.0}).start()
    a = config.algorithm
    n = config.data.group_size
    mini = verl_cfg.actor_rollout_ref.actor.ppo_mini_batch_size * n
    dp_size = max(1, trainer.actor_rollout_wg.world_size
                  // int(verl_cfg.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1))
    step_cfg = step_config(config)
    history: list[StepResult] = []
    trainer.global_steps = 0
    if config.run.resume:
        trainer._load_checkpoint()  # verl's own resume (trainer.resume_mode): sets global_steps
    first = trainer.global_steps + 1
    trainer.checkpoint_manager.update_weights(trainer.global_steps)  # wake the replicas with these weights
    try:
        for step in range(first, config.run.steps + 1):
            trainer.global_steps = step
            started = time.perf_counter()
            trajectories, errors, failed_tasks = rollouts.step(step)
            collected = time.perf_counter()
            # 3. score, rows: the torch backend's stage, on the builder's whole-run credit
            scored = score_batch(trajectories, step_cfg)
            adv_stats, rows, row_stats = scored.advantage_stats, scored.rows, scored.row_stats
            idle = nothing_trained(trajectories, row_stats, adv_stats)
            if idle:  # nothing selected, or nothing to train on (no token ids): said loudly
                logger.warning("agl train: step %d: %s", step, idle)
            if not rows:  # the step still counts
                if not idle:
                    logger.warning("agl train: step %d has no rows to train on (%d rollouts)", step,
                                   len(trajectories))
                server.model.set(max(step, server.model.version + 1), None)
                continue
            # 4. DataProto: whole rollouts per mini-batch of verl's, in its ranks' order
            trainer.checkpoint_manager.sleep_replicas()
            batch = to_data_proto(rows, pad_id=trainer.tokenizer.pad_token_id or 0, pad_to_multiple=mini,
                                  dp_size=dp_size, max_prompt_length=a.max_prompt_length,
                                  max_response_length=a.max_response_length)
            batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
            batch.meta_info["temperature"] = verl_cfg.actor_rollout_ref.rollout.temperature
            # 5. update
            old, _ = trainer._compute_old_log_prob(batch)
            old.batch.pop("entropys")
            batch = batch.union(old)
            health = sampler_agreement(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"],
                                       batch.batch["response_mask"], recorded=batch.batch["rollout_log_probs"] != 0)
            batch.batch["rollout_is_weights"] = batch.batch["token_weights"]  # agl_per_rollout's weights
            if trainer.use_reference_policy:
                batch = batch.union(trainer._compute_ref_log_prob(batch))
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            if config.backend.verl.advantages == "agl":
                batch.batch["returns"] = batch.batch["advantages"]
            else:
                batch = compute_advantage(batch, adv_estimator=verl_cfg.algorithm.adv_estimator,
                                          gamma=verl_cfg.algorithm.gamma, lam=verl_cfg.algorithm.lam, num_repeat=n,
                                          norm_adv_by_std_in_grpo=a.scale_advantages, config=verl_cfg.algorithm)
            output = trainer._update_actor(batch)
            # 6. publish
            trainer.checkpoint_manager.update_weights(step)
            server.model.set(max(step, server.model.version + 1), None)
            metrics = {k: float(v) for k, v in output.meta_info["metrics"].items()
                       if isinstance(v, int | float)}
            rollout_s = collected - started
            result = StepResult(step=step, reward=adv_stats.mean_return, final_reward=adv_stats.mean_return,
                                rollouts=len(trajectories), failed_rollouts=len(errors),
                                failed_tasks=failed_tasks,
                                transitions=row_stats.transitions, rows=row_stats.rows, merged=row_stats.merged,
                                prefix_mismatches=row_stats.prefix_mismatches, rollout_s=rollout_s,
                                update_s=time.perf_counter() - collected,
                                rollouts_per_s=len(trajectories) / rollout_s if rollout_s > 0 else 0.0, version=step,
                                time=time.time(), truncated_rows=row_stats.truncated_rows,
                                metrics={"loss": metrics.get("actor/pg_loss", 0.0), **metrics, **health,
                                         **scored.signal()})
            result.warnings = signal_warnings(result.metrics)
            result.metrics.update(warning_flags(result.metrics))
            for line in result.warnings:
                logger.warning("agl train: step %d: %s", step, line)
            history.append(result)
            server.record_metrics(step, result.values())
            write_curves(folder, history)
            if config.run.checkpoint_every and step % config.run.checkpoint_every == 0:
                trainer._save_checkpoint()
    finally:
        thread.stop()
    return [r.to_dict() for r in history]
