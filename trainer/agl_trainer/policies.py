"""Several policies in one run: each agent role its own LoRA adapter on one shared base model.

A training config's ``policies: {writer: {agents: "writer|rewriter", lora: {r: 16}}, checker: {agents:
"checker"}}`` names the policies and the agents each one serves (``agents`` is a regex searched in the
agent name, the semantics of ``agent_match``; the first policy in order whose regex matches an agent
serves it). Agents matched by no policy are not trained, and their calls are answered by the base
model (the adapters switched off), which the call's span says (``agl.llm.policy_note``).

- **Serving.** The instrumented client sends the agent scope of each call (``X-Agl-Agent``, see
  :mod:`agl_core.openai_client.instrumentor`); the gateway asks :class:`PolicyRouter` for the agent's
  policy and calls the backend with the policy's name as ``model``: the torch engine serves it from the
  adapter of that name (:class:`~agl_trainer.engine.TorchEngine` ``adapters``), vLLM from its LoRA
  adapter of that name. The reply, the call's span and its transition name that model: which policy
  served each call is its ``model`` (and the span's ``agl.llm.policy``).
- **Training** (:class:`MultiPolicyBackend`): a step's trajectories are split by policy (each keeps its
  own policy's transitions, with the credited rewards the run's builder gave them: by default every
  policy gets the run's credited rewards for its calls, so a checker is trained on the outcome of the
  writer it checked; a policy's ``credit`` of its own credits the run's calls its way, say each call its
  own reward with ``discounted`` and ``gamma`` 0, and keeps its calls); advantages are computed per
  policy, still grouped by task (GRPO); each policy
  takes one optimizer step of its own (its own :class:`~agl_trainer.torch_backend.TorchBackend` over
  its adapter: its own AdamW), and its metrics are reported under ``policy/<name>/...``: ``reward`` (the
  mean credited reward of its calls), ``reward_share`` (its part of the step's credited reward),
  ``transitions``, ``rows`` (0: no step this time), ``loss``, ``kl``, ``approx_kl``, ``ratio_mean``,
  ``ratio_first_mean``, ``clip_fraction``, ``grad_norm``.
- **Checkpoints** hold every adapter with its optimizer (``policies/<name>/trainer.pt``).
- **Separate models** (a policy's ``model``: ``policies: {judge: {agents: judge, model: ./judge-model}}``): that
  policy is its own model, not an adapter on the base: its own :class:`~agl_trainer.torch_backend.TorchBackend`
  (full fine-tuning, or its own LoRA when the policy names ``lora``), its own engine serving it under the
  policy's name (:class:`PolicyEngines` routes each call by ``model`` to it or to the base's engine), its own
  optimizer step per training step, and its checkpoint in ``policies/<name>/`` as the adapters'. Policies
  without ``model`` keep sharing the base with an adapter each; the two kinds mix in one run.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agl_core.credit import Credit
from agl_core.schema import Trajectory
from agl_trainer.config import POLICY_NAME
from agl_trainer.torch_backend import LoraOptions, TorchBackend, TorchConfig

__all__ = ["MultiPolicyBackend", "Policy", "PolicyEngines", "PolicyRouter", "Route", "credited_as", "policies_of",
           "split_by_policy"]

logger = logging.getLogger("agl.trainer")



@dataclass(frozen=True)
class Policy:
    """One policy: its name (its adapter's, and the model name it is served under) and the agents it serves."""

    name: str
    agents: str
    """A regex searched in the agent name (``re.search``: ``write`` serves ``write_query`` and ``rewrite_query``)."""
    lora: LoraOptions | None = field(default_factory=LoraOptions)
    """Its LoRA adapter. On the shared base None means the defaults; on a separate model, full fine-tuning."""
    model: str | None = None
    """A separate model of its own (a path or hub id, as ``backend.model``); None: an adapter on the shared base."""
    credit: Credit | None = None
    """How this policy's calls are credited from the run's rewards, over every call of the run (``"final"``,
    ``"discounted"`` with :attr:`gamma`, or a function, as :mod:`agl_core.credit`); None: the run's builder's."""
    gamma: float = 1.0

    def __post_init__(self) -> None:
        if not POLICY_NAME.fullmatch(self.name):
            raise ValueError(f"policy name {self.name!r}: letters, digits, '_', '-' only (it names a LoRA adapter, "
                             "where peft refuses '.', and the model it is served as), at most 64, starting with a "
                             "letter or digit")
        if self.credit is not None and self.credit not in ("final", "discounted") and not callable(self.credit):
            raise ValueError(f"policy {self.name!r}: credit must be 'final', 'discounted' or a function, got "
                             f"{self.credit!r}")
        try:
            re.compile(self.agents)
        except re.error as exc:
            raise ValueError(f"policy {self.name!r}: agents {self.agents!r} is not a valid regular expression: "
                             f"{exc}") from None


@dataclass(frozen=True)
class Route:
    """Where one call goes: the policy that serves it (None: the base model) and, for the base, why."""

    policy: str | None
    note: str | None = None


class PolicyRouter:
    """Agent name -> policy, as the gateway routes calls and the trainer groups transitions: the same rule."""

    def __init__(self, policies: Sequence[Policy]) -> None:
        if not policies:
            raise ValueError("policies is empty: name at least one policy")
        names = [p.name for p in policies]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"policy names must differ: {twice} given more than once")
        self.policies = list(policies)
        self._patterns = [(p.name, re.compile(p.agents)) for p in self.policies]
        self._overlaps: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.policies]

    def agent_match(self) -> str:
        """One regex matching every agent some policy serves: what the run's ``TransitionBuilder`` selects."""
        return "|".join(f"(?:{p.agents})" for p in self.policies)

    def policy_for(self, agent: str | None) -> str | None:
        """The first policy whose ``agents`` regex is found in ``agent``; None when none is (or no agent)."""
        if agent is None:
            return None
        found = [name for name, pattern in self._patterns if pattern.search(agent)]
        if len(found) > 1 and agent not in self._overlaps and len(self._overlaps) < 256:
            self._overlaps.add(agent)
            logger.warning("agl policies: agent %r matches policies %s; the first, %r, serves and trains it "
                           "(make the agents regexes disjoint, e.g. ^%s$, to choose another)", agent, found,
                           found[0], re.escape(agent))
        return found[0] if found else None

    def route(self, agent: str | None) -> Route:
        policy = self.policy_for(agent)
        if policy is not None:
            return Route(policy)
        if agent is None:
            return Route(None, "the call named no agent (no X-Agl-Agent header: not in an agent scope, or not "
                               "from agl's instrumented client): served by the base model, not trained")
        return Route(None, f"agent {agent!r} matches no policy ({', '.join(self.names)}): served by the base "
                           "model, not trained")


def policies_of(config: Any) -> list[Policy]:
    """The policies of a training config's ``policies`` section (:class:`agl_trainer.config.Config`), in order."""
    from agl_core.transitions import load_function

    out = []
    for name, section in (config.policies or {}).items():
        credit: Any = None
        gamma = 1.0
        if section.credit is not None:
            credit, gamma = section.credit.method, section.credit.gamma
            if credit == "custom":
                credit = load_function(str(section.credit.function), f"policies.{name}.credit.function")
        if section.model is not None:  # its own model: its own lora, else full fine-tuning (not backend.lora's)
            own = LoraOptions(**section.lora.model_dump()) if section.lora is not None else None
            out.append(Policy(name, section.agents, own, model=section.model, credit=credit, gamma=gamma))
            continue
        lora = section.lora or config.backend.lora
        options = LoraOptions(**lora.model_dump()) if lora is not None else LoraOptions()
        out.append(Policy(name, section.agents, options, credit=credit, gamma=gamma))
    return out


def credited_as(builder: Any, policy: Policy) -> Any:
    """``builder`` (the run's ``TransitionBuilder``) crediting as ``policy`` says: the same calls and rewards."""
    own = copy.copy(builder)
    own.credit, own.gamma = policy.credit, policy.gamma
    return own


def split_by_policy(trajectories: Sequence[Trajectory], router: PolicyRouter,
                    elsewhere: dict[str, int] | None = None) -> dict[str, list[Trajectory]]:
    """Each policy's share of the trajectories: the same rollouts, each with only that policy's transitions.

    A rollout in which a policy made no call is left out of that policy's share (it has nothing to train
    there); its reward still counts in the step's reward. Transitions of agents no policy serves go nowhere.
    A transition whose ``model`` says another model answered it (the call reached the gateway without its
    agent: a client that is not agl's, or no agent scope) is not trained: its tokens are not its policy's
    samples. Those are counted per policy into ``elsewhere``.
    """
    out: dict[str, list[Trajectory]] = {name: [] for name in router.names}
    for traj in trajectories:
        mine: dict[str, list[Any]] = {}
        for t in traj.transitions:
            policy = router.policy_for(t.agent_name)
            if policy is None:
                continue
            if t.model is not None and t.model != policy:
                if elsewhere is not None:
                    elsewhere[policy] = elsewhere.get(policy, 0) + 1
                continue
            mine.setdefault(policy, []).append(t)
        for policy, transitions in mine.items():
            out[policy].append(replace(traj, transitions=transitions))
    return out


_REPORTED = ("loss", "pg", "kl", "approx_kl", "clip_fraction", "ratio_mean", "ratio_first_mean", "ratio_first_min",
             "ratio_first_max", "sampler_kl", "skipped_steps", "flat_steps", "entropy", "grad_norm", "rows", "update_s")


def _joined(key: str, values: list[float]) -> float:
    """The step's figure for ``key`` from its policies' figures: the signal checks read the step's, so a drift or
    a skipped step of one policy must not be averaged away by another's (1.3 and 0.7 are no 1.0)."""
    if key in ("rows", "update_s", "skipped_steps", "flat_steps"):
        return sum(values)
    if key == "ratio_first_mean":
        return max(values, key=lambda v: abs(v - 1.0))
    if key == "ratio_first_min":
        return min(values)
    if key in ("ratio_first_max", "sampler_kl"):
        return max(values)
    return sum(values) / len(values)


class MultiPolicyBackend:
    """One base model with a LoRA adapter per policy, each trained by its own :class:`TorchBackend`; a policy
    given a model of its own in ``models`` (``{name: model}``) trains that model instead.

    Duck-types the parts of :class:`TorchBackend` the training loop uses (``step``, ``version``,
    ``publish``, ``save``, ``load``, ``has_checkpoint``, ``engine``); the loop calls :meth:`update_policies`
    in place of ``update``. ``tokenizers`` (``{name: tokenizer}``) are the separate models' own, for their
    engines; ``pad_ids`` their padding ids (default ``pad_id``); ``configs`` a policy's own
    :class:`TorchConfig` in place of ``config`` (say a lower ``lr`` for a fully fine-tuned model; its ``lora`` is
    the policy's, whatever the config says).
    """

    def __init__(self, model: Any, policies: Sequence[Policy], config: TorchConfig | None = None, *,
                 device: str | None = None, pad_id: int = 0, models: Mapping[str, Any] | None = None,
                 tokenizers: Mapping[str, Any] | None = None, pad_ids: Mapping[str, int] | None = None,
                 configs: Mapping[str, TorchConfig] | None = None) -> None:
        import torch

        self.router = policies if isinstance(policies, PolicyRouter) else PolicyRouter(policies)
        config = config or TorchConfig()
        models = dict(models or {})
        own = dict(configs or {})
        unknown = sorted((set(models) | set(own)) - set(self.router.names))
        if unknown:
            raise ValueError(f"models or configs {unknown}: no policy of that name ({', '.join(self.router.names)})")
        unloaded = [p.name for p in self.router.policies if p.model is not None and p.name not in models]
        if unloaded:
            raise ValueError(f"policies {unloaded} name a model of their own: pass each loaded, "
                             "models={name: model}")
        self.separate = [p.name for p in self.router.policies if p.name in models]
        """The policies trained as models of their own, not adapters on the base."""
        on_base = [p for p in self.router.policies if p.name not in models]
        if config.gradient_checkpointing and on_base and getattr(model, "supports_gradient_checkpointing", False):
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if device:
            model = model.to(torch.device(device))
        peft_model: Any = model  # no adapter policy: the base is served as it is, untrained
        if on_base:
            try:
                from peft import LoraConfig, get_peft_model
            except ImportError as exc:
                raise ImportError("several policies on one base train LoRA adapters, which needs peft: "
                                  "pip install peft") from exc
            peft_model = None
            for policy in on_base:
                lora = policy.lora or LoraOptions()
                options = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                     target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
                if peft_model is None:
                    peft_model = get_peft_model(model, options, adapter_name=policy.name)
                else:
                    peft_model.add_adapter(policy.name, options)
        self.model = peft_model
        self.backends: dict[str, TorchBackend] = {}
        for policy in self.router.policies:
            if policy.name in models:  # its own model: full fine-tuning, or its own LoRA
                self.backends[policy.name] = TorchBackend(
                    models[policy.name], replace(own.get(policy.name, config), lora=policy.lora), device=device,
                    pad_id=(pad_ids or {}).get(policy.name, pad_id))
            else:
                self.backends[policy.name] = TorchBackend(peft_model, replace(own.get(policy.name, config), lora=None),
                                                          device=device, pad_id=pad_id, adapter=policy.name)
        self.tokenizers = dict(tokenizers or {})
        self.config = config
        self.step = 0
        self.version = 0
        self.shared_engine: Any = None
        self.history: list[dict[str, Any]] = []
        self.last_batches: dict[str, Any] = {}
        """The last step's scored batch of each policy that had calls (``score``'s ``StepBatch``)."""

    @property
    def names(self) -> list[str]:
        return self.router.names

    # ------------------------------------------------------------------ training

    def update_policies(self, trajectories: Sequence[Trajectory], score: Callable[[Sequence[Trajectory]], Any], *,
                        credited: Mapping[str, Sequence[Trajectory]] | None = None) -> dict[str, float]:
        """One training step: each policy's share scored (``score``: the loop's ``score_batch``) and stepped.

        ``credited``: for a policy with a ``credit`` of its own, the step's rollouts built with it
        (:func:`credited_as`); its share is taken from those. Each policy's scored batch is kept in
        :attr:`last_batches` (the step's rows and signal are theirs). A policy with no rows this step takes
        no optimizer step (its ``policy/<name>/rows`` is 0). The step's own ``loss``, ``kl``, ``ratio_*``...
        join the policies' (:func:`_joined`), so the loop's signal checks read them as for one policy.
        """
        metrics: dict[str, float] = {}
        stepped: list[dict[str, float]] = []
        elsewhere: dict[str, int] = {}
        shares = split_by_policy(trajectories, self.router, elsewhere)
        for name, own in (credited or {}).items():
            if name not in shares:
                raise ValueError(f"credited: no policy {name!r} ({', '.join(self.names)})")
            shares[name] = split_by_policy(own, self.router)[name]
        self.last_batches = {}
        for name, count in elsewhere.items():
            metrics[f"policy/{name}/served_elsewhere"] = float(count)
            logger.warning("agl policies: %d call(s) of policy %r's agents were answered by another model (their "
                           "transition's model) and are not trained: did they reach the gateway without agl's "
                           "instrumented client (its X-Agl-Agent header)?", count, name)
        credited = {name: sum(t.credited_reward or 0.0 for traj in trajs for t in traj.transitions)
                    for name, trajs in shares.items()}
        total = sum(abs(v) for v in credited.values())
        for name, trajs in shares.items():
            prefix = f"policy/{name}/"
            batch = score(trajs) if trajs else None
            if batch is not None:
                self.last_batches[name] = batch
            rows = batch.rows if batch is not None else []
            count = sum(len(t.transitions) for t in trajs)
            metrics[prefix + "transitions"] = float(count)
            metrics[prefix + "reward"] = credited[name] / count if count else 0.0  # its calls' mean credited reward
            metrics[prefix + "reward_share"] = abs(credited[name]) / total if total else 0.0
            if not rows:
                metrics[prefix + "rows"] = 0.0
                continue
            out = self.backends[name].update(rows)
            stepped.append(out)
            for key in _REPORTED:
                if key in out:
                    metrics[prefix + key] = float(out[key])
        for key in _REPORTED:
            values = [m[key] for m in stepped if key in m]
            if values:
                metrics[key] = _joined(key, values)
        self.step += 1
        return metrics

    # ------------------------------------------------------------------ serving

    def engine(self, tokenizer: Any, **kwargs: Any) -> Any:
        """A :class:`~agl_trainer.engine.TorchEngine` serving the shared model, one adapter per policy by name;
        with separate models, a :class:`PolicyEngines` over it and each separate model's own engine (named as
        its policy, with its own tokenizer when :attr:`tokenizers` has one)."""
        from agl_trainer.engine import TorchEngine

        adapters = [n for n in self.names if n not in self.separate]
        engine = TorchEngine(self.model, tokenizer, adapters=adapters, **kwargs)
        self.shared_engine = engine
        for name in adapters:
            self.backends[name].shared_engine = engine
        if not self.separate:
            return engine
        own = {k: v for k, v in kwargs.items() if k != "name"}
        engines = {name: self.backends[name].engine(self.tokenizers.get(name, tokenizer), name=name, **own)
                   for name in self.separate}
        return PolicyEngines(engine, engines)

    def shares(self, engine: Any) -> bool:
        if isinstance(engine, PolicyEngines):
            return engine.base.model is self.model and all(
                self.backends[n].shares(engine.engines.get(n)) for n in self.separate)
        return not self.separate and getattr(engine, "model", None) is self.model

    def publish(self, engine: Any, version: int | None = None) -> int:
        """Serve every policy as trained now: an engine on the shared model only takes the new version."""
        self.version = self.step if version is None else version
        if not self.shares(engine):
            raise ValueError("several policies are served from the engine on their own model "
                             "(MultiPolicyBackend.engine) or from vLLM by LoRA name (MultiPolicyVllmLink)")
        base = engine.base if isinstance(engine, PolicyEngines) else engine
        for name, backend in self.backends.items():
            if name in self.separate:
                backend.publish(engine.engines[name], self.version)
            else:
                backend.version = self.version
        base.serve_version(self.version)
        return self.version

    def save_adapters(self, folder: str | os.PathLike[str], version: int | None = None) -> dict[str, str]:
        """Each policy's adapter as peft saves it, in ``folder/<policy>``: what vLLM loads by name."""
        self.version = self.step if version is None else version
        if self.separate:
            raise ValueError(f"policies {self.separate} are models of their own: vLLM does not serve them yet")
        return {name: backend.save_adapter(os.path.join(folder, name), self.version)
                for name, backend in self.backends.items()}

    # ------------------------------------------------------------------ checkpoints

    def save(self, folder: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> str:
        """Every policy's adapter and optimizer in ``folder/policies/<name>``, the run's step and ``extra`` beside."""
        os.makedirs(folder, exist_ok=True)
        for name, backend in self.backends.items():
            backend.save(os.path.join(folder, "policies", name))
        path = os.path.join(folder, "policies.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"step": self.step, "version": self.version, "policies": self.names, **(extra or {})}, f,
                      indent=1)
        os.replace(path + ".tmp", path)  # last: a checkpoint is whole once this names its policies
        return path

    def load(self, folder: str | os.PathLike[str]) -> dict[str, Any]:
        with open(os.path.join(folder, "policies.json"), encoding="utf-8") as f:
            meta: dict[str, Any] = json.load(f)
        saved = list(meta.get("policies") or [])
        if sorted(saved) != sorted(self.names):
            raise ValueError(f"the checkpoint in {folder} holds policies {saved}, this run trains {self.names}: "
                             "resume with the same policies, or start in another run.dir")
        for name, backend in self.backends.items():
            backend.load(os.path.join(folder, "policies", name))
        self.step = int(meta.pop("step"))
        self.version = int(meta.pop("version"))
        meta.pop("policies", None)
        return meta

    @staticmethod
    def has_checkpoint(folder: str | os.PathLike[str]) -> bool:
        return os.path.exists(os.path.join(folder, "policies.json"))


class PolicyEngines:
    """A gateway backend over the shared base's engine and each separate model's engine, by the call's ``model``.

    A call for a separate policy's name (the gateway sets it from the call's agent) is answered by that
    policy's engine, whose reply names it; any other call by the base's engine (its adapters, or the base).
    """

    def __init__(self, base: Any, engines: Mapping[str, Any]) -> None:
        self.base = base
        self.engines = dict(engines)
        self.model = base.model

    def _for(self, body: dict[str, Any]) -> Any:
        engine = self.engines.get(body.get("model"))  # type: ignore[arg-type]
        return engine if engine is not None else self.base

    @property
    def version(self) -> int:
        return int(self.base.version)

    async def complete(self, endpoint: Any, body: dict[str, Any]) -> Any:
        return await self._for(body).complete(endpoint, body)

    async def stream(self, endpoint: Any, body: dict[str, Any]) -> Any:
        return await self._for(body).stream(endpoint, body)

    async def models(self) -> list[str]:
        return [*await self.base.models(), *self.engines]

    async def update_weights(self, weights: str | None, version: int) -> None:
        if weights is not None:
            raise ValueError("several models are served in this process: their weights are published by the "
                             "trainer here (MultiPolicyBackend.publish), not loaded from a path")
        for engine in (self.base, *self.engines.values()):
            await engine.update_weights(None, version)

    def serve_version(self, version: int) -> None:
        for engine in (self.base, *self.engines.values()):
            engine.serve_version(version)

    async def aclose(self) -> None:
        for engine in (self.base, *self.engines.values()):
            await engine.aclose()
