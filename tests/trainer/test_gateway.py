"""The gateway on the real server: token ids recorded per traceparent, the model/sampling rule, errors."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from agl_core.testing import FakeOpenAI, render_prompt, tokenize
from agl_trainer.gateway import GatewayConfig, OpenAIBackend
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer, check_bind

from .conftest import ServerFactory

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
TP = {"traceparent": f"00-{TRACE}-{SPAN}-01"}
USER = [{"role": "user", "content": "What is the capital of France?"}]


def _post(url: str, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 30,
          **kw: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout, **kw)


def _record(thread: ServerThread, span: str = SPAN) -> Any:
    return thread.server.records.get((TRACE, span))


def test_chat_records_ids_by_traceparent_and_strips_what_the_agent_did_not_ask(
        fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    r = _post(srv.url, "/v1/chat/completions", {"model": "gpt-4o", "messages": USER}, TP)
    assert r.status_code == 200, r.text
    data = r.json()
    assert "prompt_token_ids" not in data and "token_ids" not in data["choices"][0]
    assert data["choices"][0]["logprobs"] is None
    upstream = fake.requests[-1].body
    assert upstream["return_token_ids"] is True and upstream["logprobs"] is True
    record = _record(srv)
    assert record.prompt_token_ids == tokenize(render_prompt(USER))
    assert record.response_token_ids == tokenize(USER[0]["content"])
    assert len(record.response_logprobs) == len(record.response_token_ids)
    # an agent that asks for ids and logprobs itself gets them
    r = _post(srv.url, "/v1/chat/completions",
              {"model": "m", "messages": USER, "return_token_ids": True, "logprobs": True}, TP)
    data = r.json()
    assert data["prompt_token_ids"] == record.prompt_token_ids
    assert data["choices"][0]["token_ids"] == record.response_token_ids
    assert data["choices"][0]["logprobs"]["content"]


def test_streaming_keeps_token_ids(make_server: ServerFactory) -> None:
    reply = {"content": "Paris it is", "tool_calls": [{"name": "lookup", "arguments": {"city": "Paris"}}]}
    with FakeOpenAI(script=[reply]) as fake:
        srv = make_server(fake)
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=TP, timeout=30,
                          json={"model": "m", "messages": USER, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("token_ids" not in c["choices"][0] for c in chunks if c["choices"])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Paris it is"
    record = _record(srv)
    assert record.prompt_token_ids == tokenize(render_prompt(USER))
    expected = tokenize('Paris it is <tool_call> lookup {"city": "Paris"}')
    assert record.response_token_ids == expected
    assert len(record.response_logprobs) == len(expected)


def test_openai_client_streaming_through_the_gateway(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=USER, stream=True,  # type: ignore[arg-type]
                                            stream_options={"include_usage": True}, extra_headers=TP)
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(tokenize(USER[0]["content"]))
    assert _record(srv).response_token_ids == tokenize(USER[0]["content"])


def test_text_completions(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    r = _post(srv.url, "/v1/completions", {"model": "m", "prompt": "Once upon a time"}, TP)
    assert r.status_code == 200, r.text
    assert "token_ids" not in r.json()["choices"][0]
    assert fake.requests[-1].body["logprobs"] == 0
    record = _record(srv)
    assert record.prompt_token_ids == tokenize("Once upon a time")
    assert record.response_token_ids == tokenize("Once upon a time")
    assert _post(srv.url, "/v1/completions", {"prompt": [1, "x"]}).json()["error"]["param"] == "prompt"


def test_models_names_the_served_model(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, gateway=GatewayConfig(served_model="policy"))
    data = httpx.get(srv.url + "/v1/models").json()
    assert [m["id"] for m in data["data"]] == ["policy"]
    # without a name, the backend's first model is served
    other = make_server(fake, db=None)
    assert httpx.get(other.url + "/v1/models").json()["data"][0]["id"] == "fake-model"


def test_model_override_and_sampling_rule(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    config = GatewayConfig(served_model="policy", sampling_defaults={"max_tokens": 64, "top_p": 0.9},
                           sampling_overrides={"temperature": 1.0})
    srv = make_server(fake, gateway=config)
    _post(srv.url, "/v1/chat/completions",
          {"model": "gpt-4o", "messages": USER, "temperature": 0.2, "top_p": 0.5, "seed": 7})
    sent = fake.requests[-1].body
    assert sent["model"] == "policy"
    assert sent["temperature"] == 1.0  # overridden
    assert sent["top_p"] == 0.5 and sent["seed"] == 7  # the agent's own values are honoured
    assert sent["max_tokens"] == 64  # a default fills what the agent left out


def test_model_passthrough(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, gateway=GatewayConfig(served_model="policy", model_rule="passthrough"))
    r = _post(srv.url, "/v1/chat/completions", {"model": "lora-a", "messages": USER})
    assert fake.requests[-1].body["model"] == "lora-a" and r.json()["model"] == "lora-a"
    with pytest.raises(ValueError, match="not a sampling field"):
        GatewayConfig(sampling_overrides={"model": "x"})


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "n": True}, "n"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "tools": {"a": 1}}, "tools"),
    ({"messages": USER, "stop": [1]}, "stop"),
    ([1, 2], "body"),
])
def test_malformed_requests_get_400_naming_the_field(fake: FakeOpenAI, make_server: ServerFactory,
                                                     body: Any, param: str) -> None:
    srv = make_server(fake)
    r = _post(srv.url, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not [q for q in fake.requests if q.method == "POST"]  # never reached the backend


def test_not_json_and_oversized_bodies(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, max_body_bytes=2048)
    r = httpx.post(srv.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    big = {"messages": [{"role": "user", "content": "x" * 4096}]}
    assert _post(srv.url, "/v1/chat/completions", big).status_code == 413
    assert _post(srv.url, "/v1/rollouts", {"id": "x" * 4096}).status_code == 413

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 512
        yield b'"}]}'

    r = httpx.post(srv.url + "/v1/chat/completions", content=chunked(), timeout=10)
    assert r.status_code == 413


def test_backend_errors_reach_the_agent_with_the_reason(make_server: ServerFactory) -> None:
    script = [{"status": 400, "error": "context too long"}, {"status": 500, "error": "engine crashed"},
              {"status": 200, "body": "not json"}]
    with FakeOpenAI(script=script) as fake:
        srv = make_server(fake, gateway=GatewayConfig(served_model="m"))
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="context too long"):
            client.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
        with pytest.raises(openai.APIStatusError, match="engine crashed") as err:
            client.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
        assert err.value.status_code == 502
        r = _post(srv.url, "/v1/chat/completions", {"messages": USER})
        assert r.status_code == 502 and "not a JSON object" in r.json()["error"]["message"]
        assert len(srv.server.records) == 0


def test_backend_down_or_slow(make_server: ServerFactory) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    srv = make_server(OpenAIBackend(f"http://127.0.0.1:{dead}/v1"), gateway=GatewayConfig(served_model="m"))
    r = _post(srv.url, "/v1/chat/completions", {"messages": USER})
    assert r.status_code == 502 and "could not be reached" in r.json()["error"]["message"]

    def slow(body: dict[str, Any]) -> str:
        time.sleep(1.0)
        return "late"

    with FakeOpenAI(script=slow) as fake:
        srv = make_server(OpenAIBackend(fake.url, timeout_s=0.3), gateway=GatewayConfig(served_model="m"))
        r = _post(srv.url, "/v1/chat/completions", {"messages": USER})
        assert r.status_code == 504 and "did not answer within 0.3 s" in r.json()["error"]["message"]
        r = _post(srv.url, "/v1/chat/completions", {"messages": USER, "stream": True})
        assert r.status_code == 504


def test_bearer_token(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake, token="s3cret")
    assert httpx.get(srv.url + "/healthz").status_code == 200
    r = _post(srv.url, "/v1/chat/completions", {"messages": USER})
    assert r.status_code == 401 and r.json()["error"]["param"] == "Authorization"
    r = _post(srv.url, "/v1/chat/completions", {"messages": USER}, {"Authorization": "Bearer nope"})
    assert r.status_code == 401 and "wrong" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/v1/queue", headers={"Authorization": "Bearer nope"}).status_code == 401
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
    assert client.chat.completions.create(model="m", messages=USER).choices  # type: ignore[arg-type]


def test_refuses_to_listen_beyond_loopback_without_a_token(tmp_path: Any) -> None:
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", "t")
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without a bearer token"):
        check_bind("0.0.0.0", None)
    server = TrainerServer(ServerConfig(db_path=str(tmp_path / "x.db"), host="0.0.0.0", port=0),
                           OpenAIBackend("http://127.0.0.1:9/v1"))
    with pytest.raises(ValueError, match="bearer token"):
        ServerThread(server)


def test_calls_without_traceparent_are_answered_and_counted(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    assert _post(srv.url, "/v1/chat/completions", {"messages": USER}).status_code == 200
    assert _post(srv.url, "/v1/chat/completions", {"messages": USER},
                 {"traceparent": "00-" + "0" * 32 + "-" + SPAN + "-01"}).status_code == 200
    assert srv.server.records.unkeyed == 2 and len(srv.server.records) == 0


def test_concurrent_calls_each_get_their_own_record(fake: FakeOpenAI, make_server: ServerFactory) -> None:
    srv = make_server(fake)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    spans = [f"{i:016x}" for i in range(1, 17)]

    def call(span: str) -> None:
        text = f"question number {span}"
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                       extra_headers={"traceparent": f"00-{TRACE}-{span}-01"},
                                       stream=span.endswith(("1", "3", "5")))
        for _ in range(100):
            if _record(srv, span) is not None:
                break
            time.sleep(0.01)

    threads = [threading.Thread(target=call, args=(s,)) for s in spans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for span in spans:
        assert _record(srv, span).response_token_ids == tokenize(f"question number {span}")


def test_gateway_in_front_of_a_uvicorn_backend_streams_chunked(fake: FakeOpenAI, make_server: ServerFactory,
                                                                tmp_path: Any) -> None:
    """A uvicorn-served backend (as vLLM is) streams with chunked transfer encoding over kept-alive connections."""
    inner = make_server(fake, db=tmp_path / "inner.db")
    outer = make_server(OpenAIBackend(inner.url + "/v1"), db=tmp_path / "outer.db")
    client = openai.OpenAI(base_url=outer.url + "/v1", api_key="x", max_retries=0)
    for i in range(3):  # the same upstream connection, reused
        span = f"{i + 1:016x}"
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=USER, stream=True, extra_headers={"traceparent": f"00-{TRACE}-{span}-01"},  # type: ignore
        ) if c.choices)
        assert text == USER[0]["content"]
        assert _record(outer, span).response_token_ids == tokenize(USER[0]["content"])
        plain = client.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
        assert plain.choices[0].message.content == USER[0]["content"]
    assert len(outer.server.backend._upstream._idle) == 1  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- streams: as they come, and cancelled


class GatedStream:
    """A vLLM-like model server on 127.0.0.1 that streams ``before``, waits for ``gate``, then sends ``after``.

    It notices when the gateway closes its connection while it waits (``closed``).
    """

    def __init__(self, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.gate = threading.Event()
        self.closed = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                pass

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in before:
                    self._event(json.dumps(chunk))
                deadline = time.monotonic() + 10
                while not outer.gate.wait(0.02) and time.monotonic() < deadline:
                    self.connection.setblocking(False)
                    try:
                        if self.connection.recv(1, socket.MSG_PEEK) == b"":
                            outer.closed.set()
                            return
                    except BlockingIOError:
                        pass
                    finally:
                        self.connection.setblocking(True)
                for chunk in after:
                    self._event(json.dumps(chunk))
                self._event("[DONE]")
                self.wfile.write(b"0\r\n\r\n")

            def _event(self, payload: str) -> None:
                data = f"data: {payload}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


def _chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None, **top: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", **top,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids,
                         "logprobs": {"content": [{"token": str(i), "logprob": -0.5, "top_logprobs": []}
                                                  for i in ids]}}]}


def _call(i: int, args: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": i, "id": f"call_{i}", "type": "function",
                            "function": {"name": "lookup", "arguments": args}}]}


def test_streamed_tool_call_deltas_pass_through_as_they_come(make_server: ServerFactory) -> None:
    before = [_chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[1, 2, 3]),
              _chunk(_call(0, '{"q": "a"}'), [11, 12])]
    after = [_chunk(_call(1, '{"q": "b"}'), [13, 14]), _chunk({}, [15], finish="tool_calls")]
    backend = GatedStream(before, after)
    try:
        srv = make_server(OpenAIBackend(backend.url), gateway=GatewayConfig(served_model="m"))
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(model="m", messages=USER, stream=True,  # type: ignore[arg-type]
                                                tools=[{"type": "function", "function": {"name": "lookup"}}],
                                                extra_headers=TP)
        calls = []
        for chunk in stream:
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                calls.append((call.index, call.function.arguments, backend.gate.is_set()))  # type: ignore[union-attr]
                backend.gate.set()  # the backend sends the rest only once the first call got through
        assert calls == [(0, '{"q": "a"}', False), (1, '{"q": "b"}', True)]
        record = _record(srv)
        assert record.prompt_token_ids == [1, 2, 3] and record.response_token_ids == [11, 12, 13, 14, 15]
        assert record.response_logprobs == [-0.5] * 5
    finally:
        backend.stop()


def test_an_agent_that_goes_away_mid_stream_closes_the_upstream_request(make_server: ServerFactory) -> None:
    backend = GatedStream([_chunk({"role": "assistant", "content": "Hel"}, [7], prompt_token_ids=[1])],
                          [_chunk({"content": "lo"}, [8], finish="stop")])
    try:
        srv = make_server(OpenAIBackend(backend.url), gateway=GatewayConfig(served_model="m"))
        with httpx.stream("POST", srv.url + "/v1/chat/completions", headers=TP, timeout=30,
                          json={"messages": USER, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the first words arrived; the agent goes away
        assert backend.closed.wait(10), "the gateway kept the backend's request open after the agent left"
        assert _record(srv) is None  # half a call is not recorded
        assert len(srv.server.backend._upstream._idle) == 0  # type: ignore[attr-defined]  # not reused mid-body
    finally:
        backend.stop()


def test_an_agent_that_gives_up_on_a_plain_request_closes_the_upstream_request(make_server: ServerFactory) -> None:
    backend = GatedStream([_chunk({"role": "assistant", "content": "Hel"}, [7])], [])  # holds its answer back
    try:
        srv = make_server(OpenAIBackend(backend.url), gateway=GatewayConfig(served_model="m"))
        with pytest.raises(httpx.ReadTimeout):
            _post(srv.url, "/v1/chat/completions", {"messages": USER}, TP, timeout=0.5)
        assert backend.closed.wait(10), "the gateway kept the backend's request open after the agent left"
        deadline = time.monotonic() + 5
        while srv.server.gateway.abandoned == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.server.gateway.abandoned == 1 and _record(srv) is None
    finally:
        backend.stop()
