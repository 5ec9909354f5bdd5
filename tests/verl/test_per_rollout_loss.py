"""verl's loss weighs each rollout one unit, as agl's torch loss does, and both backends train on the same credit.

verl's own pieces run here on CPU: its composed actor config, its padding removal, its ``ppo_loss``
(which calls the policy loss that ``actor_rollout_ref.actor.policy_loss.loss_mode`` names, agl's
``agl_per_rollout``), against agl's torch ``policy_loss`` on the same rows.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from verl.trainer.ppo.core_algos import agg_loss  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import agl_trainer.verl_loss  # noqa: E402,F401 - registers agl_per_rollout, as verl's workers do at start
from agl_core.schema import Trajectory, Transition  # noqa: E402
from agl_core.transitions import AirRules, TransitionBuilder  # noqa: E402
from agl_trainer.advantages import compute_advantages  # noqa: E402
from agl_trainer.config import validate  # noqa: E402
from agl_trainer.loss import policy_loss  # noqa: E402
from agl_trainer.rows import Row, build_rows  # noqa: E402
from agl_trainer.train_cli import _train_config  # noqa: E402
from agl_trainer.training import score_batch  # noqa: E402
from agl_trainer.verl_backend import (  # noqa: E402
    LOSS_MODE,
    compose_verl_config,
    data_proto_fields,
    signal_problems,
    step_config,
    to_data_proto,
    verl_gateway_config,
    verl_overrides,
)

from ..trainer.test_advantages import writer_checker_run  # noqa: E402 - the same runs the torch side is tested on
from .test_launch import CONFIG  # noqa: E402

NO_KL = {**CONFIG, "algorithm": {**CONFIG["algorithm"], "kl_coef": 0.0}}


def _call(rid: str, task: str, i: int, prompt: list[int], response: list[int]) -> Transition:
    return Transition(rollout_id=rid, task_id=task, index=i, prompt=[{"role": "user", "content": "q"}],
                      response={"role": "assistant", "content": "a"}, prompt_token_ids=prompt,
                      response_token_ids=response, response_logprobs=[-0.5] * len(response), token_source="gateway")


def _rows() -> list[Row]:
    """Rollout ``split``: three calls whose prompts do not extend each other (three rows); ``whole``: one row."""
    split = Trajectory(rollout_id="split", task_id="t#0", reward=1.0, transitions=[
        _call("split", "t#0", 0, [11, 12], [21, 22]), _call("split", "t#0", 1, [13, 14], [23]),
        _call("split", "t#0", 2, [15], [24, 25, 26])])
    whole = Trajectory(rollout_id="whole", task_id="t#1", reward=0.0, transitions=[
        _call("whole", "t#1", 0, [11, 12], [27, 28])])
    scored, _ = compute_advantages([split, whole], credit="final")
    rows, stats = build_rows(scored, "trajectory")
    assert stats.rows == 4 and stats.prefix_mismatches == 2
    return rows


def _actor(raw: dict[str, Any]) -> Any:
    return omega_conf_to_dataclass(compose_verl_config(verl_overrides(validate(raw))).actor_rollout_ref.actor)


def _verl_loss(data: Any, actor: Any, logp: Any) -> Any:
    """verl's ``ppo_loss`` on ``data`` as its actor sees one mini-batch (dp 1), with the policy's logprobs ``logp``."""
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"]  # verl's recomputed ones: the same policy here
    td = left_right_2_no_padding(data.to_tensordict())
    mask = data.batch["attention_mask"]
    P = data.batch["prompts"].shape[1]
    pieces = []
    for i in range(mask.shape[0]):  # the model's output, unpadded: token j's slot holds the logprob of token j + 1
        p, r = int(mask[i, :P].sum()), int(mask[i, P:].sum())
        pieces += [torch.zeros(p - 1), logp[i, :r], torch.zeros(1)]
    values = torch.cat(pieces)
    offsets = torch.tensor([0, *mask.sum(-1).cumsum(0).tolist()])
    from tensordict import NonTensorData

    td["dp_size"], td["batch_num_tokens"] = NonTensorData(1), NonTensorData(int(data.batch["response_mask"].sum()))
    td["global_batch_size"] = NonTensorData(len(data))
    loss, _ = ppo_loss(actor, {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets=offsets)}, td)
    return loss


def _weights_per_rollout(loss_of: Any, data: Any) -> dict[str, float]:
    """Each rollout's share of the loss: minus the gradient on its tokens' logprobs, per unit of advantage (ratio 1)."""
    old = data.batch["rollout_log_probs"]
    logp = old.clone().requires_grad_(True)
    loss_of(logp).backward()
    adv, mask = data.batch["advantages"], data.batch["response_mask"].bool()
    share = (-logp.grad / torch.where(adv == 0, torch.ones_like(adv), adv)) * mask
    out: dict[str, float] = {}
    for i, rid in enumerate(data.non_tensor_batch["rollout_id"]):
        key = rid or "padding"
        out[key] = out.get(key, 0.0) + float(share[i].sum())
    return {k: round(v, 6) for k, v in out.items()}


def test_verls_loss_weighs_each_rollout_one_unit_as_the_torch_loss_does() -> None:
    rows = _rows()
    data = to_data_proto(rows, pad_to_multiple=6)  # one mini-batch of 6 rows: 4 real, 2 of padding
    assert data.meta_info["agl"]["pad_rows"] == 2 and "token_weights" in data.batch.keys()
    data.batch["rollout_is_weights"] = data.batch["token_weights"]  # what agl's _fit hands verl's update
    ours = _weights_per_rollout(lambda logp: _verl_loss(data, _actor(NO_KL), logp), data)

    # agl's torch backend on the same rows: sum(weight * pg) / rollouts, the rows' tokens side by side
    flat = {k: torch.tensor([v for r in rows for v in getattr(r, k)[1:]], dtype=torch.float32)
            for k in ("old_logprobs", "advantages", "token_weights")}
    logp = flat["old_logprobs"].clone().requires_grad_(True)
    policy_loss(logp, flat["old_logprobs"], flat["advantages"], flat["token_weights"], rollouts=2.0).loss.backward()
    share = -logp.grad / flat["advantages"].masked_fill(flat["advantages"] == 0, 1.0)
    owners = [r.rollout_id for r in rows for _ in r.input_ids[1:]]
    torch_share = {rid: float(sum(v for v, o in zip(share.tolist(), owners, strict=True) if o == rid))
                   for rid in ("split", "whole")}
    assert ours == {"split": 0.5, "whole": 0.5, "padding": 0.0}
    assert ours["split"] == pytest.approx(torch_share["split"]) and ours["whole"] == pytest.approx(torch_share["whole"])


def test_verls_own_row_weighting_is_what_agls_loss_replaces() -> None:
    # before: loss_agg_mode seq-mean-token-mean with verl's vanilla loss; every row weighs 1 / global_batch_size
    rows = _rows()
    data = to_data_proto(rows, pad_to_multiple=6)
    old = {**NO_KL, "backend": {**NO_KL["backend"], "verl": {**NO_KL["backend"]["verl"], "overrides": [
        "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]}}}
    verl_share = _weights_per_rollout(lambda logp: _verl_loss(data, _actor(old), logp), data)
    # the rollout split in three rows weighs 3/6, the one in one row 1/6, and the two rows of padding take 2/6
    assert verl_share == {"split": 0.5, "whole": pytest.approx(1 / 6, abs=1e-6), "padding": 0.0}
    assert sum(verl_share.values()) == pytest.approx(4 / 6, abs=1e-6)
    without_padding = agg_loss(torch.ones(4, 3), torch.ones(4, 3), "seq-mean-token-mean")  # 4 rows, no pads
    assert float(without_padding) == pytest.approx(1.0)  # ... and 0.75 / 0.25 without padding
    # and agl's launch path refuses a config that brings verl's row weighting back
    problems = signal_problems(compose_verl_config(verl_overrides(validate(old))), validate(old))
    assert any(f"leave it at {LOSS_MODE}" in p for p in problems)


def test_mini_batches_hold_whole_rollouts_in_the_order_verls_ranks_take_them() -> None:
    rows = [r for k in range(5) for r in _one_rollout_rows(f"r{k}", calls=1 + k % 3)]  # 1, 2, 3, 1, 2 rows
    tensors, non_tensors, stats = data_proto_fields(rows, pad_to_multiple=4, dp_size=2)
    ids, weights = list(non_tensors["rollout_id"]), tensors["token_weights"]
    B = len(ids)
    assert B % 4 == 0 and stats.mini_batches == B // 4 and stats.split_rollouts == 0
    # verl: rank k gets rows [k * B/2, (k+1) * B/2); its mini-batch j is the j-th 2 rows of that
    per_rank = B // 2
    batches = [[i for rank in range(2) for i in range(rank * per_rank + j * 2, rank * per_rank + j * 2 + 2)]
               for j in range(stats.mini_batches)]
    seen: set[str] = set()
    for batch in batches:
        own = {ids[i] for i in batch} - {""}
        assert not own & seen  # a rollout lives in one mini-batch
        seen |= own
        total = {rid: float(sum(weights[i].sum() for i in batch if ids[i] == rid)) for rid in own}
        assert all(v == pytest.approx(1 / len(own)) for v in total.values())  # one unit of the mini-batch each
    assert seen == {f"r{k}" for k in range(5)}


def _one_rollout_rows(rid: str, calls: int) -> list[Row]:
    traj = Trajectory(rollout_id=rid, task_id=f"{rid}#0", reward=1.0, transitions=[
        _call(rid, f"{rid}#0", i, [40 + i], [50 + i]) for i in range(calls)])
    scored, _ = compute_advantages([traj], credit="final")
    return build_rows(scored, "transition")[0]


def test_the_torch_and_verl_paths_agree_on_every_transitions_credited_reward() -> None:
    # the writer is trained, the checker is not; the checker's tool failed in run 0 (AIR -1)
    config = validate({**NO_KL, "agent_match": "writer", "air": {"tool_error": -1.0},
                       "algorithm": {**NO_KL["algorithm"], "row_mode": "transition"}})
    builder = TransitionBuilder(agent_match="writer", air=AirRules(tool_error=-1.0))
    runs = [builder.build(writer_checker_run(0, checker_fails=True)),
            builder.build(writer_checker_run(1, checker_fails=False))]
    torch_side = score_batch(runs, _train_config(config, "out"))   # what `agl train` runs with the torch backend
    verl_side = score_batch(runs, step_config(config))              # ... and with the verl backend
    credited = {(s.rollout_id, i): c for s in torch_side.scored for i, c in enumerate(s.credited)}
    assert credited == {("run0", 0): 0.0, ("run0", 1): 0.0, ("run1", 0): 1.0, ("run1", 1): 1.0}
    assert {(s.rollout_id, i): c for s in verl_side.scored for i, c in enumerate(s.credited)} == credited
    data = to_data_proto(verl_side.rows)
    scores = data.batch["token_level_scores"].sum(-1).tolist()  # each transition row's credited reward
    assert scores == [credited[(t.rollout_id, t.index)] for run in runs for t in run.transitions]
    ours = data.batch["advantages"][data.batch["response_mask"].bool()].tolist()
    theirs = [a for r in torch_side.rows for a, m in zip(r.advantages, r.loss_mask, strict=True) if m]
    assert ours == pytest.approx(theirs) and min(ours) == pytest.approx(-0.5)  # the penalty reached the writer


def test_verls_gateway_samples_at_the_temperature_verl_trains_at() -> None:
    config = validate({**NO_KL, "algorithm": {**NO_KL["algorithm"], "temperature": 0.7}})
    verl_cfg = compose_verl_config(verl_overrides(config))
    # before: the gateway pinned 1.0 whatever rollout.temperature verl computed its logprobs at
    assert verl_gateway_config(config).sampling_overrides["temperature"] == 0.7
    assert verl_cfg.actor_rollout_ref.rollout.temperature == 0.7
    assert verl_cfg.actor_rollout_ref.rollout.logprobs_mode == "processed_logprobs"
    assert signal_problems(verl_cfg, config) == []
    clash = validate({**config.model_dump(mode="json", exclude={"base_dir"}), "backend": {
        **NO_KL["backend"], "verl": {"overrides": ["actor_rollout_ref.rollout.temperature=1.0"]}}})
    problems = signal_problems(compose_verl_config(verl_overrides(clash)), clash)
    assert problems and problems[0].startswith("actor_rollout_ref.rollout.temperature=1.0 differs from "
                                               "algorithm.temperature 0.7")
