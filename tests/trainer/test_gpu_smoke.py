"""``scripts/gpu_smoke.sh``, the run a machine with one GPU makes (issue 17), on the CPU path it shares.

The same script and code path as on a GPU (``agl train`` in-process: the gateway, the torch
engine serving the policy's weights, workers running an OpenAI-client agent, bf16 updates),
with ``--device cpu --size tiny``; and what it says when a GPU is asked for and none is there,
or when a run trained nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_smoke.sh"


def smoke(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=400)


def test_the_smoke_run_trains_bf16_steps_through_the_gateway_and_prints_peak_memory(tmp_path: Path) -> None:
    out = smoke("--device", "cpu", "--size", "tiny", "--steps", "2", "--threads", "1", "--keep", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    steps = re.findall(r"gpu_smoke: step (\d+): reward ([\d.]+), 8 rollouts \(0 failed\), (\d+) rows, loss (\S+),"
                       r".* grad norm (\S+)", out.stdout)
    assert [s[0] for s in steps] == ["1", "2"], out.stdout
    assert all(int(rows) == 8 and float(norm) > 0 for _, _, rows, _, norm in steps)  # every step had a gradient
    assert re.search(r"gpu_smoke: peak memory rss [\d.]+ GiB \([\d.]+ B/param\)", out.stdout), out.stdout
    assert "bfloat16, full fine-tuning" in out.stdout and out.stdout.rstrip().endswith("gpu_smoke: ok")
    assert (tmp_path / "out" / "summary.json").exists()  # agl train's own record of the run


def test_a_run_whose_groups_have_no_spread_fails_loudly(tmp_path: Path) -> None:
    out = smoke("--device", "cpu", "--size", "tiny", "--steps", "1", "--group", "1", "--keep", str(tmp_path))
    assert out.returncode == 1
    assert "gpu_smoke: FAILED: no step had a gradient (every group scored alike)" in out.stderr


def test_cuda_asked_for_where_there_is_none_is_one_line_and_status_2() -> None:
    out = smoke("--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("gpu_smoke: --device cuda but torch ")
    assert "sees no CUDA device; run it with --device cpu" in out.stderr


def test_the_default_model_is_about_half_a_billion_parameters() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_smoke
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # counted, never allocated
        model = LlamaForCausalLM(gpu_smoke.model_config("0.5b", gpu_smoke.build_tokenizer("0.5b")))
    assert 0.45e9 < sum(p.numel() for p in model.parameters()) < 0.55e9
