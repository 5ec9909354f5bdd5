"""The real server on uvicorn at 127.0.0.1 (an ephemeral port), with FakeOpenAI as the vLLM-like backend.

Only the network edge is fake: the model server. The server, gateway, store,
queue, HttpStore, worker and the OpenAI client are the real ones.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_core.testing import FakeOpenAI
from agl_trainer.gateway import Backend, GatewayConfig, OpenAIBackend
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer

HERE = Path(__file__).parent
REPO = HERE.parent.parent


@pytest.fixture(scope="session", autouse=True)
def openai_instrumented() -> Iterator[None]:
    """The plain OpenAI plugin on for the whole suite: it sends the traceparent the gateway keys on."""
    from agl_core.openai_client import OpenAIInstrumentor

    plugin = OpenAIInstrumentor()
    if not plugin.is_instrumented_by_opentelemetry:
        plugin.instrument(skip_dep_check=True)
    yield
    plugin.uninstrument()


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as srv:
        yield srv


ServerFactory = Callable[..., ServerThread]


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """``make_server(backend_or_fake, **config)``: a started server; all are stopped at teardown."""
    started: list[ServerThread] = []

    def make(backend: Backend | FakeOpenAI, *, gateway: GatewayConfig | None = None, db: Path | None = None,
             **config: Any) -> ServerThread:
        if isinstance(backend, FakeOpenAI):
            backend = OpenAIBackend(backend.url, timeout_s=config.pop("backend_timeout_s", 30.0))
        cfg = ServerConfig(db_path=str(db or tmp_path / "agl.db"), port=0, gateway=gateway or GatewayConfig(),
                           **config)
        thread = ServerThread(TrainerServer(cfg, backend)).start()
        started.append(thread)
        return thread

    yield make
    for thread in started:
        if thread._thread.is_alive():
            thread.stop()


@pytest.fixture
def subprocess_env(tmp_path: Path) -> dict[str, str]:
    """Environment for a worker or server in a subprocess: this checkout and the test agents importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO / "src"), str(REPO / "trainer"),
                                         env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["AGL_TEST_DIR"] = str(tmp_path)
    return env


PYTHON = sys.executable
