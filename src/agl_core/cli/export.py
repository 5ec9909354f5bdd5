"""``agl export --format jsonl|parquet|hf OUT``: a store's transitions, for SFT or offline RL elsewhere.

``jsonl`` and ``parquet`` are the files ``Store.export`` writes (one ``Transition``
per line or row). ``hf`` is a Hugging Face ``datasets.Dataset`` saved with
``save_to_disk`` (load it with ``datasets.load_from_disk(OUT)``), whose columns
fit the usual trainers as they are:

- ``prompt`` (the chat messages sent), ``completion`` (the one assistant message
  answered, as a list) and ``messages`` (both together): TRL's conversational
  prompt-completion and language-modeling formats;
- ``response``: the assistant message itself;
- ``prompt_token_ids``, ``response_token_ids``, ``response_logprobs``,
  ``token_source``: the exact tokens, for training on ids rather than text;
- ``reward``, ``credited_reward``, and ``rollout_id``, ``task_id``, ``attempt``,
  ``index``, ``agent_name``, ``model``, ``finish_reason``, ``span_id``,
  ``trace_id``; ``tools`` (the tool definitions offered) as JSON text.

Every message has the same fields (``role``, ``content`` as text, ``name``,
``tool_call_id``, ``tool_calls`` with ``function.arguments`` as JSON text), so
rows from different agents and frameworks share one schema.

The output appears complete or not at all, and an existing ``OUT`` is kept
unless ``--force`` is given.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from importlib import import_module
from typing import Any

import click

from agl_core.cli.stores import open_store, store_options, where
from agl_core.errors import AglError
from agl_core.schema import Transition
from agl_core.store.selection import Selection

__all__ = ["export", "hf_features", "hf_row"]

FORMATS = ("jsonl", "parquet", "hf")


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", metavar="OUT", type=click.Path(dir_okay=True, writable=True))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="jsonl", show_default=True,
              help="jsonl: one Transition per line; parquet: one per row; hf: a datasets.Dataset (save_to_disk)")
@store_options
@click.option("--task", "task_id", metavar="TASK_ID", help="only this task's transitions")
@click.option("--agent", "agent", metavar="REGEX",
              help="only calls of agents whose name this regex is found in (a search, as agent_match: "
                   "'write' keeps write_query and rewrite_query; '^writer$' one name)")
@click.option("--status", type=click.Choice(["running", "succeeded", "failed", "timeout", "cancelled"]),
              multiple=True, help="only rollouts with this status (repeatable)")
@click.option("--min-reward", type=float, metavar="R",
              help="only transitions whose credited reward is at least R (one without a reward is left out)")
@click.option("--force", is_flag=True, help="replace OUT if it exists")
def export(out: str, fmt: str, db: str, server: str | None, token: str | None, task_id: str | None,
           agent: str | None, status: tuple[str, ...], min_reward: float | None, force: bool) -> None:
    """Write the transitions of a store to OUT: one per training example, with prompt and response
    messages, exact token ids when known, and rewards."""
    try:
        selection = Selection(task_ids=[task_id] if task_id is not None else None, status=list(status) or None,
                              agent=agent, min_reward=min_reward)
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix(f"agent: {agent!r} "), param_hint="'--agent'") from None
    if os.path.lexists(out) and not force:
        raise click.BadParameter(f"{out} exists; pass --force to replace it", param_hint="'OUT'")
    datasets: Any = None
    if fmt == "hf":
        try:
            datasets = import_module("datasets")
        except ImportError:
            message = "--format hf needs the Hugging Face datasets package: pip install datasets (or agl-core[hf])"
            raise click.UsageError(message) from None
    with open_store(db, server, token) as store:
        try:
            rollouts = selection.rollouts(store)
        except AglError as exc:
            raise click.ClickException(f"cannot read {where(db, server)}: {exc}") from None
        progress = _Progress(len(rollouts), f"exporting {len(rollouts)} rollouts")
        rows = selection.transitions(store, [r.id for r in rollouts], on_rollout=lambda: progress.advance())
        try:
            with progress:
                count = _write(fmt, out, rows, datasets)
        except AglError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"agl export: wrote {count} transitions of {len(rollouts)} rollouts to {out} ({fmt})")


def _write(fmt: str, out: str, rows: Iterator[Transition], datasets: Any) -> int:
    """Write to a temporary path beside ``out``, then move it into place: complete or absent."""
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        if fmt == "jsonl":
            count = _write_jsonl(tmp, rows)
        elif fmt == "parquet":
            from agl_core.store import sqlite  # the parquet layout of Store.export, shared

            count = sqlite._parquet_writer("transitions")(tmp, (t.to_json() for t in rows))
        else:
            count = _write_hf(datasets, tmp, rows)
        if os.path.isdir(out) and not os.path.islink(out):
            shutil.rmtree(out)
        elif os.path.lexists(out):
            os.remove(out)
        os.replace(tmp, out)
        return count
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc}") from None
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)


def _write_jsonl(path: str, rows: Iterator[Transition]) -> int:
    count = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for t in rows:
            f.write(t.to_json())
            f.write("\n")
            count += 1
    return count


def _write_hf(datasets: Any, path: str, rows: Iterator[Transition]) -> int:
    quiet = getattr(datasets, "disable_progress_bars", None)  # agl's own bar is the one shown
    if quiet is not None:
        quiet()
    features = hf_features(datasets)
    records = [hf_row(t) for t in rows]
    if not records:  # datasets saves an empty Dataset that load_from_disk then cannot read
        raise click.ClickException("no transitions match; nothing written (a Hugging Face dataset needs at least "
                                   "one row)")
    columns = {name: [r[name] for r in records] for name in features}
    try:
        datasets.Dataset.from_dict(columns, features=features).save_to_disk(path)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever datasets raises, one line naming it, not its traceback
        raise click.ClickException(f"cannot build the Hugging Face dataset: {type(exc).__name__}: {exc}") from None
    return len(records)


# ---------------------------------------------------------------------- the hf layout


def hf_features(datasets: Any) -> Any:
    """The ``datasets.Features`` of an ``hf`` export: one schema for every row."""
    v = datasets.Value
    message = {
        "role": v("string"),
        "content": v("string"),
        "name": v("string"),
        "tool_call_id": v("string"),
        "tool_calls": [{"id": v("string"), "type": v("string"),
                        "function": {"name": v("string"), "arguments": v("string")}}],
    }
    return datasets.Features({
        "prompt": [message],
        "completion": [message],
        "messages": [message],
        "response": message,
        "prompt_token_ids": [v("int64")],
        "response_token_ids": [v("int64")],
        "response_logprobs": [v("float64")],
        "token_source": v("string"),
        "reward": v("float64"),
        "credited_reward": v("float64"),
        "rollout_id": v("string"),
        "task_id": v("string"),
        "attempt": v("int64"),
        "index": v("int64"),
        "agent_name": v("string"),
        "model": v("string"),
        "finish_reason": v("string"),
        "tools": v("string"),
        "span_id": v("string"),
        "trace_id": v("string"),
    })


def hf_row(t: Transition) -> dict[str, Any]:
    """One transition as a row of the ``hf`` layout."""
    prompt = [_message(m) for m in t.prompt]
    response = _message(t.response)
    return {
        "prompt": prompt, "completion": [response], "messages": [*prompt, response], "response": response,
        "prompt_token_ids": t.prompt_token_ids, "response_token_ids": t.response_token_ids,
        "response_logprobs": t.response_logprobs, "token_source": t.token_source, "reward": t.reward,
        "credited_reward": t.credited_reward, "rollout_id": t.rollout_id, "task_id": t.task_id,
        "attempt": t.attempt, "index": t.index, "agent_name": t.agent_name, "model": t.model,
        "finish_reason": t.finish_reason, "tools": None if t.tools is None else json.dumps(t.tools, ensure_ascii=False),
        "span_id": t.span_id, "trace_id": t.trace_id,
    }


def _message(message: dict[str, Any]) -> dict[str, Any]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        calls.append({"id": call.get("id"), "type": call.get("type") or "function",
                      "function": {"name": function.get("name"),
                                   "arguments": arguments if isinstance(arguments, str) or arguments is None
                                   else json.dumps(arguments, ensure_ascii=False)}})
    return {"role": message.get("role"), "content": _text(message.get("content")), "name": message.get("name"),
            "tool_call_id": message.get("tool_call_id"), "tool_calls": calls}


def _text(content: Any) -> str | None:
    """Message content as text: parts joined (non-text parts as JSON), so every row has one type."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and p.get("type") == "text"
                       else json.dumps(p, ensure_ascii=False) for p in content)
    return json.dumps(content, ensure_ascii=False)


# ---------------------------------------------------------------------- progress


class _Progress:
    """A rich progress bar on stderr, per rollout read; silent when stderr is not a terminal."""

    def __init__(self, total: int, description: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, disable=not console.is_terminal,
                                 transient=False)
        self.task = self.progress.add_task(description, total=total)
        self.advance: Callable[[], None] = lambda: self.progress.advance(self.task)

    def __enter__(self) -> _Progress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
