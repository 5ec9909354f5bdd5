"""Peak memory and time per RL step: agl's torch backend beside TRL's ``GRPOTrainer``, same model and batch, CPU.

    .venvs/trainer/bin/python bench/train_memory.py --trl-python .venvs/bench-trl/bin/python \\
        [--preset 125m] [--prompts 2] [--generations 4] [--prompt-len 32] [--completion-len 32] \\
        [--steps 3] [--modes full,lora]

Both sides train the same Llama, built in code from the same seed (``--preset``: ``125m``
is 12 layers, hidden 768, a 32,000-token vocabulary, about 125M parameters), on the same
prompts (``--prompts`` of ``--prompt-len`` tokens, ``--generations`` completions each of at
most ``--completion-len`` tokens, sampled at temperature 1), with the same reward (the share
of even token ids), AdamW at the same learning rate, gradient checkpointing on, no KL term,
float32. A step is what each project does per batch: generate the completions from the
current weights, score them, group-normalise the rewards, one optimizer step. agl's step is
its shared :class:`~agl_trainer.engine.TorchEngine` generating from the policy's own weights
and :meth:`TorchBackend.update`; TRL's is one ``GRPOTrainer`` training step
(``model.generate``, then its loss).

Each side and mode runs in a process of its own (TRL under the interpreter of its venv,
``bench/requirements-trl.txt``), so one's allocations never count in the other's figure.
Memory is the process's peak resident size (``VmHWM``) over its size just before the model
was built (imports and tokenizer excluded: TRL imports more), with glibc's mmap threshold
fixed in both so that freed blocks go back to the system and the peak is what was live.
Times are the median of the steps after the first (warm-up); the generation part of each
step is timed apart, so the ratio of the rest (the update) compares the training code alone.

``--sides agl`` runs agl alone, and with ``--dtype bfloat16`` / ``--kl`` it measures those
configurations too; its line also prints :meth:`TorchBackend.memory` per parameter, the
figures of ``docs/memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "..", "src"), os.path.join(_HERE, "..", "trainer")]

PRESETS = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": (64, 256, 2, 4, 2, 2048),
    "25m": (256, 1024, 8, 8, 4, 32000),
    "125m": (768, 2048, 12, 12, 4, 32000),
    "300m": (1024, 2816, 20, 16, 8, 32000),
}
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


# ---------------------------------------------------------------- the workload both sides share


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def build_tokenizer(vocab: int) -> Any:
    """One word a token (``t0`` ... ``t{vocab-3}``, then eos and pad): a prompt of N words is N tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 2)}
    words["</s>"], words["<pad>"] = vocab - 2, vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="</s>")


def _preload(mode: str) -> None:
    """Import what building and training the model imports, so that the base size includes it on both sides."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    if mode == "lora":
        import peft  # noqa: F401


def build_model(preset: str, max_positions: int, dtype: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = PRESETS[preset]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, eos_token_id=vocab - 2, pad_token_id=vocab - 1, bos_token_id=None)
    return LlamaForCausalLM(config).to(getattr(torch, dtype))


def prompt_texts(args: argparse.Namespace, vocab: int) -> list[str]:
    """``--prompts`` new prompts a step, for every step: the same list on both sides."""
    rng = random.Random(0)
    return [" ".join(f"t{rng.randrange(vocab - 2)}" for _ in range(args.prompt_len))
            for _ in range(args.prompts * (args.steps + 1))]


def reward(text: str) -> float:
    """The share of even token ids in a completion: a signal a random model can climb."""
    words = [w for w in text.split() if w[1:].isdigit()]
    return sum(int(w[1:]) % 2 == 0 for w in words) / max(1, len(words))


# ---------------------------------------------------------------- agl


def run_agl(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    import torch

    from agl_trainer.rows import Row
    from agl_trainer.torch_backend import LoraOptions, TorchBackend, TorchConfig

    torch.set_num_threads(args.threads)
    vocab = PRESETS[args.preset][5]
    tok = build_tokenizer(vocab)
    prompts = [tok(t)["input_ids"] for t in prompt_texts(args, vocab)]
    _preload(args.mode)
    base = _rss("VmRSS:")
    model = build_model(args.preset, args.prompt_len + args.completion_len, args.dtype)
    n_params = sum(p.numel() for p in model.parameters())
    lora = LoraOptions(**LORA) if args.mode == "lora" else None
    backend = TorchBackend(model, TorchConfig(lr=args.lr, lora=lora, lora_above_params=None, kl_coef=args.kl,
                                              gradient_checkpointing=True, temperature=1.0, max_grad_norm=1.0,
                                              logit_chunk_tokens=args.logit_chunk_tokens),
                           pad_id=vocab - 1)
    engine = backend.engine(tok, name="bench", max_batch=args.prompts * args.generations, seed=0,
                            default_max_tokens=args.completion_len)

    async def generate(batch: list[list[int]]) -> list[dict[str, Any]]:
        body = {"max_tokens": args.completion_len, "n": args.generations, "temperature": 1.0, "logprobs": 1,
                "return_token_ids": True}
        replies = await asyncio.gather(*(engine.complete("completions", {**body, "prompt": p}) for p in batch))
        return [r.data for r in replies]

    steps, gens, lengths, rewards = [], [], [], []
    try:
        for s in range(args.steps + 1):
            batch = prompts[s * args.prompts:(s + 1) * args.prompts]
            started = time.perf_counter()
            replies = asyncio.run(generate(batch))
            generated = time.perf_counter()
            rows = []
            for g, (prompt, reply) in enumerate(zip(batch, replies, strict=True)):
                choices = reply["choices"]
                scores = [reward(c["text"]) for c in choices]
                mean, std = statistics.fmean(scores), statistics.pstdev(scores)
                for c, score in zip(choices, scores, strict=True):
                    ids, lps = c["token_ids"], c["logprobs"]["token_logprobs"]
                    n = len(prompt)
                    adv = (score - mean) / (std + 1e-4)
                    rows.append(Row(rollout_id=f"s{s}g{g}c{c['index']}", group=f"s{s}g{g}",
                                    input_ids=[*prompt, *ids], loss_mask=[0] * n + [1] * len(ids),
                                    advantages=[0.0] * n + [adv] * len(ids),
                                    token_weights=[0.0] * n + [1.0 / len(ids)] * len(ids),
                                    old_logprobs=[0.0] * n + list(lps), prompt_len=n))
                    lengths.append(len(ids))
                rewards.append(mean)
            backend.update(rows)
            backend.publish(engine)
            steps.append(time.perf_counter() - started)
            gens.append(generated - started)
        accounting = backend.memory()
    finally:
        asyncio.run(engine.aclose())
    return {"side": "agl", "mode": args.mode, "dtype": args.dtype, "kl": args.kl, "params": n_params,
            "trainable": sum(p.numel() for p in backend.model.parameters() if p.requires_grad),
            "base_rss": base, "peak_rss": _rss("VmHWM:"), "steps": steps, "generation": gens,
            "completion_tokens": statistics.fmean(lengths), "reward": rewards,
            "accounting": {k: v / n_params for k, v in accounting.items()}}


# ---------------------------------------------------------------- TRL


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    vocab = PRESETS[args.preset][5]
    tok = build_tokenizer(vocab)
    data = Dataset.from_dict({"prompt": prompt_texts(args, vocab)})
    _preload(args.mode)
    base = _rss("VmRSS:")
    model = build_model(args.preset, args.prompt_len + args.completion_len, args.dtype)
    n_params = sum(p.numel() for p in model.parameters())
    peft_config = None
    if args.mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"],
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
    lengths: list[float] = []
    rewards: list[float] = []

    def score(completions: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
        out = [reward(c) for c in completions]
        lengths.extend(len(ids) for ids in completion_ids)
        rewards.append(statistics.fmean(out))
        return out

    steps: list[float] = []
    gens: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            steps.append(time.perf_counter() - self.started)

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=args.prompts * args.generations,
                            num_generations=args.generations, max_completion_length=args.completion_len,
                            max_steps=args.steps + 1, learning_rate=args.lr, lr_scheduler_type="constant",
                            beta=args.kl, temperature=1.0, use_cpu=True, report_to="none", save_strategy="no",
                            logging_steps=1, gradient_checkpointing=True, max_grad_norm=1.0, seed=0,
                            shuffle_dataset=False, dataloader_num_workers=0, bf16=args.dtype == "bfloat16",
                            disable_dropout=True)
        trainer = GRPOTrainer(model=model, reward_funcs=score, args=config, train_dataset=data,
                              processing_class=tok, peft_config=peft_config, callbacks=[Clock()])
        generate = trainer._generate

        def timed_generate(prompts: list[Any]) -> Any:  # the generation part of the step, timed apart
            started = time.perf_counter()
            try:
                return generate(prompts)
            finally:
                gens.append(time.perf_counter() - started)

        trainer._generate = timed_generate
        trainer.train()
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"side": "trl", "mode": args.mode, "dtype": args.dtype, "kl": args.kl, "params": n_params,
            "trainable": trainable, "base_rss": base, "peak_rss": _rss("VmHWM:"), "steps": steps, "generation": gens,
            "completion_tokens": statistics.fmean(lengths), "reward": rewards}


# ---------------------------------------------------------------- the run


def _child(python: str, side: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [python, os.path.abspath(__file__), "--child", side, "--mode", mode, "--preset", args.preset,
            "--prompts", str(args.prompts), "--generations", str(args.generations), "--prompt-len",
            str(args.prompt_len), "--completion-len", str(args.completion_len), "--steps", str(args.steps),
            "--lr", str(args.lr), "--dtype", args.dtype, "--kl", str(args.kl), "--threads", str(args.threads),
            "--logit-chunk-tokens", str(args.logit_chunk_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "131072",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{side} ({mode}) failed with status {done.returncode}:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _summary(r: dict[str, Any]) -> dict[str, float]:
    timed = r["steps"][1:] or r["steps"]
    gens = r["generation"][1:] or r["generation"]
    step, gen = statistics.median(timed), statistics.median(gens)
    peak = r["peak_rss"] - r["base_rss"]
    return {"peak_mb": peak / 1e6, "bytes_per_param": peak / r["params"], "step_s": step, "generation_s": gen,
            "update_s": step - gen}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="125m")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kl", type=float, default=0.0, help="KL coefficient (agl kl_coef, TRL beta)")
    p.add_argument("--logit-chunk-tokens", type=int, default=512, help="agl's backend.logit_chunk_tokens")
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--sides", default="agl,trl")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trl-python", default=os.path.join(_HERE, "..", ".venvs", "bench-trl", "bin", "python"))
    p.add_argument("--json", help="write every side's raw figures here")
    p.add_argument("--child", choices=["agl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps((run_agl if args.child == "agl" else run_trl)(args)), flush=True)
        # the figures are out: skip the interpreter's teardown, where a C++ thread of torch still joinable at exit
        # has aborted the process now and then ("terminate called without an active exception") after a good run
        os._exit(0)

    sides = args.sides.split(",")
    if "trl" in sides and not os.path.exists(args.trl_python):
        raise SystemExit(f"no TRL interpreter at {args.trl_python}: build it (bench/requirements-trl.txt) "
                         "or pass --trl-python, or run --sides agl")
    pythons = {"agl": sys.executable, "trl": args.trl_python}
    print(f"preset {args.preset}, {args.prompts} prompts x {args.generations} completions, prompt {args.prompt_len}"
          f" tokens, completion <= {args.completion_len}, {args.dtype}, kl {args.kl}, {args.threads} thread(s), "
          f"{args.steps} timed steps")
    raw = []
    for mode in args.modes.split(","):
        got = {}
        for side in sides:  # ours first, then the peer, each in its own process
            r = _child(pythons[side], side, mode, args)
            raw.append(r)
            got[side] = s = _summary(r)
            line = (f"{mode:5} {side:4} params {r['params'] / 1e6:7.1f}M trainable {r['trainable'] / 1e6:7.2f}M  "
                    f"peak {s['peak_mb']:8.0f} MB ({s['bytes_per_param']:5.1f} B/param)  step {s['step_s']:6.2f} s "
                    f"(generation {s['generation_s']:5.2f}, update {s['update_s']:5.2f})  completion "
                    f"{r['completion_tokens']:.1f} tokens")
            if "accounting" in r:
                line += "  held/param: " + " ".join(f"{k} {v:.2f}" for k, v in r["accounting"].items() if v)
            print(line, flush=True)
        if "agl" in got and "trl" in got:
            a, t = got["agl"], got["trl"]
            print(f"{mode:5} agl/trl: peak memory {a['peak_mb'] / t['peak_mb']:.2f}, step time "
                  f"{a['step_s'] / t['step_s']:.2f}, update time {a['update_s'] / t['update_s']:.2f}, generation "
                  f"{a['generation_s'] / t['generation_s']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
