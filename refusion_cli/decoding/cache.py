"""The committed context the ReFusion decoder attends to: K/V reused from a cache, or recomputed.

Every model call of the decoder goes through :class:`Context`. A call feeds new tokens (one row,
true position ids) after the committed tokens. The new tokens are split into *groups*: a new
token sees every committed token and the earlier new tokens of its own group. One group is plain
causal attention; several groups lay independent rows side by side in one sequence (the parallel
completion step), so the batch stays 1 and the cache is only ever appended to and cropped.

Tokens fed by a call are provisional: ``commit(n)`` keeps the first ``n`` of them, and the next
call discards whatever was not committed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from refusion_cli.decoding.stats import DecodeStats, cache_argument, counted_forward, float_logits, last_logits


def group_causal(groups: torch.Tensor) -> torch.Tensor:
    """[Q] group ids -> [Q, Q] bool: query i sees key j iff j <= i and both are in one group."""
    same = groups[:, None] == groups[None, :]
    return same & torch.ones_like(same).tril()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[Q, K] bool -> [1, 1, Q, K] float mask (0 where allowed, the dtype's minimum elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def crop_to(cache: DynamicCache, length: int) -> None:
    """Trim ``cache`` to its first ``length`` entries (a negative count works across transformers 5.x)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


class Context:
    """The committed tokens (prompt first, then response tokens in commit order) and the model calls over them.

    Committed tokens without K/V in the cache are *pending*: they are re-run, plain causal over
    commit order, at the front of the next call. With ``reuse`` the K/V of that call is kept, so a
    token is computed once (the prompt rides along with the first call); without ``reuse`` every
    committed token stays pending and is recomputed on every call.
    """

    def __init__(self, model: torch.nn.Module, stats: DecodeStats, prompt_ids: torch.Tensor,
                 prompt_positions: torch.Tensor, reuse: bool = True):
        self.model = model
        self.stats = stats
        self.reuse = reuse
        self.dtype = next(model.parameters()).dtype
        self.layer_types = sorted(set(getattr(model.config, "layer_types", None) or ["full_attention"]))
        self.cache = DynamicCache(config=model.config) if reuse else None
        self.cached = 0  # committed tokens whose K/V is in the cache
        self.pending_ids = prompt_ids  # [N] committed tokens without cached K/V
        self.pending_positions = prompt_positions  # [N]
        self._fed: tuple[torch.Tensor, torch.Tensor] | None = None  # the last call's tokens, until committed

    @property
    def length(self) -> int:
        """Committed tokens, prompt included."""
        return self.cached + self.pending_ids.numel()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``ids`` [Q] at true ``positions`` [Q] after the committed tokens; return float logits [Q, V].

        ``groups`` [Q] (default: one group) limits what the new tokens see among themselves.
        """
        self.commit(0)  # drop what the previous call fed and nobody committed
        if groups is None:
            groups = torch.zeros_like(ids)
        n_pending = self.pending_ids.numel()
        all_ids = torch.cat([self.pending_ids, ids])
        all_positions = torch.cat([self.pending_positions, positions])
        all_groups = torch.cat([torch.full((n_pending,), -1, dtype=groups.dtype, device=groups.device), groups])
        allowed = group_causal(all_groups)  # [Q', Q'] with Q' = pending + new
        allowed[n_pending:, :n_pending] = True  # new tokens see every pending committed token
        seen_cache = torch.ones(all_ids.numel(), self.cached, dtype=torch.bool, device=ids.device)
        logits = self._call(all_ids, all_positions, torch.cat([seen_cache, allowed], dim=1), ids.numel())
        if self.reuse:  # the pending tokens' K/V is in the cache now, followed by the fed tokens'
            self.cached += n_pending
            self.pending_ids, self.pending_positions = ids[:0], positions[:0]
        self._fed = (ids, positions)
        return logits

    def commit(self, n: int) -> None:
        """Commit the first ``n`` tokens fed by the last call (they must not depend on a later group)."""
        if self._fed is None:
            if n:
                raise RuntimeError("commit() without a preceding forward()")
            return
        ids, positions = self._fed
        self._fed = None
        if self.reuse:
            self.cached += n
            crop_to(self.cache, self.cached)
        else:
            self.pending_ids = torch.cat([self.pending_ids, ids[:n]])
            self.pending_positions = torch.cat([self.pending_positions, positions[:n]])

    def _call(self, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor,
              n_new: int) -> torch.Tensor:
        """One counted model call on a single row; ``allowed`` [Q, cached + Q]; returns the logits of the
        last ``n_new`` positions [n_new, V] (the model computes no others when it can)."""
        mask = additive_mask(allowed, self.dtype)
        out = counted_forward(
            self.model,
            self.stats,
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask={kind: mask for kind in self.layer_types},
            use_cache=self.reuse,
            **cache_argument(self.model, self.cache),
            **last_logits(self.model, n_new),
        )
        return float_logits(out.logits[0, -n_new:])
