"""``python -m agl_core.cli ...``: the same as ``agl ...``."""

import sys

from agl_core.cli import main

if __name__ == "__main__":
    sys.exit(main())
