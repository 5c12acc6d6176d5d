"""The web view at ``/`` in a real browser: headless Debian chromium loads the page, submits a prompt, and the
answer it shows is the API's; the canvas shows ReFusion's commit kinds."""

from __future__ import annotations

import pytest

from refusion_cli.models.loading import load_model
from tests.serve.helpers import in_process, running_server, served
from tools.web_view import chromium, drive

PROMPT = "Mia has 12 apples. She buys 7 more apples. How many apples does Mia have now?"


@pytest.mark.skipif(chromium() is None, reason="no chromium (apt-get install -y chromium; .ci/run installs it)")
def test_the_web_view_shows_the_answer_and_the_canvas(tmp_path):
    loaded = load_model("refusion-tiny", "cpu")
    models = served(["refusion", "ar"])
    with running_server(loaded, models) as (base, _):
        shown = drive(base, "refusion", PROMPT, 64, screenshot=tmp_path / "page.png")
    answer, tokens, forwards = in_process(loaded, models["refusion"], PROMPT, 64)
    assert shown.error == ""
    assert shown.answer == answer
    assert shown.kinds.get("first", 0) >= 1 and sum(shown.kinds.values()) >= tokens  # every position drawn
    assert f"{tokens} tokens" in shown.stats and f"{forwards} forwards" in shown.stats
    assert (tmp_path / "page.png").stat().st_size > 10_000
