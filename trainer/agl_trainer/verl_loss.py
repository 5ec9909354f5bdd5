"""agl's per-rollout policy loss inside verl: each rollout weighs one unit, as in the torch backend.

verl's own loss aggregations weigh tokens or rows: ``seq-mean-token-mean`` gives every row
``1 / global_batch_size``, so a rollout split into three rows (its calls did not extend each
other) weighs three times one kept in one row (0.75 against 0.25), and the loss-free rows that
fill a mini-batch take a share of the denominator. This module registers ``agl_per_rollout``
with verl's policy-loss registry (``actor_rollout_ref.actor.policy_loss.loss_mode``, which
:func:`agl_trainer.verl_backend.verl_overrides` sets): PPO-clip computed by agl's own
:func:`agl_trainer.loss.policy_loss` and summed with agl's per-token weights.

The weights travel in the batch as ``rollout_is_weights``, the one per-token field verl's
actor hands a policy loss besides the advantages (agl's ``_fit`` fills it from the
DataProto's ``token_weights``). :func:`agl_trainer.verl_backend.data_proto_fields` lays the
rows out so that each of verl's mini-batches holds whole rollouts and divides each rollout's
unit by the rollouts of its mini-batch, so the sum here, times verl's data-parallel size
(FSDP averages the ranks' gradients), is exactly the torch backend's loss for the same part:
``sum(weight * pg) / rollouts``. verl adds its own KL and entropy terms (``use_kl_loss``,
``entropy_coeff``) with ``loss_agg_mode`` (agl sets ``token-mean``).

Importing this module needs verl; verl's worker processes import it through Ray's
``worker_process_setup_hook`` (:func:`register`), set by the launch path.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.core_algos import register_policy_loss

from agl_trainer.loss import policy_loss

__all__ = ["LOSS_MODE", "per_rollout_policy_loss", "register"]

LOSS_MODE = "agl_per_rollout"


@register_policy_loss(LOSS_MODE)
def per_rollout_policy_loss(old_log_prob: Any, log_prob: Any, advantages: Any, response_mask: Any,
                            loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_is_weights: Any = None) -> tuple[Any, dict[str, Any]]:
    """verl's policy-loss signature; ``rollout_is_weights`` holds agl's per-token weights (see the module)."""
    if rollout_is_weights is None:
        raise ValueError(f"loss_mode {LOSS_MODE} needs agl's per-token weights in the batch as rollout_is_weights "
                         "(agl_trainer.verl_backend.to_data_proto's token_weights); none came")
    if config is None:
        raise ValueError(f"loss_mode {LOSS_MODE} needs the actor's config (clip ratios, global batch info)")
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    weights = rollout_is_weights * response_mask.to(rollout_is_weights.dtype)
    parts = policy_loss(log_prob, old_log_prob, advantages, weights, rollouts=1.0, clip_low=low, clip_high=high)
    dp_size = (config.global_batch_info or {}).get("dp_size") or 1
    metrics = {"actor/pg_clipfrac": parts.clip_fraction, "actor/ppo_kl": parts.approx_kl,
               "actor/ratio_mean": parts.ratio_mean}
    return parts.loss * dp_size, metrics


def register() -> None:
    """Ray's ``worker_process_setup_hook``: importing this module registered the loss in this process."""
