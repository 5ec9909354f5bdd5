"""``agl train config.yaml``: the typed training config, and errors that say which key is wrong and what it takes.

A config is a YAML (or JSON) mapping of sections; every key has a default but
``data.path``, ``agent`` and ``backend.model``::

    data:
      path: tasks.jsonl          # one task (a JSON value the agent understands) per line, or a JSON list
      group_size: 8              # rollouts per task per step: one GRPO group
      tasks_per_step: 4
    agent: my_pkg.agent:solve    # an @agl.rollout_fn (a plain function is wrapped in one)
    backend:
      name: torch                # torch (built in, one machine) | verl (a Ray cluster of GPUs)
      model: ./my-hf-model       # a Hugging Face causal LM folder
      device: cpu
      lora: {r: 8, alpha: 16}    # optional; needs peft (the default above lora_above_params: docs/memory.md)
    algorithm:
      name: grpo                 # grpo | apo (a prompt resource searched for instead: the apo section, docs/apo.md)
                                 # | sft | rft (fine-tuning on stored or sampled calls: the sft section, docs/sft.md)
      clip_epsilon: 0.2
      kl_coef: 0.0
      lr: 1.0e-5
      row_mode: trajectory       # transition | trajectory
      max_prompt_length: 4096
      max_response_length: 1024
    credit:
      method: final              # final | discounted | custom
      gamma: 1.0
    agent_match: "writer|rewriter"  # a regex searched in the agent name ("write": write_query and rewrite_query)
    policies:                    # instead of agent_match: several policies, each agent role its own LoRA adapter
      writer: {agents: "writer|rewriter", lora: {r: 16}}   # (docs/multi-policy.md; lora: backend.lora's default)
      checker: {agents: "checker", credit: {method: discounted, gamma: 0}}   # credit: its own; default the run's
      judge: {agents: "judge", model: ./judge-model}   # a model of its own: fully fine-tuned (or its own lora)
    air: {tool_error: -0.1, tool_exception: -0.1}   # custom: my_pkg.rewards:tool_said_error, (span) -> reward | None
    workers: {count: 4}          # or {count: 8, ray: "auto"}; count 0: run `agl worker` yourself
    server: {host: 127.0.0.1, port: 0, db: agl.db}    # or {url: "http://host:8000", token: ...}
    run: {steps: 100, dir: agl-train}
    validation:                  # optional: a held-out set, run at the start and every N steps, never trained on
      path: val.jsonl
      every: 10
      sampling: {temperature: 0.0}   # the gateway samples validation calls so (greedy by default)
    resources: {system_prompt: "You are ..."}   # what the agent reads (agl.resources()); apo's first prompt
    apo: {optimizer: {base_url: ..., model: ...}, beam_width: 2, rounds: 3}   # algorithm.name: apo (docs/apo.md)

Relative paths (``data.path``, ``validation.path``, ``backend.model``, ``server.db``, ``run.dir``, ...) are
taken from the config file's folder. ``--set a.b=c`` overrides one key (the value is
read as a YAML scalar: ``--set algorithm.lr=3e-4``, ``--set backend.lora=null``).

Every problem is a :class:`ConfigError` whose message names the key by its dotted
path and, where the choices are few, lists them::

    config error: algorithm.row_mode: 'rows' is not one of: transition, trajectory
    config error: algorithm.rowmode: unknown key (did you mean row_mode?); allowed: clip_epsilon, ...

and :func:`load_config` raises it before anything starts: the data file is read,
the model folder and the agent's module are looked up, and nothing is built.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError

__all__ = [
    "AirConfig", "AlgorithmConfig", "ApoConfig", "ApoOptimizerConfig", "BackendConfig", "Config", "ConfigError",
    "CreditConfig", "DataConfig",
    "LoraConfig", "RunConfig", "ServerSection", "SftConfig", "ValidationConfig", "ValidationSampling", "VerlConfig",
    "VllmLoraConfig", "WorkersConfig", "apply_overrides", "code_builder", "load_config", "load_tasks",
    "load_validation_tasks", "transition_builder",
]


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    return value


Int = Annotated[int, Strict()]
Float = Annotated[float, BeforeValidator(_no_bool)]
Bool = Annotated[bool, Strict()]
PosInt = Annotated[int, Strict(), Field(gt=0)]

_AGENT = r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$"
_DEVICE = r"^(cpu|cuda(:\d+)?|mps)$"
_PATTERN_HINTS = {_AGENT: "must look like pkg.module:function", _DEVICE: "is not one of: cpu, cuda, cuda:N, mps"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    """The data set: which tasks, how many at a time, how many rollouts of each."""

    path: str
    """A JSONL file (one task per line) or a JSON file holding a list of tasks."""
    group_size: PosInt = 8
    tasks_per_step: PosInt = 4


class LoraConfig(_Section):
    r: PosInt = 8
    alpha: PosInt = 16
    dropout: Annotated[Float, Field(ge=0.0, lt=1.0)] = 0.0
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class CreditConfig(_Section):
    method: Literal["final", "discounted", "custom"] = "final"
    gamma: Annotated[Float, Field(ge=0.0, le=1.0)] = 1.0
    function: Annotated[str, Field(pattern=_AGENT)] | None = None
    """With ``method: custom``: ``pkg.module:fn``, ``fn(rewards, final) -> list[float | None]``."""


class PolicyConfig(_Section):
    """One of several policies (``policies: {NAME: ...}``): the agents it serves and trains, its LoRA adapter."""

    agents: Annotated[str, Field(min_length=1)]
    """Regex searched in the agent name, as ``agent_match`` (the first policy in order that matches serves it)."""
    lora: LoraConfig | None = None
    """This policy's adapter; None: ``backend.lora``, else the defaults. With ``model``: that model's LoRA; None:
    it is fully fine-tuned (``backend.lora_above_params`` still applies)."""
    model: str | None = None
    """A model of its own (a Hugging Face model folder, as ``backend.model``), trained and served apart from the
    base; None: an adapter on ``backend.model`` (docs/multi-policy.md)."""
    lr: Annotated[float, Field(gt=0)] | None = None
    """This policy's learning rate; None: ``algorithm.lr`` (a fully fine-tuned model often wants a lower one)."""
    credit: CreditConfig | None = None
    """How this policy's calls are credited from the run's rewards (``method``, ``gamma``, ``function`` as the
    run's ``credit``), over every call of the run in order; None: the run's ``credit`` (every policy gets the
    run's credited rewards for its calls). ``{method: discounted, gamma: 0}``: each call its own reward."""


class VerlConfig(_Section):
    """verl's side, with ``backend.name: verl`` (see docs/verl.md)."""

    ray_address: str | None = None
    """The Ray cluster (``ray.init`` address; None: ``RAY_ADDRESS`` or a local one)."""
    gateway_host: str | None = None
    """The address agl's workers on every node reach its gateway at (None: Ray's address of the node it runs on)."""
    nnodes: PosInt = 1
    n_gpus_per_node: PosInt = 8
    rollout_engine: Literal["vllm", "sglang"] = "vllm"
    tensor_parallel_size: PosInt = 1
    gpu_memory_utilization: Annotated[Float, Field(gt=0.0, le=1.0)] = 0.6
    tool_call_parser: str | None = "hermes"
    """The replicas' parser of the model's tool calls, in the engine's own names (vLLM's ``--tool-call-parser``:
    hermes for Qwen2.5/Qwen3 and Hermes, llama3_json for Llama 3.1+, mistral, ...); null: no tool calls parsed."""
    ppo_mini_batch_size: PosInt = 16
    """Tasks per mini-batch (x ``data.group_size`` rows); a step of fewer tasks is one mini-batch of them all."""
    ppo_micro_batch_size_per_gpu: PosInt = 4
    log_prob_micro_batch_size_per_gpu: PosInt | None = None
    """Rows per GPU in one forward of the old and the reference logprobs (None: ``ppo_micro_batch_size_per_gpu``)."""
    advantages: Literal["agl", "grpo", "rloo"] = "agl"
    """agl: agl's per-rollout group advantages (LightningRL); grpo/rloo: verl's estimators on the scores."""
    overrides: list[str] = Field(default_factory=list)
    """More of verl's own config, as its Hydra overrides (``trainer.val_before_train=false``), passed as given."""


class VllmLoraConfig(_Section):
    """``vllm serve BASE --enable-lora`` beside the torch backend: rollouts on vLLM, the adapter trained here."""

    url: str
    """vLLM's OpenAI base URL (``http://127.0.0.1:8000/v1``); it serves ``backend.model`` as its base."""
    api_key: str | None = None
    """vLLM's ``--api-key``, when it was started with one."""
    lora_name: Annotated[str, Field(min_length=1)] = "agl-policy"
    """The name vLLM serves the trained adapter under: every call through the gateway asks for it."""
    adapters_dir: str | None = None
    """Where each version's adapter is written for vLLM to read at the same path (default ``<run.dir>/adapters``)."""


class BackendConfig(_Section):
    name: Literal["torch", "verl"] = "torch"
    model: str
    """A Hugging Face causal LM: a local folder (torch); a folder or hub name on the cluster (verl)."""
    device: Annotated[str, Field(pattern=_DEVICE)] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None
    lora_above_params: PosInt | None = 1_000_000_000
    """A model with more parameters than this and no ``lora`` trains LoRA adapters (docs/memory.md); null: never."""
    gradient_checkpointing: bool = True
    """Recompute each decoder layer in the backward pass instead of keeping its activations."""
    epochs: PosInt = 1
    minibatches: PosInt = 1
    max_tokens_per_forward: PosInt = 16384
    logit_chunk_tokens: PosInt = 512
    """Positions projected onto the vocabulary at a time for logprobs and entropy (docs/memory.md)."""
    threads: PosInt | None = None
    """torch CPU threads (None: torch's default)."""
    max_batch: PosInt = 8
    """The built-in engine's most sequences per batch."""
    verl: VerlConfig = Field(default_factory=VerlConfig)
    vllm: VllmLoraConfig | None = None
    """With ``name: torch``: rollouts on this vLLM server, the LoRA adapter trained here hot-loaded after each step."""


class AlgorithmConfig(_Section):
    name: Literal["grpo", "apo", "sft", "rft"] = "grpo"
    """grpo: LightningRL on the model's weights; apo: beam search over a prompt resource (``apo`` section,
    docs/apo.md), no weights trained; sft: fine-tune on stored transitions (the ``sft`` section); rft: rounds of
    sampling ``data.group_size`` per task, keeping the best, SFT on them (docs/sft.md)."""
    clip_epsilon: Annotated[Float, Field(gt=0.0, lt=1.0)] = 0.2
    clip_epsilon_high: Annotated[Float, Field(gt=0.0)] | None = None
    """The ratio's upper clip (DAPO's clip-higher); None: ``clip_epsilon``."""
    kl_coef: Annotated[Float, Field(ge=0.0)] = 0.0
    lr: Annotated[Float, Field(gt=0.0)] = 1e-5
    weight_decay: Annotated[Float, Field(ge=0.0)] = 0.0
    max_grad_norm: Annotated[Float, Field(gt=0.0)] | None = 1.0
    row_mode: Literal["transition", "trajectory"] = "trajectory"
    max_prompt_length: PosInt | None = None
    max_response_length: PosInt | None = None
    scale_advantages: Bool = True
    """Divide by the group's std (GRPO); false: only the mean is taken away (Dr. GRPO)."""
    temperature: Annotated[Float, Field(gt=0.0)] | None = 1.0
    """The temperature the policy samples at: the gateway enforces it (with no top_p/top_k cut) and the trainer
    computes its logprobs at it, so the recorded logprobs and the trained ones are of one distribution."""


class SftConfig(_Section):
    """What ``algorithm.name: sft`` trains on, and how (docs/sft.md); ``rft`` keeps its samples by ``min_reward``."""

    data: str | None = None
    """The store to read: a SQLite file (``runs.db``) or an ``agl serve`` URL; None: this run's ``server.db``."""
    min_reward: Float | None = None
    """sft: only transitions whose credited reward is at least this; rft: a task's best rollout is kept only if its
    final reward is at least this. A transition or rollout without a reward never passes."""
    agent: str | None = None
    """A regex searched in the agent name (as ``agl export --agent``); None: ``agent_match``."""
    task_ids: list[str] | None = None
    """sft: only these tasks' rollouts (None: every task)."""
    status: list[Literal["running", "succeeded", "failed", "timeout", "cancelled"]] = \
        Field(default_factory=lambda: ["succeeded"])
    """sft: only rollouts with one of these statuses (empty: any)."""
    epochs: PosInt = 1
    """Passes over the selected examples (per round, with rft)."""
    batch_size: PosInt = 8
    """Sequences per optimizer step."""


class AirConfig(_Section):
    """Automatic intermediate rewards: system signal -> reward (``agl.AirRules``); null: no reward."""

    tool_ok: Float | None = None
    tool_error: Float | None = None
    tool_exception: Float | None = None
    tool_timeout: Float | None = None
    tool_rejected: Float | None = None
    malformed_tool_call: Float | None = None
    truncated: Float | None = None
    """A reply ``max_tokens`` cut off (finish reason ``length``); in place of ``malformed_tool_call`` for a call it
    broke."""
    custom: Annotated[str, Field(pattern=_AGENT)] | None = None
    """``pkg.module:function``, ``function(span) -> reward | None``, called with every tool span (a tool that
    reports failure as an ``"Error: ..."`` string with an ok status is the usual case)."""


class WorkersConfig(_Section):
    count: Annotated[int, Strict(), Field(ge=0)] = 4
    """Rollouts at a time (threads here, or Ray actors); 0: none started, run ``agl worker`` yourself."""
    ray: str | None = None
    """A Ray address (``auto``, ``ray://host:10001``; ``local`` starts one here): workers as Ray actors."""
    actor_cpus: Annotated[Float, Field(gt=0.0)] = 1.0


class ServerSection(_Section):
    url: str | None = None
    """An ``agl serve`` already running: train against it over HTTP. None: start one in this process."""
    host: str = "127.0.0.1"
    port: Annotated[int, Strict(), Field(ge=0, le=65535)] = 0
    db: str = "agl.db"
    token: str | None = None
    """Bearer token (default ``$AGL_TOKEN``); required when ``host`` is not a loopback address."""
    weights_dir: str | None = None
    """With ``url``: where new weights are written for the server to load (default ``<run.dir>/weights``)."""
    max_attempts: PosInt = 2
    lease_timeout_s: Annotated[Float, Field(gt=0.0)] = 600.0
    upstreams: dict[str, Annotated[str, Field(pattern=r"^https?://")]] = Field(default_factory=dict)
    """Frozen models by name, ``{judge: http://host:port/v1}``: the gateway relays their calls there, untrained."""


class RunConfig(_Section):
    steps: PosInt = 100
    dir: str = "agl-train"
    """Checkpoint, curves and summary go here."""
    checkpoint_every: PosInt = 10
    step_timeout_s: Annotated[Float, Field(gt=0.0)] = 600.0
    seed: Int = 0
    resume: Bool = True
    """Continue from the checkpoint in ``dir`` when there is one."""


class ValidationSampling(_Section):
    """How validation calls sample: the gateway puts these in place of the training run's sampling while a
    validation runs (fields left null are the agent's own)."""

    temperature: Annotated[Float, Field(ge=0.0)] = 0.0
    """0: greedy, so a validation reward moves only when the policy does."""
    top_p: Annotated[Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Int | None = None
    max_tokens: PosInt | None = None
    seed: Int | None = None

    def overrides(self) -> dict[str, Any]:
        """The gateway's ``sampling_overrides`` during a validation."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ValidationConfig(_Section):
    """A held-out data set, run through the same agent and workers but never trained on."""

    path: str
    """A JSONL or JSON file of tasks, as ``data.path``."""
    every: PosInt = 10
    """Run after every this many training steps (and after the last step)."""
    at_start: Bool = True
    """Run once before the first step, so the curve starts from the untrained policy."""
    repeat: PosInt = 1
    """Rollouts per task."""
    max_tasks: PosInt | None = None
    """Only the first this many tasks of the file (None: all)."""
    sampling: ValidationSampling = Field(default_factory=ValidationSampling)


class ApoOptimizerConfig(_Section):
    """The model that critiques and edits the prompt: any OpenAI-compatible chat endpoint."""

    base_url: Annotated[str, Field(pattern=r"^https?://")]
    """Its OpenAI base URL, ending in ``/v1``."""
    model: Annotated[str, Field(min_length=1)]
    api_key_env: str | None = None
    """The environment variable holding its API key (None: no key sent)."""
    temperature: Annotated[Float, Field(ge=0.0)] = 1.0
    max_tokens: PosInt = 1024
    """Most tokens of one reply (also capped at what ``apo.max_optimizer_tokens`` leaves)."""
    timeout_s: Annotated[Float, Field(gt=0.0)] = 120.0
    retries: Annotated[int, Strict(), Field(ge=0)] = 3
    """Tries after the first of a failed call (unreachable, 429, 5xx, unreadable reply), then reported."""
    backoff_s: Annotated[Float, Field(ge=0.0)] = 1.0
    """Wait before the first retry; doubled each time."""


class ApoConfig(_Section):
    """``algorithm.name: apo``: beam search over versions of one prompt resource (docs/apo.md)."""

    resource: Annotated[str, Field(min_length=1)] = "system_prompt"
    """The resource optimised; its first value is ``resources.<resource>``."""
    optimizer: ApoOptimizerConfig
    beam_width: PosInt = 2
    edits_per_candidate: PosInt = 2
    """Edited prompts asked for per beam candidate and round (one optimiser call each, after its critique)."""
    batch_size: PosInt = 4
    """Training tasks each candidate runs per round (the next ones of ``data.path``); their failures are critiqued."""
    success_reward: Float = 1.0
    """A rollout whose final reward is below this is a failure the optimiser sees."""
    max_examples: PosInt = 3
    """Failing rollouts shown per critique (the lowest rewards first)."""
    rounds: PosInt = 3
    max_rollouts: PosInt | None = None
    """All rollouts of the run, training and validation; a batch that would go past it is not started."""
    max_optimizer_tokens: PosInt | None = None
    """All optimiser tokens, prompts and replies (``usage.total_tokens``); a call starts only while what is left
    holds its prompt (estimated) and a reply as long as the longest so far, its reply capped at what is left."""
    gateway_model: Annotated[str, Field(pattern=r"^https?://")] | None = None
    """An OpenAI base URL the agent's model is reached at through agl's gateway (workers point the agent's
    OpenAI clients at it, calls recorded with their tokens); None: the agent calls its own model itself."""
    gateway_api_key_env: str | None = None


class Config(_Section):
    """One training run, as ``agl train`` reads it."""

    data: DataConfig
    agent: Annotated[str, Field(pattern=_AGENT)]
    backend: BackendConfig | None = None
    """Required but with ``algorithm.name: apo``, which loads no model."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    """With ``algorithm.name: sft`` or ``rft``: the transitions trained on (docs/sft.md)."""
    credit: CreditConfig = Field(default_factory=CreditConfig)
    agent_match: str | None = None
    """Regex searched in the agent names whose LLM calls are trained (``re.search``, Agent Lightning's semantics:
    ``write`` selects ``write_query`` and ``rewrite_query``; ``^writer$`` one name); None: every call."""
    policies: dict[str, PolicyConfig] | None = None
    """Several policies in one run, each agent role its own LoRA adapter on the shared base (docs/multi-policy.md);
    ``agent_match`` is the one-policy shorthand, and the two do not go together."""
    air: AirConfig = Field(default_factory=AirConfig)
    workers: WorkersConfig = Field(default_factory=WorkersConfig)
    server: ServerSection = Field(default_factory=ServerSection)
    run: RunConfig = Field(default_factory=RunConfig)
    validation: ValidationConfig | None = None
    """A held-out set run at the start and every ``validation.every`` steps (None: no validation)."""
    resources: dict[str, Any] = Field(default_factory=dict)
    """What the agent reads (``agl.resources()``); with ``algorithm.name: apo`` the server's first version."""
    apo: ApoConfig | None = None
    """With ``algorithm.name: apo``: what it optimises and how (docs/apo.md)."""

    base_dir: str = Field(default=".", exclude=True)
    """The config file's folder: relative paths are taken from here (not a key of the file)."""

    def path(self, value: str) -> str:
        """``value`` as an absolute path, relative ones taken from the config file's folder."""
        return value if os.path.isabs(value) else os.path.normpath(os.path.join(self.base_dir, value))


POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""A policy's name: it names its LoRA adapter (peft refuses a '.') and the model it is served as."""


class ConfigError(ValueError):
    """A config that cannot run; ``key`` is the dotted path of the key at fault ("" for the whole file)."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"config error: {key}: {problem}" if key else f"config error: {problem}")


class ConfigErrors(ConfigError):
    """Several problems at once; the message has one ``config error:`` line per problem."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = list(errors)
        ValueError.__init__(self, "\n".join(str(e) for e in self.errors))
        self.key, self.problem = self.errors[0].key, self.errors[0].problem


# ---------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str], overrides: Sequence[str] = (), *, check_files: bool = True) -> Config:
    """Read, override, validate and check ``path``; raise :class:`ConfigError` naming the first bad key(s)."""
    import yaml

    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"no such config file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("", f"cannot read {path}: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError("", f"{path}{where} is not valid YAML: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path} must hold a mapping of sections (data, agent, backend, ...), "
                              f"got a {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    config = validate(raw, base_dir=str(file.resolve().parent))
    if check_files:
        check(config)
    return config


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``raw`` with each ``a.b=c`` set (``c`` read as YAML); a copy, ``raw`` is left alone."""
    import copy

    import yaml

    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError("", f"--set {item}: expected KEY=VALUE with a dotted KEY, e.g. algorithm.lr=1e-5")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[:i + 1])
                raise ConfigError(where, f"is {_show(child)}, not a section: --set {key} cannot go inside it")
            node = child
        node[parts[-1]] = value
    return out


_WEIGHTS_ONLY = "a term of the grpo loop's policy-gradient step, which sft and rft do not take"
_SFT_AND_RFT = {
    "algorithm.clip_epsilon": _WEIGHTS_ONLY, "algorithm.clip_epsilon_high": _WEIGHTS_ONLY,
    "algorithm.kl_coef": _WEIGHTS_ONLY, "algorithm.row_mode": _WEIGHTS_ONLY,
    "algorithm.scale_advantages": _WEIGHTS_ONLY,
    "backend.epochs": "the passes over the examples are sft.epochs",
    "backend.minibatches": "an optimizer step takes sft.batch_size examples",
    "run.checkpoint_every": "the model and its checkpoint are written once, at the end",
}
SFT_UNREAD = {
    **_SFT_AND_RFT,
    "algorithm.temperature": "sft samples nothing; its loss is the model's own distribution",
    "data.group_size": "sft samples nothing: it reads the stored transitions of sft.data",
    "data.tasks_per_step": "sft samples nothing: it reads the stored transitions of sft.data",
    "run.steps": "the passes over the examples are sft.epochs",
    "credit": "the transitions are trained as stored; sft.min_reward selects them by their run's return",
    "air": "the transitions are trained as stored; sft.min_reward selects them by their run's return",
    "resources": "sft runs no agent",
    "workers": "sft runs no agent",
}
"""Keys ``algorithm.name: sft`` never reads, and what it does instead (:func:`refuse_unread`)."""
RFT_UNREAD = dict(_SFT_AND_RFT)
"""Keys ``algorithm.name: rft`` never reads (:func:`refuse_unread`)."""
APO_UNREAD = {
    "algorithm": "no weights are trained: the sampling is the agent's (or validation.sampling when scoring through "
                 "apo.gateway_model)",
    "data.group_size": "each candidate runs apo.batch_size training tasks once",
    "data.tasks_per_step": "each candidate runs apo.batch_size training tasks a round",
    "sft": "it is read by algorithm.name sft and rft",
    "run.steps": "the search runs apo.rounds rounds (and stops at apo.max_rollouts or apo.max_optimizer_tokens)",
    "run.checkpoint_every": "the search writes apo.json after it ends, and every candidate is a resources version "
                            "on the server as it is made",
    "run.seed": "the search draws nothing at random (the optimiser's temperature is apo.optimizer.temperature)",
    "validation.every": "every candidate is scored on the whole validation split when it is made, and there are no "
                        "training steps to count",
    "validation.at_start": "the initial prompt is scored first in any case",
}
"""Keys ``algorithm.name: apo`` never reads (:func:`refuse_unread`)."""


def unread_keys(config: Config, unread: dict[str, str]) -> list[tuple[str, str]]:
    """The keys of ``unread`` (a section, or ``section.key``) that ``config`` sets to other than their default, each
    with what the run does instead. Set means not the default, so a config dumped with every default
    (``summary.json``'s) sets none."""
    defaults: dict[str, Any] = {
        "algorithm": AlgorithmConfig(name=config.algorithm.name), "data": DataConfig(path=config.data.path),
        "sft": SftConfig(), "run": RunConfig(), "credit": CreditConfig(), "air": AirConfig(), "resources": {},
        "workers": WorkersConfig(),
        "backend": BackendConfig(name=config.backend.name, model=config.backend.model) if config.backend else None,
        "validation": ValidationConfig(path=config.validation.path) if config.validation else None,
    }
    found: list[tuple[str, str]] = []
    for key, instead in unread.items():
        section, _, name = key.partition(".")
        value, default = getattr(config, section), defaults[section]
        if value is None:  # an optional section left out sets nothing
            continue
        if name:
            value, default = getattr(value, name), getattr(default, name)
        if value == default:
            continue
        if not name and isinstance(default, BaseModel):
            found += [(f"{key}.{k}", instead) for k in type(default).model_fields
                      if k != "name" and getattr(value, k) != getattr(default, k)]
        else:
            found.append((key, instead))
    return found


def refuse_unread(config: Config, algorithm: str, unread: dict[str, str]) -> None:
    """:class:`ConfigError` naming the first key of ``unread`` that ``config`` sets (:func:`unread_keys`), and what
    ``algorithm`` does instead: a key the run would ignore is refused, not ignored."""
    for key, instead in unread_keys(config, unread)[:1]:
        raise ConfigError(key, f"is not used with algorithm.name: {algorithm} ({instead}), so it would be "
                          "ignored: drop it")


def ignored_line(config: Config) -> str | None:
    """One line naming the keys an ``sft`` or ``rft`` run does not read that ``config`` sets, or None. They are
    said, not refused: an sft config is often the grpo run's with another ``algorithm.name`` (SFT first, then
    GRPO from its model), while apo, which refuses a backend section, never shares one."""
    name = config.algorithm.name
    if name not in ("sft", "rft"):
        return None
    found = unread_keys(config, SFT_UNREAD if name == "sft" else RFT_UNREAD)
    if not found:
        return None
    return (f"agl train: algorithm.name {name} does not read " + "; ".join(f"{k} ({why})" for k, why in found)
            + ": ignored")


_LEAVES = {"grpo": "checkpoint/, reward_curve.png, loss_curve.png, summary.json",
           "sft": "model/, sft-checkpoint/, loss_curve.png, summary.json",
           "rft": "model/, rft-checkpoint/, loss_curve.png, summary.json",
           "apo": "apo.json, best_prompt.txt, summary.json"}
"""What each algorithm writes in ``run.dir``."""


def refuse_earlier_run(config: Config) -> None:
    """:class:`ConfigError` when ``run.dir`` holds the ``summary.json`` of an earlier run that this one would write
    over without a word while ``run.resume`` (the default) asks to go on from it: a run of another algorithm, or one
    of sft, rft or apo, which cannot resume yet. A grpo run over a grpo run's folder resumes from its checkpoint."""
    name = config.algorithm.name
    path = os.path.join(config.path(config.run.dir), "summary.json")
    if not config.run.resume or not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        earlier = str(summary.get("algorithm") or "grpo")  # a grpo summary names no algorithm
        found = ""
        if earlier == "apo":
            score = summary.get("best_validation_score")
            found = f": best v{summary.get('best_version')}, validation score " + \
                ("unscored" if score is None else f"{float(score):.3f}")
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        earlier, found = "unknown", f": unreadable, {exc}"
    if earlier == name == "grpo":
        return
    why = f"{name} cannot resume a run yet" if earlier == name else f"it is not a {name} run's"
    raise ConfigError("run.dir", f"{os.path.dirname(path)} holds an earlier {earlier} run ({path}{found}), which "
                      f"this {name} run would write over ({_LEAVES.get(name, 'summary.json')}), and {why}: choose "
                      "another run.dir, or set run.resume: false to start over in this one")


def validate(raw: dict[str, Any], *, base_dir: str = ".") -> Config:
    """The :class:`Config` of ``raw``, or :class:`ConfigError` in our words (never pydantic's dump)."""
    if "base_dir" in raw:
        raise ConfigError("base_dir", _unknown("base_dir", Config))
    try:
        config = Config.model_validate({**raw, "base_dir": base_dir})
    except ValidationError as exc:
        errors = [_explain(e) for e in exc.errors(include_url=False)]
        algorithm = raw.get("algorithm")
        if "backend" not in raw and not (isinstance(algorithm, dict) and algorithm.get("name") == "apo"):
            errors.append(ConfigError("backend", "is required, and missing"))  # optional for apo alone
        raise (errors[0] if len(errors) == 1 else ConfigErrors(errors)) from None
    _cross_check(config)
    return config


def _cross_check(config: Config) -> None:
    """What one key's type cannot say alone."""
    if config.algorithm.name == "apo" and config.policies is not None:
        raise ConfigError("policies", "train model weights, one LoRA adapter each; algorithm.name apo changes a "
                          "prompt and trains no weights: drop policies, or use algorithm.name grpo")
    if config.algorithm.name == "apo":
        from agl_trainer.apo import check_apo_config

        check_apo_config(config)
        return
    if config.apo is not None:
        raise ConfigError("apo", f"is only used with algorithm.name: apo, not {config.algorithm.name}")
    if config.backend is None:
        raise ConfigError("backend", "is required, and missing")
    _check_credit(config.credit, "credit")
    if config.sft.agent is not None:
        try:
            re.compile(config.sft.agent)
        except re.error as exc:
            raise ConfigError("sft.agent", f"{config.sft.agent!r} is not a valid regular expression: {exc}") from None
    name = config.algorithm.name
    if name in ("sft", "rft") and config.backend.name != "torch":
        raise ConfigError("algorithm.name", f"{name} trains with the torch backend; backend.name is "
                          f"{config.backend.name}")
    if name in ("sft", "rft") and config.policies is not None:
        raise ConfigError("policies", f"algorithm.name {name} fine-tunes one policy; several (one adapter per role) "
                          "are trained by grpo only yet: drop policies (sft.agent selects the role's calls)")
    if name in ("sft", "rft") and config.validation is not None:
        raise ConfigError("validation", f"is run by the grpo loop; algorithm.name {name} does not run it yet: drop "
                          "the section, or validate the model folder it writes with a grpo run")
    if name == "grpo" and config.sft != SftConfig():  # set, not merely present (a dumped config carries defaults)
        raise ConfigError("sft", "is read with algorithm.name sft or rft only; algorithm.name is grpo")
    if config.agent_match is not None:
        try:
            re.compile(config.agent_match)
        except re.error as exc:
            raise ConfigError("agent_match", f"{config.agent_match!r} is not a valid regular expression: {exc}"
                              ) from None
    if config.policies is not None:
        _check_policies(config)
    if config.algorithm.temperature is None:
        raise ConfigError("algorithm.temperature", "must be a number: with null each call would sample at the "
                          "temperature its agent asked for, while the trainer computes its logprobs at one "
                          "temperature, so the importance ratio would compare two distributions; set the temperature "
                          "the policy samples at (the gateway enforces it on every call)")
    vllm = config.backend.vllm
    if vllm is not None:
        if config.backend.name != "torch":
            raise ConfigError("backend.vllm", f"is the torch backend's rollout server; backend.name is "
                              f"{config.backend.name}, whose rollout engine is backend.verl.rollout_engine")
        if config.server.url is not None:
            raise ConfigError("backend.vllm", f"and server.url {config.server.url} both name the model server: the "
                              "remote server has its own (agl serve --backend); set one of them")
        if not vllm.url.startswith(("http://", "https://")):
            raise ConfigError("backend.vllm.url", f"must be an http(s) URL ending in /v1, got {vllm.url!r}")
    high = config.algorithm.clip_epsilon_high
    if high is not None and high < config.algorithm.clip_epsilon:
        raise ConfigError("algorithm.clip_epsilon_high", f"must be at least algorithm.clip_epsilon "
                          f"({config.algorithm.clip_epsilon:g}), got {high:g}")
    if config.server.url is not None and not re.match(r"^https?://[^/\s]+", config.server.url):
        raise ConfigError("server.url", f"must be an http:// or https:// URL, got {config.server.url!r}")
    if config.workers.ray is not None and config.workers.count == 0:
        raise ConfigError("workers.count", "must be at least 1 with workers.ray (the number of Ray actors)")
    if config.validation is not None and config.server.url is not None:
        raise ConfigError("validation", "is not available with server.url yet: a remote agl serve pins the training "
                          "sampling on every call and offers no way to sample a validation at validation.sampling; "
                          "leave server.url out (agl train starts its own server) or drop the validation section")
    if config.validation is not None and config.backend.name == "verl":
        raise ConfigError("validation", "is run by the torch backend's loop; with backend.name: verl use verl's own "
                          "validation (backend.verl.overrides: data.val_files=..., trainer.test_freq=N)")


def _check_credit(credit: CreditConfig, where: str) -> None:
    if credit.method == "custom" and credit.function is None:
        raise ConfigError(f"{where}.function", f"required with {where}.method: custom (pkg.module:function)")
    if credit.method != "custom" and credit.function is not None:
        raise ConfigError(f"{where}.function", f"is only used with {where}.method: custom, not {credit.method}")


def _check_policies(config: Config) -> None:
    policies = config.policies or {}
    if config.agent_match is not None:
        raise ConfigError("policies", f"and agent_match ({config.agent_match!r}) both select the trained agents: "
                          "with policies each policy's agents regex selects its own; drop agent_match (or drop "
                          "policies and train one policy)")
    if not policies:
        raise ConfigError("policies", "is empty: name at least one policy ({NAME: {agents: REGEX}}), or leave it out")
    for name, policy in policies.items():
        if not POLICY_NAME.fullmatch(name):
            raise ConfigError(f"policies.{name}", "a policy's name names its LoRA adapter and the model it is "
                              "served as: letters, digits, '_', '-' only (peft refuses '.'), at most 64, starting "
                              "with a letter or digit")
        try:
            re.compile(policy.agents)
        except re.error as exc:
            raise ConfigError(f"policies.{name}.agents", f"{policy.agents!r} is not a valid regular expression: "
                              f"{exc}") from None
        if policy.credit is not None:
            _check_credit(policy.credit, f"policies.{name}.credit")
        if policy.model is not None and config.backend.vllm is not None:
            raise ConfigError(f"policies.{name}.model", "a policy with a model of its own is served by the torch "
                              "engine only yet, not with backend.vllm (which serves LoRA adapters on its base): "
                              "drop backend.vllm, or drop the model to train an adapter on the base")
    if config.backend.name != "torch":
        raise ConfigError("policies", f"are trained by the torch backend (an adapter each on one base); "
                          f"backend.name is {config.backend.name}")
    if config.server.url is not None:
        raise ConfigError("policies", "need the server agl train starts (its gateway routes each agent to its "
                          "policy); leave server.url out")


def check(config: Config) -> None:
    """The files and modules the config names exist: the data sets load, the model folder, the agent's module."""
    if config.algorithm.name != "sft":  # sft reads a store, not the data set
        load_tasks(config)
    load_validation_tasks(config)
    if config.backend is not None and config.backend.name == "torch":
        model = config.path(config.backend.model)
        if not os.path.isdir(model):
            raise ConfigError("backend.model", f"no such folder: {model} (the torch backend needs a local "
                                               "Hugging Face model folder)")
        if not os.path.exists(os.path.join(model, "config.json")):
            raise ConfigError("backend.model", f"{model} has no config.json: not a Hugging Face model folder")
        for name, policy in (config.policies or {}).items():
            if policy.model is not None and not os.path.exists(os.path.join(config.path(policy.model),
                                                                            "config.json")):
                raise ConfigError(f"policies.{name}.model", f"{config.path(policy.model)} is not a Hugging Face "
                                  "model folder (no config.json)")
    functions = [("agent", config.agent), ("credit.function", config.credit.function),
                 ("air.custom", config.air.custom)]
    functions += [(f"policies.{name}.credit.function", p.credit.function)
                  for name, p in (config.policies or {}).items() if p.credit is not None]
    for key, spec in functions:
        if spec is None:
            continue
        module = spec.partition(":")[0]
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ConfigError(key, f"no module {module!r} to import (for {spec}); is it on PYTHONPATH?")


def transition_builder(config: Config, code: Any = None) -> Any:
    """The run's ``TransitionBuilder``: the config's ``agent_match``, ``air`` and ``credit``, joined with ``code``.

    ``code`` is the builder the agent's ``@agl.rollout_fn(builder=...)`` was given (:func:`code_builder`):
    one source of truth for what is trained, so a key that both set to different values is a
    :class:`ConfigError` at start, naming both values.
    """
    from agl_core.errors import SchemaError
    from agl_core.transitions import AirRules, BuilderConflict, TransitionBuilder, load_function, merge_builders

    rules: dict[str, Any] = config.air.model_dump(exclude={"custom"})
    try:
        if config.air.custom is not None:
            rules["custom"] = load_function(config.air.custom, "air.custom")
        credit: Any = config.credit.method
        if credit == "custom":
            credit = load_function(str(config.credit.function), "credit.function")
    except SchemaError as exc:
        raise ConfigError(exc.field, exc.problem) from None
    kwargs: dict[str, Any] = {"air": AirRules(**rules), "credit": credit, "gamma": config.credit.gamma}
    if config.agent_match is not None:
        kwargs["agent_match"] = config.agent_match
    if config.policies:  # every policy's agents are trained (each by its own policy)
        kwargs["agent_match"] = "|".join(f"(?:{p.agents})" for p in config.policies.values())
    ours = TransitionBuilder(**kwargs)
    try:
        return merge_builders(code, ours, names=(f"the agent's @agl.rollout_fn builder ({config.agent})",
                                                 "the config"))
    except BuilderConflict as exc:
        raise ConfigError(exc.conflicts[0][0], str(exc)) from None


def code_builder(config: Config) -> Any:
    """The builder the agent's ``@agl.rollout_fn(builder=...)`` was given, or None (imports the agent's module)."""
    from agl_core.worker import load_agent

    try:
        agent = load_agent(config.agent)
    except ValueError as exc:
        raise ConfigError("agent", str(exc)) from None
    return getattr(agent, "builder", None)


def load_tasks(config: Config) -> list[Any]:
    """The data set's tasks: JSONL (one JSON value a line, blank lines skipped) or one JSON list."""
    return _read_tasks(config.path(config.data.path), "data.path")


def load_validation_tasks(config: Config) -> list[Any]:
    """The validation set's tasks (``validation.max_tasks`` of them at most); empty without a validation section."""
    if config.validation is None:
        return []
    tasks = _read_tasks(config.path(config.validation.path), "validation.path")
    return tasks[:config.validation.max_tasks] if config.validation.max_tasks else tasks


def _read_tasks(path: str, key: str) -> list[Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(key, f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read {path}: {exc}") from None
    tasks: list[Any]
    if path.endswith(".json"):
        try:
            loaded = json.loads(text)
        except ValueError as exc:
            raise ConfigError(key, f"{path} is not JSON: {exc}") from None
        if not isinstance(loaded, list):
            raise ConfigError(key, f"{path} must hold a JSON list of tasks, got a {type(loaded).__name__}")
        tasks = loaded
    else:
        tasks = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                tasks.append(json.loads(line))
            except ValueError as exc:
                raise ConfigError(key, f"{path} line {number} is not JSON: {exc}") from None
    if not tasks:
        raise ConfigError(key, f"{path} holds no tasks")
    return tasks


# ---------------------------------------------------------------------- pydantic's errors, in our words


def _explain(error: Any) -> ConfigError:
    loc = [p for p in error["loc"] if isinstance(p, str | int)]
    key = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[")
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    field_type = _annotation(loc)
    if kind == "extra_forbidden":
        return ConfigError(key, _unknown(str(loc[-1]), _model_at(loc[:-1])))
    if kind == "missing":
        return ConfigError(key, "is required, and missing")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        model = _model_at(loc)
        allowed = f" (keys: {', '.join(_keys(model))})" if model is not None else ""
        return ConfigError(key, f"must be a mapping{allowed}, got {_show(value)}")
    if kind == "literal_error":
        return ConfigError(key, f"{_show(value)} is not one of: {', '.join(_literal_values(field_type))}")
    if kind == "string_pattern_mismatch":
        hint = _PATTERN_HINTS.get(str(ctx.get("pattern")), f"must match {ctx.get('pattern')}")
        if hint.startswith("is not"):
            return ConfigError(key, f"{_show(value)} {hint}")
        return ConfigError(key, f"{hint}, got {_show(value)}")
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return ConfigError(key, f"{_show(value)} is not an integer")
    if kind in ("float_type", "float_parsing") or (kind == "value_error" and isinstance(value, bool)):
        return ConfigError(key, f"{_show(value)} is not a number")
    if kind in ("bool_type", "bool_parsing"):
        return ConfigError(key, f"{_show(value)} is not true or false")
    if kind in ("string_type",):
        return ConfigError(key, f"{_show(value)} is not a string")
    if kind in ("list_type",):
        return ConfigError(key, f"must be a list, got {_show(value)}")
    if kind == "finite_number":
        return ConfigError(key, f"{_show(value)} is not a finite number")
    bounds = {"greater_than": "greater than", "greater_than_equal": "at least", "less_than": "less than",
              "less_than_equal": "at most"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return ConfigError(key, f"must be {bounds[kind]} {limit:g}, got {_show(value)}")
    message = str(error.get("msg", kind))
    return ConfigError(key, message.removeprefix("Value error, "))


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:g}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)


def _unwrap(annotation: Any) -> list[Any]:
    """The types inside ``X | None``, ``Annotated[X, ...]``."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(annotation) for t in _unwrap(a)]
    return [annotation]


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Config
    values: type[BaseModel] | None = None  # the model of a mapping's values (``policies: {NAME: ...}``)
    for part in loc:
        if values is not None:  # ``part`` is a key of the mapping
            model, values = values, None
            continue
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        kinds = _unwrap(model.model_fields[part].annotation)
        found = [t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)]
        mapped = [v for t in kinds if typing.get_origin(t) is dict for v in typing.get_args(t)[1:]
                  if isinstance(v, type) and issubclass(v, BaseModel)]
        model = found[0] if found else None
        values = mapped[0] if mapped else None
    return None if values is not None else model


def _annotation(loc: Sequence[Any]) -> Any:
    if not loc:
        return None
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str) or loc[-1] not in model.model_fields:
        return None
    return model.model_fields[loc[-1]].annotation


def _literal_values(annotation: Any) -> list[str]:
    return [str(v) for t in _unwrap(annotation) if typing.get_origin(t) is Literal for v in typing.get_args(t)]


def _keys(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return [name for name, f in model.model_fields.items() if not f.exclude]


def _unknown(name: str, model: type[BaseModel] | None) -> str:
    keys = _keys(model)
    close = difflib.get_close_matches(name, keys, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown key{hint}; allowed: {', '.join(keys)}"
