"""agl trainer: the server side of agl.

- :mod:`agl_trainer.server`: ``agl serve``, one ASGI app over one SQLite file: the
  task queue (:mod:`agl_trainer.queue`), rollouts in core's store, the model
  version, and the gateway.
- :mod:`agl_trainer.gateway`: the OpenAI-compatible gateway that records exact
  token ids per call by W3C ``traceparent`` (:mod:`agl_trainer.token_records`),
  in front of vLLM-style servers (:mod:`agl_trainer.upstream`) or the built-in
  torch engine (:mod:`agl_trainer.engine`).

Training (LightningRL), each stage its own module:

- :mod:`agl_trainer.advantages`: per-rollout advantages grouped by task (GRPO), over
  core's credit assignment (:mod:`agl_core.credit`);
- :mod:`agl_trainer.rows`: training rows per transition or per trajectory, tool tokens masked;
- :mod:`agl_trainer.loss`: PPO-clip against the gateway's sampling logprobs, KL to a reference;
- :mod:`agl_trainer.torch_backend`: the built-in backend (any Hugging Face causal LM, LoRA,
  checkpoints, new weights into the engine after each step);
- :mod:`agl_trainer.verl_backend`: rows as verl's ``DataProto``, and the verl recipe;
- :mod:`agl_trainer.training`: the loop over the server (enqueue, collect, score, rows,
  update, publish);
- :mod:`agl_trainer.demo`: ``agl demo``, a LangChain agent that learns on a CPU in minutes.

The client side (``agl.HttpStore``, ``agl worker``) lives in ``agl_core``.
"""

__version__ = "0.1.0"
