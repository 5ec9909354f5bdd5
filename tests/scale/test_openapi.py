"""schemathesis against the live server's OpenAPI document: no 500, no hang, answers as documented.

The server runs on uvicorn at 127.0.0.1 with FakeOpenAI as its model backend,
with a bearer token (the generated requests carry it, and requests without it
must get 401), and its queue holds enough tasks that a generated lease never waits for one.
Generation is derandomised and bounded (``max_examples`` per operation, a
request timeout), so CI runs the same cases every time; ``AGL_FULL=1`` runs
more. Checks: no 5xx but the gateway's documented 502/504 from the backend,
every status and content type documented, every body matching its schema.

Then every operation with a body again, each generated body poisoned at one
place drawn at random: nesting 300 to 100,000 levels deep, a lone UTF-16
surrogate, ``NaN`` or ``-Infinity``. Each must be a 400 naming the place
(``body`` for nesting too deep to walk), whatever the route; and paths and
query strings carrying bytes that are not UTF-8 get no 5xx either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from scale_agents import model_reply
from scale_harness import FULL
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from agl_core.testing import FakeOpenAI
from agl_trainer.dashboard import OPEN_PATHS as DASHBOARD_FILES
from agl_trainer.gateway import OpenAIBackend
from agl_trainer.openapi import openapi_document
from agl_trainer.queue import TaskSpec
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer

TOKEN = "scale-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# unknown query parameters are ignored, as by most servers: generating them tests nothing of ours;
# the token goes in as the document's bearer scheme, so schemathesis also sends requests without it
CONFIG = schemathesis.Config.from_dict({"generation": {"allow-extra-parameters": False},
                                        "auth": {"openapi": {"bearer": {"bearer": TOKEN}}}})
schema = schemathesis.openapi.from_dict(openapi_document(), config=CONFIG)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
EXAMPLES = 300 if FULL else 40
TIMEOUT_S = 15.0
STATUSES: dict[str, set[int]] = {}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    db = tmp_path_factory.mktemp("openapi") / "agl.db"
    with FakeOpenAI(script=model_reply, model="policy") as fake:
        config = ServerConfig(db_path=str(db), port=0, sweep_interval_s=0.2, token=TOKEN)
        thread = ServerThread(TrainerServer(config, OpenAIBackend(fake.url, timeout_s=10.0))).start()
        try:
            thread.server.queue.enqueue([TaskSpec({"n": i}) for i in range(20 * EXAMPLES)])
            yield thread
        finally:
            thread.stop()


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
def test_server_answers_every_generated_request_as_documented(case: Any, live: ServerThread) -> None:
    response = case.call_and_validate(base_url=live.url, checks=CHECKS, timeout=TIMEOUT_S)
    if case.method.upper() == case.operation.method.upper():  # not one of the unsupported-method probes
        STATUSES.setdefault(case.operation.label, set()).add(response.status_code)


POISONS = [("deep", "[" * 300 + "]" * 300), ("deep", "[" * 100_000 + "]" * 100_000),
           ("deep", '{"a":' * 5_000 + "1" + "}" * 5_000), ("surrogate", '"\\ud800"'), ("surrogate", '"x \\udfff y"'),
           ("constant", "NaN"), ("constant", "-Infinity")]
POISON_EXAMPLES = 60 if FULL else 12
_MARK = "\u0000agl-poison\u0000"
# JSON bodies of this API (OTLP's /v1/traces answers in its own protocol's shape: tests/otlp)
BODY_OPERATIONS = [(path, method) for path, ops in openapi_document()["paths"].items() for method, op in ops.items()
                   if "requestBody" in op and "application/x-protobuf" not in op["requestBody"]["content"]]


def _places(value: Any, path: str = "") -> list[str]:
    """Every place in a JSON value, as the server names fields: ``a.b[2]``, "" for the whole."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _places(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _places(v, f"{path}[{i}]")
    return out


def _put(value: Any, path: str, new: Any) -> Any:
    """``value`` with the place ``path`` (one of its :func:`_places`) replaced by ``new``."""
    def walk(v: Any, here: str) -> Any:
        if here == path:
            return new
        if isinstance(v, dict):
            return {k: walk(x, f"{here}.{k}" if here else str(k)) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, f"{here}[{i}]") for i, x in enumerate(v)]
        return v
    return walk(value, "")


@pytest.mark.parametrize(("path", "method"), BODY_OPERATIONS)
def test_deep_nesting_surrogates_and_nan_anywhere_are_a_400_naming_the_place(live: ServerThread, path: str,
                                                                               method: str) -> None:
    operation = schema[path][method.upper()]

    @settings(max_examples=POISON_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(), poison=st.sampled_from(POISONS), where=st.integers(0, 10**6))
    def poisoned(case: Any, poison: tuple[str, str], where: int) -> None:
        body = case.body if isinstance(case.body, (dict, list)) else {}
        places = _places(body)
        place = places[where % len(places)]
        text = json.dumps(_put(body, place, _MARK), ensure_ascii=False).replace(json.dumps(_MARK), poison[1])
        url = live.url + case.formatted_path
        reply = httpx.request(method, url, params=case.query, content=text.encode(),
                              headers={**AUTH, "Content-Type": "application/json"}, timeout=TIMEOUT_S)
        assert reply.status_code == 400, f"{method} {case.formatted_path} with {poison[0]} at {place!r}: " \
                                         f"{reply.status_code} {reply.text[:300]}"
        param = reply.json()["error"]["param"]
        expected = "body" if poison[0] == "deep" or place == "" else place
        assert param == expected, f"{method} {case.formatted_path}: {poison[0]} at {place!r} named {param!r}"

    poisoned()


@pytest.mark.parametrize("target", ["/v1/tasks/%ED%A0%80", "/v1/rollouts/%ED%A0%80", "/v1/rollouts/%ED%A0%80/spans",
                                    "/v1/rollouts?task_id=%ED%A0%80", "/v1/rollouts?after=%ED%A0%80",
                                    "/v1/transitions?after=%00%FF", "/v1/tasks?after=%ED%A0%80"])
def test_paths_and_queries_that_are_not_utf8_get_no_5xx(live: ServerThread, target: str) -> None:
    reply = httpx.get(live.url + target, headers=AUTH, timeout=TIMEOUT_S)
    assert reply.status_code < 500, reply.text
    reply = httpx.post(live.url + "/v1/leases/%ED%A0%80/release", headers=AUTH, timeout=TIMEOUT_S)
    assert reply.status_code in (400, 409), reply.text


def test_generated_requests_got_through_to_every_operation() -> None:
    """Not all 401s or 400s: some generated request of each operation got past the token and the checks
    (a 2xx, or a 404/409 where the path names a lease or rollout that random ids never hit)."""
    assert len(STATUSES) == sum(len(ops) for ops in openapi_document()["paths"].values()), STATUSES
    refused = {op: codes for op, codes in STATUSES.items() if codes <= {400, 401, 413}}
    assert not refused, refused


def test_every_route_of_the_app_is_in_the_document(tmp_path: Path) -> None:
    with FakeOpenAI() as fake:
        server = TrainerServer(ServerConfig(db_path=str(tmp_path / "agl.db")), OpenAIBackend(fake.url))
        try:
            app: Any = server.app
            routes = {(r.path.replace(":path}", "}"), m.lower()) for r in app.routes if isinstance(r, Route)
                      # the dashboard's page and static files are not the API (its JSON routes are)
                      if r.path not in DASHBOARD_FILES
                      for m in (r.methods or ()) if m != "HEAD"}
        finally:
            server.close()
    paths = openapi_document()["paths"]
    documented = {(path, method) for path, ops in paths.items() for method in ops}
    assert routes - documented == set(), "routes missing from the OpenAPI document"
    assert documented - routes == set(), "the OpenAPI document names routes the server does not have"


def test_the_server_serves_its_document(live: ServerThread) -> None:
    reply = httpx.get(f"{live.url}/openapi.json", headers=AUTH, timeout=TIMEOUT_S)
    assert reply.status_code == 200 and reply.json() == openapi_document()
    assert reply.json()["components"]["schemas"]["Rollout"]["required"] == ["id", "task_id"]


@pytest.mark.parametrize(("method", "path", "body", "param"), [
    # each of these was a 500 (or, for repeat, a process filling its memory) before schemathesis found it
    ("GET", "/v1/tasks?limit=9223372036854775808", None, "limit"),
    ("GET", "/v1/rollouts?status=null", None, "status"),
    ("GET", "/v1/trajectories?status=done", None, "status"),
    ("POST", "/v1/model", {"version": 2**63}, "version"),
    ("POST", "/v1/metrics", {"step": 2**63, "values": {"loss": 1.0}}, "step"),
    ("POST", "/v1/tasks", {"tasks": [{"task": 1}], "max_attempts": 2**63}, "max_attempts"),
    ("POST", "/v1/tasks", {"tasks": [{"task": 1}], "repeat": 10**9}, "repeat"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": {}}]}, "messages[0].role"),
    ("POST", "/v1/rollouts", {"id": "r", "task_id": "t", "attempt": 2**70}, "Rollout.attempt"),
    ("POST", "/v1/rollouts", {"id": "r", "task_id": "t", "spans": [
        {"span_id": "a", "trace_id": "b", "name": "n", "start_ns": 2**70, "end_ns": 2**70}]},
     "Rollout.spans[0].start_ns"),
])
def test_what_schemathesis_found_is_a_400_naming_the_field(live: ServerThread, method: str, path: str, body: Any,
                                                          param: str) -> None:
    reply = httpx.request(method, live.url + path, json=body, headers=AUTH, timeout=TIMEOUT_S)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
