"""Fault injection for plugin authors: find every agl function a plugin's hooks call and make each raise in turn.

agl's rule is that an error inside its instrumentation never changes what the user's agent gets. A
plugin's test proves it by running a small agent once per fault::

    from agl_core.testing.faults import check_reported, fault_id, hook_faults, inject

    FAULTS = hook_faults(my_plugin.attributes, my_plugin.instrumentor)

    @pytest.mark.parametrize("fault", FAULTS, ids=fault_id)
    def test_fail_open(fault, monkeypatch, caplog):
        good = run_agent()
        hits: list[int] = []
        inject(monkeypatch, fault, hits)()          # arm the fault
        assert run_agent() == good                  # the agent gets the same
        monkeypatch.undo()
        assert hits                                 # and the fault was reached
        check_reported(caplog)                      # logged once per site and counted

The faults are found by introspection, so a hook added later is covered without editing the test.
:func:`misbehaving_provider` covers the other side: a user SDK provider whose processor raises or
whose exporter raises or never answers.

Only the standard library and agl_core are imported at module level; pytest is accepted as a parameter
(``monkeypatch``, ``caplog``) and the OpenTelemetry SDK is imported when a fake exporter is built.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import threading
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from agl_core import collector, guard
from agl_core.testing.fake_openai import FakeOpenAI

if TYPE_CHECKING:
    import pytest

__all__ = [
    "PROVIDER_FAULTS",
    "blocking_exporter",
    "check_misbehaving_provider",
    "check_reported",
    "fault_id",
    "hook_faults",
    "inject",
    "misbehaving_provider",
    "raising_exporter",
    "raising_processor",
]

Fault = tuple[Any, str]
"""``(owner, name)``: ``getattr(owner, name)`` (or ``vars(owner)[name]`` for a class) is the function to break."""

INJECTED = "agl-injected-fault"
"""The message of every injected ``RuntimeError``."""


# --------------------------------------------------------------------------- the faults, by introspection


def hook_faults(attrs_module: types.ModuleType, instrumentor_module: types.ModuleType) -> list[Fault]:
    """(owner, name) of every agl function a plugin's hooks call, for :func:`inject`.

    The attributes module's own functions, its classes' methods and the agl helpers it imports; the
    agl_core helpers the instrumentor imports by name (``set_on``, ...); ``collector.tracer``. Fault
    reporting itself (``agl_core.guard``) and the hook wrappers are not faults that a hook calls.
    """
    found: list[Fault] = []
    for name, value in vars(attrs_module).items():
        if inspect.isclass(value) and value.__module__ == attrs_module.__name__:
            found += [(value, m) for m, f in vars(value).items() if inspect.isfunction(f)]
        elif _agl_callable(value):
            found.append((attrs_module, name))
    for name, value in vars(instrumentor_module).items():
        if _agl_callable(value) and value.__module__ not in (instrumentor_module.__name__, attrs_module.__name__):
            found.append((instrumentor_module, name))
    found.append((collector, "tracer"))
    return found


def _agl_callable(value: Any) -> bool:
    if not (inspect.isfunction(value) or inspect.ismethod(value)):
        return False
    module = getattr(value, "__module__", "") or ""
    return module.startswith("agl_") and module != guard.__name__


def fault_id(fault: Fault) -> str:
    """A readable test id: ``agl_langchain.attributes.dumps``, ``_Memo.__init__``, ``agl_core.collector.tracer``."""
    owner, name = fault
    return f"{getattr(owner, '__qualname__', None) or owner.__name__}.{name}"


def _raiser(*args: Any, **kwargs: Any) -> Any:
    """The body a faulty function gets (its ``__code__``): counts the call, then raises.

    It runs with the patched function's globals, so it reaches the counter through builtins.
    """
    __agl_fault_hits__.append(1)  # type: ignore[name-defined]  # noqa: F821
    raise RuntimeError("agl-injected-fault")


def inject(monkeypatch: pytest.MonkeyPatch, fault: Fault, hits: list[int]) -> Callable[[], None]:
    """The function that arms ``fault`` (run it where the fault must start); each call of it appends to ``hits``.

    A plain function gets the raising body in place (``__code__``), so every reference to it fails,
    including ones bound at import time (a memo's key function, a class's method); a closure or a
    bound method is replaced by name in the namespace that holds it. ``monkeypatch.undo()`` disarms.
    """
    monkeypatch.setattr(builtins, "__agl_fault_hits__", hits, raising=False)
    owner, name = fault
    target = vars(owner)[name] if inspect.isclass(owner) else getattr(owner, name)

    def arm() -> None:
        if inspect.isfunction(target) and not target.__code__.co_freevars:
            monkeypatch.setattr(target, "__code__", _raiser.__code__)
        else:
            def boom(*args: Any, **kwargs: Any) -> Any:
                hits.append(1)
                raise RuntimeError(INJECTED)

            monkeypatch.setattr(owner, name, boom)

    return arm


def check_reported(caplog: pytest.LogCaptureFixture) -> None:
    """Each faulty site was logged exactly once on the ``agl`` logger, naming the injected fault, and counted.

    Set ``caplog.set_level(logging.WARNING, logger="agl")`` before the run.
    """
    counts = guard.fault_counts()
    assert sum(counts.values()) >= 1, "the fault was swallowed without being reported"
    logged = [r for r in caplog.records if r.name == "agl" and "error in" in r.getMessage()]
    sites = [str(r.args[0]) if isinstance(r.args, tuple) and r.args else r.getMessage() for r in logged]
    assert sorted(sites) == sorted(counts), "each faulty site is logged exactly once"
    assert any(INJECTED in r.getMessage() for r in logged)


# --------------------------------------------------------------------------- the user's provider misbehaves


@functools.cache
def _sdk_kit() -> dict[str, type[Any]]:
    """The fake exporters and processor, built on first use (the OpenTelemetry SDK is imported here)."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class RaisingExporter(SpanExporter):
        """An exporter whose backend is unreachable: every export raises; ``calls`` counts them."""

        def __init__(self) -> None:
            self.calls = 0
            self.release = threading.Event()

        def export(self, spans: Any) -> SpanExportResult:
            self.calls += 1
            raise ConnectionError("collector unreachable")

        def shutdown(self) -> None:
            self.release.set()

    class BlockingExporter(SpanExporter):
        """An exporter whose backend never answers until ``release`` is set; ``entered`` is set on the first export."""

        def __init__(self) -> None:
            self.release = threading.Event()
            self.entered = threading.Event()

        def export(self, spans: Any) -> SpanExportResult:
            self.entered.set()
            self.release.wait(60)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self.release.set()

    class RaisingProcessor(SpanProcessor):
        """A processor that raises on span start, end or both (``on``: "start", "end", "both")."""

        def __init__(self, on: str) -> None:
            self.on = on

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            if self.on in ("start", "both"):
                raise RuntimeError("processor on_start")

        def on_end(self, span: Any) -> None:
            if self.on in ("end", "both"):
                raise RuntimeError("processor on_end")

    return {"raising": RaisingExporter, "blocking": BlockingExporter, "processor": RaisingProcessor}


def raising_exporter() -> Any:
    """A ``SpanExporter`` whose every export raises ``ConnectionError``; ``.calls`` counts the exports."""
    return _sdk_kit()["raising"]()


def blocking_exporter() -> Any:
    """A ``SpanExporter`` whose exports wait (60 s at most) until ``.release`` is set; ``.entered`` marks the first."""
    return _sdk_kit()["blocking"]()


def raising_processor(on: str) -> Any:
    """A ``SpanProcessor`` that raises ``RuntimeError`` in ``on_start``, ``on_end`` or both (``on``)."""
    if on not in ("start", "end", "both"):
        raise ValueError(f"raising_processor: on must be 'start', 'end' or 'both', not {on!r}")
    return _sdk_kit()["processor"](on)


PROVIDER_FAULTS = ["processor raises on start", "processor raises on end", "exporter raises", "exporter blocks"]
"""The user-provider faults :func:`misbehaving_provider` knows, for ``pytest.mark.parametrize``."""


@contextlib.contextmanager
def misbehaving_provider(fault: str) -> Iterator[Any]:
    """agl's spans go to a user SDK ``TracerProvider`` with ``fault`` (one of :data:`PROVIDER_FAULTS`) while inside.

    A raising processor is added before agl's (so the SDK stops its chain there); a raising exporter sits
    behind a ``SimpleSpanProcessor``, a blocking one behind a ``BatchSpanProcessor``. On exit agl goes
    back to its own tracer, the blocked exporter is let go and the provider is shut down.
    """
    if fault not in PROVIDER_FAULTS:
        raise ValueError(f"misbehaving_provider: unknown fault {fault!r}; known: {PROVIDER_FAULTS}")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider()
    exporter = blocking_exporter() if fault == "exporter blocks" else raising_exporter()
    if fault.startswith("processor"):
        provider.add_span_processor(raising_processor(fault.split()[-1]))
    elif fault == "exporter raises":
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1, max_export_batch_size=1))
    collector.use_provider(provider)
    try:
        yield provider
    finally:
        collector.use_provider(None)
        exporter.release.set()
        provider.shutdown()


def check_misbehaving_provider(fault: str, agent: Callable[..., Any], script: list[Any], good: Any) -> None:
    """With :func:`misbehaving_provider` ``fault``, ``agent(srv)`` still returns ``good`` and no span is lost.

    ``agent(srv, during=f)`` must run the workload against the fake server ``srv`` inside an
    ``agl.rollout`` block, calling ``f()`` first inside it; ``script`` is the server's script for one run.
    A raising processor is reported only at the collector's span start/end sites.
    """

    def span_names(srv: FakeOpenAI) -> list[str]:
        buffers: list[Any] = []
        agent(srv, during=lambda: buffers.append(collector.current_rollout.get()))
        return sorted(collector.to_record(s).name for s in buffers[0].spans)

    with FakeOpenAI(script=script) as srv:
        plain_names = span_names(srv)
    with misbehaving_provider(fault):
        with FakeOpenAI(script=script) as srv:
            assert agent(srv) == good
        with FakeOpenAI(script=script) as srv:
            assert span_names(srv) == plain_names  # no span lost
    if fault.startswith("processor"):
        counts = guard.fault_counts()
        assert counts and set(counts) <= {"collector.start_span", "collector.span_end"}, counts
