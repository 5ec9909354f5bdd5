"""The policy's endpoint, handed to each rollout: where the model being trained answers.

    client = openai.OpenAI(base_url=agl.policy().base_url, api_key=agl.policy().api_key)
    client.chat.completions.create(model=agl.policy().model, ...)

``agl worker`` sets it for every rollout it runs (the server's gateway, its
token, the name the policy is served under), as Agent Lightning hands its
agents the ``main_llm`` resource. An agent that also calls models that are not
trained (a frozen judge, a checker) reaches the policy this way and runs under
``agl worker --no-gateway-env``, so ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
stay with its other models. Without that flag the worker points those
variables at the gateway too: the zero-change default for agents with one
model.
"""

from __future__ import annotations

import contextvars
import dataclasses
import urllib.parse
from dataclasses import dataclass

from agl_core import semconv
from agl_core.errors import AglError
from agl_core.schema import Span

__all__ = ["Policy", "mark_calls_elsewhere", "policy", "use_policy"]


@dataclass(frozen=True)
class Policy:
    """An OpenAI-compatible endpoint serving the policy: ``base_url`` (ending in ``/v1``), ``api_key``, ``model``.

    ``model`` is the name the policy is served under; None when the server did not say.
    """

    base_url: str
    api_key: str
    model: str | None = None


_current: contextvars.ContextVar[Policy | None] = contextvars.ContextVar("agl_policy", default=None)


def policy() -> Policy:
    """The policy's endpoint for the running rollout; raises :class:`AglError` where none was handed over."""
    found = _current.get()
    if found is None:
        raise AglError("agl.policy(): no policy endpoint here: agl worker hands it to each rollout it runs; "
                       "elsewhere set one with agl_core.policy_endpoint.use_policy(Policy(base_url, api_key, model))")
    return found


def use_policy(endpoint: Policy | None) -> contextvars.Token[Policy | None]:
    """Make ``endpoint`` what :func:`policy` returns in this context (a thread, an asyncio task) from now on."""
    return _current.set(endpoint)


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def mark_calls_elsewhere(spans: list[Span], endpoint: Policy) -> set[str]:
    """Mark the LLM spans of calls sent to a server other than ``endpoint`` as a frozen model's; return their names.

    An agent that reaches the policy through :func:`policy` and its other models (a judge)
    through their own base URLs makes both kinds of LLM span; the client's ``server.address``
    and ``server.port`` say which went where. A marked call (``agl.llm.frozen_model``, the model
    it asked for) is never a transition, unless the gateway recorded it after all (a proxy in
    between): the gateway's token ids are the proof that the policy answered.
    """
    parts = urllib.parse.urlsplit(endpoint.base_url)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    marked: set[str] = set()
    for i, span in enumerate(spans):
        attrs = span.attributes
        address = attrs.get(semconv.SERVER_ADDRESS)
        if attrs.get(semconv.GEN_AI_OPERATION_NAME) not in semconv.LLM_OPERATIONS or not isinstance(address, str):
            continue
        there = address.lower()
        same_host = there == host or (there in _LOOPBACK and host in _LOOPBACK)
        if same_host and attrs.get(semconv.SERVER_PORT, port) == port:
            continue
        model = attrs.get(semconv.GEN_AI_REQUEST_MODEL) or attrs.get(semconv.GEN_AI_RESPONSE_MODEL)
        name = f"{model or '?'} at {address}:{attrs.get(semconv.SERVER_PORT, '?')}"
        spans[i] = dataclasses.replace(span, attributes={**attrs, semconv.AGL_FROZEN_MODEL: name})
        marked.add(name)
    return marked
