"""``algorithm: sft`` and ``rft`` through ``agl train``'s own entry (:func:`run_training`) on a tiny Phi built here.

SFT reads a real SQLite store of transitions (the selection ``agl export`` uses) and trains the
torch backend; RFT samples through the real server, gateway, torch engine and worker threads
running :func:`sft_test_agents.pick`; a ``grpo`` run then starts from the SFT model folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from agl_core.schema import Rollout, Trajectory, Transition  # noqa: E402
from agl_core.store.selection import Selection  # noqa: E402
from agl_core.store.sqlite import SqliteStore  # noqa: E402
from agl_trainer.config import validate  # noqa: E402
from agl_trainer.demo.policy import PolicySpec, build_tokenizer  # noqa: E402
from agl_trainer.sft import SftExample, SftTrainer, sft_examples, sft_loss  # noqa: E402
from agl_trainer.train_cli import run_training  # noqa: E402

ANSWERS = ["blue", "red", "green"]
WORDS = ["user", "assistant", "pick", "a", "colour", "shape", "please"]
COLOUR = {"q": "pick a colour", "answer": "blue"}
SHAPE = {"q": "pick a shape", "answer": "green"}


@pytest.fixture(scope="module", autouse=True)
def agent_importable() -> Any:
    """The agent's module importable by ``sft_test_agents:pick``, as a user's would be."""
    import sys

    here = str(Path(__file__).parent)
    sys.path.insert(0, here)
    yield
    sys.path.remove(here)


def save_policy(folder: Path) -> Any:
    """A 2-layer Phi whose output bias favours the three answers alike (a third each), and its tokenizer."""
    from transformers import PhiConfig, PhiForCausalLM

    tokenizer = build_tokenizer(PolicySpec(WORDS, [], ANSWERS))
    torch.manual_seed(0)
    model = PhiForCausalLM(PhiConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                                     tie_word_embeddings=False, bos_token_id=None,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    with torch.no_grad():
        model.lm_head.bias.zero_()
        for word in ANSWERS:
            model.lm_head.bias[tokenizer.convert_tokens_to_ids(word)] = 8.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def config(folder: Path, **sections: Any) -> Any:
    raw: dict[str, Any] = {
        "data": {"path": "tasks.jsonl", "group_size": 8, "tasks_per_step": 2},
        "agent": "sft_test_agents:pick",
        "backend": {"name": "torch", "model": "policy", "threads": 1, "max_batch": 8},
        "workers": {"count": 4},
        "server": {"db": "agl.db"},
        "run": {"steps": 1, "dir": "out"},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return validate(raw, base_dir=str(folder))


def ids(tokenizer: Any, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(w) for w in text.split()]


def prompt_ids(tokenizer: Any, q: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def call(rollout: str, task: str, q: str, answer: str, reward: float, tokenizer: Any, *, agent: str = "picker",
         prompt: list[int] | None = None, response: list[int] | None = None, recorded: bool = True) -> Transition:
    """One stored call; its ids are the gateway's (``recorded``) unless ``prompt`` / ``response`` say otherwise."""
    with_ids = recorded or prompt is not None
    return Transition(
        rollout_id=rollout, task_id=task, index=0, agent_name=agent,
        prompt=[{"role": "user", "content": q}], response={"role": "assistant", "content": answer},
        prompt_token_ids=(prompt or prompt_ids(tokenizer, q)) if with_ids else None,
        response_token_ids=(response or [*ids(tokenizer, answer), tokenizer.eos_token_id]) if with_ids else None,
        token_source="gateway" if with_ids else None, reward=reward, credited_reward=reward)


def store_calls(path: Path, calls: list[Transition], status: str = "succeeded") -> None:
    with SqliteStore(path) as store:
        for t in calls:
            store.put_rollout(Rollout(id=t.rollout_id, task_id=t.task_id, status=status, start_time=1.0, end_time=2.0),
                              Trajectory(rollout_id=t.rollout_id, task_id=t.task_id, transitions=[t],
                                         reward=t.credited_reward))


def logprob(model_dir: Path, prompt: list[int], response: list[int], *, temperature: float = 1.0) -> float:
    """log p(response | prompt) under the model folder's weights, sampled at ``temperature``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0, :-1].float() / temperature, -1)
    return float(sum(logp[len(prompt) - 1 + i, tok] for i, tok in enumerate(response)))


# ---------------------------------------------------------------------- sft from a store


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A store of good (reward 1: blue for a colour) and bad calls (reward 0: red; another agent's; another task's),
    and an sft run with LoRA on the good ones."""
    folder = tmp_path_factory.mktemp("sft")
    tokenizer = save_policy(folder / "policy")
    (folder / "tasks.jsonl").write_text(json.dumps(COLOUR) + "\n" + json.dumps({**SHAPE, "max_tokens": 4}) + "\n")
    calls = [call(f"good-{i}", "colour", COLOUR["q"], "blue", 1.0, tokenizer) for i in range(4)]
    calls += [call(f"bad-{i}", "colour", COLOUR["q"], "red", 0.0, tokenizer) for i in range(4)]
    calls += [call("judge-0", "colour", COLOUR["q"], "green", 1.0, tokenizer, agent="judge"),
              call("other-task-0", "shape", COLOUR["q"], "green", 1.0, tokenizer)]
    store_calls(folder / "runs.db", calls)
    store_calls(folder / "runs.db", [call("failed-0", "colour", COLOUR["q"], "green", 1.0, tokenizer)], "failed")
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "fc1", "fc2", "lm_head"]}
    cfg = config(folder, algorithm={"name": "sft", "lr": 3e-2}, backend={"lora": lora},
                 sft={"data": "runs.db", "min_reward": 0.5, "agent": "^pick", "task_ids": ["colour"], "epochs": 6,
                      "batch_size": 2})
    outcome = run_training(cfg, progress=False)
    summary = json.loads((folder / "out" / "summary.json").read_text())
    return {"folder": folder, "tokenizer": tokenizer, "outcome": outcome, "summary": summary, "calls": calls}


def test_the_selection_is_export_s_and_keeps_only_the_good_calls(sft_run: dict[str, Any]) -> None:
    with SqliteStore(sft_run["folder"] / "runs.db") as store:
        chosen = Selection(task_ids=["colour"], status=["succeeded"], agent="^pick", min_reward=0.5)
        kept = sorted(t.rollout_id for t in chosen.transitions(store))
    assert kept == [f"good-{i}" for i in range(4)]
    assert sft_run["summary"]["selection"]["examples"] == 4 and sft_run["summary"]["selection"]["recorded"] == 4
    with pytest.raises(ValueError, match=r"agent: '\(' is not a valid regular expression"):
        Selection(agent="(")


def test_sft_loss_falls_and_the_selected_response_becomes_likelier(sft_run: dict[str, Any]) -> None:
    folder, tokenizer = sft_run["folder"], sft_run["tokenizer"]
    steps = sft_run["summary"]["steps"]
    assert len(steps) == 12  # 4 examples, batches of 2, 6 epochs
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"]
    assert all(s["loss_tokens"] == 4 and s["chat_template"] == 0 for s in steps)  # blue + <|im_end|>, twice
    prompt = prompt_ids(tokenizer, COLOUR["q"])
    end = [tokenizer.eos_token_id]
    good = (logprob(folder / "policy", prompt, ids(tokenizer, "blue") + end),
            logprob(folder / "out" / "model", prompt, ids(tokenizer, "blue") + end))
    bad = (logprob(folder / "policy", prompt, ids(tokenizer, "red") + end),
           logprob(folder / "out" / "model", prompt, ids(tokenizer, "red") + end))
    assert good[1] > good[0] + 1.0, good  # the selected behaviour: much likelier
    assert bad[1] < bad[0], bad  # the excluded low-reward one: not learned
    first_token = logprob(folder / "out" / "model", prompt, ids(tokenizer, "blue"))
    assert first_token > -0.3  # p(blue) from a third to most of the mass


def test_only_response_tokens_carry_loss(sft_run: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    from agl_trainer.torch_backend import TorchBackend, TorchConfig

    tokenizer = sft_run["tokenizer"]
    example = SftExample([5, 6, 7, 8, 9, 10], prompt_len=4, source="gateway")
    assert example.label_mask == [0, 0, 0, 0, 1, 1]
    model = AutoModelForCausalLM.from_pretrained(sft_run["folder"] / "policy")
    backend = TorchBackend(model, TorchConfig(lora_above_params=None, gradient_checkpointing=False),
                           pad_id=tokenizer.pad_token_id)
    trainer = SftTrainer(backend)
    other = SftExample([5, 6, 7], prompt_len=2, source="gateway")
    ids_t, attention, mask = trainer.tensors([example, other])
    # logp[:, p] is the logprob of token p+1: the targets 4 and 5 of the first row, 2 of the second (the padding not)
    assert mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 0, 0, 0]]
    logp = torch.randn(2, 5, requires_grad=True)
    loss, tokens = sft_loss(logp, mask)
    loss.backward()
    assert tokens == 3 and torch.equal(logp.grad, -mask)  # no gradient reaches a prompt position's target
    changed = logp.detach().clone()
    changed[0, :3] += 5.0  # the prompt tokens' targets, as another prompt would score them
    changed[1, 0] -= 5.0
    assert float(sft_loss(changed, mask)[0]) == pytest.approx(float(loss.detach()))


def test_the_recorded_token_ids_are_trained_and_a_call_without_them_is_rendered_and_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = save_policy(tmp_path / "policy")
    (tmp_path / "tasks.jsonl").write_text(json.dumps(COLOUR) + "\n")
    # recorded ids no re-tokenisation of the text would give: a prompt without the template's tokens, "green" for
    # a reply whose text says "blue"
    odd_prompt = ids(tokenizer, "please pick a colour please")
    odd_response = ids(tokenizer, "green green") + [tokenizer.eos_token_id]
    calls = [call(f"odd-{i}", "colour", COLOUR["q"], "blue", 1.0, tokenizer, prompt=odd_prompt, response=odd_response)
             for i in range(3)]
    calls.append(call("text-0", "colour", SHAPE["q"], "red", 1.0, tokenizer, recorded=False))
    examples, stats = sft_examples(calls, tokenizer)
    assert [e.input_ids for e in examples[:3]] == [odd_prompt + odd_response] * 3
    assert (stats.recorded, stats.chat_template, stats.token_sources) == (3, 1, {"gateway": 3, "chat_template": 1})
    rendered = prompt_ids(tokenizer, SHAPE["q"])
    assert examples[3].input_ids == rendered + ids(tokenizer, "red") + [tokenizer.eos_token_id]
    assert examples[3].prompt_len == len(rendered)

    store_calls(tmp_path / "agl.db", calls)  # the run's own store: sft.data left out
    retokenized = (prompt_ids(tokenizer, COLOUR["q"]), ids(tokenizer, "blue") + [tokenizer.eos_token_id])
    before = (logprob(tmp_path / "policy", odd_prompt, odd_response), logprob(tmp_path / "policy", *retokenized))
    cfg = config(tmp_path, algorithm={"name": "sft", "lr": 5e-3}, sft={"epochs": 5, "batch_size": 4})
    import yaml

    from agl_trainer.train_cli import main

    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=True)))
    assert main([str(tmp_path / "sft.yaml"), "--check"]) == 0
    checked = capsys.readouterr().out.strip()
    assert checked == f"agl train: {tmp_path / 'sft.yaml'} is valid: sft on the store agl.db, backend torch"
    assert main([str(tmp_path / "sft.yaml")]) == 0  # agl train's own entry: the lines a user reads
    after = (logprob(tmp_path / "out" / "model", odd_prompt, odd_response),
             logprob(tmp_path / "out" / "model", *retokenized))
    assert after[0] > before[0] + 2.0, (before, after)  # the recorded sequence is what was learned
    assert after[1] - before[1] < after[0] - before[0]
    printed = capsys.readouterr()
    assert "3 with recorded token ids, 1 rendered with the chat template" in printed.err
    assert printed.err.count("1 chat-template") == 5  # every step's line counts the rendered example
    assert "agl train: sft 5 steps on 4 examples (1 rendered with the chat template), loss " in printed.out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"][0]["chat_template"] == 1.0 and summary["selection"]["chat_template"] == 1


def test_the_keys_sft_and_rft_do_not_read_are_said_in_one_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """kl_coef, backend.epochs, run.steps... in an sft config were ignored without a word (a user raising
    backend.epochs for more passes got one). They are said, not refused: an sft config is often the grpo one."""
    import yaml

    from agl_trainer.config import ignored_line
    from agl_trainer.train_cli import main

    save_policy(tmp_path / "policy")
    (tmp_path / "tasks.jsonl").write_text(json.dumps(COLOUR) + "\n")
    capsys.readouterr()
    cfg = config(tmp_path, algorithm={"name": "sft", "kl_coef": 0.1}, backend={"epochs": 3})
    line = ignored_line(cfg)
    assert line is not None and line.startswith("agl train: algorithm.name sft does not read algorithm.kl_coef (")
    for key in ("backend.epochs (the passes over the examples are sft.epochs)", "data.tasks_per_step", "run.steps"):
        assert key in line, line
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=True)))
    assert main([str(tmp_path / "sft.yaml"), "--check"]) == 0
    assert capsys.readouterr().err.strip() == line
    rft = config(tmp_path, algorithm={"name": "rft", "kl_coef": 0.1})  # rft samples: group_size, steps are its
    assert ignored_line(rft) == ("agl train: algorithm.name rft does not read algorithm.kl_coef (a term of the grpo "
                                 "loop's policy-gradient step, which sft and rft do not take): ignored")
    bare = validate({"data": {"path": "tasks.jsonl"}, "agent": "sft_test_agents:pick", "algorithm": {"name": "sft"},
                     "backend": {"model": "policy"}}, base_dir=str(tmp_path))
    assert ignored_line(bare) is None
    dumped = validate(bare.model_dump(mode="json"), base_dir=str(tmp_path))  # every default written out
    assert ignored_line(dumped) is None and ignored_line(config(tmp_path)) is None  # grpo reads them all


def test_sft_with_nothing_selected_is_a_config_error_naming_the_selection(sft_run: dict[str, Any]) -> None:
    from agl_trainer.config import ConfigError

    folder = sft_run["folder"]
    cfg = config(folder, algorithm={"name": "sft"}, run={"dir": "empty"},
                 sft={"data": "runs.db", "min_reward": 5.0})
    with pytest.raises(ConfigError, match=r"sft: no transition of .*runs.db passes the selection \(status=\['succeeded"
                                          r"'\], min_reward=5.0\)"):
        run_training(cfg, progress=False)
    missing = config(folder, algorithm={"name": "sft"}, run={"dir": "empty"}, sft={"data": "nope.db"})
    with pytest.raises(ConfigError, match="sft.data: no such store: .*nope.db"):
        run_training(missing, progress=False)
    assert not (folder / "empty").exists() and not (folder / "nope.db").exists()


def test_a_second_sft_run_in_the_same_run_dir_is_refused_not_written_over(sft_run: dict[str, Any]) -> None:
    """sft cannot resume, and a second run in run.dir wrote over the first one's model/, checkpoint and summary
    without a word; run.resume (the default) now refuses it, naming the way to start over."""
    from agl_trainer.config import ConfigError

    folder = sft_run["folder"]
    left = {p: p.stat().st_mtime_ns for p in (folder / "out").rglob("*") if p.is_file()}
    again = config(folder, algorithm={"name": "sft"}, sft={"data": "runs.db", "min_reward": 0.5})
    with pytest.raises(ConfigError, match=r"^config error: run\.dir: .*out holds an earlier sft run "
                                          r"\(.*summary\.json\), which this sft run would write over \(model/, "
                                          r"sft-checkpoint/, .*sft cannot resume a run yet.*run\.resume: false"):
        run_training(again, progress=False)
    # nor a grpo run there, which would write its summary.json and loss_curve.png over the sft run's
    grpo = config(folder, backend={"model": "out/model"})
    with pytest.raises(ConfigError, match=r"holds an earlier sft run .*which this grpo run would write over "
                                          r"\(checkpoint/, .*it is not a grpo run's"):
        run_training(grpo, progress=False)
    assert {p: p.stat().st_mtime_ns for p in (folder / "out").rglob("*") if p.is_file()} == left


# ---------------------------------------------------------------------- grpo from the sft model, rft


def test_grpo_starts_from_the_sft_model_folder_and_trains(sft_run: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    folder = sft_run["folder"]
    sft_model = folder / "out" / "model"
    assert (sft_model / "config.json").exists() and (sft_model / "tokenizer.json").exists()
    # up to 4 words sampled at temperature 4 (p(blue) about 0.64 then, 0.999 at 1): a reward in quarters, so a group
    # of 8 rarely scores all alike
    (folder / "four.jsonl").write_text(json.dumps({**COLOUR, "max_tokens": 4}) + "\n")
    cfg = config(folder, data={"path": "four.jsonl", "tasks_per_step": 1}, backend={"model": "out/model"},
                 algorithm={"lr": 5e-3, "temperature": 4.0}, run={"steps": 2, "dir": "grpo", "checkpoint_every": 2})
    outcome = run_training(cfg, progress=False)
    assert [s["step"] for s in outcome.steps] == [1, 2]
    assert any(s["metrics"].get("grad_norm", 0.0) > 0 for s in outcome.steps), outcome.steps
    saved = load_file(str(sft_model / "model.safetensors"))
    trained = torch.load(folder / "grpo" / "checkpoint" / "trainer.pt", weights_only=True)["model"]
    assert set(trained) == set(saved)  # the merged SFT weights, loaded as a plain model
    assert any(not torch.equal(saved[k], trained[k]) for k in saved)
    # the policy served in step 1 was the SFT model: the gateway's recorded logprobs are its, not the base's
    with SqliteStore(folder / "agl.db") as store:
        t = store.transitions(rollout_id=store.rollouts()[0].id)[0]
    assert t.token_source == "gateway" and t.prompt_token_ids and t.response_token_ids and t.response_logprobs
    recorded = sum(t.response_logprobs)
    served = logprob(sft_model, t.prompt_token_ids, t.response_token_ids, temperature=4.0)
    assert served == pytest.approx(recorded, abs=1e-3)
    assert abs(logprob(folder / "policy", t.prompt_token_ids, t.response_token_ids, temperature=4.0) - recorded) > 0.1


def test_rft_rounds_raise_the_mean_reward(tmp_path: Path) -> None:
    save_policy(tmp_path / "policy")
    (tmp_path / "tasks.jsonl").write_text(json.dumps(COLOUR) + "\n" + json.dumps(SHAPE) + "\n")
    cfg = config(tmp_path, data={"group_size": 12}, algorithm={"name": "rft", "lr": 5e-3},
                 sft={"epochs": 6, "batch_size": 2, "min_reward": 1.0}, run={"steps": 3})
    outcome = run_training(cfg, progress=False)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3] and all(r["rollouts"] == 24 for r in rounds)
    assert rounds[0]["tasks_kept"] == 2 and rounds[0]["best_reward_mean"] == 1.0
    assert rounds[0]["selection"] == {**rounds[0]["selection"], "examples": 2, "recorded": 2, "chat_template": 0}
    assert rounds[0]["reward_mean"] < 0.6  # about a third: the base picks each answer alike
    assert rounds[-1]["reward_mean"] > rounds[0]["reward_mean"] + 0.3, [r["reward_mean"] for r in rounds]
    assert "rft 3 rounds" in (outcome.summary_line or "")
    assert os.path.exists(tmp_path / "out" / "model" / "model.safetensors")
    import sqlite3

    with sqlite3.connect(tmp_path / "agl.db") as conn:  # each round's figures went to the server (the dashboard)
        recorded = dict(conn.execute("SELECT step, value FROM trainer_metrics WHERE name = 'reward_mean'").fetchall())
    assert recorded == {r["round"]: pytest.approx(r["reward_mean"]) for r in rounds}


def test_an_rft_round_that_keeps_nothing_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_policy(tmp_path / "policy")
    (tmp_path / "tasks.jsonl").write_text(json.dumps(COLOUR) + "\n")
    cfg = config(tmp_path, data={"group_size": 4, "tasks_per_step": 1}, algorithm={"name": "rft"},
                 sft={"min_reward": 2.0})
    run_training(cfg, progress=False)
    (only,) = json.loads((tmp_path / "out" / "summary.json").read_text())["rounds"]
    assert (only["tasks_kept"], only["tasks_without_keeper"], only["steps"]) == (0, 1, [])
    assert "agl train: rft round 1 trains on nothing: no task had a rollout to keep (rewards missing, or none " \
           "reached sft.min_reward 2.0)" in caplog.text


@pytest.mark.parametrize(("changes", "message"), [
    ({"algorithm": {"name": "dpo"}}, "config error: algorithm.name: 'dpo' is not one of: grpo, apo, sft, rft"),
    ({"algorithm": {"name": "sft"}, "sft": {"agent": "("}},
     "config error: sft.agent: '(' is not a valid regular expression: missing ), unterminated subpattern at "
     "position 0"),
    ({"algorithm": {"name": "sft"}, "sft": {"epochs": 0}}, "config error: sft.epochs: must be greater than 0, got 0"),
    ({"sft": {"min_reward": 1.0}}, "config error: sft: is read with algorithm.name sft or rft only; algorithm.name is "
                                   "grpo"),
    ({"algorithm": {"name": "rft"}, "validation": {"path": "tasks.jsonl"}},
     "config error: validation: is run by the grpo loop; algorithm.name rft does not run it yet: drop the section, or "
     "validate the model folder it writes with a grpo run"),
    ({"algorithm": {"name": "sft"}, "policies": {"writer": {"agents": "writer"}}},
     "config error: policies: algorithm.name sft fine-tunes one policy; several (one adapter per role) are trained by "
     "grpo only yet: drop policies (sft.agent selects the role's calls)"),
    ({"algorithm": {"name": "sft"}, "backend": {"name": "verl"}},
     "config error: algorithm.name: sft trains with the torch backend; backend.name is verl"),
])
def test_a_bad_sft_config_is_named(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    from agl_trainer.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        config(tmp_path, **changes)
    assert str(caught.value) == message


def test_sft_reads_a_running_server_s_store_over_http(tmp_path: Path, fake: Any, make_server: Any) -> None:
    tokenizer = save_policy(tmp_path / "policy")
    (tmp_path / "tasks.jsonl").write_text(json.dumps(COLOUR) + "\n")
    store_calls(tmp_path / "served.db", [call(f"good-{i}", "colour", COLOUR["q"], "blue", 1.0, tokenizer)
                                         for i in range(2)]
                + [call("bad-0", "colour", COLOUR["q"], "red", 0.0, tokenizer)])
    server = make_server(fake, db=tmp_path / "served.db")
    cfg = config(tmp_path, algorithm={"name": "sft", "lr": 5e-3}, sft={"data": server.url, "min_reward": 0.5})
    summary = run_training(cfg, progress=False)
    assert summary.files["model"] == str(tmp_path / "out" / "model")
    selection = json.loads((tmp_path / "out" / "summary.json").read_text())["selection"]
    assert (selection["transitions"], selection["examples"], selection["recorded"]) == (2, 2, 2)


def test_a_tool_call_without_ids_is_rendered_with_its_arguments_as_the_template_takes_them(tmp_path: Path) -> None:
    from agl_trainer.demo.policy import tool_call_text

    unlock = tool_call_text("unlock", {"code": "3"})
    tokenizer = build_tokenizer(PolicySpec(WORDS, [unlock], ANSWERS))
    reply = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "unlock", "arguments": '{"code": "3"}'}}]}
    t = Transition(rollout_id="r", task_id="t", index=0, prompt=[{"role": "user", "content": "pick a colour"}],
                   response=reply)
    (example,), stats = sft_examples([t], tokenizer)
    assert stats.chat_template == 1
    response = tokenizer.convert_ids_to_tokens(example.input_ids[example.prompt_len:])
    assert unlock in response and response[-1] == "<|im_end|>"  # the one token of the call the model would write
