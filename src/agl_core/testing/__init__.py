"""Test helpers that fake only the network edge: a fake OpenAI-compatible server (vLLM-like token ids).

For plugin authors, two submodules (imported on their own, ``from agl_core.testing.faults import ...``):
:mod:`agl_core.testing.faults` finds every agl function a plugin's hooks call and makes each raise in
turn (fail-open tests); :mod:`agl_core.testing.redaction` checks that with content capture off no
secret of the agent's reaches a span.
"""

from agl_core.testing.fake_openai import FakeOpenAI, LoraLoad, RecordedRequest, render_prompt, tokenize

__all__ = ["FakeOpenAI", "LoraLoad", "RecordedRequest", "render_prompt", "tokenize"]
