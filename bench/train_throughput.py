"""Training throughput: transitions per second through scoring, row building and the torch update.

    .venvs/trainer/bin/python bench/train_throughput.py [--rollouts 64] [--calls 3] [--prompt 200] [--response 32]

The workload is an agent's: rollouts of ``--calls`` LLM calls, each call's prompt the
previous prompt + response + a tool result (``--tool`` tokens), so trajectory rows can
merge. It is run twice in the same process, once per row mode, on the same tiny Llama
(the demo's size unless told otherwise), and the ratio says what merging saves: a
transition row re-reads the whole conversation before its response, a trajectory row
reads it once.

For a 0.5B model with verl on a GPU cluster, see docs/verl.md.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "src"),
                os.path.join(os.path.dirname(__file__), "..", "trainer")]


def _trajectories(args: argparse.Namespace, vocab: int) -> list[object]:
    from agl_core.schema import Trajectory, Transition

    rng = random.Random(0)
    out = []
    for r in range(args.rollouts):
        ids = [rng.randrange(vocab) for _ in range(args.prompt)]
        steps = []
        for i in range(args.calls):
            response = [rng.randrange(vocab) for _ in range(args.response)]
            steps.append(Transition.trusted(
                rollout_id=f"r{r}", task_id=f"task-{r % 8}#{r}", index=i, prompt=[{"role": "user", "content": ""}],
                response={"role": "assistant", "content": ""}, prompt_token_ids=list(ids),
                response_token_ids=response, response_logprobs=[-1.0] * len(response), token_source="gateway"))
            ids = ids + response + [rng.randrange(vocab) for _ in range(args.tool)]
        out.append(Trajectory(rollout_id=f"r{r}", task_id=f"task-{r % 8}#{r}", transitions=steps,
                              reward=float(rng.random() < 0.5)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--tool", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agl_trainer.advantages import compute_advantages
    from agl_trainer.rows import build_rows
    from agl_trainer.torch_backend import TorchBackend, TorchConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096)
    trajectories = _trajectories(args, args.vocab)
    transitions = args.rollouts * args.calls
    print(f"workload: {args.rollouts} rollouts x {args.calls} calls (prompt {args.prompt}, response "
          f"{args.response}, tool {args.tool} tokens); model {args.layers} x {args.hidden}, vocab {args.vocab}; "
          f"{args.threads} thread(s)")
    results = {}
    for mode in ("transition", "trajectory"):
        backend = TorchBackend(LlamaForCausalLM(config), TorchConfig(lr=1e-4))
        best_rows = best_update = float("inf")
        stats = None
        for _ in range(args.repeat):
            started = time.perf_counter()
            scored, _ = compute_advantages(trajectories, credit="final")  # type: ignore[arg-type]
            rows, stats = build_rows(scored, mode)  # type: ignore[arg-type]
            built = time.perf_counter()
            backend.update(rows)
            done = time.perf_counter()
            best_rows = min(best_rows, built - started)
            best_update = min(best_update, done - built)
        assert stats is not None
        results[mode] = best_rows + best_update
        print(f"{mode:>10}: {stats.rows:4d} rows, {stats.tokens:7d} tokens | score+rows "
              f"{transitions / best_rows:9.0f} transitions/s | update {transitions / best_update:7.1f} "
              f"transitions/s ({stats.tokens / best_update:8.0f} tokens/s) | both {transitions / results[mode]:7.1f}"
              f" transitions/s")
    print(f"trajectory rows vs transition rows: {results['transition'] / results['trajectory']:.2f}x "
          f"the transitions per second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
