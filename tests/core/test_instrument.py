"""instrument() / uninstrument(): discovery by entry point, skips with reasons, exact restore."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import agl_core as agl
from agl_core import instrumentation

TOY_PLUGINS = '''
from agl_core.plugin import Instrumentor


class Ghost(Instrumentor):
    name = "ghost"
    framework = "agl_no_such_framework_xyz"


class Toy(Instrumentor):
    name = "toy"
    framework = "agl_toy_framework"

    def _attach(self):
        import agl_toy_framework as fw

        def make(original):
            def hello(self):
                return "instrumented " + original(self)
            return hello

        self.patch(fw.Greeter, "hello", make)


class Broken(Instrumentor):
    name = "broken"
    framework = "agl_toy_framework"

    def _attach(self):
        import agl_toy_framework as fw

        self.patch(fw.Greeter, "bye", lambda original: original)
        raise RuntimeError("hook layout unknown")


class Conflicted(Instrumentor):
    name = "conflicted"
    framework = "agl_toy_framework"
    requirements = ("agl-toy-framework >= 99",)
'''

TOY_FRAMEWORK = '''
class Greeter:
    def hello(self):
        return "hello"

    def bye(self):
        return "bye"
'''


@pytest.fixture()
def toy_plugins(tmp_path: Path) -> Iterator[None]:
    """A plugin distribution and a framework installed the way pip would: modules plus dist-info on sys.path."""
    (tmp_path / "agl_toy_plugins.py").write_text(TOY_PLUGINS)
    (tmp_path / "agl_toy_framework.py").write_text(TOY_FRAMEWORK)
    for dist, version, eps in [
        ("agl_toy_plugins", "1.0", "ghost = agl_toy_plugins:Ghost\ntoy = agl_toy_plugins:Toy\n"
                                   "broken = agl_toy_plugins:Broken\nconflicted = agl_toy_plugins:Conflicted\n"),
        ("agl_toy_framework", "1.0", ""),
    ]:
        info = tmp_path / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n")
        if eps:
            (info / "entry_points.txt").write_text(f"[agl.instrumentors]\n{eps}")
    sys.path.insert(0, str(tmp_path))
    try:
        yield
    finally:
        agl.uninstrument(["toy", "broken", "conflicted", "ghost"])
        sys.path.remove(str(tmp_path))
        for mod in ("agl_toy_plugins", "agl_toy_framework"):
            sys.modules.pop(mod, None)


def test_discovery_activates_what_it_can_and_says_why_not(toy_plugins: None) -> None:
    import agl_toy_framework as fw

    original_hello, original_bye = fw.Greeter.__dict__["hello"], fw.Greeter.__dict__["bye"]
    result = agl.instrument(["toy", "ghost", "broken", "conflicted"])
    assert list(result) == ["toy"]
    assert "agl_no_such_framework_xyz" in result.skipped["ghost"] and "not importable" in result.skipped["ghost"]
    assert "hook layout unknown" in result.skipped["broken"]
    assert "conflict" in result.skipped["conflicted"]
    assert fw.Greeter().hello() == "instrumented hello"
    assert fw.Greeter.__dict__["bye"] is original_bye  # the failed plugin's partial patch was undone

    again = agl.instrument(["toy"])  # idempotent: no double wrapping
    assert list(again) == ["toy"] and fw.Greeter().hello() == "instrumented hello"

    assert agl.uninstrument(["toy"]) == ["toy"]
    assert fw.Greeter.__dict__["hello"] is original_hello
    assert agl.uninstrument(["toy"]) == []


def test_unknown_plugin_name_lists_installed_ones(toy_plugins: None) -> None:
    with pytest.raises(agl.PluginError) as err:
        agl.instrument(["langchian"])
    message = str(err.value)
    assert "'langchian'" in message and "toy" in message and "openai" in message


def test_all_installed_plugins_report_a_state() -> None:
    result = agl.instrument()
    try:
        installed = set(instrumentation.installed_plugins())
        assert {"openai", "langchain", "openai_agents", "autogen", "crewai", "agent_framework",
                "pydantic_ai"} <= installed
        assert set(result) | set(result.skipped) == installed
        assert "openai" in result  # the plain client ships with agl-core and openai is installed here
        assert all(reason for reason in result.skipped.values())
    finally:
        agl.uninstrument()


def test_uninstrument_restores_openai_exactly() -> None:
    from openai.resources.chat.completions import AsyncCompletions, Completions

    before = (Completions.__dict__["create"], AsyncCompletions.__dict__["create"])
    agl.instrument(["openai"])
    agl.instrument(["openai"])
    assert Completions.__dict__["create"] is not before[0]
    agl.uninstrument()
    assert (Completions.__dict__["create"], AsyncCompletions.__dict__["create"]) == before
    assert Completions.__dict__["create"] is before[0] and AsyncCompletions.__dict__["create"] is before[1]


def test_opentelemetry_instrument_entry_points_are_registered() -> None:
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="opentelemetry_instrumentor")}
    assert {"agl_openai", "agl_langchain", "agl_openai_agents", "agl_autogen", "agl_crewai",
            "agl_agent_framework", "agl_pydantic_ai"} <= names


def test_import_is_thin() -> None:
    import subprocess

    code = textwrap.dedent(
        """
        import sys
        import agl_core
        heavy = ["openai", "torch", "fastapi", "uvicorn", "starlette", "langchain_core", "langchain", "crewai",
                 "autogen_core", "autogen_agentchat", "agents", "agent_framework", "pydantic_ai", "transformers",
                 "pydantic", "httpx",
                 "opentelemetry.sdk", "sqlite3", "verl", "ray"]
        print(",".join(m for m in heavy if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


def test_public_names_survive_submodule_imports() -> None:
    """Importing a submodule must never shadow a public function of the same name on the package."""
    import importlib
    import pkgutil

    import agl_core

    for info in pkgutil.walk_packages(agl_core.__path__, "agl_core."):
        if not info.name.startswith(("agl_core.openai_client", "agl_core.testing")):
            importlib.import_module(info.name)
    for name in agl_core.__all__:
        value = getattr(agl_core, name)
        assert not isinstance(value, type(agl_core)), f"agl_core.{name} is a module"
