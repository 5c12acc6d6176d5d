"""A slow reference ReFusion decoder for tests: no cache, every pass re-runs the whole buffer.

It follows docs/algorithm.md step by step with plain Python lists. Each committed token remembers
which committed tokens it attended to when it was committed; every pass rebuilds the buffer
(committed tokens in commit order, then the new rows) with a 4-D mask that reproduces exactly
that, so its tokens must equal those of the cached decoder.

``siblings_visible=True`` lets the slots committed together by one completion step see each
other (plain causal over commit order): that is what ``kv_reuse=False`` computes.

``causal_first=True``: every committed token also remembers the causal head's argmax for the next
position and its probability, from the pass that committed it (the last prompt token: from the
first pass); a chosen slot whose left neighbour is committed starts with that token when that
probability is at least the draft's first-token probability. ``causal_firsts`` counts such slots,
``replaced_firsts`` those where it differs from the draft, ``kept_drafts`` the slots after a
committed neighbour that keep the draft because it is the surer one.

``recheck=True``: after a completion step of more than one row, the rows are run again as one row
in position order; the first row is kept whole, every later token must pass its check (a slot's
first token as drafted), and the whole slots up to the first failure are committed (through the
EOS if one is in the accepted tokens, as on the fast path), with the K/V of that pass (they see
each other).
"""

from __future__ import annotations

import torch

# The settings the exactness tests sweep, against this reference and batched against one prompt at a time:
# (slot_size, block_size, gen_length, slot_threshold, token_threshold), on a tiny model per seed
CONFIGS = [
    (4, 8, 24, 0.3, 0.3),
    (4, None, 20, 0.5, 0.1),
    (2, 4, 13, 0.2, 0.4),
    (3, 9, 18, 0.0, 0.2),
    (4, 16, 32, 0.6, 0.05),
    (8, 8, 24, 0.1, 0.2),
    (1, 4, 7, 0.5, 0.5),
    (4, 4, 16, 1.0, 1.0),
]
MODEL_SEEDS = [0, 1, 2]


class ReferenceReFusion:
    def __init__(self, model, prompt: list[int], *, mask_id: int, eos_id: int | None, siblings_visible: bool = False):
        self.model = model
        self.mask_id = mask_id
        self.eos_id = eos_id
        self.siblings_visible = siblings_visible
        # committed tokens in commit order: (token, position, indices of committed tokens it sees)
        self.committed: list[tuple[int, int, set[int]]] = []
        self._commit_rows([[(t, i) for i, t in enumerate(prompt)]], together=True)
        self.n_prompt = len(prompt)
        self.forwards = 0
        self.context_logits: torch.Tensor | None = None  # the last pass's logits at the committed tokens
        self.causal_firsts = 0
        self.replaced_firsts = 0
        self.kept_drafts = 0
        self.rechecked_away = 0  # completed slots the recheck sent back to the plan

    def _commit_rows(self, rows: list[list[tuple[int, int]]], together: bool) -> None:
        """Commit rows of (token, position); a row sees what was committed before plus its own earlier tokens."""
        before = set(range(len(self.committed)))
        for row in rows:
            start = len(self.committed)
            for offset, (token, position) in enumerate(row):
                sees = set(before) | set(range(start, start + offset))
                self.committed.append((token, position, sees))
            if together:
                before |= set(range(start, len(self.committed)))

    def run(self, rows: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
        """Logits [len(row), V] of each row fed after all committed tokens, from scratch."""
        self.forwards += 1
        n_ctx = len(self.committed)
        ids = [t for t, _, _ in self.committed] + [t for row in rows for t, _ in row]
        positions = [p for _, p, _ in self.committed] + [p for row in rows for _, p in row]
        n = len(ids)
        allowed = torch.zeros(n, n, dtype=torch.bool)
        for i, (_, _, sees) in enumerate(self.committed):
            allowed[i, i] = True
            for j in sees:
                allowed[i, j] = True
        start = n_ctx
        for row in rows:
            for a in range(len(row)):
                allowed[start + a, :n_ctx] = True
                allowed[start + a, start:start + a + 1] = True
            start += len(row)
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        logits = self.model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            attention_mask={"full_attention": mask},
            use_cache=False,
        ).logits[0]
        self.context_logits, logits = logits[:n_ctx], logits[n_ctx:]
        out, start = [], 0
        for row in rows:
            out.append(logits[start:start + len(row)])
            start += len(row)
        return out

    def decode(self, gen_length: int, slot_size: int, block_size: int | None, slot_threshold: float,
               token_threshold: float, causal_fix: bool = False, causal_first: bool = False,
               recheck: bool = False) -> list[int]:
        k = slot_size
        n_slots = (gen_length + k - 1) // k
        block_slots = (block_size // k) if block_size is not None else max(1, n_slots // 2)
        P = self.n_prompt

        def slot_positions(s: int) -> list[int]:
            return [P + s * k + i for i in range(k)]

        def ar_prob(logits: torch.Tensor, j: int, token: int) -> float:
            return float(torch.softmax(logits[j - 1], -1)[token])

        # position -> (causal head's token, its probability), from the pass committing position - 1
        predicted: dict[int, tuple[int, float]] = {}

        def prediction(token_logits: torch.Tensor) -> tuple[int, float]:
            token = int(token_logits.argmax())
            return token, float(torch.softmax(token_logits, -1)[token])

        def remember(row: list[tuple[int, int]], logits: torch.Tensor) -> None:
            for (_, position), token_logits in zip(row, logits):
                predicted[position + 1] = prediction(token_logits)

        for block_start in range(0, n_slots, block_slots):
            masked = list(range(block_start, min(block_start + block_slots, n_slots)))
            ended = False
            while masked:
                # plan
                plan_row = [(self.mask_id, p) for s in masked for p in slot_positions(s)]
                logits = self.run([plan_row])[0]
                if P not in predicted:  # the first pass computes the prompt
                    predicted[P] = prediction(self.context_logits[P - 1])
                drafts, first_probs = {}, {}
                for n, s in enumerate(masked):
                    piece = logits[n * k:(n + 1) * k]
                    drafts[s] = [int(x) for x in piece.argmax(-1)]
                    first_probs[s] = float(torch.softmax(piece[0], -1)[drafts[s][0]])
                chosen = [s for s in masked if first_probs[s] > slot_threshold]
                if not chosen:
                    best = max(first_probs.values())
                    chosen = [next(s for s in masked if first_probs[s] == best)]
                for s in chosen:
                    start = slot_positions(s)[0]
                    if causal_first and start in predicted:
                        token, prob = predicted[start]
                        if prob < first_probs[s]:
                            self.kept_drafts += 1
                            continue
                        self.causal_firsts += 1
                        self.replaced_firsts += token != drafts[s][0]
                        drafts[s] = [token] + drafts[s][1:]
                # verify
                concat = [(drafts[s][i], slot_positions(s)[i]) for s in chosen for i in range(k)]
                logits = self.run([concat])[0]
                prefix = 0
                for j, (token, _) in enumerate(concat):
                    if j % k == 0 or ar_prob(logits, j, token) > token_threshold:
                        prefix += 1
                    else:
                        break
                eos_at = next((j for j in range(prefix) if concat[j][0] == self.eos_id), None)
                if eos_at is not None or prefix >= k:
                    n_commit = eos_at + 1 if eos_at is not None else prefix // k * k
                    self._commit_rows([concat[:n_commit]], together=True)
                    remember(concat[:n_commit], logits)
                    done = chosen[: (n_commit + k - 1) // k]
                else:
                    rows, row_logits = self._complete(chosen, drafts, logits, slot_positions, k, token_threshold,
                                                      causal_fix)
                    flat = [t for row in rows for t in row]
                    if recheck and len(rows) > 1:
                        logits = self.run([flat])[0]
                        kept = k
                        while kept < len(flat) and (kept % k == 0 or
                                                    ar_prob(logits, kept, flat[kept][0]) > token_threshold):
                            kept += 1
                        eos_at = next((j for j in range(kept) if flat[j][0] == self.eos_id), None)
                        n_commit = eos_at + 1 if eos_at is not None else kept // k * k
                        self.rechecked_away += len(rows) - (n_commit + k - 1) // k
                        self._commit_rows([flat[:n_commit]], together=True)
                        remember(flat[:n_commit], logits)
                        done = chosen[: (n_commit + k - 1) // k]
                    else:
                        done = chosen[: len(rows)]
                        eos_at = next((j for j, (t, _) in enumerate(flat) if t == self.eos_id), None)
                        keep = eos_at + 1 if eos_at is not None else len(flat)
                        cut_rows, left = [], keep
                        for row in rows:
                            cut_rows.append(row[:left])
                            left -= len(cut_rows[-1])
                        self._commit_rows([r for r in cut_rows if r], together=self.siblings_visible)
                        for row, row_logit in zip(cut_rows, row_logits):
                            remember(row, row_logit)
                masked = [s for s in masked if s not in done]
                if eos_at is not None:
                    ended = True
                    masked = [s for s in masked if s < done[-1]]
            if ended:
                break
        response = sorted((p, t) for t, p, _ in self.committed[P:])
        tokens = [t for _, t in response]
        if self.eos_id in tokens:
            tokens = tokens[: tokens.index(self.eos_id) + 1]
        return tokens

    def _complete(self, chosen, drafts, verify_logits, slot_positions, k, token_threshold, causal_fix=False):
        """Parallel completion: each chosen slot is its own row, re-drafted and verified until accepted.

        Each round the first unaccepted token of a row is taken even if it fails its check (the forced
        token); with ``causal_fix`` it is replaced by the causal prediction instead and the row accepts
        nothing after it in that round; if the last round replaced a token, one more pass runs the
        final rows (the K/V the cached decoder commits). Returns the rows and the logits of each row
        in the pass they are committed from."""
        rows = [[(drafts[s][i], slot_positions(s)[i]) for i in range(k)] for s in chosen]
        accepted = []
        for n, row in enumerate(rows):  # per-slot accepted prefix from the global verification
            flags = [True]
            for i in range(1, k):
                j = n * k + i
                ok = float(torch.softmax(verify_logits[j - 1], -1)[row[i][0]]) > token_threshold
                flags.append(flags[-1] and ok)
            accepted.append(flags)
        verify, round_fixed = None, False
        for _ in range(k):
            if all(all(f) for f in accepted):
                break
            round_fixed = False
            masked_rows = [[(t if accepted[r][i] else self.mask_id, p) for i, (t, p) in enumerate(row)]
                           for r, row in enumerate(rows)]
            draft_logits = self.run(masked_rows)
            rows = [[(t if accepted[r][i] else int(draft_logits[r][i].argmax()), p) for i, (t, p) in enumerate(row)]
                    for r, row in enumerate(rows)]
            verify = self.run(rows)
            for r, row in enumerate(rows):
                flags, fixed = [True], False
                for i in range(1, k):
                    if accepted[r][i]:
                        flags.append(True)
                    elif fixed or not flags[-1]:
                        flags.append(False)
                    elif float(torch.softmax(verify[r][i - 1], -1)[row[i][0]]) > token_threshold:
                        flags.append(True)
                    elif accepted[r][i - 1]:  # the first unaccepted token failed its check
                        if causal_fix:
                            row[i] = (int(verify[r][i - 1].argmax()), row[i][1])
                            fixed = round_fixed = True
                        flags.append(True)
                    else:
                        flags.append(False)
                accepted[r] = flags
            eos_row = next((r for r, row in enumerate(rows)
                            if any(t == self.eos_id and accepted[r][i] for i, (t, _) in enumerate(row))), None)
            if eos_row is not None:
                rows, accepted, verify = rows[: eos_row + 1], accepted[: eos_row + 1], verify[: eos_row + 1]
                accepted[-1] = [True] * k
        if round_fixed:
            verify = self.run(rows)
        return rows, verify
