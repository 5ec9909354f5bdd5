"""Foreign span conventions -> agl's (the GenAI conventions of :mod:`agl_core.semconv`), one module each.

Every module is laid out alike, so a diff between two shows only what differs between the conventions:

- ``NAME``: the convention, as ``agl.otlp.convention`` on the spans it mapped;
- ``detect(span, scope) -> bool``: whether the span (its instrumentation scope's name is ``scope``) is in it;
- ``attributes(span) -> dict``: the agl attributes the span maps to (an LLM call's ``gen_ai.operation.name``,
  ``gen_ai.input.messages`` / ``gen_ai.output.messages`` as JSON in the parts format, its model and tool
  definitions; a tool call's name, call id, arguments and result; an agent's name), empty for a span of the
  convention that is neither (a chain, a workflow step).

The mapped span keeps every attribute it came with; the mapped ones are added (they win over the originals
of the same name, which only the GenAI form itself has). The first module whose ``detect`` says yes maps a
span; a span no module claims is kept as it came, and one that looks like a model call is marked
untrainable with the reason (:func:`map_span`), so the rollout's skipped list says why it was not trained.
"""

from __future__ import annotations

import re
from typing import Any

from agl_core import semconv
from agl_core.schema import Span
from agl_trainer.otlp.conventions import genai, openinference, openllmetry, pydantic_ai, vercel_ai
from agl_trainer.otlp.decode import amended

__all__ = ["AGL_CONVENTION", "CONVENTIONS", "map_span"]

AGL_CONVENTION = "agl.otlp.convention"
"""On an ingested span: the convention it was read in (``openinference``, ``genai``, ...), or ``unknown``."""

# most specific first: Pydantic AI and OpenLLMetry write gen_ai.* attributes of their own beside the GenAI ones
CONVENTIONS = (pydantic_ai, openinference, openllmetry, vercel_ai, genai)

_LLM_LIKE_NAME = re.compile(r"\b(chat|llm|completions?|generate\w*|inference|invoke_model)\b", re.IGNORECASE)
_LLM_LIKE_KEYS = ("llm.", "gen_ai.", "ai.", "prompt", "completion", "messages")
_KNOWN = ", ".join(m.NAME for m in CONVENTIONS)


def map_span(span: Span, scope: str) -> Span:
    """``span`` with its convention's agl attributes added, or marked untrainable when it looks like a model
    call in no convention agl reads. Rewards (``agl.reward.value``) are read whatever the convention."""
    attrs = dict(span.attributes)
    if scope:  # what made it: one instrumentation records a request once (two of its calls are two requests)
        attrs.setdefault(semconv.OTEL_SCOPE_NAME, scope)
    for convention in CONVENTIONS:
        if convention.detect(span, scope):
            attrs.update(convention.attributes(span))
            attrs[AGL_CONVENTION] = convention.NAME
            break
    else:
        attrs[AGL_CONVENTION] = "unknown"
        if _looks_like_llm_call(span) and semconv.GEN_AI_OPERATION_NAME not in attrs:
            attrs[semconv.GEN_AI_OPERATION_NAME] = semconv.OP_CHAT
            attrs[semconv.AGL_UNTRAINABLE] = (
                f"span {span.name!r} (scope {scope or 'unnamed'!r}) looks like a model call but is in no "
                f"convention agl reads ({_KNOWN}): kept as it came, not trained")
    _reward(attrs)
    return amended(span, attributes=attrs)


def _reward(attrs: dict[str, Any]) -> None:
    value = attrs.get(semconv.AGL_REWARD_VALUE)
    if isinstance(value, str):
        try:
            value = attrs[semconv.AGL_REWARD_VALUE] = float(value)
        except ValueError:
            return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        attrs.setdefault(semconv.AGL_SPAN_KIND, semconv.KIND_REWARD)


def _looks_like_llm_call(span: Span) -> bool:
    if _LLM_LIKE_NAME.search(span.name):
        return True
    return any(key.startswith(_LLM_LIKE_KEYS) or any(k in key for k in _LLM_LIKE_KEYS[3:])
               for key in span.attributes)
