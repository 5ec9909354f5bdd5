"""agl's rows as verl's ``DataProto``, checked with verl's own code (its GRPO estimator, its batch ops)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
verl = pytest.importorskip("verl")

from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402

from agl_core.schema import Trajectory, Transition  # noqa: E402
from agl_trainer.advantages import compute_advantages  # noqa: E402
from agl_trainer.rows import build_rows  # noqa: E402
from agl_trainer.verl_backend import to_data_proto  # noqa: E402
from verl import DataProto  # noqa: E402

PAD = 0


def _rollout(rid: str, task: str, reward: float, prompt: list[int], turns: list[tuple[list[int], list[int]]]
             ) -> Trajectory:
    """``turns``: (response, tool tokens after it); each call's prompt is the conversation so far."""
    steps, ids = [], list(prompt)
    for i, (response, tool) in enumerate(turns):
        steps.append(Transition(rollout_id=rid, task_id=task, index=i, prompt=[{"role": "user", "content": "q"}],
                                response={"role": "assistant", "content": "a"}, prompt_token_ids=list(ids),
                                response_token_ids=response, response_logprobs=[-0.5] * len(response),
                                token_source="gateway"))
        ids += response + tool
    return Trajectory(rollout_id=rid, task_id=task, transitions=steps, reward=reward)


BATCH = [
    _rollout("a", "t1#0", 1.0, [11, 12, 13], [([21], [31, 32]), ([22, 23], [])]),
    _rollout("b", "t1#1", 0.0, [11, 12, 13], [([24, 25, 26], [])]),
    _rollout("c", "t2#0", 0.5, [14, 15], [([27], [33]), ([28], [])]),
    _rollout("d", "t2#1", 0.0, [14, 15], [([29], [])]),
]


def _data() -> DataProto:
    scored, _ = compute_advantages(BATCH, credit="final")
    rows, stats = build_rows(scored, "trajectory")
    assert stats.merged == 2 and stats.rows == 4
    return to_data_proto(rows, pad_id=PAD)


def test_the_batch_has_verls_keys_and_padding() -> None:
    data = _data()
    assert isinstance(data, DataProto) and len(data) == 4
    assert set(data.batch.keys()) >= {"prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                      "position_ids", "rollout_log_probs", "token_level_scores", "advantages"}
    assert list(data.non_tensor_batch["uid"]) == ["t1", "t1", "t2", "t2"]
    a, b, c, _ = range(4)
    assert data.batch["prompts"][c].tolist() == [PAD, 14, 15]  # left-padded
    assert data.batch["responses"][a].tolist() == [21, 31, 32, 22, 23]  # response, tool, response
    assert data.batch["response_mask"][a].tolist() == [1, 0, 0, 1, 1]  # the tool's tokens are not trained on
    assert data.batch["responses"][b].tolist() == [24, 25, 26, PAD, PAD]  # right-padded
    assert data.batch["attention_mask"][c].tolist() == [0, 1, 1, 1, 1, 1, 0, 0]
    assert data.batch["position_ids"][c].tolist()[:4] == [0, 0, 1, 2]
    assert data.batch["input_ids"].shape == (4, 8)
    assert data.batch["token_level_scores"][a].tolist() == [0, 0, 0, 0, 1.0]  # the return, on the last response
    assert data.batch["rollout_log_probs"][a].tolist() == [-0.5, 0, 0, -0.5, -0.5]
    assert data.meta_info["agl"]["truncated_prompts"] == 0


def test_verls_grpo_on_it_gives_agls_advantages() -> None:
    data = _data()
    verl_adv, _ = compute_grpo_outcome_advantage(token_level_rewards=data.batch["token_level_scores"],
                                                 response_mask=data.batch["response_mask"],
                                                 index=data.non_tensor_batch["uid"])
    mask = data.batch["response_mask"].bool()
    ours = data.batch["advantages"]
    # one row per rollout: verl's groups are agl's; verl divides by the sample std (n - 1), agl by the
    # population std, so for groups of two agl's advantages are sqrt(2) times verl's
    assert torch.allclose(ours[mask], verl_adv[mask] * math.sqrt(2), atol=1e-4)


def test_verls_batch_operations_work_on_it() -> None:
    data = _data()
    first, second = data.chunk(2)
    assert len(first) == 2 and list(second.non_tensor_batch["rollout_id"]) == ["c", "d"]
    again = DataProto.concat([first, second])
    assert torch.equal(again.batch["input_ids"], data.batch["input_ids"])
    picked = data.select(batch_keys=["input_ids", "response_mask"], non_tensor_batch_keys=["uid"])
    assert set(picked.batch.keys()) == {"input_ids", "response_mask"}
    assert isinstance(picked.non_tensor_batch["uid"], np.ndarray)


def test_truncation_is_counted() -> None:
    scored, _ = compute_advantages(BATCH, credit="final")
    rows, _ = build_rows(scored, "trajectory")
    data = to_data_proto(rows, max_prompt_length=2, max_response_length=3)
    assert data.batch["prompts"].shape == (4, 2) and data.batch["responses"].shape == (4, 3)
    stats = data.meta_info["agl"]
    assert stats["truncated_prompts"] == 2 and stats["truncated_responses"] == 1
    assert stats["dropped_loss_tokens"] == 2  # rollout a's second response [22 23] fell off the end
