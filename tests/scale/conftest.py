"""The scale suite: many workers and frameworks against one server, crashes, and schemathesis.

Only the network edge is fake: the model server (``agl_core.testing.FakeOpenAI``,
scripted by ``scale_agents.model_reply``). Server, gateway, queue, store,
workers, and the LangChain, OpenAI Agents SDK and OpenAI client code are real.
``AGL_FULL=1`` runs the full counts (1,000 rollouts over 64 workers); CI runs
shorter ones. ``AGL_SCALE_SEED`` replays a crash schedule.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_harness import Processes  # noqa: E402


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Start child processes with ``procs.start(...)``; all are killed when the test ends, however it ends."""
    children = Processes(tmp_path)
    try:
        yield children
    finally:
        children.close()
