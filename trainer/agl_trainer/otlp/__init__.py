"""OTLP in: ``agl serve`` as an OpenTelemetry trace receiver (``POST /v1/traces``).

An agent traced by anything that exports OTLP/HTTP (OpenInference, OpenLLMetry, the OpenTelemetry GenAI
instrumentations, Pydantic AI, the Vercel AI SDK, in any language) sends its spans here; each span is
mapped from its convention to agl's (:mod:`agl_trainer.otlp.conventions`), grouped into rollouts
(:mod:`agl_trainer.otlp.grouping`) and stored, and the server builds transitions from them as from any
rollout. :mod:`agl_trainer.otlp.receiver` is the HTTP side: the OTLP/HTTP specification's content
types, compression and answers.
"""

from agl_trainer.otlp.receiver import TracesReceiver

__all__ = ["TracesReceiver"]
