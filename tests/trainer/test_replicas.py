"""One gateway in front of several replicas (verl's vLLM servers): rollouts spread, a rollout's calls on one.

Three fake vLLM replicas behind the real server and gateway, a tool-using agent on the real
OpenAI client (instrumented: it sends the ``traceparent`` the gateway keys on). Before, the verl
launch path put the gateway in front of the first replica only and the others sat idle.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

import agl_core as agl
from agl_core.testing import FakeOpenAI
from agl_trainer.gateway import BackendReply, OpenAIBackend, route_key
from agl_trainer.replicas import ReplicaBackend

from .conftest import ServerFactory

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def _script(request: dict[str, Any]) -> Any:
    """A model that calls the tool once, then answers with what the tool said."""
    last = request["messages"][-1]
    if last["role"] == "tool":
        return f"It is {last['content']}."
    return {"tool_calls": [{"name": "lookup", "arguments": {"q": last["content"]}}]}


def _tool_agent(url: str, store: agl.HttpStore, i: int) -> agl.RolloutRun:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    question = [{"role": "user", "content": f"capital {i}?"}]
    with agl.rollout(task_id=f"t{i}", task={"i": i}, store=store) as run:
        first = client.chat.completions.create(model="m", messages=question, tools=[TOOL])  # type: ignore[arg-type,list-item]
        call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
        messages: list[Any] = [*question, first.choices[0].message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": f"city {i}"}]
        stream = client.chat.completions.create(model="m", messages=messages, stream=True)
        answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        agl.emit_reward(1.0 if answer == f"It is city {i}." else 0.0)
    return run


def test_rollouts_spread_over_every_replica_and_a_rollouts_calls_stay_on_one(make_server: ServerFactory) -> None:
    fakes = [FakeOpenAI(script=_script).start() for _ in range(3)]
    try:
        backend = ReplicaBackend([OpenAIBackend(f.url, timeout_s=30.0) for f in fakes])
        srv = make_server(backend)
        store = agl.HttpStore(srv.url)
        with ThreadPoolExecutor(3) as pool:
            runs = list(pool.map(lambda i: _tool_agent(srv.url, store, i), range(9)))
        assert all(r.store_error is None for r in runs)
        trajectories = store.trajectories(rollout_ids=[r.id for r in runs])
        assert [t.reward for t in trajectories] == [1.0] * 9  # the tool call came back parsed, every time
        assert all(len(t.transitions) == 2 and t.transitions[0].token_source == "gateway" for t in trajectories)
        assert all(t.transitions[0].response["tool_calls"][0]["function"]["name"] == "lookup" for t in trajectories)
        # every replica served rollouts (before: all 18 calls on the first, 0 on the others) ...
        # (the gateway does not pass the traceparent on: a rollout is known upstream by its question)
        traces = [{q.body["messages"][0]["content"] for q in f.requests if q.method == "POST"} for f in fakes]
        assert all(len(t) >= 1 for t in traces), [len(t) for t in traces]
        assert sum(len(t) for t in traces) == 9 and backend.calls == [2 * len(t) for t in traces]
        # ... and each rollout's two calls went to one replica (its prefix cache)
        assert not (traces[0] & traces[1] or traces[0] & traces[2] or traces[1] & traces[2])
        assert backend.in_flight == [0, 0, 0]  # streamed calls too are released
    finally:
        for fake in fakes:
            fake.stop()


class _Slow:
    """A replica whose calls wait until released: what "in flight" means to the balancer."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def complete(self, endpoint: str, body: dict[str, Any]) -> BackendReply:
        await self.release.wait()
        return BackendReply(200, {"replica": id(self)})


def test_a_new_rollout_goes_to_the_least_loaded_replica_then_sticks() -> None:
    async def scenario() -> list[int]:
        replicas = [_Slow(), _Slow()]
        backend = ReplicaBackend(replicas)  # type: ignore[list-item]

        async def call(key: str | None) -> int:
            route_key.set(key)
            reply = await backend.complete("chat/completions", {})
            return [id(r) for r in replicas].index(reply.data["replica"])

        long = asyncio.create_task(call("a"))  # rollout a: replica 0, its call in flight
        await asyncio.sleep(0)
        b = asyncio.create_task(call("b"))  # the least loaded: replica 1
        await asyncio.sleep(0)
        a_again = asyncio.create_task(call("a"))  # rollout a again: replica 0, though it is the busier
        await asyncio.sleep(0)
        assert backend.in_flight == [2, 1]
        for r in replicas:
            r.release.set()
        placed = [await t for t in (long, b, a_again)]
        # idle replicas: a new rollout goes to the one given fewer rollouts; no traceparent: a rollout of its own
        placed += [await call("c"), await call(None), await call("c")]
        return placed

    assert asyncio.run(scenario()) == [0, 1, 0, 0, 1, 0]
