"""The text demo, reduced: a BPE tokenizer and a tiny Llama built in code, a teacher's traces, SFT, then GRPO.

What it checks, on the folders and stores the run leaves: the model folder round-trips through
``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``; every response (the teacher's, the SFT model's
and the policy's) is several tokens and ends with the end token, and the tool call's JSON reached the agent as
an OpenAI ``tool_calls`` (parsed by the engine behind the gateway); SFT raised the logprob of the teacher's
responses; the untrained model scores nothing, and RL raises the reward above what SFT alone scores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("langchain_openai")
pytest.importorskip("langgraph")

import agl_core as agl  # noqa: E402
from agl_trainer.demo.lockers import SYSTEM, TEXT_MAX_TOKENS, TEXT_TOOL_ERROR_REWARD, Lockers  # noqa: E402
from agl_trainer.demo.run import DemoOptions, run_demo  # noqa: E402
from agl_trainer.demo.textpolicy import (  # noqa: E402
    END,
    TEMPLATE,
    Teacher,
    build_text_model,
    build_text_tokenizer,
    tool_call_text,
)

STEPS = 18


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DemoOptions, Any]]:
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("text-demo")
    # the demo as it runs by default (4 lockers, groups of 8), cut to STEPS steps of RL that never stop early, one
    # rollout at a time: with several, which rollout's call reaches the engine's batch first decides what each one
    # samples, and the run differs from run to run (one in four of them collapsed); one at a time it is the same
    options = DemoOptions(folder=str(folder), steps=STEPS, minutes=5, target=2.0, progress=False,
                          checkpoint_every=STEPS, workers=1)
    yield options, run_demo(options)
    agl.uninstrument(["langchain"])  # the worker turned it on; the suite's other tests run without it


def responses(db: str, prefix: str = "") -> list[Any]:
    store = agl.SqliteStore(db)
    try:
        return [t for r in store.rollouts() if r.task_id.startswith(prefix)
                for t in store.transitions(rollout_id=r.id)]
    finally:
        store.close()


def parsed(t: Any) -> bool:
    return bool(t.response.get("tool_calls"))


def test_the_model_folder_round_trips_through_from_pretrained(demo: tuple[DemoOptions, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    options, _ = demo
    base = os.path.join(options.folder, "base-model")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and isinstance(model, LlamaForCausalLM)
    assert type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    assert tokenizer.eos_token == END and tokenizer.pad_token == "<pad>" and tokenizer.chat_template == TEMPLATE
    fresh = build_text_tokenizer(Lockers(options.lockers, options.seed), SYSTEM)
    assert tokenizer.get_vocab() == fresh.get_vocab()
    call = tool_call_text("unlock", {"code": "2"})
    ids = tokenizer.encode(call, add_special_tokens=False)
    assert ids == fresh.encode(call, add_special_tokens=False) and 10 <= len(ids) <= 30
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == call
    built = build_text_model(fresh, seed=options.seed, hidden=options.hidden).state_dict()
    assert all(torch.equal(built[k], v) for k, v in model.state_dict().items())
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    tuned = AutoModelForCausalLM.from_pretrained(os.path.join(options.folder, "sft-model")).state_dict()
    assert any(not torch.equal(tuned[k], v) for k, v in model.state_dict().items())


def test_every_response_is_several_tokens_ending_with_the_end_token(demo: tuple[DemoOptions, Any]) -> None:
    options, result = demo
    end = build_text_tokenizer(Lockers(options.lockers, options.seed), SYSTEM).eos_token_id
    taught = responses(os.path.join(options.folder, "teacher.db"), "teacher")
    tuned = responses(os.path.join(options.folder, "agl.db"))  # the SFT model's, then the policy's
    assert len(taught) >= 2 * options.teacher_runs * options.lockers and len(tuned) > STEPS * 32
    for t in taught:
        ids = list(t.response_token_ids or [])
        assert len(ids) >= 2 and ids[-1] == end, (t.rollout_id, ids, t.response)
    # the model's own replies: several tokens each, ending with the end token unless max_tokens cut them (a reply
    # sampled at temperature 1 can run on): rare, and each one priced as a wrong code (air.truncated), never free
    cut = 0
    for t in tuned:
        ids = list(t.response_token_ids or [])
        assert len(ids) >= 2, (t.rollout_id, ids, t.response)
        if ids[-1] != end:
            assert len(ids) == TEXT_MAX_TOKENS and t.finish_reason == "length", (t.rollout_id, ids, t.response)
            # the price alone, or with its call's outcome (a cut reply can still hold a whole call), at most 0
            priced = t.reward == TEXT_TOOL_ERROR_REWARD if not parsed(t) else t.reward is not None and t.reward <= 0
            assert priced, (t.rollout_id, t.reward, t.response)
            cut += 1
        else:
            assert t.finish_reason in ("stop", "tool_calls"), (t.rollout_id, t.finish_reason)
    assert cut <= 0.02 * len(tuned), (cut, len(tuned))
    for t in [*taught, *tuned]:
        calls = t.response.get("tool_calls") or []
        if calls:  # the JSON the model wrote, parsed into an OpenAI tool call before the agent saw it
            assert [c["function"]["name"] for c in calls] == ["unlock"], t.response
            assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict), t.response
    # the teacher's calls all parse (and leave no text behind); its other replies are plain answers
    assert all(not t.response.get("content") if parsed(t) else "<tool_call>" not in t.response["content"]
               for t in taught)
    assert sum(map(parsed, taught)) >= len(taught) // 2
    # the policy writes broken calls too (a -0.5, as a wrong code): few of them, once SFT has taught the format
    tried = [t for t in tuned if parsed(t) or "<tool_call>" in str(t.response.get("content") or "")]
    assert len(tried) >= len(tuned) // 3 and sum(map(parsed, tried)) >= 0.9 * len(tried)
    assert result.steps[-1]["prefix_mismatches"] == 0 and sum(s["merged"] for s in result.steps) > 0


def test_sft_raises_the_teachers_behaviour_and_rl_goes_beyond_it(demo: tuple[DemoOptions, Any]) -> None:
    options, result = demo
    warm = result.extra["warm"]
    assert warm["chance"]["reward"] <= 0.05 and warm["chance"]["tool_calls"] == 0  # the untrained model: noise
    s = warm["sft_stage"]
    assert s["examples"] > 0 and s["recorded"] == s["examples"]  # the gateway's exact ids, none re-rendered
    assert s["logprob_per_token_before"] < -3.0 and s["logprob_per_token_after"] > -0.3, s
    assert 0.35 <= warm["teacher"]["first_right"] / warm["teacher"]["first_tries"] <= 0.75
    assert warm["sft"]["reward"] > warm["chance"]["reward"] + 0.3  # SFT taught the format and the teacher's codes
    assert warm["sft"]["reward"] < DemoOptions().target - 0.05  # but not past the teacher's mix-ups
    steps = result.steps
    assert len(steps) == STEPS and result.weights_changed
    last = sum(x["reward"] for x in steps[-3:]) / 3
    assert last > warm["sft"]["reward"] + 0.08, ([round(x["reward"], 2) for x in steps], warm["sft"])
    with open(os.path.join(options.folder, "summary.md"), encoding="utf-8") as f:
        summary = f.read()
    assert "SFT alone: reward" in summary and "untrained model: reward" in summary


def test_a_written_tool_call_parses_and_renders_back_to_the_same_tokens() -> None:
    from agl_trainer.engine import _template_message, _tool_calls

    tokenizer = build_text_tokenizer(Lockers(4, 0), SYSTEM)
    tools = [{"type": "function", "function": {"name": "unlock", "parameters": {}}}]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is inside locker red"}]

    def render(msgs: list[dict[str, Any]]) -> list[int]:
        ids = tokenizer.apply_chat_template([_template_message(m) for m in msgs], tools=tools,
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    prompt = render(messages)
    wrote = [*tokenizer.encode(tool_call_text("unlock", {"code": "3"}), add_special_tokens=False),
             tokenizer.eos_token_id]
    assert len(wrote) > 10
    content, calls = _tool_calls(tokenizer.decode(wrote, skip_special_tokens=True))
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("unlock", {"code": "3"})]
    # the agent sends the call back (arguments as JSON text) with the tool's answer: the next prompt extends
    # this one token for token, so the gateway's trajectory rows merge the two calls
    after = render([*messages, {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "content": "inside is coin", "tool_call_id": calls[0]["id"]}])
    assert after[:len(prompt) + len(wrote)] == prompt + wrote


@pytest.mark.parametrize("order", ["locker by locker", "in turn"])
def test_the_teachers_right_first_share_holds_on_every_locker_for_every_seed(order: str) -> None:
    """SFT learns a locker's codes from the teacher's runs on it, and RL can only build on a right first try the
    SFT model ever samples: a locker whose teacher runs never tried the right code first gives RL nothing. A
    coin per try left that to chance (seed 2, its tasks queued locker by locker as the demo queues them: 0 of
    32 right first tries on blue); the teacher's shares now hold on each locker, whatever the seed or order."""
    runs = DemoOptions().teacher_runs
    for seed in range(12):
        lockers = Lockers(4, seed)
        teacher = Teacher(lockers.secret(), lockers.codes, right=0.2, known=0.9, seed=seed)
        asked = ([name for name in lockers.names for _ in range(runs)] if order == "locker by locker"
                 else [name for _ in range(runs) for name in lockers.names])
        right = dict.fromkeys(lockers.names, 0)
        for name in asked:
            call = teacher.reply([{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": f"what is inside locker {name}"}])
            right[name] += f'"code": "{lockers.secret()[name][0]}"' in call
        for name, n in right.items():
            share = 0.2 if name in teacher.mixed else 0.9
            assert abs(n - share * runs) <= 1, (seed, order, right)
        assert teacher.first_right == sum(right.values()) and teacher.first_tries == len(asked)
