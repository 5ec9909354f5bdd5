"""The policy loss: PPO-clip against the sampling policy's logprobs, with an optional KL term to a reference.

For each loss token, with ``r = exp(logp - old_logp)`` the importance ratio of the
policy being trained to the policy that sampled the token (the gateway recorded
``old_logp`` when the engine generated it):

    pg  = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
    kl  = exp(ref - logp) - (ref - logp) - 1          (k3, unbiased and >= 0)
    loss = sum(weight * (pg + kl_coef * kl)) / rollouts

``weight`` is the token's share of its rollout's unit weight (:mod:`agl_trainer.rows`),
so dividing by the number of rollouts averages over rollouts, not over tokens or calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LossParts", "policy_loss", "token_logprobs"]


@dataclass
class LossParts:
    """The loss and what it is made of (plain floats, for logs)."""

    loss: Any
    pg: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    approx_kl: float
    """Mean of ``old_logp - logp`` over loss tokens: how far the update moved from the sampling policy."""
    tokens: int = 0
    """Loss tokens the means are over."""
    ratio_min: float = 1.0
    ratio_max: float = 1.0
    sampler_kl: float = 0.0
    """Mean of ``r - 1 - log r`` over loss tokens (k3: an estimate of KL(sampler || policy), never negative)."""


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any, *, temperature: float = 1.0) -> Any:
    """``(B, L-1)``: the logprob of token ``p+1`` given tokens ``0..p``, for right-padded ``input_ids``.

    ``temperature``: the one the tokens were sampled at. The logprobs are those of
    ``softmax(logits / temperature)``, the distribution the engine sampled from and recorded
    (:mod:`agl_trainer.engine`), so the importance ratio compares like with like.
    """
    import torch.nn.functional as F

    if not temperature > 0:
        raise ValueError(f"temperature must be above 0 (a sampling temperature), got {temperature!r}")
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    targets = input_ids[:, 1:]
    flat = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    if temperature != 1.0:
        flat = flat / temperature
    return -F.cross_entropy(flat, targets.reshape(-1), reduction="none").view(targets.shape)


def policy_loss(
    logp: Any,
    old_logp: Any,
    advantages: Any,
    weights: Any,
    *,
    rollouts: float,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logp: Any = None,
    kl_coef: float = 0.0,
) -> LossParts:
    """PPO-clip (and KL) summed with ``weights`` and divided by ``rollouts``; tensors share one shape."""
    import torch

    mask = weights > 0
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    pg = -torch.minimum(unclipped, clipped)
    total = (weights * pg).sum()
    kl_value = 0.0
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        kl_sum = (weights * kl).sum()
        total = total + kl_coef * kl_sum
        kl_value = float(kl_sum.detach()) / rollouts
    tokens = int(mask.sum())
    n = max(tokens, 1)
    with torch.no_grad():
        clip_fraction = float(((unclipped != clipped) & mask).sum()) / n
        ratio_mean = float((ratio * mask).sum()) / n
        approx_kl = float(((old_logp - logp) * mask).sum()) / n
        log_ratio = (logp - old_logp).detach()
        sampler_kl = float(((torch.exp(log_ratio) - 1.0 - log_ratio) * mask).sum()) / n
        kept = ratio.detach()[mask]
        ratio_min = float(kept.min()) if tokens else 1.0
        ratio_max = float(kept.max()) if tokens else 1.0
    return LossParts(loss=total / rollouts, pg=float((weights * pg).sum().detach()) / rollouts, kl=kl_value,
                     clip_fraction=clip_fraction, ratio_mean=ratio_mean, approx_kl=approx_kl, tokens=tokens,
                     ratio_min=ratio_min, ratio_max=ratio_max, sampler_kl=sampler_kl)
