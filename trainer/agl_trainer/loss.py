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


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any, *, temperature: float = 1.0,
                   chunk_tokens: int = 512, with_entropy: bool = False) -> Any:
    """``(B, L-1)``: the logprob of token ``p+1`` given tokens ``0..p``, for right-padded ``input_ids``.

    ``temperature``: the one the tokens were sampled at. The logprobs are those of
    ``softmax(logits / temperature)``, the distribution the engine sampled from and recorded
    (:mod:`agl_trainer.engine`), so the importance ratio compares like with like.

    ``with_entropy``: also the entropy of that distribution at each position, ``(logp, entropy)``.

    **Memory**: no ``[tokens, vocab]`` tensor is ever whole. The decoder's hidden states are
    projected onto the vocabulary ``chunk_tokens`` positions at a time, in float32, and each
    chunk is recomputed in the backward pass (:func:`torch.utils.checkpoint.checkpoint`)
    rather than kept: the peak is one chunk's logits, ``chunk_tokens * vocab * 4`` bytes a
    few times over, whatever the batch. A model whose head is not a plain projection of its
    decoder's output (see :func:`_split_head`) is run whole and only its logits are chunked.
    """
    import torch

    if not temperature > 0:
        raise ValueError(f"temperature must be above 0 (a sampling temperature), got {temperature!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens!r}")
    split = _split_head(model)
    if split is not None:
        decoder, head = split
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    else:
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        head = None
    targets = input_ids[:, 1:]
    flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)

    def piece(h: Any, t: Any) -> tuple[Any, Any]:
        logits = (head(h) if head is not None else h).float()
        if temperature != 1.0:
            logits = logits / temperature
        logz = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, t[:, None]).squeeze(-1) - logz
        if not with_entropy:
            return logp, logp.new_zeros(())
        probs = torch.softmax(logits, dim=-1)
        return logp, logz - (probs * logits).sum(-1)

    grad = torch.is_grad_enabled() and flat.requires_grad
    logps, entropies = [], []
    for start in range(0, flat.shape[0], chunk_tokens):
        h, t = flat[start:start + chunk_tokens], flat_targets[start:start + chunk_tokens]
        lp, ent = torch.utils.checkpoint.checkpoint(piece, h, t, use_reentrant=False) if grad else piece(h, t)
        logps.append(lp)
        entropies.append(ent)
    logp = torch.cat(logps).view(targets.shape)
    if not with_entropy:
        return logp
    return logp, torch.cat(entropies).view(targets.shape)


def _split_head(model: Any) -> tuple[Any, Any] | None:
    """``(decoder, lm_head)`` of a causal LM whose logits are ``lm_head(decoder(...).last_hidden_state)``; else None.

    Models that scale or soft-cap their logits (Gemma 2's ``final_logit_softcapping``,
    Cohere's ``logit_scale``) are left whole, so their logprobs stay exactly theirs.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the model with its adapters
    config = getattr(base, "config", None)
    if any(getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    get_decoder = getattr(base, "get_decoder", None)
    get_head = getattr(base, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


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
