"""The torch backend: PPO-clip against the sampling logprobs, KL, LoRA, publishing to the engine, checkpoints."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from agl_core.schema import Trajectory, Transition  # noqa: E402
from agl_trainer.advantages import ScoredRollout  # noqa: E402
from agl_trainer.engine import TorchEngine  # noqa: E402
from agl_trainer.loss import policy_loss  # noqa: E402
from agl_trainer.rows import Row, build_rows  # noqa: E402
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


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_a_batch_without_signal_leaves_the_weights_where_they_are(tokenizer: Any, max_grad_norm: float | None) -> None:
    # A group whose rollouts all scored alike has every advantage 0: it trains on nothing, and the loop says so.
    # AdamW stepped on it anyway would still move every weight on the momentum of the steps before and on its
    # weight decay: the policy drifted on no signal (the multi-policy demo's writer, all 'B' and no spread, went
    # on to answer tokens nobody rewarded).
    backend = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=5e-2, weight_decay=0.01,
                                                                    max_grad_norm=max_grad_norm))
    backend.update([_row("a", GOOD, 1.0), _row("b", BAD, -1.0)])  # Adam has momentum now
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    metrics = backend.update([_row("a", GOOD, 0.0), _row("b", BAD, 0.0)])
    for name, value in backend.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert metrics["flat_steps"] == 1.0 and metrics["rows"] == 2.0 and metrics["grad_norm"] == 0.0 and backend.step == 2
    again = backend.update([_row("a", GOOD, 1.0), _row("b", BAD, -1.0)])  # a batch with signal still steps
    assert "flat_steps" not in again and any(not torch.equal(v, before[k])
                                             for k, v in backend.model.state_dict().items())


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


# ---------------------------------------------------------------------- logprobs of the distribution sampled from


def _sample(engine: TorchEngine, prompt: list[int], **sampling: Any) -> tuple[list[int], list[float]]:
    """One text completion from the engine (as the gateway asks for it): the token ids and their recorded logprobs."""
    reply = asyncio.run(engine.complete("completions", {"prompt": prompt, "max_tokens": 6, "logprobs": 0,
                                                        "return_token_ids": True, "seed": 3, **sampling}))
    choice = reply.data["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _rows_of(prompt: list[int], response: list[int], logprobs: list[float], **limits: Any) -> tuple[list[Row], Any]:
    t = Transition(rollout_id="r", task_id="t#0", index=0, prompt=[{"role": "user", "content": "q"}],
                   response={"role": "assistant", "content": "a"}, prompt_token_ids=prompt,
                   response_token_ids=response, response_logprobs=logprobs, token_source="gateway")
    scored = ScoredRollout(Trajectory(rollout_id="r", task_id="t#0", transitions=[t], reward=1.0), "t", [1.0], [1.0])
    return build_rows([scored], "transition", **limits)


def test_the_trainer_computes_logprobs_at_the_sampling_temperature(tokenizer: Any) -> None:
    served = tiny_model(len(tokenizer))
    engine = TorchEngine(copy.deepcopy(served), tokenizer, name="tiny", seed=0)
    prompt = [5, 6, 7, 8, 9]
    ids, recorded = _sample(engine, prompt, temperature=0.5)
    backend = TorchBackend(served, TorchConfig(lr=1e-9, temperature=0.5))
    metrics = backend.update(_rows_of(prompt, ids, recorded)[0])
    # before: the engine recorded the unscaled model's logprobs and the trainer took its own unscaled too, so the
    # ratio was 1 against a distribution nobody sampled from; now both are of softmax(logits / 0.5)
    assert metrics["ratio_first_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["ratio_first_min"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["ratio_first_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["sampler_kl"] == pytest.approx(0.0, abs=1e-6)
    # a trainer at another temperature than the sampler's is seen at once
    other = TorchBackend(copy.deepcopy(served), TorchConfig(lr=1e-9, temperature=1.0))
    drift = other.update(_rows_of(prompt, ids, recorded)[0])
    assert drift["sampler_kl"] > 1e-3 and drift["ratio_first_min"] < 0.95


def test_a_prompt_cut_after_sampling_gets_fresh_logprobs_and_a_first_ratio_of_one(tokenizer: Any) -> None:
    served = tiny_model(len(tokenizer))
    engine = TorchEngine(copy.deepcopy(served), tokenizer, name="tiny", seed=0)
    prompt = [(7 * k) % 200 + 3 for k in range(40)]
    ids, recorded = _sample(engine, prompt, temperature=1.0)
    rows, stats = _rows_of(prompt, ids, recorded, max_prompt_length=6)
    assert stats.truncated_prompts == 1
    backend = TorchBackend(served, TorchConfig(lr=1e-9, epochs=1, minibatches=1))
    metrics = backend.update(rows)
    # before: the row kept the logprobs the engine computed with all 40 prompt tokens
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert stats.recomputed_logprobs == 1 and metrics["ratio_first_max"] == pytest.approx(1.0, abs=1e-4)


# ---------------------------------------------------------------------- bf16 with float32 master weights


def test_bf16_training_moves_the_weights_as_fp32_does(tokenizer: Any) -> None:
    other = Row(rollout_id="b", group="g", input_ids=[9, 10, 11, BAD], loss_mask=[0, 0, 0, 1],
                advantages=[0.0, 0.0, 0.0, -1.0], token_weights=[0.0, 0.0, 0.0, 1.0], old_logprobs=None, prompt_len=3)
    rows = [_row("a", GOOD, 1.0), other]
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        backend = TorchBackend(tiny_model(len(tokenizer)).to(dtype), TorchConfig(lr=1e-6, max_grad_norm=None))
        trained = [p for group in backend.optimizer.param_groups for p in group["params"]]
        start = [p.detach().float().clone() for p in trained]
        for _ in range(20):
            backend.update(copy.deepcopy(rows))
        moved[dtype] = torch.cat([(p.detach().float() - s).flatten() for p, s in zip(trained, start, strict=True)])
        # the model (what the engine is served) is the trained weights rounded to its dtype
        for param, master in zip([p for p in backend.model.parameters() if p.requires_grad], trained, strict=True):
            assert param.dtype == dtype and torch.equal(param, master.to(dtype))
    share = {dtype: float((delta != 0).float().mean()) for dtype, delta in moved.items()}
    # before: AdamW stepped the bf16 weights themselves: 1.5% of them moved (fp32: 77%; the rest have no
    # gradient: embeddings of tokens the rows never use), in a direction unrelated to fp32's (cosine 0.13)
    assert share[torch.float32] > 0.5 and share[torch.bfloat16] == pytest.approx(share[torch.float32], abs=0.01)
    assert float(torch.nn.functional.cosine_similarity(moved[torch.float32], moved[torch.bfloat16], dim=0)) > 0.95


def test_a_bf16_run_learns_as_an_fp32_run_on_the_same_seed(tokenizer: Any, tmp_path: Path) -> None:
    rows = [_row("a", GOOD, 1.0), _row("b", BAD, -1.0)]
    gains = {}
    for dtype in (torch.float32, torch.bfloat16):
        backend = TorchBackend(tiny_model(len(tokenizer)).to(dtype), TorchConfig(lr=3e-3))
        good0 = _logprob(backend.model, GOOD)
        for _ in range(8):
            backend.update(copy.deepcopy(rows))
        gains[dtype] = _logprob(backend.model, GOOD) - good0
    assert gains[torch.float32] > 0.5
    assert gains[torch.bfloat16] == pytest.approx(gains[torch.float32], rel=0.1)
    # and a bf16 checkpoint resumes its float32 master weights, not the rounded ones
    first = TorchBackend(tiny_model(len(tokenizer)).to(torch.bfloat16), TorchConfig(lr=1e-6))
    first.update(copy.deepcopy(rows))
    first.save(tmp_path / "ckpt")
    second = TorchBackend(tiny_model(len(tokenizer), seed=5).to(torch.bfloat16), TorchConfig(lr=1e-6))
    second.load(tmp_path / "ckpt")
    for a, b in zip(first.master.parameters, second.master.parameters, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
