"""What the masked-diffusion samplers (LLaDA, Dream, D2F) share: the model calls of every row (one packed call,
K/V in place), the prefix and dual caches of Fast-dLLM, and the logits read at the read positions only (the
canvas itself: ``canvas``; the choice of positions: ``mdm_sampling``).

Calls: a sampler is a row program (a generator that yields a :class:`CanvasFeed` per model call and is sent its
reply) on a prompt's canvas (:func:`canvas_row`); :class:`CanvasRunner` makes one call of every running row's
feed. A row's K/V lives in its row of a ``cache.KVStore`` whose columns are the canvas positions: a fed token's
K/V is written at its position, and a later feed sees the columns it names (the prefix left of the fed tokens,
the dual cache's suffix right of them) in place; nothing is copied or concatenated.

Caches (Fast-dLLM's ``use_cache`` / ``dual_cache``): a block's first step is a full pass that keeps the prefix's
K/V (positions [0, block start)) and, with ``dual_cache``, the suffix's (right of the block); later steps feed
the block and the suffix, or the block alone. Exact for a causal model, an approximation for a bidirectional one
(the cached K/V were computed while the block was still masked).

Rounding: a call of several rows reduces over other shapes than a row's call alone, so a decision within float
rounding of a tie can go the other way; a call of one row is that row's own call.

Logits: a feed names the fed offsets it reads, and the model computes the head there only. A row that reads
more than :data:`LOGITS_CHUNK` positions (Dream's masks) is ``chunked``: the head computes nothing in the call
and the row gets the head's input (:class:`HeadInput`), applied :data:`LOGITS_CHUNK` rows at a time
(:func:`logit_chunks`); a model whose head cannot be reached computes the logits in the call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterator, overload

import numpy as np
import torch

from refusion_cli.decoding.cache import (PLACEHOLDER_MASK, CallCounts, CallKV, KVStore, RowsMask, attending_by_rows,
                                         mask_argument, row_masks)
from refusion_cli.decoding.canvas import Block, Canvas, CanvasStep, MDMStep, even_schedule, report_to
from refusion_cli.decoding.readback import device_index
from refusion_cli.decoding.stats import (DecodeResult, DecodeStats, EosIds, RowClock, cache_argument, count_call,
                                         kept_logits, logits_at, timed_call)

LOGITS_CHUNK = 32  # the most read positions whose logits a chunked row (Dream) holds at once: [LOGITS_CHUNK, V]
# The CPU's BLAS computes a product of 1 to 3 rows another way than a longer one (float32; bfloat16 at Dream's
# 3,584 wide), and float64's in groups of 4: chunks of rows that start at multiples of 4 and have at least 4 rows
# give the head's rows bit for bit as one product of them all (measured here in float64 and bfloat16, and in
# float32 on one thread; float32 on several threads splits rows by their count, and rounds differently)
SMALLEST_CHUNK = 4


@dataclass
class CanvasFeed:
    """What one row feeds to a shared call: ``ids`` [Q] at canvas positions start..start+Q-1, their K/V written at
    those columns of the row's store (shifted by ``base``: a second conditioning stream's own columns); they see
    the row's cached columns [0, prefix) and the ``suffix`` columns right after the fed ones (not in a causal
    model), and each other (all, the earlier ones in a causal model; ``among`` narrows that)."""

    stats: DecodeStats  # the row's counters: the call counts once for it, with Q positions
    ids: torch.Tensor  # [Q]
    start: int = 0
    prefix: int = 0  # cached columns left of the fed tokens that they see
    suffix: int = 0  # cached columns right of them that they see (the dual cache's)
    keep: int | None = None  # later calls read the K/V of the first ``keep`` fed positions (None: this call's none)
    among: np.ndarray | None = None  # [Q, Q] bool (host): fed token q sees fed token k (None: all, or the earlier ones)
    read: Sequence[int] | torch.Tensor | None = None  # ascending fed offsets whose logits come back (None: all)
    chunked: bool = False  # the row takes a HeadInput for its logits when the call reads more than LOGITS_CHUNK
    base: int = 0  # the store column of canvas position 0 for this stream

    @property
    def cached(self) -> bool:
        """Whether the feed reads or keeps K/V of the store (else it is a pass over the whole canvas, alone)."""
        return bool(self.prefix or self.suffix or self.start) or self.keep is not None

    def reads(self) -> list[int]:
        if self.read is None:
            return list(range(self.ids.numel()))
        return self.read.tolist() if isinstance(self.read, torch.Tensor) else list(self.read)


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
CanvasReply = tuple[ReadLogits, None]  # the read positions' logits (a HeadInput for a chunked feed)


class CanvasRunner:
    """The masked-diffusion decoders' model runner: one model call for every row of a batch of canvases (driven by
    ``engine.Engine``).

    A call where no row reads or keeps K/V (whole canvases, no cache) and every canvas is as long is the plain
    call [B, Q] (with one row: the reference's own call). Any other call is packed [1, T] (rows end to end, true
    position ids, no padding), each fed token's K/V written at its column of its row's store (none for whole
    canvases: ``cache.CallKV``), and attention done row by row against the row's store
    (``cache.rows_attention``; ``packed``: one attention call per layer for every row). A row opens at its
    first feed, in the store's first free row; a closed row's store row stays free until a row opens there (a
    free row between open ones is a row of no tokens), so no K/V ever moves.
    The model computes logits at the read positions only, and none when they are more than LOGITS_CHUNK and
    some feed is ``chunked``: such a feed gets its reads' head input, any other row the head's output.
    """

    def __init__(self, model: torch.nn.Module, packed: bool | None = None):
        """``packed``: at more than one row, one attention call per layer for all of them (None: on CUDA)."""
        self.model = model
        self.causal = attends_causally(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.packed = self.device.type == "cuda" if packed is None else packed
        self.counts = CallCounts()
        self.store = KVStore(self.counts)
        self.slots: list[int | None] = []  # the row (request) in each row of the store; None: free
        self.placeholder = PLACEHOLDER_MASK.to(self.device)

    def close(self, row: int) -> None:
        """A row leaves: its store row is free for the next row to open (nothing moves); the last one to leave
        lets the store go (the next row's store is made to its size, not grown by copying a free one)."""
        if row in self.slots:
            self.slots[self.slots.index(row)] = None
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        if not self.slots:
            self.store = KVStore(self.counts)

    def forward(self, feeds: dict[int, CanvasFeed]) -> dict[int, CanvasReply]:
        """One counted model call over every row's feed; each row gets its read logits back."""
        for row in feeds:
            if row not in self.slots:
                free = self.slots.index(None) if None in self.slots else len(self.slots)
                self.slots[free: free + 1] = [row]
        order = [row for row in self.slots if row is not None]  # feeds in store order
        if len(feeds) != len(order):
            raise RuntimeError("every open row feeds every call")
        rows = [feeds[row] for row in order]
        lengths = [feed.ids.numel() for feed in rows]
        reads = [feed.reads() for feed in rows]
        # whole canvases of one length, nothing cached: the plain call of one row each [B, Q]; else packed
        stacked = not any(feed.cached for feed in rows) and len(set(lengths)) == 1
        width = max(lengths) if stacked else sum(lengths)
        if stacked:
            columns, where = _stacked_columns(reads)
        else:
            columns, where = _packed_columns(reads, lengths)
        index = device_index(columns, self.device)  # [U]
        keep = logits_at(self.model, index, width, last=columns == list(range(width - len(columns), width)))
        head = output_head(self.model)
        chunks = head is not None and len(columns) > LOGITS_CHUNK and any(feed.chunked for feed in rows)
        with head_input(head if chunks else None, index) as states:  # states: [B, U, H] once the head ran
            if stacked:
                out, seconds = self._stacked_call(rows, width, keep)
            else:
                out, seconds = self._packed_call([None if row is None else feeds[row] for row in self.slots], keep)
        self.counts.positions += len(rows) * width if stacked else width
        read_logits = _row_reads(rows, where, out, index, head, states, stacked)
        replies = {}
        for row, feed, n, logits in zip(order, rows, lengths, read_logits):
            count_call(feed.stats, n, seconds)
            replies[row] = (logits, None)
        return replies

    def _stacked_call(self, rows: list[CanvasFeed], width: int, keep: dict) -> tuple[Any, float | None]:
        """The model's output and seconds for whole canvases [B, width] of one length: the plain call."""
        return timed_call(self.model, input_ids=torch.stack([feed.ids for feed in rows]), use_cache=False, **keep)

    def _packed_call(self, slots: list[CanvasFeed | None], keep: dict) -> tuple[Any, float | None]:
        """The model's output and seconds for the feeds of the store's rows (None: a free row, which feeds
        nothing) packed into [1, T], their K/V in the store; when no feed reads or keeps K/V (whole canvases
        without a cache), no store: each row attends to its own tokens' K/V of the call (``cache.CallKV``)."""
        own = not any(feed.cached for feed in slots if feed is not None)
        if own:
            slots = [feed for feed in slots if feed is not None]
        places: list[tuple[int, int, int]] = []  # per fed token: its store row, store column and position
        spans, alloweds, first = [], [], 0
        for slot, feed in enumerate(slots):
            if feed is None:
                allowed = np.zeros((0, 1), dtype=bool)
            else:
                allowed = self._among(feed) if own else self._allowed(feed)  # [Q, columns]
                column = feed.base + feed.start
                places.extend((slot, column + offset, feed.start + offset) for offset in range(allowed.shape[0]))
            alloweds.append(allowed)
            spans.append((first, allowed.shape[0], allowed.shape[1]))
            first += allowed.shape[0]
        write_rows, write_columns, positions = device_index(places, self.device).T.contiguous()  # [T] each
        packed, masks = row_masks(alloweds, self.dtype, self.device, self.packed and len(slots) > 1)
        attend = attending_by_rows(self.model) if hasattr(self.model.config, "_attn_implementation_internal") \
            else contextlib.nullcontext("sdpa")  # a stand-in model's config (it runs no attention of its own)
        with attend as implementation:
            if not own:
                self.store.prepare(len(slots), max(span[2] for span in spans), write_rows, write_columns)
            return timed_call(self.model, input_ids=torch.cat([feed.ids for feed in slots if feed is not None])[None],
                              position_ids=positions[None],
                              attention_mask=mask_argument(self.model.config, self.placeholder),
                              rows_mask=RowsMask(spans, masks, implementation, packed, call_keys=own), use_cache=True,
                              **cache_argument(self.model, CallKV() if own else self.store), **keep)

    def _among(self, feed: CanvasFeed) -> np.ndarray:
        """[Q, Q] bool (host): which fed tokens each fed token sees."""
        n = feed.ids.numel()
        among = np.ones((n, n), dtype=bool) if feed.among is None else feed.among
        return np.tril(among) if self.causal else among

    def _allowed(self, feed: CanvasFeed) -> np.ndarray:
        """[Q, columns] bool (host): the store columns of its row each fed token sees."""
        n, fed = feed.ids.numel(), feed.base + feed.start
        allowed = np.zeros((n, fed + n + feed.suffix), dtype=bool)
        allowed[:, feed.base: feed.base + feed.prefix] = True
        allowed[:, fed: fed + n] = self._among(feed)
        if not self.causal:
            allowed[:, fed + n:] = True
        return allowed


def _stacked_columns(reads: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """A plain call's columns whose logits some row reads (ascending, [U]), and where each row's reads are in them."""
    columns = sorted(set().union(*reads))
    at = {column: index for index, column in enumerate(columns)}
    return columns, [[at[column] for column in read] for read in reads]


def _packed_columns(reads: list[list[int]], lengths: list[int]) -> tuple[list[int], list[list[int]]]:
    """A packed call's read columns (each row's reads after the rows before it) and each row's place in them."""
    columns: list[int] = []
    where = []
    first = 0
    for read, n in zip(reads, lengths):
        where.append(list(range(len(columns), len(columns) + len(read))))
        columns.extend(first + offset for offset in read)
        first += n
    return columns, where


def _row_reads(rows: list[CanvasFeed], where: list[list[int]], out: Any, columns: torch.Tensor,
               head: torch.nn.Module | None, states: list[torch.Tensor], stacked: bool) -> list[ReadLogits]:
    """Each row's read logits [R, V] from the call's output ([B, U, .] ``stacked``, else [1, U, .]), or, where the
    head's input was kept (``states``), a chunked row's HeadInput and any other row's logits computed from it."""
    if not states or head is None:  # the head's input is kept only when there is a head
        logits = kept_logits(out.logits, columns)  # [B or 1, U, V]
        return [take_rows(logits[row if stacked else 0], read) for row, read in enumerate(where)]
    hidden = states[-1]  # [B or 1, U, H]
    inputs = [HeadInput(take_rows(hidden[row if stacked else 0], read), head) for row, read in enumerate(where)]
    return [given if feed.chunked else given.head(given.states) for feed, given in zip(rows, inputs)]


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


@overload
def take_rows(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor: ...
@overload
def take_rows(logits: HeadInput, rows: Sequence[int]) -> HeadInput: ...
@overload
def take_rows(logits: ReadLogits, rows: Sequence[int]) -> ReadLogits: ...
def take_rows(logits: ReadLogits, rows: Sequence[int]) -> ReadLogits:
    """``logits[rows]`` ([R, V] of [N, V]; or of a HeadInput, or hidden states [N, H]), a view when ``rows`` is a
    run of consecutive rows (at batch 1 every row): each copy of a read is as large as the logits a call returns."""
    rows = list(rows)
    if rows == list(range(rows[0], rows[0] + len(rows))) if rows else True:
        return logits[rows[0]: rows[0] + len(rows)] if rows else logits[:0]
    device = logits.states.device if isinstance(logits, HeadInput) else logits.device
    return logits[device_index(rows, device)]


def plain_logits(logits: ReadLogits) -> torch.Tensor:
    """The logits [R, V] of a feed that is not ``chunked``: only a chunked feed gets a HeadInput back."""
    if isinstance(logits, HeadInput):
        raise TypeError("a HeadInput came back to a feed that is not chunked")
    return logits


def one_chunk(logits: ReadLogits) -> bool:
    """Whether ``logits`` are at most a chunk's worth: computed logits, or a HeadInput of at most LOGITS_CHUNK rows."""
    return isinstance(logits, torch.Tensor) or len(logits) <= LOGITS_CHUNK


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
    ([U] of the call's input columns) of its input [B, ., H] in the list this yields and gets a zero-length slice."""
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


def read_offsets(positions: Sequence[int], first: int) -> tuple[list[int], list[int]]:
    """For canvas ``positions`` [R] read from a call that feeds from canvas position ``first`` on: the fed
    offsets to compute (ascending, each once: a feed's ``read``) and the row of each position among them [R]."""
    offsets = sorted({position - first for position in positions})
    at = {offset: row for row, offset in enumerate(offsets)}
    return offsets, [at[position - first] for position in positions]


class CanvasPasses:
    """One conditioning stream's model calls over a canvas, a block at a time (CFG's second stream: ``base``, the
    store columns after the first's).

    Without the cache every call is a full pass (the reference samplers). With ``use_cache`` the block's first
    call is a full pass that keeps the K/V of the prefix, positions [0, block.start), and with ``dual_cache`` of
    the whole canvas; later calls feed [block.start, T) after the prefix, or, with ``dual_cache``, the block
    alone between the prefix and the suffix [block.end, T). ``shifted`` (Dream): a position is predicted by the
    logits of the position before it. ``chunked``: the calls' feeds are chunked (see CanvasRunner).
    """

    def __init__(self, stats: DecodeStats, use_cache: bool, dual_cache: bool = False, shifted: bool = False,
                 chunked: bool = False, base: int = 0):
        self.stats = stats
        self.use_cache = use_cache
        self.dual_cache = dual_cache
        self.shifted = shifted
        self.chunked = chunked
        self.base = base
        self.block: Block | None = None
        self.cached = False  # the block's full pass is done: its K/V are in the store

    def start_block(self, block: Block) -> None:
        """Begin ``block``: the next call is a full pass."""
        self.block = block
        self.cached = False

    def __call__(self, canvas: torch.Tensor, positions: Sequence[int]) -> CanvasStep[ReadLogits]:
        """The logits [R, V] (the model's dtype) that predict the canvas ``positions`` [R] of the block:
        each position's own, or with ``shifted`` those of the position before it among the positions the
        call feeds (the first fed position reads its own, as each sampler's reference reads them). The
        model computes the head at those positions only; ``chunked``: at none when they are more than
        LOGITS_CHUNK, and this returns their HeadInput."""
        block = self.block
        if block is None:
            raise RuntimeError("start_block comes before the block's calls")
        first = block.start if self.use_cache and self.cached else 0  # the first fed position
        offsets, rows = read_offsets([max(position - int(self.shifted), first) for position in positions], first)
        feed = CanvasFeed(self.stats, canvas, read=offsets, chunked=self.chunked, base=self.base)
        if self.use_cache and not self.cached:  # the block's first step: a full pass that keeps K/V
            feed.keep = canvas.numel() if self.dual_cache else block.start
            self.cached = True
        elif self.use_cache:
            end = block.end if self.dual_cache else canvas.numel()
            feed.ids, feed.start, feed.prefix = canvas[block.start: end], block.start, block.start
            feed.suffix = canvas.numel() - end
        logits, _ = yield feed
        return take_rows(logits, rows)


# ---------------------------------------------------------------------------------------------
# one prompt's row


def canvas_row(prompt: torch.Tensor, gen_length: int,
               program: Callable[[Canvas, torch.Generator | None], CanvasStep[DecodeResult]], *,
               mask_token_id: int, eos_token_id: EosIds, generator: torch.Generator | None,
               on_step: Callable[[MDMStep], None] | None = None,
               clock: RowClock | None = None) -> CanvasStep[DecodeResult]:
    """``program`` on the canvas of ``prompt`` [P] with ``gen_length`` masks: one row of :class:`CanvasRunner`;
    ``on_step`` sees every step, its time kept out of every row's latency by ``clock``."""
    report = None if on_step is None or clock is None else functools.partial(report_to, clock, on_step)
    canvas = Canvas(prompt, gen_length, mask_token_id=mask_token_id, eos_token_id=eos_token_id, report=report)
    return program(canvas, generator)


__all__ = ["Block", "Canvas", "CanvasFeed", "CanvasPasses", "CanvasRunner", "CanvasStep", "HeadInput", "LOGITS_CHUNK",
           "MDMStep", "ReadLogits", "attends_causally", "canvas_row", "even_schedule", "logit_chunks", "output_head",
           "one_chunk", "plain_logits", "read_offsets", "take_rows"]
