"""Training metrics on the server: record_metrics in process, POST/GET /v1/metrics over HTTP, across restarts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl_core.testing import FakeOpenAI
from agl_trainer.gateway import OpenAIBackend
from agl_trainer.server import ServerConfig, TrainerServer

from .conftest import ServerFactory


def _server(db: Path, fake_url: str = "http://127.0.0.1:9/v1") -> TrainerServer:
    return TrainerServer(ServerConfig(db_path=str(db), port=0), OpenAIBackend(fake_url))


def test_record_and_read_by_step_and_survive_restart(tmp_path: Path) -> None:
    db = tmp_path / "agl.db"
    server = _server(db)
    server.record_metrics(2, {"reward_mean": 0.75, "loss": 0.1})
    server.record_metrics(1, {"reward_mean": 0.5, "loss": 0.12})
    server.record_metrics(2, {"loss": 0.09, "kl": 0.001})  # a step recorded again: updates, keeps the rest
    data = server.metrics()
    assert [d["step"] for d in data] == [1, 2]
    assert data[0]["values"] == {"reward_mean": 0.5, "loss": 0.12}
    assert data[1]["values"] == {"reward_mean": 0.75, "loss": 0.09, "kl": 0.001}
    assert all(isinstance(d["time"], float) and d["time"] > 1.7e9 for d in data)
    server.close()

    again = _server(db)
    assert again.metrics() == data
    again.close()


def test_numpy_numbers_are_stored_as_plain_numbers(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")  # a trainer's loss and reward often come out of numpy or torch .item()
    server = _server(tmp_path / "agl.db")
    server.record_metrics(np.int64(4), {"loss": np.float32(0.25), "reward_mean": np.float64(0.5)})
    assert server.metrics()[0]["step"] == 4 and server.metrics()[0]["values"] == {"loss": 0.25, "reward_mean": 0.5}
    with pytest.raises(ValueError, match="'values.loss'"):
        server.record_metrics(5, {"loss": np.float32("nan")})
    server.close()


@pytest.mark.parametrize(("step", "values", "names"), [
    (-1, {"loss": 1.0}, "'step'"),
    (True, {"loss": 1.0}, "'step'"),
    (1.5, {"loss": 1.0}, "'step'"),
    (1, [("loss", 1.0)], "'values'"),
    (1, {"": 1.0}, "''"),
    (1, {3: 1.0}, "3"),
    (1, {"loss": math.nan}, "'values.loss'"),
    (1, {"loss": math.inf}, "'values.loss'"),
    (1, {"loss": "0.1"}, "'values.loss'"),
    (1, {"loss": None}, "'values.loss'"),
    (1, {"ok": 1.0, "loss": False}, "'values.loss'"),
])
def test_bad_metrics_name_the_key_and_store_nothing(tmp_path: Path, step: Any, values: Any, names: str) -> None:
    server = _server(tmp_path / "agl.db")
    server.record_metrics(0, {"loss": 2.0})
    with pytest.raises(ValueError) as err:
        server.record_metrics(step, values)
    assert names in str(err.value)
    assert server.metrics()[0]["values"] == {"loss": 2.0} and len(server.metrics()) == 1
    server.close()


def test_post_and_get_over_http(make_server: ServerFactory) -> None:
    with FakeOpenAI() as fake:
        srv = make_server(fake, token="s3cret")
        auth = {"Authorization": "Bearer s3cret"}
        with httpx.Client(base_url=srv.url, headers=auth) as client:
            assert client.get("/v1/metrics").json() == {"data": []}
            r = client.post("/v1/metrics", json={"step": 3, "values": {"reward_mean": 0.5, "loss": 0.12}})
            assert r.status_code == 201, r.text
            client.post("/v1/metrics", json={"step": 1, "values": {"reward_mean": 0.25}})
            srv.server.record_metrics(2, {"reward_mean": 0.4})  # the in-process trainer's way
            data = client.get("/v1/metrics").json()["data"]
            assert [d["step"] for d in data] == [1, 2, 3]
            assert data[2]["values"] == {"reward_mean": 0.5, "loss": 0.12}
            assert data[0]["time"] >= data[2]["time"]  # the time a step was recorded: step 1 came after step 3

            bad = client.post("/v1/metrics", json={"step": 4, "values": {"loss": "high"}})
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "values.loss" and "finite number" in bad.json()["error"]["message"]
            missing = client.post("/v1/metrics", json={"values": {"loss": 1.0}})
            assert missing.status_code == 400 and missing.json()["error"]["param"] == "step"
            assert client.post("/v1/metrics", json={"step": -2, "values": {}}).json()["error"]["param"] == "step"
            assert [d["step"] for d in client.get("/v1/metrics").json()["data"]] == [1, 2, 3]
        # the token guards the metrics like every other route
        assert httpx.get(srv.url + "/v1/metrics").status_code == 401
        assert httpx.post(srv.url + "/v1/metrics", json={"step": 9, "values": {"x": 1.0}}).status_code == 401
        assert [d["step"] for d in srv.server.metrics()] == [1, 2, 3]
