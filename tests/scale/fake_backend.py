"""``python fake_backend.py [PORT]``: FakeOpenAI with the scale tests' script, in a process of its own.

It prints ``url <base url>`` once listening and serves until its standard input
closes or it gets SIGTERM, so the model's work never shares a GIL with the
server or the workers whose load is being measured.
"""

from __future__ import annotations

import signal
import sys
import threading

from scale_agents import model_reply

from agl_core.testing import FakeOpenAI


def main() -> None:
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0  # a fixed port: the crash test kills it and starts it again
    with FakeOpenAI(script=model_reply, model="policy", port=port) as srv:
        print(f"url {srv.url}", flush=True)
        done.wait()


if __name__ == "__main__":
    main()
