"""agl trainer: the server side of agl.

- :mod:`agl_trainer.server`: ``agl serve``, one ASGI app over one SQLite file: the
  task queue (:mod:`agl_trainer.queue`), rollouts in core's store, the model
  version, and the gateway.
- :mod:`agl_trainer.gateway`: the OpenAI-compatible gateway that records exact
  token ids per call by W3C ``traceparent`` (:mod:`agl_trainer.token_records`),
  in front of vLLM-style servers (:mod:`agl_trainer.upstream`) or the built-in
  torch engine (:mod:`agl_trainer.engine`).

The client side (``agl.HttpStore``, ``agl worker``) lives in ``agl_core``.
Credit assignment, advantages and the training backends come next (issue 8).
"""

__version__ = "0.1.0"
