"""What the suite's tests share: models on the fake servers, span selectors, a fake Responses API server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_core.testing import FakeOpenAI


def chat_model(srv: FakeOpenAI, name: str = "fake-model") -> Any:
    """An ``OpenAIChatModel`` on the fake server (explicit key, none from the environment, no retries)."""
    from openai import AsyncOpenAI
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = AsyncOpenAI(base_url=srv.url, api_key="not-a-key", max_retries=0)
    return OpenAIChatModel(name, provider=OpenAIProvider(openai_client=client))


def spans(run: Any, operation: str) -> list[Span]:
    return [s for s in run.rollout.spans if s.attributes.get(semconv.GEN_AI_OPERATION_NAME) == operation]


def by_plugin(items: list[Span], plugin: str) -> list[Span]:
    return [s for s in items if s.attributes.get(semconv.AGL_PLUGIN) == plugin]


# --------------------------------------------------------------------------- the Responses API, faked


def call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def text_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _response(output: list[dict[str, Any]], model: str, n: int) -> dict[str, Any]:
    return {"id": f"resp_{n}", "object": "response", "created_at": 0, "model": model, "status": "completed",
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 11, "output_tokens": 5, "total_tokens": 16,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


class FakeResponses:
    """``POST /v1/responses`` on 127.0.0.1: scripted output items, as JSON or as a server-sent event stream."""

    def __init__(self, replies: list[list[dict[str, Any]]]) -> None:
        self.replies = replies
        self.requests: list[dict[str, Any]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                return None

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"body": body, "headers": {k.lower(): v for k, v in self.headers.items()}})
                data = _response(fake.replies.pop(0), body["model"], len(fake.requests))
                if body.get("stream"):
                    created = {**data, "output": [], "status": "in_progress"}
                    events = [{"type": "response.created", "sequence_number": 0, "response": created}]
                    for i, item in enumerate(data["output"]):
                        events.append({"type": "response.output_item.added", "sequence_number": len(events),
                                       "output_index": i, "item": item})
                        for c, part in enumerate(item.get("content") or ()):
                            events.append({"type": "response.output_text.delta", "sequence_number": len(events),
                                           "item_id": item["id"], "output_index": i, "content_index": c,
                                           "delta": part["text"], "logprobs": []})
                        events.append({"type": "response.output_item.done", "sequence_number": len(events),
                                       "output_index": i, "item": item})
                    events.append({"type": "response.completed", "sequence_number": len(events), "response": data})
                    payload = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode()
                                       + b"\n\n" for e in events)
                    content_type = "text/event-stream"
                else:
                    payload, content_type = json.dumps(data).encode(), "application/json"
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler

    def __enter__(self) -> FakeResponses:
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"
