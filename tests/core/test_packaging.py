"""Each distribution builds as its own wheel holding only its own package, and agl-core installs and imports alone.

The wheels are built the way a release is (``python -m build --wheel dists/<name>``),
without build isolation so no build backend is fetched; the agl-core wheel is then
installed into a fresh virtual environment that sees none of this checkout.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# distribution -> (package, folder holding the package)
DISTS: dict[str, tuple[str, str]] = {
    "agl-core": ("agl_core", "src"),
    "agl-langchain": ("agl_langchain", "src"),
    "agl-openai-agents": ("agl_openai_agents", "src"),
    "agl-autogen": ("agl_autogen", "src"),
    "agl-crewai": ("agl_crewai", "src"),
    "agl-agent-framework": ("agl_agent_framework", "src"),
    "agl-pydantic-ai": ("agl_pydantic_ai", "src"),
    "agl-trainer": ("agl_trainer", "trainer"),
}

PLUGINS: dict[str, tuple[str, str]] = {  # distribution -> (plugin name, entry-point target)
    "agl-core": ("openai", "agl_core.openai_client:OpenAIInstrumentor"),
    "agl-langchain": ("langchain", "agl_langchain:LangChainInstrumentor"),
    "agl-openai-agents": ("openai_agents", "agl_openai_agents:OpenAIAgentsInstrumentor"),
    "agl-autogen": ("autogen", "agl_autogen:AutoGenInstrumentor"),
    "agl-crewai": ("crewai", "agl_crewai:CrewAIInstrumentor"),
    "agl-agent-framework": ("agent_framework", "agl_agent_framework:AgentFrameworkInstrumentor"),
    "agl-pydantic-ai": ("pydantic_ai", "agl_pydantic_ai:PydanticAIInstrumentor"),
}

VERSION = "0.1.0"

pytestmark = pytest.mark.packaging


def _source_files(dist: str) -> set[str]:
    package, folder = DISTS[dist]
    base = ROOT / folder
    return {
        path.relative_to(base).as_posix()
        for path in (base / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def _wheel_name(dist: str) -> str:
    return f"{dist.replace('-', '_')}-{VERSION}-py3-none-any.whl"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    built: dict[str, Path] = {}
    for dist in DISTS:
        command = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)]
        proc = subprocess.run(
            [*command, str(ROOT / "dists" / dist)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"building {dist} failed:\n{proc.stdout}\n{proc.stderr}"
        built[dist] = out / _wheel_name(dist)
        assert built[dist].is_file(), f"{dist}: no {built[dist].name} in {sorted(p.name for p in out.iterdir())}"
    return built


def _entry_points(wheel: zipfile.ZipFile, dist: str) -> dict[str, dict[str, str]]:
    name = f"{dist.replace('-', '_')}-{VERSION}.dist-info/entry_points.txt"
    if name not in wheel.namelist():
        return {}
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # names are case-sensitive
    parser.read_string(wheel.read(name).decode())
    return {group: dict(parser[group]) for group in parser.sections()}


@pytest.mark.parametrize("dist", list(DISTS))
def test_wheel_holds_only_its_own_package(wheels: dict[str, Path], dist: str) -> None:
    package, _ = DISTS[dist]
    with zipfile.ZipFile(wheels[dist]) as wheel:
        names = wheel.namelist()
        dist_info = f"{dist.replace('-', '_')}-{VERSION}.dist-info"
        assert {name.split("/")[0] for name in names} == {package, dist_info}
        assert {name for name in names if not name.startswith(dist_info)} == _source_files(dist)
        assert f"{package}/py.typed" in names
        metadata = Parser().parsestr(wheel.read(f"{dist_info}/METADATA").decode())
    assert metadata["Name"] == dist
    assert metadata["Version"] == VERSION
    requires = metadata.get_all("Requires-Dist") or []
    if dist != "agl-core":
        assert any(req.startswith("agl-core") for req in requires), requires


@pytest.mark.parametrize("dist", list(DISTS))
def test_wheel_registers_its_plugin_in_both_groups(wheels: dict[str, Path], dist: str) -> None:
    with zipfile.ZipFile(wheels[dist]) as wheel:
        groups = _entry_points(wheel, dist)
    if dist not in PLUGINS:
        assert groups == {}
        return
    name, target = PLUGINS[dist]
    expected = {"agl.instrumentors": {name: target}, "opentelemetry_instrumentor": {f"agl_{name}": target}}
    if dist == "agl-core":  # the `agl` command ships with the core
        expected["console_scripts"] = {"agl": "agl_core.cli:main"}
    assert groups == expected


def test_agl_core_wheel_ships_its_json_schema(wheels: dict[str, Path]) -> None:
    with zipfile.ZipFile(wheels["agl-core"]) as wheel:
        schemas = [n for n in wheel.namelist() if n.startswith("agl_core/schemas/") and n.endswith(".json")]
    assert schemas, "agl_core/schemas/*.json is missing from the agl-core wheel"


def test_dev_install_registers_every_distribution_entry_point() -> None:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    merged: dict[str, dict[str, str]] = {}
    for dist in DISTS:
        project = tomllib.loads((ROOT / "dists" / dist / "pyproject.toml").read_text())["project"]
        for group, entries in project.get("entry-points", {}).items():
            merged.setdefault(group, {}).update(entries)
    assert merged == root


def test_agl_core_wheel_installs_and_imports_in_a_fresh_venv(wheels: dict[str, Path], tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", str(wheels["agl-core"])],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert install.returncode == 0, f"pip install of the agl-core wheel failed:\n{install.stdout}\n{install.stderr}"
    probe = (
        "import importlib.metadata as m, agl_core; "
        "print(agl_core.__version__); print(agl_core.__file__); "
        "print(sorted(ep.name for ep in m.entry_points(group='agl.instrumentors')))"
    )
    run = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    version, location, plugins = run.stdout.splitlines()
    assert version == VERSION
    assert Path(location).is_relative_to(env_dir), f"imported agl_core from {location}, not from the fresh venv"
    assert plugins == "['openai']"
