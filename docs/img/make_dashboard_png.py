"""Render docs/img/dashboard.png (and trace-viewer.png from trace-viewer.svg) in Debian's headless chromium.

The dashboard shot is the page the browser tests check: the real server on
127.0.0.1, its store filled by the same real rollouts (tests/dashboard/sample_runs.py:
agents on the plain openai client under agl's plugin, FakeOpenAI behind the
gateway), one rollout open with a span selected, and the training curves.

    .venvs/dashboard/bin/python docs/img/make_dashboard_png.py
"""

from __future__ import annotations

import math
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests" / "dashboard"))

import chromium  # noqa: E402 - the tests' browser set-up, shared on purpose
import sample_runs  # noqa: E402

from agl_core.openai_client import OpenAIInstrumentor  # noqa: E402
from agl_core.testing import FakeOpenAI  # noqa: E402
from agl_trainer.gateway import OpenAIBackend  # noqa: E402
from agl_trainer.server import ServerConfig, ServerThread, TrainerServer  # noqa: E402


def dashboard_png(out: Path) -> None:
    plugin = OpenAIInstrumentor()
    plugin.instrument(skip_dep_check=True)
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAI(script=sample_runs.script) as fake:
        server = TrainerServer(ServerConfig(db_path=f"{tmp}/agl.db", port=0), OpenAIBackend(fake.url))
        with ServerThread(server) as thread:
            sample_runs.fill(thread.url)
            sample_runs.record_curves(server)
            with chromium.browser_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1) as ctx:
                page = ctx.new_page()
                page.goto(thread.url + "/")
                page.locator("#rollouts tbody tr", has_text="calc-4").click()
                page.locator("#tree .node.k-tool").click()
                page.locator("#span-detail table.attrs").wait_for()
                page.locator("#curves svg.curve").nth(1).wait_for()
                page.screenshot(path=str(out), full_page=True)
    plugin.uninstrument()


def svg_png(svg: Path, out: Path) -> None:
    """An SVG as chromium draws it, cropped to the picture; its web fonts are refused (local fonts only)."""
    box = re.search(r'viewBox="([-\d.]+)[ ,]+([-\d.]+)[ ,]+([\d.]+)[ ,]+([\d.]+)"', svg.read_text())
    if box is None:
        raise SystemExit(f"{svg} has no viewBox: cannot size the picture")
    width, height = math.ceil(float(box[3])), math.ceil(float(box[4]))
    # the page is exactly the picture: an SVG without width and height fills the viewport
    with chromium.browser_context(viewport={"width": width, "height": height}, device_scale_factor=1) as ctx:
        ctx.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort())
        page = ctx.new_page()
        page.goto(svg.as_uri())
        page.screenshot(path=str(out))


def main() -> int:
    problem = chromium.missing()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    dashboard_png(HERE / "dashboard.png")
    print(f"wrote {HERE / 'dashboard.png'}")
    svg = HERE / "trace-viewer.svg"
    if svg.exists():
        svg_png(svg, HERE / "trace-viewer.png")
        print(f"wrote {HERE / 'trace-viewer.png'}")
    else:
        print(f"no {svg}: trace-viewer.png not made")
    return 0


if __name__ == "__main__":
    sys.exit(main())
