"""Fixtures of the CrewAI suite: crewai kept offline and quiet, agl's ``crewai`` and ``openai`` plugins on.

Set before crewai is imported: crewai's anonymous telemetry and its tracing are
off (``CREWAI_DISABLE_TELEMETRY``, ``CREWAI_TRACING_ENABLED``; never
``OTEL_SDK_DISABLED``, which would switch agl's spans off too), LiteLLM reads its
bundled model-cost map instead of fetching it, and crewai's app data goes to a
temporary folder. A guard on ``socket`` then fails any test that tries to reach
beyond 127.0.0.1 (a name lookup included), even when the library that tried
swallowed the error.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ["CREWAI_DISABLE_TELEMETRY"] = "true"
os.environ["CREWAI_TRACING_ENABLED"] = "false"
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ.setdefault("XDG_DATA_HOME", tempfile.mkdtemp(prefix="agl-crewai-data-"))
os.environ.setdefault("OPENAI_API_KEY", "sk-test-not-used")

import agl_core as agl  # noqa: E402
from agl_core import guard  # noqa: E402
from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_core.testing.fake_openai import Script  # noqa: E402

_outside: list[str] = []  # every attempt to reach beyond the loopback, in order
_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo


def _local(host: Any) -> bool:
    if host in (None, "localhost", b"localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def _check(sock: socket.socket, address: Any) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
        _outside.append(f"connect {address!r}")
        raise ConnectionRefusedError(f"the CrewAI suite stays on 127.0.0.1; refused {address!r}")


def _connect(self: socket.socket, address: Any) -> None:
    _check(self, address)
    _real_connect(self, address)


def _connect_ex(self: socket.socket, address: Any) -> int:
    _check(self, address)
    return _real_connect_ex(self, address)


def _getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    if not _local(host):
        _outside.append(f"lookup {host!r}")
        raise socket.gaierror(socket.EAI_NONAME, f"the CrewAI suite stays on 127.0.0.1; refused to look up {host!r}")
    return _real_getaddrinfo(host, *args, **kwargs)


socket.socket.connect = _connect  # type: ignore[method-assign]
socket.socket.connect_ex = _connect_ex  # type: ignore[method-assign]
socket.getaddrinfo = _getaddrinfo


def pytest_configure(config: pytest.Config) -> None:
    # crewai warns about its own deprecated fields on every crew it builds; they say nothing about agl
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:crewai")
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:crewai.*")


@pytest.fixture(autouse=True)
def _stays_on_loopback() -> Iterator[None]:
    before = len(_outside)
    yield
    assert _outside[before:] == [], "the test tried to reach beyond 127.0.0.1"


@pytest.fixture
def instrumented() -> Iterator[list[str]]:
    """The two plugins a CrewAI user gets from ``agl.instrument()``: ``crewai``, and ``openai`` beneath it."""
    agl.uninstrument()
    active = agl.instrument(["crewai", "openai"])
    assert list(active) == ["crewai", "openai"], active.skipped
    guard.reset_fault_counts()
    try:
        yield list(active)
    finally:
        agl.uninstrument()


@pytest.fixture
def crewai_only() -> Iterator[list[str]]:
    """agl's ``crewai`` plugin alone: the spans a custom LLM or LiteLLM's own route gets without the client plugin."""
    agl.uninstrument()
    active = agl.instrument(["crewai"])
    assert list(active) == ["crewai"], active.skipped
    guard.reset_fault_counts()
    try:
        yield list(active)
    finally:
        agl.uninstrument()


@pytest.fixture
def serve() -> Iterator[Callable[..., FakeOpenAI]]:
    """``serve(script)``: a running fake OpenAI-compatible server that says ``script``; stopped after the test."""
    servers: list[FakeOpenAI] = []

    def start(script: Script | None = None, **kwargs: Any) -> FakeOpenAI:
        srv = FakeOpenAI(script, **kwargs).start()
        servers.append(srv)
        return srv

    try:
        yield start
    finally:
        for srv in servers:
            srv.stop()
