"""Debian's chromium driven by Playwright, offline: the browser of the dashboard tests and screenshots.

Playwright's own browser builds are never downloaded (no ``playwright install``):
``executable_path`` points at the system browser, and the flags keep it from
reaching anything but the server under test.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM = os.environ.get("AGL_CHROMIUM", "/usr/bin/chromium")

ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def missing() -> str | None:
    """Why the browser cannot run here, or None."""
    if not os.path.isfile(CHROMIUM) or not os.access(CHROMIUM, os.X_OK):
        return (f"no chromium at {CHROMIUM}: the dashboard's browser tests need Debian's chromium "
                f"(apt-get install -y chromium; .ci/run installs it), or AGL_CHROMIUM=/path/to/chromium")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is missing: pip install -r tests/dashboard/requirements.txt"
    return None


@contextmanager
def browser_context(**context: Any) -> Iterator[Any]:
    """A Playwright browser context on a fresh profile in a temporary folder, closed afterwards."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="agl-chromium-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=ARGS, **context)
        try:
            yield ctx
        finally:
            ctx.close()
