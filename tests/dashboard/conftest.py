"""The real server on 127.0.0.1 with a store filled by real rollouts, and Debian's chromium to look at it.

Only the model server is fake (FakeOpenAI behind the real gateway). A missing
chromium fails the browser tests with the reason; it never skips them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agl_core.testing import FakeOpenAI
from agl_trainer.gateway import OpenAIBackend
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer

from . import chromium, sample_runs

TOKEN = "dash-s3cret"


@pytest.fixture(scope="session", autouse=True)
def openai_instrumented() -> Iterator[None]:
    """agl's plain OpenAI plugin on for the whole suite, as a user's agent would have it."""
    from agl_core.openai_client import OpenAIInstrumentor

    plugin = OpenAIInstrumentor()
    if not plugin.is_instrumented_by_opentelemetry:
        plugin.instrument(skip_dep_check=True)
    yield
    plugin.uninstrument()


class Filled:
    """A started server whose store holds :data:`sample_runs.QUESTIONS` as rollouts, and curves."""

    def __init__(self, thread: ServerThread, runs: list[Any], token: str | None) -> None:
        self.thread = thread
        self.url = thread.url
        self.server = thread.server
        self.runs = runs
        self.token = token


def _filled(db: Path, token: str | None) -> Iterator[Filled]:
    with FakeOpenAI(script=sample_runs.script) as fake:
        server = TrainerServer(ServerConfig(db_path=str(db), port=0, token=token), OpenAIBackend(fake.url))
        thread = ServerThread(server).start()
        try:
            runs = sample_runs.fill(thread.url, token)
            sample_runs.record_curves(server)
            yield Filled(thread, runs, token)
        finally:
            thread.stop()


@pytest.fixture(scope="session")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Filled]:
    yield from _filled(tmp_path_factory.mktemp("open") / "agl.db", None)


@pytest.fixture(scope="session")
def filled_with_token(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Filled]:
    yield from _filled(tmp_path_factory.mktemp("token") / "agl.db", TOKEN)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One chromium for the suite (a fresh profile); each test opens its own pages."""
    problem = chromium.missing()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    with chromium.browser_context(viewport={"width": 1400, "height": 1000}) as ctx:
        yield ctx


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab (its own sessionStorage) that fails the test on any request beyond 127.0.0.1."""
    tab = browser.new_page()
    tab.set_default_timeout(15_000)
    tab.requests_seen = []
    tab.console_errors = []
    tab.on("request", lambda r: tab.requests_seen.append(r.url))
    tab.on("console", lambda m: tab.console_errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: tab.console_errors.append(str(e)))
    yield tab
    tab.close()
