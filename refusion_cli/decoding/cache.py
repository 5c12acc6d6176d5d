"""The committed context the cached decoders attend to, for one prompt or many: K/V reused in place, or
recomputed.

Every model call of ReFusion and AR goes through :class:`CausalRunner`, the causal decoders' model runner.
Each prompt being decoded is a *sequence*: its committed tokens (prompt first, then response tokens in commit
order) have their K/V in one row of a :class:`KVStore`, a preallocated store [rows, heads, columns, dim] per
layer that the model writes in place. A call feeds, for each sequence, new tokens (true position ids) after its
committed tokens; a sequence never sees another. The new tokens of a sequence are split into *groups*: a new
token sees every committed token of its sequence and the earlier new tokens of its own group. One group is
plain causal attention; several groups lay independent rows side by side (ReFusion's parallel completion
step).

A call packs the sequences' new tokens into one sequence [1, T] without padding, so the model's linear layers
compute exactly the tokens fed. Only attention is done per row of the store: its queries are laid out
[rows, Q, ...] (Q: the longest feed), each against its own row of the store, under a mask built from the
feeds' lengths and groups (``rows_attention``). The new tokens' K/V is written at the columns right after the
sequence's committed ones.

Tokens fed by a call are provisional: ``commit(sequence, n)`` keeps the first ``n`` of them, which is the
sequence's length growing by ``n``; the next call writes over whatever was not committed, so nothing is
copied to drop it. When a sequence closes, the last row of the store moves into its row (one row's
committed K/V), so that the sequences of a call are always the store's first rows and every call reads a
view of the store, never a gathered copy. The store grows (doubling) when a call needs more rows or
columns than it holds.

A call of several sequences reduces over other shapes than a sequence's call alone, so its logits differ
from batch 1's by float rounding: a decision within that rounding of a tie can go the other way. A
call of one sequence is its plain call: the same query, K/V and mask as a call of a batch of one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Protocol, TypeVar

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from refusion_cli.decoding.readback import Batched, Readback, device_index, joined, to_device
from refusion_cli.decoding.stats import DecodeStats, count_call, float_logits, logits_at, timed_call

def group_causal(groups: np.ndarray) -> np.ndarray:
    """[Q] group ids -> [Q, Q] bool (host): query i sees key j iff j <= i and both are in one group."""
    return (groups[:, None] == groups[None, :]) & np.tri(len(groups), dtype=bool)


def additive_mask(allowed: np.ndarray | torch.Tensor, dtype: torch.dtype,
                  device: torch.device | None = None) -> torch.Tensor:
    """[Q, K] or [B, Q, K] bool on the host -> [1 or B, 1, Q, K] float mask (0 where allowed, the dtype's minimum
    elsewhere), built on the host and copied to ``device`` (None: left on the host) once."""
    minimum = torch.finfo(dtype).min  # exact in float64, as every float dtype's
    mask = torch.tensor(np.where(allowed, 0.0, minimum).reshape(-1, 1, *allowed.shape[-2:]), dtype=dtype)
    return mask if device is None else to_device(mask, device)


def mask_argument(config, mask: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """A 4-D mask as the model's forward takes it: one per layer type where the config lists layer types
    (Qwen2, Qwen3), else the tensor itself (Llama: LLaDA loaded natively)."""
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return mask
    return {kind: mask for kind in sorted(set(layer_types))}


@dataclass
class Feed:
    """What one sequence feeds to a call: new tokens [Q] at true positions [Q] (device tensors, or numpy arrays
    the call copies to the device with every sequence's in one transfer), split into groups [Q]."""

    ids: torch.Tensor | np.ndarray
    positions: torch.Tensor | np.ndarray
    groups: Sequence[int] | None = None  # the group of each new token, on the host (None: one group)
    # also answer the logits of the sequence's last committed token, first: only while it has no K/V in
    # the cache (the sequence's first call, or every call without reuse)
    context_logits: bool = False


T = TypeVar("T")
# a sequence's program step: yields feeds (sent their logits) or readbacks (sent host values), returns T
SequenceStep = Generator["Feed | Readback | Batched", Any, T]


@dataclass
class _SequenceState:
    stats: DecodeStats
    pending_ids: torch.Tensor  # [N] committed tokens without K/V in the store (fed at the front of the next call)
    pending_positions: torch.Tensor  # [N]
    length: int = 0  # committed tokens with K/V in the store: columns [0, length) of its row
    fed: Feed | None = None  # the last call's new tokens (their K/V right after the committed ones), until committed


@dataclass
class CallCounts:
    """What the calls of a :class:`CausalRunner` cost besides the model: for ``refusion bench``'s counts."""

    positions: int = 0  # tokens the model computed (the packed call has no padding)
    kv_bytes_copied: int = 0  # K/V moved: a closed sequence's row filled from the last one, the store grown


class KVStore:
    """K/V of every sequence in place: per layer, keys and values [rows, heads, columns, dim], the call's
    sequence ``i`` in row ``i``. The model calls :meth:`update` once per layer; before a call :meth:`prepare` says
    where each fed token's K/V goes and how large the store must be."""

    def __init__(self, counts: CallCounts):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.counts = counts
        self._rows = self._columns = 0  # the size the next update makes sure of
        self._write_rows = self._write_columns = torch.zeros(0, dtype=torch.long)

    def prepare(self, rows: int, columns: int, write_rows: torch.Tensor, write_columns: torch.Tensor) -> None:
        """Before a call: the store holds ``rows`` x ``columns``; fed token t goes to (write_rows[t], write_columns[t])."""
        self._rows, self._columns = rows, columns
        self._write_rows, self._write_columns = write_rows, write_columns

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the call's K/V ([1, heads, T, dim]) in place; return the layer's whole store (rows_attention reads
        each sequence's row of it)."""
        if layer_idx == len(self.keys):
            self.keys.append(key_states.new_zeros(0, *key_states.shape[1:2], 0, key_states.shape[3]))
            self.values.append(value_states.new_zeros(0, *value_states.shape[1:2], 0, value_states.shape[3]))
        keys, values = self._sized(layer_idx)
        keys[self._write_rows, :, self._write_columns] = key_states[0].transpose(0, 1)  # [T, heads, dim]
        values[self._write_rows, :, self._write_columns] = value_states[0].transpose(0, 1)
        return keys, values

    def _sized(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        rows, columns = _grown(keys.shape[0], self._rows), _grown(keys.shape[2], self._columns)
        if (rows, columns) == (keys.shape[0], keys.shape[2]):
            return keys, values
        grown = []
        for old in (keys, values):
            new = old.new_zeros(rows, old.shape[1], columns, old.shape[3])
            new[: old.shape[0], :, : old.shape[2]] = old
            self.counts.kv_bytes_copied += old.numel() * old.element_size()
            grown.append(new)
        self.keys[layer], self.values[layer] = grown
        return grown[0], grown[1]

    def move(self, source: int, target: int, columns: int) -> None:
        """Copy the first ``columns`` entries of row ``source`` into row ``target``, every layer."""
        for states in (*self.keys, *self.values):
            states[target, :, :columns] = states[source, :, :columns]
            self.counts.kv_bytes_copied += states[source, :, :columns].numel() * states.element_size()


class CallKV:
    """The cache of a packed call that keeps nothing: the model's K/V of the call's tokens come back as they are
    ([1, kv heads, T, dim]), and ``rows_attention`` reads each row's span of them (``RowsMask.call_keys``)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states


def _grown(size: int, needed: int) -> int:
    """A store dimension of ``size`` that must hold ``needed``: as it is, or doubled (at least ``needed``)."""
    return size if size >= needed else max(needed, 2 * size)


@dataclass
class PackedRows:
    """The rows of a call laid out as one batch for a single attention call per layer: queries gathered
    [rows, Q] from the packed sequence (padding repeats a row's first query), against the store's first
    ``rows`` rows and ``columns`` columns under one mask."""

    gather: torch.Tensor  # [rows * Q]: the packed token of each (row, query) place
    scatter: torch.Tensor  # [T]: the (row, query) place of each packed token
    mask: torch.Tensor  # [rows, 1, Q, columns] additive (a padding query sees its row's first column)
    rows: int
    queries: int
    columns: int


@dataclass
class RowsMask:
    """What ``rows_attention`` needs to attend row by row in a packed call (passed as the model's mask)."""

    spans: list[tuple[int, int, int]]  # per row: its first packed token, its token count, the store columns it sees
    masks: list[torch.Tensor]  # per row: additive mask [1, 1, n, columns] (0 on its committed columns)
    implementation: str  # the attention the model runs otherwise (sdpa, eager)
    packed: PackedRows | None = None  # set: one attention call for every row (see CausalRunner's ``packed``)
    call_keys: bool = False  # the keys are the call's own packed K/V (CallKV), a row's those of its span


def row_masks(alloweds: list[np.ndarray], dtype: torch.dtype, device: torch.device,
              packed: bool) -> tuple[PackedRows | None, list[torch.Tensor]]:
    """The attention layout of a packed call whose row ``i`` feeds ``alloweds[i].shape[0]`` tokens (in row
    order) that see columns ``alloweds[i]`` [n, c] (host, bool) of its store row: with ``packed``, one
    attention call for every row (:class:`PackedRows`), else each row's additive mask [1, 1, n, c]. Built on
    the host and copied to the device once, whatever the number of rows."""
    lengths = [allowed.shape[0] for allowed in alloweds]
    rows, queries = len(lengths), max(max(lengths), 1)
    columns = max(max(allowed.shape[1] for allowed in alloweds), 1)
    allowed = np.zeros((rows, queries, columns), dtype=bool)
    allowed[:, :, 0] = True  # a padding query sees one column (its output is dropped), never none
    for row, row_allowed in enumerate(alloweds):
        allowed[row, : row_allowed.shape[0], : row_allowed.shape[1]] = row_allowed
    additive = additive_mask(allowed, dtype, device)  # [rows, 1, Q, columns]
    if not packed:  # [rows, 1, Q, columns]: each row's own corner
        return None, [additive[row: row + 1, :, :n, : row_allowed.shape[1]]
                      for row, (n, row_allowed) in enumerate(zip(lengths, alloweds))]
    gather: list[int] = []
    scatter: list[int] = []
    first = 0
    for row, n in enumerate(lengths):
        gather.extend(range(first, first + n))
        gather.extend([first] * (queries - n))
        scatter.extend(range(row * queries, row * queries + n))
        first += n
    return PackedRows(device_index(gather, device), device_index(scatter, device), additive, rows, queries,
                      columns), []


ROWS_ATTENTION = "refusion_rows"
# what a packed call passes as the model's mask: a prepared 4-D mask to transformers, which then builds none;
# the real layout goes to rows_attention as the ``rows_mask`` keyword
PLACEHOLDER_MASK = torch.zeros(1, 1, 0, 0)


def rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, scaling: float | None = None, *, rows_mask: RowsMask,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of a packed call ([1, heads, T, dim] queries): each row's queries against its row of the store
    ([rows, kv heads, columns, dim]) only, so no row sees another's K/V. Row by row (one kernel per row), or
    with ``rows_mask.packed`` in one call for every row. With the model's sdpa it is torch's, the K/V heads
    shared in place (``enable_gqa``), which computes what transformers' sdpa call computes on the repeated heads;
    another attention (or a sliding window, a softcap) runs as the model's own."""
    rows = rows_mask  # the call's layout; ``attention_mask`` is a placeholder that keeps transformers from making one
    own = rows.implementation != "sdpa" or kwargs.get("sliding_window") is not None or bool(kwargs.get("softcap"))
    if rows.packed is not None:
        packed = rows.packed
        queries = query[0][:, packed.gather].view(query.shape[1], packed.rows, packed.queries, query.shape[3])
        queries = queries.transpose(0, 1)  # [rows, heads, Q, dim]
        if rows.call_keys:  # gathered as the queries are: each row's own tokens, padding masked out
            keys, values = (kv[0][:, packed.gather].view(kv.shape[1], packed.rows, packed.queries, kv.shape[3])
                            .transpose(0, 1) for kv in (key, value))
        else:
            keys, values = key[: packed.rows, :, : packed.columns], value[: packed.rows, :, : packed.columns]
        out = _attend(module, queries, keys, values, packed.mask, scaling, rows.implementation, own, kwargs)
        out = out.reshape(packed.rows * packed.queries, *out.shape[2:])  # [rows * Q, heads, dim]
        return out[packed.scatter][None], None  # [1, T, heads, dim]
    outs = []
    for row, ((first, count, columns), mask) in enumerate(zip(rows.spans, rows.masks)):
        queries = query[:, :, first: first + count]  # [1, heads, n, dim]
        if rows.call_keys:
            keys, values = key[:, :, first: first + count], value[:, :, first: first + count]
        else:
            keys, values = key[row: row + 1, :, :columns], value[row: row + 1, :, :columns]
        outs.append(_attend(module, queries, keys, values, mask, scaling, rows.implementation, own, kwargs))
    return torch.cat(outs, 1), None  # [1, T, heads, dim]


def _attend(module: torch.nn.Module, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor, scaling: float | None, implementation: str, own: bool,
            kwargs: dict[str, Any]) -> torch.Tensor:
    """[B, n, heads, dim]: ``queries`` [B, heads, n, dim] against ``keys`` / ``values`` [B, kv heads, c, dim]."""
    if not own:
        return torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scaling,
            enable_gqa=keys.shape[1] != queries.shape[1]).transpose(1, 2)
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, sdpa_attention_forward)
    out, _ = inner(module, queries, keys, values, mask, scaling=scaling, **kwargs)
    return out


AttentionInterface.register(ROWS_ATTENTION, rows_attention)


@contextlib.contextmanager
def attending_by_rows(model: torch.nn.Module) -> Iterator[str]:
    """Route the model's attention through ``rows_attention`` for one call; yields the attention it had."""
    config: Any = model.config  # transformers' config: its fields are dynamic
    before: str | None = config._attn_implementation_internal
    config._attn_implementation_internal = ROWS_ATTENTION
    try:
        yield before or "sdpa"
    finally:
        config._attn_implementation_internal = before


class CausalRunner:
    """The causal decoders' model runner: independent decodes (sequences) sharing the model calls, one packed
    call, a row of the store each.

    Committed tokens without K/V in the store are *pending*: they are fed, plain causal over commit
    order, at the front of the sequence's next call. With ``reuse`` the K/V of that call is kept, so a
    token is computed once (the prompt rides along with the sequence's first call); without ``reuse``
    every committed token stays pending and is recomputed on every call.
    """

    def __init__(self, model: torch.nn.Module, reuse: bool = True, packed: bool | None = None):
        """``packed``: at more than one sequence, one attention call per layer for all of them (None: on CUDA
        only, where a kernel per sequence would be a launch per sequence and layer; on a CPU the loop is as
        fast)."""
        self.model = model
        self.reuse = reuse
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.packed = self.device.type == "cuda" if packed is None else packed
        self.counts = CallCounts()
        self.store = KVStore(self.counts)
        self.rows: list[int] = []  # the sequence in each row of the store
        self.sequences: dict[int, _SequenceState] = {}

    def open(self, sequence: int, stats: DecodeStats, prompt_ids: torch.Tensor) -> "CausalSequence":
        """Start ``sequence`` with ``prompt_ids`` [P] committed at positions 0..P-1; ``stats`` counts its calls."""
        positions = torch.arange(prompt_ids.numel(), device=prompt_ids.device)
        self.sequences[sequence] = _SequenceState(stats, prompt_ids, positions)
        self.rows.append(sequence)
        return CausalSequence(self, sequence)

    def close(self, sequence: int) -> None:
        """End a sequence: the store's last row moves into its row (a sequence already closed stays closed)."""
        if self.sequences.pop(sequence, None) is None:
            return
        row, last = self.rows.index(sequence), len(self.rows) - 1
        if row != last:
            moved = self.rows[last]
            state = self.sequences[moved]
            fed = len(state.fed.ids) if state.fed is not None else 0
            written = state.length + fed if self.reuse else 0  # committed, and fed until committed
            if self.store.keys and written:
                self.store.move(last, row, written)
            self.rows[row] = moved
        self.rows.pop()

    def length(self, sequence: int) -> int:
        """Committed tokens of ``sequence``, prompt included."""
        state = self.sequences[sequence]
        return state.length + state.pending_ids.numel()

    def commit(self, sequence: int, n: int) -> None:
        """Commit the first ``n`` new tokens ``sequence`` fed to the last call (none may depend on a later
        group)."""
        state = self.sequences[sequence]
        if state.fed is None:
            if n:
                raise RuntimeError("commit() without a preceding forward()")
            return
        fed, state.fed = state.fed, None
        if self.reuse:
            state.length += n
        else:
            state.pending_ids = joined([state.pending_ids, fed.ids[:n]], self.device)
            state.pending_positions = joined([state.pending_positions, fed.positions[:n]], self.device)

    def forward(self, feeds: dict[int, Feed]) -> dict[int, torch.Tensor]:
        """One model call, counted once for every sequence: each open one feeds its tokens after its committed
        ones.

        Returns each sequence's float logits [Q, V] of its new tokens (the model computes no others when it
        can), [1 + Q, V] with ``context_logits``. Tokens fed by an earlier call and not committed are
        written over.
        """
        if set(feeds) != set(self.sequences):
            raise RuntimeError("every open sequence feeds every call")
        states = [self.sequences[sequence] for sequence in self.rows]
        inputs = []
        for state, sequence in zip(states, self.rows):
            feed = feeds[sequence]
            state.fed = None
            if feed.context_logits and not state.pending_ids.numel():
                raise RuntimeError("context_logits asked for a committed token whose K/V is already cached")
            inputs.append(self._row_input(state, feed))
        lengths = [sum(len(piece) for piece in ids) for ids, _, _ in inputs]
        starts = [state.length if self.reuse else 0 for state in states]
        reads = [len(feeds[sequence].ids) + feeds[sequence].context_logits for sequence in self.rows]
        total = sum(lengths)
        with attending_by_rows(self.model) as implementation:
            mask, write_rows, write_columns, read_columns = self._layout(inputs, lengths, starts, reads, implementation)
            self.store.prepare(len(states), max(span[2] for span in mask.spans), write_rows, write_columns)
            out, seconds = timed_call(
                self.model,
                input_ids=joined([piece for ids, _, _ in inputs for piece in ids], self.device)[None],  # [1, T]
                position_ids=joined([piece for _, positions, _ in inputs for piece in positions], self.device)[None],
                attention_mask=mask_argument(self.model.config, PLACEHOLDER_MASK),
                rows_mask=mask,
                use_cache=True,
                cache=self.store,
                **logits_at(self.model, read_columns, total, last=len(states) == 1),
            )
        self.counts.positions += total
        logits = out.logits[0]
        if logits.shape[0] != read_columns.numel():
            logits = logits[read_columns]
        logits = float_logits(logits)  # every sequence's at once
        results, offset = {}, 0
        for sequence, state, n, read in zip(self.rows, states, lengths, reads):
            feed = feeds[sequence]
            count_call(state.stats, n, seconds)
            results[sequence] = logits[offset: offset + read]
            offset += read
            state.fed = feed
            if self.reuse:  # the pending tokens' K/V is in the store now, the fed tokens' right after
                state.length += state.pending_ids.numel()
                state.pending_ids, state.pending_positions = state.pending_ids[:0], state.pending_positions[:0]
        return results

    def _layout(self, inputs: list[tuple[list[Any], list[Any], np.ndarray]], lengths: list[int],
                starts: list[int], reads: list[int],
                implementation: str) -> tuple[RowsMask, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed call's per-sequence attention (by the model's ``implementation`` otherwise), where its K/V goes
        ([T] store rows and columns), and the packed columns whose logits are read."""
        spans, alloweds = [], []
        reading: list[int] = []
        offset = 0
        for (_, _, among), n, start, read in zip(inputs, lengths, starts, reads):
            allowed = np.ones((n, start + n), dtype=bool)  # [n, columns]
            allowed[:, start:] = among
            alloweds.append(allowed)
            spans.append((offset, n, start + n))
            reading.extend(range(offset + n - read, offset + n))  # the sequence's last ``read`` tokens
            offset += n
        packed, masks = row_masks(alloweds, self.dtype, self.device, self.packed and len(inputs) > 1)
        write_rows = np.repeat(np.arange(len(inputs)), lengths)  # [T]
        write_columns = np.concatenate([np.arange(start, start + n) for start, n in zip(starts, lengths)])  # [T]
        write_rows_device, write_columns_device = device_index(np.stack([write_rows, write_columns]), self.device)
        read_columns = device_index(reading, self.device)
        return RowsMask(spans, masks, implementation, packed), write_rows_device, write_columns_device, read_columns

    def _row_input(self, state: _SequenceState, feed: Feed) -> tuple[list[torch.Tensor | np.ndarray],
                                                            list[torch.Tensor | np.ndarray], np.ndarray]:
        """A sequence's pending + new tokens, their positions and what they see among themselves [Q, Q]
        (host)."""
        n_pending, n_new = state.pending_ids.numel(), len(feed.ids)
        groups = np.zeros(n_new, dtype=np.int64) if feed.groups is None else np.asarray(feed.groups, dtype=np.int64)
        among = group_causal(np.concatenate([np.full(n_pending, -1), groups]))  # [Q, Q] with Q = pending + new
        among[n_pending:, :n_pending] = True  # new tokens see every pending committed token
        if not n_pending:
            return [feed.ids], [feed.positions], among
        return [state.pending_ids, feed.ids], [state.pending_positions, feed.positions], among


class CausalSequence:
    """One sequence's view of :class:`CausalRunner`, for a decoder written as a generator: ``yield from
    sequence.forward(...)`` hands a :class:`Feed` to the driver and returns the sequence's logits."""

    def __init__(self, runner: CausalRunner, sequence: int):
        self.runner = runner
        self.sequence = sequence

    @property
    def length(self) -> int:
        """Committed tokens, prompt included."""
        return self.runner.length(self.sequence)

    def forward(self, ids: torch.Tensor | np.ndarray, positions: torch.Tensor | np.ndarray,
                groups: Sequence[int] | None = None,
                context_logits: bool = False) -> SequenceStep[torch.Tensor]:
        """Feed ``ids`` [Q] at true ``positions`` [Q] after the committed tokens; return float logits [Q, V].

        ``groups`` [Q] (default: one group) limits what the new tokens see among themselves.
        ``context_logits``: the logits of the last committed token come first ([1 + Q, V]); only in
        a call that computes that token's K/V (the sequence's first call, or any call without reuse).
        """
        return (yield Feed(ids, positions, groups, context_logits))

    def commit(self, n: int) -> None:
        """Commit the first ``n`` tokens fed by the last call (they must not depend on a later group)."""
        self.runner.commit(self.sequence, n)


class ModelRunner(Protocol):
    """What the engine needs of the rows' shared model calls: :class:`CausalRunner`, or the masked-diffusion
    samplers' ``mdm.CanvasRunner``."""

    def forward(self, feeds: dict[int, Any]) -> dict[int, Any]: ...

    def close(self, row: int) -> None: ...
