"""ReFusion decoding: plan slots with a diffusion pass, infill them with causal verification.

Token ids in, token ids out; this module knows nothing of text or tokenizers. The response is
cut into slots of ``slot_size`` (k) tokens, decoded block by block (``block_size`` tokens) left to
right. Each iteration of a block:

1) plan      one pass over the block's still-masked slots drafts every position (unshifted
             logits); slots whose first-token probability exceeds ``slot_threshold`` are chosen
             (the single best one if none is).
2) verify    the chosen drafts, concatenated in position order, are checked autoregressively in
             one causal pass (token j against the logits of token j-1); the first token of each
             slot is accepted as drafted. Whole slots inside the accepted prefix are committed with
             the K/V of this pass; an EOS inside the prefix ends the response after this block.
3) complete  if not even one whole slot was accepted, every chosen slot becomes its own row (the
             rows see the committed context and themselves, not each other) and is re-drafted and
             re-verified until all of it is accepted (at most k rounds, at least one new token per
             row and round); all rows are then committed with the K/V of their last verification.

Committed tokens join the context in commit order and keep their true position ids, so their K/V
is reused, never recomputed (``kv_reuse=False`` recomputes it on every pass, the paper's ablation).

An EOS ends the response after its block, and the block's slots right of the EOS slot are dropped;
slots left of it that are still masked are decoded as usual. This holds for both paths. The public
reference (``generate.py``) does so on the fast path, but after an EOS inside the completion step it
drops the block's remaining slots from the index of the EOS *row* among the chosen slots, not from
the EOS slot, so unchosen slots left of the EOS can be dropped undecoded and the response closes
up over the gap. This decoder does not reproduce that.

``causal_fix=True`` is an ablation of this toolkit, not the paper's decoder: where the completion
step would force in a re-drafted token that failed its check, it takes the causal head's own
prediction for that position instead (as speculative decoding does with a rejected draft), and
accepts nothing after it in that round; if the last round replaced a token, one more pass computes
the rows' K/V before they are committed.

``causal_first=True`` is another ablation of this toolkit: the pass that computes a committed token's
K/V also gives the causal head's prediction for the position after it. The decoder keeps that token
and its probability (argmax; for the first response position, that of the last prompt token, from
the first call), and a chosen slot whose left neighbour is committed starts with it instead of its
draft when the causal head is at least as sure of its token as the draft head of the draft's
(probability against probability); the slot is still chosen by its draft's score, and the rest of
it is verified against its first token as usual. It costs no forward. It fixes the slot's first
token and ``causal_fix`` the completion step's forced ones, so the two combine. (Taking the causal
token unconditionally fails on a model whose causal head never learned some positions: ReFusion's
objective never trains the first token of a slot autoregressively, and with slots cut from the
response start every 32nd position starts a slot whatever its size.)

``recheck=True`` is a third ablation of this toolkit. The completion step's rows do not see each
other, so a row is verified without the row to its left, which is committed beside it. With
``recheck`` the rows, once completed, are verified again in one causal pass in position order (as
the global verification: the first token of a slot as drafted, the first row whole); the rows up
to the first one with a failing token are committed with that pass's K/V (through an EOS among the
accepted tokens, as on the fast path), and the rest go back to the plan. It costs one forward per
completion step of more than one row. It combines with the other two.

The prompt, batch and sampling helpers that every decoder shares are in
:mod:`refusion_cli.decoding.batching`; this module holds only ReFusion's own algorithm.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from refusion_cli.decoding.batching import gumbel_argmax, next_token_probs, token_probs
from refusion_cli.decoding.cache import Lane, Lanes, LaneStep
from refusion_cli.decoding.config import ReFusionConfig
from refusion_cli.decoding.readback import read
from refusion_cli.decoding.stats import RowClock, DecodeResult, DecodeStats, EosIds, cut_after_eos, eos_ids, wide_float


@dataclass
class StepTrace:
    """What one iteration of the decoder did (slots are numbered from 0 over the whole response)."""

    block: int
    path: str  # "fast" (committed from the global verification) or "completion"
    chosen: list[int]  # slots chosen by the plan, in position order
    committed: list[int]  # slots committed by this iteration (the last may be cut after an EOS)
    accepted_prefix: int  # tokens accepted by the global verification
    rounds: int = 0  # re-draft + verify rounds of the completion step (0 on the fast path)
    eos: bool = False  # an EOS was committed: the response ends after this block
    offsets: list[int] = field(default_factory=list)  # response offsets of the committed tokens, commit order
    tokens: list[int] = field(default_factory=list)  # the committed token ids, commit order
    # how each committed token got in, commit order: "first" (a slot's first token, taken as drafted),
    # "verified" (AR probability above τ_token), "forced" (the completion step's one token per round)
    # or "corrected" (with causal_fix: the causal head's token in place of a forced one), "causal-first"
    # (with causal_first: a slot's first token, the causal head's prediction after its committed left neighbour)
    kinds: list[str] = field(default_factory=list)


FIRST, VERIFIED, FORCED, CORRECTED, CAUSAL_FIRST = 1, 2, 3, 4, 5  # acceptance kinds in a tensor (0: not accepted)
KIND_NAMES = {FIRST: "first", VERIFIED: "verified", FORCED: "forced", CORRECTED: "corrected",
              CAUSAL_FIRST: "causal-first"}


# ---------------------------------------------------------------------------------------------
# the three steps


def plan_slots(ctx: Lane, slots: list[int], slot_pos: torch.Tensor, config: ReFusionConfig,
               mask_token_id: int, generator: torch.Generator | None, context_next: bool = False
               ) -> LaneStep[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """1) Draft every position of the masked ``slots``; return the chosen ones, all drafts [S, k], their
    first tokens' probabilities [S] and, with ``context_next``, the causal head's logits after the last
    committed token ([V]; else None)."""
    k = config.slot_size
    positions = slot_pos[slots].flatten()  # [S*k]
    masks = torch.full_like(positions, mask_token_id)
    logits = yield from ctx.forward(masks, positions, context_logits=context_next)  # [(1+)S*k, V]
    next_logits = logits[0] if context_next else None
    logits = logits[1:] if context_next else logits  # [S*k, V], read unshifted
    drafts = gumbel_argmax(logits, config.temperature, generator)  # [S*k]
    first_prob = token_probs(logits, drafts).view(-1, k)[:, 0]  # [S]
    over = first_prob > config.slot_threshold  # [S]; none over it: the single best slot
    best = torch.zeros_like(over).scatter_(0, first_prob.argmax().view(1), True)
    (flags,) = yield from read(over | (best & ~over.any()))
    chosen = [index for index, flag in enumerate(flags) if flag]
    return chosen, drafts.view(-1, k), first_prob, next_logits


def verify_drafts(ctx: Lane, drafts: torch.Tensor, positions: torch.Tensor,
                  token_threshold: float) -> LaneStep[tuple[torch.Tensor, torch.Tensor]]:
    """2) One causal pass over the concatenated drafts [R, k]; return accepted flags [R, k] and the
    pass's logits [R*k, V].

    A token is accepted when its AR probability exceeds ``token_threshold``; the first token of
    every slot is accepted as drafted. The flags are not yet cumulative.
    """
    logits = yield from ctx.forward(drafts.flatten(), positions.flatten())
    accepted = (next_token_probs(logits, drafts.flatten()) > token_threshold).view_as(drafts)
    accepted[:, 0] = True
    return accepted, logits


@dataclass
class Completed:
    """What the completion step ends with: the rows [R, k] (cut after the first row holding an accepted EOS),
    the rounds run, the logits [R, k, V] of the last call (the verification of exactly these rows, ready to be
    committed), and on the host the rows' tokens and how each was accepted (FIRST / VERIFIED / FORCED or
    CORRECTED), flat in row order."""

    rows: torch.Tensor
    rounds: int
    logits: torch.Tensor
    tokens: list[int]
    kinds: list[int]


def complete_slots(ctx: Lane, rows: torch.Tensor, positions: torch.Tensor, accepted: torch.Tensor,
                   config: ReFusionConfig, mask_token_id: int, stops: torch.Tensor | None, causal_fix: bool = False
                   ) -> LaneStep[Completed]:
    """3) Re-draft and verify each chosen slot in its own row until every row is accepted.

    ``rows`` [R, k] drafts, ``accepted`` [R, k] cumulative flags from the global verification (not all set),
    ``stops`` the EOS ids on the rows' device (None: no EOS). Each round reads its outcome back once.
    """
    k = config.slot_size
    rounds = 0
    kinds = torch.where(accepted, VERIFIED, 0)
    kinds[:, 0] = FIRST
    stale = False  # causal_fix replaced a token after the last verification: its K/V is not that token's
    done, tokens, kind_list = False, [], []
    logits = rows.new_zeros(0)
    while not done and rounds < k:
        rounds += 1
        n_rows = rows.shape[0]
        groups = [row for row in range(n_rows) for _ in range(k)]  # [R*k] row of each token (host)
        # a) re-draft the unaccepted tokens of each row (unshifted MDM read)
        masked = torch.where(accepted, rows, mask_token_id)
        logits = (yield from ctx.forward(masked.flatten(), positions.flatten(), groups)).view(n_rows, k, -1)
        rows = torch.where(accepted, rows, logits.argmax(-1))
        # b) verify every row causally; the token after the accepted prefix is always taken
        logits = (yield from ctx.forward(rows.flatten(), positions.flatten(), groups)).view(n_rows, k, -1)
        checked = next_token_probs(logits, rows) > config.token_threshold
        passed = checked.clone()
        passed[:, 0] = True
        frontier = torch.zeros_like(accepted)  # each row's first unaccepted token
        frontier[:, 1:] = accepted[:, :-1] & ~accepted[:, 1:]
        fix = torch.zeros_like(accepted)
        if causal_fix:
            fix = frontier & ~checked
            predicted = torch.zeros_like(rows)
            predicted[:, 1:] = logits[:, :-1].argmax(-1)  # the causal head's token for each position
            rows = torch.where(fix, predicted, rows)
            after_fix = (fix.long().cumsum(-1) - fix.long()) > 0  # checked against the replaced token
            passed = (passed | fix | accepted) & ~after_fix
        else:
            passed |= frontier | accepted
        now_accepted = passed.long().cumprod(-1).bool()
        forced_kind = CORRECTED if causal_fix else FORCED
        kinds = torch.where(now_accepted & ~accepted, torch.where(checked, VERIFIED, forced_kind), kinds)
        accepted = now_accepted
        # c) an accepted EOS ends its row; later rows are dropped
        eos_rows = (torch.isin(rows, stops) & accepted).any(-1) if stops is not None else accepted[:, 0] & False
        flags, eos, tokens, kind_list, fixed = yield from read(accepted, eos_rows, rows, kinds, fix.any())
        stale = bool(fixed[0])
        if 1 in eos:
            last = eos.index(1) + 1
            rows, positions, accepted, kinds = rows[:last], positions[:last], accepted[:last], kinds[:last]
            logits = logits[:last]
            tokens, kind_list = tokens[: last * k], kind_list[: last * k]
            accepted[-1] = True
            done = all(flags[: (last - 1) * k])
        else:
            done = all(flags)
    if stale:  # the commit takes the K/V of the context's last call: compute it for the final tokens
        groups = [row for row in range(rows.shape[0]) for _ in range(k)]
        logits = (yield from ctx.forward(rows.flatten(), positions.flatten(), groups)).view(rows.shape[0], k, -1)
    return Completed(rows, rounds, logits, tokens, kind_list)


# ---------------------------------------------------------------------------------------------
# the loop


def refusion_row(lanes: Lanes, index: int, prompt: torch.Tensor, config: ReFusionConfig, *, mask_token_id: int,
                 eos_token_id: EosIds, generator: torch.Generator | None, causal_fix: bool = False,
                 causal_first: bool = False, recheck: bool = False,
                 on_step: Callable[[StepTrace], None] | None = None,
                 clock: RowClock | None = None) -> LaneStep[DecodeResult]:
    """Open lane ``index`` for ``prompt`` [P] and return its decode program (see engine.Engine); ``on_step``
    sees every iteration, its time kept out of the latency by ``clock``."""
    stats = DecodeStats()
    ctx = lanes.open(index, stats, prompt)
    stop_ids = eos_ids(eos_token_id)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=prompt.device) if stop_ids else None
    report = None if on_step is None or clock is None else functools.partial(clock.report, stats, on_step)
    return decode_lane(ctx, stats, prompt.numel(), config, mask_token_id, stops, eos_token_id, generator,
                       causal_fix, causal_first, recheck, report)


def decode_lane(ctx: Lane, stats: DecodeStats, n_prompt: int, config: ReFusionConfig, mask_token_id: int,
                stops: torch.Tensor | None, eos_token_id: EosIds, generator: torch.Generator | None,
                causal_fix: bool, causal_first: bool, recheck: bool,
                report: Callable[[StepTrace], None] | None) -> LaneStep[DecodeResult]:
    """One prompt's decode as a lane program (see engine.Engine); returns its result, ``seconds`` unset."""
    device, k = ctx.lanes.device, config.slot_size
    n_slots = config.padded_length // k
    slots_per_block = config.block_tokens // k
    stop_ids = set(eos_ids(eos_token_id))
    # true position ids of every response slot: [n_slots, k]
    slot_pos = torch.arange(n_prompt, n_prompt + n_slots * k, device=device).view(n_slots, k)
    trace: list[StepTrace] = []
    response = [-1] * (n_slots * k)  # by offset, on the host; -1 = not committed
    # causal_first: the causal head's token for each offset and its probability, from the pass that
    # computed the K/V of the token before it (offset 0: the last prompt token); -1 = not committed
    causal_next = torch.full((n_slots * k + 1,), -1, dtype=torch.long, device=device)
    causal_prob = torch.zeros((n_slots * k + 1,), dtype=wide_float(device), device=device)
    for block, first_slot in enumerate(range(0, n_slots, slots_per_block)):
        masked = list(range(first_slot, min(first_slot + slots_per_block, n_slots)))
        ended = False
        while masked:
            # 1) plan
            context_next = causal_first and not trace  # the first call computes the prompt's K/V
            chosen_idx, drafts, first_prob, prompt_logits = yield from plan_slots(
                ctx, masked, slot_pos, config, mask_token_id, generator, context_next)
            if prompt_logits is not None:
                remember_causal(causal_next, causal_prob, torch.zeros(1, dtype=torch.long, device=device),
                                prompt_logits[None])
            chosen = [masked[i] for i in chosen_idx]
            rows, positions = drafts[chosen_idx], slot_pos[chosen]  # [R, k]
            from_causal = torch.zeros(len(chosen), dtype=torch.bool, device=device)  # [R]
            if causal_first:  # after a committed neighbour, the surer of the causal head's token and the draft
                starts = positions[:, 0] - n_prompt
                heads = causal_next[starts]  # [R], -1: left neighbour still masked
                from_causal = (heads >= 0) & (causal_prob[starts] >= first_prob[chosen_idx].to(causal_prob.dtype))
                rows[:, 0] = torch.where(from_causal, heads, rows[:, 0])
            # 2) verify
            accepted, pass_logits = yield from verify_drafts(ctx, rows, positions, config.token_threshold)
            flags, tokens, causal_starts = yield from read(accepted, rows, from_causal)
            prefix, eos_at, n_commit = accepted_prefix(flags, tokens, stop_ids, k)
            if eos_at is not None or prefix >= k:
                path, rounds = "fast", 0
                kinds = [FIRST if i % k == 0 else VERIFIED for i in range(len(tokens))]
            else:
                # 3) complete in parallel
                completed = yield from complete_slots(ctx, rows, positions, accepted.long().cumprod(-1).bool(),
                                                      config, mask_token_id, stops, causal_fix)
                rows, rounds, pass_logits = completed.rows, completed.rounds, completed.logits
                tokens, kinds, path = completed.tokens, completed.kinds, "completion"
                kept = [1] * len(tokens)  # every completed row
                if recheck and rows.shape[0] > 1:  # verify the rows again, each seeing those to its left
                    checked, pass_logits = yield from verify_drafts(ctx, rows, positions[: rows.shape[0]],
                                                                    config.token_threshold)
                    (kept,) = yield from read(checked)
                    kept[:k] = [1] * k  # the first row saw its whole context already
                _, eos_at, n_commit = accepted_prefix(kept, tokens, stop_ids, k)
            # 4) commit: the first n_commit fed tokens, with the K/V just computed
            ctx.commit(n_commit)
            done = chosen[: -(-n_commit // k)]
            offsets = [slot * k + j for slot in done for j in range(k)][:n_commit]
            for offset, token in zip(offsets, tokens):
                response[offset] = token
            if causal_first:
                remember_causal(causal_next, causal_prob, torch.tensor(offsets, device=device) + 1,
                                pass_logits.reshape(-1, pass_logits.shape[-1])[:n_commit])
                for row, causal in enumerate(causal_starts[: len(kinds) // k]):
                    if causal:
                        kinds[row * k] = CAUSAL_FIRST
            masked = [s for s in masked if s not in done]
            if eos_at is not None:  # nothing right of the EOS slot is decoded any more
                ended = True
                masked = [s for s in masked if s < done[-1]]
            step = StepTrace(block, path, chosen, done, prefix, rounds, eos_at is not None,
                             offsets, tokens[:n_commit], [KIND_NAMES[kind] for kind in kinds[:n_commit]])
            trace.append(step)
            if report is not None:
                report(step)
        if ended:
            break
    tokens = cut_after_eos([t for t in response if t >= 0], eos_token_id)
    stats.tokens = len(tokens)
    return DecodeResult(tokens=tokens, stats=stats, trace=trace)


def accepted_prefix(accepted: list[int], tokens: list[int], stops: set[int], k: int) -> tuple[int, int | None, int]:
    """Of ``tokens`` (rows of k, in order) with flags ``accepted`` (not yet cumulative; host values): the length
    of the accepted prefix, the index of the first EOS inside it (None: none) and how many tokens to commit
    (through that EOS, else the whole slots of the prefix)."""
    prefix = next((i for i, flag in enumerate(accepted) if not flag), len(accepted))
    eos_at = next((i for i, token in enumerate(tokens[:prefix]) if token in stops), None)
    return prefix, eos_at, eos_at + 1 if eos_at is not None else prefix // k * k


def remember_causal(tokens: torch.Tensor, probs: torch.Tensor, offsets: torch.Tensor, logits: torch.Tensor) -> None:
    """causal_first: store the causal head's token and its probability for each of ``offsets`` from the
    ``logits`` [N, V] of the tokens before them."""
    best = logits.argmax(-1)
    tokens[offsets] = best
    probs[offsets] = token_probs(logits, best).to(probs.dtype)
