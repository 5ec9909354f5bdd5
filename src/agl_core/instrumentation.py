"""``instrument()`` / ``uninstrument()``: find plugins by entry point and switch them on or off."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from agl_core.errors import PluginError
from agl_core.guard import report

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from agl_core.plugin import Instrumentor

GROUP = "agl.instrumentors"

_active: dict[str, Instrumentor] = {}
_lock = threading.RLock()


class Instrumented(list[str]):
    """The names of the plugins now active; ``skipped`` maps each other plugin asked for to the reason."""

    def __init__(self, names: Iterable[str] = (), skipped: dict[str, str] | None = None) -> None:
        super().__init__(names)
        self.skipped: dict[str, str] = skipped or {}

    def __repr__(self) -> str:
        return f"Instrumented({list(self)!r}, skipped={self.skipped!r})"


def installed_plugins() -> dict[str, EntryPoint]:
    """Every plugin registered under the ``agl.instrumentors`` entry-point group, by name."""
    from importlib.metadata import entry_points

    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep)  # an editable dev install and a wheel may both register one
    return found


def instrument(names: Iterable[str] | None = None, *, tracer_provider: Any = None,
               capture_content: bool | None = None) -> Instrumented:
    """Activate installed plugins whose framework is importable; idempotent.

    With ``names``, only those plugins; an unknown name raises ``PluginError``
    listing the installed ones. Returns the names now active, with the reason
    for each plugin that was skipped in ``.skipped``.

    ``capture_content=False`` keeps prompts, outputs and tool arguments and
    results off every span (token ids, usage, names and timing stay); None
    follows ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` (see
    :mod:`agl_core.encoding`).
    """
    from agl_core import collector, encoding

    encoding.set_capture_content(capture_content)

    with _lock:
        plugins = installed_plugins()
        wanted = sorted(plugins) if names is None else list(dict.fromkeys([names] if isinstance(names, str) else names))
        unknown = [n for n in wanted if n not in plugins]
        if unknown:
            listed = ", ".join(sorted(plugins)) or "none"
            raise PluginError(f"unknown agl plugin {unknown[0]!r}; installed plugins: {listed}")
        collector.install(tracer_provider)
        result = Instrumented()
        for name in wanted:
            reason = _activate(name, plugins[name], tracer_provider)
            if reason is None:
                result.append(name)
            else:
                result.skipped[name] = reason
        return result


def _activate(name: str, ep: EntryPoint, tracer_provider: Any) -> str | None:
    if name in _active:
        return None
    try:
        cls = ep.load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin must not stop the others
        return f"cannot load {ep.value}: {type(exc).__name__}: {exc}"
    plugin: Instrumentor = cls()
    if plugin.is_instrumented_by_opentelemetry:  # already on, e.g. through opentelemetry-instrument
        _active[name] = plugin
        return None
    reason = plugin.unavailable_reason()
    if reason is not None:
        return reason
    try:
        plugin.instrument(tracer_provider=tracer_provider, skip_dep_check=True)
    except NotImplementedError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        report(f"instrument {name}", exc)
        return f"failed to attach: {type(exc).__name__}: {exc}"
    _active[name] = plugin
    return None


def uninstrument(names: Iterable[str] | None = None) -> list[str]:
    """Deactivate plugins (all active ones by default); every patched original is restored."""
    with _lock:
        wanted = list(_active) if names is None else [n for n in ([names] if isinstance(names, str) else names)]
        done = []
        for name in wanted:
            plugin = _active.pop(name, None)
            if plugin is not None:
                plugin.uninstrument()
                done.append(name)
        return done


def active() -> list[str]:
    with _lock:
        return sorted(_active)
