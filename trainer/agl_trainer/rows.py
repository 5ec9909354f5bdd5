"""Training rows from scored rollouts: token ids, a loss mask, the sampling logprobs and per-token advantages.

Two modes:

- ``"transition"``: one row per LLM call, ``prompt + response``, the loss on the response.
- ``"trajectory"``: consecutive calls of a rollout merged into one row when the next
  call's prompt token ids start with the previous prompt + response (what a chat
  template gives when the agent appends the reply and a tool result and calls again).
  The tokens between (the tool's result, the environment's turn, the template's
  separators) are in the row as context but out of the loss; each response keeps its
  own transition's advantage. Where the next prompt does not extend the sequence (the
  agent rewrote its history, the template re-tokenises the reply differently, another
  agent's call), a new row starts and the mismatch is counted in :class:`RowStats`,
  so a trainer can tell when merging is not buying anything.

Every response token of a rollout carries the rollout's advantage for its step, and
its weight: the rollout's one unit of loss weight spread over all its response tokens
(in every row of it), so a rollout counts once however many calls and tokens it made.

Lengths: with ``max_prompt_length`` a row's prompt (the tokens before its first
response token) keeps its last ``max_prompt_length`` tokens, the most recent context;
with ``max_response_length`` everything after the prompt (responses and the tool tokens
between them) is cut at that length, and the loss tokens beyond it are dropped. In
trajectory mode a call that would push the merged row past ``max_response_length``
starts a new row instead, so merging never costs loss tokens that a row of their own
would keep. Each row cut is counted (:attr:`RowStats.truncated_rows`), and the rollout's
unit of loss weight is spread over the loss tokens that are left. A row whose prompt was
cut loses its recorded logprobs (``old_logprobs`` None, counted in
:attr:`RowStats.recomputed_logprobs`): the gateway computed them with the context the cut
removed, so the backend recomputes them on the row as it is trained, and the first-pass
importance ratio stays 1. Cutting the end changes no kept token's logprob.

Transitions without token ids (no gateway in front of the model, and no ids in the
response) cannot be trained on and are counted, not guessed; transitions without
logprobs are kept, and the backend computes their sampling logprobs from the current
weights before the update (``Row.old_logprobs`` is None).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from agl_core.schema import Transition
from agl_trainer.advantages import ScoredRollout

__all__ = ["Row", "RowMode", "RowStats", "build_rows"]

RowMode = Literal["transition", "trajectory"]


@dataclass
class Row:
    """One training sequence; every list but ``input_ids``' own is aligned with ``input_ids``."""

    rollout_id: str
    group: str
    input_ids: list[int]
    loss_mask: list[int]
    """1 on tokens the policy sampled (trained on); 0 on prompt, tool and environment tokens."""
    advantages: list[float]
    """The advantage of each loss token (0 elsewhere)."""
    token_weights: list[float]
    """Each loss token's share of its rollout's loss weight (0 elsewhere)."""
    old_logprobs: list[float] | None
    """The sampling policy's logprob of each loss token (0 elsewhere); None: not recorded, recompute."""
    transitions: int = 1
    prompt_len: int = 0
    """Tokens before the first response token (the first call's prompt)."""
    reward: float = 0.0
    """The credited reward of the row's first call (in transition rows: its call's), for trainers that compute
    advantages themselves (verl's GRPO); with ``final`` credit, the rollout's return."""

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class RowStats:
    """What row building did with a batch of transitions."""

    transitions: int = 0
    rows: int = 0
    rollouts: int = 0
    merged: int = 0
    """Transitions appended to the row of the call before them (trajectory mode)."""
    prefix_mismatches: int = 0
    """Trajectory mode: a call whose prompt did not extend the previous call's prompt + response."""
    no_token_ids: int = 0
    no_logprobs: int = 0
    truncated_rows: int = 0
    """Rows cut to ``max_prompt_length`` / ``max_response_length`` (either or both)."""
    truncated_prompts: int = 0
    truncated_responses: int = 0
    recomputed_logprobs: int = 0
    """Rows whose prompt was cut: their recorded logprobs saw the lost context, so the backend recomputes them."""
    dropped_loss_tokens: int = 0
    """Response tokens cut off the end of a row: sampled, but not trained on."""
    length_splits: int = 0
    """Trajectory mode: a call that started a new row because the merged one would pass ``max_response_length``."""
    tokens: int = 0
    loss_tokens: int = 0
    token_sources: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


class _Open:
    """A row being built."""

    def __init__(self, scored: ScoredRollout, t: Transition, advantage: float, credited: float) -> None:
        prompt = list(t.prompt_token_ids or [])
        response = list(t.response_token_ids or [])
        self.ids = prompt + response
        self.mask = [0] * len(prompt) + [1] * len(response)
        self.adv = [0.0] * len(prompt) + [advantage] * len(response)
        self.lp: list[float] | None = [0.0] * len(prompt) + list(t.response_logprobs) \
            if t.response_logprobs is not None else None
        self.transitions = 1
        self.prompt_len = len(prompt)
        self.scored = scored
        self.credited = credited

    def extends(self, t: Transition) -> bool:
        prompt = t.prompt_token_ids or []
        return len(prompt) >= len(self.ids) and prompt[:len(self.ids)] == self.ids

    def response_length_with(self, t: Transition) -> int:
        """The response part's length (after the first prompt) once ``t`` is appended."""
        return len(t.prompt_token_ids or []) + len(t.response_token_ids or []) - self.prompt_len

    def truncate(self, max_prompt: int | None, max_response: int | None, stats: RowStats) -> None:
        cut = False
        if max_prompt is not None and self.prompt_len > max_prompt:
            drop = self.prompt_len - max_prompt
            self.ids, self.mask, self.adv = self.ids[drop:], self.mask[drop:], self.adv[drop:]
            if self.lp is not None:
                self.lp = None  # recorded with the context just cut: not the logprobs of this row
                stats.recomputed_logprobs += 1
            self.prompt_len = max_prompt
            stats.truncated_prompts += 1
            cut = True
        if max_response is not None and len(self.ids) - self.prompt_len > max_response:
            end = self.prompt_len + max_response
            stats.dropped_loss_tokens += sum(self.mask[end:])
            self.ids, self.mask, self.adv = self.ids[:end], self.mask[:end], self.adv[:end]
            if self.lp is not None:
                self.lp = self.lp[:end]
            stats.truncated_responses += 1
            cut = True
        stats.truncated_rows += cut

    def append(self, t: Transition, advantage: float) -> None:
        prompt = list(t.prompt_token_ids or [])
        response = list(t.response_token_ids or [])
        between = prompt[len(self.ids):]
        self.ids += between + response
        self.mask += [0] * len(between) + [1] * len(response)
        self.adv += [0.0] * len(between) + [advantage] * len(response)
        if self.lp is not None and t.response_logprobs is not None:
            self.lp += [0.0] * len(between) + list(t.response_logprobs)
        else:
            self.lp = None
        self.transitions += 1


def build_rows(scored: Iterable[ScoredRollout], mode: RowMode = "transition", *,
               max_prompt_length: int | None = None, max_response_length: int | None = None
               ) -> tuple[list[Row], RowStats]:
    """The rows of a batch of scored rollouts, and what was merged, cut, skipped and counted on the way."""
    if mode not in ("transition", "trajectory"):
        raise ValueError(f"mode must be 'transition' or 'trajectory', got {mode!r}")
    for name, value in (("max_prompt_length", max_prompt_length), ("max_response_length", max_response_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    stats = RowStats()
    rows: list[Row] = []
    for item in scored:
        built = _rows_of(item, mode, stats, max_response_length)
        for o in built:
            o.truncate(max_prompt_length, max_response_length, stats)
        built = [o for o in built if sum(o.mask)]
        if not built:
            continue
        stats.rollouts += 1
        loss_tokens = sum(sum(o.mask) for o in built)
        share = item.weight / loss_tokens if loss_tokens else 0.0
        for o in built:
            rows.append(Row(
                rollout_id=item.rollout_id, group=item.group, input_ids=o.ids, loss_mask=o.mask, advantages=o.adv,
                token_weights=[share * m for m in o.mask], old_logprobs=o.lp, transitions=o.transitions,
                prompt_len=o.prompt_len, reward=o.credited))
            stats.tokens += len(o.ids)
            stats.loss_tokens += sum(o.mask)
    stats.rows = len(rows)
    return rows, stats


def _rows_of(item: ScoredRollout, mode: RowMode, stats: RowStats, max_response: int | None) -> list[_Open]:
    built: list[_Open] = []
    current: _Open | None = None
    transitions: Sequence[Transition] = item.trajectory.transitions
    for t, advantage, credited in zip(transitions, item.advantages, item.credited, strict=True):
        stats.transitions += 1
        source = str(t.token_source)
        stats.token_sources[source] = stats.token_sources.get(source, 0) + 1
        if t.prompt_token_ids is None or not t.response_token_ids:
            stats.no_token_ids += 1
            current = None  # the sequence is broken: what follows cannot extend it
            continue
        if t.response_logprobs is None:
            stats.no_logprobs += 1
        if mode == "trajectory" and current is not None:
            if current.extends(t):
                if max_response is None or current.response_length_with(t) <= max_response:
                    current.append(t, advantage)
                    stats.merged += 1
                    continue
                stats.length_splits += 1
            else:
                stats.prefix_mismatches += 1
        current = _Open(item, t, advantage, credited)
        built.append(current)
    return built
