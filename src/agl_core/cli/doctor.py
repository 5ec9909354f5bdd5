"""``agl doctor``: what agl would do in this environment, and why.

It answers the questions asked when spans or token ids are missing: which agl
plugins are installed and whether each would activate (or why not: the same
reasons ``agl.instrument()`` puts in ``.skipped``), which framework versions
are installed, which OpenTelemetry provider agl's spans would go to, whether
``opentelemetry-instrument`` would export them (it needs ``opentelemetry-distro``
for that), whether the gateway (``--server`` or ``OPENAI_BASE_URL``) answers, and
what would be captured: message content (on or off) and where token ids would
come from.

The gateway is checked on the path the agent's OpenAI client will use: the base
URL is ``OPENAI_BASE_URL`` exactly as set, or ``--server``'s root with ``/v1``
(what ``agl worker`` gives its agent), so a base URL without ``/v1`` shows as the
404 the agent would get, not as a server that answers.

Nothing here patches a framework: a plugin is loaded and asked
``unavailable_reason()``, which only looks for the framework; it is not
instrumented.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from importlib import metadata
from typing import Any

import click

__all__ = ["diagnose", "doctor"]

# Installed beside agl and worth a line when present: training backends and serving engines.
_OTHER_PACKAGES = ("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-instrumentation", "opentelemetry-distro",
                   "opentelemetry-exporter-otlp", "torch", "transformers", "vllm", "verl", "ray", "datasets", "pyarrow")


@click.command("doctor", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--server", metavar="URL", help="the agl server or OpenAI-compatible gateway to check "
              "[default: $OPENAI_BASE_URL]")
@click.option("--token", envvar="AGL_TOKEN", metavar="TOKEN",
              help="bearer token for it [env: AGL_TOKEN; else $OPENAI_API_KEY]")
@click.option("--probe", is_flag=True, help="also send one 1-token chat request, to see whether token ids come back")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="seconds per HTTP request")
@click.option("--json", "as_json", is_flag=True, help="the report as one JSON object")
def doctor(server: str | None, token: str | None, probe: bool, timeout: float, as_json: bool) -> None:
    """Installed plugins and whether each would activate, framework versions, the OpenTelemetry provider,
    gateway reachability, and what would be captured. Exits 1 when the gateway checked cannot be reached."""
    if server is not None and not server.startswith(("http://", "https://")):
        raise click.BadParameter(f"must be an http:// or https:// URL, got {server!r}", param_hint="'--server'")
    report = diagnose(server=server, token=token, probe=probe, timeout=timeout)
    if as_json:
        click.echo(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        _print(report)
    gateway = report["gateway"]
    if gateway["url"] is not None and not gateway["reachable"]:
        raise SystemExit(1)


# ---------------------------------------------------------------------- the checks


def diagnose(*, server: str | None = None, token: str | None = None, probe: bool = False,
             timeout: float = 5.0) -> dict[str, Any]:
    """The doctor's report as plain data (what ``agl doctor --json`` prints)."""
    from agl_core import __version__

    plugins = _plugins()
    return {
        "agl": __version__,
        "plugins": plugins,
        "packages": _packages(plugins),
        "provider": _provider(),
        "auto_instrumentation": _auto_instrumentation(),
        "gateway": _gateway(server, token, probe, timeout),
        "capture": _capture(),
    }


def _plugins() -> list[dict[str, Any]]:
    from agl_core.instrumentation import active, installed_plugins

    on = set(active())
    rows = []
    for name, ep in sorted(installed_plugins().items()):
        dist = ep.dist
        row: dict[str, Any] = {"name": name, "target": ep.value,
                               "distribution": f"{dist.name} {dist.version}" if dist is not None else None,
                               "framework": None, "requirements": [], "status": "", "reason": None}
        try:
            cls = ep.load()
            plugin = cls()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is a finding, not a crash
            row.update(status="broken", reason=f"cannot load {ep.value}: {type(exc).__name__}: {exc}")
            rows.append(row)
            continue
        row["framework"] = getattr(plugin, "framework", None) or None
        row["requirements"] = list(getattr(plugin, "requirements", ()))
        if name in on or getattr(plugin, "is_instrumented_by_opentelemetry", False):
            row["status"] = "active"
            rows.append(row)
            continue
        try:
            reason = plugin.unavailable_reason()
        except Exception as exc:  # noqa: BLE001
            reason = f"its check failed: {type(exc).__name__}: {exc}"
        row.update(status="would activate" if reason is None else "skipped", reason=reason)
        rows.append(row)
    return rows


def _requirement_name(requirement: str) -> str:
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return Requirement(requirement).name
    except InvalidRequirement:
        return requirement.split()[0]


def _packages(plugins: list[dict[str, Any]]) -> dict[str, str | None]:
    names = [_requirement_name(r) for p in plugins for r in p["requirements"]]
    versions: dict[str, str | None] = {}
    for name in [*dict.fromkeys(names), *_OTHER_PACKAGES]:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _provider() -> dict[str, Any]:
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    kind = f"{type(provider).__module__}.{type(provider).__qualname__}"
    try:
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:  # pragma: no cover - agl-core depends on the SDK
        TracerProvider = None  # type: ignore[assignment,misc]  # noqa: N806
    user_sdk = TracerProvider is not None and isinstance(provider, TracerProvider)
    processors: list[str] = []
    if user_sdk:
        active = getattr(provider, "_active_span_processor", None)
        for p in getattr(active, "_span_processors", ()):
            exporter = getattr(p, "span_exporter", None)
            processors.append(type(p).__name__ + (f"({type(exporter).__name__})" if exporter is not None else ""))
    env = {k: v for k, v in sorted(os.environ.items())
           if k in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "OTEL_SERVICE_NAME", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS")}
    if user_sdk:
        summary = ("the SDK TracerProvider set in this process: agl adds its span processor to it, so its exporters "
                   "see agl's spans too")
    else:
        summary = ("agl's own light tracer: no SDK TracerProvider is set here, so nobody else reads the spans (set "
                   "one before agl.instrument(), or run under opentelemetry-instrument, to export them too)")
    return {"global": kind, "user_sdk": user_sdk, "processors": processors, "env": env, "summary": summary}


def _auto_instrumentation() -> dict[str, Any]:
    """Whether ``opentelemetry-instrument python app.py`` would export agl's spans.

    The command runs every ``opentelemetry_instrumentor`` (agl's plugins among them) but sets up the
    SDK's provider and exporters only through a configurator, which ``opentelemetry-distro`` brings.
    """
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    command, distro = version("opentelemetry-instrumentation"), version("opentelemetry-distro")
    if command is None:
        summary = "opentelemetry-instrument is not installed (pip install opentelemetry-instrumentation)"
    elif distro is None:
        summary = ("opentelemetry-instrument python app.py runs agl's plugins but exports nothing: "
                   "opentelemetry-distro is not installed, so no SDK provider or exporter is set up "
                   "(pip install opentelemetry-distro opentelemetry-exporter-otlp)")
    else:
        summary = (f"opentelemetry-instrument python app.py sets up the SDK (opentelemetry-distro {distro}) and runs "
                   "agl's plugins; exporters come from the OTEL_* variables")
    return {"command": command, "distro": distro, "exports": command is not None and distro is not None,
            "summary": summary}


def _capture() -> dict[str, Any]:
    from agl_core import encoding

    raw = os.environ.get(encoding.CAPTURE_CONTENT_ENV)
    return {"content": bool(encoding.capture_content), "env": encoding.CAPTURE_CONTENT_ENV, "env_value": raw}


def _agent_base_url(url: str, source: str | None) -> str:
    """The base URL the agent's OpenAI client will use: OPENAI_BASE_URL as set, a bare --server root plus /v1."""
    base = url.rstrip("/")
    if source == "--server" and not urllib.parse.urlsplit(base).path:
        return base + "/v1"  # what agl worker gives its agent for this server
    return base


def _gateway(server: str | None, token: str | None, probe: bool, timeout: float) -> dict[str, Any]:
    source = "--server" if server else ("OPENAI_BASE_URL" if os.environ.get("OPENAI_BASE_URL") else None)
    url = server or os.environ.get("OPENAI_BASE_URL")
    result: dict[str, Any] = {"url": None, "source": source, "base_url": None, "models_path": None,
                              "reachable": False, "healthz": None, "models": None, "agl_server": False,
                              "token_ids": None, "probe": None, "error": None}
    if not url:
        return result
    agent_base = _agent_base_url(url, source)
    base = agent_base[: -len("/v1")] if agent_base.endswith("/v1") else agent_base
    result.update(url=base, base_url=agent_base, models_path=urllib.parse.urlsplit(agent_base).path + "/models")
    key = token or os.environ.get("AGL_TOKEN") or os.environ.get("OPENAI_API_KEY")
    health_status, _ = _get(base + "/healthz", key, timeout)
    models_status, models = _get(agent_base + "/models", key, timeout)
    result["healthz"] = health_status
    if isinstance(models_status, int) and models_status == 200 and isinstance(models, dict):
        result["models"] = [str(m.get("id")) for m in models.get("data") or [] if isinstance(m, dict)]
    else:
        result["models"] = models_status
    result["reachable"] = isinstance(models_status, int) and models_status == 200
    if not result["reachable"]:
        result["error"] = f"GET {agent_base}/models: {models_status}"
        if models_status == 404 and not agent_base.endswith("/v1"):
            result["error"] += (" (the agent's OpenAI client would get this 404 too: is the base URL missing its "
                                "/v1?)")
    # /v1/model (the served policy's version) is agl's own: only its server answers it
    model_status, model = _get(base + "/v1/model", key, timeout)
    result["agl_server"] = health_status == 200 and model_status == 200 and isinstance(model, dict)
    if result["agl_server"]:
        result["token_ids"] = "exact: agl's gateway records prompt and response token ids per call (gateway)"
    elif result["reachable"]:
        result["token_ids"] = ("only if this server returns them in its responses (vLLM with return_token_ids: "
                               "response); otherwise transitions are re-tokenised (retokenized)")
    if probe and isinstance(models_status, int):  # the server answered: probe the path the agent will use
        result["probe"] = _probe(agent_base, key, timeout, result["models"])
        if result["probe"].get("token_ids"):
            result["token_ids"] = (result["token_ids"] if result["agl_server"]
                                   else "in the response: this server returned token ids (response)")
    return result


def _get(url: str, key: str | None, timeout: float) -> tuple[int | str, Any]:
    return _request(urllib.request.Request(url, method="GET"), key, timeout)


def _request(request: urllib.request.Request, key: str | None, timeout: float) -> tuple[int | str, Any]:
    """(HTTP status, JSON body or None), or (why it failed, None) when nothing answered."""
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the user's own URL
            status, body = int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        status, body = int(exc.code), exc.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"unreachable ({reason})", None
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, None


def _probe(agent_base: str, key: str | None, timeout: float, models: Any) -> dict[str, Any]:
    """One 1-token chat request to ``{agent_base}/chat/completions``, as the agent's OpenAI client sends it."""
    model = models[0] if isinstance(models, list) and models else "default"
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}],
            "return_token_ids": True, "logprobs": True}
    target = agent_base + "/chat/completions"
    request = urllib.request.Request(target, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    status, reply = _request(request, key, timeout)
    path = urllib.parse.urlsplit(target).path
    if status != 200 or not isinstance(reply, dict):
        return {"status": status, "path": path, "token_ids": False}
    choices = reply.get("choices") or [{}]
    ids = reply.get("prompt_token_ids") is not None and choices[0].get("token_ids") is not None
    return {"status": status, "path": path, "model": model, "token_ids": ids}


# ---------------------------------------------------------------------- the printout


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"[bold]agl[/] {report['agl']}")

    table = Table(title="plugins (entry points in agl.instrumentors)", title_justify="left", header_style="bold")
    for column in ("plugin", "distribution", "framework", "status"):
        table.add_column(column, overflow="fold")
    styles = {"active": "bold green", "would activate": "green", "skipped": "yellow", "broken": "bold red"}
    for p in report["plugins"]:
        status = f"[{styles.get(p['status'], '')}]{p['status']}[/]"
        if p["reason"]:
            status += f": {escape(p['reason'])}"
        needs = [f"{r} ({report['packages'].get(_requirement_name(r)) or 'not installed'})" for r in p["requirements"]]
        table.add_row(p["name"], escape(p["distribution"] or "-"), escape(", ".join(needs) or "-"), status)
    if not report["plugins"]:
        table.add_row("-", "-", "-", "[red]no agl plugin is installed[/]")
    console.print(table)

    installed = {k: v for k, v in report["packages"].items() if v is not None}
    missing = [k for k, v in report["packages"].items() if v is None]
    console.print("[bold]packages[/] " + ", ".join(f"{k} {v}" for k, v in installed.items()))
    if missing:
        console.print("[dim]not installed: " + ", ".join(missing) + "[/]")

    provider = report["provider"]
    console.print(f"[bold]OpenTelemetry provider[/] {escape(provider['summary'])}")
    console.print(f"  global provider: {provider['global']}")
    if provider["processors"]:
        console.print(f"  span processors: {', '.join(provider['processors'])}")
    for k, v in provider["env"].items():
        console.print(f"  {k}={escape(v)}")
    auto = report["auto_instrumentation"]
    style = "green" if auto["exports"] else "yellow"
    console.print(f"[bold]opentelemetry-instrument[/] [{style}]{escape(auto['summary'])}[/]")

    gateway = report["gateway"]
    if gateway["url"] is None:
        console.print("[bold]gateway[/] not checked: no --server given and OPENAI_BASE_URL is not set")
    else:
        mark = "[green]reachable[/]" if gateway["reachable"] else "[bold red]NOT reachable[/]"
        console.print(f"[bold]gateway[/] {escape(gateway['url'])} (from {gateway['source']}): {mark}")
        console.print(f"  GET /healthz: {escape(str(gateway['healthz']))}")
        models = gateway["models"]
        shown = ", ".join(models) if isinstance(models, list) else str(models)
        console.print(f"  GET {escape(gateway['models_path'])}: {escape(shown or '(no models)')}")
        if gateway["reachable"]:
            console.print("  agl server: " + ("yes" if gateway["agl_server"] else "no (another OpenAI-compatible "
                                                                                 "server)"))
        if gateway["probe"] is not None:
            p = gateway["probe"]
            console.print(f"  probe: chat completion {p['status']}, token ids "
                          + ("returned" if p["token_ids"] else "not returned")
                          + f" (POST {escape(p['path'])}, the path the agent's client uses)")
        if gateway["error"]:
            console.print(f"  [red]{escape(gateway['error'])}[/]")

    capture = report["capture"]
    content = "[green]on[/]" if capture["content"] else "[yellow]off[/]"
    env_note = (f" ({capture['env']}={escape(capture['env_value'])})" if capture["env_value"] is not None
                else f" (default; {capture['env']}=false turns it off)")
    console.print(f"[bold]captured[/] message content {content}{env_note}; token ids: "
                  + escape(gateway["token_ids"] or "unknown until a gateway is checked (--server URL)"))
    if not capture["content"]:
        console.print("  [yellow]prompts, outputs and tool arguments stay off spans: transitions need token ids "
                      "(agl's gateway) to be trained on[/]")
