"""The GPU smoke run: ``agl train`` on one GPU, bf16, a random ~0.5B Llama built here, a tiny task, peak memory printed.

    scripts/gpu_smoke.sh                       # cuda, bf16, the 0.5B model, 3 steps (a few minutes on one GPU)
    scripts/gpu_smoke.sh --device cpu --size tiny --steps 2     # the same path on CPU, in seconds (the test's)

Needs only what a GPU machine has besides this repository: torch, transformers, and the
trainer's server stack (starlette, uvicorn, pydantic, pyyaml, click, httpx, openai). No
vLLM, no download: the model and its word-level tokenizer are built in code and saved to a
temporary folder, then trained the way a user trains, by the config ``agl train`` reads
(:func:`agl_trainer.train_cli.run_training`): the built-in server and gateway in this
process, the torch engine serving the policy's own weights, workers running a plain
OpenAI-client agent (:func:`agent`) through the gateway, the torch backend updating in bf16
with float32 masters (full fine-tuning below ``lora_above_params``, ``--lora`` for adapters).

The task: reply with even words; the reward is the share of the reply's words that are
(``w0``, ``w2``, ...). A random model scores about 0.5 with a spread inside each group, so
every step has a gradient; the point is that every stage runs on the device, not that it
learns in 3 steps.

Prints one line a step, then the peak memory (CUDA: ``torch.cuda.max_memory_allocated`` and
reserved; CPU: the process's peak RSS) over the parameter count. Exit status 0 when every step
trained rows with a finite loss; 1 (one line saying why) otherwise; 2 for bad arguments (a
CUDA device asked for where there is none).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

SIZES = {
    # name: (hidden, intermediate, layers, heads, kv heads, vocabulary words)
    "0.5b": (1024, 4096, 28, 16, 4, 32000),  # about 0.49B parameters, most of a Qwen2.5-0.5B's shape
    "tiny": (64, 128, 2, 4, 2, 256),
}
TASKS = 16

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


# ---------------------------------------------------------------- the agent the workers run


def agent(task: dict[str, Any]) -> float:
    """One chat call through the gateway (the worker points ``OPENAI_BASE_URL`` at it); the reward of the reply."""
    import openai

    client = openai.OpenAI(max_retries=0, timeout=300)
    try:
        reply = client.chat.completions.create(model=os.environ.get("AGL_MODEL", "policy"), max_tokens=8,
                                               temperature=1.0,
                                               messages=[{"role": "user", "content": task["question"]}])
    finally:
        client.close()
    return reward(reply.choices[0].message.content or "")


def reward(text: str) -> float:
    """The share of the words of ``text`` that are even words (``w0``, ``w2``, ...)."""
    words = text.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(1, len(words))


# ---------------------------------------------------------------- the model and the run


def build_tokenizer(size: str) -> Any:
    """A word-level tokenizer (``w0`` ... and the prompts' words) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(SIZES[size][5])}}
    for extra in ("say", "even", "words", "user", "assistant", "system"):
        vocab.setdefault(extra, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                        pad_token="<pad>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def model_config(size: str, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    hidden, inter, layers, heads, kv, _ = SIZES[size]
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def build_policy(folder: str, size: str, dtype: str) -> int:
    """A random Llama of ``size`` and its tokenizer, saved as a Hugging Face folder; its parameter count."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer(size)
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config(size, tokenizer)).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_run(folder: str, args: argparse.Namespace) -> dict[str, Any]:
    tasks = [{"id": f"even-{i}", "question": f"say even words w{2 * i} w{2 * i + 2}"} for i in range(TASKS)]
    with open(os.path.join(folder, "tasks.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(t) + "\n" for t in tasks)
    backend: dict[str, Any] = {"name": "torch", "model": "policy", "device": args.device, "dtype": args.dtype,
                               "max_batch": args.group * args.tasks, "gradient_checkpointing": True}
    if args.device == "cpu":
        backend["threads"] = args.threads
    if args.lora:
        backend["lora"] = {"r": 8, "alpha": 16}
    return {"data": {"path": "tasks.jsonl", "group_size": args.group, "tasks_per_step": args.tasks},
            "agent": "gpu_smoke:agent", "backend": backend,
            "algorithm": {"lr": 1e-5, "max_response_length": 16},
            "workers": {"count": args.group * args.tasks}, "server": {"db": "agl.db"},
            "run": {"steps": args.steps, "dir": "out", "checkpoint_every": 10_000, "resume": False}}


def peak_memory(device: str) -> dict[str, float]:
    import torch

    if device.startswith("cuda"):
        return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return {"rss": float(hwm)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tasks", type=int, default=2, help="tasks per step")
    p.add_argument("--group", type=int, default=4, help="rollouts per task per step")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (the default above 1B parameters)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads with --device cpu")
    p.add_argument("--keep", help="build the run in this folder and keep it (default: a temporary one)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_smoke: --device {args.device} but torch {torch.__version__} sees no CUDA device; "
              "run it with --device cpu to check the path without one", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the workers import gpu_smoke:agent
    from agl_trainer.config import validate
    from agl_trainer.train_cli import run_training

    folder = args.keep or tempfile.mkdtemp(prefix="agl-gpu-smoke-")
    os.makedirs(folder, exist_ok=True)
    started = time.monotonic()
    n_params = build_policy(os.path.join(folder, "policy"), args.size, args.dtype)
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"gpu_smoke: {gpu}, torch {torch.__version__}, {n_params / 1e6:.1f}M parameters ({args.size}), "
          f"{args.dtype}, {'LoRA' if args.lora else 'full fine-tuning'}, {args.steps} steps of {args.tasks} tasks x "
          f"{args.group}; model built in {time.monotonic() - started:.1f} s in {folder}", flush=True)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(args.device)
    config = validate(write_run(folder, args), base_dir=folder)
    os.environ["AGL_MODEL"] = "policy"  # the engine serves the model under its folder's name
    outcome = run_training(config, progress=False)
    bad = []
    for s in outcome.steps:
        loss = s.get("metrics", {}).get("loss", float("nan"))
        print(f"gpu_smoke: step {s['step']}: reward {s['reward']:.3f}, {s['rollouts']} rollouts "
              f"({s['failed_rollouts']} failed), {s['rows']} rows, loss {loss:.4g}, rollouts {s['rollout_s']:.1f} s, "
              f"update {s['update_s']:.1f} s, grad norm {s.get('metrics', {}).get('grad_norm', 0.0):.3g}", flush=True)
        if not s["rows"] or not math.isfinite(loss) or s["failed_rollouts"]:
            bad.append(f"step {s['step']} ({s['rows']} rows, loss {loss}, {s['failed_rollouts']} failed rollouts)")
    peak = peak_memory(args.device)
    shown = ", ".join(f"{k} {v / 2**30:.2f} GiB ({v / n_params:.1f} B/param)" for k, v in peak.items())
    print(f"gpu_smoke: peak memory {shown}; {len(outcome.steps)} steps in {outcome.wall_s:.0f} s "
          f"({time.monotonic() - started:.0f} s in all)", flush=True)
    if not any(s.get("metrics", {}).get("grad_norm", 0.0) > 0 for s in outcome.steps):
        bad.append("no step had a gradient (every group scored alike)")
    if len(outcome.steps) != args.steps:
        bad.append(f"{len(outcome.steps)} of {args.steps} steps ran")
    if bad:
        print(f"gpu_smoke: FAILED: {'; '.join(bad)}", file=sys.stderr)
        return 1
    print("gpu_smoke: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
