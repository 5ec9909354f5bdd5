"""``agl demo``: a LangChain agent that really learns, on a CPU, in minutes (see :mod:`agl_trainer.demo.run`)."""
