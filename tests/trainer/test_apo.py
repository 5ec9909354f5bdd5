"""APO (``algorithm.name: apo``): a beam search over a prompt resource, through the real server, queue, workers and
resources versions, against two scripted model servers on 127.0.0.1: the agent's model (FakeOpenAI), which answers
correctly only when the system prompt holds a planted instruction, and an optimiser that critiques and proposes
edits, one of which holds it. The budgets are counted exactly; a failing optimiser is retried, then reported.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

import agl_core as agl
from agl_core.cli import cli
from agl_core.testing import FakeOpenAI
from agl_trainer.apo import ApoOutcome, run_apo
from agl_trainer.config import ConfigError, validate
from agl_trainer.train_cli import main

from .conftest import HERE, ServerFactory

PLANTED = "answer in french"  # compared lower-cased
INITIAL = "You are a helpful assistant."
EDITS = ["You are a helpful assistant. Be concise.", "You are a helpful assistant. Always answer in French.",
         "You are a helpful assistant. Be brief.", "You are a helpful assistant. Think step by step."]
CRITIQUE = "The prompt never says which language to answer in."
TOKENS_PER_CALL = 100


def agent_model(body: dict[str, Any]) -> str:
    system = " ".join(str(m.get("content")) for m in body["messages"] if m.get("role") == "system")
    return "bonjour" if PLANTED in system.lower() else "hello"


class Optimizer:
    """The optimiser's endpoint: a critique, or the next scripted edit; ``usage.total_tokens`` is fixed per call.

    ``fail`` says, by call number (1-based), which calls answer 503 instead.
    """

    def __init__(self, fail: Callable[[int], bool] = lambda n: False, *, by_length: bool = False) -> None:
        self.fail = fail
        self.by_length = by_length
        """``usage`` as a tokenizer of 4 characters a token would count (prompt and reply), the reply cut at the
        call's ``max_tokens`` (``finish_reason: length``); else a fixed 90 + 10 a call."""
        self.usage: list[dict[str, int]] = []
        self.bodies: list[dict[str, Any]] = []
        self.times: list[float] = []
        self.edits = 0
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = owner.answer(body)
                raw = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.bodies.append(body)
            self.times.append(time.monotonic())
            if self.fail(len(self.bodies)):
                return 503, {"error": {"message": "overloaded"}}
            if "Critique:" in body["messages"][-1]["content"]:
                text = CRITIQUE
            else:
                text = f"Here it is:\n<prompt>\n{EDITS[self.edits % len(EDITS)]}\n</prompt>"
                self.edits += 1
        usage = {"prompt_tokens": 90, "completion_tokens": 10, "total_tokens": TOKENS_PER_CALL}
        finish = "stop"
        if self.by_length:
            prompt = sum(-(-len(str(m["content"])) // 4) + 4 for m in body["messages"])
            reply = -(-len(text) // 4)
            if reply > body["max_tokens"]:
                text, reply, finish = text[:4 * body["max_tokens"]], body["max_tokens"], "length"
            usage = {"prompt_tokens": prompt, "completion_tokens": reply, "total_tokens": prompt + reply}
        with self._lock:
            self.usage.append(usage)
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish}], "usage": usage}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    with FakeOpenAI(agent_model) as srv:
        monkeypatch.setenv("APO_TEST_MODEL_URL", srv.url)
        yield srv


@pytest.fixture
def optimizer() -> Iterator[Callable[..., Optimizer]]:
    made: list[Optimizer] = []

    def make(**kwargs: Any) -> Optimizer:
        made.append(Optimizer(**kwargs))
        return made[-1]

    yield make
    for o in made:
        o.close()


@pytest.fixture(autouse=True)
def _agent_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))  # apo_test_agents:agent, as agl train imports a user's agent
    logging.getLogger("agl.worker").setLevel(logging.ERROR)


def raw_config(tmp_path: Path, optimizer_url: str, **apo: Any) -> dict[str, Any]:
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"id": f"t{i}", "q": f"greet {i}"}) + "\n"
                                                  for i in range(4)))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"id": f"v{i}", "q": f"hello {i}"}) + "\n"
                                                for i in range(2)))
    return {"data": {"path": "tasks.jsonl"}, "agent": "apo_test_agents:agent", "algorithm": {"name": "apo"},
            "resources": {"system_prompt": INITIAL, "k": 3}, "validation": {"path": "val.jsonl"},
            "workers": {"count": 2}, "run": {"dir": "out", "step_timeout_s": 60},
            "apo": {"optimizer": {"base_url": optimizer_url, "model": "critic", "backoff_s": 0.01},
                    "beam_width": 2, "edits_per_candidate": 2, "batch_size": 2, "rounds": 2, **apo}}


def run(tmp_path: Path, optimizer_url: str, **apo: Any) -> ApoOutcome:
    return run_apo(validate(raw_config(tmp_path, optimizer_url, **apo), base_dir=str(tmp_path)), progress=False)


def stored(tmp_path: Path) -> agl.SqliteStore:
    return agl.SqliteStore(str(tmp_path / "agl.db"))


def test_the_beam_finds_the_planted_instruction_and_keeps_everything(
        tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer], make_server: ServerFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    opt = optimizer()
    outcome = run_apo(validate(raw_config(tmp_path, opt.url), base_dir=str(tmp_path)), progress=True)
    # initial 2 validation rollouts; round 1: v1's batch 2, critique + 2 edits, each scored on 2; round 2: the
    # French prompt (v3) fails nothing, v1 fails again: critique + 2 new edits scored
    assert outcome.budget.to_dict() | {"stop_detail": ""} == {
        "rounds": 2, "max_rollouts": None, "max_optimizer_tokens": None, "rollouts": 16, "optimizer_tokens": 600,
        "optimizer_calls": 6, "stop": "rounds", "stop_detail": ""}
    first, best = outcome.candidates[0], outcome.best
    assert (first.version, first.prompt, first.validation_score) == (1, INITIAL, 0.0)
    assert PLANTED in best.prompt.lower() and best.validation_score == 1.0 and best.version == 3
    assert best.parent == 1 and best.critique == CRITIQUE and best.winner
    assert [c.validation_score for c in outcome.candidates] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert [[c["version"] for c in r["beam"]] for r in outcome.rounds] == [[3, 1], [3, 1]]
    assert outcome.candidates[2].train_scores == [1.0] and first.train_scores == [0.0, 0.0]
    # what the optimiser read: the failing rollouts' task, the model's answer and the reward
    critique_asked = opt.bodies[0]["messages"][-1]["content"]
    assert INITIAL in critique_asked and "greet 0" in critique_asked and "[assistant] hello" in critique_asked
    assert "reward 0.0" in critique_asked and CRITIQUE in opt.bodies[1]["messages"][-1]["content"]
    # the run folder: the winner's text and every candidate, critique and score
    folder = tmp_path / "out"
    assert (folder / "best_prompt.txt").read_text() == best.prompt
    record = json.loads((folder / "apo.json").read_text())
    assert record["best"]["version"] == 3 and len(record["candidates"]) == 5 and len(record["optimizer_calls"]) == 6
    assert record["rounds"][0]["critiques"][0]["critique"] == CRITIQUE
    err = capsys.readouterr().err
    assert "apo round 1/2:" in err and "apo round 2/2:" in err and "best v3 1.000" in err
    # the store: 16 rollouts, each run with the version it was scored for; the winner is the current version
    with stored(tmp_path) as store:
        runs = store.rollouts()
        assert len(runs) == 16
        for r in runs:
            assert r.resources_version == int(r.task_id.split("-v")[1].split("-")[0]), r.task_id
        assert {r.final_reward for r in runs if r.resources_version == 3} == {1.0}
    # a server started again on the run's store serves it all: the candidates with their notes, the round metrics
    srv = make_server(model, db=tmp_path / "agl.db")
    current = httpx.get(srv.url + "/v1/resources").json()
    assert current["version"] == 3 and current["resources"] == {"system_prompt": best.prompt, "k": 3}
    notes = current["metadata"]["apo"]
    assert notes["winner"] and notes["validation_score"] == 1.0 and notes["critique"] == CRITIQUE
    assert notes["parent"] == 1 and notes["round"] == 1 and notes["run"] == record["run"]
    history = httpx.get(srv.url + "/v1/resources/history").json()["data"]
    assert [e["metadata"]["apo"]["winner"] for e in history] == [False, False, True, False, False]
    assert [e["metadata"]["apo"]["validation_score"] for e in history] == [0.0, 0.0, 1.0, 0.0, 0.0]
    metrics = httpx.get(srv.url + "/v1/metrics").json()["data"]
    assert [(m["step"], m["values"]["apo_best_validation_reward"], m["values"]["apo_rollouts"],
             m["values"]["apo_optimizer_calls"]) for m in metrics] == [(1, 1.0, 8.0, 3.0), (2, 1.0, 16.0, 6.0)]
    # agl apo show: from the run folder (with why it stopped) and from the server, the same candidates
    wide = CliRunner(env={"COLUMNS": "200"})
    shown = [wide.invoke(cli, ["apo", "show", str(folder)]),
             wide.invoke(cli, ["apo", "show", "--server", srv.url, "--run-id", record["run"]])]
    for result in shown:
        assert result.exit_code == 0, result.output
        winner = next(line for line in result.output.splitlines() if "yes" in line)
        assert "v3" in winner and "1.000" in winner and "Always answer in French." in winner, result.output
        assert f"from which v3 was written: {CRITIQUE}" in result.output
    assert "stopped: rounds" in shown[0].output and "16 rollouts, 6 optimiser calls, 600 tokens" in shown[0].output


@pytest.mark.parametrize(("budget", "stop", "rollouts", "calls", "versions"), [
    ({"max_rollouts": 9}, "rollouts", 8, 3, 3),  # round 2's first batch (2) would make 10
    ({"rounds": 1}, "rounds", 8, 3, 3),
])
def test_each_budget_is_respected_exactly(tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer],
                                          budget: dict[str, Any], stop: str, rollouts: int, calls: int,
                                          versions: int) -> None:
    opt = optimizer()
    outcome = run(tmp_path, opt.url, **budget)
    b = outcome.budget
    assert (b.stop, b.rollouts, b.calls, b.tokens) == (stop, rollouts, calls, calls * TOKENS_PER_CALL), b.detail
    assert len(opt.bodies) == calls and len(outcome.candidates) == versions
    with stored(tmp_path) as store:
        assert len(store.rollouts()) == rollouts
    assert PLANTED in outcome.best.prompt.lower()
    assert json.loads((tmp_path / "out" / "apo.json").read_text())["budget"]["stop"] == stop


@pytest.mark.parametrize("limit", [300, 700, 1500])
def test_prompts_count_against_the_token_budget_and_no_call_can_pass_it(
        tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer], limit: int) -> None:
    """The budget is ``usage.total_tokens``, the prompt's tokens too: a call whose prompt and reply could pass it is
    not made, and the reply is capped at what its prompt leaves (a cap on the reply alone let prompts overrun)."""
    opt = optimizer(by_length=True)
    outcome = run(tmp_path, opt.url, max_optimizer_tokens=limit, rounds=5)
    b = outcome.budget
    assert b.stop == "optimizer_tokens" and b.calls >= 1, (b.stop, b.detail)
    assert b.tokens == sum(u["total_tokens"] for u in opt.usage) <= limit
    spent = 0
    for body, usage in zip(opt.bodies, opt.usage, strict=True):
        assert usage["prompt_tokens"] + body["max_tokens"] <= limit - spent  # even the longest reply would fit
        spent += usage["total_tokens"]
    calls = json.loads((tmp_path / "out" / "apo.json").read_text())["optimizer_calls"]
    used, cut = [c for c in calls if c["ok"]], [c for c in calls if not c["ok"]]
    assert all("cut at the" in str(c["error"]) for c in cut)  # a reply the cap cut is said, and not used
    assert len(used) + len(cut) == b.calls
    if limit == 300:  # the critique's prompt and reply took 194: no edit fits, none is asked for
        assert outcome.best.validation_score == 0.0


def test_a_failing_optimiser_call_is_retried_with_backoff(tmp_path: Path, model: FakeOpenAI,
                                                          optimizer: Callable[..., Optimizer]) -> None:
    opt = optimizer(fail=lambda n: n <= 2)  # the critique's first two tries answer 503
    outcome = run(tmp_path, opt.url, rounds=1, optimizer={"base_url": opt.url, "model": "critic",
                                                          "retries": 2, "backoff_s": 0.05})
    assert len(opt.bodies) == 5 and PLANTED in outcome.best.prompt.lower()
    assert [(c.purpose, c.tries, c.ok) for c in _calls(tmp_path)] == [
        ("critique", 3, True), ("edit", 1, True), ("edit", 1, True)]
    waits = [b - a for a, b in zip(opt.times[:2], opt.times[1:3], strict=True)]
    assert waits[0] >= 0.05 and waits[1] >= 0.1  # doubled
    assert outcome.rounds[0]["errors"] == []


def _calls(tmp_path: Path) -> list[Any]:
    from types import SimpleNamespace

    return [SimpleNamespace(**c) for c in json.loads((tmp_path / "out" / "apo.json").read_text())["optimizer_calls"]]


def test_an_optimiser_that_keeps_failing_is_reported_and_the_run_ends_cleanly(
        tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer],
        capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    opt = optimizer(fail=lambda n: True)
    raw = raw_config(tmp_path, opt.url, optimizer={"base_url": opt.url, "model": "critic", "retries": 1,
                                                   "backoff_s": 0.01})
    (tmp_path / "apo.yaml").write_text(yaml.safe_dump(raw))
    assert main([str(tmp_path / "apo.yaml"), "--quiet"]) == 0
    out = capsys.readouterr()
    assert "stopped: no_edits" in out.out and "503" in out.out and "after 2 tries" in out.out
    assert len(opt.bodies) == 2  # one critique, tried twice; nothing to edit without it
    record = json.loads((tmp_path / "out" / "apo.json").read_text())
    assert record["rounds"][0]["errors"][0].startswith("the optimiser's critique of v1 failed:")
    assert record["optimizer_calls"] == [{"purpose": "critique", "candidate": 1, "tokens": 0, "tries": 2, "ok": False,
                                          "error": record["optimizer_calls"][0]["error"], "estimated": False}]
    assert (tmp_path / "out" / "best_prompt.txt").read_text() == INITIAL  # the initial prompt stays the best


def test_through_the_gateway_the_agent_model_calls_are_recorded(
        tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("APO_TEST_MODEL_URL")  # the agent's OpenAI client reads OPENAI_BASE_URL: the gateway
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    opt = optimizer()
    outcome = run(tmp_path, opt.url, rounds=1, gateway_model=model.url)
    assert PLANTED in outcome.best.prompt.lower() and outcome.budget.rollouts == 8
    assert len([r for r in model.requests if r.path.endswith("/chat/completions")]) == 8
    with stored(tmp_path) as store:
        assert {t.token_source for t in store.transitions()} == {"gateway"}  # the gateway's own token ids


def test_through_the_gateway_scoring_runs_sample_at_validation_sampling(
        tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """validation.sampling was ignored by apo; through the gateway a scoring run's calls now carry it, and a
    training batch's calls the agent's own settings (this agent sets none)."""
    monkeypatch.delenv("APO_TEST_MODEL_URL")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    raw = raw_config(tmp_path, optimizer().url, rounds=1, gateway_model=model.url)
    raw["validation"]["sampling"] = {"temperature": 0.0, "seed": 7}
    outcome = run_apo(validate(raw, base_dir=str(tmp_path)), progress=False)
    assert PLANTED in outcome.best.prompt.lower()
    calls = [r.body for r in model.requests if r.path.endswith("/chat/completions")]
    scored = [b for b in calls if b["messages"][-1]["content"].startswith("hello")]  # the validation split
    batches = [b for b in calls if b["messages"][-1]["content"].startswith("greet")]
    assert len(scored) == 6 and len(batches) == 2, [b["messages"][-1]["content"] for b in calls]
    assert all(b.get("temperature") == 0.0 and b.get("seed") == 7 for b in scored), scored
    assert all("temperature" not in b and "seed" not in b for b in batches), batches


def test_a_second_search_in_the_same_run_dir_is_refused_not_written_over(
        tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer]) -> None:
    """A second search in run.dir wrote over the first one's apo.json and best_prompt.txt without a word (and
    the second, starting from the initial prompt again, may well find less)."""
    first = run(tmp_path, optimizer().url, rounds=1)
    folder = tmp_path / "out"
    kept = {name: (folder / name).read_text() for name in ("apo.json", "best_prompt.txt")}
    with pytest.raises(ConfigError) as info:
        run(tmp_path, optimizer().url, rounds=1)
    assert info.value.key == "run.dir" and "best v3, validation score 1.000" in str(info.value)
    assert "run.resume: false" in str(info.value)
    assert {name: (folder / name).read_text() for name in kept} == kept
    raw = raw_config(tmp_path, optimizer().url, rounds=1)
    raw["run"]["resume"] = False  # asked for: start over in it
    again = run_apo(validate(raw, base_dir=str(tmp_path)), progress=False)
    assert again.best.prompt == first.best.prompt and json.loads((folder / "apo.json").read_text())["run"] != \
        json.loads(kept["apo.json"])["run"]


@pytest.mark.parametrize("agent_match", [None, "^solver$"])
def test_the_stored_transitions_are_built_as_the_config_says(
        tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer], monkeypatch: pytest.MonkeyPatch,
        agent_match: str | None) -> None:
    """agent_match, air and credit were ignored by apo's server: the transitions it stored of the gateway's calls
    (what agl export reads) were built by the default builder whatever the config said."""
    monkeypatch.delenv("APO_TEST_MODEL_URL")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unset")
    raw = raw_config(tmp_path, optimizer().url, rounds=1, gateway_model=model.url)
    if agent_match is not None:
        raw["agent_match"] = agent_match  # this agent's calls are in no agent's scope: none is selected
    run_apo(validate(raw, base_dir=str(tmp_path)), progress=False)
    with stored(tmp_path) as store:
        trajectories = store.trajectories()
    assert len(trajectories) == 8
    if agent_match is None:
        assert all(len(t.transitions) == 1 for t in trajectories)
    else:
        assert all(not t.transitions for t in trajectories)
        assert all("agent_match" in s.reason for t in trajectories for s in t.skipped), trajectories[0].skipped


def test_without_the_gateway_the_server_serves_no_model(tmp_path: Path, model: FakeOpenAI,
                                                        optimizer: Callable[..., Optimizer]) -> None:
    from agl_trainer.apo import _local_server

    config = validate(raw_config(tmp_path, optimizer().url), base_dir=str(tmp_path))
    local = _local_server(config, None)
    try:
        r = httpx.post(local.url + "/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "apo.gateway_model" in r.json()["error"]["message"]
    finally:
        local.stop()


@pytest.mark.parametrize(("change", "key"), [
    (lambda r: r.pop("apo"), "apo"),
    (lambda r: r.pop("validation"), "validation"),
    (lambda r: r["resources"].pop("system_prompt"), "resources.system_prompt"),
    (lambda r: r["apo"].update(resource="rules"), "resources.rules"),
    (lambda r: r["apo"].pop("optimizer"), "apo.optimizer"),
    (lambda r: r["apo"]["optimizer"].pop("model"), "apo.optimizer.model"),
    (lambda r: r["apo"]["optimizer"].update(base_url="localhost:1"), "apo.optimizer.base_url"),
    (lambda r: r["apo"]["optimizer"].update(api_key_env="AGL_TEST_NO_SUCH_KEY"), "apo.optimizer.api_key_env"),
    (lambda r: r["apo"].update(beam_width=0), "apo.beam_width"),
    (lambda r: r["apo"].update(beamwidth=2), "apo.beamwidth"),
    (lambda r: r["apo"].update(max_rollouts=-1), "apo.max_rollouts"),
    (lambda r: r.update(backend={"model": "m"}), "backend"),
    (lambda r: r["algorithm"].update(name="apox"), "algorithm.name"),
    (lambda r: r["algorithm"].update(name="grpo", lr=1e-5) or r.update(backend={"model": "m"}), "apo"),
    # what apo would not read is refused, not ignored: it scores each candidate once, and without the gateway no
    # sampling override reaches the agent's own model
    (lambda r: r["validation"].update(every=5), "validation.every"),
    (lambda r: r["validation"].update(at_start=False), "validation.at_start"),
    (lambda r: r["validation"].update(sampling={"temperature": 0.7}), "validation.sampling"),
    (lambda r: r["algorithm"].update(lr=3e-5), "algorithm.lr"),
    (lambda r: r["algorithm"].update(temperature=0.5), "algorithm.temperature"),
    (lambda r: r["data"].update(group_size=3), "data.group_size"),
    (lambda r: r["data"].update(tasks_per_step=3), "data.tasks_per_step"),
    (lambda r: r.update(sft={"min_reward": 0.5}), "sft.min_reward"),
    (lambda r: r["run"].update(steps=3), "run.steps"),
    (lambda r: r["run"].update(checkpoint_every=3), "run.checkpoint_every"),
    (lambda r: r["run"].update(seed=3), "run.seed"),
])
def test_bad_config_errors_name_the_field(tmp_path: Path, change: Callable[[dict[str, Any]], Any], key: str) -> None:
    raw = raw_config(tmp_path, "http://127.0.0.1:9/v1")
    change(raw)
    with pytest.raises(ConfigError) as info:
        validate(raw, base_dir=str(tmp_path))
    assert info.value.key == key, str(info.value)
    assert str(info.value).startswith(f"config error: {key}: ")
    if key == "apo.beamwidth":
        assert "did you mean beam_width?" in str(info.value)


def test_check_says_what_would_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    (tmp_path / "apo.yaml").write_text(yaml.safe_dump(raw_config(tmp_path, "http://127.0.0.1:9/v1")))
    assert main([str(tmp_path / "apo.yaml"), "--check"]) == 0
    assert "apo over resources.system_prompt, 4 tasks, 2 validation tasks x 1, beam 2, 2 rounds" in \
        capsys.readouterr().out


def test_a_run_that_fails_keeps_what_it_found(tmp_path: Path, optimizer: Callable[..., Optimizer],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    raw = raw_config(tmp_path, optimizer().url)
    raw["workers"], raw["run"]["step_timeout_s"] = {"count": 0}, 1  # nobody runs the rollouts
    (tmp_path / "apo.yaml").write_text(yaml.safe_dump(raw))
    assert main([str(tmp_path / "apo.yaml"), "--quiet"]) == 1
    assert "did not finish within run.step_timeout_s=1 s: are workers running?" in capsys.readouterr().err
    record = json.loads((tmp_path / "out" / "apo.json").read_text())
    assert record["budget"]["stop"] == "error" and "TimeoutError" in record["budget"]["stop_detail"]
    assert (tmp_path / "out" / "best_prompt.txt").read_text() == INITIAL


def test_an_edit_that_drops_a_template_placeholder_is_refused(tmp_path: Path, model: FakeOpenAI,
                                                              optimizer: Callable[..., Optimizer]) -> None:
    opt = optimizer()
    raw = raw_config(tmp_path, opt.url, rounds=1)
    raw["resources"]["system_prompt"] = "Greet the user {name}."  # the scripted edits have no {name}
    outcome = run_apo(validate(raw, base_dir=str(tmp_path)), progress=False)
    assert outcome.budget.stop == "no_edits" and [c.version for c in outcome.candidates] == [1]
    assert outcome.rounds[0]["errors"] == ["an edit of v1 dropped the placeholders {name} and is not tried"] * 2
    assert "keep every {placeholder}" in opt.bodies[1]["messages"][-1]["content"]


def test_rollouts_whose_agent_raised_score_zero_and_the_optimiser_reads_the_error(
        tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer]) -> None:
    opt = optimizer()
    raw = raw_config(tmp_path, opt.url, rounds=1)
    raw["agent"] = "apo_test_agents:raising"
    outcome = run_apo(validate(raw, base_dir=str(tmp_path)), progress=False)
    assert [c.validation_score for c in outcome.candidates] == [0.0, 0.0, 1.0] and outcome.best.version == 3
    asked = opt.bodies[0]["messages"][-1]["content"]
    assert "reward None" in asked and "Error: ValueError: expected French, got 'hello'" in asked, asked


def test_against_a_running_agl_serve(tmp_path: Path, model: FakeOpenAI, optimizer: Callable[..., Optimizer],
                                     make_server: ServerFactory) -> None:
    srv = make_server(model, db=tmp_path / "served.db")
    opt = optimizer()
    raw = raw_config(tmp_path, opt.url, rounds=1)
    raw["server"] = {"url": srv.url}
    outcome = run_apo(validate(raw, base_dir=str(tmp_path)), progress=False)
    assert PLANTED in outcome.best.prompt.lower() and outcome.server_url == srv.url
    assert httpx.get(srv.url + "/v1/resources").json()["version"] == outcome.best.version
    assert len(srv.server.store.rollouts()) == outcome.budget.rollouts == 8
    assert not (tmp_path / "agl.db").exists()  # no server of its own
