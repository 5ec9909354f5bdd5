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
- ``token_level_scores`` ``(B, R)``: the rollout's return on its row's last response token, so
  verl's own estimators (``grpo``, ``rloo``, ...) can run;
- ``advantages`` ``(B, R)``: agl's per-rollout group advantages (LightningRL), for a trainer that
  keeps them instead of re-estimating;
- non-tensor ``uid`` (the task group), ``rollout_id``; ``meta_info["agl"]``: what was truncated.

verl's GRPO treats each row as one sample of its group: with ``row_mode="transition"`` a
rollout of three calls is three samples there, the per-transition bias that
:mod:`agl_trainer.advantages` avoids. Use trajectory rows (one row per rollout when the
agent's calls extend each other) or keep agl's ``advantages``.

**Recipe: verl's trainer on a Ray cluster with agl's gateway in front of its vLLM servers**
(written for verl 0.9; the GPU path is not yet exercised by agl's tests):

1. Run verl's PPO trainer with async rollout (``actor_rollout_ref.rollout.mode=async``): its
   vLLM servers are Ray actors with OpenAI-compatible endpoints and return token ids.
2. ``agl serve --backend http://<vllm-server>/v1 --agent-match <agent regex>`` in front of them:
   the agents' calls go through the gateway, which records token ids and logprobs per call.
3. ``agl worker --server <agl server> --agent pkg.mod:solve --ray <ray address> -n <actors>``
   runs the unchanged agent as Ray actors.
4. In verl's loop, replace the rollout stage by: enqueue the step's tasks with ``repeat=n``
   (``agl_core.worker.TaskClient.enqueue``), wait for them, read their trajectories, score them
   (:func:`agl_trainer.advantages.compute_advantages`), build rows and hand
   ``to_data_proto(rows)`` to verl's ``compute_log_prob`` / ``compute_advantage`` / ``update_actor``.
5. After verl syncs the new weights into vLLM, ``POST /v1/model {"version": step}`` so the
   gateway records which version answered each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agl_trainer.rows import Row

__all__ = ["DataProtoStats", "data_proto_fields", "to_data_proto"]


@dataclass
class DataProtoStats:
    """What fitting rows into ``(P, R)`` cost."""

    rows: int = 0
    prompt_length: int = 0
    response_length: int = 0
    truncated_prompts: int = 0
    truncated_responses: int = 0
    dropped_loss_tokens: int = 0


def data_proto_fields(rows: Sequence[Row], *, pad_id: int = 0, max_prompt_length: int | None = None,
                      max_response_length: int | None = None) -> tuple[dict[str, Any], dict[str, Any],
                                                                        DataProtoStats]:
    """The tensors and non-tensor arrays of :func:`to_data_proto`, without verl (torch and numpy only).

    A prompt longer than ``max_prompt_length`` keeps its last tokens; a response part longer than
    ``max_response_length`` is cut at the end (its loss tokens beyond are counted as dropped).
    """
    import numpy as np
    import torch

    if not rows:
        raise ValueError("no rows: nothing to put in a DataProto")
    stats = DataProtoStats(rows=len(rows))
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
    for i, r in enumerate(rows):
        prompt = prompts[i]
        if len(prompt) > P:
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
        if r.old_logprobs is not None:
            t_logprobs[i, :n] = torch.tensor(r.old_logprobs[start:start + n], dtype=torch.float32)
        t_adv[i, :n] = torch.tensor(r.advantages[start:start + n], dtype=torch.float32)
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
    }
    non_tensors = {"uid": np.array([r.group for r in rows], dtype=object),
                   "rollout_id": np.array([r.rollout_id for r in rows], dtype=object)}
    stats.prompt_length, stats.response_length = P, R
    return tensors, non_tensors, stats


def to_data_proto(rows: Sequence[Row], *, pad_id: int = 0, max_prompt_length: int | None = None,
                  max_response_length: int | None = None, meta_info: dict[str, Any] | None = None) -> Any:
    """verl's ``DataProto`` of ``rows`` (see the module docstring for its keys). Needs ``verl``."""
    from verl import DataProto

    tensors, non_tensors, stats = data_proto_fields(rows, pad_id=pad_id, max_prompt_length=max_prompt_length,
                                                    max_response_length=max_response_length)
    meta = dict(meta_info or {})
    meta["agl"] = dict(stats.__dict__)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)
