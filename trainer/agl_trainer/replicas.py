"""Several replicas of the policy behind one gateway: a rollout's calls on one replica, rollouts spread over all.

verl starts one vLLM (or SGLang) server per ``tensor_parallel_size`` GPUs: the docs' 2 x 8 GPU
recipe at TP 1 makes 16. :class:`ReplicaBackend` is the gateway's :class:`~agl_trainer.gateway.Backend`
over all of them, with the policy of verl's own agent-loop balancer
(``verl.workers.rollout.router.GlobalRequestLoadBalancer``), which routes verl's token-level
``generate`` calls and so cannot stand in front of an OpenAI endpoint:

- **sticky**: every call of one rollout goes to the replica its first call went to, so the
  replica's prefix cache holds the conversation so far. A rollout is its trace: the gateway
  keys each call on the W3C ``traceparent`` the instrumented client sends
  (:data:`agl_trainer.gateway.route_key`), and all calls of a rollout share its trace id;
- **least loaded**: a rollout's first call goes to the replica with the fewest calls in flight,
  ties to the one that was given the fewest rollouts, so rollouts started one after another
  still go round the replicas. A call with no ``traceparent`` is routed as a rollout of its own.

The sticky map keeps the ``max_keys`` latest rollouts (least recently used out first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from agl_trainer.gateway import Backend, BackendReply, Chunks, Endpoint, route_key

__all__ = ["ReplicaBackend"]


class ReplicaBackend:
    """The gateway's backend over ``replicas`` (each a :class:`~agl_trainer.gateway.Backend` of the same model)."""

    def __init__(self, replicas: Sequence[Backend], *, max_keys: int = 100_000) -> None:
        if not replicas:
            raise ValueError("replicas is empty: the gateway needs at least one model server")
        self.replicas = list(replicas)
        self.max_keys = max_keys
        self.in_flight = [0] * len(self.replicas)
        self.rollouts = [0] * len(self.replicas)
        """Rollouts (distinct route keys) each replica was given."""
        self.calls = [0] * len(self.replicas)
        self._sticky: OrderedDict[str, int] = OrderedDict()

    def pick(self, key: str | None) -> int:
        """The replica of a call of rollout ``key`` (None: a rollout of its own), counted as in flight there."""
        index = self._sticky.get(key) if key is not None else None
        if index is None:
            index = min(range(len(self.replicas)), key=lambda i: (self.in_flight[i], self.rollouts[i]))
            self.rollouts[index] += 1
            if key is not None:
                self._sticky[key] = index
                if len(self._sticky) > self.max_keys:
                    self._sticky.popitem(last=False)
        elif key is not None:
            self._sticky.move_to_end(key)
        self.in_flight[index] += 1
        self.calls[index] += 1
        return index

    def _done(self, index: int) -> None:
        self.in_flight[index] -= 1

    async def complete(self, endpoint: Endpoint, body: dict[str, Any]) -> BackendReply:
        index = self.pick(route_key.get())
        try:
            return await self.replicas[index].complete(endpoint, body)
        finally:
            self._done(index)

    async def stream(self, endpoint: Endpoint, body: dict[str, Any]) -> BackendReply | Chunks:
        index = self.pick(route_key.get())
        try:
            opened = await self.replicas[index].stream(endpoint, body)
        except BaseException:
            self._done(index)
            raise
        if isinstance(opened, BackendReply):
            self._done(index)
            return opened
        return self._until_done(opened, index)

    async def _until_done(self, chunks: Chunks, index: int) -> AsyncGenerator[dict[str, Any], None]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
            self._done(index)

    async def models(self) -> list[str]:
        return await self.replicas[0].models()

    async def update_weights(self, weights: str | None, version: int) -> None:
        for replica in self.replicas:
            await replica.update_weights(weights, version)

    async def aclose(self) -> None:
        for replica in self.replicas:
            await replica.aclose()
