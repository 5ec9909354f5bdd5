"""Content-capture checks for plugin authors: with capture off, no secret of the agent's reaches a span.

A plugin's test runs one small agent whose prompt, tool arguments and replies carry a marker string::

    from agl_core.testing.redaction import capturing_provider, check_captured, check_redacted, switch_off

    @pytest.fixture
    def capture(monkeypatch):
        with capturing_provider(monkeypatch) as exporter:
            yield exporter

    @pytest.mark.parametrize("how", ["argument", "env"])
    def test_capture_off(capture, how, monkeypatch):
        switch_off(how, ["my_plugin", "openai"], monkeypatch)
        answer, run = run_agent()
        check_redacted(run, capture.get_finished_spans(), SECRET, tool="lookup", agent_name="weather")

``switch_off`` turns capture off with ``agl.instrument(capture_content=False)`` or with
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false``; ``check_redacted`` looks at agl's own
records and at what the user's exporter saw, and checks that names, usage, timing and token ids stay.
``check_captured`` is the control: without the switch the same run does carry the content.

Only the standard library and agl_core are imported at module level; pytest is accepted as a
parameter and the OpenTelemetry SDK is imported when the provider is built.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from agl_core import collector, encoding, semconv
from agl_core.instrumentation import instrument, uninstrument

if TYPE_CHECKING:
    import pytest

    from agl_core.rollouts import RolloutRun

__all__ = ["capturing_provider", "check_captured", "check_redacted", "switch_off", "texts"]


@contextlib.contextmanager
def capturing_provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A user SDK provider with an ``InMemorySpanExporter`` (yielded); the capture setting is put back afterwards."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    uninstrument()
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    collector.use_provider(provider)
    try:
        yield exporter
    finally:
        uninstrument()
        collector.use_provider(None)
        monkeypatch.delenv(encoding.CAPTURE_CONTENT_ENV, raising=False)
        encoding.reset_capture_content()


def switch_off(how: str, plugins: Sequence[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Instrument ``plugins`` with content capture off, by ``how``: "argument" or "env" (the OTel variable)."""
    if how == "argument":
        active = instrument(list(plugins), capture_content=False)
    elif how == "env":
        monkeypatch.setenv(encoding.CAPTURE_CONTENT_ENV, "false")
        active = instrument(list(plugins))
    else:
        raise ValueError(f"switch_off: how must be 'argument' or 'env', not {how!r}")
    assert sorted(active) == sorted(plugins) and encoding.capture_content is False


def texts(attributes: Any) -> str:
    """A span's attributes as one JSON text, to search for a secret."""
    return json.dumps({k: v for k, v in dict(attributes or {}).items()}, default=str)


def check_redacted(run: RolloutRun, exported: Sequence[Any], secret: str, *, tool: str = "lookup",
                   agent_name: str = "weather", transitions: int = 2) -> None:
    """No ``secret`` and no content attribute in agl's spans or the exported ones; names, usage, timing stay.

    The run still trains: ``transitions`` transitions of ``agent_name``, each with token ids and no secret.
    """
    assert exported and run.rollout.spans
    for attrs in [s.attributes for s in run.rollout.spans] + [s.attributes for s in exported]:
        assert secret not in texts(attrs)
        assert not set(dict(attrs or {})) & encoding.CONTENT_ATTRIBUTES
    spans = run.rollout.spans
    assert not [s.name for s in spans if secret in s.name]
    assert any(s.attributes.get(semconv.GEN_AI_TOOL_NAME) == tool for s in spans)  # names kept
    assert any(s.attributes.get(semconv.GEN_AI_USAGE_INPUT_TOKENS) for s in spans)  # usage kept
    assert all(s.end_ns >= s.start_ns > 0 for s in spans)  # timing kept
    traj = run.trajectory()
    assert len(traj.transitions) == transitions and traj.reward == 1.0
    for t in traj.transitions:  # training still works from token ids
        assert t.prompt_token_ids and t.response_token_ids and t.agent_name == agent_name
        assert secret not in json.dumps(t.to_dict())


def check_captured(run: RolloutRun, exported: Sequence[Any], secret: str) -> None:
    """The control for :func:`check_redacted`: with capture on, the run's spans carry the content and ``secret``."""
    keys: set[str] = set().union(*(s.attributes for s in run.rollout.spans))
    assert {semconv.GEN_AI_INPUT_MESSAGES, semconv.GEN_AI_OUTPUT_MESSAGES, semconv.GEN_AI_TOOL_CALL_ARGUMENTS,
            semconv.GEN_AI_TOOL_CALL_RESULT} <= keys
    assert any(secret in texts(s.attributes) for s in exported)
