"""``agl serve``: start the trainer server from the command line.

    agl serve --backend http://127.0.0.1:8001/v1          # in front of `vllm serve`
    agl serve --engine ./my-hf-model --model my-policy     # the built-in torch engine
    agl serve --host 0.0.0.0 --token "$AGL_TOKEN" ...      # beyond this machine: a token is required

When it is listening it prints one line, ``agl serve: listening on URL``, so a
script can start it on ``--port 0`` and read which port it got.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "parser"]


def _pair(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agl serve", description="The agl trainer server: task queue, rollouts, "
                                "model version and the token-recording OpenAI-compatible gateway.")
    p.add_argument("--db", default="agl.db", help="the SQLite file for rollouts, the queue and token records")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    p.add_argument("--token", default=os.environ.get("AGL_TOKEN"),
                   help="bearer token every client must send (default $AGL_TOKEN); required beyond 127.0.0.1")
    backend = p.add_mutually_exclusive_group(required=True)
    backend.add_argument("--backend", metavar="URL", help="an OpenAI-compatible server returning token ids "
                         "(vllm serve), its base URL ending in /v1")
    backend.add_argument("--engine", metavar="PATH", help="a Hugging Face causal LM folder for the built-in "
                         "torch engine")
    p.add_argument("--backend-key", default=os.environ.get("AGL_BACKEND_KEY"), help="API key for --backend")
    p.add_argument("--backend-timeout", type=float, default=600.0, help="seconds to wait for the backend")
    p.add_argument("--model", help="the name the policy is served under (default: the backend's first model)")
    p.add_argument("--model-rule", choices=("override", "passthrough"), default="override",
                   help="override: every call goes to the served model; passthrough: the agent's model is sent")
    p.add_argument("--sampling-default", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="fill a sampling field the agent left out (repeatable)")
    p.add_argument("--sampling-override", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="replace a sampling field whatever the agent said (repeatable)")
    p.add_argument("--device", default="cpu", help="torch engine device (cpu, cuda)")
    p.add_argument("--max-batch", type=int, default=8, help="torch engine: most sequences per batch")
    p.add_argument("--agent-match", help="regex of the agent names whose calls become transitions")
    p.add_argument("--lease-timeout", type=float, default=600.0, help="seconds a lease lasts without a heartbeat")
    p.add_argument("--max-attempts", type=int, default=3, help="tries per task before it is marked failed")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body accepted, in MiB")
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from agl_core.transitions import TransitionBuilder
    from agl_trainer.gateway import Backend, GatewayConfig, OpenAIBackend
    from agl_trainer.server import ServerConfig, TrainerServer, check_bind, serve

    try:
        check_bind(args.host, args.token)
    except ValueError as exc:
        print(f"agl serve: {exc}", file=sys.stderr)
        return 2
    backend: Backend
    if args.backend:
        backend = OpenAIBackend(args.backend, args.backend_key, timeout_s=args.backend_timeout)
    else:
        from agl_trainer.engine import TorchEngine

        backend = TorchEngine.from_pretrained(args.engine, name=args.model, device=args.device,
                                              max_batch=args.max_batch)
    config = ServerConfig(
        db_path=args.db, host=args.host, port=args.port, token=args.token,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024), lease_timeout_s=args.lease_timeout,
        max_attempts=args.max_attempts,
        gateway=GatewayConfig(served_model=args.model, model_rule=args.model_rule,
                              sampling_defaults=dict(args.sampling_default),
                              sampling_overrides=dict(args.sampling_override)),
        builder=TransitionBuilder(agent_match=args.agent_match) if args.agent_match else None,
    )
    server = TrainerServer(config, backend)

    def ready(url: str) -> None:
        print(f"agl serve: listening on {url}", flush=True)

    serve(server, on_ready=ready, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
