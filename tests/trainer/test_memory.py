"""Memory in the torch path: one set of weights, LoRA with no reference copy, checkpointing, chunked logprobs.

Each memory figure is a ratio against the parameter count, from the backend's own
accounting (:meth:`TorchBackend.memory`), the bytes autograd keeps for the backward pass,
or the peak resident memory of a subprocess; never a timing.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from agl_trainer.loss import token_logprobs  # noqa: E402
from agl_trainer.rows import Row  # noqa: E402
from agl_trainer.torch_backend import LoraOptions, TorchBackend, TorchConfig  # noqa: E402

from .test_engine import tiny_model, tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)

PROMPT = [5, 6, 7, 8]
GOOD = 40


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def _row(rollout: str, token: int, advantage: float) -> Row:
    n = len(PROMPT)
    return Row(rollout_id=rollout, group="g", input_ids=[*PROMPT, token], loss_mask=[0] * n + [1],
               advantages=[0.0] * n + [advantage], token_weights=[0.0] * n + [1.0], old_logprobs=None, prompt_len=n)


def _logprob(model: Any, token: int) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1].float()
    return float(torch.log_softmax(logits, -1)[token])


def _n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- one set of weights


def test_the_engine_serves_the_policys_own_tensors_and_samples_each_update(tokenizer: Any) -> None:
    backend = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=1e-2))
    engine = backend.engine(tokenizer, name="tiny", seed=0)
    try:
        policy = {n: p.data_ptr() for n, p in backend.model.named_parameters()}
        assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == policy
        before = _logprob(engine.model, GOOD)
        backend.update([_row("a", GOOD, 1.0)])
        assert backend.publish(engine) == 1 and engine.version == 1
        assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == policy  # nothing was copied
        assert _logprob(engine.model, GOOD) > before  # the engine samples from the updated weights at once
        assert not engine.model.training  # back in the engine's mode after the update
        reply = asyncio.run(engine.complete("completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1}))
        assert reply.status == 200
        memory = backend.memory()
        assert memory["engine"] == 0 and memory["reference"] == 0
    finally:
        asyncio.run(engine.aclose())


def test_an_update_waits_for_the_batch_the_shared_engine_is_generating(tokenizer: Any) -> None:
    import threading

    backend = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=1e-2))
    engine = backend.engine(tokenizer, name="tiny")
    try:
        done = threading.Event()
        with engine.paused():  # as while a batch generates
            thread = threading.Thread(target=lambda: (backend.update([_row("a", GOOD, 1.0)]), done.set()))
            thread.start()
            assert not done.wait(0.5)  # the update did not touch the weights under the batch
        thread.join(30)
        assert done.is_set()
    finally:
        asyncio.run(engine.aclose())


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bytes_per_parameter_full_fine_tuning_bf16_and_lora(tokenizer: Any) -> None:
    """The figures of docs/memory.md, from the backend's own accounting after a step."""
    fp32 = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=1e-3))
    n = _n_params(fp32.model)
    fp32.update([_row("a", GOOD, 1.0)])
    m = fp32.memory()
    assert m["model"] / n == pytest.approx(4.0, rel=0.02)  # the weights (buffers: a few rotary frequencies)
    assert m["optimizer"] / n == pytest.approx(8.0, rel=0.02)  # AdamW's two moments
    assert m["grads"] == 0 and m["master"] == 0 and m["engine"] == 0

    bf16 = TorchBackend(tiny_model(len(tokenizer)).to(torch.bfloat16), TorchConfig(lr=1e-3, kl_coef=0.1))
    bf16.update([_row("a", GOOD, 1.0)])
    m = bf16.memory()
    assert m["model"] / n == pytest.approx(2.0, rel=0.02)
    assert m["master"] / n == pytest.approx(4.0, rel=0.02)
    assert m["optimizer"] / n == pytest.approx(8.0, rel=0.02)
    assert m["reference"] / n == pytest.approx(2.0, rel=0.02)  # full fine-tuning moves the base: a copy
    assert (m["total"] - m["reference"]) / n == pytest.approx(14.0, rel=0.02)

    pytest.importorskip("peft")
    lora = TorchBackend(tiny_model(len(tokenizer)).to(torch.bfloat16),
                        TorchConfig(lr=1e-3, kl_coef=0.1, lora=LoraOptions(r=2, alpha=4)))
    lora.update([_row("a", GOOD, 1.0)])
    m = lora.memory()
    trainable = sum(p.numel() for p in lora.model.parameters() if p.requires_grad)
    assert m["reference"] == 0 and lora.ref_model is None  # the base with adapters off is the reference
    assert m["master"] == 0  # peft keeps the adapters in float32 over a bf16 base: they are their own masters
    assert m["optimizer"] == pytest.approx(trainable * 8, rel=0.02)
    assert m["total"] / n == pytest.approx(2.0 + 12.0 * trainable / n, rel=0.03)


# ---------------------------------------------------------------- LoRA


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_lora_reference_is_the_base_with_its_adapters_disabled(tokenizer: Any) -> None:
    pytest.importorskip("peft")
    base = tiny_model(len(tokenizer))
    original = copy.deepcopy(base)
    backend = TorchBackend(base, TorchConfig(lr=5e-2, kl_coef=0.5, lora=LoraOptions(r=4, alpha=8)))
    assert backend.ref_model is None
    kls = []
    for _ in range(4):
        kls.append(backend.update([_row("a", GOOD, 1.0)])["kl"])
    rows = [_row("a", GOOD, 1.0)]
    ref = backend._ref_logprobs(rows)[0][-1]
    assert ref == pytest.approx(_logprob(original, GOOD), abs=1e-5)  # the reference never moved
    backend.model.eval()
    assert _logprob(backend.model, GOOD) > ref + 0.05  # while the policy did
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 1e-4  # and the KL to it grew


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lora_is_the_default_above_lora_above_params(tokenizer: Any) -> None:
    pytest.importorskip("peft")
    n = _n_params(tiny_model(len(tokenizer)))
    big = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lora_above_params=n - 1))
    assert big.config.lora == LoraOptions()
    trainable = [name for name, p in big.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    small = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lora_above_params=n))
    assert small.config.lora is None and all(p.requires_grad for p in small.model.parameters())
    never = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lora_above_params=None))
    assert never.config.lora is None


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_shared_lora_engine_samples_with_the_adapters_it_trains(tokenizer: Any) -> None:
    pytest.importorskip("peft")
    backend = TorchBackend(tiny_model(len(tokenizer)), TorchConfig(lr=5e-2, lora=LoraOptions(r=4, alpha=8)))
    engine = backend.engine(tokenizer, name="tiny", seed=0)
    try:
        before = _logprob(engine.model, GOOD)
        for _ in range(3):
            backend.update([_row("a", GOOD, 1.0)])
        backend.publish(engine)
        assert _logprob(engine.model, GOOD) > before + 0.05
        reply = asyncio.run(engine.complete("completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1,
                                                            "temperature": 1.0, "return_token_ids": True}))
        choice = reply.data["choices"][0]
        first = choice["token_ids"][0]
        # the recorded logprob is the trained policy's, adapters on
        assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(_logprob(backend.model, first), abs=1e-5)
    finally:
        asyncio.run(engine.aclose())


# ---------------------------------------------------------------- gradient checkpointing


def _saved_bytes(model: Any, ids: Any) -> tuple[int, list[Any]]:
    """Bytes autograd keeps for the backward pass of one logprob forward, and the gradients it gives."""
    saved = 0

    def pack(t: Any) -> Any:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = token_logprobs(model, ids, torch.ones_like(ids))
    logp.sum().backward()
    return saved, [p.grad.clone() for p in model.parameters()]


def test_gradient_checkpointing_is_on_and_keeps_a_fraction_of_the_activations(tokenizer: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    def model() -> Any:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2))

    on = TorchBackend(model(), TorchConfig())
    off = TorchBackend(model(), TorchConfig(gradient_checkpointing=False))
    assert on.model.is_activation_checkpointing and not off.model.is_activation_checkpointing
    ids = torch.randint(0, 64, (2, 128))
    kept_on, grads_on = _saved_bytes(on.model, ids)
    kept_off, grads_off = _saved_bytes(off.model, ids)
    assert kept_on < 0.25 * kept_off  # layer inputs only, not every activation inside the layers
    for a, b in zip(grads_on, grads_off, strict=True):
        assert torch.allclose(a, b, atol=1e-6)  # the same gradient, recomputed


# ---------------------------------------------------------------- chunked logprobs and entropy


def _full(model: Any, ids: Any, temperature: float) -> tuple[Any, Any]:
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_full_computation(tokenizer: Any, temperature: float) -> None:
    model = tiny_model(len(tokenizer)).train()
    ids = torch.randint(0, len(tokenizer), (3, 23))
    logp, entropy = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature, chunk_tokens=5,
                                   with_entropy=True)
    grads = torch.autograd.grad((logp.sum() + entropy.sum()), list(model.parameters()))
    want_logp, want_entropy = _full(model, ids, temperature)
    want_grads = torch.autograd.grad((want_logp.sum() + want_entropy.sum()), list(model.parameters()))
    assert torch.allclose(logp, want_logp, atol=1e-5) and torch.allclose(entropy, want_entropy, atol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-5)


_PEAK_SCRIPT = r"""
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from agl_trainer.loss import token_logprobs
torch.set_num_threads(1)
mode, vocab, B, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=L))
ids = torch.randint(0, vocab, (B, L))
def run():
    if mode == "chunked":
        logp = token_logprobs(model, ids, torch.ones_like(ids), chunk_tokens=128)
    else:  # what it was: the model's whole logits, then a float32 cross-entropy over them
        logits = model(input_ids=ids).logits
        flat = logits[:, :-1].reshape(-1, vocab).float()
        logp = -torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1), reduction="none")
    logp.sum().backward()
    model.zero_grad(set_to_none=False)
run()  # gradients allocated once, before the measure
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak resident size starts again from here
base = rss("VmRSS:")
run()
print(json.dumps({"peak": rss("VmHWM:") - base}))
"""


def _peak(mode: str, vocab: int, batch: int, length: int) -> int:
    # a fixed mmap threshold: every large block goes back to the system when freed, so the peak is what was live
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, mode, str(vocab), str(batch), str(length)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak"])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_chunked_logprobs_never_hold_a_float32_tokens_by_vocab_tensor() -> None:
    vocab, batch, length = 32000, 2, 1024
    whole = batch * (length - 1) * vocab * 4  # one float32 [tokens, vocab] tensor: 262 MB
    chunked = _peak("chunked", vocab, batch, length)
    full = _peak("full", vocab, batch, length)
    assert full > whole  # the measure sees such a tensor when there is one
    assert chunked < 0.5 * whole, f"peak {chunked / 1e6:.0f} MB, a [tokens, vocab] float32 is {whole / 1e6:.0f} MB"


# ---------------------------------------------------------------- the optimizer step

_STEP_SCRIPT = r"""
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
from agl_trainer.torch_backend import TorchBackend, TorchConfig
torch.set_num_threads(1)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
backend = TorchBackend(model, TorchConfig(lr=1e-3, gradient_checkpointing=False))
def step():
    for p in backend.master.parameters:
        p.grad = torch.full_like(p, 1e-3)
    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")
    base = rss("VmRSS:")
    backend.master.step(backend.optimizer, 1.0)
    return rss("VmHWM:") - base
step()  # AdamW's moments allocated once, before the measure
print(json.dumps({"peak": step(), "largest": max(p.numel() * p.element_size() for p in model.parameters())}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_the_optimizer_step_allocates_no_temporary_the_size_of_a_parameter() -> None:
    """AdamW one tensor at a time took two temporaries the size of each parameter (its square root's denominator):
    twice the 33 MB embedding of a 128k vocabulary over the model's own memory, a figure TRL's fused AdamW does not
    pay (bench/train_memory.py). The fused kernel updates in place."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _STEP_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["peak"] < 0.25 * got["largest"], f"the step's peak is {got['peak'] / 1e6:.0f} MB over the live memory"
