"""Resources: what training may change, the agent reads; versioned by the server, recorded per rollout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

import agl_core as agl
from agl_core.testing import FakeOpenAI
from agl_core.worker import TaskClient, Worker

from .conftest import ServerFactory


def test_outside_training_the_agent_reads_its_defaults_or_the_config(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    seen: list[Any] = []

    @agl.rollout_fn(resources={"system_prompt": "default", "k": 1})
    def agent(task: Any, resources: Any) -> float:
        seen.append((dict(resources), dict(agl.resources())))
        return 1.0

    agent({"id": "t"})
    assert seen[-1] == ({"system_prompt": "default", "k": 1},) * 2
    assert agent.last_run.rollout.resources_version is None
    file = tmp_path / "res.json"
    file.write_text(json.dumps({"system_prompt": "from config"}))
    monkeypatch.setenv("AGL_RESOURCES", str(file))
    agent({"id": "t"})
    assert seen[-1][0] == {"system_prompt": "from config", "k": 1}
    assert dict(agl.resources()) == {"system_prompt": "from config"}  # outside any rollout
    monkeypatch.setenv("AGL_RESOURCES", "[1]")
    with pytest.raises(agl.SchemaError, match="AGL_RESOURCES"):
        agl.resources()


def test_server_versions_resources_and_refuses_bad_ones(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    url = make_server(fake).url
    assert httpx.get(url + "/v1/resources").status_code == 404
    one = httpx.post(url + "/v1/resources", json={"resources": {"system_prompt": "a"}}).json()
    two = httpx.post(url + "/v1/resources", json={"resources": {"system_prompt": "b"}, "metadata": {"round": 1}})
    assert (one["version"], two.status_code, two.json()["version"]) == (1, 201, 2)
    assert httpx.get(url + "/v1/resources").json()["resources"] == {"system_prompt": "b"}
    back = httpx.post(url + "/v1/resources/1", json={"current": True, "metadata": {"score": 0.5}}).json()
    assert back["current"] and back["metadata"] == {"score": 0.5}
    assert httpx.get(url + "/v1/resources").json()["version"] == 1
    page = httpx.get(url + "/v1/resources/history", params={"limit": 1}).json()
    assert [e["version"] for e in page["data"]] == [1] and page["next"] == "1"
    for body, param in (({"resources": [1]}, "resources"), ({"resources": {" ": 1}}, "resources"),
                        ({"resources": {}, "metadata": 3}, "metadata"), ({"resources": {}, "current": 1}, "current"),
                        ({}, "resources")):
        r = httpx.post(url + "/v1/resources", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert httpx.get(url + "/v1/resources/99").status_code == 404
    # digits Python's int() reads but a version is not: superscript one (int() fails), Arabic-Indic three (reads 3)
    for raw in ("x", "%C2%B9", "%D9%A3", "%EF%BC%91"):
        r = httpx.get(url + "/v1/resources/" + raw)
        assert r.status_code == 404 and r.json()["error"]["param"] == "version", (raw, r.text)
        r = httpx.post(url + "/v1/resources/" + raw, json={"current": True})
        assert r.status_code == 404 and r.json()["error"]["param"] == "version", (raw, r.text)
    assert httpx.get(url + "/v1/resources/history", params={"after": "\u0661"}).status_code == 400
    assert len(httpx.get(url + "/v1/resources/history").json()["data"]) == 2  # nothing refused was stored


def test_worker_fetches_the_current_version_per_rollout_and_the_rollout_records_it(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    seen: list[str] = []

    @agl.rollout_fn(resources={"system_prompt": "default"})
    def agent(task: Any, resources: Any) -> float:
        seen.append(resources["system_prompt"])
        return 1.0

    tasks = TaskClient(srv.url)
    tasks.enqueue([{"id": "a"}])
    with Worker(srv.url, agent, set_openai_env=False, instrument=False, max_tasks=1, poll_s=0.2) as w:
        w.run()
    httpx.post(srv.url + "/v1/resources", json={"resources": {"system_prompt": "v1"}})
    httpx.post(srv.url + "/v1/resources", json={"resources": {"system_prompt": "v2"}})
    tasks.enqueue([{"id": "b"}])
    with Worker(srv.url, agent, set_openai_env=False, instrument=False, max_tasks=1, poll_s=0.2) as w:
        w.run()
    assert seen == ["default", "v2"]
    versions = {r.task_id: r.resources_version for r in srv.server.store.rollouts()}
    assert versions == {"a": None, "b": 2}
