"""``refusion bench --endpoint``: the bench's prompts sent to OpenAI-compatible servers at several concurrencies.

Per endpoint and concurrency level one :class:`ServedRow`: output tokens/s and requests/s over the level's wall
time, TTFT, ITL and TPOT at p50 and p99, tokens per chunk, and the answers scored by the in-process bench's rule
(:func:`~refusion_cli.tasks.synthetic.is_correct`). Tokens are counted by one rule for every endpoint: with
``--tokenizer`` when given (the answer's text, tokenized), else each reply's ``usage.completion_tokens``.

A row is a dLLM when its model id names one of the toolkit's diffusion decoders (``refusion``, ``llada``, ... and
their variants, as ``refusion serve`` names them), else AR. :func:`crossovers`: for each dLLM row and AR row, the
highest concurrency at which the dLLM's throughput is still above the AR row's.

Files in ``--output`` (written as each level finishes; the report and plot at the end, also after an error):
``served.csv`` (rows), ``served_samples.csv`` (one line per request: counts, times, correctness, the text),
``served.md`` and ``served.png`` (:mod:`refusion_cli.bench.served_report`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refusion_cli.bench.endpoint import Endpoint, LevelRun, load_level, parse_endpoint, resolve_endpoint
from refusion_cli.bench.figures import mean, percentile
from refusion_cli.bench.prompts import SYNTHETIC_TEST, BenchPrompt, load_prompts
from refusion_cli.bench.report import CsvRows
from refusion_cli.bench.runner import DEFAULT_GEN_LENGTH
from refusion_cli.decoding.registry import DECODERS
from refusion_cli.errors import UserError
from refusion_cli.paths import check_output_dir
from refusion_cli.tasks.synthetic import is_correct

DEFAULT_CONCURRENCY = (1, 4, 16, 64)
DEFAULT_MAX_SECONDS = 600.0  # per level: no request starts after it
ROWS_FILE = "served.csv"
SAMPLES_FILE = "served_samples.csv"
DLLM, AR = "dLLM", "AR"


@dataclass(frozen=True)
class LoadSettings:
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY  # requests in flight, one level each
    max_requests: int | None = None  # requests per level; None: one per prompt
    max_seconds: float | None = DEFAULT_MAX_SECONDS  # per level; None: no time bound
    max_tokens: int = DEFAULT_GEN_LENGTH  # the requests' max_tokens (the bench's --gen-length)
    seed: int = 0  # request for prompt i sends seed + i
    warmup: int = 1  # untimed requests to each endpoint before its first level

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise UserError(f"--concurrency levels must be whole numbers >= 1, got {self.concurrency}")
        if self.max_requests is not None and self.max_requests < 1:
            raise UserError(f"--max-requests must be at least 1, got {self.max_requests}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise UserError(f"--max-seconds must be above 0, got {self.max_seconds}")
        if self.max_tokens < 1:
            raise UserError(f"--gen-length must be at least 1, got {self.max_tokens}")
        if self.warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {self.warmup}")


@dataclass
class ServedRow:
    """One endpoint at one concurrency level; times in ms, speeds per second of wall time."""

    endpoint: str  # the row's label: the model id (and its address when two endpoints share an id)
    kind: str  # dLLM or AR (row_kind)
    url: str
    concurrency: int
    requests: int
    seconds: float  # the level's wall time, first request sent to last answer read
    tokens: int  # output tokens of all requests (the run's counting rule)
    throughput: float  # output tokens / s
    requests_per_s: float
    user_tps_p50: float  # a request's tokens / its latency: what one user sees, the median
    latency_p50_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float  # the gap between two content chunks
    itl_p99_ms: float
    tpot_p50_ms: float  # (latency - TTFT) / (tokens - 1) of a request
    tpot_p99_ms: float
    tokens_per_chunk: float
    accuracy: float | None
    scored: int
    stopped_by_time: bool  # --max-seconds passed before every request had started


@dataclass
class ServedSample:
    endpoint: str
    concurrency: int
    request: int
    prompt: int  # the prompt's index
    tokens: int
    seconds: float
    ttft_ms: float
    chunks: int
    finish_reason: str | None
    correct: bool | None
    output: str  # the answer's text


ROW_FIELDS = [f.name for f in dataclasses.fields(ServedRow)]
SAMPLE_FIELDS = [f.name for f in dataclasses.fields(ServedSample)]


@dataclass(frozen=True)
class Crossover:
    dllm: str
    ar: str
    ratios: dict[int, float]  # concurrency -> dLLM throughput / AR's, at the levels both measured

    @property
    def highest(self) -> int | None:
        """The highest concurrency at which the dLLM's throughput is above AR's (None: at none)."""
        return max((level for level, ratio in self.ratios.items() if ratio > 1), default=None)

    def line(self) -> str:
        ratios = ", ".join(f"{ratio:.2f}× at {level}" for level, ratio in sorted(self.ratios.items()))
        if self.highest is None:
            return f"{self.dllm} is below {self.ar} at every level ({ratios})"
        top = "every level measured" if self.highest == max(self.ratios) else f"concurrency {self.highest}"
        return f"{self.dllm} above {self.ar} up to {top} ({ratios})"


def parse_concurrency(values: Sequence[str]) -> tuple[int, ...]:
    """``--concurrency`` values (comma-separated or repeated) -> sorted distinct levels."""
    levels = []
    for value in (part.strip() for text in values for part in text.split(",") if part.strip()):
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"--concurrency must be whole numbers >= 1, got '{value}'",
                            hint="e.g. --concurrency 1,4,16,64")
        levels.append(int(value))
    return tuple(sorted(set(levels))) or DEFAULT_CONCURRENCY


def row_kind(model: str) -> str:
    """dLLM when ``model`` is a diffusion decoder's id (its variants' too: ``refusion-recheck``), else AR."""
    names = [name for name in DECODERS if model == name or model.startswith(name + "-")]
    return DLLM if names and DECODERS[max(names, key=len)].needs_mask else AR


def row_labels(endpoints: Sequence[Endpoint]) -> list[str]:
    """Each endpoint's model id, with its address where two endpoints share an id."""
    models = [endpoint.model or "" for endpoint in endpoints]
    labels = [model if models.count(model) == 1 else f"{model} @ {endpoint.address}"
              for model, endpoint in zip(models, endpoints)]
    if len(set(labels)) < len(labels):
        raise UserError("two --endpoint values name the same server and model")
    return labels


TokenCounter = Callable[[str, int | None], int]


def token_counter(tokenizer_name: str | None) -> tuple[TokenCounter, str]:
    """The one counting rule of a run and its description: the tokenizer's count of a text, else the usage."""
    if tokenizer_name is None:
        def from_usage(text: str, usage: int | None) -> int:
            if usage is None:
                raise UserError("an endpoint sent no usage (stream_options.include_usage)",
                                hint="give --tokenizer to count the answers' tokens")
            return usage
        return from_usage, "the servers' usage.completion_tokens"
    from refusion_cli.models.checkpoint import resolve_checkpoint
    from refusion_cli.models.loading import load_tokenizer

    tokenizer = load_tokenizer(resolve_checkpoint(tokenizer_name))

    def from_text(text: str, usage: int | None) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return from_text, f"the answers' text tokenized with {tokenizer_name}"


def score_level(label: str, url: str, level: LevelRun, prompts: Sequence[BenchPrompt],
                count: TokenCounter) -> tuple[ServedRow, list[ServedSample]]:
    """The row and samples of one measured level."""
    samples, ttfts, itls, tpots, user_tps, latencies = [], [], [], [], [], []
    for reply in sorted(level.replies, key=lambda reply: reply.request):
        target = prompts[reply.index].target
        tokens = count(reply.text, reply.usage_tokens)
        samples.append(ServedSample(label, level.concurrency, reply.request, reply.index, tokens, reply.latency,
                                    reply.ttft * 1000, len(reply.chunk_times), reply.finish_reason,
                                    None if target is None else is_correct(reply.text, target), reply.text))
        ttfts.append(reply.ttft * 1000)
        latencies.append(reply.latency * 1000)
        itls += [(later - earlier) * 1000 for earlier, later in zip(reply.chunk_times, reply.chunk_times[1:])]
        if tokens > 1:
            tpots.append((reply.latency - reply.ttft) * 1000 / (tokens - 1))
        user_tps.append(tokens / reply.latency if reply.latency > 0 else 0.0)
    tokens = sum(sample.tokens for sample in samples)
    chunks = sum(sample.chunks for sample in samples)
    scored = [sample.correct for sample in samples if sample.correct is not None]
    seconds = level.seconds
    row = ServedRow(label, row_kind(label.split(" @ ")[0]), url, level.concurrency, len(samples), seconds, tokens,
                    tokens / seconds if seconds else 0.0, len(samples) / seconds if seconds else 0.0,
                    percentile(user_tps, 50), percentile(latencies, 50), percentile(ttfts, 50),
                    percentile(ttfts, 99), percentile(itls, 50), percentile(itls, 99), percentile(tpots, 50),
                    percentile(tpots, 99), tokens / chunks if chunks else 0.0,
                    mean([float(correct) for correct in scored]) if scored else None, len(scored),
                    level.stopped_by_time)
    return row, samples


def crossovers(rows: Sequence[ServedRow]) -> list[Crossover]:
    """For each dLLM row and AR row, their throughput ratio at each level both measured."""
    by_label: dict[str, dict[int, ServedRow]] = {}
    for row in rows:
        by_label.setdefault(row.endpoint, {})[row.concurrency] = row
    kinds = {row.endpoint: row.kind for row in rows}
    found = []
    for dllm in (label for label in by_label if kinds[label] == DLLM):
        for ar in (label for label in by_label if kinds[label] == AR):
            shared = sorted(set(by_label[dllm]) & set(by_label[ar]))
            ratios = {level: by_label[dllm][level].throughput / by_label[ar][level].throughput
                      for level in shared if by_label[ar][level].throughput > 0}
            if ratios:
                found.append(Crossover(dllm, ar, ratios))
    return found


def row_line(row: ServedRow) -> str:
    accuracy = f", accuracy {row.accuracy * 100:.1f}%" if row.accuracy is not None else ""
    return (f"{row.endpoint} ({row.kind}), concurrency {row.concurrency}: {row.throughput:.1f} tok/s, "
            f"{row.requests_per_s:.2f} req/s, TTFT p50 {row.ttft_p50_ms:.0f} ms, ITL p50 {row.itl_p50_ms:.1f} ms, "
            f"{row.tokens_per_chunk:.2f} tokens/chunk{accuracy}")


@dataclass
class ServedRun:
    """What the report needs of a run: its settings, what it measured, how it counted and whether it ended early."""

    endpoints: list[str]  # URL=MODEL of each endpoint
    settings: LoadSettings
    prompts_source: str
    n_prompts: int
    counting: str
    rows: list[ServedRow] = dataclasses.field(default_factory=list)
    interrupted: str | None = None  # why the run stopped early


def bench_endpoints(given: Sequence[str], *, settings: LoadSettings, prompts_file: Path | None, limit: int | None,
                    tokenizer: str | None, output: Path, say: Callable[[str], None]) -> ServedRun:
    """Load each endpoint at each level, writing rows and samples as levels finish and the report at the end;
    a UserError (or Ctrl-C) mid-run still writes the report of the levels measured, then goes on up."""
    from refusion_cli.bench.served_report import write_report

    endpoints = [parse_endpoint(text) for text in given]
    prompts = load_prompts(prompts_file, limit)
    check_output_dir(output, hint="give a directory for served.csv, served.md and the plot")
    count, counting = token_counter(tokenizer)
    endpoints = [resolve_endpoint(endpoint) for endpoint in endpoints]  # every server answers before any load
    labels = row_labels(endpoints)
    source = (f"{len(prompts)} prompts from {prompts_file}" if prompts_file is not None
              else f"the first {len(prompts)} problems of the synthetic task (evals/synthetic/{SYNTHETIC_TEST.name})")
    run = ServedRun([f"{e.base}={e.model}" for e in endpoints], settings, source, len(prompts), counting)
    requests = settings.max_requests or len(prompts)
    texts = [prompt.text for prompt in prompts]
    output.mkdir(parents=True, exist_ok=True)
    try:
        with CsvRows(output / ROWS_FILE, ROW_FIELDS) as rows_csv, \
                CsvRows(output / SAMPLES_FILE, SAMPLE_FIELDS) as samples_csv:
            for endpoint, label in zip(endpoints, labels):
                if settings.warmup:
                    load_level(endpoint, texts, 1, settings.warmup, None, settings.max_tokens, settings.seed)
                for concurrency in settings.concurrency:
                    level = load_level(endpoint, texts, concurrency, requests, settings.max_seconds,
                                       settings.max_tokens, settings.seed)
                    row, samples = score_level(label, endpoint.base, level, prompts, count)
                    for sample in samples:
                        samples_csv.write(dataclasses.asdict(sample))
                    rows_csv.write(dataclasses.asdict(row))
                    run.rows.append(row)
                    say(row_line(row))
    except (UserError, KeyboardInterrupt) as exc:
        run.interrupted = str(exc) or "interrupted (Ctrl-C)"
        write_report(output, run)
        raise
    written = write_report(output, run)
    for crossover in crossovers(run.rows):
        say(f"crossover: {crossover.line()}")
    say(f"wrote {', '.join(written)} to {output}")
    return run


def served_bench(endpoint: Sequence[str], stray: Sequence[str], *, concurrency: Sequence[str] | None,
                 tokenizer: str | None, max_requests: int | None, max_seconds: float | None, prompts: Path | None,
                 limit: int | None, gen_length: Sequence[str] | None, seed: int, warmup: int, output: Path | None,
                 say: Callable[[str], None], in_process: dict[str, Any]) -> ServedRun:
    """``refusion bench --endpoint``: the options checked, then :func:`bench_endpoints`. Stray values after
    ``--endpoint`` that are URLs are endpoints too; ``output`` None: a fresh ``runs/bench-...`` folder."""
    check_in_process_options(in_process)
    urls = [value for value in stray if value.startswith(("http://", "https://"))]
    others = [value for value in stray if value not in urls]
    if others:
        raise UserError(f"unexpected value '{others[0]}' with --endpoint",
                        hint="give several values of an option comma-separated: --concurrency 1,4,16")
    lengths = [part.strip() for text in gen_length or [] for part in text.split(",") if part.strip()]
    if len(lengths) > 1:
        raise UserError("--gen-length takes one value with --endpoint (the requests' max_tokens)")
    if lengths and not lengths[0].isdigit():
        raise UserError(f"--gen-length must be a positive integer, got '{lengths[0]}'")
    settings = LoadSettings(parse_concurrency(concurrency or []), max_requests,
                            DEFAULT_MAX_SECONDS if max_seconds is None else max_seconds,
                            int(lengths[0]) if lengths else DEFAULT_GEN_LENGTH, seed, warmup)
    if output is None:
        from refusion_cli.paths import fresh_run_dir

        output = fresh_run_dir("bench")
    return bench_endpoints([*endpoint, *urls], settings=settings, prompts_file=prompts, limit=limit,
                           tokenizer=tokenizer, output=output, say=say)


def check_in_process_options(given: dict[str, Any]) -> None:
    """Refuse, with --endpoint, the options that set up in-process decoding (``given``: option -> value, None or
    False when not given): the servers decode with their own settings."""
    for option, value in given.items():
        if value not in (None, False, [], ()):
            raise UserError(f"{option} does not apply with --endpoint: the servers decode with their own settings",
                            hint="set them where the server starts (refusion serve --set ..., --model ...)")


def check_load_options(given: dict[str, Any]) -> None:
    """Refuse the load options (``given``: option -> value, None when not given) without --endpoint."""
    for option, value in given.items():
        if value is not None:
            raise UserError(f"{option} needs --endpoint", hint="e.g. refusion bench --endpoint "
                            "http://127.0.0.1:8000=refusion --concurrency 1,4")
