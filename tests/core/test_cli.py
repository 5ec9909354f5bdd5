"""The ``agl`` command through its real entry point (``.venv/bin/agl`` in a subprocess).

The store is filled here with real rollouts: a two-agent run on the plain
``openai`` client, traced by agl's openai plugin against the fake vLLM-like
server, with tool calls (one failing) and rewards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import agl_core as agl
from agl_core import collector, semconv
from agl_core.testing import FakeOpenAI

AGL = Path(sys.executable).parent / "agl"
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name}",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
         for name in ("search", "calculator")]


def agl_cli(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    run_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    if "FORCE_COLOR" not in (env or {}):
        run_env.pop("FORCE_COLOR", None)
    out = subprocess.run([str(AGL), *args], capture_output=True, text=True, timeout=120, env=run_env)
    assert "Traceback" not in out.stderr, out.stderr  # errors are one clear line
    if check:
        assert out.returncode == 0, (out.stdout, out.stderr)
    return out


# ---------------------------------------------------------------------- a store with real rollouts


def _model(request: dict[str, Any]) -> Any:
    """The policy, scripted: the planner searches then plans; the solver's first calculation fails."""
    last = request["messages"][-1]
    if "planner" in request["messages"][0]["content"]:
        if last["role"] == "user":
            return {"tool_calls": [{"name": "search", "arguments": {"q": "price of apples"}}]}
        return "Plan: apples cost 3 each; compute 4 * 3."
    if last["role"] == "user":
        return {"tool_calls": [{"name": "calculator", "arguments": {"q": "4 * 3 / 0"}}]}
    if last["content"].startswith("error"):
        return {"tool_calls": [{"name": "calculator", "arguments": {"q": "4 * 3"}}]}
    return "The answer is 12."


def _agent(client: openai.OpenAI, name: str, question: str) -> str:
    """An ordinary tool loop, inside an ``invoke_agent`` span as agent frameworks make them."""
    attrs = {semconv.GEN_AI_OPERATION_NAME: semconv.OP_INVOKE_AGENT, semconv.GEN_AI_AGENT_NAME: name}
    with collector.tracer().start_as_current_span(semconv.agent_span_name(name), attributes=attrs):
        messages: list[Any] = [{"role": "system", "content": f"You are the {name}."},
                               {"role": "user", "content": question}]
        for _ in range(4):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
            message = reply.choices[0].message
            if not message.tool_calls:
                return message.content or ""
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                q = json.loads(call.function.arguments)["q"]
                with agl.tool_call(call.function.name, call_id=call.id, arguments=call.function.arguments) as tool:
                    if "/ 0" in q:
                        tool.error("error: division by zero")
                    else:
                        tool.result = "apples: 3 each" if call.function.name == "search" else "12"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(tool.result)})
    return ""


class Filled:
    def __init__(self, db: Path, ok: list[str], failed: str, store: agl.SqliteStore) -> None:
        self.db, self.ok, self.failed, self.store = db, ok, failed, store


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Filled]:
    db = tmp_path_factory.mktemp("cli") / "agl.db"
    store = agl.SqliteStore(db)
    builder = agl.TransitionBuilder(air=agl.AirRules(tool_error=-0.5))
    agl.instrument(["openai"])
    ids = []
    try:
        with FakeOpenAI(_model, return_token_ids=True) as srv:
            client = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
            for i in range(3):
                with agl.rollout(task_id=f"apples-{i}", task={"q": "4 apples?"}, store=store, builder=builder) as run:
                    plan = _agent(client, "planner", "How much are 4 apples?")
                    answer = _agent(client, "solver", plan)
                    agl.emit_reward(1.0 if "12" in answer else 0.0)
                ids.append(run.id)
            with pytest.raises(RuntimeError), agl.rollout(task_id="broken", store=store, builder=builder) as bad:
                _agent(client, "planner", "How much are 4 apples?")
                raise RuntimeError("the environment crashed")
    finally:
        agl.uninstrument()
    yield Filled(db, ids, bad.id, store)
    store.close()


# ---------------------------------------------------------------------- the group


def test_help_lists_every_command_without_importing_them() -> None:
    out = agl_cli("--help", env={"PYTHONPROFILEIMPORTTIME": "1"})
    for name in ("demo", "doctor", "export", "serve", "traces", "train", "worker"):
        assert re.search(rf"^\s+{name}\s+\S", out.stdout, re.M), out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
    assert "agl_core.cli" in imported
    heavy = {m for m in imported if m.split(".")[0] in {"agl_trainer", "torch", "rich", "openai", "datasets"}
             or m in {"agl_core.cli.traces", "agl_core.cli.export", "agl_core.cli.doctor", "agl_core.cli.worker"}}
    assert heavy == set()


def test_import_agl_core_imports_neither_click_nor_rich() -> None:
    code = "import sys, agl_core; agl_core.SqliteStore; print(sorted(m for m in ('click', 'rich') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_version_and_unknown_command() -> None:
    assert agl_cli("--version").stdout.strip() == f"agl, version {agl.__version__}"
    bad = agl_cli("trace", check=False)
    assert bad.returncode == 2 and "No such command 'trace'" in bad.stderr


def test_trainer_commands_without_agl_trainer_say_what_to_install() -> None:
    for command in ("serve", "demo", "train"):
        code = ("import sys; sys.modules['agl_trainer'] = None\n"  # what an agl-core-only install looks like
                f"from agl_core.cli import main; sys.exit(main([{command!r}, '--port', '0']))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip() == f"agl {command}: needs agl-trainer (pip install agl-trainer)"


def test_worker_keeps_its_options_and_names_bad_ones() -> None:
    help_text = agl_cli("worker", "--help").stdout
    for option in ("--server", "--agent", "--concurrency", "--token", "--worker-id", "--lease-timeout", "--grace",
                   "--max-tasks", "--idle-exit", "--poll", "--ray", "--actor-cpus", "--no-gateway-env",
                   "--log-level"):
        assert option in help_text
    zero = agl_cli("worker", "--server", "http://127.0.0.1:9", "--agent", "json:dumps", "-n", "0", check=False)
    assert zero.returncode == 2
    assert "Invalid value for '-n' / '--concurrency': 0 is not in the range x>=1" in zero.stderr
    missing = agl_cli("worker", "--agent", "json:dumps", check=False)
    assert missing.returncode == 2 and "Missing option '--server'" in missing.stderr
    bad = agl_cli("worker", "--server", "http://127.0.0.1:9", "--agent", "no_colon", check=False)
    assert bad.returncode == 2 and "--agent must look like pkg.module:function, got 'no_colon'" in bad.stderr


# ---------------------------------------------------------------------- traces list


def _row(stdout: str, rollout_id: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if rollout_id in line)
    return re.split(r"\s{2,}", line.strip())


def test_traces_list_shows_each_rollout(filled: Filled) -> None:
    out = agl_cli("traces", "list", "--db", str(filled.db)).stdout
    header = _row(out, "transitions")
    assert header == ["id", "task", "attempt", "status", "reward", "spans", "transitions", "started", "duration"]
    for i, rollout_id in enumerate(filled.ok):
        cells = _row(out, rollout_id)
        spans = len(filled.store.spans(rollout_id))
        assert cells[:7] == [rollout_id, f"apples-{i}", "1", "succeeded", "1", str(spans), "5"], cells
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", cells[7]) and cells[8].endswith("ms")
    cells = _row(out, filled.failed)
    assert cells[1:7] == ["broken", "1", "failed", "-", str(len(filled.store.spans(filled.failed))), "2"], cells


def test_traces_list_fits_a_narrow_terminal(filled: Filled) -> None:
    lines = agl_cli("traces", "list", "--db", str(filled.db), env={"COLUMNS": "80"}).stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert lines[1].split() == ["id", "task", "try", "status", "reward", "spans", "trans", "started", "time"]
    first = lines[2].split()
    spans = str(len(filled.store.spans(filled.ok[0])))
    assert first[:7] == [filled.ok[0][:10], "apples-0", "1", "succeeded", "1", spans, "5"]
    assert re.fullmatch(r"\d\d:\d\d:\d\d", first[7])


def test_traces_list_filters(filled: Filled) -> None:
    only = agl_cli("traces", "list", "--db", str(filled.db), "--task", "apples-1").stdout
    assert filled.ok[1] in only and filled.ok[0] not in only and filled.failed not in only
    failed = agl_cli("traces", "list", "--db", str(filled.db), "--status", "failed").stdout
    assert filled.failed in failed and not any(i in failed for i in filled.ok)
    latest = agl_cli("traces", "list", "--db", str(filled.db), "--limit", "2").stdout
    assert [i for i in [*filled.ok, filled.failed] if i in latest] == [filled.ok[2], filled.failed]
    lines = agl_cli("traces", "list", "--db", str(filled.db), "--json", "--status", "succeeded").stdout.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["id"] for r in rows] == filled.ok and {r["transitions"] for r in rows} == {5}
    assert {r["reward"] for r in rows} == {1.0}
    none = agl_cli("traces", "list", "--db", str(filled.db), "--task", "nope").stdout
    assert none.strip() == f"no rollouts in {filled.db} matching the filters"


def test_traces_bad_arguments_name_the_argument(filled: Filled, tmp_path: Path) -> None:
    db = str(filled.db)
    missing = tmp_path / "nope.db"
    cases = [
        (["list", "--db", db, "--limit", "0"], "Invalid value for '--limit': 0 is not in the range x>=1"),
        (["list", "--db", db, "--status", "done"], "Invalid value for '--status': 'done' is not one of"),
        (["list", "--db", str(missing)], f"Invalid value for '--db': no such file: {missing}"),
        (["show", "--db", db, "feedbeef"], f"Invalid value for 'ROLLOUT_ID': no rollout 'feedbeef' in {db}"),
        (["show", "--db", db], "Missing argument 'ROLLOUT_ID'"),
        (["list", "--server", "127.0.0.1:8000"], "Invalid value for '--server': must be an http:// or https:// URL"),
    ]
    for args, message in cases:
        out = agl_cli("traces", *args, check=False)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    assert not missing.exists()  # a reading command never creates a store
    not_ours = tmp_path / "notes.txt"
    not_ours.write_text("my notes\n")
    out = agl_cli("traces", "list", "--db", str(not_ours), check=False)
    assert out.returncode == 2, out.stderr
    assert f"Invalid value for '--db': {not_ours} is not an agl store" in out.stderr.replace("\n", " ")
    assert not_ours.read_text() == "my notes\n"


# ---------------------------------------------------------------------- traces show


def test_traces_show_draws_the_tree(filled: Filled) -> None:
    rollout_id = filled.ok[0]
    out = agl_cli("traces", "show", "--db", str(filled.db), rollout_id[:8]).stdout  # a unique prefix is enough
    lines = out.splitlines()
    assert lines[0].startswith(f"rollout {rollout_id}  task apples-0  attempt 1  succeeded  reward 1  ")
    assert lines[0].endswith("(12 spans: 5 LLM calls, 3 tool calls; 5 transitions)"), lines[0]
    body = [re.sub(r"\s+\d+(\.\d+)? (ms|µs|s)\b", " T", line) for line in lines[1:]]  # durations vary
    tokens = [t for t in filled.store.transitions(rollout_id=rollout_id)]
    assert body == [
        "├── agent planner T",
        f"│   ├── LLM chat policy [openai]  {len(tokens[0].prompt_token_ids or [])} in / "
        f"{len(tokens[0].response_token_ids or [])} out tokens T  → search({{\"q\": \"price of apples\"}})  "
        "transition #0 (response ids)  credited 0.5",
        "│   ├── tool search({\"q\": \"price of apples\"}) T  → apples: 3 each",
        f"│   └── LLM chat policy [openai]  {len(tokens[1].prompt_token_ids or [])} in / 9 out tokens T  "
        "→ 'Plan: apples cost 3 each; compute 4 * 3.'  transition #1 (response ids)  credited 0.5",
        "├── agent solver T",
        f"│   ├── LLM chat policy [openai]  {len(tokens[2].prompt_token_ids or [])} in / 8 out tokens T  "
        "→ calculator({\"q\": \"4 * 3 / 0\"})  transition #2 (response ids)  reward -0.5  credited 0.5",
        "│   ├── tool calculator({\"q\": \"4 * 3 / 0\"}) T  ✗ error: error: division by zero",
        f"│   ├── LLM chat policy [openai]  {len(tokens[3].prompt_token_ids or [])} in / 6 out tokens T  "
        "→ calculator({\"q\": \"4 * 3\"})  transition #3 (response ids)  credited 0.5",
        "│   ├── tool calculator({\"q\": \"4 * 3\"}) T  → 12",
        f"│   └── LLM chat policy [openai]  {len(tokens[4].prompt_token_ids or [])} in / 4 out tokens T  "
        "→ 'The answer is 12.'  transition #4 (response ids)  credited 0.5",
        "└── reward 1  (final)",
    ]


def test_traces_show_errors_are_red(filled: Filled) -> None:
    out = agl_cli("traces", "show", "--db", str(filled.db), filled.ok[1], env={"FORCE_COLOR": "1"}).stdout
    failing = next(line for line in out.splitlines() if "division by zero" in line)
    assert "\x1b[1;31mtool \x1b[0m" in failing and "\x1b[1;31m  ✗ error: error: division by zero\x1b[0m" in failing
    ok_tool = next(line for line in out.splitlines() if "→ 12" in line or "\x1b[32m12" in line)
    assert "\x1b[1;33mtool \x1b[0m" in ok_tool  # a tool that worked is yellow, not red
    crashed = agl_cli("traces", "show", "--db", str(filled.db), filled.failed, env={"FORCE_COLOR": "1"}).stdout
    first, second = crashed.splitlines()[:2]
    assert "\x1b[1;31mfailed\x1b[0m" in first
    assert "\x1b[1;31merror: RuntimeError: the environment crashed\x1b[0m" in second, second


def test_traces_show_says_why_a_call_was_not_trained(tmp_path: Path) -> None:
    db = tmp_path / "match.db"
    builder = agl.TransitionBuilder(agent_match="solver")
    agl.instrument(["openai"])
    try:
        with agl.SqliteStore(db) as store, FakeOpenAI(_model, return_token_ids=True) as srv:
            client = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0)
            with agl.rollout(task_id="match", store=store, builder=builder) as run:
                _agent(client, "planner", "How much are 4 apples?")
                agl.emit_message("the shop " + "is open " * 20 + "today")
    finally:
        agl.uninstrument()
    out = agl_cli("traces", "show", "--db", str(db), run.id).stdout
    planned = [line for line in out.splitlines() if "LLM chat" in line]
    assert len(planned) == 2 and all(line.endswith("not trained: agent 'planner' does not match agent_match "
                                                   "'solver'") for line in planned), out
    message = next(line for line in out.splitlines() if "message" in line)
    said = "the shop " + "is open " * 20 + "today"
    assert message.endswith("message " + said[:79] + "…")  # one line, cut at 80 characters
    full = agl_cli("traces", "show", "--db", str(db), run.id, "--full").stdout
    assert f"message {said}" in full


def test_traces_from_a_server_that_is_not_there() -> None:
    out = agl_cli("traces", "list", "--server", "http://127.0.0.1:9", check=False)
    assert out.returncode == 1 and out.stderr.startswith("Error: cannot read http://127.0.0.1:9: "), out.stderr


# ---------------------------------------------------------------------- export


def test_export_jsonl_with_filters(filled: Filled, tmp_path: Path) -> None:
    out = tmp_path / "all.jsonl"
    result = agl_cli("export", "--db", str(filled.db), str(out))
    every = filled.store.transitions()
    assert result.stdout.strip() == f"agl export: wrote {len(every)} transitions of 4 rollouts to {out} (jsonl)"
    assert [agl.Transition.from_json(line) for line in out.read_text().splitlines()] == every
    solver = tmp_path / "solver.jsonl"
    agl_cli("export", "--format", "jsonl", "--db", str(filled.db), "--agent", "solver", "--task", "apples-2",
            str(solver))
    rows = [agl.Transition.from_json(line) for line in solver.read_text().splitlines()]
    assert [(t.rollout_id, t.agent_name, t.index) for t in rows] == [(filled.ok[2], "solver", i) for i in (2, 3, 4)]
    searched = tmp_path / "olv.jsonl"  # a search, as agent_match is: "olv" is in "solver"
    agl_cli("export", "--db", str(filled.db), "--agent", "olv", "--task", "apples-2", str(searched))
    assert searched.read_text() == solver.read_text()
    succeeded = tmp_path / "ok.jsonl"
    agl_cli("export", "--db", str(filled.db), "--status", "succeeded", "--agent", "plan.*", str(succeeded))
    assert len(succeeded.read_text().splitlines()) == 6
    rewarded = tmp_path / "rewarded.jsonl"  # agl train's sft selection: a credited reward of at least R
    agl_cli("export", "--db", str(filled.db), "--min-reward", "0.5", str(rewarded))
    kept = [agl.Transition.from_json(line) for line in rewarded.read_text().splitlines()]
    expected = [t for t in every if t.credited_reward is not None and t.credited_reward >= 0.5]
    assert kept == expected and 0 < len(kept) < len(every)


def test_export_keeps_an_existing_file_and_names_bad_arguments(filled: Filled, tmp_path: Path) -> None:
    out = tmp_path / "mine.jsonl"
    out.write_text("precious\n")
    refused = agl_cli("export", "--db", str(filled.db), str(out), check=False)
    assert refused.returncode == 2 and f"Invalid value for 'OUT': {out} exists; pass --force to replace it" in \
        refused.stderr
    assert out.read_text() == "precious\n"
    agl_cli("export", "--db", str(filled.db), "--force", str(out))
    assert len(out.read_text().splitlines()) == len(filled.store.transitions())
    fmt = agl_cli("export", "--db", str(filled.db), "--format", "csv", str(tmp_path / "x"), check=False)
    assert fmt.returncode == 2 and "Invalid value for '--format': 'csv' is not one of 'jsonl', 'parquet', 'hf'" in \
        fmt.stderr
    regex = agl_cli("export", "--db", str(filled.db), "--agent", "(", str(tmp_path / "y"), check=False)
    assert regex.returncode == 2 and "Invalid value for '--agent': is not a valid regular expression" in regex.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.jsonl"]


def test_export_parquet(filled: Filled, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "t.parquet"
    agl_cli("export", "--format", "parquet", "--db", str(filled.db), "--task", "apples-0", str(out))
    table = pq.read_table(out)
    expected = filled.store.transitions(task_id="apples-0")
    assert table.num_rows == len(expected) == 5
    assert table.column("response_token_ids").to_pylist() == [t.response_token_ids for t in expected]
    assert table.column("reward").to_pylist() == [None, None, -0.5, None, None]


def test_export_hf_dataset_for_sft(filled: Filled, tmp_path: Path) -> None:
    import datasets

    out = tmp_path / "sft"
    result = agl_cli("export", "--format", "hf", "--db", str(filled.db), "--status", "succeeded", str(out))
    assert result.stdout.strip() == f"agl export: wrote 15 transitions of 3 rollouts to {out} (hf)"
    assert result.stderr == ""  # agl's bar only, and only on a terminal: datasets' own bars are off
    ds = datasets.load_from_disk(str(out))
    expected = filled.store.transitions()[:15]
    assert len(ds) == 15
    assert {"prompt", "completion", "messages", "response", "prompt_token_ids", "response_token_ids",
            "response_logprobs", "reward", "credited_reward", "agent_name", "task_id"} <= set(ds.column_names)
    row = ds[2]
    t = expected[2]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][1]["content"] == t.prompt[1]["content"]
    assert row["completion"] == [row["response"]] and row["messages"] == [*row["prompt"], row["response"]]
    assert row["response"]["role"] == "assistant" and row["response"]["content"] is None
    call = row["response"]["tool_calls"][0]
    assert call["function"] == {"name": "calculator", "arguments": '{"q": "4 * 3 / 0"}'}
    assert row["prompt_token_ids"] == t.prompt_token_ids and row["response_token_ids"] == t.response_token_ids
    assert (row["reward"], row["credited_reward"], row["agent_name"]) == (-0.5, t.credited_reward, "solver")
    empty = tmp_path / "empty"
    nothing = agl_cli("export", "--format", "hf", "--db", str(filled.db), "--task", "nope", str(empty), check=False)
    assert nothing.returncode == 1 and "Error: no transitions match; nothing written" in nothing.stderr
    assert not empty.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["sft"]
    tool_turn = ds[3]["prompt"][-1]
    assert (tool_turn["role"], tool_turn["content"]) == ("tool", "error: division by zero")
    assert tool_turn["tool_call_id"] == ds[2]["response"]["tool_calls"][0]["id"]


def test_export_hf_without_datasets_says_so(filled: Filled, tmp_path: Path) -> None:
    code = ("import sys; sys.modules['datasets'] = None\n"
            f"from agl_core.cli import main; sys.exit(main(['export', '--format', 'hf', '--db', {str(filled.db)!r}, "
            f"{str(tmp_path / 'out')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "Error: --format hf needs the Hugging Face datasets package: pip install datasets" in out.stderr
    assert not (tmp_path / "out").exists()


def test_export_shows_progress_on_a_terminal(filled: Filled, tmp_path: Path) -> None:
    out = agl_cli("export", "--db", str(filled.db), str(tmp_path / "p.jsonl"), env={"FORCE_COLOR": "1"})
    assert "exporting 4 rollouts" in out.stderr and "4/4" in out.stderr
    quiet = agl_cli("export", "--db", str(filled.db), str(tmp_path / "q.jsonl"))  # not a terminal: no bar
    assert quiet.stderr == ""


# ---------------------------------------------------------------------- doctor


def test_doctor_reports_plugins_with_instruments_reasons() -> None:
    probe = "import json, agl_core as agl; r = agl.instrument(); print(json.dumps([list(r), r.skipped]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    activated, skipped = json.loads(done.stdout)
    report = json.loads(agl_cli("doctor", "--json").stdout)
    assert report["agl"] == agl.__version__
    plugins = {p["name"]: p for p in report["plugins"]}
    assert set(plugins) == set(activated) | set(skipped)
    for name in activated:
        assert plugins[name]["status"] == "would activate"
    for name, reason in skipped.items():
        assert (plugins[name]["status"], plugins[name]["reason"]) == ("skipped", reason)
    assert report["packages"]["openai"] == openai.__version__
    assert report["provider"]["user_sdk"] is False and report["capture"]["content"] is True
    text = agl_cli("doctor").stdout
    version = re.escape(openai.__version__)
    assert re.search(rf"│ openai\s+│ \S+ \S+\s+│ openai >= 1.40 \({version}\)\s+│ would activate\s+│", text), text
    assert "agl's own light tracer" in text and "message content on" in text
    assert "gateway not checked: no --server given and OPENAI_BASE_URL is not set" in text


def test_doctor_checks_the_gateway_and_content_capture() -> None:
    with FakeOpenAI(return_token_ids=True) as srv:
        text = agl_cli("doctor", "--probe", env={"OPENAI_BASE_URL": srv.url,
                                                  "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "false"}).stdout
        paths = [r.path for r in srv.requests]
        base = srv.url.removesuffix("/v1")
    assert f"gateway {base} (from OPENAI_BASE_URL): reachable" in text
    assert "GET /healthz: 404" in text and "agl server: no (another OpenAI-compatible server)" in text
    assert "probe: chat completion 200, token ids returned" in text
    assert "token ids: in the response: this server returned token ids (response)" in text
    assert "message content off (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=false)" in text
    assert "/v1/chat/completions" in paths
    down = agl_cli("doctor", "--server", "http://127.0.0.1:9", "--timeout", "2", check=False)
    assert down.returncode == 1 and "gateway http://127.0.0.1:9 (from --server): NOT reachable" in down.stdout


def test_doctor_says_opentelemetry_instrument_needs_the_distro() -> None:
    from importlib import metadata

    report = json.loads(agl_cli("doctor", "--json").stdout)["auto_instrumentation"]
    assert report["command"] == metadata.version("opentelemetry-instrumentation")
    try:
        distro: str | None = metadata.version("opentelemetry-distro")
    except metadata.PackageNotFoundError:
        distro = None
    assert report["distro"] == distro and report["exports"] is (distro is not None)
    text = agl_cli("doctor").stdout
    if distro is None:
        assert "opentelemetry-instrument python app.py runs agl's plugins but exports nothing: opentelemetry-distro" \
               in " ".join(text.split()), text
    else:
        assert f"sets up the SDK (opentelemetry-distro {distro})" in text


def test_doctor_sees_the_users_sdk_provider() -> None:
    code = textwrap.dedent("""
        import sys
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        trace.set_tracer_provider(provider)
        from agl_core.cli import main
        sys.exit(main(["doctor"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "OpenTelemetry provider the SDK TracerProvider set in this process" in out.stdout
    assert "span processors: SimpleSpanProcessor(InMemorySpanExporter)" in out.stdout
