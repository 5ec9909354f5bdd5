"""``agl apo show``: an APO run's candidates, scores, critiques and winner, from its run folder or its server.

    agl apo show apo-run                      # the run folder's apo.json: also the budget and why it stopped
    agl apo show --server http://127.0.0.1:8000   # the server's resources versions that an APO run noted
    agl apo show apo-run --full               # whole prompts and critiques, not one-line previews

Each candidate is one row: its resources version, the round that wrote it, the version it was
edited from, its validation score, its training-batch scores while in the beam, and whether it
won; the critiques each edit was written from follow the table.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

__all__ = ["apo", "load_run", "server_candidates"]

_PREVIEW = 90


@click.group("apo", context_settings={"help_option_names": ["-h", "--help"]})
def apo() -> None:
    """Automatic prompt optimisation runs (agl train with algorithm.name: apo)."""


@apo.command("show")
@click.argument("run", required=False, metavar="RUN", type=click.Path())
@click.option("--server", metavar="URL", help="read the candidates from this agl server's resources versions")
@click.option("--token", envvar="AGL_TOKEN", help="bearer token for --server [env: AGL_TOKEN]")
@click.option("--run-id", metavar="ID", help="with --server: only this run's candidates (apo.json's run)")
@click.option("--full", is_flag=True, help="whole prompts and critiques instead of one-line previews")
def show(run: str | None, server: str | None, token: str | None, run_id: str | None, full: bool) -> None:
    """The candidates of an APO run: RUN is its run folder (or its apo.json); or --server URL."""
    if (run is None) == (server is None):
        raise click.UsageError("give a run folder (RUN) or --server URL, one of them")
    if run is not None:
        record = load_run(run)
        candidates, budget = record["candidates"], record.get("budget")
    else:
        from agl_core.errors import AglError

        try:
            candidates = server_candidates(str(server), token, run_id)
        except AglError as exc:
            raise click.ClickException(f"cannot read {server}: {exc}") from None
        budget = None
        if not candidates:
            click.echo(f"no APO candidates on {server}" + (f" for run {run_id}" if run_id else ""))
            return
    _render(candidates, budget, full)


def load_run(path: str) -> dict[str, Any]:
    """The ``apo.json`` of a run folder (or that file itself)."""
    file = os.path.join(path, "apo.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            record: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        raise click.ClickException(f"no {file}: is {path} the run.dir of an agl train with algorithm apo?") from None
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot read {file}: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("candidates"), list):
        raise click.ClickException(f"{file} is not an APO record (no 'candidates' list)")
    return record


def server_candidates(url: str, token: str | None = None, run_id: str | None = None) -> list[dict[str, Any]]:
    """The resources versions at ``url`` whose ``metadata.apo`` an APO run wrote, as ``apo.json`` candidates."""
    from agl_core.store.http import ServerClient

    client = ServerClient(url, token, timeout=30.0, retry_s=0.0)
    out: list[dict[str, Any]] = []
    after: str | None = "0"
    try:
        while after is not None:
            _, page = client.request("GET", f"/v1/resources/history?limit=1000&after={after}")
            for entry in page.get("data", []):
                notes = (entry.get("metadata") or {}).get("apo")
                if not isinstance(notes, dict) or (run_id is not None and notes.get("run") != run_id):
                    continue
                resource = notes.get("resource") or "system_prompt"
                out.append({**notes, "version": entry["version"], "prompt": entry["resources"].get(resource),
                            "current": entry.get("current", False)})
            after = page.get("next")
    finally:
        client.close()
    return out


def _render(candidates: list[dict[str, Any]], budget: dict[str, Any] | None, full: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(title="APO candidates", title_justify="left", header_style="bold")
    for name in ("version", "round", "from", "validation", "train", "winner", "prompt"):
        table.add_column(name, justify="right" if name in ("version", "round", "from", "validation") else "left",
                         overflow="fold")
    for c in candidates:
        score = c.get("validation_score")
        train = ", ".join(f"{s:.3f}" for s in c.get("train_scores") or [])
        table.add_row(f"v{c['version']}", str(c.get("round", "")), f"v{c['parent']}" if c.get("parent") else "",
                      "-" if score is None else f"{score:.3f}", train, "[bold green]yes[/]" if c.get("winner") else "",
                      escape(_preview(c.get("prompt"), full)))
    console.print(table)
    for c in candidates:
        if c.get("critique"):
            console.print(f"[bold]critique of v{c.get('parent')}, from which v{c['version']} was written:[/] "
                          f"{escape(_preview(c['critique'], full))}")
    if budget:
        console.print(f"stopped: {budget.get('stop')} ({escape(str(budget.get('stop_detail', '')))}); "
                      f"{budget.get('rollouts')} rollouts, {budget.get('optimizer_calls')} optimiser calls, "
                      f"{budget.get('optimizer_tokens')} tokens")


def _preview(text: Any, full: bool) -> str:
    shown = "" if text is None else str(text)
    if full:
        return shown
    line = " ".join(shown.split())
    return line if len(line) <= _PREVIEW else line[:_PREVIEW - 3] + "..."
