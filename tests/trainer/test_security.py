"""The bearer-token check of the server has no bypass, on every route, and compares in constant time.

The routes are not listed by hand: they are read from the running app (gateway,
task, rollout, model, metrics and dashboard routes alike), so a route added later
is checked too. Each gets every malformed or wrong ``Authorization`` header we
could think of, sent as raw bytes through real uvicorn, and must answer 401 (or
400 where the HTTP layer itself refuses the header); the right token must get
past the check on every route, so the test can fail. Only ``/healthz`` and the
dashboard's static page and script are open, and they carry no data.
"""

from __future__ import annotations

import ast
import base64
import http.client
import inspect
import json
import re
import textwrap
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from starlette.routing import Mount, Route

from agl_core.testing import FakeOpenAI
from agl_trainer import api
from agl_trainer.server import DASHBOARD_FILES, ServerThread

from .conftest import ServerFactory

TOKEN = "s3cret-Tok3n-0123456789"

BAD_HEADERS: dict[str, list[bytes] | None] = {
    "missing": None,
    "empty": [b""],
    "scheme only": [b"Bearer"],
    "scheme and a space": [b"Bearer "],
    "no scheme": [TOKEN.encode()],
    "basic scheme, token as password": [b"Basic " + base64.b64encode(f"agl:{TOKEN}".encode())],
    "basic scheme, token as is": [b"Basic " + TOKEN.encode()],
    "token scheme": [b"Token " + TOKEN.encode()],
    "lower-case scheme, wrong token": [b"bearer wrong"],
    "upper-case scheme, wrong token": [b"BEARER wrong"],
    "two spaces": [b"Bearer  " + TOKEN.encode()],
    "tab": [b"Bearer\t" + TOKEN.encode()],
    "token prefix": [b"Bearer " + TOKEN[:-1].encode()],
    "token suffix": [b"Bearer " + TOKEN.encode() + b"x"],
    "token and more words": [b"Bearer " + TOKEN.encode() + b" extra"],
    "token twice": [b"Bearer " + TOKEN.encode() + b"," + TOKEN.encode()],
    "upper-cased token": [b"Bearer " + TOKEN.upper().encode()],
    "unicode look-alike token": [b"Bearer " + TOKEN.replace("e", "\u0435").encode()],  # Cyrillic e
    "latin-1 token": [b"Bearer " + TOKEN.encode("latin-1") + "\u00e9".encode("latin-1")],
    "nul after the token": [b"Bearer " + TOKEN.encode() + b"\x00"],
    "wrong first of two headers": [b"Bearer wrong", b"Bearer " + TOKEN.encode()],
    "only the scheme's prefix": [b"Bear " + TOKEN.encode()],
}
OTHER_PLACES = {  # the token anywhere but the Authorization header
    "query string": ("?token=" + TOKEN, {}),
    "api-key header": ("", {"x-api-key": TOKEN.encode(), "api-key": TOKEN.encode()}),
    "cookie": ("", {"cookie": f"token={TOKEN}".encode()}),
    "proxy-authorization": ("", {"proxy-authorization": b"Bearer " + TOKEN.encode()}),
}


def app_routes(app: Any) -> Iterator[tuple[str, str]]:
    """(method, concrete path) for every HTTP route of the app behind the auth middleware, mounts included."""
    inner = getattr(app, "app", app)

    def walk(routes: list[Any], prefix: str) -> Iterator[tuple[str, str]]:
        for route in routes:
            if isinstance(route, Mount):
                yield from walk(list(route.routes), prefix + route.path)
            elif isinstance(route, Route):
                path = re.sub(r"\{[^}]+\}", "x", prefix + route.path)
                for method in sorted(route.methods or {"GET"}):
                    yield method, path

    yield from walk(list(inner.routes), "")


def send(url: str, method: str, path: str, headers: dict[str, bytes], auth: list[bytes] | None) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for value in auth or []:
            conn.putheader("Authorization", value)
        for name, value in headers.items():
            conn.putheader(name, value)
        body = b"{}" if method in ("POST", "PUT", "PATCH") else b""
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@pytest.fixture(scope="module")
def guarded_server() -> Iterator[ServerThread]:
    """One server with a token for the whole module (a few hundred requests)."""
    import tempfile
    from pathlib import Path

    from agl_trainer.gateway import GatewayConfig, OpenAIBackend
    from agl_trainer.server import ServerConfig, TrainerServer

    with FakeOpenAI() as fake, tempfile.TemporaryDirectory() as tmp:
        cfg = ServerConfig(db_path=str(Path(tmp) / "agl.db"), port=0, gateway=GatewayConfig(), token=TOKEN)
        thread = ServerThread(TrainerServer(cfg, OpenAIBackend(fake.url, timeout_s=5.0))).start()
        try:
            yield thread
        finally:
            thread.stop()


def _guarded(server: ServerThread) -> list[tuple[str, str]]:
    return [(m, p) for m, p in app_routes(server.server.app) if p not in OPEN and m != "HEAD"]


OPEN = frozenset({"/healthz"}) | DASHBOARD_FILES


def test_the_route_walk_sees_every_kind_of_route(guarded_server: ServerThread) -> None:
    paths = {p for _, p in app_routes(guarded_server.server.app)}
    for must in ("/v1/chat/completions", "/v1/tasks", "/v1/tasks/lease", "/v1/rollouts", "/v1/rollouts/x/spans",
                 "/v1/model", "/v1/metrics", "/healthz"):
        assert must in paths, sorted(paths)
    assert len(_guarded(guarded_server)) >= 20


@pytest.mark.parametrize("case", list(BAD_HEADERS), ids=list(BAD_HEADERS))
def test_no_malformed_or_wrong_token_gets_through_on_any_route(guarded_server: ServerThread, case: str) -> None:
    auth = BAD_HEADERS[case]
    let_through = {}
    for method, path in _guarded(guarded_server):
        status = send(guarded_server.url, method, path, {}, auth)
        if status not in (400, 401):
            let_through[f"{method} {path}"] = status
        elif status == 400:  # only the HTTP layer may refuse it first, never a handler after the check
            assert case == "nul after the token", (method, path, status)
    assert let_through == {}, f"{case!r} got past the token check"


@pytest.mark.parametrize("place", list(OTHER_PLACES), ids=list(OTHER_PLACES))
def test_the_token_counts_only_in_the_authorization_header(guarded_server: ServerThread, place: str) -> None:
    query, headers = OTHER_PLACES[place]
    statuses = {f"{m} {p}": send(guarded_server.url, m, p + query, headers, None)
                for m, p in _guarded(guarded_server)}
    assert set(statuses.values()) == {401}, statuses


def test_the_right_token_gets_past_the_check_on_every_route(guarded_server: ServerThread) -> None:
    """The control: each guarded route exists and the check lets the right token through (never 401)."""
    statuses = {f"{m} {p}": send(guarded_server.url, m, p, {}, [b"Bearer " + TOKEN.encode()])
                for m, p in _guarded(guarded_server) if not p.endswith("/lease")}  # lease waits for a task
    assert 401 not in statuses.values(), statuses


def test_a_401_says_what_to_send_and_never_echoes_the_token(guarded_server: ServerThread) -> None:
    parts = urlsplit(guarded_server.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    conn.request("GET", "/v1/tasks", headers={"Authorization": f"Bearer {TOKEN}x"})
    response = conn.getresponse()
    body = response.read().decode()
    conn.close()
    assert response.status == 401 and response.getheader("WWW-Authenticate") == "Bearer"
    assert TOKEN not in body and "token" in json.loads(body)["error"]["message"]


def test_only_health_and_the_dashboards_static_files_are_open(guarded_server: ServerThread) -> None:
    for method, path in app_routes(guarded_server.server.app):
        if path in OPEN:
            assert "{" not in path and method in ("GET", "HEAD")
            assert send(guarded_server.url, method, path, {}, None) == 200
    assert {p for p in OPEN if not p.startswith("/healthz")}.isdisjoint({"/v1/tasks", "/v1/rollouts"})


def test_the_token_is_compared_in_constant_time() -> None:
    """``hmac.compare_digest`` and no ``==``/``!=``/``in``/``startswith`` on the header or the token."""
    source = textwrap.dedent(inspect.getsource(api.BearerAuth))
    tree = ast.parse(source)
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "hmac.compare_digest" in calls
    secret_names = {"given", "expected", "token", "self.expected"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and not all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            names = {ast.unparse(x) for x in [node.left, *node.comparators]}
            assert not names & secret_names, f"non-constant-time compare: {ast.unparse(node)}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "startswith", "endswith", "find", "index"):
            assert ast.unparse(node.func.value) not in secret_names, ast.unparse(node)


def test_the_server_refuses_to_listen_beyond_loopback_without_a_token(make_server: ServerFactory,
                                                                      fake: FakeOpenAI) -> None:
    from agl_trainer.server import check_bind

    for host in ("0.0.0.0", "::", "192.168.1.10", "example.internal"):
        with pytest.raises(ValueError, match="without a bearer token"):
            check_bind(host, None)
        with pytest.raises(ValueError, match="without a bearer token"):
            check_bind(host, "")
        check_bind(host, TOKEN)  # with one it may
    check_bind("127.0.0.1", None)
