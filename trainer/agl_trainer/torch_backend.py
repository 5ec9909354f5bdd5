"""The built-in training backend: any Hugging Face causal LM, on CPU or one GPU, updated with PPO-clip.

:class:`TorchBackend` holds the model being trained and its optimizer. Per step:

1. rows whose sampling logprobs were not recorded get them from the current weights
   (so their ratio starts at 1), and with ``kl_coef`` every row gets the reference's;
2. ``epochs`` passes over the rollouts in ``minibatches`` parts, one optimizer step per
   part, each part's rows in micro-batches of at most ``max_tokens_per_forward`` tokens
   whose gradients add up to the part's (the loss is divided by the part's rollouts);
3. :meth:`publish` makes the new weights the ones the engine serves, so the next rollouts
   sample from them: on-policy.

**One set of weights** (``docs/memory.md``): :meth:`TorchBackend.engine` serves the policy
itself, no copy. An update then holds the engine between two batches (no token is generated
from half-updated weights), and :meth:`publish` only bumps the version. An engine built on a
model of its own (another process, or a copy) is sent the weights by
:meth:`~agl_trainer.engine.TorchEngine.swap_weights`, in place.

Also for memory: gradient checkpointing (``gradient_checkpointing``, on by default), and
logprobs and entropy taken ``logit_chunk_tokens`` positions at a time
(:func:`agl_trainer.loss.token_logprobs`), never a whole ``[tokens, vocab]`` float32 tensor.

Logprobs are computed at ``TorchConfig.temperature``, the temperature the engine sampled
at (the gateway enforces it in training runs), so they are of the distribution whose
logprobs the gateway recorded: before the first optimizer step of an update the policy
is the sampler and the importance ratio is 1 (reported as ``ratio_first_*``).

**Precision** (:class:`MasterWeights`): a model loaded in bfloat16 or float16 is trained
with float32 master weights. Forward and backward run in the model's dtype; each
micro-batch's gradient is added into a float32 gradient, AdamW steps the float32 copy,
and the model's parameters are the copy rounded to their dtype after every step. AdamW
stepping bf16 weights directly loses every update smaller than half a bf16 step (one
part in 256): at ``lr`` 1e-6 almost no weight moves. float16 adds a dynamic loss scale.

LoRA (``lora=LoraOptions(...)``, needs ``peft``; by default for a model of more than
``lora_above_params`` parameters): only the adapters train. The KL reference is the same
model with its adapters disabled, not a second model. A shared engine serves the model with
its adapters; any other engine is sent merged weights (base + the adapters' delta), computed
without touching the trained model. Full fine-tuning with ``kl_coef`` keeps a frozen copy as
its reference (its base weights move).

:meth:`save` and :meth:`load` checkpoint weights, optimizer state, step and version,
so a run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agl_trainer.loss import policy_loss, token_logprobs
from agl_trainer.rows import Row

__all__ = ["LORA_ABOVE_PARAMS", "LoraOptions", "MasterWeights", "TorchBackend", "TorchConfig"]

logger = logging.getLogger("agl.trainer")

LORA_ABOVE_PARAMS = 1_000_000_000
"""Models with more parameters than this train LoRA adapters unless told otherwise: full fine-tuning
takes about 18 bytes a parameter (``docs/memory.md``), so 1B is what a 24 GB GPU holds."""


@dataclass
class LoraOptions:
    """LoRA adapters (peft) on the named modules."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TorchConfig:
    """How the torch backend updates the policy."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    epochs: int = 1
    minibatches: int = 1
    max_grad_norm: float | None = 1.0
    max_tokens_per_forward: int = 16384
    lora: LoraOptions | None = None
    """LoRA adapters to train; None: full fine-tuning, unless the model is above ``lora_above_params``."""
    lora_above_params: int | None = LORA_ABOVE_PARAMS
    """A model with more parameters than this and no ``lora`` trains default :class:`LoraOptions`; None: never."""
    temperature: float = 1.0
    """The sampling temperature of the rows' recorded logprobs; the policy's logprobs are taken at it too."""
    gradient_checkpointing: bool = True
    """Keep each decoder layer's input only and recompute the layer in the backward pass."""
    logit_chunk_tokens: int = 512
    """Positions projected onto the vocabulary at a time when taking logprobs and entropy."""


class TorchBackend:
    """Trains ``model`` (a Hugging Face causal LM) on :class:`~agl_trainer.rows.Row` batches."""

    def __init__(self, model: Any, config: TorchConfig | None = None, *, device: str | None = None,
                 pad_id: int = 0, adapter: str | None = None) -> None:
        import torch

        self.torch = torch
        self.config = config or TorchConfig()
        self.adapter = adapter
        """One named LoRA adapter of a peft ``model`` that holds several (:mod:`agl_trainer.policies`): only it
        trains, it is switched on for every forward of this backend, and checkpoints hold it alone."""
        if adapter is not None:
            self._check_adapter(model, adapter)
        self.device = torch.device(device) if device else next(model.parameters()).device
        self.pad_id = pad_id
        if not self.config.temperature > 0:
            raise ValueError(f"TorchConfig.temperature must be above 0, got {self.config.temperature!r}")
        model = model.to(self.device)
        n_params = sum(p.numel() for p in model.parameters())
        above = self.config.lora_above_params
        if self.config.lora is None and above is not None and n_params > above and adapter is None:
            self.config.lora = LoraOptions()
            logger.info("agl: %.2fB parameters, above lora_above_params (%.2fB): training LoRA adapters %s",
                        n_params / 1e9, above / 1e9, asdict(self.config.lora))
        self.ref_model: Any = None
        if self.config.kl_coef > 0 and self.config.lora is None and adapter is None:
            self.ref_model = copy.deepcopy(model).eval()  # full fine-tuning moves the base: the reference is a copy
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        if self.config.gradient_checkpointing and adapter is None:  # an adapter's model was set up by its owner
            if getattr(model, "supports_gradient_checkpointing", False):
                enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5's name
                if enable is not None:
                    enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                logger.warning("agl: %s does not support gradient checkpointing; training without it",
                               type(model).__name__)
        if self.config.lora is not None and adapter is None:
            model = _with_lora(model, self.config.lora)
        self.model = model
        self.model.train()
        self.shared_engine: Any = None
        """The :class:`~agl_trainer.engine.TorchEngine` that serves :attr:`model` itself (:meth:`engine`)."""
        self.master = MasterWeights(self._trainable())
        self.optimizer = _adamw(self.master.parameters, self.config)
        self.step = 0
        self.version = 0

    def _trainable(self) -> list[Any]:
        if self.adapter is None:
            return [p for p in self.model.parameters() if p.requires_grad]
        return [p for _, p in self._adapter_parameters()]

    def _adapter_parameters(self) -> list[tuple[str, Any]]:
        """This backend's adapter's own parameters, by their names in the peft model."""
        marks = (f".lora_A.{self.adapter}.", f".lora_B.{self.adapter}.")
        return [(n, p) for n, p in self.model.named_parameters() if any(m in n for m in marks)]

    @staticmethod
    def _check_adapter(model: Any, adapter: str) -> None:
        adapters = getattr(model, "peft_config", None)
        if not isinstance(adapters, dict) or adapter not in adapters:
            raise ValueError(f"adapter {adapter!r}: the model holds no LoRA adapter of that name "
                             f"(it holds {sorted(adapters) if isinstance(adapters, dict) else 'none'})")

    def use_adapter(self) -> None:
        """Make this backend's adapter the active one (peft also makes it alone trainable); no-op without one."""
        if self.adapter is not None:
            self.model.set_adapter(self.adapter)

    # ------------------------------------------------------------------ update

    def update(self, rows: Sequence[Row]) -> dict[str, float]:
        """One training step over ``rows``; returns the step's metrics."""
        started = time.perf_counter()
        rows = [r for r in rows if r.loss_tokens]
        if not rows:
            return {"rows": 0.0}
        with self._holding_engine():
            self.use_adapter()  # the engine may have served another adapter last; it is paused now
            return self._update(rows, started)

    @contextlib.contextmanager
    def _holding_engine(self) -> Iterator[None]:
        """The shared engine generates nothing meanwhile; the model is back in its mode after."""
        was_training = self.model.training
        held = self.shared_engine.paused() if self.shared_engine is not None else contextlib.nullcontext()
        with held:
            try:
                yield
            finally:
                self.model.train(was_training)

    def _update(self, rows: list[Row], started: float) -> dict[str, float]:
        self._fill_old_logprobs(rows)
        ref = self._ref_logprobs(rows) if self.config.kl_coef > 0 else None
        by_rollout: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            by_rollout.setdefault(r.rollout_id, []).append(i)
        rollout_ids = list(by_rollout)
        parts = max(1, min(self.config.minibatches, len(rollout_ids)))
        totals = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "approx_kl": 0.0,
                  "entropy": 0.0, "grad_norm": 0.0}
        first = _FirstPass()
        passes = 0
        skipped = 0
        flat = 0
        self.model.train()
        for _ in range(self.config.epochs):
            for k in range(parts):
                chosen = rollout_ids[k::parts]
                indices = [i for rid in chosen for i in by_rollout[rid]]
                n_rollouts = float(sum(sum(rows[i].token_weights) for i in indices)) or 1.0
                part_tokens = sum(rows[i].loss_tokens for i in indices) or 1
                self.optimizer.zero_grad(set_to_none=True)
                for micro_ids in _micro_batches([len(rows[i].input_ids) for i in indices],
                                                self.config.max_tokens_per_forward):
                    micro = [indices[j] for j in micro_ids]
                    batch = self._tensors([rows[i] for i in micro], [ref[i] for i in micro] if ref else None)
                    logp, entropy = token_logprobs(self.model, batch["input_ids"], batch["attention_mask"],
                                                   temperature=self.config.temperature, with_entropy=True,
                                                   chunk_tokens=self.config.logit_chunk_tokens)
                    parts_ = policy_loss(logp, batch["old"], batch["adv"], batch["weights"], rollouts=n_rollouts,
                                         clip_low=self.config.clip_low, clip_high=self.config.clip_high,
                                         ref_logp=batch.get("ref"), kl_coef=self.config.kl_coef)
                    self.master.backward(parts_.loss)
                    share = parts_.tokens / part_tokens
                    totals["loss"] += float(parts_.loss.detach())
                    totals["pg"] += parts_.pg
                    totals["kl"] += parts_.kl
                    for key in ("clip_fraction", "ratio_mean", "approx_kl"):
                        totals[key] += getattr(parts_, key) * share
                    mask = batch["weights"] > 0
                    totals["entropy"] += float((entropy.detach() * mask).sum()) / part_tokens
                    if passes == 0:  # no optimizer step yet: the policy is still the one that sampled
                        first.add(parts_)
                norm, outcome = self.master.step(self.optimizer, self.config.max_grad_norm)
                totals["grad_norm"] += norm
                skipped += outcome == "overflow"
                flat += outcome == "flat"
                passes += 1
        self.step += 1
        metrics = {k: v / passes for k, v in totals.items()}
        metrics.update(first.metrics())
        if skipped:
            metrics["skipped_steps"] = float(skipped)  # float16: the loss scale overflowed, that step was not taken
        if flat:
            metrics["flat_steps"] = float(flat)  # no gradient (every advantage 0, no KL): the weights stayed put
        tokens = sum(len(r.input_ids) for r in rows)
        elapsed = time.perf_counter() - started
        metrics.update({"rows": float(len(rows)), "rollouts": float(len(rollout_ids)), "tokens": float(tokens),
                        "loss_tokens": float(sum(r.loss_tokens for r in rows)), "update_s": elapsed})
        return metrics

    def _tensors(self, rows: Sequence[Row], ref: list[list[float]] | None) -> dict[str, Any]:
        torch = self.torch
        width = max(len(r.input_ids) for r in rows)
        n = len(rows)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        old = torch.zeros((n, width - 1))
        adv = torch.zeros((n, width - 1))
        weights = torch.zeros((n, width - 1))
        ref_t = torch.zeros((n, width - 1)) if ref is not None else None
        for i, r in enumerate(rows):
            L = len(r.input_ids)
            ids[i, :L] = torch.tensor(r.input_ids)
            attention[i, :L] = 1
            assert r.old_logprobs is not None
            old[i, :L - 1] = torch.tensor(r.old_logprobs[1:])
            adv[i, :L - 1] = torch.tensor(r.advantages[1:])
            weights[i, :L - 1] = torch.tensor(r.token_weights[1:])
            if ref_t is not None and ref is not None:
                ref_t[i, :L - 1] = torch.tensor(ref[i][1:])
        out = {"input_ids": ids, "attention_mask": attention, "old": old, "adv": adv, "weights": weights}
        if ref_t is not None:
            out["ref"] = ref_t
        return {k: v.to(self.device) for k, v in out.items()}

    def logprobs(self, rows: Sequence[Row], model: Any = None) -> list[list[float]]:
        """The logprob of every token of each row under ``model`` (default: the policy), aligned with its ids."""
        torch = self.torch
        model = model or self.model
        out: list[list[float]] = [[] for _ in rows]
        with torch.no_grad():
            for micro_ids in _micro_batches([len(r.input_ids) for r in rows], self.config.max_tokens_per_forward):
                micro = [rows[j] for j in micro_ids]
                width = max(len(r.input_ids) for r in micro)
                ids = torch.full((len(micro), width), self.pad_id, dtype=torch.long)
                attention = torch.zeros((len(micro), width), dtype=torch.long)
                for i, r in enumerate(micro):
                    ids[i, :len(r.input_ids)] = torch.tensor(r.input_ids)
                    attention[i, :len(r.input_ids)] = 1
                lp = token_logprobs(model, ids.to(self.device), attention.to(self.device),
                                    temperature=self.config.temperature,
                                    chunk_tokens=self.config.logit_chunk_tokens).cpu()
                for i, j in enumerate(micro_ids):
                    out[j] = [0.0] + lp[i, :len(micro[i].input_ids) - 1].tolist()
        return out

    def _fill_old_logprobs(self, rows: Sequence[Row]) -> None:
        missing = [r for r in rows if r.old_logprobs is None]
        if not missing:
            return
        was_training = self.model.training
        self.model.eval()
        for r, lp in zip(missing, self.logprobs(missing), strict=True):
            r.old_logprobs = [v * m for v, m in zip(lp, r.loss_mask, strict=True)]
        self.model.train(was_training)

    def _ref_logprobs(self, rows: Sequence[Row]) -> list[list[float]]:
        if self.ref_model is not None:
            return self.logprobs(rows, self.ref_model)
        with self.model.disable_adapter():  # LoRA: the reference is the base, the adapters switched off
            return self.logprobs(rows)

    # ------------------------------------------------------------------ weights

    def serving_state_dict(self) -> dict[str, Any]:
        """The weights to serve, under the plain model's names (LoRA adapters merged in)."""
        if self.config.lora is None and self.adapter is None:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        self.use_adapter()
        return _merged_lora_state(self.model)

    def engine(self, tokenizer: Any, **kwargs: Any) -> Any:
        """A :class:`~agl_trainer.engine.TorchEngine` that serves this backend's model itself: one set of weights.

        ``kwargs`` go to the engine (``name``, ``max_batch``, ``seed``...). Updates pause its generation.
        """
        from agl_trainer.engine import TorchEngine

        engine = TorchEngine(self.model, tokenizer, device=str(self.device), **kwargs)
        self.shared_engine = engine
        return engine

    def shares(self, engine: Any) -> bool:
        """Whether ``engine`` serves this backend's model itself (no weights to copy)."""
        return getattr(engine, "model", None) is self.model

    def publish(self, engine: Any, version: int | None = None) -> int:
        """Serve the current weights from a :class:`~agl_trainer.engine.TorchEngine`; return the version served.

        An engine that shares the model (:meth:`engine`) only takes the new version; any other gets
        the weights copied into its own, in place.
        """
        self.version = self.step if version is None else version
        if self.shares(engine):
            engine.serve_version(self.version)
        else:
            engine.swap_weights(self.serving_state_dict(), self.version)
        return self.version

    def save_adapter(self, folder: str | os.PathLike[str], version: int | None = None) -> str:
        """Write the LoRA adapters as peft saves them (``adapter_config.json``, ``adapter_model.safetensors``: what
        vLLM's ``/v1/load_lora_adapter`` reads) into ``folder``; the version they serve as is ``version``.

        Only with LoRA: full fine-tuning has no adapter to write (:class:`ValueError`).
        """
        if self.config.lora is None and self.adapter is None:
            raise ValueError("no LoRA adapters to write: this backend fine-tunes every weight (TorchConfig.lora)")
        self.version = self.step if version is None else version
        tmp = f"{os.fspath(folder)}.tmp"
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        if self.adapter is None:
            self.model.save_pretrained(tmp)  # peft: the adapters alone, under peft's names
            written = tmp
        else:  # peft writes an adapter other than "default" into a folder of its name
            self.model.save_pretrained(tmp, selected_adapters=[self.adapter])
            written = tmp if self.adapter == "default" else os.path.join(tmp, self.adapter)
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.replace(written, folder)  # whole, or not there: a reader never sees half an adapter
        if written != tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        return os.fspath(folder)

    def memory(self) -> dict[str, int]:
        """Bytes this backend holds, by what holds them, each tensor's storage counted once.

        ``model``: the policy's parameters and buffers (with LoRA: the base and the adapters);
        ``master``: float32 copies of low-precision trainable parameters (:class:`MasterWeights`);
        ``optimizer``: AdamW's moments; ``grads``: gradients alive now (between steps: none);
        ``reference``: the KL reference's own weights (0 with LoRA: the base is the reference);
        ``engine``: weights a shared engine holds beyond the policy's (0: it serves the policy's own).
        ``total`` is their sum. ``docs/memory.md`` turns these into bytes per parameter.
        """
        seen: set[int] = set()

        def size(tensors: Any) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return total

        out = {"model": size(list(self.model.parameters()) + list(self.model.buffers()))}
        out["master"] = size(m for m, c in zip(self.master.parameters, self.master.copied, strict=True) if c)
        out["optimizer"] = size(v for state in self.optimizer.state.values() for v in state.values()
                                if isinstance(v, self.torch.Tensor) and v.dim() > 0)
        out["grads"] = size([p.grad for p in self.model.parameters()] + [m.grad for m in self.master.parameters])
        out["reference"] = size(self.ref_model.parameters()) if self.ref_model is not None else 0
        out["engine"] = size(self.shared_engine.model.parameters()) if self.shared_engine is not None else 0
        out["total"] = sum(out.values())
        return out

    # ------------------------------------------------------------------ checkpoints

    def save(self, folder: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> str:
        """Write a checkpoint (weights, optimizer, step, version, ``extra``) into ``folder``; atomic."""
        torch = self.torch
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "trainer.pt")
        tmp = path + ".tmp"
        torch.save({"model": self._model_state(), "optimizer": self.optimizer.state_dict(),
                    "master": self.master.state_dict(), "step": self.step, "version": self.version,
                    "rng": torch.get_rng_state(), "config": json.dumps(asdict(self.config))}, tmp)
        os.replace(tmp, path)
        if extra is not None:
            meta = os.path.join(folder, "trainer.json")
            with open(meta + ".tmp", "w", encoding="utf-8") as f:
                json.dump({"step": self.step, "version": self.version, **extra}, f, indent=1)
            os.replace(meta + ".tmp", meta)
        return path

    def load(self, folder: str | os.PathLike[str]) -> dict[str, Any]:
        """Resume from :meth:`save`'s checkpoint in ``folder``; returns its ``extra`` (empty when none)."""
        torch = self.torch
        state = torch.load(os.path.join(folder, "trainer.pt"), map_location=self.device, weights_only=True)
        if self.adapter is None:
            self.model.load_state_dict(state["model"])
        else:
            self._load_adapter_state(state["model"], folder)
        self.master.load_state_dict(state.get("master"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.version = int(state["version"])
        torch.set_rng_state(state["rng"].cpu())
        meta = os.path.join(folder, "trainer.json")
        if os.path.exists(meta):
            with open(meta, encoding="utf-8") as f:
                extra: dict[str, Any] = json.load(f)
            return extra
        return {}

    @staticmethod
    def has_checkpoint(folder: str | os.PathLike[str]) -> bool:
        return os.path.exists(os.path.join(folder, "trainer.pt"))

    def _model_state(self) -> dict[str, Any]:
        if self.adapter is None:
            return dict(self.model.state_dict())
        return {n: p.detach() for n, p in self._adapter_parameters()}  # the shared base is not this one's to save

    def _load_adapter_state(self, saved: dict[str, Any], folder: str | os.PathLike[str]) -> None:
        torch = self.torch
        own = dict(self._adapter_parameters())
        if set(saved) != set(own):
            missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
            raise ValueError(f"the checkpoint in {folder} is not adapter {self.adapter!r} of this model: "
                             f"missing {missing[:3]}, unexpected {extra[:3]}")
        with torch.no_grad():
            for name, param in own.items():
                param.copy_(saved[name].to(device=param.device, dtype=param.dtype))


def _adamw(params: list[Any], config: TorchConfig) -> Any:
    """AdamW, fused where the device has the kernel: it updates each tensor in place, where the one-tensor-at-a-time
    AdamW takes two temporaries the size of the parameter (for a 150k-token vocabulary's embedding, GBs)."""
    import torch

    options = {"lr": config.lr, "betas": config.betas, "weight_decay": config.weight_decay}
    try:
        return torch.optim.AdamW(params, fused=True, **options)
    except RuntimeError:  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, **options)


class MasterWeights:
    """float32 master weights for the trainable parameters of a model kept in bfloat16 or float16.

    The optimizer steps :attr:`parameters`: the model's own parameter where it is float32
    already, a float32 copy where it is not. :meth:`backward` runs the backward pass and
    moves each low-precision gradient into its master's, in float32, so micro-batches add up
    without rounding; :meth:`step` clips the float32 gradients, steps the optimizer and
    writes each master back into its parameter, rounded to the parameter's dtype (what the
    engine is served). With float16 parameters the loss is scaled before backward (a
    dynamic scale: halved, and that step skipped, on an overflow; doubled after 200 clean
    steps) so that small gradients do not underflow; bfloat16 has float32's range and needs
    none. A float32 model has nothing to copy: every master is its parameter, and this is
    plain AdamW.
    """

    def __init__(self, params: Sequence[Any]) -> None:
        import torch

        self.torch = torch
        self.model_params = list(params)
        self.parameters: list[Any] = [p if p.dtype == torch.float32 else
                                      torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        self.copied = [m is not p for m, p in zip(self.parameters, self.model_params, strict=True)]
        self.loss_scale = 2.0 ** 16 if any(p.dtype == torch.float16 for p in self.model_params) else 1.0
        self._clean_steps = 0

    @property
    def active(self) -> bool:
        """Whether any parameter has a float32 copy (the model is not all float32)."""
        return any(self.copied)

    def backward(self, loss: Any) -> None:
        """``loss.backward()``, then each low-precision gradient added into its master's, in float32."""
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
        for param, master, copied in zip(self.model_params, self.parameters, self.copied, strict=True):
            if not copied or param.grad is None:
                continue
            grad = param.grad.float()
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            param.grad = None

    def step(self, optimizer: Any, max_grad_norm: float | None) -> tuple[float, str]:
        """Unscale, clip and step the masters, then round them into the model; ``(grad_norm, outcome)``.

        ``outcome``: ``"stepped"``; ``"overflow"`` (float16: the loss scale overflowed, the gradient is
        dropped); ``"flat"`` (the gradient is zero everywhere: no advantage and no KL pull reached the
        loss). A flat step is not taken: AdamW would still move every weight on its momentum and its
        weight decay, so a batch that carries no signal would change the policy.
        """
        torch = self.torch
        grads = [m.grad for m in self.parameters if m.grad is not None]
        if self.loss_scale != 1.0:
            for g in grads:
                g.div_(self.loss_scale)
            if not all(bool(torch.isfinite(g).all()) for g in grads):
                self.loss_scale /= 2.0  # an overflow: this step's gradient is lost, not applied
                self._clean_steps = 0
                optimizer.zero_grad(set_to_none=True)
                return 0.0, "overflow"
            self._clean_steps += 1
            if self._clean_steps >= 200:
                self.loss_scale *= 2.0
                self._clean_steps = 0
        if max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, max_grad_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
                if grads else 0.0
        if norm == 0.0:
            optimizer.zero_grad(set_to_none=True)
            return 0.0, "flat"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, master, copied in zip(self.model_params, self.parameters, self.copied, strict=True):
                if copied:
                    param.copy_(master)
        return norm, "stepped"

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach().cpu() for m, c in zip(self.parameters, self.copied, strict=True) if c],
                "loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Masters from :meth:`state_dict`; None (a checkpoint without them): taken from the loaded model."""
        torch = self.torch
        with torch.no_grad():
            if state is None:
                for param, master, copied in zip(self.model_params, self.parameters, self.copied, strict=True):
                    if copied:
                        master.copy_(param.float())
                return
            masters = iter(state["masters"])
            for master, copied in zip(self.parameters, self.copied, strict=True):
                if copied:
                    master.copy_(next(masters).to(master.device))
            self.loss_scale = float(state.get("loss_scale", self.loss_scale))


class _FirstPass:
    """The importance ratio and the KL to the sampler over the rows seen before an update's first optimizer step."""

    def __init__(self) -> None:
        self.tokens = 0
        self.ratio_sum = 0.0
        self.kl_sum = 0.0
        self.low = float("inf")
        self.high = float("-inf")

    def add(self, parts: Any) -> None:
        if not parts.tokens:
            return
        self.tokens += parts.tokens
        self.ratio_sum += parts.ratio_mean * parts.tokens
        self.kl_sum += parts.sampler_kl * parts.tokens
        self.low = min(self.low, parts.ratio_min)
        self.high = max(self.high, parts.ratio_max)

    def metrics(self) -> dict[str, float]:
        if not self.tokens:
            return {}
        return {"ratio_first_mean": self.ratio_sum / self.tokens, "ratio_first_min": self.low,
                "ratio_first_max": self.high, "sampler_kl": self.kl_sum / self.tokens}


def _micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of rows in groups whose padded size (rows x longest) stays within ``max_tokens`` (one row at least).

    Rows are taken shortest first, so rows of similar length share a batch and padding stays small.
    """
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        w = max(width, lengths[i])
        if current and w * (len(current) + 1) > max_tokens:
            out.append(current)
            current, w = [], lengths[i]
        current.append(i)
        width = w
    if current:
        out.append(current)
    return out


def _with_lora(model: Any, options: LoraOptions) -> Any:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError("LoRA needs peft: pip install peft") from exc
    config = LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout,
                        target_modules=list(options.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _merged_lora_state(model: Any) -> dict[str, Any]:
    """Base weights with each LoRA layer's delta added, named as in the model without peft."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    state = {k.replace(".base_layer", ""): v.detach() for k, v in base.state_dict().items() if "lora_" not in k}
    for name, found in base.named_modules():
        if isinstance(found, LoraLayer):
            module: Any = found
            weight = module.get_base_layer().weight
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            state[f"{name}.weight"] = (weight + delta).detach()
    return state
