"""The address verl's launch path gives agl's workers for its gateway: one a Ray node elsewhere can route to.

Before, it was ``gethostbyname(gethostname())``: 127.0.0.1 on hosts whose ``/etc/hosts`` maps their
name there (this one does), so every worker on another node failed every call. Now it is Ray's
address of the node the loop runs on, ``backend.verl.gateway_host`` when set, and a loopback
address on more than one node stops the run before a worker starts. Needs Ray, not verl or a GPU.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

ray_util = pytest.importorskip("ray.util")

from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_trainer.config import ConfigError, validate  # noqa: E402
from agl_trainer.gateway import OpenAIBackend  # noqa: E402
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer  # noqa: E402
from agl_trainer.verl_backend import gateway_url  # noqa: E402

BASE: dict[str, Any] = {"data": {"path": "tasks.jsonl"}, "agent": "my_pkg.agent:solve",
                        "backend": {"name": "verl", "model": "Qwen/Qwen2.5-0.5B-Instruct"}}


def _config(**verl: Any) -> Any:
    return validate({**BASE, "backend": {**BASE["backend"], "verl": verl}})


def test_the_workers_reach_the_gateway_at_rays_node_address_not_loopback(tmp_path: Any) -> None:
    with FakeOpenAI() as fake:
        # the launch path's server: on every interface, so with a token
        server = TrainerServer(ServerConfig(db_path=str(tmp_path / "server.db"), host="0.0.0.0", port=0,
                                            token="t0ken"), OpenAIBackend(fake.url))
        thread = ServerThread(server).start()
        try:
            url = gateway_url(_config(nnodes=2), int(thread.url.rsplit(":", 1)[1]))
            host = url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]")
            # what the other nodes' raylets reach this one by; on this machine 192.0.2.2, where the host name's
            # address (the old choice) is 127.0.0.1
            assert host == ray_util.get_node_ip_address(), url
            with urllib.request.urlopen(f"{url}/healthz", timeout=10) as reply:  # noqa: S310 - the test's own URL
                assert reply.status == 200
        finally:
            thread.stop()


def test_gateway_host_overrides_it_and_a_loopback_one_on_several_nodes_is_refused() -> None:
    assert gateway_url(_config(nnodes=2, gateway_host="10.1.2.3"), 8123) == "http://10.1.2.3:8123"
    assert gateway_url(_config(nnodes=2, gateway_host="fd00::7"), 8123) == "http://[fd00::7]:8123"
    assert gateway_url(_config(nnodes=1, gateway_host="127.0.0.1"), 8123) == "http://127.0.0.1:8123"  # one node
    for host in ("127.0.0.1", "127.0.1.1", "localhost", "::1"):
        with pytest.raises(ConfigError, match=rf"backend\.verl\.gateway_host: the gateway's address {host} is "
                                              r"this machine's loopback, which the workers on the other 1 node"):
            gateway_url(_config(nnodes=2, gateway_host=host), 8123)
