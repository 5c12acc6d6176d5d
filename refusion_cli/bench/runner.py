"""The speed benchmark: the same prompts through several decoders, batch 1, one counting rule.

Contract:

- :class:`BenchSettings` holds what to run and checks the options on their own (decoder names,
  lengths, device, dtype); :func:`plan_entries` checks the rest (``--set`` options through
  ``build_config``, checkpoint paths) before any model loads,
  and returns the rows to measure: one per decoder and response length, plus, with ``ablation``, "refusion
  (recompute)" (``kv_reuse=False``, the paper's ablation) after each ReFusion row, and "refusion
  (causal fix)" (``causal_fix=True``), "refusion (causal first)" (``causal_first=True``), "refusion
  (recheck)" (``recheck=True``) and, when asked for together, "refusion (causal fix + first)" and
  "refusion (causal fix + first + recheck)" (this toolkit's ablations); with ``sweep``, a
  row per point of the decoder's grid (:mod:`refusion_cli.bench.sweep`) after its usual rows, then
  the same grid for each variant ("refusion (recheck) k=4 b=16 τ=0.6/0.2"). AR's
  rows come first, so every later row knows AR's TPS at its length (the speed-up column).
- :func:`resolve_models` resolves each distinct checkpoint once (``models.checkpoint``) and checks each
  decoder's fit to its record; the loading reads the same records.
- :func:`run_bench` measures the entries in that order and yields one :class:`BenchRow` as soon as
  each is done; ``on_sample`` sees every measured decode as it finishes. One model is held at a
  time (loaded once for the entries on it, with a mask token required when any of their decoders
  needs one, released when the next entry needs another).
  A resumed run passes the entries still to measure and AR's TPS from the rows measured before.
- ``machine.bench_machine`` describes the machine before any model loads (the device and dtype
  resolved as ``load_model`` resolves them), so that ``--resume`` can compare it first.
- A row: ``warmup`` decodes (prompts in order, not recorded), then every prompt ``repeats``
  times. Each decode is timed by the decoder itself (``DecodeStats.seconds``: the wall time of
  the decode call, the device synchronised at both ends) and counted the same way for every
  decoder (``tokens`` up to and including EOS, ``forwards`` = every model call). A row's
  ``tps``, ``tpf``, ``tokens`` and ``forwards`` are means over its decodes of the per-decode
  values (TPS "averaged over the benchmark", as the paper reports it); latency p50 / p95 are
  percentiles (linear interpolation) of the decode wall times; ``accuracy`` is the share of
  decodes of prompts with a target whose text ``is_correct``.
- Every decode of prompt i draws from its own ``torch.Generator`` seeded ``seed + i``, so
  repeats (and reruns) decode the same tokens; only the timings vary.
- With ``counts`` (``--counts``) a timed row's prompts are decoded once more, untimed, as the row decodes
  them, under :mod:`refusion_cli.bench.counts`' counter (:func:`count_entry`): host syncs per engine step,
  attention calls per layer per model call, positions and K/V bytes copied per generated token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from refusion_cli.bench.figures import BenchRow, BenchSample, CallTally, bench_sample, summarise, with_counts
from refusion_cli.bench.machine import PeakMemory
from refusion_cli.bench.prompts import BenchPrompt
from refusion_cli.bench.sweep import check_swept_overrides, setting_label, sweep_configs
from refusion_cli.decoding.registry import BASELINE, EMBEDDED_DECODERS, decoder_spec, default_model
from refusion_cli.decoding.engine import Engine, run_decoder
from refusion_cli.decoding.spec import PRESET_DECODER, DecoderChoice, check_preset, require_refusion
from refusion_cli.decoding.stats import DecodeResult, RowClock, synchronize
from refusion_cli.decoding.variants import asked_variants, first_option, variant_label, variant_options
from refusion_cli.errors import UserError
from refusion_cli.models.chat import require_chat_template, user_prompt_ids
from refusion_cli.models.checkpoint import Checkpoint, resolve_checkpoint
from refusion_cli.models.devices import free_device_memory, parse_device, parse_dtype
from refusion_cli.models.loading import LoadedModel, check_model_fits, load_model

if TYPE_CHECKING:
    from refusion_cli.bench.counts import DecodeCounts

DEFAULT_DECODERS = EMBEDDED_DECODERS  # every decoder with an embedded model
AUTO_BATCH = "auto"  # --batch-size auto: as many rows as the memory model fits
DEFAULT_GEN_LENGTH = 256
RECOMPUTE = " (recompute)"  # label suffix of the kv_reuse=False ablation


@dataclass(frozen=True)
class BenchSettings:
    decoders: tuple[str, ...] = DEFAULT_DECODERS
    gen_lengths: tuple[int, ...] = (DEFAULT_GEN_LENGTH,)
    batch_sizes: tuple[int | str, ...] = (1,)  # prompts decoded together (1 is the paper's setting), or AUTO_BATCH
    max_memory: int | None = None  # bytes the weights and rows may take with AUTO_BATCH (None: the free memory)
    models: dict[str, str] = field(default_factory=dict)  # decoder -> checkpoint (default: its embedded model)
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)  # decoder -> {config option: value}
    preset: str | None = None  # a preset of the decoders that have it (registry), under the overrides
    ablation: bool = False  # also time ReFusion with kv_reuse=False (--ablation)
    causal_fix: bool = False  # also time ReFusion with causal_fix=True
    causal_first: bool = False  # also time ReFusion with causal_first=True (and both, with causal_fix)
    recheck: bool = False  # also time ReFusion with recheck=True (and all three, with causal_fix and causal_first)
    sweep: bool = False  # also time each decoder over its grid of parallelism settings (bench/sweep.py)
    counts: bool = False  # decode each row once more, untimed, under bench.counts' counter (--counts)
    warmup: int = 1  # untimed decodes before each row
    repeats: int = 1  # timed decodes of every prompt
    seed: int = 0
    device: str | None = None  # None: CUDA when available
    dtype: str | None = None  # None: bf16 on CUDA, float32 on CPU
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not self.decoders:
            raise UserError("give at least one decoder")
        for name in self.decoders:
            decoder_spec(name)
        for length in self.gen_lengths:
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise UserError(f"--gen-length must be a positive integer, got {length}")
        if not self.gen_lengths:
            raise UserError("give at least one --gen-length")
        for size in self.batch_sizes:
            if size != AUTO_BATCH and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise UserError(f"--batch-size must be a positive integer or auto, got {size}")
        if self.max_memory is not None and AUTO_BATCH not in self.batch_sizes:
            raise UserError("--max-memory bounds --batch-size auto; give --batch-size auto with it")
        if not self.batch_sizes:
            raise UserError("give at least one --batch-size")
        for option, names in (("--model", self.models), ("--set", self.overrides)):
            stray = [name for name in names if name not in self.decoders]
            if stray:
                raise UserError(f"{option} names {', '.join(stray)}, which is not among the decoders benchmarked "
                                f"({', '.join(self.decoders)})")
        if (flag := first_option(self.causal_fix, self.causal_first, self.recheck)) is not None:
            require_refusion(flag, self.decoders, "benchmarked")
        if self.sweep:
            check_swept_overrides(self.overrides)
        if self.preset is not None:
            check_preset(self.preset, self.decoders, "benchmarked")  # before any model is loaded
        if self.warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {self.warmup}")
        if self.repeats < 1:
            raise UserError(f"--repeats must be >= 1, got {self.repeats}")
        parse_device(self.device)  # a misspelt or absent device fails here, not when the first model loads
        if self.dtype is not None:
            parse_dtype(self.dtype)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BenchEntry:
    """One row to measure: a decoder with its config, on its model, at one response length."""

    label: str  # "refusion", "refusion (recompute)", "ar", ...
    decoder: str
    model: str  # the checkpoint as given (embedded name, directory or hub id)
    gen_length: int
    config: Any
    kv_reuse: bool = True
    causal_fix: bool = False
    causal_first: bool = False
    recheck: bool = False
    batch_size: int = 1  # prompts decoded together (refill: a finished row's place goes to the next prompt)
    auto: bool = False  # --batch-size auto: rows admitted while the memory model fits them (batch_size unused)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # the config (a dataclass) as a dict of its fields


# ---------------------------------------------------------------------------------------------
# planning


def decoder_config(decoder: str, gen_length: int, overrides: dict[str, str] | None = None,
                   preset: str | None = None, model: str | None = None) -> Any:
    """The config a decoder is benchmarked with at ``gen_length``: its defaults (LLaDA and Dream:
    one token per step; LLaDA: blocks of 32 when 32 divides the length), its preset of that name, else
    ``model``'s own, then ``overrides`` (:class:`~refusion_cli.decoding.spec.DecoderChoice`, as every command)."""
    overrides = dict(overrides or {})
    if "gen_length" in overrides:
        raise UserError(f"set the response length with --gen-length, not --set {decoder}.gen_length")
    return DecoderChoice(decoder, model, preset, overrides).config(gen_length)


def measuring_order(decoders: Sequence[str]) -> list[str]:
    """The decoders in the order their rows are measured: each once, AR first, the others as given."""
    return sorted(dict.fromkeys(decoders), key=lambda name: name != BASELINE)  # stable


def measured_lengths(lengths: Sequence[Any]) -> list[Any]:
    """The response lengths measured, in the order given: a length given twice is measured once."""
    return list(dict.fromkeys(lengths))


def bench_models(settings: BenchSettings) -> dict[str, str]:
    """decoder -> the checkpoint it is benchmarked on (``--model``, else its embedded model), in measuring order."""
    return {decoder: settings.models.get(decoder) or default_model(decoder)
            for decoder in measuring_order(settings.decoders)}


def resolve_models(settings: BenchSettings) -> dict[str, Checkpoint]:
    """Each distinct checkpoint of the run resolved once (checkpoint -> its record), each decoder's fit to it
    checked: a missing or unfitting checkpoint fails now, before any row runs."""
    models = bench_models(settings)
    checkpoints = {model: resolve_checkpoint(model, settings.trust_remote_code)
                   for model in dict.fromkeys(models.values())}
    for decoder, model in models.items():
        check_model_fits(decoder, checkpoints[model])
    return checkpoints


def plan_entries(settings: BenchSettings, checkpoints: Mapping[str, Checkpoint] | None = None) -> list[BenchEntry]:
    """Every row of the run, in measuring order (AR first); everything is checked here (the checkpoints too,
    unless ``checkpoints`` holds the records :func:`resolve_models` checked)."""
    decoders = measuring_order(settings.decoders)
    lengths = measured_lengths(settings.gen_lengths)
    models = bench_models(settings)
    configs = {(decoder, length): decoder_config(decoder, length, settings.overrides.get(decoder), settings.preset,
                                                 models[decoder])
               for decoder in decoders for length in lengths}
    if checkpoints is None:
        resolve_models(settings)
    entries: list[BenchEntry] = []
    for decoder in decoders:
        for length in lengths:
            config = configs[decoder, length]
            entries.append(BenchEntry(decoder, decoder, models[decoder], length, config))
            for size in measured_lengths(settings.batch_sizes):
                if size == AUTO_BATCH:
                    entries.append(BenchEntry(decoder + batch_suffix(AUTO_BATCH), decoder, models[decoder], length,
                                              config, auto=True))
                elif isinstance(size, int) and size > 1:
                    entries.append(BenchEntry(decoder + batch_suffix(size), decoder, models[decoder], length, config,
                                              batch_size=size))
            if decoder == PRESET_DECODER and settings.ablation:
                entries.append(BenchEntry(decoder + RECOMPUTE, decoder, models[decoder], length, config,
                                          kv_reuse=False))
            variants = (asked_variants(settings.causal_fix, settings.causal_first, settings.recheck)
                        if decoder == PRESET_DECODER else [])
            entries += [BenchEntry(variant_label(decoder, flags), decoder, models[decoder], length, config,
                                   **variant_options(flags)) for flags in variants]
            if settings.sweep:  # the decoder's grid, then each variant's
                for flags in [(False, False, False), *variants]:
                    name = variant_label(decoder, flags)
                    entries += [BenchEntry(f"{name} {setting_label(decoder, point)}", decoder, models[decoder],
                                           length, point, **variant_options(flags))
                                for point in sweep_configs(decoder, config)]
    return entries


def variant_name(entry: BenchEntry) -> str:
    """The entry's decoder, and its variant if it is one (:func:`variant_label`)."""
    return variant_label(entry.decoder, (entry.causal_fix, entry.causal_first, entry.recheck))


def batch_suffix(size: int | str) -> str:
    """The label suffix of a row decoded ``size`` prompts at a time."""
    return f" (batch {size})"


def budget_notes(entries: list[BenchEntry]) -> list[str]:
    """Where ReFusion's response budget differs from the --gen-length the other decoders stop at:
    its ``gen_length`` is rounded up to whole slots, so it may decode more tokens than they can."""
    notes = {}
    for entry in entries:
        padded = getattr(entry.config, "padded_length", entry.gen_length)
        if padded != entry.gen_length:
            notes[entry.gen_length, padded] = (
                f"at --gen-length {entry.gen_length} refusion may decode up to {padded} tokens (gen_length is "
                f"rounded up to a multiple of slot_size {entry.config.slot_size}); the other decoders stop at "
                f"{entry.gen_length}")
    return list(notes.values())


# ---------------------------------------------------------------------------------------------
# measuring


class ModelSlot:
    """Holds one loaded model at a time, keyed by its checkpoint: the entries on one checkpoint share one load,
    with a mask token required when any of their decoders needs one."""

    def __init__(self, settings: BenchSettings, checkpoints: Mapping[str, Checkpoint],
                 needs_mask: Mapping[str, bool]):
        self.settings = settings
        self.checkpoints = checkpoints  # checkpoint -> its record, resolved and fitted while planning
        self.needs_mask = needs_mask  # checkpoint -> whether a decoder run on it needs a mask token
        self.key: str | None = None
        self.loaded: LoadedModel | None = None

    def get(self, model: str) -> LoadedModel:
        if model != self.key:
            self.release()
            self.loaded = load_model(self.checkpoints[model], self.settings.device, self.settings.dtype,
                                     require_mask=self.needs_mask[model])
            self.key = model
        assert self.loaded is not None
        return self.loaded

    def release(self) -> None:
        if self.loaded is None:
            return
        device = next(self.loaded.model.parameters()).device
        self.loaded, self.key = None, None
        free_device_memory(device)


def run_bench(
    settings: BenchSettings,
    prompts: Sequence[BenchPrompt],
    *,
    entries: Sequence[BenchEntry] | None = None,
    ar_tps: Mapping[int, float] | None = None,
    on_entry: Callable[[BenchEntry, LoadedModel], None] | None = None,
    on_sample: Callable[[BenchSample], None] | None = None,
    checkpoints: Mapping[str, Checkpoint] | None = None,
) -> Iterator[BenchRow]:
    """Measure every entry (``plan_entries(settings)`` unless given); yield each row when it is done.

    ``ar_tps``: AR's TPS per response length from rows measured before (a resumed run), for the speed-up.
    ``checkpoints``: the records :func:`resolve_models` made while planning (default: resolved here).
    """
    if not prompts:
        raise UserError("there are no prompts to benchmark")
    if checkpoints is None:
        checkpoints = resolve_models(settings)
    entries = plan_entries(settings, checkpoints) if entries is None else entries
    needs_mask = dict.fromkeys((entry.model for entry in entries), False)  # one load serves every decoder on it
    for entry in entries:
        needs_mask[entry.model] |= decoder_spec(entry.decoder).needs_mask
    slot = ModelSlot(settings, checkpoints, needs_mask)
    ar_tps_at = dict(ar_tps or {})  # length -> AR's TPS; this run's AR rows added as they finish
    ids_key: str | None = None
    prompt_ids: list[list[int]] = []
    try:
        for entry in entries:
            loaded = slot.get(entry.model)
            if slot.key != ids_key:  # each checkpoint renders the prompts with its own chat template
                require_chat_template(loaded.tokenizer, f"'{entry.model}'")
                prompt_ids = [user_prompt_ids(loaded.tokenizer, prompt.text) for prompt in prompts]
                ids_key = slot.key
            if on_entry is not None:
                on_entry(entry, loaded)
            row = measure_entry(entry, loaded, prompt_ids, prompts, settings, ar_tps_at.get(entry.gen_length),
                                on_sample)
            if settings.counts:
                row = with_counts(row, *count_entry(entry, loaded, prompt_ids, settings))
            del loaded  # the slot holds the only reference: switching models frees this one before the next loads
            if entry.decoder == BASELINE and entry.batch_size == 1:
                ar_tps_at[entry.gen_length] = row.tps
                row.speedup_vs_ar = 1.0 if row.tps > 0 else None
            yield row
    finally:
        slot.release()


def measure_entry(
    entry: BenchEntry,
    loaded: LoadedModel,
    prompt_ids: Sequence[list[int]],
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    ar_tps: float | None,
    on_sample: Callable[[BenchSample], None] | None = None,
) -> BenchRow:
    """Warm up, then decode every prompt ``repeats`` times inside one peak-memory window."""
    device = next(loaded.model.parameters()).device
    tally = CallTally()

    def decode(index: int, timed: bool = True) -> DecodeResult:
        generator = torch.Generator(device=device).manual_seed(settings.seed + index)  # noise drawn where it is used
        engine = Engine(loaded.model)
        result = run_decoder(entry.decoder, loaded.model, prompt_ids[index], entry.config,
                             mask_token_id=loaded.mask_token_id, eos_token_id=loaded.stop_token_ids,
                             generator=generator, kv_reuse=entry.kv_reuse, causal_fix=entry.causal_fix,
                             causal_first=entry.causal_first, recheck=entry.recheck, engine=engine)
        if timed:
            tally.add(engine)
        return result

    if entry.batch_size > 1 or entry.auto:
        return measure_batched(entry, loaded, prompt_ids, prompts, settings, on_sample)
    for warm in range(settings.warmup):
        decode(warm % len(prompt_ids), timed=False)
    samples: list[BenchSample] = []
    with PeakMemory(device) as memory:
        for index, prompt in enumerate(prompts):
            for repeat in range(settings.repeats):
                sample = bench_sample(entry, loaded, prompt, index, repeat, decode(index))
                samples.append(sample)
                if on_sample is not None:
                    on_sample(sample)
    return summarise(entry, samples, len(prompts), memory.delta_mib, ar_tps, tally=tally)


def measure_batched(
    entry: BenchEntry,
    loaded: LoadedModel,
    prompt_ids: Sequence[list[int]],
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    on_sample: Callable[[BenchSample], None] | None = None,
) -> BenchRow:
    """Decode all prompts ``batch_size`` at a time (a finished row's place goes to the next prompt), or with
    ``auto`` as many as the memory model fits, ``repeats`` times; each prompt keeps its own generator, so its
    tokens are those of its batch-1 decode. An auto row's batch is the most rows that ran at once."""
    device = next(loaded.model.parameters()).device
    peak = [entry.batch_size]
    tally = CallTally()

    def decode(indices: Sequence[int], timed: bool = True) -> list[DecodeResult]:
        generators = [torch.Generator(device=device).manual_seed(settings.seed + i) for i in indices]
        engine = (Engine(loaded.model, max_memory=settings.max_memory, budget_memory=True) if entry.auto
                  else Engine(loaded.model, max_rows=entry.batch_size))
        results = run_decoder(entry.decoder, loaded.model, [prompt_ids[i] for i in indices], entry.config,
                              mask_token_id=loaded.mask_token_id, eos_token_id=loaded.stop_token_ids,
                              generator=generators, kv_reuse=entry.kv_reuse, causal_fix=entry.causal_fix,
                              causal_first=entry.causal_first, recheck=entry.recheck, engine=engine)
        peak[0] = max(peak[0], engine.counts.peak_rows)
        if timed:
            tally.add(engine)
        return results

    if settings.warmup:
        decode([i % len(prompt_ids) for i in range(max(entry.batch_size, 2 if entry.auto else 1))], timed=False)
    samples: list[BenchSample] = []
    wall = 0.0
    with PeakMemory(device) as memory:
        for repeat in range(settings.repeats):
            synchronize(device)
            clock = RowClock(device)
            results = decode(range(len(prompts)))
            synchronize(device)
            wall += clock.latency()
            for index, (prompt, result) in enumerate(zip(prompts, results)):
                sample = bench_sample(entry, loaded, prompt, index, repeat, result)
                samples.append(sample)
                if on_sample is not None:
                    on_sample(sample)
    if entry.auto:
        entry = dataclasses.replace(entry, batch_size=peak[0])
    return summarise(entry, samples, len(prompts), memory.delta_mib, None, wall_seconds=wall, tally=tally)


def count_entry(entry: BenchEntry, loaded: LoadedModel, prompt_ids: Sequence[list[int]],
                settings: BenchSettings) -> tuple[DecodeCounts, int]:
    """What the entry's decodes cost besides the model (``--counts``): every prompt decoded once more, untimed,
    as the row decodes it (alone, or ``batch_size`` at a time), under :func:`~refusion_cli.bench.counts.counting`;
    with the tokens they generated."""
    from refusion_cli.bench.counts import counting  # --counts only

    device = next(loaded.model.parameters()).device
    batches = ([range(len(prompt_ids))] if entry.batch_size > 1 or entry.auto
               else [[index] for index in range(len(prompt_ids))])
    tokens = 0
    with counting(loaded.model) as counts:
        for indices in batches:
            engine = (Engine(loaded.model, max_memory=settings.max_memory, budget_memory=True) if entry.auto
                      else Engine(loaded.model, max_rows=entry.batch_size))
            results = run_decoder(entry.decoder, loaded.model, [prompt_ids[i] for i in indices], entry.config,
                                  mask_token_id=loaded.mask_token_id, eos_token_id=loaded.stop_token_ids,
                                  generator=[torch.Generator(device=device).manual_seed(settings.seed + i)
                                             for i in indices],
                                  kv_reuse=entry.kv_reuse, causal_fix=entry.causal_fix,
                                  causal_first=entry.causal_first, recheck=entry.recheck, engine=engine)
            tokens += sum(result.stats.tokens for result in results)
    return counts, tokens
