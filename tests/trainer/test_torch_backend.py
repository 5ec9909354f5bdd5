"""The torch backend: PPO-clip against the sampling logprobs, KL, LoRA, publishing to the engine, checkpoints."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from agl_trainer.engine import TorchEngine  # noqa: E402
from agl_trainer.loss import policy_loss  # noqa: E402
from agl_trainer.rows import Row  # noqa: E402
from agl_trainer.torch_backend import LoraOptions, TorchBackend, TorchConfig  # noqa: E402

from .test_engine import tiny_model, tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8]
GOOD, BAD = 40, 41


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def _row(rollout: str, token: int, advantage: float, old: float | None = None) -> Row:
    n = len(PROMPT)
    return Row(rollout_id=rollout, group="g", input_ids=[*PROMPT, token], loss_mask=[0] * n + [1],
               advantages=[0.0] * n + [advantage], token_weights=[0.0] * n + [1.0],
               old_logprobs=None if old is None else [0.0] * n + [old], prompt_len=n)


def _logprob(model: Any, token: int) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1].float()
    return float(torch.log_softmax(logits, -1)[token])


def test_policy_loss_clips_the_ratio_against_the_sampling_policy() -> None:
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    weights = torch.tensor([1.0, 1.0, 0.0])  # the third is not a loss token
    parts = policy_loss(logp, old, adv, weights, rollouts=2.0, clip_low=0.2, clip_high=0.28)
    # ratio 1.5 with A>0 is held at 1.28; ratio 0.5 with A<0 at 0.8: -min(r*A, clip(r)*A)
    assert float(parts.loss) == pytest.approx((-1.28 + 0.8) / 2, abs=1e-5)
    assert parts.clip_fraction == pytest.approx(1.0)
    assert parts.ratio_mean == pytest.approx(1.0)


def test_an_update_raises_the_good_token_and_lowers_the_bad_one(tokenizer: Any) -> None:
    backend = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=1e-2, minibatches=2, epochs=2))
    good0, bad0 = _logprob(backend.model, GOOD), _logprob(backend.model, BAD)
    rows = [_row("a", GOOD, 1.0), _row("b", BAD, -1.0)]
    metrics = backend.update(rows)  # no recorded logprobs: filled from the current weights, so the ratio starts at 1
    assert metrics["rollouts"] == 2 and metrics["loss_tokens"] == 2 and backend.step == 1
    assert rows[0].old_logprobs is not None and rows[0].old_logprobs[-1] == pytest.approx(good0, abs=1e-5)
    for _ in range(3):
        backend.update(rows)
    assert _logprob(backend.model, GOOD) > good0 + 0.1
    assert _logprob(backend.model, BAD) < bad0 - 0.1


def test_the_ratio_uses_the_recorded_sampling_logprobs(tokenizer: Any) -> None:
    backend = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=1e-3))
    now = _logprob(backend.model, GOOD)
    metrics = backend.update([_row("a", GOOD, 1.0, old=now - 1.0)])  # sampled by an older, less likely policy
    assert metrics["ratio_mean"] == pytest.approx(2.718, abs=0.01)
    assert metrics["clip_fraction"] == 1.0  # clipped: no gradient from a token that far off-policy


def test_kl_to_the_reference_grows_as_the_policy_moves(tokenizer: Any) -> None:
    backend = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=1e-2, kl_coef=0.5))
    rows = [_row("a", GOOD, 1.0)]
    assert backend.update(rows)["kl"] == pytest.approx(0.0, abs=1e-6)
    for _ in range(3):
        rows[0].old_logprobs = None
        metrics = backend.update(rows)
    assert metrics["kl"] > 1e-4


def test_publish_swaps_the_trained_weights_into_the_engine_in_place(tokenizer: Any) -> None:
    served = tiny_model(len(tokenizer))
    engine = TorchEngine(served, tokenizer, name="tiny")
    backend = TorchBackend(copy.deepcopy(served), TorchConfig(lr=1e-2))
    pointers = {k: v.data_ptr() for k, v in served.state_dict().items()}
    backend.update([_row("a", GOOD, 1.0)])
    assert _logprob(served, GOOD) != pytest.approx(_logprob(backend.model, GOOD))
    assert backend.publish(engine) == 1 and engine.version == 1
    assert _logprob(served, GOOD) == pytest.approx(_logprob(backend.model, GOOD), abs=1e-6)
    assert {k: v.data_ptr() for k, v in served.state_dict().items()} == pointers


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lora_trains_only_the_adapters_and_serves_merged_weights(tokenizer: Any) -> None:
    pytest.importorskip("peft")
    served = tiny_model(len(tokenizer))
    engine = TorchEngine(served, tokenizer, name="tiny")
    backend = TorchBackend(copy.deepcopy(served), TorchConfig(lr=5e-2, lora=LoraOptions(r=4, alpha=8)))
    trainable = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for _ in range(3):
        backend.update([_row("a", GOOD, 1.0)])
    state = backend.serving_state_dict()
    assert set(state) == set(served.state_dict())
    backend.publish(engine)
    backend.model.eval()
    assert _logprob(served, GOOD) == pytest.approx(_logprob(backend.model, GOOD), abs=1e-5)
    assert _logprob(served, GOOD) != pytest.approx(_logprob(tiny_model(len(tokenizer)), GOOD), abs=1e-4)


def test_a_checkpoint_resumes_weights_optimizer_and_step(tokenizer: Any, tmp_path: Path) -> None:
    rows = [_row("a", GOOD, 1.0), _row("b", BAD, -1.0)]
    first = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=1e-2))
    first.update(copy.deepcopy(rows))
    first.save(tmp_path / "ckpt", extra={"note": "hi"})
    second = TorchBackend(tiny_model(len(tokenizer), seed=5), TorchConfig(lr=1e-2))
    assert second.load(tmp_path / "ckpt") == {"step": 1, "version": 0, "note": "hi"}
    assert second.step == 1
    first.update(copy.deepcopy(rows))
    second.update(copy.deepcopy(rows))  # Adam's moments came back too: the same step gives the same weights
    for (name, a), b in zip(first.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
