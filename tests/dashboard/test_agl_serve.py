"""``agl serve`` through its real entry point serves the dashboard over what it stored, and logs nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import expect

from agl_core.testing import FakeOpenAI

from . import sample_runs
from .conftest import TOKEN

AGL = Path(sys.executable).with_name("agl")  # the console script pip installed: the command users run


def test_agl_serve_shows_the_dashboard_quietly(tmp_path: Path, page: Any) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AGL_TOKEN": ""}
    with FakeOpenAI(script=sample_runs.script) as fake:
        proc = subprocess.Popen([str(AGL), "serve", "--db", str(tmp_path / "agl.db"), "--port", "0",
                                 "--backend", fake.url, "--token", TOKEN],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("agl serve: listening on "), (line, proc.stderr.read() if proc.stderr else "")
            url = line.split()[-1]
            runs = sample_runs.fill(url, TOKEN)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert httpx.post(url + "/v1/metrics", json={"step": 0, "values": {"reward_mean": 0.5}},
                              headers=auth).status_code == 201
            assert httpx.get(url + "/v1/stats").status_code == 401  # one refused request: not worth a log line

            page.goto(f"{url}/?token={TOKEN}")
            rows = page.locator("#rollouts tbody tr[data-rollout-id]")
            expect(rows).to_have_count(len(runs))
            rows.first.click()
            expect(page.locator("#tree .node.k-llm")).to_have_count(3)
            expect(page.locator("#curves svg.curve")).to_have_count(1)
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM), (proc.returncode, err)
    # uvicorn at its warning level, no access log: requests, a 401 and a shutdown leave no trace
    assert out == "" and err == "", (out, err)
