"""What ``import agl_core`` costs, next to peer projects, and what it drags in.

Each import is timed in a fresh interpreter (``python -I -c``, perf_counter around
the import alone, so interpreter start-up is not counted); the runs of all
projects are interleaved so that drift on the machine hits each alike, and the
median of N runs is reported with its ratio to agl_core.

Peers, each measured only where it is importable:
- ``openinference.instrumentation.openai`` (Arize OpenInference), in this interpreter
  (``pip install -e '.[bench]'`` brings it);
- ``agentlightning`` (Microsoft Agent Lightning), in the interpreter named by
  ``AGL_BENCH_AGENTLIGHTNING_PYTHON`` (a venv's python; its dependency tree
  conflicts with ours), else in this one.

Then it lists which heavy modules are in ``sys.modules`` after ``import agl_core``:
agl_core promises to import no framework, no torch and no server library.

    python bench/import_time.py [--runs 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field

HEAVY = (
    "openai",
    "torch",
    "fastapi",
    "uvicorn",
    "starlette",
    "langchain*",
    "crewai",
    "autogen*",
    "agents",
    "transformers",
    "pydantic",
    "sqlite3",
    "opentelemetry.sdk",
)

# agentlightning imports litellm, which fetches a model price list over the network at import
# unless told to use its bundled copy; the network is not part of what is measured.
_ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}

_TIMER = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"

_PROBE = """
import json, sys
before = set(sys.modules)
import agl_core
loaded = set(sys.modules) - before
heavy = {}
for pattern in json.loads(sys.argv[1]):
    if pattern.endswith("*"):
        hits = sorted(m for m in loaded if m.split(".")[0].startswith(pattern[:-1]))
    else:
        hits = sorted(m for m in loaded if m == pattern or m.startswith(pattern + "."))
    heavy[pattern] = hits
print(json.dumps({"count": len(loaded), "heavy": heavy}))
"""


@dataclass
class Subject:
    label: str
    module: str
    python: str
    times_s: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_s) * 1000


def importable(python: str, module: str) -> bool:
    """Whether ``python`` can import ``module``; the import also warms the disk cache for the timed runs."""
    if not os.path.exists(python):
        return False
    proc = subprocess.run([python, "-I", "-c", f"import {module}"], capture_output=True, timeout=120, env=_ENV)
    return proc.returncode == 0


def time_import(python: str, module: str) -> float:
    proc = subprocess.run(
        [python, "-I", "-c", _TIMER.format(module=module)], capture_output=True, text=True, timeout=120, env=_ENV
    )
    if proc.returncode != 0:
        raise RuntimeError(f"import {module} failed under {python}:\n{proc.stderr}")
    return float(proc.stdout.strip().splitlines()[-1])


def heavy_modules(python: str) -> dict[str, object]:
    proc = subprocess.run(
        [python, "-I", "-c", _PROBE, json.dumps(HEAVY)], capture_output=True, text=True, timeout=120, env=_ENV
    )
    if proc.returncode != 0:
        raise RuntimeError(f"import agl_core failed under {python}:\n{proc.stderr}")
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def subjects(python: str) -> tuple[list[Subject], list[str]]:
    found = [Subject("agl_core", "agl_core", python)]
    missing = []
    if importable(python, "openinference.instrumentation.openai"):
        found.append(Subject("openinference-openai", "openinference.instrumentation.openai", python))
    else:
        missing.append("openinference.instrumentation.openai (pip install -e '.[bench]')")
    al_python = os.environ.get("AGL_BENCH_AGENTLIGHTNING_PYTHON") or python
    if importable(al_python, "agentlightning"):
        found.append(Subject("agentlightning", "agentlightning", al_python))
    else:
        missing.append(f"agentlightning (not importable by {al_python}; set AGL_BENCH_AGENTLIGHTNING_PYTHON)")
    return found, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh interpreters per project (default 15)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with agl_core installed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)

    probe = heavy_modules(args.python)  # first, so that it also warms the disk cache for agl_core
    found, missing = subjects(args.python)
    for _ in range(args.runs):
        for subject in found:
            subject.times_s.append(time_import(subject.python, subject.module))
    base = found[0].median_ms

    if args.json:
        report = {
            "runs": args.runs,
            "import_ms": {s.label: round(s.median_ms, 2) for s in found},
            "ratio_to_agl_core": {s.label: round(s.median_ms / base, 2) for s in found},
            "not_measured": missing,
            "after_import_agl_core": probe,
        }
        print(json.dumps(report, indent=2))
        return 0

    print(f"import time, median of {args.runs} fresh interpreters (python -I)")
    print(f"{'project':<24}{'module':<40}{'ms':>9}{'x agl_core':>12}")
    for s in found:
        print(f"{s.label:<24}{s.module:<40}{s.median_ms:>9.1f}{s.median_ms / base:>12.2f}")
    for line in missing:
        print(f"  not measured: {line}")
    print()
    print(f"after `import agl_core`: {probe['count']} new modules; heavy ones:")
    heavy = probe["heavy"]
    assert isinstance(heavy, dict)
    for pattern in HEAVY:
        hits = heavy.get(pattern) or []
        shown = "no" if not hits else "YES: " + ", ".join(hits[:5]) + (" ..." if len(hits) > 5 else "")
        print(f"  {pattern:<20}{shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
