"""The verl launch path as far as a CPU takes it: agl's config as verl's Hydra config (composed with verl's own
``ppo_trainer``, so every key must exist there), the padded DataProto through verl's own padding removal, its
advantage step and its policy loss. The GPU part (worker groups, vLLM replicas) is docs/verl.md's recipe.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import validate_config  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from agl_trainer.advantages import compute_advantages  # noqa: E402
from agl_trainer.config import ConfigError, apply_overrides, validate  # noqa: E402
from agl_trainer.rows import build_rows  # noqa: E402
from agl_trainer.verl_backend import (  # noqa: E402
    PAD_UID,
    check_verl_config,
    compose_verl_config,
    to_data_proto,
    verl_overrides,
)

from .test_data_proto import BATCH  # noqa: E402

CONFIG = {
    "data": {"path": "tasks.jsonl", "group_size": 2, "tasks_per_step": 2},
    "agent": "my_pkg.agent:solve",
    "backend": {"name": "verl", "model": "Qwen/Qwen2.5-0.5B-Instruct", "epochs": 2, "lora": {"r": 16, "alpha": 32},
                "verl": {"n_gpus_per_node": 4, "tensor_parallel_size": 2, "ppo_mini_batch_size": 2,
                         "overrides": ["trainer.project_name=agl-test"]}},
    "algorithm": {"lr": 1e-6, "kl_coef": 0.001, "clip_epsilon": 0.2, "clip_epsilon_high": 0.28,
                  "max_prompt_length": 512, "max_response_length": 256, "scale_advantages": False},
    "run": {"steps": 3, "dir": "/tmp/agl-verl-run"},
}


def test_agl_config_becomes_verl_config_with_every_key_known_to_verl() -> None:
    config = validate(CONFIG)
    verl_cfg = compose_verl_config(verl_overrides(config))
    actor, rollout = verl_cfg.actor_rollout_ref.actor, verl_cfg.actor_rollout_ref.rollout
    assert verl_cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (rollout.name, rollout.mode, rollout.n, rollout.tensor_model_parallel_size) == ("vllm", "async", 2, 2)
    assert (actor.optim.lr, actor.clip_ratio_low, actor.clip_ratio_high) == (1e-6, 0.2, 0.28)
    assert actor.use_kl_loss is True and actor.kl_loss_coef == 0.001 and actor.ppo_epochs == 2
    # agl's per-rollout loss (tests/verl/test_per_rollout_loss.py); verl's KL/entropy terms as token means; the
    # mini-batches as agl laid them out, and the replicas' logprobs of the distribution they sampled from
    assert actor.policy_loss.loss_mode == "agl_per_rollout" and actor.loss_agg_mode == "token-mean"
    assert actor.shuffle is False and rollout.logprobs_mode == "processed_logprobs" and rollout.temperature == 1.0
    assert verl_cfg.actor_rollout_ref.model.lora_rank == 16 and verl_cfg.actor_rollout_ref.model.lora_alpha == 32
    assert verl_cfg.algorithm.adv_estimator == "grpo" and verl_cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert (verl_cfg.data.max_prompt_length, verl_cfg.data.max_response_length) == (512, 256)
    assert verl_cfg.trainer.n_gpus_per_node == 4 and verl_cfg.trainer.total_training_steps == 3
    assert verl_cfg.trainer.use_v1 is False and verl_cfg.trainer.project_name == "agl-test"


def test_a_key_verl_does_not_have_fails_on_this_machine() -> None:
    config = validate({**CONFIG, "backend": {**CONFIG["backend"], "verl": {"overrides": ["trainer.no_such_key=1"]}}})
    with pytest.raises(Exception, match="no_such_key"):
        compose_verl_config(verl_overrides(config))


def _batch(pad_to: int) -> object:
    scored, _ = compute_advantages(BATCH, credit="final")
    rows, _ = build_rows(scored, "trajectory")
    return to_data_proto(rows, pad_to_multiple=pad_to), rows


def test_padding_rows_fill_the_mini_batch_and_carry_no_loss() -> None:
    data, rows = _batch(3)
    assert len(rows) == 4 and len(data) == 6
    assert data.meta_info["agl"]["pad_rows"] == 2
    assert list(data.non_tensor_batch["uid"][-2:]) == [f"{PAD_UID}-0", f"{PAD_UID}-1"]
    assert int(data.batch["response_mask"][4:].sum()) == 0 and float(data.batch["advantages"][4:].abs().sum()) == 0
    # real rows are untouched
    assert int(data.batch["response_mask"][:4].sum()) == sum(r.loss_tokens for r in rows)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        to_data_proto(rows, pad_to_multiple=0)


def test_verl_removes_the_padding_of_our_batch_as_its_workers_do() -> None:
    data, rows = _batch(3)
    td = left_right_2_no_padding(data.to_tensordict())
    lengths = td["input_ids"].offsets().diff().tolist()
    expected = [len(r.input_ids) for r in rows] + [2, 2]
    assert lengths == expected  # every real token kept, every pad token dropped


def test_verl_advantage_and_policy_loss_run_on_our_batch() -> None:
    data, _ = _batch(3)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"]
    ours = data.batch["advantages"].clone()
    grpo = compute_advantage(data, adv_estimator="grpo", num_repeat=2, norm_adv_by_std_in_grpo=True)
    mask = grpo.batch["response_mask"].bool()
    # trajectory rows are one per rollout here, so verl's GRPO over uid agrees with agl's advantages, up to
    # its std: verl divides by the sample std (n - 1), agl by the group's own (n): a factor sqrt(2) for pairs
    assert torch.allclose(grpo.batch["advantages"][mask] * 2 ** 0.5, ours[mask], atol=1e-4)
    # verl's PPO-clip loss, with the actor config our overrides made, on our batch
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(compose_verl_config(verl_overrides(validate(CONFIG))).actor_rollout_ref.actor)
    logp = data.batch["old_log_probs"] + 0.5 * data.batch["response_mask"]  # ratio e^0.5 = 1.65: clipped at 1.28
    pg, metrics = compute_policy_loss_vanilla(data.batch["old_log_probs"], logp, grpo.batch["advantages"],
                                              data.batch["response_mask"], loss_agg_mode=actor.loss_agg_mode,
                                              config=actor)
    assert torch.isfinite(pg)
    assert float(metrics["actor/pg_clipfrac"]) > 0
    assert agg_loss(data.batch["response_mask"].float(), data.batch["response_mask"], "seq-mean-token-mean") > 0


def _recipe() -> tuple[dict[str, Any], list[list[str]]]:
    """docs/verl.md's config, and the ``--set`` flags of each ``agl train train.yaml`` command line it gives."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "verl.md").read_text(encoding="utf-8")
    block = re.findall(r"```yaml\n(.*?)```", page, re.S)[0]
    commands = [re.findall(r"--set\s+(\S+)", line) for line in re.findall(r"agl train train\.yaml[^`\n]*", page)]
    return yaml.safe_load(block), commands


def test_the_recipe_in_docs_verl_md_passes_verls_own_validate_config() -> None:
    """The full run and the short run, as written: verl's ``validate_config`` (its Ray actor's first check)."""
    raw, commands = _recipe()
    short = [flags for flags in commands if "run.steps=2" in flags]
    assert short and [] in commands, commands  # the docs still name both runs
    for flags in ([], *short):
        config = validate(apply_overrides(raw, flags))
        verl_cfg = check_verl_config(config)  # raises ConfigError with verl's own words when verl would refuse it
        validate_config(config=verl_cfg, use_reference_policy=need_reference_policy(verl_cfg),
                        use_critic=need_critic(verl_cfg))
        actor = verl_cfg.actor_rollout_ref.actor
        assert verl_cfg.trainer.nnodes == 2 and verl_cfg.trainer.n_gpus_per_node == 8
        assert verl_cfg.actor_rollout_ref.rollout.n == 8 and verl_cfg.trainer.project_name == "my-agent"
        assert verl_cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True
        assert verl_cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 4
        assert verl_cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
        assert actor.ppo_mini_batch_size <= verl_cfg.data.train_batch_size == config.data.tasks_per_step
    assert [check_verl_config(validate(apply_overrides(raw, f))).actor_rollout_ref.actor.ppo_mini_batch_size
            for f in ([], short[0])] == [16, 4]  # a step of 4 tasks is one mini-batch of them


def test_batch_sizes_verl_would_refuse_after_the_cluster_started_fail_before_it() -> None:
    raw, _ = _recipe()
    # 3 tasks x 2 rollouts = 6 rows per mini-batch over 16 GPUs: verl's update would stop on it at step 1
    config = validate(apply_overrides(raw, ["data.tasks_per_step=3", "data.group_size=2"]))
    with pytest.raises(ConfigError, match=r"backend\.verl: .*6 rows, which 16 data-parallel GPUs cannot share"):
        check_verl_config(config)
    # verl's own validate_config, in its words: mini-batches of 2 x 8 rows fit, but a step of 3 x 8 does not
    config = validate(apply_overrides(raw, ["data.tasks_per_step=3", "backend.verl.ppo_mini_batch_size=2"]))
    with pytest.raises(ConfigError, match=r"validate_config refused it: real_train_batch_size \(24\)"):
        check_verl_config(config)
    config = validate(apply_overrides(raw, ["backend.verl.log_prob_micro_batch_size_per_gpu=2"]))
    assert check_verl_config(config).actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 2


def test_the_replicas_parse_tool_calls_with_the_configured_parser() -> None:
    # before: engine_kwargs.vllm was {}, so vLLM answered tool_choice=auto with a 400 and left calls in the text
    raw, _ = _recipe()
    engine = check_verl_config(validate(raw)).actor_rollout_ref.rollout.engine_kwargs
    # verl's vLLM server passes these as `vllm serve` flags: --enable_auto_tool_choice --tool_call_parser hermes
    assert dict(engine.vllm) == {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}  # Qwen's default
    llama = validate(apply_overrides(raw, ["backend.verl.tool_call_parser=llama3_json"]))
    assert compose_verl_config(verl_overrides(llama)).actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser \
        == "llama3_json"
    sglang = validate(apply_overrides(raw, ["backend.verl.rollout_engine=sglang",
                                            "backend.verl.tool_call_parser=qwen25"]))
    engine = compose_verl_config(verl_overrides(sglang)).actor_rollout_ref.rollout.engine_kwargs
    assert dict(engine.sglang) == {"tool_call_parser": "qwen25"} and dict(engine.vllm) == {}
    none = validate(apply_overrides(raw, ["backend.verl.tool_call_parser=null"]))
    assert dict(compose_verl_config(verl_overrides(none)).actor_rollout_ref.rollout.engine_kwargs.vllm) == {}
    # the user's own overrides still win: they come last
    own = validate(apply_overrides(raw, ["backend.verl.overrides=[++actor_rollout_ref.rollout.engine_kwargs.vllm."
                                         "tool_call_parser=mistral]"]))
    assert compose_verl_config(verl_overrides(own)).actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser \
        == "mistral"


def test_a_lora_config_is_checked_where_verl_can_ask_vllm_for_its_ranks() -> None:
    # verl's validate_config rounds the LoRA rank up to one vLLM supports, importing vLLM to ask; without vLLM
    # it said "vllm version None not supported and SGLang also not Found": now one line naming the key and why
    config = validate(CONFIG)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"backend\.lora: verl checks the LoRA rank against the vLLM it runs, "
                                              r"and vllm is not installed here"):
            check_verl_config(config)
    else:
        assert check_verl_config(config).actor_rollout_ref.model.lora_rank == 16


def test_agl_train_check_runs_verls_own_checks(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from agl_trainer.train_cli import train

    raw, _ = _recipe()
    (tmp_path / "tasks.jsonl").write_text('{"q": 1}\n', encoding="utf-8")
    raw = {**raw, "data": {**raw["data"], "path": "tasks.jsonl"}, "agent": "agl_trainer.demo.lockers:solve"}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    config = str(tmp_path / "train.yaml")
    ok = CliRunner().invoke(train, [config, "--check"])
    assert ok.exit_code == 0 and "verl's validate_config passes it" in ok.output, ok.output
    # before: --check said "is valid", and verl refused the batch sizes in its Ray actor once the cluster was up
    bad = CliRunner().invoke(train, [config, "--check", "--set", "data.tasks_per_step=3", "--set",
                                     "backend.verl.ppo_mini_batch_size=2"])
    assert bad.exit_code == 2 and "validate_config refused it: real_train_batch_size (24)" in bad.output, bad.output
