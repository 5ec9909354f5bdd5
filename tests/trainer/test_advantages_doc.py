"""docs/credit-assignment.md's snippets are real API: each Python block runs, in order, and its asserts hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "credit-assignment.md"


def test_the_credit_assignment_page_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 4
    scope: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), scope)  # noqa: S102 - the page's own code, as a reader runs it
    printed = capsys.readouterr().out.splitlines()
    # what the page says each print shows
    assert printed == ["1.73 -0.58", "{'win': [1.0], 'lose': [-1.0, -1.0, -1.0]}", "{'win': 1.0, 'lose': 1.0}"]
