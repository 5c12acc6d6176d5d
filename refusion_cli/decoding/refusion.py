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

What needs the logits is computed on the device for every row of a step at once (:func:`plan_choice`,
:func:`verify_choice`, :func:`draft_choice`, yielded with ``readback.decide``); a row program keeps its slots,
flags and tokens on the host and feeds the model host arrays, which the runner copies in one transfer for all
rows. The prompt, batch and sampling helpers that every decoder shares are in
:mod:`refusion_cli.decoding.batching`; this module holds only ReFusion's own algorithm.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from refusion_cli.decoding.batching import (next_token_probs, ragged_rows, side_by_side, token_probs, uniform,
                                             with_gumbel)
from refusion_cli.decoding.cache import CausalRunner, CausalSequence, SequenceStep
from refusion_cli.decoding.config import ReFusionConfig
from refusion_cli.decoding.readback import decide, device_index
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


def plan_choice(sizes: list[int], logits: torch.Tensor, *noise: torch.Tensor, temperature: float,
                slot_threshold: float) -> tuple[torch.Tensor, ...]:
    """1) for every row waiting on it at once: ``logits`` [sum S, k, V] of each row's S masked slots, the rows
    end to end (``sizes``: each row's S), and with ``temperature`` > 0 their U(0, 1) draws (as ``logits``, in
    float64). Returns every slot's draft [sum S, k], its first token's probability [sum S] and whether it is
    chosen [sum S]: its probability exceeds ``slot_threshold``, or none of its row's does and it is the row's
    best (the first of equals)."""
    drafts = (logits if temperature == 0 else with_gumbel(logits, temperature, noise[0])).argmax(-1)  # [sum S, k]
    first_prob = token_probs(logits[:, 0], drafts[:, 0])  # [sum S]
    # each row's slots side by side [rows, max S], padded with -1 (below every probability)
    row_of, slot_of, _ = ragged_rows(sizes, logits.device)
    by_row = side_by_side(first_prob, sizes, row_of, slot_of, -1.0)
    best = (slot_of == by_row.argmax(-1)[row_of]) & ~(by_row > slot_threshold).any(-1)[row_of]
    return drafts, first_prob, (first_prob > slot_threshold) | best


def plan_slots(ctx: CausalSequence, slots: list[int], slot_pos: np.ndarray, config: ReFusionConfig,
               mask_token_id: int, generator: torch.Generator | None, context_next: bool = False
               ) -> SequenceStep[tuple[list[int], np.ndarray, list[float], torch.Tensor | None]]:
    """1) Draft every position of the masked ``slots`` (``slot_pos`` [n_slots, k]: every slot's positions);
    return the chosen ones, all drafts [S, k] and their first tokens' probabilities [S] (host values), and, with
    ``context_next``, the causal head's logits after the last committed token ([V]; else None)."""
    k = config.slot_size
    positions = slot_pos[slots].reshape(-1)  # [S*k]
    logits = yield from ctx.forward(np.full_like(positions, mask_token_id), positions, context_logits=context_next)
    next_logits = logits[0] if context_next else None
    logits = (logits[1:] if context_next else logits).view(len(slots), k, -1)  # [S, k, V], read unshifted
    noise = [uniform(tuple(logits.shape), generator, logits.device)] if config.temperature > 0 else []
    decision = functools.partial(plan_choice, temperature=config.temperature, slot_threshold=config.slot_threshold)
    drafts, first_prob, flags = yield from decide((plan_choice, *decision.keywords.items()), decision, logits,
                                                  *noise, ragged=True)
    chosen = [index for index, flag in enumerate(flags) if flag]
    return chosen, np.asarray(drafts, dtype=np.int64).reshape(-1, k), first_prob, next_logits


def verify_choice(sizes: list[int], logits: torch.Tensor, drafts: torch.Tensor, *carried: torch.Tensor,
                  token_threshold: float, causal: bool = False) -> tuple[torch.Tensor, ...]:
    """2) for every row waiting on it at once: the verification's ``logits`` [sum R, k, V] of the ``drafts``
    [sum R, k] (each row's R slots end to end). Returns whether each token is accepted (not yet cumulative: its
    AR probability exceeds ``token_threshold``; a slot's first token always) and the drafts, each [sum R, k],
    with ``causal`` the causal head's token after each but the last [sum R, k - 1], then the ``carried`` values
    [sum R, ...] as they are (read back with the decision)."""
    accepted = next_token_probs(logits, drafts) > token_threshold
    accepted[:, 0] = True
    predicted = (logits[:, :-1].argmax(-1),) if causal else ()
    return accepted, drafts, *predicted, *carried


def verify_drafts(ctx: CausalSequence, drafts: torch.Tensor | np.ndarray, positions: np.ndarray,
                  token_threshold: float, groups: list[int] | None = None, *carried: torch.Tensor,
                  causal: bool = False) -> SequenceStep[tuple[Any, ...]]:
    """2) One causal pass over the concatenated drafts [R, k] (``groups``: rows that do not see each other); return
    the accepted flags and the drafts (host values, flat), the pass's logits [R*k, V], with ``causal`` the causal
    head's tokens (see :func:`verify_choice`) and the host values of the ``carried`` tensors [R, ...].

    A token is accepted when its AR probability exceeds ``token_threshold``; the first token of
    every slot is accepted as drafted. The flags are not yet cumulative.
    """
    logits = yield from ctx.forward(drafts.reshape(-1), positions.reshape(-1), groups)
    decision = functools.partial(verify_choice, token_threshold=token_threshold, causal=causal)
    flags, tokens, *values = yield from decide((verify_choice, token_threshold, causal), decision,
                                               logits.view(*drafts.shape, -1), drafts, *carried, ragged=True)
    return flags, tokens, logits, *values


@dataclass
class Completed:
    """What the completion step ends with: the rows [R, k] (cut after the first row holding an accepted EOS),
    the rounds run, the logits [R, k, V] of the last call (the verification of exactly these rows, ready to be
    committed), and the rows' tokens and how each was accepted (FIRST / VERIFIED / FORCED or CORRECTED), flat in
    row order (host values all but the logits)."""

    rows: np.ndarray
    rounds: int
    logits: torch.Tensor
    tokens: list[int]
    kinds: list[int]


def draft_choice(sizes: list[int], logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """3a) for every row waiting on it at once: the argmax of the re-draft's ``logits`` [sum R, k, V]."""
    return (logits.argmax(-1),)


def complete_slots(ctx: CausalSequence, rows: np.ndarray, positions: np.ndarray, accepted: np.ndarray,
                   config: ReFusionConfig, mask_token_id: int, stops: set[int], causal_fix: bool = False
                   ) -> SequenceStep[Completed]:
    """3) Re-draft and verify each chosen slot in its own row until every row is accepted.

    ``rows`` [R, k] drafts, ``accepted`` [R, k] cumulative flags from the global verification (not all set),
    ``stops`` the EOS ids, all on the host. The device computes what needs the logits (the re-drafts, the
    verification's checks and with ``causal_fix`` the causal head's tokens), for every row at once; the rest is
    the host's.
    """
    k = config.slot_size
    rounds = 0
    kinds = np.where(accepted, VERIFIED, 0)
    kinds[:, 0] = FIRST
    stale = False  # causal_fix replaced a token after the last verification: its K/V is not that token's
    done = False
    while not done and rounds < k:
        rounds += 1
        n_rows = rows.shape[0]
        groups = [row for row in range(n_rows) for _ in range(k)]  # [R*k] row of each token (host)
        # a) re-draft the unaccepted tokens of each row (unshifted MDM read)
        logits = yield from ctx.forward(np.where(accepted, rows, mask_token_id).reshape(-1), positions.reshape(-1),
                                        groups)
        (drafted,) = yield from decide(draft_choice, draft_choice, logits.view(n_rows, k, -1), ragged=True)
        rows = np.where(accepted, rows, np.reshape(drafted, (n_rows, k)))
        # b) verify every row causally; the token after the accepted prefix is always taken
        checks, _, logits, *causal = yield from verify_drafts(ctx, rows, positions, config.token_threshold, groups,
                                                              causal=causal_fix)
        logits = logits.view(n_rows, k, -1)
        checked = np.reshape(checks, (n_rows, k)) > 0  # a slot's first token is checked as drafted
        frontier = np.zeros_like(accepted)  # each row's first unaccepted token
        frontier[:, 1:] = accepted[:, :-1] & ~accepted[:, 1:]
        fix = np.zeros_like(accepted)
        if causal_fix:
            fix = frontier & ~checked
            predicted = np.zeros_like(rows)
            predicted[:, 1:] = np.reshape(causal[0], (n_rows, k - 1))  # the causal head's token for each position
            rows = np.where(fix, predicted, rows)
            after_fix = (np.cumsum(fix, -1) - fix) > 0  # checked against the replaced token
            passed = (checked | fix | accepted) & ~after_fix
        else:
            passed = checked | frontier | accepted
        now_accepted = np.cumprod(passed, -1) > 0
        forced_kind = CORRECTED if causal_fix else FORCED
        kinds = np.where(now_accepted & ~accepted, np.where(checked, VERIFIED, forced_kind), kinds)
        accepted = now_accepted
        stale = bool(fix.any())
        # c) an accepted EOS ends its row; later rows are dropped
        eos_rows = (np.isin(rows, list(stops)) & accepted).any(-1)
        if eos_rows.any():
            last = int(eos_rows.argmax()) + 1
            rows, positions, accepted, kinds = rows[:last], positions[:last], accepted[:last], kinds[:last]
            logits = logits[:last]
            accepted[-1] = True
            done = bool(accepted[: last - 1].all())
        else:
            done = bool(accepted.all())
    if stale:  # the commit takes the K/V of the context's last call: compute it for the final tokens
        groups = [row for row in range(rows.shape[0]) for _ in range(k)]
        logits = (yield from ctx.forward(rows.reshape(-1), positions.reshape(-1), groups)).view(rows.shape[0], k, -1)
    return Completed(rows, rounds, logits, rows.reshape(-1).tolist(), kinds.reshape(-1).tolist())


# ---------------------------------------------------------------------------------------------
# the loop


def refusion_row(runner: CausalRunner, index: int, prompt: torch.Tensor, config: ReFusionConfig, *, mask_token_id: int,
                 eos_token_id: EosIds, generator: torch.Generator | None, causal_fix: bool = False,
                 causal_first: bool = False, recheck: bool = False,
                 on_step: Callable[[StepTrace], None] | None = None,
                 clock: RowClock | None = None) -> SequenceStep[DecodeResult]:
    """Open sequence ``index`` for ``prompt`` [P] and return its decode program (see engine.Engine); ``on_step``
    sees every iteration, its time kept out of the latency by ``clock``."""
    stats = DecodeStats()
    ctx = runner.open(index, stats, prompt)
    report = None if on_step is None or clock is None else functools.partial(clock.report, stats, on_step)
    return refusion_program(ctx, stats, prompt.numel(), config, mask_token_id, eos_token_id, generator,
                       causal_fix, causal_first, recheck, report)


def refusion_program(ctx: CausalSequence, stats: DecodeStats, n_prompt: int, config: ReFusionConfig,
                     mask_token_id: int, eos_token_id: EosIds, generator: torch.Generator | None,
                     causal_fix: bool, causal_first: bool, recheck: bool,
                     report: Callable[[StepTrace], None] | None) -> SequenceStep[DecodeResult]:
    """One prompt's decode as a sequence's program (see engine.Engine); returns its result, ``seconds`` unset."""
    device, k = ctx.runner.device, config.slot_size
    n_slots = config.padded_length // k
    slots_per_block = config.block_tokens // k
    stop_ids = set(eos_ids(eos_token_id))
    # true position ids of every response slot: [n_slots, k]
    slot_pos = np.arange(n_prompt, n_prompt + n_slots * k).reshape(n_slots, k)
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
            rows: torch.Tensor | np.ndarray = drafts[chosen_idx]  # [R, k]
            positions = slot_pos[chosen]  # [R, k]
            carried = []
            if causal_first:  # after a committed neighbour, the surer of the causal head's token and the draft
                rows = device_index(drafts[chosen_idx], device)
                starts = device_index(positions[:, 0] - n_prompt, device)
                heads = causal_next[starts]  # [R], -1: left neighbour still masked
                drafted = torch.tensor([first_prob[i] for i in chosen_idx], dtype=causal_prob.dtype)
                from_causal = (heads >= 0) & (causal_prob[starts] >= drafted.to(device))
                rows[:, 0] = torch.where(from_causal, heads, rows[:, 0])
                carried.append(from_causal)
            # 2) verify
            flags, tokens, pass_logits, *causal_starts = yield from verify_drafts(ctx, rows, positions,
                                                                                  config.token_threshold, None,
                                                                                  *carried)
            prefix, eos_at, n_commit = accepted_prefix(flags, tokens, stop_ids, k)
            if eos_at is not None or prefix >= k:
                path, rounds = "fast", 0
                kinds = [FIRST if i % k == 0 else VERIFIED for i in range(len(tokens))]
            else:
                # 3) complete in parallel
                accepted = np.cumprod(np.reshape(flags, (-1, k)), axis=1) > 0
                completed = yield from complete_slots(ctx, np.reshape(tokens, (-1, k)), positions, accepted, config,
                                                      mask_token_id, stop_ids, causal_fix)
                rows, rounds, pass_logits = completed.rows, completed.rounds, completed.logits
                tokens, kinds, path = completed.tokens, completed.kinds, "completion"
                kept = [1] * len(tokens)  # every completed row
                if recheck and rows.shape[0] > 1:  # verify the rows again, each seeing those to its left
                    kept, _, pass_logits = yield from verify_drafts(ctx, rows, positions[: rows.shape[0]],
                                                                    config.token_threshold)
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
                for row, causal in enumerate(causal_starts[0][: len(kinds) // k]):
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
