"""vLLM beside the trainer: the torch backend trains a LoRA adapter, vLLM serves it, reloaded after every step.

A fake vLLM (``FakeOpenAI(enable_lora=True)``: vLLM's chat endpoint and its runtime LoRA endpoints,
``/v1/load_lora_adapter`` included, with vLLM's answers) is the only fake; ``agl train``'s run,
its server, gateway, workers, the torch backend and peft are the real ones. What a real vLLM
does with the adapter's weights (sampling from them) is the part a CPU cannot show.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_trainer.config import ConfigError, validate  # noqa: E402
from agl_trainer.train_cli import run_training  # noqa: E402
from agl_trainer.vllm_lora import VllmAdapters  # noqa: E402

from .test_engine import tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _policy(folder: Path) -> None:
    """A tiny Llama whose vocabulary holds the fake's token ids (its toy tokenizer's run up to 50010)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50_016, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)


def _config(tmp_path: Path, vllm: FakeOpenAI, **backend: Any) -> Any:
    (tmp_path / "tasks.jsonl").write_text('{"q": "yes or no?", "answer": "yes"}\n', encoding="utf-8")
    return validate({
        "data": {"path": "tasks.jsonl", "group_size": 4, "tasks_per_step": 1},
        "agent": "trainer_test_agents:solve",
        "backend": {"name": "torch", "model": "policy", "device": "cpu", "threads": 1, "lora": LORA,
                    "vllm": {"url": vllm.url}, **backend},
        "algorithm": {"lr": 5e-2, "max_prompt_length": 64, "max_response_length": 16},
        "workers": {"count": 2},
        "server": {"db": "agl.db"},
        "run": {"steps": 2, "dir": "out", "checkpoint_every": 2, "step_timeout_s": 60},
    }, base_dir=str(tmp_path))


_CALLS = itertools.count()


def _half_right(request: dict[str, Any]) -> str:
    return "yes" if next(_CALLS) % 2 == 0 else "no"  # each group of 4: two rewards of 1, two of 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_step_loads_the_adapter_just_trained_into_vllm_under_the_policys_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the agent's module, as a user's would be importable
    _policy(tmp_path / "policy")
    adapters = tmp_path / "out" / "adapters"
    (adapters / "v7").mkdir(parents=True)  # a run before this one's last adapter, and a file of the user's
    (adapters / "notes.txt").write_text("mine", encoding="utf-8")
    with FakeOpenAI(script=_half_right, enable_lora=True, model="base") as vllm:
        outcome = run_training(_config(tmp_path, vllm), progress=False)
        chats = [q.body for q in vllm.requests if q.path.endswith("/chat/completions")]
    assert [s["version"] for s in outcome.steps] == [2, 3] and all(s["rows"] > 0 for s in outcome.steps)
    loads = vllm.lora_loads
    # (the fake's logprobs are not the tiny model's: the run warns of a sampler/trainer mismatch, rightly)
    # the untrained adapter before the first rollout, then the one each step just wrote, before the next step's calls
    assert [(x.name, Path(x.path).name, x.calls_before) for x in loads] == \
        [("agl-policy", "v1", 0), ("agl-policy", "v2", 4), ("agl-policy", "v3", 8)]
    assert len({x.weights_sha256 for x in loads}) == 3  # each version's weights differ: the update moved them
    assert len(chats) == 8 and all(c["model"] == "agl-policy" for c in chats)  # the agent asked for gpt-4o-mini
    assert all(c["return_token_ids"] is True and c["logprobs"] is True for c in chats)
    # only the latest version stays on disk, and it is what was loaded last ...
    assert sorted(p.name for p in adapters.iterdir()) == ["notes.txt", "v3"]
    assert _sha256(adapters / "v3" / "adapter_model.safetensors") == loads[-1].weights_sha256
    # ... the trained adapters themselves: the checkpoint's LoRA weights after step 2, tensor for tensor
    loaded = safetensors_torch.load_file(str(adapters / "v3" / "adapter_model.safetensors"))
    trained = torch.load(tmp_path / "out" / "checkpoint" / "trainer.pt", weights_only=True)["model"]
    lora = {k.replace(".default", ""): v for k, v in trained.items() if "lora_" in k}
    assert sorted(loaded) == sorted(lora) and len(loaded) == 4
    assert all(torch.equal(loaded[k], lora[k]) for k in loaded)
    assert any(float(v.abs().sum()) > 0 for k, v in loaded.items() if "lora_B" in k)  # B starts at 0: it moved


def test_a_vllm_without_load_inplace_gets_the_adapter_unloaded_and_loaded_again(tmp_path: Path) -> None:
    for version in ("v0", "v1"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "adapter_config.json").write_text("{}", encoding="utf-8")
    with FakeOpenAI(enable_lora=True, lora_inplace=False) as vllm:
        adapters = VllmAdapters(vllm.url, "agl-policy")
        adapters.load(str(tmp_path / "v0"))
        adapters.load(str(tmp_path / "v1"))
        assert vllm.adapters == {"agl-policy": str(tmp_path / "v1")} and adapters.loaded == str(tmp_path / "v1")
        routes = [q.path for q in vllm.requests]
    assert routes == ["/v1/load_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                      "/v1/load_lora_adapter"]


def test_a_vllm_that_cannot_load_adapters_is_named_in_one_line(tmp_path: Path) -> None:
    with FakeOpenAI() as plain:  # `vllm serve` without VLLM_ALLOW_RUNTIME_LORA_UPDATING: no such route
        with pytest.raises(RuntimeError, match=r"has no /load_lora_adapter: start it with "
                                               r"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"):
            VllmAdapters(plain.url, "agl-policy").load(str(tmp_path))
    with FakeOpenAI(enable_lora=True) as vllm:  # a folder with no adapter in it
        with pytest.raises(RuntimeError, match=r"refused the adapter .* as 'agl-policy' \(400\): Loading lora "
                                               r"agl-policy failed: No adapter found"):
            VllmAdapters(vllm.url, "agl-policy").load(str(tmp_path))


def test_the_vllm_path_is_refused_where_it_cannot_work(tmp_path: Path) -> None:
    with FakeOpenAI(enable_lora=True) as vllm:
        with pytest.raises(ConfigError, match="backend.vllm: and server.url http://h:1 both name the model server"):
            validate({**_raw(tmp_path, vllm), "server": {"url": "http://h:1"}})
        _policy(tmp_path / "policy")
        full = _config(tmp_path, vllm, lora=None, lora_above_params=None)
        with pytest.raises(ConfigError, match="backend.lora: backend.vllm serves the policy as a LoRA adapter"):
            run_training(full, progress=False)
        assert vllm.lora_loads == []


def _raw(tmp_path: Path, vllm: FakeOpenAI) -> dict[str, Any]:
    return _config(tmp_path, vllm).model_dump(mode="json", exclude={"base_dir"})
