"""docs/migrating-from-agent-lightning.md names only what exists: every ``agl.NAME`` of its agl column is exported by
agl_core, every config key it names is a key of ``agl train``'s config, every CLI flag one of its command's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import agl_core
from agl_trainer.config import Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-agent-lightning.md"


def agl_column() -> list[str]:
    """The second cell of each mapping table's rows (agl's side)."""
    cells = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        parts = [p.strip() for p in re.split(r"(?<!\\)\|", line)]
        if line.startswith("|") and len(parts) >= 4 and not set(parts[2]) <= set("-"):
            cells.append(parts[2])
    return cells


def config_key(path: str) -> bool:
    model: Any = Config
    for part in path.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        annotation = fields[part].annotation
        model = next((a for a in getattr(annotation, "__args__", ()) if hasattr(a, "model_fields")), annotation)
    return True


def test_every_agl_name_in_the_mapping_exists() -> None:
    names = {m for cell in agl_column() for m in re.findall(r"\bagl\.([A-Za-z_]\w*)", cell)}
    assert {"rollout_fn", "emit_reward", "TransitionBuilder", "policy", "resources"} <= names
    assert sorted(n for n in names if not hasattr(agl_core, n)) == []


def test_every_config_key_in_the_mapping_exists() -> None:
    sections = "data|validation|algorithm|backend|workers|run|server|air|credit"
    keys = {m for cell in agl_column() for m in re.findall(rf"`((?:{sections})\.\w+(?:\.\w+)?)`", cell)}
    assert {"validation.every", "validation.at_start", "data.group_size", "validation.sampling"} <= keys
    assert sorted(k for k in keys if not config_key(k)) == []


@pytest.mark.parametrize(("command", "flags"), [
    (["agl_trainer.cli", "serve"], ["--agent-match", "--upstream"]),
    (["agl_core.worker"], ["--no-gateway-env", "--server", "--agent"]),
])
def test_the_cli_flags_it_names_exist(command: list[str], flags: list[str]) -> None:
    text = DOC.read_text(encoding="utf-8")
    module, *rest = command
    if module == "agl_trainer.cli":
        from click.testing import CliRunner

        from agl_trainer.cli import serve

        help_text = CliRunner().invoke(serve, ["--help"]).output
    else:
        help_text = subprocess.run([sys.executable, "-m", module, *rest, "--help"], capture_output=True, text=True,
                                   timeout=60).stdout
    for flag in flags:
        assert flag in text and flag in help_text, flag
