"""What the masked-diffusion samplers (LLaDA, Dream) share: the canvas, the block loop and the model
calls with an optional prefix or dual cache (their options checked and the choice of positions to unmask:
``mdm_sampling``).

The *canvas* is the prompt followed by ``gen_length`` mask tokens ([P + L]); a sampler replaces
masks by tokens, block by block (left to right), a few per step, and never changes a token once it
is unmasked. Everything here is token ids; nothing knows of text.

The KV caches (the Fast-dLLM options, ``use_cache`` and ``dual_cache``): the first step of a
block is a full pass over the canvas that keeps the K/V of the *prefix* (prompt and finished
blocks, positions [0, block start)) and, with ``dual_cache``, of the *suffix* (the masks right of
the block) too. The block's later steps feed the block and the suffix (prefix cache) or the block
alone (dual cache), with explicit position ids and an explicit 4-D mask (causal or full, as the
model's config says), after that K/V. A block always takes at least one cached step after its full
pass, and its steps run until it has no mask left. For a causal model both caches are exact (a
token's K/V depends only on the tokens left of it, and a causal query never sees the suffix); for a
bidirectional model they are an approximation, since the cached K/V were computed while the current
block was still (partly) masked.

Batches: a sampler is written as a row program (a generator that yields a :class:`CanvasFeed` for
each model call and is sent its logits back) on a prompt's canvas (:func:`canvas_row`);
``engine.run_decoder`` runs one per prompt, ``batch_size`` at a time, and
:class:`CanvasCalls` makes one padded, masked model call of every running row's feed. Each row keeps
its own canvas, counters, generator and cached K/V, so it decodes as it would alone; one prompt is
a batch of one through the same code. Up to float rounding: a padded call reduces over other shapes
than a row's call alone, so its logits differ from batch 1's by float rounding, and a decision
within that rounding of a tie can go the other way.

Logits: a feed names the fed positions whose logits its row reads (a LLaDA block, Dream's masks,
D2F's decoding blocks), and the model computes the head at those positions only; with a vocabulary
of 126k-152k words, the logits of a whole canvas cost more memory than the rest of the call. A row
that reads more positions than that, Dream's 512 masks, asks for them in chunks (``chunked``): when a
call reads more than :data:`LOGITS_CHUNK` positions, the model's head computes nothing during the
call, and such a row gets the head's input at its read positions (a :class:`HeadInput`, the final
hidden states) and applies the head :data:`LOGITS_CHUNK` positions at a time (:func:`logit_chunks`),
so that no row holds more than [LOGITS_CHUNK, V] logits at once. A model whose head cannot be reached
(``get_output_embeddings``) computes the logits in the call, and the row reads them a chunk at a time.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, TypeVar, cast, overload

import torch
from transformers import DynamicCache, PreTrainedConfig

from refusion_cli.decoding.cache import additive_mask, mask_argument
from refusion_cli.decoding.stats import (RowClock, DecodeResult, DecodeStats, EosIds, cache_argument, count_call,
                                         cut_after_eos, kept_logits, logits_at, timed_call)

T = TypeVar("T")

LOGITS_CHUNK = 32  # the most read positions whose logits a chunked row (Dream) holds at once: [LOGITS_CHUNK, V]
# The CPU's BLAS computes a product of 1 to 3 rows another way than a longer one (float32; bfloat16 at Dream's
# 3,584 wide), and float64's in groups of 4: chunks of rows that start at multiples of 4 and have at least 4 rows
# give the head's rows bit for bit as one product of them all (measured here in float64 and bfloat16, and in
# float32 on one thread; float32 on several threads splits rows by their count, and rounds differently)
SMALLEST_CHUNK = 4


@dataclass
class MDMStep:
    """What one step of a masked-diffusion sampler unmasked (offsets count from the response start)."""

    block: int
    step: int  # step within the block, from 0
    offsets: list[int] = field(default_factory=list)  # response offsets unmasked by this step, in choice order
    tokens: list[int] = field(default_factory=list)  # the tokens written there


@dataclass(frozen=True)
class Block:
    index: int
    start: int  # first canvas position of the block
    end: int  # one past its last canvas position

    @property
    def length(self) -> int:
        return self.end - self.start


# ---------------------------------------------------------------------------------------------
# the canvas


def even_schedule(n_masked: int, steps: int) -> list[int]:
    """Tokens to unmask at each of ``steps`` steps: n // steps each, the remainder on the first steps."""
    base, remainder = divmod(n_masked, steps)
    return [base + 1 if step < remainder else base for step in range(steps)]


class Canvas:
    """The sequence being denoised (prompt + masked response), its counters and its trace."""

    def __init__(self, prompt: torch.Tensor, gen_length: int, *, mask_token_id: int, eos_token_id: EosIds,
                 report: Callable[[DecodeStats, MDMStep], None] | None = None):
        self.device = prompt.device
        self.prompt_length = prompt.numel()
        self.mask_token_id = mask_token_id
        self.eos_token_id = eos_token_id
        masks = torch.full((gen_length,), mask_token_id, dtype=torch.long, device=self.device)
        self.ids = torch.cat([prompt, masks])  # [P + L]
        self.stats = DecodeStats()
        self.trace: list[MDMStep] = []
        self.report = report

    def blocks(self, block_length: int) -> Iterator[Block]:
        """The response's blocks, left to right."""
        end = self.ids.numel()
        for index, start in enumerate(range(self.prompt_length, end, block_length)):
            yield Block(index, start, min(start + block_length, end))

    def masked(self, block: Block) -> torch.Tensor:
        """[B] bool: which positions of ``block`` still hold the mask token."""
        return self.ids[block.start:block.end] == self.mask_token_id

    def steps(self, block: Block, steps: int, threshold: float | None, cached: bool) -> Iterator[int]:
        """Step indices for ``block``. Without the cache: exactly ``steps`` of them, or, with a threshold,
        until no mask is left. With the cache: until no mask is left, and at least two, since the
        block's full pass is always followed by a cached step (which finds nothing left to unmask when
        the full pass finished the block)."""
        step = 0
        while self._takes_another_step(block, step, steps, threshold, cached):
            yield step
            step += 1

    def _takes_another_step(self, block: Block, step: int, steps: int, threshold: float | None, cached: bool) -> bool:
        if cached:
            return step < 2 or bool(self.masked(block).any())
        if threshold is None:
            return step < steps
        return bool(self.masked(block).any())

    def unmask(self, block: Block, step: int, offsets: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write ``tokens`` [n] at block offsets ``offsets`` [n] and record the step."""
        self.ids[block.start + offsets] = tokens
        response_offsets = (offsets + block.start - self.prompt_length).tolist()
        record = MDMStep(block.index, step, response_offsets, tokens.tolist())
        self.trace.append(record)
        if self.report is not None:
            self.report(self.stats, record)

    def result(self) -> DecodeResult:
        """The response cut after its first EOS, with the shared counters (``seconds`` is set by the driver)."""
        tokens = cut_after_eos(self.ids[self.prompt_length:].tolist(), self.eos_token_id)
        self.stats.tokens = len(tokens)
        return DecodeResult(tokens=tokens, stats=self.stats, trace=self.trace)


# ---------------------------------------------------------------------------------------------
# model calls, shared by the rows of a batch

RowKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V [H, n, D] of n consecutive positions of a row


@dataclass
class CanvasFeed:
    """What one conditioning stream of one row feeds to a shared call: ``ids`` [Q] at positions
    start..start+Q-1, after the K/V ``prefix`` of positions 0..start-1 and before the K/V ``suffix``
    of the positions right after the fed ones, when it has them; ``read``: the fed offsets whose
    logits the row reads."""

    stats: DecodeStats  # the row's counters: the call counts once for it, with Q positions
    ids: torch.Tensor  # [Q]
    start: int = 0
    prefix: RowKV | None = None  # None: nothing cached left of the fed tokens (they start the sequence)
    suffix: RowKV | None = None  # None: nothing cached right of them (the dual cache's suffix when given)
    keep: int | None = None  # return the K/V of the first ``keep`` fed positions (None: keep none, no cache)
    among: torch.Tensor | None = None  # [Q, Q] bool: fed token q sees fed token k (None: all, or the earlier ones)
    read: torch.Tensor | None = None  # [R] ascending fed offsets whose logits are returned (None: every one)
    chunked: bool = False  # the row takes a HeadInput for its logits when the call reads more than LOGITS_CHUNK


@dataclass(frozen=True)
class HeadInput:
    """What the model's head turns into the logits of R read positions: their final hidden states [R, H]."""

    states: torch.Tensor  # [R, H], the model's dtype
    head: torch.nn.Module  # the model's output embeddings: states [n, H] -> logits [n, V]

    def __len__(self) -> int:
        return self.states.shape[0]

    def __getitem__(self, rows: torch.Tensor | slice) -> HeadInput:
        return HeadInput(self.states[rows], self.head)


ReadLogits = torch.Tensor | HeadInput  # the logits [R, V] of a row's read positions, or what the head makes them from
CanvasReply = tuple[ReadLogits, RowKV | None]  # the read positions' logits (a HeadInput for a chunked feed), the K/V
CanvasStep = Generator[CanvasFeed, CanvasReply, T]  # a row program's step: yields feeds, is sent replies


class CanvasCalls:
    """One model call for every row of a batch of canvases (driven by :class:`refusion_cli.decoding.engine.Engine`).

    Rows are left-padded to the longest feed of the call, so that the rows' read positions, which lie
    towards the end of a canvas, line up. A call where no row uses a cache and every row is as long as
    the others is the plain call (no mask, default positions): with one row, the reference's own call.
    Otherwise each row gets explicit position ids and a 4-D mask: its fed tokens see its cached prefix,
    its cached suffix (not in a causal model: the suffix lies right of them) and each other (all of
    them, or the earlier ones for a causal model; a feed's ``among`` narrows that), never another row
    or padding; a pad sees only itself. The cached K/V are laid in one :class:`DynamicCache` made for
    the call: every row's prefix left-aligned and zero-padded to the longest prefix, then every row's
    suffix likewise; the fed tokens' K/V follow them. The model computes logits only at the columns
    some row reads (one index set for the whole call: the union of the rows' reads), and at none when
    they are more than LOGITS_CHUNK and some feed is ``chunked``: such a feed gets its reads' head input,
    any other row the head's output at its reads.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.causal = attends_causally(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def close(self, row: int) -> None:
        """A finished row holds nothing here: its cache lives in its own program."""

    def forward(self, feeds: dict[int, CanvasFeed]) -> dict[int, CanvasReply]:
        """One counted model call over every row's feed; each row gets its read logits and kept K/V back."""
        rows = list(feeds.values())
        lengths = [feed.ids.numel() for feed in rows]
        width = max(lengths)  # Q
        pads = [width - n for n in lengths]
        columns, reads = self._read_columns(rows, pads, width)  # [U]; per row, its reads among the U
        head = output_head(self.model)
        chunks = head is not None and columns.numel() > LOGITS_CHUNK and any(feed.chunked for feed in rows)
        with head_input(head if chunks else None, columns) as states:  # states: [B, U, H] once the head ran
            out, seconds, cache, cached_width = self._call(rows, width, logits_at(self.model, columns, width))
        read_logits = self._row_reads(rows, reads, out, columns, head, states)
        replies = {}
        for row, (index, feed) in enumerate(feeds.items()):
            count_call(feed.stats, lengths[row], seconds)
            kept = None
            if feed.keep is not None and cache is not None:  # a feed that keeps K/V makes the call cached
                fed = slice(cached_width + pads[row], cached_width + pads[row] + feed.keep)
                kept = [(keys[row, :, fed].clone(), values[row, :, fed].clone()) for keys, values in _layers_kv(cache)]
            replies[index] = (read_logits[row], kept)
        return replies

    def _call(self, rows: list[CanvasFeed], width: int,
              keep_logits: dict) -> tuple[Any, float | None, DynamicCache | None, int]:
        """The model's output and seconds for the rows' feeds, left-padded to ``width``; the call's cache (None
        without one) and the cached columns left of the fed ones in it."""
        cached = any(feed.prefix is not None or feed.suffix is not None or feed.keep is not None for feed in rows)
        if not cached and all(feed.ids.numel() == width for feed in rows):
            out, seconds = timed_call(self.model, input_ids=torch.stack([feed.ids for feed in rows]), use_cache=False,
                                      **keep_logits)
            return out, seconds, None, 0
        prefix_width = max(_kv_length(feed.prefix) for feed in rows)  # W
        suffix_width = max(_kv_length(feed.suffix) for feed in rows)  # S
        cache = DynamicCache(config=cast(PreTrainedConfig, self.model.config)) if cached else None
        if cache is not None and prefix_width + suffix_width:  # cached K/V make the call cached
            _fill_cache(cache, [feed.prefix for feed in rows], [feed.suffix for feed in rows],
                        prefix_width, suffix_width)
        input_ids, position_ids, allowed = self._padded(rows, width, prefix_width, suffix_width)
        mask = additive_mask(allowed, self.dtype)  # [B, 1, Q, W + S + Q]
        cache_kwargs = cache_argument(self.model, cache) if cached else {}
        out, seconds = timed_call(self.model, input_ids=input_ids, position_ids=position_ids,
                                  attention_mask=mask_argument(self.model.config, mask),
                                  use_cache=cached, **cache_kwargs, **keep_logits)
        return out, seconds, cache, prefix_width + suffix_width

    @staticmethod
    def _row_reads(rows: list[CanvasFeed], reads: list[torch.Tensor], out: Any, columns: torch.Tensor,
                   head: torch.nn.Module | None, states: list[torch.Tensor]) -> list[ReadLogits]:
        """Each row's read logits [R, V] from the call's output, or, where the head's input was kept (``states``),
        a chunked row's HeadInput and any other row's logits computed from it."""
        if not states or head is None:  # the head's input is kept only when there is a head
            logits = kept_logits(out.logits, columns)  # [B, U, V]
            return [take_rows(logits[row], read) for row, read in enumerate(reads)]
        hidden = states[-1]  # [B, U, H]
        inputs = [HeadInput(take_rows(hidden[row], read), head) for row, read in enumerate(reads)]
        return [given if feed.chunked else given.head(given.states) for feed, given in zip(rows, inputs)]

    def _read_columns(self, rows: list[CanvasFeed], pads: list[int],
                      width: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The call's columns whose logits some row reads (ascending [U]), and where each row's reads are among them."""
        wanted = [pad + (torch.arange(width - pad, device=self.device) if feed.read is None else feed.read)
                  for feed, pad in zip(rows, pads)]
        columns, where = torch.unique(torch.cat(wanted), sorted=True, return_inverse=True)
        return columns, list(where.split([read.numel() for read in wanted]))

    def _padded(self, rows: list[CanvasFeed], width: int, prefix_width: int,
                suffix_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input ids [B, Q] and position ids [B, Q] (left-padded), and what each query sees [B, Q, W + S + Q]."""
        fed_column = prefix_width + suffix_width  # the first column of the fed tokens' K/V
        input_ids = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)
        position_ids = torch.zeros_like(input_ids)
        allowed = torch.zeros(len(rows), width, fed_column + width, dtype=torch.bool, device=self.device)
        allowed[:, :, fed_column:] = torch.eye(width, dtype=torch.bool, device=self.device)  # pads see themselves
        for row, feed in enumerate(rows):
            n = feed.ids.numel()
            pad = width - n
            input_ids[row, pad:] = feed.ids
            position_ids[row, pad:] = torch.arange(feed.start, feed.start + n, device=self.device)
            allowed[row, pad:, : _kv_length(feed.prefix)] = True
            if not self.causal:
                allowed[row, pad:, prefix_width: prefix_width + _kv_length(feed.suffix)] = True
            among = torch.ones(n, n, dtype=torch.bool, device=self.device) if feed.among is None else feed.among
            allowed[row, pad:, fed_column + pad:] = among.tril() if self.causal else among
        return input_ids, position_ids, allowed


def attends_causally(model: torch.nn.Module) -> bool:
    """Whether ``model`` attends causally: ``config.is_causal`` when the config records it (the toolkit's
    loader sets it False for every masked-diffusion checkpoint); else its attention modules' own flag
    (transformers' carry ``is_causal``); a model with neither (a masked-diffusion model's own code) is
    bidirectional."""
    recorded = getattr(model.config, "is_causal", None)
    if recorded is not None:
        return bool(recorded)
    flags = {bool(module.is_causal) for module in model.modules()
             if module is not model and isinstance(getattr(module, "is_causal", None), bool)}
    return flags == {True}


def _layers_kv(cache: DynamicCache) -> RowKV:
    """Each layer's keys and values [B, H, n, D] in a call's cache, which the call filled (full attention layers)."""
    # a filled DynamicCache of full attention layers holds both K and V in every layer
    return [(layer.keys, layer.values) for layer in cache.layers]


def _kv_length(kv: RowKV | None) -> int:
    return kv[0][0].shape[1] if kv else 0


def _fill_cache(cache: DynamicCache, prefixes: list[RowKV | None], suffixes: list[RowKV | None],
                prefix_width: int, suffix_width: int) -> None:
    """Put every row's prefix and suffix K/V [H, n, D] into ``cache`` as [B, H, W + S, D]: prefixes
    left-aligned in the first W columns, suffixes left-aligned in the next S, zeros elsewhere."""
    sample = next(kv for kv in prefixes + suffixes if kv)
    for layer, (sample_keys, sample_values) in enumerate(sample):
        heads, dim = sample_keys.shape[0], sample_keys.shape[2]
        keys = sample_keys.new_zeros(len(prefixes), heads, prefix_width + suffix_width, dim)
        values = sample_values.new_zeros(len(prefixes), sample_values.shape[0], prefix_width + suffix_width,
                                         sample_values.shape[2])
        for row, (prefix, suffix) in enumerate(zip(prefixes, suffixes)):
            for kv, first in ((prefix, 0), (suffix, prefix_width)):
                if kv:
                    row_keys, row_values = kv[layer]
                    keys[row, :, first: first + row_keys.shape[1]] = row_keys
                    values[row, :, first: first + row_values.shape[1]] = row_values
        cache.update(keys, values, layer)


@overload
def take_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor: ...
@overload
def take_rows(logits: HeadInput, rows: torch.Tensor) -> HeadInput: ...
@overload
def take_rows(logits: ReadLogits, rows: torch.Tensor) -> ReadLogits: ...
def take_rows(logits: ReadLogits, rows: torch.Tensor) -> ReadLogits:
    """``logits[rows]`` ([R, V] of [N, V]; or of a HeadInput, or hidden states [N, H]), as a view when ``rows`` is
    0..N-1 (at batch 1, the common case): each copy of a read is as large as the logits a call returns."""
    if rows.numel() == len(logits) and torch.equal(rows, torch.arange(rows.numel(), device=rows.device)):
        return logits
    return logits[rows]


def plain_logits(logits: ReadLogits) -> torch.Tensor:
    """The logits [R, V] of a feed that is not ``chunked``: only a chunked feed gets a HeadInput back."""
    if isinstance(logits, HeadInput):
        raise TypeError("a HeadInput came back to a feed that is not chunked")
    return logits


def logit_chunks(logits: ReadLogits) -> Iterator[torch.Tensor]:
    """The logits of ``logits``' rows in order, LOGITS_CHUNK rows ([n, V]) at a time, each computed when asked
    for (one empty chunk when there are no rows). A last chunk of fewer than SMALLEST_CHUNK rows takes
    SMALLEST_CHUNK rows of the chunk before it."""
    rows = len(logits)
    starts = list(range(0, max(rows, 1), LOGITS_CHUNK))
    if len(starts) > 1 and rows - starts[-1] < SMALLEST_CHUNK < LOGITS_CHUNK:
        starts[-1] -= SMALLEST_CHUNK
    for start, end in zip(starts, starts[1:] + [rows]):
        chunk = logits[start:end]
        yield chunk.head(chunk.states) if isinstance(chunk, HeadInput) else chunk


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's head (transformers' ``get_output_embeddings``; a PEFT wrapper hands it on), or None."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return head if isinstance(head, torch.nn.Module) else None


@contextlib.contextmanager
def head_input(head: torch.nn.Module | None, columns: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    """While open, ``head`` (None: nothing happens) computes nothing: each call of it puts the columns ``columns``
    ([U] of the call's input columns) of its input [B, ., H] in the list this yields and gets a zero-length slice.

    The head's input is the final hidden states at the columns the model computes the head at (all of them,
    or the ``logits_to_keep`` ones); the logits are the head's output, as in transformers' causal LMs."""
    states: list[torch.Tensor] = []
    if head is None:
        yield states
        return

    def keep(module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # [B, T or U, H]
        states.append(kept_logits(hidden, columns))  # the columns of [B, T or U, H], as of the logits
        return (hidden[:, :0], *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        yield states
    finally:
        handle.remove()


def read_offsets(positions: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For canvas ``positions`` [R] read from a call that feeds from canvas position ``first`` on: the fed
    offsets to compute (ascending, each once: a feed's ``read``) and the row of each position among them [R]."""
    return torch.unique(positions - first, sorted=True, return_inverse=True)


class CanvasPasses:
    """One conditioning stream's model calls over a canvas, a block at a time (CFG needs two streams).

    Without the cache every call is a full pass (the reference samplers). With ``use_cache`` the
    block's first call is a full pass that keeps the K/V of the prefix, positions [0, block.start),
    and with ``dual_cache`` also of the suffix, positions [block.end, T); later calls feed the
    positions [block.start, T) after the prefix's K/V, or, with ``dual_cache``, only the block's,
    between the prefix's and the suffix's K/V. ``shifted`` (Dream): a position is predicted by the
    logits of the position before it. ``chunked``: the calls' feeds are chunked (see CanvasCalls).
    """

    def __init__(self, stats: DecodeStats, use_cache: bool, dual_cache: bool = False, shifted: bool = False,
                 chunked: bool = False):
        self.stats = stats
        self.use_cache = use_cache
        self.dual_cache = dual_cache
        self.shifted = shifted
        self.chunked = chunked
        self.block: Block | None = None
        self.prefix: RowKV | None = None
        self.suffix: RowKV | None = None

    def start_block(self, block: Block) -> None:
        """Begin ``block``: the next call is a full pass."""
        self.block = block
        self.prefix = self.suffix = None

    def __call__(self, canvas: torch.Tensor, positions: torch.Tensor) -> CanvasStep[ReadLogits]:
        """The logits [R, V] (the model's dtype) that predict the canvas ``positions`` [R] of the block:
        each position's own, or with ``shifted`` those of the position before it among the positions the
        call feeds (the first fed position reads its own, as each sampler's reference reads them). The
        model computes the head at those positions only; ``chunked``: at none when they are more than
        LOGITS_CHUNK, and this returns their HeadInput."""
        block = self.block
        if block is None:
            raise RuntimeError("start_block comes before the block's calls")
        first = block.start if self.use_cache and self.prefix is not None else 0  # the first fed position
        offsets, rows = read_offsets((positions - int(self.shifted)).clamp(min=first), first)
        if not self.use_cache:
            logits, _ = yield CanvasFeed(self.stats, canvas, read=offsets, chunked=self.chunked)
            return take_rows(logits, rows)
        if self.prefix is None:  # the block's first step: full pass, keep the cached positions' K/V
            keep = canvas.numel() if self.dual_cache else block.start
            logits, kept = yield CanvasFeed(self.stats, canvas, keep=keep, read=offsets, chunked=self.chunked)
            assert kept is not None, "a feed that keeps K/V gets them back"
            self.prefix = [(keys[:, : block.start], values[:, : block.start]) for keys, values in kept]
            if self.dual_cache:
                self.suffix = [(keys[:, block.end:], values[:, block.end:]) for keys, values in kept]
            return take_rows(logits, rows)
        end = block.end if self.dual_cache else canvas.numel()
        logits, _ = yield CanvasFeed(self.stats, canvas[block.start: end], start=block.start, prefix=self.prefix,
                                     suffix=self.suffix, read=offsets, chunked=self.chunked)
        return take_rows(logits, rows)


# ---------------------------------------------------------------------------------------------
# one prompt's row


def report_to(clock: RowClock, callback: Callable[[MDMStep], None], stats: DecodeStats, record: MDMStep) -> None:
    """Hand a row's step to the caller's callback through the batch's clock."""
    clock.report(stats, callback, record)


def canvas_row(prompt: torch.Tensor, gen_length: int,
               program: Callable[[Canvas, torch.Generator | None], CanvasStep[DecodeResult]], *,
               mask_token_id: int, eos_token_id: EosIds, generator: torch.Generator | None,
               on_step: Callable[[MDMStep], None] | None = None,
               clock: RowClock | None = None) -> CanvasStep[DecodeResult]:
    """``program`` on the canvas of ``prompt`` [P] with ``gen_length`` masks: one row of :class:`CanvasCalls`;
    ``on_step`` sees every step, its time kept out of every row's latency by ``clock``."""
    report = None if on_step is None or clock is None else functools.partial(report_to, clock, on_step)
    canvas = Canvas(prompt, gen_length, mask_token_id=mask_token_id, eos_token_id=eos_token_id, report=report)
    return program(canvas, generator)
