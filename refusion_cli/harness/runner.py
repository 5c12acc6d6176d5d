"""`refusion eval` without the terminal: benchmarks x decoders through lm-eval, journaled and resumable.

Contract of :func:`run_eval`:

1) plan      with ``table1``, the decoders and checkpoints are the registry's Table 1 rows
             (:func:`table1_models`: each row's folders under ``checkpoints``, every one there, or its
             hub ids); every (benchmark, decoder) config is built first (``preset``, else the model's preset,
             else the one the suite names for the benchmark, where the decoder has it, as
             ``decoding.spec.DecoderChoice.config`` orders them; the benchmark's response budget;
             then ``--set`` overrides, parsed and validated by ``decoding.spec``; with
             ``causal_fix`` / ``causal_first`` / ``recheck``, ReFusion's variants of
             ``decoding.variants`` are runs of their own after the paper's decoder); the benchmarks'
             task YAMLs are rendered and their local data checked (present, not empty, JSON lines;
             with ``download``, the missing files are fetched from the hub first, see
             ``download``), as are ``--device``, ``--dtype``, ``--output`` and ``--data-dir``; each
             distinct ``--model`` is resolved once into its record (``models.checkpoint``), which each
             decoder's fit is checked against and which the loading and the journal key read later; then
             the lm-eval tasks are built over that data (in a temporary folder). Any mistake is a
             ``UserError`` before a model is loaded or a file is written (downloaded data aside).
             With ``limit=0`` the run ends here.
2) evaluate  the task YAMLs are kept in the run folder; one model at a time (loaded once, let go
             before the next: nine 8B checkpoints need not fit together), per benchmark and per
             decoder on that model, an adapter (``lm_adapters``) with a
             :class:`~refusion_cli.harness.journal.SampleJournal` as its generation hook runs
             lm-eval's ``evaluate`` (zero-shot, the chat template, the suite's ``max_gen_toks``).
             Each sample is scored and appended to the journal as it is produced; samples already
             in the journal are not decoded again (resume).
3) report    per (benchmark, decoder + model): accuracy (mean per-sample score, in %) next to
             lm-eval's own aggregate of the same metric, TPS (total tokens / total seconds, as the
             paper) and mean per-sample TPF, totals, the config's ``settings`` label and the seed;
             ``metrics.json``, ``summary.csv`` and ``summary.md`` are rewritten after each one. A folder's
             row keeps one setting: a cell it holds under a label this run writes, with another config or
             seed, stops the run in step 1 (``check_same_settings``).

Data parallel: under ``accelerate launch`` / ``torchrun`` every process runs this; lm-eval splits
the documents by rank, each process journals its own samples, and rank 0 (the only one that writes
metrics and summaries) reads every process's journal.

Model defaults follow ``registry.default_model``; MDM decoders take ``steps = gen_length`` (one
token per step, the baselines' usual setting) and LLaDA blocks of 32 when 32 divides the length,
else one block (``registry.length_settings``), unless ``steps`` / ``block_length`` are set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from refusion_cli.decoding.registry import decoder_spec
from refusion_cli.decoding.spec import parse_decoder_options, require_refusion, settings_label
from refusion_cli.decoding.stats import mean_tps, run_tps
from refusion_cli.decoding.variants import PAPER, Variant, asked_variants, first_option, variant_options
from refusion_cli.errors import UserError
from refusion_cli.harness.download import download_missing
# the options and their checks live in eval_options; every name is importable from here too, as it was
from refusion_cli.harness.eval_options import (DecoderRun, EvalOptions, Table1Selection, check_data_dir,
                                               check_same_settings, data_file_options, decoder_runs, default_output,
                                               has_results, make_output, table1_models)
from refusion_cli.harness.journal import JournalObserver, SampleJournal, journal_files, read_records
from refusion_cli.harness.report import RunResult, merge_results, read_results, write_reports
from refusion_cli.harness.scoring import TaskScorer
from refusion_cli.harness.answers import answer_rule
from refusion_cli.harness.evaluation import run_task, seed_lm_eval
from refusion_cli.harness.manifest import EvalProtocol, Table1Row, table1_rows
from refusion_cli.harness.suite import (Benchmark, RenderedTask, Suite, check_data, data_root, load_suite, load_tasks,
                                        render)
from refusion_cli.models.chat import require_chat_template
from refusion_cli.models.checkpoint import Checkpoint, resolve_checkpoint
from refusion_cli.models.devices import free_device_memory, parse_device, parse_dtype
from refusion_cli.models.loading import LoadedModel, check_model_fits
from refusion_cli.paths import check_output_dir

if TYPE_CHECKING:
    import torch

    from refusion_cli.harness.lm_adapters import DecoderLM


class EvalObserver(JournalObserver, Protocol):
    def on_run_start(self, benchmark: Benchmark, label: str, config: Any) -> None: ...

    def on_run_end(self, result: RunResult) -> None: ...


class SilentObserver:
    def on_run_start(self, benchmark: Benchmark, label: str, config: Any) -> None: ...

    def on_requests(self, total: int, stored: int, other_settings: int) -> None: ...

    def on_sample(self, record: dict[str, Any]) -> None: ...

    def on_run_end(self, result: RunResult) -> None: ...


# --- the journal key ---------------------------------------------------------------------------


def model_fingerprint(model: str, trust_remote_code: bool = False) -> str:
    """The journal key of ``model``'s files: its record's fingerprint (:mod:`refusion_cli.models.checkpoint`)."""
    return resolve_checkpoint(model, trust_remote_code).fingerprint


def placement(model: Any) -> tuple[str, str]:
    """(device, dtype) a model runs on, as recorded with its results: the device kind and GPU name
    (no index, so a data-parallel run's processes agree), and the weights' dtype."""
    import torch

    parameter = next(model.parameters())
    device = parameter.device.type
    if device == "cuda":
        device = f"cuda ({torch.cuda.get_device_name(parameter.device)})"
    return device, str(parameter.dtype).removeprefix("torch.")


# raised when the paper protocol's answer handling changes the text a journaled response is scored on
# (2: the paper's scripts step for step: end token, special tokens after the stop strings, re-tokenised)
ANSWERS_REVISION = 2


def config_hash(decoder: str, config: Any, fingerprint: str, seed: int, chat_template: bool,
                where: tuple[str, str], metric: str, stop_token_ids: tuple[int, ...] = (), batch_size: int | str = 1,
                variant: Variant = PAPER, protocol: EvalProtocol | None = None) -> str:
    """What a journaled sample is reused under: decoder settings, model files, seed, template, device
    and dtype (another dtype decodes other tokens; another device measures other timings), and the
    metric its stored score is (another metric must score it again), the decoder's revision past
    the first (a decoder whose tokens changed decodes again; revision 1 keeps the hashes it always had),
    and the EOS ids when a response ends at several (one EOS keeps the hashes it always had), and a batch
    size above 1 (the answers are the same, the timings are not: a batch is timed as a whole), and ReFusion's
    decoding variant when it is not the paper's decoder, and the paper protocol where a benchmark's task differs
    by protocol (MATH's prompts are the same under both, its scoring is not; lm-eval's keeps the hashes it had),
    with the revision of the paper's answer handling."""
    material = {"decoder": decoder, "config": dataclasses.asdict(config), "model": fingerprint, "seed": seed,
                "chat_template": chat_template, "device": where[0], "dtype": where[1], "metric": metric}
    revision = decoder_spec(decoder).revision
    if revision > 1:
        material["revision"] = revision
    if len(stop_token_ids) > 1:
        material["stop_token_ids"] = list(stop_token_ids)
    if batch_size != 1:
        material["batch_size"] = batch_size
    if any(variant):
        material["variant"] = variant_options(variant)
    if protocol == EvalProtocol.PAPER:
        material["protocol"] = EvalProtocol.PAPER.value
        material["answers"] = ANSWERS_REVISION  # the answer handling of the paper's scripts (harness.answers)
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:12]


# --- the run -----------------------------------------------------------------------------------


@dataclass
class Plan:
    benchmarks: list[Benchmark]
    runs: list[DecoderRun]
    configs: dict[tuple[str, str], Any]  # (benchmark, decoder) -> config
    rendered: dict[str, RenderedTask]
    tasks: dict[str, dict[str, Any]]  # benchmark -> lm-eval's task dict, built over the local data
    device: torch.device  # --device, resolved (default: CUDA when available)
    dtype: torch.dtype | None  # --dtype, resolved (None: the device's default)
    sandbox: str | None = None  # how code benchmarks' candidates are isolated here (None: no code benchmark)
    # each distinct --model, resolved once: what the fit check, the loader and the journal key read
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)
    table1: list[tuple[Table1Row, str]] = field(default_factory=list)  # with --table1: each row and its model


def plan_eval(options: EvalOptions, suite: Suite | None = None,
              say: Callable[[str], None] = lambda text: None) -> Plan:
    """Step 1: everything that can fail before a model loads or a file is written: the options, each
    checkpoint's config, the data files (with ``options.download``, fetched where missing; ``say``
    gets a line per file), and lm-eval's tasks built over them (a missing package or a record without
    the fields a task reads stops the run here, not after the benchmarks before it)."""
    suite = suite or load_suite(protocol=options.protocol)
    benchmarks = suite.select(options.tasks)
    decoders, models, rows = options.decoders, options.models, []
    if options.table1 is not None:  # the registry's rows: their decoders, their folders (all there) or hub ids
        rows = table1_rows(options.table1.rows)
        decoders = list(dict.fromkeys(row.decoder for row in rows))
        models = table1_models(rows, options.table1.checkpoints)
    choices = parse_decoder_options(decoders, models, options.overrides, options.preset)
    flags = (options.causal_fix, options.causal_first, options.recheck)
    if (option := first_option(*flags)) is not None:
        require_refusion(option, [choice.decoder for choice in choices])
    runs = decoder_runs(choices, asked_variants(*flags))
    checkpoints = {model: resolve_checkpoint(model, options.trust_remote_code)
                   for model in dict.fromkeys(run.model for run in runs)}
    for run in runs:
        check_model_fits(run.decoder, checkpoints[run.model])
    if options.limit is not None and options.limit < 0:
        raise UserError(f"--limit must be a number of documents (0: check the data and tasks only), "
                        f"got {options.limit}")
    if options.limit is not None and options.limit > sys.maxsize:
        raise UserError(f"--limit {options.limit} is larger than any benchmark",
                        hint="leave --limit out to run every document")
    device = parse_device(options.device)  # a misspelt device, or CUDA this machine lacks: checked here, once
    dtype = parse_dtype(options.dtype) if options.dtype is not None else None  # None: the device's default
    check_output_dir(options.output, hint="give a folder for metrics.json, the summaries and the samples")
    if options.download and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would fetch the same files
        raise UserError("--download fetches the data in one process, not under accelerate launch or torchrun",
                        hint="fetch it first with the same refusion eval command and --download --limit 0, then launch")
    configs = {(b.name, run.label): run.config(b) for b in benchmarks for run in runs}
    check_same_settings(options.output, runs, suite.benchmarks, options.seed)
    sandbox = None
    if any(b.code for b in benchmarks) and options.limit != 0:  # with --limit 0 no code runs
        from refusion_cli.harness.code_tasks import require_confirmation, sandbox_line

        require_confirmation(options.confirm_run_unsafe_code)
        sandbox = sandbox_line()
    files = data_file_options(options.data_files, benchmarks)
    rendered = {}
    for benchmark in benchmarks:
        rendered[benchmark.name] = render(benchmark, options.output / "tasks" / benchmark.name, options.data_dir,
                                          files.get(benchmark.name))
    if options.data_dir is not None:
        check_data_dir(options.data_dir, rendered, options.download)
    if options.download:
        download_missing(rendered.values(), data_root(options.data_dir), say)
    for task in rendered.values():
        check_data(task)
    tasks = {}
    with tempfile.TemporaryDirectory(prefix="refusion-tasks-") as scratch:  # the run folder does not exist yet
        for benchmark in benchmarks:
            seed_lm_eval(options.seed)  # GPQA shuffles its choices while it is built
            tasks[benchmark.name] = load_tasks(rendered[benchmark.name], Path(scratch) / benchmark.name)
    return Plan(benchmarks, runs, configs, rendered, tasks, device, dtype, sandbox, checkpoints,
                [(row, model.partition("=")[2]) for row, model in zip(rows, models)])


def run_eval(options: EvalOptions, observer: EvalObserver | None = None, suite: Suite | None = None,
             plan: Plan | None = None) -> list[RunResult]:
    """Steps 1-3 (see the module docstring; ``plan`` skips step 1); returns the results rank 0
    reported (empty on other ranks)."""
    from refusion_cli.harness.lm_adapters import ADAPTERS, distributed_context
    from refusion_cli.models.loading import load_model

    observer = observer or SilentObserver()
    plan = plan or plan_eval(options, suite)
    if options.limit == 0:
        return []
    rank, _, accelerator = distributed_context(plan.device)
    device = accelerator.device if accelerator is not None else plan.device  # one device per process
    results: list[RunResult] = []
    earlier = read_results(options.output) if rank == 0 else []  # cells of earlier runs into this folder
    for benchmark in plan.benchmarks:
        plan.rendered[benchmark.name].write()  # the task YAML, kept with the results
    scorers = {benchmark.name: TaskScorer(plan.tasks[benchmark.name]["tasks"], benchmark.metric,
                                          benchmark.metric_filter) for benchmark in plan.benchmarks}
    loaded: LoadedModel | None = None
    adapter: DecoderLM | None = None
    for model, checkpoint in plan.checkpoints.items():  # one model in memory at a time
        runs = [run for run in plan.runs if run.model == model]
        loaded = load_model(checkpoint, device, plan.dtype,
                            require_mask=any(decoder_spec(run.decoder).needs_mask for run in runs))
        fingerprint, where = checkpoint.fingerprint, placement(loaded.model)
        warmed: set[str] = set()  # decoders whose adapter has warmed up on this model
        for benchmark in plan.benchmarks:
            if benchmark.chat_template:
                require_chat_template(loaded.tokenizer, f"'{model}'")
            for run in runs:
                config = plan.configs[(benchmark.name, run.label)]
                end_ids = answer_rule(run.decoder, benchmark.answer_protocol).end_ids(loaded)
                digest = config_hash(run.decoder, config, fingerprint, options.seed, benchmark.chat_template, where,
                                     benchmark.metric_key, end_ids, options.batch_size, run.variant,
                                     benchmark.task_protocol)
                journal = SampleJournal(options.output / "samples" / benchmark.name, benchmark=benchmark.name,
                                        decoder=run.decoder, model=model, label=run.file_label, config_hash=digest,
                                        scorer=scorers[benchmark.name], rank=rank, observer=observer)
                adapter = ADAPTERS[run.decoder](pretrained=loaded, config=config, seed=options.seed, device=str(device),
                                                batch_size=options.batch_size, max_memory=options.max_memory,
                                                protocol=benchmark.answer_protocol,
                                                hook=journal, warmed_up=run.decoder in warmed,
                                                **variant_options(run.variant))
                observer.on_run_start(benchmark, run.label, config)
                evaluation = run_task(adapter, benchmark, plan.tasks[benchmark.name], gen_length=config.gen_length,
                                      limit=options.limit, seed=options.seed,
                                      confirm_run_unsafe_code=options.confirm_run_unsafe_code)
                if adapter.warmed_up:
                    warmed.add(run.decoder)
                if rank != 0 or evaluation is None:
                    continue
                result = summarize(benchmark, run, config, digest, evaluation, journal, where, options.batch_size,
                                   adapter.batch_notes, options.seed)
                results.append(result)
                write_reports(options.output, merge_results(earlier, results))
                observer.on_run_end(result)
        loaded = adapter = None  # the next model loads into the memory this one held
        free_device_memory(device)
    return results


def summarize(benchmark: Benchmark, run: DecoderRun, config: Any, digest: str, evaluation: dict[str, Any],
              journal: SampleJournal, where: tuple[str, str], batch_size: int | str = 1,
              batch_notes: list[str] | None = None, seed: int = 0) -> RunResult:
    """Step 3 for one (benchmark, decoder): the journal's records of the documents lm-eval scored;
    ``batch_notes``: what batch size auto chose and every halving (the adapter's); with auto the cell's
    batch size is the largest its samples were decoded in."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for record in read_records(journal_files(journal.directory, journal.label)):
        if record.get("config_hash") == digest:
            latest[(record["subtask"], record["doc_id"])] = record
    chosen = []
    for subtask, samples in evaluation.get("samples", {}).items():
        for sample in samples:
            if sample.get("filter") not in (None, benchmark.metric_filter):
                continue
            scored = latest.get((subtask, sample["doc_id"]))
            if scored is None:
                raise RuntimeError(f"no journal record for {subtask} document {sample['doc_id']} in {journal.directory}")
            chosen.append(scored)
    n = len(chosen)
    top = evaluation.get("groups", {}).get(benchmark.lm_eval_task) or evaluation["results"].get(benchmark.lm_eval_task, {})
    lm_eval_value = top.get(benchmark.metric_key)
    return RunResult(
        benchmark=benchmark.name, title=benchmark.title, decoder=run.decoder, model=run.model, label=run.label,
        config_hash=digest, config=dataclasses.asdict(config), settings=settings_label(run.decoder, config), seed=seed,
        samples=n,
        accuracy=100.0 * sum(r["score"] for r in chosen) / n if n else 0.0,
        lm_eval_accuracy=None if lm_eval_value is None else 100.0 * float(lm_eval_value),
        tps=run_tps([r["tokens"] for r in chosen], [r["seconds"] for r in chosen]),  # each decode's own latency
        throughput=run_tps([r["tokens"] for r in chosen], [r.get("wall_share", r["seconds"]) for r in chosen]),
        tps_sample_mean=mean_tps([r["tokens"] for r in chosen], [r["seconds"] for r in chosen]),
        tpf=sum(r["tpf"] for r in chosen) / n if n else 0.0,
        tokens=sum(r["tokens"] for r in chosen), forwards=sum(r["forwards"] for r in chosen),
        seconds=sum(r["seconds"] for r in chosen), decoded=journal.decoded,
        resumed=sum(r["key"] in journal.earlier for r in chosen), metric=benchmark.metric_key,
        lm_eval_results={name: _plain(values) for name, values in
                         {**evaluation["results"], **evaluation.get("groups", {})}.items()},
        device=where[0], dtype=where[1], prompts_cut=sum(r.get("prompt_cut", 0) > 0 for r in chosen),
        batch_size=batch_size if isinstance(batch_size, int) else max((r.get("batch_rows", 1) for r in chosen), default=1),
        batch_notes=list(batch_notes or []),
        protocol=benchmark.task_protocol.value if benchmark.task_protocol else "",
        also={key: 100.0 * float(top[key]) for key in benchmark.also if top.get(key) is not None},
        sandbox=sandbox_record() if benchmark.code else {},
    )


def sandbox_record() -> dict[str, Any]:
    """How this process ran code candidates (user, interpreter, packages reachable), for the run's metadata."""
    from refusion_cli.harness.sandbox import isolation

    return isolation().record()


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's result entry with only JSON-friendly values."""
    return {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool)) or v is None}
