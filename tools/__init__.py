"""Maintainer scripts: rebuild the embedded models, regenerate the synthetic task, measure the decoders.

Run them from the repository root, e.g. ``python -m tools.build_models`` (what ``make models`` runs),
``python -m tools.synthetic``, ``python -m tools.tokenizer``, ``python -m tools.probe``,
``python -m tools.overhead``. They import the library; the library never imports them (an
import-linter contract in pyproject.toml), and they are not part of the installed package.
"""
