"""The OTLP suite's set-up: a fake model server and a real ``agl serve`` on 127.0.0.1 relaying to it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from otlp_harness import SCRIPT, TOKEN, Agl  # noqa: E402

from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_trainer.gateway import GatewayConfig, OpenAIBackend  # noqa: E402
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer  # noqa: E402


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAI(SCRIPT, model="fake-model") as srv:
        yield srv


@pytest.fixture
def agl(tmp_path: Path, fake: FakeOpenAI) -> Iterator[Agl]:
    config = ServerConfig(db_path=str(tmp_path / "agl.db"), port=0, token=TOKEN, sweep_interval_s=0.2,
                          gateway=GatewayConfig(served_model="fake-model"))
    thread = ServerThread(TrainerServer(config, OpenAIBackend(fake.url, timeout_s=10.0))).start()
    try:
        yield Agl(thread)
    finally:
        thread.stop()
