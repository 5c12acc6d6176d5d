"""`refusion bench --tps`: decoding speed of several decoders on the same prompts, batch 1.

A thin wrapper over :mod:`refusion_cli.bench`: parses and checks every option (the output
directory included) before anything is written, shows progress and the result table with Rich,
and writes the files (run.json and the CSV rows as they are measured; Markdown and plots at the
end, also after an interruption or an error, from the rows that finished; see :class:`BenchRun`
for when a previous run's files are replaced).

``--resume`` continues the interrupted run in ``--output`` instead (:mod:`refusion_cli.bench.resume`):
the same command with ``--resume`` keeps the rows in bench.csv and their samples, measures the
planned rows that are not there, appends them, and writes the report from all rows; a run with
every row there is only reported again. It refuses (one error line, exit 2, the folder
unchanged) a folder with no run.json or bench.csv, a run.json whose settings or machine differ
from this command's, and CSV files with a record this toolkit would not have written; a last
record cut mid-write and the samples of an unfinished row are dropped and measured again.

Options that take several values accept them space-separated (``--gen-length 64 128``),
comma-separated (``--batch-size 1,8``) or repeated, the grammar of every command
(:func:`~refusion_cli.cli.options.spread_values`).

Torch and the bench modules are imported inside the functions, when the command runs: ``--help``
imports none of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from refusion_cli.cli.options import (DECODER_NAMES, PATH_OPTION, CausalFirstOpt, CausalFixOpt, DecodersOpt, DeviceOpt,
                                      DtypeOpt, ModelsOpt, MultiValues, PresetOpt, RecheckOpt, SeedOpt, SetOpt,
                                      TrustRemoteCodeOpt, panel_option, option_values, route_stray_values, split_commas)
from refusion_cli.cli.libraries import libraries_imported
from refusion_cli.cli.output import console
from refusion_cli.errors import UserError
from refusion_cli.paths import check_output_dir, fresh_run_dir

if TYPE_CHECKING:
    from refusion_cli.bench.runner import BenchSettings

RUN = "What to run"
MEASURE = "How to measure"
MACHINE = "Machine"
SERVED = "Served (--endpoint)"


def bench(
    tps: Annotated[bool, typer.Option("--tps", help="measure decoding speed (tokens per second); the default and, "
                                      "for now, the only benchmark", rich_help_panel=RUN)] = True,
    decoder: Annotated[list[str] | None, panel_option(DecodersOpt, RUN, help=f"decoders to compare ({DECODER_NAMES}); default: "
                      "each decoder with an embedded model")] = None,
    model: Annotated[list[str] | None, panel_option(ModelsOpt, RUN)] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", **PATH_OPTION, help="JSONL with a 'prompt' or "
                                                 "'question' field and an optional 'target'; default: the "
                                                 "synthetic task", rich_help_panel=RUN)] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="use the first N prompts (synthetic task: 20)",
                                              rich_help_panel=RUN)] = None,
    gen_length: Annotated[list[str] | None, typer.Option("--gen-length", help=f"response length budget(s); several "
                                                         "give a sweep (default 256)",
                                                         rich_help_panel=RUN)] = None,
    batch_size: Annotated[list[str] | None, typer.Option("--batch-size", help="prompts decoded together; several "
                                                         "give a row each (default 1, the paper's setting); auto: "
                                                         "as many as the memory holds (see --max-memory)",
                                                         rich_help_panel=RUN)] = None,
    max_memory: Annotated[str | None, typer.Option("--max-memory", help="with --batch-size auto: what the weights "
                                                   "and rows may take, e.g. 20GiB (default: a GPU's free memory, "
                                                   "or the available RAM)", rich_help_panel=RUN)] = None,
    set_options: Annotated[list[str] | None, panel_option(SetOpt, RUN)] = None,
    preset: Annotated[str | None, panel_option(PresetOpt, RUN)] = None,
    ablation: Annotated[bool, typer.Option("--ablation/--no-ablation", help="also time ReFusion recomputing the KV "
                                           "cache (kv_reuse=False), the paper's ablation: a row '(recompute)' after "
                                           "each ReFusion row (default: off)", rich_help_panel=RUN)] = False,
    causal_fix: Annotated[bool, panel_option(CausalFixOpt, RUN)] = False,
    causal_first: Annotated[bool, panel_option(CausalFirstOpt, RUN)] = False,
    recheck: Annotated[bool, panel_option(RecheckOpt, RUN)] = False,
    sweep: Annotated[bool, typer.Option("--sweep", help="also time each decoder over a grid of its parallelism "
                                        "settings, a row each (refusion: k, b, τ_slot/τ_token; llada, dream: steps "
                                        "and threshold with cache), and write frontier.csv, frontier_tps.png and "
                                        "frontier_tpf.png; --set cannot fix a swept key",
                                        rich_help_panel=RUN)] = False,
    warmup: Annotated[int, typer.Option("--warmup", help="untimed decodes before each row",
                                        rich_help_panel=MEASURE)] = 1,
    counts: Annotated[bool, typer.Option("--counts", help="after timing a row, decode its prompts once more, "
                                         "untimed, counting host syncs and tensor ops per engine step, attention "
                                         "calls per layer and positions and K/V bytes copied per token (columns "
                                         "syncs/step, ops/step, attn calls/layer, positions/token, K/V copied/token)",
                                         rich_help_panel=MEASURE)] = False,
    repeats: Annotated[int, typer.Option("--repeats", help="timed decodes of every prompt",
                                         rich_help_panel=MEASURE)] = 1,
    seed: Annotated[int, panel_option(SeedOpt, MEASURE, help="seed of the sampling noise (prompt i uses seed + i)")] = 0,
    output: Annotated[Path | None, typer.Option("--output", "-o", **PATH_OPTION, help="directory for bench.csv, "
                                                "samples.csv, bench.md, run.json and the plots (default: a new "
                                                "runs/bench-<date>-<time>/ under the working directory)",
                                                rich_help_panel=MEASURE)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue the interrupted run in --output: keep its "
                                         "finished rows, measure the others (needs the same options and machine)",
                                         rich_help_panel=MEASURE)] = False,
    device: Annotated[str | None, panel_option(DeviceOpt, MACHINE)] = None,
    dtype: Annotated[str | None, panel_option(DtypeOpt, MACHINE)] = None,
    threads: Annotated[int | None, typer.Option("--threads", help="torch CPU threads",
                                                rich_help_panel=MACHINE)] = None,
    trust_remote_code: Annotated[bool, panel_option(TrustRemoteCodeOpt, MACHINE)] = False,
    endpoint: Annotated[list[str] | None, typer.Option("--endpoint", metavar="URL[=NAME]", help="load an "
                                                       "OpenAI-compatible server instead of decoding here "
                                                       "(repeatable; NAME: the model id, default the one it "
                                                       "serves); see docs/served.md", rich_help_panel=SERVED)] = None,
    concurrency: Annotated[list[str] | None, typer.Option("--concurrency", help="with --endpoint: requests in "
                                                          "flight, a level each (default 1,4,16,64)",
                                                          rich_help_panel=SERVED)] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="with --endpoint: count answer tokens "
                                                  "with this tokenizer (a local directory, embedded model or hub id) "
                                                  "instead of the replies' usage", rich_help_panel=SERVED)] = None,
    max_requests: Annotated[int | None, typer.Option("--max-requests", help="with --endpoint: requests per level "
                                                     "(default: one per prompt)", rich_help_panel=SERVED)] = None,
    max_seconds: Annotated[float | None, typer.Option("--max-seconds", help="with --endpoint: start no request "
                                                      "after this many seconds of a level (default 600)",
                                                      rich_help_panel=SERVED)] = None,
    stray: Annotated[list[str] | None, typer.Argument(
        hidden=True, show_default=False, metavar="VALUES",
        help="more values of --decoder, --gen-length, --model, --set")] = None,
) -> None:
    """Compare decoders' speed (TPS, tokens per forward, latency, memory) and accuracy on the same prompts."""
    with libraries_imported():  # here, not at the top: `refusion bench --help` stays fast
        import torch

        from refusion_cli.bench.machine import bench_machine
        from refusion_cli.bench.prompts import SYNTHETIC_TEST, load_prompts
        from refusion_cli.bench.report import ROWS_FILE, budget_warning, machine_line
        from refusion_cli.bench.resume import load_earlier, run_record
        from refusion_cli.bench.runner import budget_notes, plan_entries, resolve_models
        from refusion_cli.bench.served import check_load_options
        from refusion_cli.cli.bench_run import BenchRun, models_line, result_table
        from refusion_cli.cli.output import print_table, quiet_library_output
        from refusion_cli.decoding.memory import parse_memory

    if endpoint:  # the served bench (refusion_cli.bench.served): the servers decode, this process loads them
        from refusion_cli.bench.served import served_bench

        served_bench(endpoint, stray or [], concurrency=concurrency, tokenizer=tokenizer, max_requests=max_requests,
                     max_seconds=max_seconds, prompts=prompts, limit=limit, gen_length=gen_length, seed=seed,
                     warmup=warmup, output=output, say=lambda line: console.print(line, highlight=False,
                                                                                 soft_wrap=True),
                     in_process={"--decoder": decoder, "--model": model, "--set": set_options, "--preset": preset,
                                 "--batch-size": batch_size, "--max-memory": max_memory, "--sweep": sweep,
                                 "--resume": resume, "--causal-fix": causal_fix, "--causal-first": causal_first,
                                 "--recheck": recheck, "--counts": counts,
                                 "--repeats": None if repeats == 1 else repeats,
                                 "--device": device, "--dtype": dtype, "--threads": threads})
        return
    check_load_options({"--concurrency": concurrency, "--tokenizer": tokenizer, "--max-requests": max_requests,
                        "--max-seconds": max_seconds})
    # --tps names the measurement; it is the only one so far, so it is on whether given or not
    values = route_stray_values(stray or [], MultiValues(option_values(decoder, "--decoder"),
                                                         list(model or []), split_commas(set_options),
                                                         gen_lengths=option_values(gen_length, "--gen-length")),
                                "refusion bench")
    sizes = option_values(batch_size, "--batch-size")
    batch_sizes = tuple(parse_batch_sizes(sizes)) or (1,)
    settings = bench_settings(values, preset, batch_sizes=batch_sizes, ablation=ablation, causal_fix=causal_fix,
                              max_memory=None if max_memory is None else parse_memory(max_memory),
                              causal_first=causal_first, recheck=recheck,
                              sweep=sweep, counts=counts, warmup=warmup,
                              repeats=repeats, seed=seed, device=device, dtype=dtype,
                              trust_remote_code=trust_remote_code)
    decoders = settings.decoders
    prompt_list = load_prompts(prompts, limit)
    checkpoints = resolve_models(settings)  # each checkpoint once, each decoder's fit checked: nothing loads yet
    entries = plan_entries(settings, checkpoints)
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        cpus = os.cpu_count() or 1
        if threads > cpus:  # torch.set_num_threads with far too many threads crashes the process
            raise UserError(f"--threads {threads} is more than this machine's {cpus} CPU threads")
        torch.set_num_threads(threads)
    if output is None and resume:
        raise UserError("--resume continues the run in --output; give its folder", hint="e.g. --output runs/bench-...")
    fresh = output is None
    output = output or fresh_run_dir("bench")
    check_output_dir(output, hint="give a directory for bench.csv, bench.md and the plots")
    source = (f"{len(prompt_list)} prompts from {prompts}" if prompts is not None
              else f"the first {len(prompt_list)} problems of the synthetic task "
                   f"(evals/synthetic/{SYNTHETIC_TEST.name})")
    machine = bench_machine(settings.device, settings.dtype)
    record = run_record(settings, entries, prompt_list, source, limit=limit, threads=threads, machine=machine)
    earlier = load_earlier(output, record, entries) if resume else None
    notes = budget_notes(entries) if len(set(decoders)) > 1 else []
    run = BenchRun(settings, entries, len(prompt_list), output, source, machine, record, earlier, notes,
                   checkpoints)
    if earlier is not None and len(earlier.rows) == len(entries):
        run.write_report(interrupted=False)
        console.print(f"the run in {output} is complete ({len(entries)} rows): nothing to measure; rewrote "
                      f"{', '.join(run.written)} from {ROWS_FILE}", highlight=False, soft_wrap=True)
        return
    quiet_library_output()
    if fresh:
        console.print(f"writing to {output}/", highlight=False, soft_wrap=True)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    run.execute(prompt_list)
    print_table(result_table(run.rows))
    console.print(models_line(run.rows), highlight=False, soft_wrap=True)
    if (warning := budget_warning(run.rows)) is not None:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    console.print(machine_line(run.machine), highlight=False, soft_wrap=True)
    console.print(f"[dim]wrote {', '.join(run.written)} to {output}[/]", highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# options with several values


def bench_settings(values: MultiValues, preset: str | None, **measuring: Any) -> BenchSettings:
    """The run's settings from the options: the decoders, checkpoints, --set values and preset in the grammar
    eval and chat share (:func:`~refusion_cli.decoding.spec.parse_decoder_options`), the lengths, ``measuring``."""
    from refusion_cli.bench.runner import DEFAULT_DECODERS, DEFAULT_GEN_LENGTH, BenchSettings
    from refusion_cli.decoding.spec import one_model_each, parse_decoder_options

    choices = parse_decoder_options(values.decoders or DEFAULT_DECODERS, values.models, values.overrides, preset)
    one_model_each(choices, "refusion bench")
    return BenchSettings(
        decoders=tuple(choice.decoder for choice in choices),
        gen_lengths=tuple(parse_lengths(values.gen_lengths) or (DEFAULT_GEN_LENGTH,)),
        models={choice.decoder: choice.model for choice in choices if choice.model is not None},
        overrides={choice.decoder: dict(choice.overrides) for choice in choices if choice.overrides},
        preset=preset, **measuring)


def parse_lengths(values: list[str], option: str = "--gen-length") -> list[int]:
    """Whole numbers of ``option`` (their range is checked by BenchSettings)."""
    lengths = []
    for value in values:
        try:
            lengths.append(int(value))
        except ValueError:
            raise UserError(f"{option} must be a positive integer, got '{value}'") from None
    return lengths


def parse_batch_sizes(values: list[str]) -> list[int | str]:
    """--batch-size's whole numbers, and ``auto`` (:data:`~refusion_cli.bench.runner.AUTO_BATCH`)."""
    from refusion_cli.bench.runner import AUTO_BATCH

    return [AUTO_BATCH if value.strip().lower() == AUTO_BATCH else parse_lengths([value], "--batch-size")[0]
            for value in values]
