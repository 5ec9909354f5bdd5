"""A Node.js agent (the ``openai`` npm package, OpenInference's OpenTelemetry JS instrumentation, the JS SDK's
OTLP/HTTP exporter, protobuf and JSON) trained from its spans alone: agl only in the environment it is started with.

The npm packages (tests/otlp/node/package.json, exact versions) are installed from the npm registry in the
test's set-up, into a folder under the system's temporary directory kept between runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from otlp_harness import TOKEN, Agl

from agl_core.testing import FakeOpenAI

NODE_DIR = Path(__file__).parent / "node"


@pytest.fixture(scope="module")
def node_agent() -> Path:
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.skip("NOT TESTED: the Node agent needs node and npm on PATH (Node 20 is on this project's image)")
    manifest = (NODE_DIR / "package.json").read_bytes()
    folder = Path(tempfile.gettempdir()) / f"agl-otlp-node-{hashlib.sha256(manifest).hexdigest()[:12]}"
    if not (folder / "node_modules" / ".agl-installed").exists():
        folder.mkdir(exist_ok=True)
        (folder / "package.json").write_bytes(manifest)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=folder, check=True,
                       timeout=300)
        (folder / "node_modules" / ".agl-installed").touch()
    shutil.copy(NODE_DIR / "agent.js", folder / "agent.js")
    return folder


@pytest.mark.parametrize("protocol", ["http/protobuf", "http/json"])
def test_a_node_agent_exporting_otlp_is_trained_from_its_spans(agl: Agl, fake: FakeOpenAI, node_agent: Path,
                                                               protocol: str) -> None:
    env = {**os.environ, "MODEL_BASE_URL": fake.url, "OTEL_TRACES_EXPORTER": "otlp",
           "OTEL_EXPORTER_OTLP_ENDPOINT": agl.url, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
           "OTEL_EXPORTER_OTLP_HEADERS": f"Authorization=Bearer {TOKEN}",
           "OTEL_RESOURCE_ATTRIBUTES": "agl.rollout.id=node-1,agl.task.id=add-2-3",  # the one line
           "OTEL_SERVICE_NAME": "node-agent", "OTEL_TRACES_SAMPLER": "always_on"}
    done = subprocess.run(["node", "agent.js"], cwd=node_agent, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "The sum is 5."
    (rollout,) = agl.get("/v1/rollouts")["rollouts"]
    assert (rollout["id"], rollout["task_id"]) == ("node-1", "add-2-3")
    assert rollout["metadata"]["service.name"] == "node-agent"
    summary = agl.finish("node-1", "add-2-3", reward=1.0)
    assert summary["transitions"] == 2, summary
    first, second = agl.transitions("node-1")
    sent = [r.body for r in fake.requests if r.path.endswith("/chat/completions")]
    assert [m["content"] for m in first["prompt"]] == [m["content"] for m in sent[0]["messages"]]
    assert first["response"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert first["response"]["tool_calls"][0]["id"] == "call_1"
    assert second["prompt"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    assert second["response"] == {"role": "assistant", "content": "The sum is 5."}
    assert first["tools"][0]["function"]["name"] == "add" and first["model"] == "fake-model"
    assert [t["credited_reward"] for t in (first, second)] == [1.0, 1.0]
