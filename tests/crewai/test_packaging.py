"""``pip install agl-crewai`` resolves beside crewai 1.15 and its pins (openai<3, pydantic<2.13), from the wheels.

The agl-core and agl-crewai wheels are built the way a release is (no build
isolation, so nothing is fetched), then pip resolves ``agl-crewai`` from them
alone against this environment, which holds crewai as a user has it: nothing
of crewai's may need to change, and nothing may be fetched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.packaging


def _pip(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_agl_crewai_installs_beside_crewais_pins(tmp_path: Path) -> None:
    for dist in ("agl-core", "agl-crewai"):
        _pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path), str(ROOT / "dists" / dist))
    plan = _pip("install", "--dry-run", "--no-index", "--find-links", str(tmp_path), "agl-crewai")
    would = next(line for line in plan.splitlines() if line.startswith("Would install"))
    assert sorted(would.split()[2:]) == ["agl-core-0.1.0", "agl-crewai-0.1.0"]  # crewai, openai, pydantic stay
    _pip("check")
