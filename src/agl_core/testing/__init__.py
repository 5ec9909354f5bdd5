"""Test helpers that fake only the network edge: a fake OpenAI-compatible server (vLLM-like token ids)."""

from agl_core.testing.fake_openai import FakeOpenAI, RecordedRequest, render_prompt, tokenize

__all__ = ["FakeOpenAI", "RecordedRequest", "render_prompt", "tokenize"]
