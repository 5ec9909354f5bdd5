#!/usr/bin/env bash
# The GPU smoke run (issue 17): agl train on one GPU, bf16, a random ~0.5B model built in code, a tiny task through
# the gateway, peak GPU memory printed. Under 8 minutes on one GPU; no vLLM, no downloads.
#   scripts/gpu_smoke.sh                                  # cuda, bf16, 0.5B, 3 steps
#   scripts/gpu_smoke.sh --lora                           # LoRA adapters instead of full fine-tuning
#   scripts/gpu_smoke.sh --device cpu --size tiny --steps 2   # the same path on CPU (tests/trainer/test_gpu_smoke.py)
# PYTHON picks the interpreter (default: .venvs/trainer/bin/python if built, else python3). Options: gpu_smoke.py --help.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venvs/trainer/bin/python" ]]; then python="$root/.venvs/trainer/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root/src:$root/trainer:$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec timeout "${AGL_SMOKE_TIMEOUT_S:-480}" "$python" "$root/scripts/gpu_smoke.py" "$@"
