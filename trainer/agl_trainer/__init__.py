"""agl trainer: the server side of agl.

It will hold the task queue and store server, the OpenAI-compatible gateway that
records exact token ids, LightningRL credit assignment and advantages, and the
training backends (built-in torch for one machine, verl + Ray beyond it).
"""

__version__ = "0.1.0"
