"""``agl serve`` and ``agl demo``: the trainer's commands (``agl`` loads them from here when they run).

    agl serve --backend http://127.0.0.1:8001/v1          # in front of `vllm serve`
    agl serve --engine ./my-hf-model --model my-policy     # the built-in torch engine
    agl serve --host 0.0.0.0 --token "$AGL_TOKEN" ...      # beyond this machine: a token is required

When it is listening ``agl serve`` prints one line, ``agl serve: listening on URL``,
so a script can start it on ``--port 0`` and read which port it got. A port that
is taken is one line naming it (exit 2), and a ``--backend`` that does not answer
``GET /models`` is a warning at start (the server runs; the gateway answers 502
until the backend is up).
"""

from __future__ import annotations

import errno
import json
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import click

__all__ = ["demo", "main", "serve"]


def _pairs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` options as a dict; a VALUE that parses as JSON is that value (``0.7``, ``true``)."""
    out: dict[str, Any] = {}
    for text in values:
        key, sep, raw = text.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {text!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def _upstreams(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    """``MODEL=URL`` options as a dict of frozen models' base URLs."""
    out: dict[str, str] = {}
    for text in values:
        name, sep, url = text.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"expected MODEL=http(s)://host:port/v1, got {text!r}")
        out[name] = url
    return out


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--db", default="agl.db", show_default=True,
              help="the SQLite file for rollouts, the queue and token records")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="port (0: any free one)")
@click.option("--token", envvar="AGL_TOKEN", help="bearer token every client must send [env: AGL_TOKEN]; required "
              "beyond 127.0.0.1")
@click.option("--backend", metavar="URL", help="an OpenAI-compatible server returning token ids (vllm serve), its "
              "base URL ending in /v1")
@click.option("--engine", metavar="PATH", help="a Hugging Face causal LM folder for the built-in torch engine")
@click.option("--backend-key", envvar="AGL_BACKEND_KEY", help="API key for --backend [env: AGL_BACKEND_KEY]")
@click.option("--backend-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="seconds to wait for the backend")
@click.option("--model", help="the name the policy is served under (default: the backend's first model)")
@click.option("--model-rule", type=click.Choice(["override", "strict", "passthrough"]), default="override",
              show_default=True, help="override: every call goes to the served model; strict: a call for another "
              "model (not an --upstream) is refused; passthrough: the agent's model is sent")
@click.option("--upstream", "upstreams", multiple=True, metavar="MODEL=URL", callback=_upstreams,
              help="a frozen model's own OpenAI base URL: calls for MODEL go there and are never trained (repeatable)")
@click.option("--sampling-default", "sampling_defaults", multiple=True, metavar="KEY=VALUE", callback=_pairs,
              help="fill a sampling field the agent left out (repeatable)")
@click.option("--sampling-override", "sampling_overrides", multiple=True, metavar="KEY=VALUE", callback=_pairs,
              help="replace a sampling field whatever the agent said (repeatable)")
@click.option("--train-temperature", type=click.FloatRange(min=0, min_open=True), metavar="T",
              help="sample every call as a training run needs: at temperature T with no top_p/top_k cut or "
              "penalty (what `agl train --set server.url=...` checks for); --sampling-override still wins")
@click.option("--device", default="cpu", show_default=True, help="torch engine device (cpu, cuda)")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="torch engine: most sequences per batch")
@click.option("--agent-match", metavar="REGEX", help="regex searched in the agent names whose calls become "
              "transitions ('write' selects write_query and rewrite_query; '^writer$' one name)")
@click.option("--lease-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="seconds a lease lasts without a heartbeat")
@click.option("--max-attempts", type=click.IntRange(min=1), default=3, show_default=True,
              help="tries per task before it is marked failed")
@click.option("--retry-backoff", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="seconds a task waits after a failed try before its next lease, doubling each try (60 s at most)")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=64.0, show_default=True,
              help="largest request body accepted, in MiB (a task payload: half of it)")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="seconds a client gets to send a request's head before its connection is closed")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="seconds a client gets to send a request's body after its head")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"], case_sensitive=False))
def serve(db: str, host: str, port: int, token: str | None, backend: str | None, engine: str | None,
          backend_key: str | None, backend_timeout: float, model: str | None, model_rule: str,
          upstreams: dict[str, str], sampling_defaults: dict[str, Any], sampling_overrides: dict[str, Any],
          train_temperature: float | None,
          device: str, max_batch: int,
          agent_match: str | None, lease_timeout: float, max_attempts: int, retry_backoff: float, max_body_mb: float,
          header_timeout: float, body_timeout: float, log_level: str) -> None:
    """The agl trainer server: task queue, rollouts, model version, the token-recording OpenAI-compatible
    gateway and the dashboard. Give exactly one of --backend URL or --engine PATH."""
    if (backend is None) == (engine is None):
        raise click.UsageError("give exactly one of --backend URL (an OpenAI-compatible server) or --engine PATH "
                               "(the built-in torch engine)")
    from agl_core.errors import SchemaError
    from agl_core.transitions import TransitionBuilder
    from agl_trainer.gateway import Backend, GatewayConfig, OpenAIBackend, training_sampling
    from agl_trainer.server import ServerConfig, TrainerServer, check_bind
    from agl_trainer.server import serve as run_server

    try:
        check_bind(host, token)
    except ValueError as exc:
        click.echo(f"agl serve: {exc}", err=True)
        sys.exit(2)
    try:
        builder = TransitionBuilder(agent_match=agent_match) if agent_match else None
    except SchemaError as exc:
        raise click.BadParameter(str(exc), param_hint="'--agent-match'") from None
    if train_temperature is not None:
        sampling_overrides = {**training_sampling(train_temperature), **sampling_overrides}
    chosen: Backend
    if backend is not None:
        chosen = OpenAIBackend(backend, backend_key, timeout_s=backend_timeout)
    else:
        from agl_trainer.engine import TorchEngine

        chosen = TorchEngine.from_pretrained(engine, name=model, device=device, max_batch=max_batch)
    config = ServerConfig(
        db_path=db, host=host, port=port, token=token, max_body_bytes=int(max_body_mb * 1024 * 1024),
        lease_timeout_s=lease_timeout, max_attempts=max_attempts, retry_backoff_s=retry_backoff,
        header_timeout_s=header_timeout, body_timeout_s=body_timeout,
        gateway=GatewayConfig(served_model=model, model_rule=model_rule, upstreams=upstreams,
                              sampling_defaults=sampling_defaults, sampling_overrides=sampling_overrides),
        builder=builder, builder_source=f"agl serve --agent-match {agent_match!r}" if agent_match else "agl serve",
    )
    server = TrainerServer(config, chosen)

    def ready(url: str) -> None:
        click.echo(f"agl serve: listening on {url}")
        if backend is not None:
            threading.Thread(target=_check_backend, args=(backend, backend_key), daemon=True).start()

    try:
        run_server(server, on_ready=ready, log_level=log_level.lower())
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            click.echo(f"agl serve: port {port} on {host} is already in use (another agl serve?): stop it, or pick "
                       f"another port with --port (--port 0 takes any free one)", err=True)
        elif exc.errno == errno.EACCES:
            click.echo(f"agl serve: not allowed to listen on port {port} on {host} (ports below 1024 need root): "
                       f"pick another with --port", err=True)
        elif exc.errno == errno.EADDRNOTAVAIL:
            click.echo(f"agl serve: {host} is not an address of this machine: pick another with --host", err=True)
        else:
            raise
        sys.exit(2)


def _check_backend(base_url: str, key: str | None, timeout: float = 5.0) -> None:
    """Warn (once, at start) when the backend does not answer ``GET /models``: every call would be a 502."""
    request = urllib.request.Request(base_url.rstrip("/") + "/models", method="GET")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the operator's URL
            if response.status == 200:
                return
            why = f"it answered {response.status}"
    except urllib.error.HTTPError as exc:
        why = f"it answered {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = f"it cannot be reached: {getattr(exc, 'reason', exc)}"
    click.echo(f"agl serve: warning: the model backend at {base_url} does not answer GET /models ({why}); the "
               f"gateway answers 502 to every call until it does (is --backend the base URL ending in /v1?)", err=True)


@click.command("demo", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               short_help="Train a LangChain agent with RL on this CPU, in minutes.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo(args: tuple[str, ...]) -> None:
    """Train a LangChain agent with RL on this CPU (agl_trainer.demo.run; `agl demo --help` lists its options)."""
    from agl_trainer.demo.run import main as run_demo

    sys.exit(run_demo(list(args)))


def main(argv: Sequence[str] | None = None) -> int:
    """``agl serve`` with ``argv``; returns the exit status (``python -m agl_trainer`` runs this)."""
    try:
        serve.main(args=None if argv is None else list(argv), prog_name="agl serve", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
