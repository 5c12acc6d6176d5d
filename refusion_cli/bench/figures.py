"""The summary figures of a benchmark row: a mean, a percentile, a config in one line, what its model calls
computed and copied (:class:`CallTally`; with ``--counts`` also :func:`with_counts`); the records,
:class:`BenchSample` (one measured decode) and :class:`BenchRow` (a decoder at one length), and how a row is
summarised from its samples (:func:`summarise`: means, percentiles, the spread of its TPS over the repeats, the
share of decodes cut by the length budget)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from refusion_cli.bench.prompts import BenchPrompt
from refusion_cli.decoding.engine import Engine
from refusion_cli.decoding.spec import settings_label
from refusion_cli.decoding.stats import DecodeResult, mean_tps, run_tps
from refusion_cli.tasks.synthetic import is_correct

if TYPE_CHECKING:
    from refusion_cli.bench.counts import DecodeCounts
    from refusion_cli.bench.runner import BenchEntry
    from refusion_cli.models.loading import LoadedModel


def describe_config(config: Any) -> str:
    return " ".join(f"{key}={value}" for key, value in dataclasses.asdict(config).items())


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class CallTally:
    """The positions the causal calls of a row's timed decodes computed and the K/V bytes they copied (the
    ``cache.CausalRunner`` counts of each engine); None once a decode ran calls that do not count them."""

    positions: int | None = 0
    kv_copied: int | None = 0

    def add(self, engine: Engine) -> None:
        for calls in engine.calls.values():
            counts = getattr(calls, "counts", None)
            if counts is None or self.positions is None or self.kv_copied is None:
                self.positions = self.kv_copied = None
            else:
                self.positions += counts.positions
                self.kv_copied += counts.kv_bytes_copied

    def per_token(self, tokens: int) -> tuple[float | None, float | None]:
        if not tokens or self.positions is None or self.kv_copied is None:
            return None, None
        return self.positions / tokens, self.kv_copied / tokens


@dataclass
class BenchSample:
    """One measured decode."""

    decoder: str  # the entry's label
    gen_length: int
    prompt: int  # index into the prompts
    repeat: int
    tokens: int
    forwards: int
    seconds: float
    tps: float
    tpf: float
    correct: bool | None  # None when the prompt has no target
    output: str  # the decoded text (special tokens dropped)
    hit_budget: bool = False  # no end token: the decode ran to its length budget (the answer may be cut)


@dataclass
class BenchRow:
    """One decoder at one length: means over its measured decodes."""

    decoder: str  # the entry's label
    model: str
    gen_length: int
    prompts: int
    decodes: int
    tps: float  # the row's tokens / its decodes' summed seconds (decoding.stats.run_tps, as refusion eval): at
    # batch 1 the paper's TPS; in a batch a decode's seconds are its latency, so this is the per-request rate
    speedup_vs_ar: float | None  # tps / AR's tps at the same length (1 for AR; None without an AR row)
    tpf: float  # mean tokens per forward
    forwards: float  # mean model calls per decode
    tokens: float  # mean response tokens (up to and including EOS) per decode
    latency_p50_ms: float
    latency_p95_ms: float
    peak_mem_mib: float  # peak memory above the level before the row's decodes (method in the report)
    accuracy: float | None  # share of scored decodes that are correct (None when no prompt has a target)
    scored: int  # decodes with a target
    config: str  # the decoder config, "name=value ..."
    tps_sample_mean: float = 0.0  # the mean of the per-decode TPS, beside ``tps``
    batch_size: int = 1  # prompts decoded together
    throughput: float = 0.0  # the row's tokens / the wall time of its timed calls (= tps at batch 1)
    mem_per_row_mib: float = 0.0  # peak_mem_mib / batch_size
    # what a causal row's calls cost besides the model, per generated token (None: a masked-diffusion row, whose
    # calls do not count them): positions the model computed, K/V bytes the cache copied (engine_counts: syncs)
    positions_per_token: float | None = None
    kv_copied_per_token: float | None = None
    tps_min: float = 0.0  # the spread of the row's TPS over its repeats (each repeat's tokens / its seconds)
    tps_median: float = 0.0
    tps_max: float = 0.0
    budget_share: float = 0.0  # share of decodes that ran to the length budget without an end token
    settings: str = ""  # the config's fields that differ from the decoder's defaults (spec.settings_label)
    # --counts: the row's prompts decoded once more, untimed, under bench.counts' counter (None / "": not counted)
    syncs_per_step: float | None = None  # host syncs per engine step
    ops_per_step: float | None = None  # tensor ops per engine step outside the model's calls
    attention_calls_per_layer: float | None = None  # None with an implementation: attention the counter cannot see
    attention_implementation: str = ""  # the model's attention (sdpa, eager, ...)
    counted_positions_per_token: float | None = None  # input_ids elements of every model call, padding included
    counted_kv_copied_per_token: float | None = None  # K/V bytes written beyond the K/V of the positions fed

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def attention_cell(row: BenchRow) -> str:
    """The row's attention calls per layer per model call, or the attention it ran where none could be counted."""
    if row.attention_calls_per_layer is not None:
        return f"{row.attention_calls_per_layer:.2f}"
    return f"{row.attention_implementation} (not counted)" if row.attention_implementation else "–"


def bench_sample(entry: BenchEntry, loaded: LoadedModel, prompt: BenchPrompt, index: int, repeat: int,
                 result: DecodeResult) -> BenchSample:
    """One measured decode of prompt ``index``: its counts, its text and whether it is correct."""
    text = loaded.tokenizer.decode(result.tokens, skip_special_tokens=True)
    stats = result.stats
    return BenchSample(entry.label, entry.gen_length, index, repeat, stats.tokens, stats.forwards, stats.seconds,
                       stats.tps, stats.tpf, None if prompt.target is None else is_correct(text, prompt.target), text,
                       hit_budget=not set(result.tokens) & set(loaded.stop_token_ids))


def summarise(entry: BenchEntry, samples: Sequence[BenchSample], n_prompts: int, peak_mem_mib: float,
              ar_tps: float | None, wall_seconds: float | None = None, tally: CallTally | None = None) -> BenchRow:
    """The row of ``samples``; ``wall_seconds``: the wall time of a batched row's timed calls (throughput);
    ``tally``: what its calls computed and copied."""
    scored = [sample.correct for sample in samples if sample.correct is not None]
    tokens, seconds = [sample.tokens for sample in samples], [sample.seconds for sample in samples]
    tps = run_tps(tokens, seconds)
    latencies_ms = [sample.seconds * 1000 for sample in samples]
    spread = repeat_spread(samples)
    positions, kv_copied = (tally or CallTally(None, None)).per_token(sum(tokens))
    return BenchRow(
        decoder=entry.label, model=entry.model, gen_length=entry.gen_length, prompts=n_prompts,
        decodes=len(samples), tps=tps, speedup_vs_ar=tps / ar_tps if ar_tps else None,
        tpf=mean([sample.tpf for sample in samples]), forwards=mean([sample.forwards for sample in samples]),
        tokens=mean([sample.tokens for sample in samples]),
        latency_p50_ms=percentile(latencies_ms, 50), latency_p95_ms=percentile(latencies_ms, 95),
        peak_mem_mib=peak_mem_mib, accuracy=mean(scored) if scored else None, scored=len(scored),
        config=describe_config(entry.config), tps_sample_mean=mean_tps(tokens, seconds),
        batch_size=entry.batch_size,
        throughput=tps if wall_seconds is None else run_tps(tokens, [wall_seconds]),
        mem_per_row_mib=peak_mem_mib / entry.batch_size,
        positions_per_token=positions, kv_copied_per_token=kv_copied,
        tps_min=min(spread, default=0.0), tps_median=percentile(spread, 50), tps_max=max(spread, default=0.0),
        budget_share=mean([sample.hit_budget for sample in samples]),
        settings=settings_label(entry.decoder, entry.config),
    )


def with_counts(row: BenchRow, counts: DecodeCounts, tokens: int) -> BenchRow:
    """``row`` with what ``counts`` counted over decodes of ``tokens`` generated tokens (``--counts``)."""
    positions, kv_copied = counts.per_token(tokens)
    return dataclasses.replace(row, syncs_per_step=counts.syncs_per_step(), ops_per_step=counts.ops_per_step(),
                               attention_calls_per_layer=counts.attention_per_layer(),
                               attention_implementation=counts.attention, counted_positions_per_token=positions,
                               counted_kv_copied_per_token=kv_copied)


def repeat_spread(samples: Sequence[BenchSample]) -> list[float]:
    """The row's TPS in each repeat: the repeat's tokens over its seconds (the row's rule, one repeat at a time)."""
    repeats = sorted({sample.repeat for sample in samples})
    return [run_tps([s.tokens for s in samples if s.repeat == r], [s.seconds for s in samples if s.repeat == r])
            for r in repeats]
