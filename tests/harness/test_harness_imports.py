"""The harness's result files know nothing of the run that writes them: no import, at any depth, from
``harness.report`` back to ``harness.runner`` (the runner imports the report)."""

from __future__ import annotations

import grimp


def test_report_does_not_import_the_runner():
    graph = grimp.build_graph("refusion_cli", cache_dir=None)
    assert graph.find_shortest_chain(importer="refusion_cli.harness.runner", imported="refusion_cli.harness.report")
    assert graph.find_shortest_chain(importer="refusion_cli.harness.report", imported="refusion_cli.harness.runner") is None
