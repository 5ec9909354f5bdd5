"""agl's examples: real agents on real environments built here, each trainable with agl unchanged.

Each folder is one example with an ``@agl.rollout_fn`` entry point
(``examples.<name>.agent:rollout``) that ``agl worker --agent`` runs; run one
from the repository root (``python -m examples.sql_agent.agent``) or put the
root on ``PYTHONPATH`` for ``agl worker``. This file makes ``examples`` a
regular package, so it wins over any stray ``examples`` module a dependency
may have installed.
"""
