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
import inspect
from collections.abc import Callable, Collection
from typing import Any, ClassVar

from opentelemetry.instrumentation.dependencies import get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from agl_core import collector
from agl_core.guard import report

_MISSING = object()


class Instrumentor(BaseInstrumentor):  # type: ignore[misc]
    """Base of agl's plugins: one per framework, a singleton like every ``BaseInstrumentor``."""

    name: ClassVar[str] = ""
    framework: ClassVar[str] = ""
    requirements: ClassVar[tuple[str, ...]] = ()
    #: The attribute a plugin sets on each of its wrappers (holding what it wraps), so a method
    #: already wrapped is never wrapped again; :meth:`hook_family` needs it.
    wrapper_mark: ClassVar[str] = ""
    #: False once uninstrumented: wrappers someone still holds, and the subclass hook, pass through.
    _active: bool = False

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

    # -- finding every class of a family ---------------------------------------------------

    def hook_family(self, base: type[Any], wrappers: dict[str, Callable[[Any], Any]]) -> None:
        """Wrap ``wrappers``' methods on ``base`` and each subclass defining one, now and when defined later.

        Subclasses that exist are found through ``__subclasses__`` recursively; ones defined
        later (a user's own model client) through a patched ``__init_subclass__`` on ``base``,
        which is undone with every other patch. A method counts as defined by a class when it
        is a plain function in its ``__dict__``, not abstract and not already one of ours.
        """
        seen: set[type[Any]] = set()
        stack = [base]
        while stack:
            cls = stack.pop()
            if cls in seen:
                continue
            seen.add(cls)
            self._patch_class(cls, wrappers)
            stack.extend(cls.__subclasses__())
        self.patch(base, "__init_subclass__", lambda _: self._init_subclass_hook(base, wrappers))

    def _patch_class(self, cls: type[Any], wrappers: dict[str, Callable[[Any], Any]]) -> None:
        for attr, make in wrappers.items():
            fn = cls.__dict__.get(attr)
            if (fn is None or not inspect.isfunction(fn) or getattr(fn, "__isabstractmethod__", False)
                    or hasattr(fn, self.wrapper_mark)):
                continue
            self.patch(cls, attr, make)

    def _init_subclass_hook(self, base: type[Any], wrappers: dict[str, Callable[[Any], Any]]) -> Any:
        raw = base.__dict__.get("__init_subclass__")
        plugin = self

        def __init_subclass__(cls: type[Any], /, **kwargs: Any) -> None:
            if raw is not None:
                raw.__get__(None, cls)(**kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)
            if plugin._active:
                try:
                    plugin._patch_class(cls, wrappers)
                except Exception as exc:  # noqa: BLE001 - fail-open: the class is still made
                    report(f"{plugin.name}.init_subclass", exc)

        setattr(__init_subclass__, self.wrapper_mark, raw)
        return classmethod(__init_subclass__)
