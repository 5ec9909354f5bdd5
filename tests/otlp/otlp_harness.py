"""The OTLP suite's pieces: a running ``agl serve`` read as a client would, and an SDK tracer provider that
exports to it with the OpenTelemetry SDK's own OTLP/HTTP exporter."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import httpx

# the instrumentations' content capture, as their users switch it on
os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
os.environ.setdefault("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
os.environ.setdefault("TRACELOOP_TRACE_CONTENT", "true")

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402

from agl_trainer.server import ServerThread  # noqa: E402

TOKEN = "otlp-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object",
                                                          "properties": {"a": {"type": "integer"},
                                                                         "b": {"type": "integer"}},
                                                          "required": ["a", "b"]}}}]
# the model asks for add(2, 3), then answers with the sum
SCRIPT = [{"tool_calls": [{"name": "add", "arguments": '{"a": 2, "b": 3}', "id": "call_1"}]}, "The sum is 5."]


@dataclass
class Agl:
    """The running server, and a way to read it as a client would."""

    thread: ServerThread

    @property
    def url(self) -> str:
        return self.thread.url

    def get(self, path: str, **params: Any) -> Any:
        reply = httpx.get(self.url + path, params=params, headers=AUTH, timeout=10)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def finish(self, rollout_id: str, task_id: str | None = None, reward: float | None = 1.0) -> dict[str, Any]:
        body: dict[str, Any] = {"id": rollout_id, "task_id": task_id or rollout_id, "status": "succeeded"}
        if reward is not None:
            body["rewards"] = [{"value": reward}]
        reply = httpx.post(self.url + "/v1/rollouts", json=body, headers=AUTH, timeout=10)
        assert reply.status_code == 201, reply.text
        return dict(reply.json())

    def transitions(self, rollout_id: str) -> list[dict[str, Any]]:
        return list(self.get("/v1/transitions", rollout_id=rollout_id)["transitions"])

    def spans(self, rollout_id: str) -> list[dict[str, Any]]:
        return list(self.get(f"/v1/rollouts/{rollout_id}/spans")["spans"])


def exporting_provider(agl: Agl, **resource: str) -> TracerProvider:
    """A tracer provider whose spans go to ``agl serve`` by the SDK's OTLP/HTTP exporter (protobuf), as
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` would send them."""
    provider = TracerProvider(resource=Resource.create({"service.name": "otlp-test", **resource}))
    exporter = OTLPSpanExporter(endpoint=f"{agl.url}/v1/traces", headers=AUTH)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
