"""The committed context the cached decoders attend to, for one prompt or a batch: K/V reused from a
cache, or recomputed.

Every model call of ReFusion and AR goes through :class:`Lanes`. Each prompt being decoded is a
*lane*: one row of a padded batch, with its own committed tokens (prompt first, then response
tokens in commit order) in the rows of one shared KV cache. A call feeds, for each lane, new
tokens (true position ids) after that lane's committed tokens; a lane never sees another lane. The
new tokens of a lane are split into *groups*: a new token sees every committed token of its lane
and the earlier new tokens of its own group. One group is plain causal attention; several groups
lay independent rows side by side (ReFusion's parallel completion step).

Tokens fed by a call are provisional: ``commit(lane, n)`` keeps the first ``n`` of them, and the
next call drops whatever was not committed: the cache keeps, per row, its lane's committed entries
(a gather over the cache's sequence dimension, made only when the longest row holds an uncommitted
entry or a row leaves; shorter rows keep unused entries, masked out). With one lane this is a crop
of the cache, and the call is the single-row call of a batch of one.

Rows are left-padded to the longest input of the call; padding is masked out for every real
token, and pad positions see only themselves. A lane's first call (its prompt, far longer than a
decoding step) runs in a call of its own beside the rows already decoding, and its K/V then joins
the cache, so those rows are not padded to the prompt's length. A padded call reduces over other
shapes than a lane's call alone, so its logits differ from batch 1's by float rounding: a decision
within that rounding of a tie can go the other way.
"""

from __future__ import annotations

import torch
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Protocol, TypeVar

from transformers import DynamicCache

from refusion_cli.decoding.stats import (BatchClock, DecodeResult, DecodeStats, cache_argument, count_call, float_logits,
                                         last_logits, timed_call)


def group_causal(groups: torch.Tensor) -> torch.Tensor:
    """[Q] group ids -> [Q, Q] bool: query i sees key j iff j <= i and both are in one group."""
    same = groups[:, None] == groups[None, :]
    return same & torch.ones_like(same).tril()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Q, K] or [B, Q, K] bool -> [1 or B, 1, Q, K] float mask (0 where allowed, the dtype's minimum elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(-1, 1, *allowed.shape[-2:])


def mask_argument(config, mask: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """A 4-D mask as the model's forward takes it: one per layer type where the config lists layer types
    (Qwen2, Qwen3), else the tensor itself (Llama: LLaDA loaded natively)."""
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return mask
    return {kind: mask for kind in sorted(set(layer_types))}


@dataclass
class Feed:
    """What one lane feeds to a call: new tokens [Q] at true positions [Q], split into groups [Q]."""

    ids: torch.Tensor
    positions: torch.Tensor
    groups: torch.Tensor | None = None  # None: one group
    # also answer the logits of the lane's last committed token, first: only while it has no K/V in
    # the cache (the lane's first call, or every call without reuse)
    context_logits: bool = False


T = TypeVar("T")
LaneStep = Generator[Feed, torch.Tensor, T]  # a lane program's step: yields feeds, is sent their logits, returns T


@dataclass
class _Lane:
    stats: DecodeStats
    pending_ids: torch.Tensor  # [N] committed tokens without K/V in the cache (re-run at the front of the next call)
    pending_positions: torch.Tensor  # [N]
    fed: Feed | None = None  # the last call's new tokens, until committed
    fed_column: int = 0  # cache column of the first of them
    committed: list[int] = field(default_factory=list)  # cache columns of this lane's committed tokens


class Lanes:
    """Independent decodes (lanes) sharing the model calls: one row each of a padded batch.

    Committed tokens without K/V in the cache are *pending*: they are re-run, plain causal over
    commit order, at the front of the lane's next call. With ``reuse`` the K/V of that call is
    kept, so a token is computed once (the prompt rides along with the lane's first call);
    without ``reuse`` every committed token stays pending and is recomputed on every call.
    """

    def __init__(self, model: torch.nn.Module, reuse: bool = True):
        self.model = model
        self.reuse = reuse
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = DynamicCache(config=model.config) if reuse else None
        self.columns = 0  # cache entries per row
        self.rows: list[int] = []  # the lane of each cache row
        self.lanes: dict[int, _Lane] = {}

    def open(self, lane: int, stats: DecodeStats, prompt_ids: torch.Tensor) -> "Lane":
        """Start lane ``lane`` with ``prompt_ids`` [P] committed at positions 0..P-1; ``stats`` counts its calls."""
        positions = torch.arange(prompt_ids.numel(), device=prompt_ids.device)
        self.lanes[lane] = _Lane(stats, prompt_ids, positions)
        return Lane(self, lane)

    def close(self, lane: int) -> None:
        """End a lane: its row leaves the batch at the next call (a lane already closed stays closed)."""
        self.lanes.pop(lane, None)

    def length(self, lane: int) -> int:
        """Committed tokens of ``lane``, prompt included."""
        state = self.lanes[lane]
        return len(state.committed) + state.pending_ids.numel()

    def commit(self, lane: int, n: int) -> None:
        """Commit the first ``n`` new tokens ``lane`` fed to the last call (none may depend on a later group)."""
        state = self.lanes[lane]
        if state.fed is None:
            if n:
                raise RuntimeError("commit() without a preceding forward()")
            return
        fed, state.fed = state.fed, None
        if self.reuse:
            state.committed.extend(range(state.fed_column, state.fed_column + n))
        else:
            state.pending_ids = torch.cat([state.pending_ids, fed.ids[:n]])
            state.pending_positions = torch.cat([state.pending_positions, fed.positions[:n]])

    def forward(self, feeds: dict[int, Feed]) -> dict[int, torch.Tensor]:
        """One round of model calls, one call counted for every lane: each open lane feeds its tokens
        after its committed ones.

        Returns each lane's float logits [Q, V] of its new tokens (the model computes no others when
        it can), [1 + Q, V] with ``context_logits``. Tokens fed by an earlier call and not committed
        are dropped first. Lanes opened since the last round have no rows in the cache yet: with
        ``reuse`` they run their first call (their prompt) in a call of their own, so the rows already
        decoding are not padded to a prompt's length; their K/V then joins the cache.
        """
        if set(feeds) != set(self.lanes):
            raise RuntimeError("every open lane feeds every call")
        for lane, feed in feeds.items():
            self.lanes[lane].fed = None
            if feed.context_logits and not self.lanes[lane].pending_ids.numel():
                raise RuntimeError("context_logits asked for a committed token whose K/V is already cached")
        self._keep_committed()
        joining = [lane for lane in feeds if lane not in self.rows]
        if not self.reuse or not self.rows:
            self.rows += joining
            joining = []
        results, width = self._call(self.rows, feeds, self.cache, self.columns)
        if self.reuse:
            self.columns += width
        if joining:
            fresh = DynamicCache(config=self.model.config)
            joined, width = self._call(joining, feeds, fresh, 0)
            results.update(joined)
            self._join(fresh, joining, width)
        return results

    def _call(self, rows: list[int], feeds: dict[int, Feed], cache: DynamicCache | None,
              columns: int) -> tuple[dict[int, torch.Tensor], int]:
        """One model call for the lanes of ``rows``, the rows of ``cache`` (``columns`` entries each);
        returns each lane's logits and the call's width (the entries it adds to every row)."""
        inputs = [self._row_input(self.lanes[lane], feeds[lane]) for lane in rows]
        width = max(ids.numel() for ids, _, _ in inputs)  # Q: the longest input of the call
        n_new = max(feeds[lane].ids.numel() + feeds[lane].context_logits for lane in rows)
        input_ids = torch.zeros(len(inputs), width, dtype=torch.long, device=self.device)  # [B, Q]
        position_ids = torch.zeros_like(input_ids)  # [B, Q]
        allowed = torch.zeros(len(inputs), width, columns + width, dtype=torch.bool, device=self.device)
        allowed[:, :, columns:] = torch.eye(width, dtype=torch.bool, device=self.device)  # pads see themselves
        for row, (lane, (ids, positions, among)) in enumerate(zip(rows, inputs)):
            pad = width - ids.numel()
            input_ids[row, pad:], position_ids[row, pad:] = ids, positions
            allowed[row, pad:, columns + pad:] = among
            allowed[row, pad:, self.lanes[lane].committed] = True
        mask = additive_mask(allowed, self.dtype)  # [B, 1, Q, columns + Q]
        out, seconds = timed_call(
            self.model,
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask_argument(self.model.config, mask),
            use_cache=self.reuse,
            **cache_argument(self.model, cache),
            **last_logits(self.model, n_new),
        )
        logits = out.logits[:, -n_new:]
        results = {}
        for row, (lane, (ids, _, _)) in enumerate(zip(rows, inputs)):
            state, feed = self.lanes[lane], feeds[lane]
            count_call(state.stats, ids.numel(), seconds)
            new = feed.ids.numel()
            results[lane] = float_logits(logits[row, n_new - new - feed.context_logits:])
            state.fed, state.fed_column = feed, columns + width - new
            if self.reuse:  # the pending tokens' K/V is in the cache now, followed by the fed tokens'
                state.committed.extend(range(state.fed_column - state.pending_ids.numel(), state.fed_column))
                state.pending_ids, state.pending_positions = state.pending_ids[:0], state.pending_positions[:0]
        return results, width

    def _join(self, fresh: DynamicCache, joining: list[int], columns: int) -> None:
        """Append the rows of ``fresh`` (the ``joining`` lanes' first call, ``columns`` entries each)
        below the cache's rows; the shorter side gets unused entries, masked out."""
        width = max(columns, self.columns)
        for layer, new in zip(self.cache.layers, fresh.layers):
            if not _written(new):
                continue
            layer.keys = torch.cat([_pad_columns(layer.keys, width), _pad_columns(new.keys, width)])
            layer.values = torch.cat([_pad_columns(layer.values, width), _pad_columns(new.values, width)])
        self.rows += joining
        self.columns = width

    def _row_input(self, state: _Lane, feed: Feed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A lane's pending + new tokens, their positions and what they see among themselves [Q, Q]."""
        groups = feed.groups if feed.groups is not None else torch.zeros_like(feed.ids)
        n_pending = state.pending_ids.numel()
        all_groups = torch.cat([torch.full((n_pending,), -1, dtype=groups.dtype, device=groups.device), groups])
        among = group_causal(all_groups)  # [Q, Q] with Q = pending + new
        among[n_pending:, :n_pending] = True  # new tokens see every pending committed token
        return torch.cat([state.pending_ids, feed.ids]), torch.cat([state.pending_positions, feed.positions]), among

    def _keep_committed(self) -> None:
        """Drop the rows of closed lanes, and the cache entries their row's lane did not commit.

        A row shorter than the longest keeps unused entries (masked out) after its own; the cache is
        rewritten only when a row leaves or the longest row has an uncommitted entry. With one lane
        this is a crop of the cache."""
        rows = [lane for lane in self.rows if lane in self.lanes]
        kept = [self.lanes[lane].committed for lane in rows]
        width = max((len(columns) for columns in kept), default=0)
        if not self.reuse or (rows == self.rows and width == self.columns):
            self.rows = rows
            return
        old_rows = {lane: row for row, lane in enumerate(self.rows)}
        self.rows = rows
        if not rows:
            self.cache, self.columns = DynamicCache(config=self.model.config), 0
            return
        index = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)  # [B, width] columns kept
        for row, columns in enumerate(kept):
            index[row, : len(columns)] = torch.tensor(columns, dtype=torch.long)
        source = torch.tensor([old_rows[lane] for lane in rows], device=self.device)  # [B] old row of each row
        for layer in self.cache.layers:
            if not _written(layer):
                continue
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            gather = index[:, None, :, None].expand(-1, heads, -1, dim)
            layer.keys = layer.keys.index_select(0, source).gather(2, gather)
            layer.values = layer.values.index_select(0, source).gather(2, gather)
        for lane, columns in zip(rows, kept):
            self.lanes[lane].committed = list(range(len(columns)))
        self.columns = width


def _written(layer: Any) -> bool:
    """Whether a cache layer holds K/V (a layer the model never wrote has none yet)."""
    return getattr(layer, "keys", None) is not None and layer.keys.numel() > 0


def _pad_columns(states: torch.Tensor, width: int) -> torch.Tensor:
    """K or V [B, H, N, D] with unused (zero) entries appended up to ``width`` columns."""
    missing = width - states.shape[2]
    return states if missing == 0 else torch.nn.functional.pad(states, (0, 0, 0, missing))


class Lane:
    """One lane's view of :class:`Lanes`, for a decoder written as a generator: ``yield from
    lane.forward(...)`` hands a :class:`Feed` to the driver and returns the lane's logits."""

    def __init__(self, lanes: Lanes, lane: int):
        self.lanes = lanes
        self.lane = lane

    @property
    def length(self) -> int:
        """Committed tokens, prompt included."""
        return self.lanes.length(self.lane)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor | None = None,
                context_logits: bool = False) -> LaneStep[torch.Tensor]:
        """Feed ``ids`` [Q] at true ``positions`` [Q] after the committed tokens; return float logits [Q, V].

        ``groups`` [Q] (default: one group) limits what the new tokens see among themselves.
        ``context_logits``: the logits of the last committed token come first ([1 + Q, V]); only in
        a call that computes that token's K/V (the lane's first call, or any call without reuse).
        """
        return (yield Feed(ids, positions, groups, context_logits))

    def commit(self, n: int) -> None:
        """Commit the first ``n`` tokens fed by the last call (they must not depend on a later group)."""
        self.lanes.commit(self.lane, n)


class SharedCalls(Protocol):
    """What :func:`drive` needs of the rows' shared model calls: :class:`Lanes`, or the masked-diffusion
    samplers' ``mdm.CanvasCalls``."""

    def forward(self, feeds: dict[int, Any]) -> dict[int, Any]: ...

    def close(self, lane: int) -> None: ...


def drive(lanes: SharedCalls, start: Callable[[int], Generator[Any, Any, DecodeResult]], count: int,
          batch_size: int | None, clock: BatchClock) -> list[DecodeResult]:
    """Run ``count`` lane programs, at most ``batch_size`` (None: all) at once, one shared model call per round.

    ``start(i)`` opens lane ``i`` in ``lanes`` and returns its program: a generator that yields a
    feed (a :class:`Feed` for :class:`Lanes`) for every call and is sent back what ``lanes.forward``
    answers for it (its logits), and returns the lane's result. Each
    round advances every running program by one call; a finished lane is closed, its result gets
    its latency from ``clock``, and the next waiting prompt takes its place (continuous batching).
    """
    limit = count if batch_size is None else batch_size
    waiting = deque(range(count))
    running: dict[int, tuple[Generator[Any, Any, DecodeResult], Any]] = {}
    results: list[DecodeResult | None] = [None] * count

    def advance(index: int, program: Generator[Any, Any, DecodeResult], logits: Any) -> None:
        try:
            running[index] = (program, next(program) if logits is None else program.send(logits))
        except StopIteration as stop:
            running.pop(index, None)
            lanes.close(index)
            stop.value.stats.seconds = clock.latency()
            results[index] = stop.value

    while waiting or running:
        while waiting and len(running) < limit:
            index = waiting.popleft()
            advance(index, start(index), None)
        if not running:
            continue
        logits = lanes.forward({index: feed for index, (_, feed) in running.items()})
        for index, (program, _) in list(running.items()):
            advance(index, program, logits[index])
    return results  # type: ignore[return-value]  # every program returned
