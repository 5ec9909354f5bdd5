"""The text demo's policy and its teacher: a byte-level BPE tokenizer and a tiny Llama built in code, saved as a
Hugging Face folder and loaded back the way users load a model; a scripted, imperfect teacher served by agl's
own torch engine.

**The tokenizer** is a byte-level BPE (the GPT-2 / Llama-3 / Qwen kind) trained here, with the ``tokenizers``
library, on a small corpus of the demo's own texts (its prompts, tool calls, tool answers and answers rendered
with the chat template), wrapped as a ``PreTrainedTokenizerFast`` with special tokens ``<|im_start|>``,
``<|im_end|>`` (the end token) and ``<pad>``, and ``<tool_call>`` / ``</tool_call>`` as added (not special)
tokens, so a decoded response keeps them. Its chat template is the ChatML / Hermes one: a tool call is
``<tool_call>{"name": "unlock", "arguments": {"code": "3"}}</tool_call>``, which the torch engine parses into an
OpenAI ``tool_calls``. A tool call is some twenty tokens, an answer two (the word and ``<|im_end|>``): the
model writes every byte of them.

**The model** is a randomly initialised Llama (2 layers, hidden 128, ~0.4M parameters): it writes noise until it
is taught. Both are written with ``save_pretrained`` and read back with ``AutoTokenizer.from_pretrained`` /
``AutoModelForCausalLM.from_pretrained`` (:func:`save_text_policy`, :func:`load_text_policy`), the path
``agl train``'s ``backend.model`` and ``agl serve`` take.

**The teacher** (:class:`TeacherEngine`) is a :class:`~agl_trainer.engine.TorchEngine` whose sampler is
replaced by a script: it reads the conversation and writes what a half-competent agent would, token by token
through the same engine, gateway and recording as the policy, so its calls are stored with their exact token
ids. It knows half of the lockers (the right code first in 90% of its runs on each) and mixes up the other half
with their neighbours (the right code first in 20% of its runs on each); after a wrong code it tries the right
one, and it always answers with what the tool said is inside.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agl_trainer.engine import TorchEngine

__all__ = ["END", "TEMPLATE", "Teacher", "TeacherEngine", "build_text_model", "build_text_tokenizer", "corpus",
           "load_text_policy", "save_text_policy", "tool_call_text"]

END = "<|im_end|>"
PAD = "<pad>"
START = "<|im_start|>"
OPEN, CLOSE = "<tool_call>", "</tool_call>"

TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t['function']['name'] }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with Hermes tool calls; the tool list is reduced to the tools' names (a tiny model's prompt stays short)."""

VOCAB_SIZE = 384
"""256 byte tokens, 3 special ones, the rest BPE merges learned from :func:`corpus` (the 2 tool-call tags come on
top)."""


def tool_call_text(tool: str, arguments: Mapping[str, Any]) -> str:
    """A tool call as the model writes it (and as the chat template renders it back)."""
    return f"{OPEN}{json.dumps({'name': tool, 'arguments': dict(arguments)}, ensure_ascii=False)}{CLOSE}"


def corpus(lockers: Any, system: str) -> list[str]:
    """The demo's own texts: every question, tool call, tool answer and answer, rendered as chat turns."""
    texts = []
    for name in lockers.names:
        for code in lockers.codes:
            for thing in lockers.things:
                texts.append(
                    f"{START}system\n{system}{END}\n{START}user\nwhat is inside locker {name}{END}\n"
                    f"{START}assistant\n{tool_call_text('unlock', {'code': code})}{END}\n"
                    f"{START}tool\nwrong code{END}\n{START}tool\nalready open{END}\n"
                    f"{START}tool\ninside is {thing}{END}\n{START}assistant\n{thing}{END}\n")
    return texts


def build_text_tokenizer(lockers: Any, system: str, *, vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on :func:`corpus`, with the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, START, END]
    added = [OPEN, CLOSE]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # the tags are whole tokens of their own (added below, not special): no merges are spent on their letters
    texts = [t.replace(OPEN, " ").replace(CLOSE, " ") for t in corpus(lockers, system)]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, pad_token=PAD,
                                   additional_special_tokens=[START])
    # the tool-call tags are plain added tokens: decoding with skip_special_tokens keeps them, so they parse
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast.chat_template = TEMPLATE
    return fast


def build_text_model(tokenizer: Any, *, seed: int = 0, hidden: int = 64, layers: int = 2) -> Any:
    """A randomly initialised Llama of ``layers`` x ``hidden`` over ``tokenizer``'s vocabulary."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model.eval()


def save_text_policy(folder: str | os.PathLike[str], lockers: Any, system: str, *, seed: int = 0,
                     hidden: int = 64, layers: int = 2) -> str:
    """Train the tokenizer, build the model, write both as a Hugging Face folder; its path."""
    tokenizer = build_text_tokenizer(lockers, system)
    model = build_text_model(tokenizer, seed=seed, hidden=hidden, layers=layers)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return os.fspath(folder)


def load_text_policy(folder: str | os.PathLike[str]) -> tuple[Any, Any]:
    """``(model, tokenizer)`` read back through the Auto classes, as a user's model folder is read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


# --------------------------------------------------------------------------- the teacher

_LOCKER = re.compile(r"locker (\w+)")
_INSIDE = re.compile(r"inside is (\w+)")


class Teacher:
    """A scripted agent model that knows the lockers but mixes up half of them.

    On a locker it knows (``red``, ``green``, ...: every other one) it tries the right code first in a share
    ``known`` of its runs, else a random wrong one. Each of the others it mixes up with the locker before it:
    it tries that locker's code first, and the right one in a share ``right`` of its runs. After a wrong code
    it tries the right one; it answers with what the tool said is inside. The mix-up is systematic, so SFT
    learns it (a uniform random mistake would teach the model nothing about which code goes with which
    locker); the teacher's right first tries on those lockers are what RL has to build on.

    The shares hold on every locker for every seed: the k-th first try on a locker is right when
    ``floor((k + 1) * share + phase)`` passes ``floor(k * share + phase)``, the phase drawn per locker from
    ``seed``, so 32 runs at 0.2 have 6 or 7 right first tries on each mixed-up locker, in an order the seed
    decides. A coin per try left that to chance: seed 2's teacher tried one locker's right code first in 0 of
    its 32 runs (a 1-in-1,300 draw), SFT learnt that it never does, and RL never sampled the right code first
    on it, so it had nothing to learn from and stalled short of the target.
    """

    def __init__(self, secret: Mapping[str, tuple[str, str]], codes: Sequence[str], *, right: float = 0.2,
                 known: float = 0.9, seed: int = 0) -> None:
        self.secret = dict(secret)
        self.codes = list(codes)
        names = list(self.secret)
        self.mixed = {names[i]: names[i - 1] for i in range(1, len(names), 2)}
        """Locker -> the locker whose code the teacher tries first on it."""
        self.right = right
        self.known = known
        self.rng = random.Random(seed)
        self._phase = {name: self.rng.random() for name in names}
        self._tries: dict[str, int] = {}
        """Locker -> its first tries so far."""
        self.first_tries = 0
        self.first_right = 0

    def _right_first(self, locker: str, share: float) -> bool:
        """Whether this first try on ``locker`` is the right code: a share ``share`` of them, spread evenly."""
        k = self._tries.get(locker, 0)
        self._tries[locker] = k + 1
        phase = self._phase[locker]
        return math.floor((k + 1) * share + phase) > math.floor(k * share + phase)

    def reply(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """What the teacher writes next in this conversation (its text, without the end token)."""
        asked = next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")
        found = _LOCKER.search(asked)
        locker = found.group(1) if found and found.group(1) in self.secret else next(iter(self.secret))
        code = self.secret[locker][0]
        tools = [str(m.get("content") or "") for m in messages if m.get("role") == "tool"]
        if tools and (inside := _INSIDE.search(tools[-1])):
            return inside.group(1)  # the answer: what the tool said is inside
        if not tools:
            self.first_tries += 1
            if locker in self.mixed:
                if not self._right_first(locker, self.right):
                    code = self.secret[self.mixed[locker]][0]
            elif not self._right_first(locker, self.known):
                code = self.rng.choice([c for c in self.codes if c != code])
            self.first_right += code == self.secret[locker][0]
        return tool_call_text("unlock", {"code": code})


class TeacherEngine(TorchEngine):
    """The torch engine with :class:`Teacher` choosing every token: the teacher's calls go through agl exactly as
    the policy's do (chat template, batching, tool-call parsing, the gateway's token records)."""

    def __init__(self, model: Any, tokenizer: Any, teacher: Teacher, **kwargs: Any) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self.teacher = teacher
        self.scripted = True
        """False: the engine samples from its model as the plain engine does (the untrained model's reward)."""

    def _rows(self, endpoint: Any, body: dict[str, Any]) -> Any:
        rows, prompt_ids = super()._rows(endpoint, body)
        for row in rows:
            row.plan = None
            if not self.scripted:
                continue
            text = self.teacher.reply(body.get("messages") or [])
            row.plan = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return rows, prompt_ids

    def _sample(self, logits: Any, row: Any, generator: Any) -> tuple[int, float]:
        plan: list[int] | None = row.plan
        if plan is None:
            return super()._sample(logits, row, generator)
        token = plan[len(row.ids)] if len(row.ids) < len(plan) else int(self.tokenizer.eos_token_id)
        return token, float(self.torch.log_softmax(logits, dim=-1)[token])
