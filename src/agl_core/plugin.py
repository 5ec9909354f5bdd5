"""The base every agl plugin subclasses: OpenTelemetry's ``BaseInstrumentor`` plus patching that undoes itself.

A plugin names the framework module it needs (``framework``) and the versions it
was tested with (``requirements``); it attaches its hooks in ``_attach`` and
detaches non-patch hooks in ``_detach``. Patches made through :meth:`patch` are
undone by ``uninstrument()`` so that every patched attribute is the original
object again (``is`` holds). Plugin modules import their framework inside
``_attach``, never at module top, so discovery can say *why* a plugin is skipped
instead of failing to load it.

Because the class is a ``BaseInstrumentor``, ``opentelemetry-instrument python
app.py`` activates agl plugins too (entry-point group ``opentelemetry_instrumentor``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Collection
from typing import Any, ClassVar

from opentelemetry.instrumentation.dependencies import get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from agl_core import collector

_MISSING = object()


class Instrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Base of agl's plugins: one per framework, a singleton like every ``BaseInstrumentor``."""

    name: ClassVar[str] = ""
    framework: ClassVar[str] = ""
    requirements: ClassVar[tuple[str, ...]] = ()

    _patches: list[tuple[Any, str, Any]]

    def instrumentation_dependencies(self) -> Collection[str]:
        return self.requirements

    def unavailable_reason(self) -> str | None:
        """Why this plugin cannot be activated here, or None when it can."""
        if self.framework and importlib.util.find_spec(self.framework.split(".")[0]) is None:
            return f"{self.framework!r} is not importable (install it to use the {self.name!r} plugin)"
        conflict = get_dependency_conflicts(list(self.requirements))
        if conflict is not None:
            return f"version conflict: {conflict}"
        return None

    def _instrument(self, **kwargs: Any) -> None:
        collector.install(kwargs.get("tracer_provider"))
        self._patches = []
        try:
            self._attach()
        except BaseException:
            self._restore()
            raise

    def _uninstrument(self, **kwargs: Any) -> None:
        try:
            self._detach()
        finally:
            self._restore()

    def _attach(self) -> None:
        raise NotImplementedError(f"the {self.name!r} plugin attaches no hooks yet")

    def _detach(self) -> None:
        """Undo hooks that are not patches (callbacks, processors); patches are undone for you."""

    def patch(self, owner: Any, attr: str, make_wrapper: Callable[[Any], Any]) -> None:
        """Replace ``owner.attr`` with ``make_wrapper(original)``, remembered for ``uninstrument``."""
        raw = owner.__dict__.get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        current = getattr(owner, attr)
        wrapper = make_wrapper(current)
        setattr(owner, attr, wrapper)
        self._patches.append((owner, attr, raw))

    def _restore(self) -> None:
        patches = getattr(self, "_patches", [])
        while patches:
            owner, attr, raw = patches.pop()
            if raw is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, raw)
