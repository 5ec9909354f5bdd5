"""The dashboard's JSON routes and files over HTTP: rollout pages, per-agent stats, the token, the headers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from agl_core.testing import FakeOpenAI
from agl_trainer.gateway import OpenAIBackend
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer

from . import sample_runs
from .conftest import TOKEN, Filled


def test_rollout_pages_are_newest_first_and_filter_by_status(filled: Filled) -> None:
    with httpx.Client(base_url=filled.url) as client:
        page = client.get("/v1/dashboard/rollouts").json()
        ids = [r["id"] for r in page["data"]]
        assert ids == [run.id for run in reversed(filled.runs)]
        assert page["total"] == len(sample_runs.QUESTIONS)
        assert page["counts"] == {"succeeded": 4, "failed": 2}
        first = {r["task_id"]: r for r in page["data"]}
        assert first["calc-2"]["final_reward"] == 1.0 and first["calc-2"]["status"] == "succeeded"
        assert first["calc-4"]["final_reward"] == 0.0
        assert first["calc-3"]["status"] == "failed" and "ZeroDivisionError" in first["calc-3"]["error"]
        assert first["calc-5"]["final_reward"] is None
        # the rollout, the solver agent with 2 LLM calls and a tool call, the checker with 1 call, the reward
        assert first["calc-1"]["spans"] == 8

        two = client.get("/v1/dashboard/rollouts", params={"limit": 2, "offset": 2}).json()
        assert [r["id"] for r in two["data"]] == ids[2:4] and two["total"] == 6
        failed = client.get("/v1/dashboard/rollouts", params={"status": "failed"}).json()
        assert sorted(r["task_id"] for r in failed["data"]) == ["calc-3", "calc-5"] and failed["total"] == 2
        both = client.get("/v1/dashboard/rollouts", params=[("status", "failed"), ("status", "succeeded")]).json()
        assert both["total"] == 6

        for params, param in [({"status": "done"}, "status"), ({"limit": "x"}, "limit"),
                              ({"limit": 501}, "limit"), ({"offset": -1}, "offset"), ({"offset": 2**63}, "offset")]:
            bad = client.get("/v1/dashboard/rollouts", params=params)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        assert "running, succeeded, failed, timeout, cancelled" in \
            client.get("/v1/dashboard/rollouts", params={"status": "done"}).json()["error"]["message"]


def test_stats_count_llm_and_tool_calls_per_agent(filled: Filled) -> None:
    stats = httpx.get(filled.url + "/v1/stats").json()
    agents = {a["agent"]: a for a in stats["agents"]}
    assert set(agents) == {"solver", "checker"}
    solver, checker = agents["solver"], agents["checker"]
    # six questions; the one the model refuses (500) makes one failed call and nothing else
    assert solver["rollouts"] == 6 and solver["llm_calls"] == 10 and solver["llm_errors"] == 1
    assert solver["llm_error_rate"] == pytest.approx(0.1)
    # five calculator calls: one raises, one returns an error
    assert solver["tool_calls"] == 5 and solver["tool_errors"] == 2 and solver["tool_error_rate"] == 0.4
    # the checker ran after the solver in the four rollouts that did not fail
    assert checker == {"agent": "checker", "rollouts": 4, "llm_calls": 4, "llm_errors": 0, "tool_calls": 0,
                       "tool_errors": 0, "llm_error_rate": 0.0, "tool_error_rate": 0.0}
    assert stats["rollouts"] == {"total": 6, "by_status": {"failed": 2, "succeeded": 4}}
    assert stats["window"] == {"last": 1000, "rollouts": 6, "reward_mean": pytest.approx((1.0 + 1.0 + 0.0 + 0.5) / 4)}

    # the newest two rollouts only: calc-6 (all fine) and calc-5 (the model's 500)
    two = httpx.get(filled.url + "/v1/stats", params={"last": 2}).json()
    assert two["window"] == {"last": 2, "rollouts": 2, "reward_mean": 0.5} and two["rollouts"]["total"] == 6
    solver = next(a for a in two["agents"] if a["agent"] == "solver")
    assert (solver["rollouts"], solver["llm_calls"], solver["llm_errors"], solver["tool_calls"]) == (2, 3, 1, 1)
    bad = httpx.get(filled.url + "/v1/stats", params={"last": "all"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "last"


def test_stats_follow_new_rollouts(tmp_path: Path) -> None:
    with FakeOpenAI(script=sample_runs.script) as fake:
        server = TrainerServer(ServerConfig(db_path=str(tmp_path / "agl.db"), port=0), OpenAIBackend(fake.url))
        with ServerThread(server) as thread:
            assert server.dashboard.stats()["agents"] == []
            sample_runs.fill(thread.url)
            before = server.dashboard.stats()
            assert server.dashboard.stats() == before  # nothing new: the same answer (from the cache)
            sample_runs.fill(thread.url)
            after = server.dashboard.stats()
            assert after["rollouts"]["total"] == 12
            assert [a["llm_calls"] for a in after["agents"]] == [2 * a["llm_calls"] for a in before["agents"]]


def test_stats_on_an_empty_store(tmp_path: Path) -> None:
    server = TrainerServer(ServerConfig(db_path=str(tmp_path / "empty.db")), OpenAIBackend("http://127.0.0.1:9/v1"))
    try:
        assert server.dashboard.stats() == {"agents": [], "window": {"last": 1000, "rollouts": 0, "reward_mean": None},
                                            "rollouts": {"total": 0, "by_status": {}}}
        assert server.dashboard.rollouts_page([], 25, 0) == {"data": [], "total": 0, "offset": 0, "limit": 25,
                                                             "counts": {}}
    finally:
        server.close()


def test_page_loads_without_the_token_but_no_data_does(filled_with_token: Filled) -> None:
    url = filled_with_token.url
    for path in ("/", "/dashboard", "/dashboard/", "/dashboard/app.js", "/dashboard/app.css"):
        r = httpx.get(url + path)
        assert r.status_code == 200, path
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert r.headers["referrer-policy"] == "no-referrer"
        assert filled_with_token.runs[0].id not in r.text  # the page itself holds no data
    assert httpx.get(url + "/").headers["content-type"].startswith("text/html")
    assert httpx.get(url + "/dashboard/app.js").headers["content-type"].startswith("text/javascript")
    for path in ("/v1/dashboard/rollouts", "/v1/stats", "/v1/metrics", f"/v1/rollouts/{filled_with_token.runs[0].id}",
                 "/dashboard/other.js", "/dashboard/../v1/stats"):
        assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    ok = httpx.get(url + "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["rollouts"]["total"] == 6


def test_the_page_fetches_nothing_from_elsewhere(filled: Filled) -> None:
    html = httpx.get(filled.url + "/").text
    js = httpx.get(filled.url + "/dashboard/app.js").text
    css = httpx.get(filled.url + "/dashboard/app.css").text
    for text in (html, js, css):
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
        assert "@import" not in text and "innerHTML" not in text
