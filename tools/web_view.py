"""Drive ``refusion serve``'s web view in a real browser (Debian's chromium, headless, through Playwright) and
read the finished answer from the page; ``python -m tools.web_view`` also saves the screenshot of docs/serve.md.

    python -m tools.web_view --output docs/serve-web-view.png   # serves refusion-tiny on a free port itself
"""

from __future__ import annotations

import argparse
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium() -> str | None:
    """The path of Debian's chromium (``apt-get install -y chromium``), or None."""
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


@dataclass
class PageAnswer:
    answer: str  # the text the page shows as the answer
    kinds: dict[str, int]  # canvas cells per commit kind ("mask": still open)
    stats: str  # the line the page prints when the answer ends
    error: str


def drive(base: str, model: str, prompt: str, max_tokens: int, screenshot: Path | None = None,
          timeout_s: float = 60) -> PageAnswer:
    """Open the page at ``base``, ask ``prompt`` with ``model``, wait for the answer to finish, read it back."""
    from playwright.sync_api import sync_playwright

    executable = chromium()
    if executable is None:
        raise RuntimeError("no chromium on PATH: apt-get install -y chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.goto(base + "/")
            page.wait_for_selector(f"#model option[value='{model}']", state="attached")
            page.select_option("#model", model)
            page.fill("#prompt", prompt)
            page.fill("#max-tokens", str(max_tokens))
            page.click("#run")
            page.wait_for_selector("#answer[data-done='true'], #answer[data-done='error']", timeout=timeout_s * 1000)
            kinds: dict[str, int] = {}
            for name in page.eval_on_selector_all("#canvas .cell", "cells => cells.map(c => c.className)"):
                kind = next((part[2:] for part in name.split() if part.startswith("k-")), "mask")
                kinds[kind] = kinds.get(kind, 0) + 1
            result = PageAnswer(page.text_content("#answer") or "", kinds, page.text_content("#stats") or "",
                                page.text_content("#error") or "")
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
            return result
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("docs/serve-web-view.png"))
    parser.add_argument("--prompt", default="Mia has 12 apples. She buys 7 more apples. Then she gives 5 apples to "
                                            "Max. How many apples does Mia have now?")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    import uvicorn

    from refusion_cli.decoding.spec import DecoderChoice
    from refusion_cli.models.loading import load_model
    from refusion_cli.serve.app import ServerState, create_app
    from refusion_cli.serve.engine import Scheduler
    from refusion_cli.serve.metrics import ServeMetrics
    from refusion_cli.serve.protocol import ServedModel

    loaded = load_model("refusion-tiny", "cpu")
    served = {name: ServedModel(name, DecoderChoice(name, "refusion-tiny")) for name in ("refusion", "ar")}
    metrics = ServeMetrics()
    state = ServerState(served, {"refusion-tiny": Scheduler(loaded, "refusion-tiny", stats=metrics)}, metrics)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        result = drive(f"http://127.0.0.1:{port}", "refusion", args.prompt, args.max_tokens, screenshot=args.output)
    finally:
        server.should_exit = True
        thread.join()
    print(f"answer: {result.answer!r}\ncells: {result.kinds}\n{result.stats}\nscreenshot: {args.output}")


if __name__ == "__main__":
    main()
