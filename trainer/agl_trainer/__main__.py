"""``python -m agl_trainer ...``: the same as ``agl serve ...``."""

import sys

from agl_trainer.cli import main

sys.exit(main())
