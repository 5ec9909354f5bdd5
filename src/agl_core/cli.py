"""``agl``: the command line. ``agl worker ...`` runs here; ``agl serve ...`` and ``agl demo`` are agl-trainer's.

Each command's module is imported only when that command runs, so ``agl worker``
needs nothing beyond agl-core.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from importlib import import_module

__all__ = ["COMMANDS", "main"]

COMMANDS: dict[str, tuple[str, str, str]] = {
    # name: (module with main(argv), distribution that ships it, what it does)
    "worker": ("agl_core.worker", "agl-core", "lease tasks from an agl server and run an agent on each"),
    "serve": ("agl_trainer.cli", "agl-trainer", "the trainer server: task queue, rollouts and the gateway"),
    "demo": ("agl_trainer.demo.run", "agl-trainer", "train a LangChain agent with RL on this CPU, in minutes"),
}


def _usage() -> str:
    lines = ["usage: agl COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<8} {about}" for name, (_, _, about) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"agl: no command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, dist, _ = COMMANDS[name]
    try:
        module = import_module(module_name)
    except ImportError as exc:
        print(f"agl {name}: needs {dist} ({exc}); pip install {dist}", file=sys.stderr)
        return 2
    command: Callable[[Sequence[str]], int] = module.main
    return command(rest)


if __name__ == "__main__":
    sys.exit(main())
