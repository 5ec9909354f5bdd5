"""The demo's policy: a tiny Llama and a word-level tokenizer, built in code (no download, a few hundred kB).

The tokenizer knows the words of the demo's prompts, and has one token for each
whole tool call (``<tool_call>{"name": "unlock", "arguments": {"code": "3"}}</tool_call>``,
the Hermes/Qwen convention the torch engine parses into an OpenAI ``tool_calls``),
so choosing a tool argument is choosing one token. Its chat template renders an
assistant's tool call back into exactly that token, so a call's prompt extends the
previous call's prompt + response token for token (trajectory rows merge).

The model's output layer starts with a prior over the *action* tokens (the tool
calls and the answer words), as a pretrained model knows the format of a tool call
and of an answer. It knows nothing about which code opens which locker or what is
inside: at the start every action is about equally likely, and that is what RL
teaches it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["PolicySpec", "build_model", "build_tokenizer", "save_policy", "tool_call_text"]

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)

PRIOR = 8.0
"""Logit bias of the action tokens at the start: they hold all but ~0.1% of the probability."""


def tool_call_text(tool: str, arguments: dict[str, Any]) -> str:
    """A tool call as the chat template renders it (and as one token of the tokenizer)."""
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments}, ensure_ascii=False)}</tool_call>"


class PolicySpec:
    """The words and action tokens of a tiny policy."""

    def __init__(self, words: Sequence[str], tool_calls: Sequence[str], answers: Sequence[str]) -> None:
        self.words = list(dict.fromkeys([*words, *answers]))
        self.tool_calls = list(tool_calls)
        self.answers = list(answers)


def build_tokenizer(spec: PolicySpec) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over ``spec``'s words, one token per tool call."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", *spec.words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<pad>", additional_special_tokens=["<|im_start|>"])
    fast.add_tokens([AddedToken(call, special=False, normalized=False) for call in spec.tool_calls])
    fast.chat_template = TEMPLATE
    return fast


def build_model(tokenizer: Any, spec: PolicySpec, *, seed: int = 0, hidden: int = 64, layers: int = 2) -> Any:
    """A Llama of ``layers`` x ``hidden`` with the action prior in its output layer's bias."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    head = torch.nn.Linear(hidden, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        for token in [*spec.tool_calls, *spec.answers]:
            head.bias[tokenizer.convert_tokens_to_ids(token)] = PRIOR
    model.lm_head = head
    return model.eval()


def save_policy(folder: str | os.PathLike[str], lockers: Any, *, seed: int = 0, hidden: int = 64,
                layers: int = 2) -> str:
    """The demo's policy as a Hugging Face folder (model and tokenizer) that ``agl train`` and ``agl serve`` load.

    A Phi rather than :func:`build_model`'s Llama: Phi's output layer has a bias of its own, so
    the action prior survives ``save_pretrained`` / ``from_pretrained`` (Llama's head has none).
    """
    import torch
    from transformers import PhiConfig, PhiForCausalLM

    spec = PolicySpec(lockers.words(), [tool_call_text("unlock", {"code": c}) for c in lockers.codes],
                      lockers.things)
    tokenizer = build_tokenizer(spec)
    torch.manual_seed(seed)
    config = PhiConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=512,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    model = PhiForCausalLM(config)
    with torch.no_grad():
        model.lm_head.bias.zero_()
        for token in [*spec.tool_calls, *spec.answers]:
            model.lm_head.bias[tokenizer.convert_tokens_to_ids(token)] = PRIOR
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return os.fspath(folder)
