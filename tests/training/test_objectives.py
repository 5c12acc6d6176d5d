"""Data construction per objective, batching, and the loss (tiny float64 Qwen3, exact values)."""

from __future__ import annotations

import pytest
import torch
from tests.tiny import EOS_ID, MASK_ID, PAD_ID, tiny_qwen3

from refusion_cli.training.objectives import (
    IGNORE_INDEX,
    MASK_EPSILON,
    OBJECTIVES,
    SLOT_SIZES,
    Example,
    LossKind,
    RefusionPlan,
    attention_allowed,
    build_ar,
    build_dream,
    build_llada,
    build_refusion,
    collate,
    compute_loss,
    draw_refusion_plan,
    layout_llada,
    layout_refusion,
    mask_probability,
    model_attention_mask,
)
from tests.training.losses import expected_loss, manual_ce, row_logits

PROMPT = (10, 11, 12)
RESPONSE = (20, 21, 22, 23, 24, 25, 26, 27, 28, EOS_ID)  # 10 tokens, ends with EOS


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_refusion_layout_of_a_hand_made_plan():
    # k = 4 -> slots [0, 4), [4, 8), [8, 10); slot 1 masked; clean slots laid out as 2 then 0
    plan = RefusionPlan(slot_size=4, mask_prob=0.25, masked=(False, True, False), clean_order=(2, 0))
    sample = layout_refusion(Example(PROMPT, RESPONSE), plan, MASK_ID)
    M, X = MASK_ID, IGNORE_INDEX
    assert sample.input_ids.tolist() == [10, 11, 12, 28, EOS_ID, 20, 21, 22, 23, M, M, M, M]
    assert sample.position_ids.tolist() == [0, 1, 2, 11, 12, 3, 4, 5, 6, 7, 8, 9, 10]
    # clean token -> next token of its own slot (slot's last token unlabelled); mask -> the token at its position
    assert sample.labels.tolist() == [X, X, X, EOS_ID, X, 21, 22, 23, X, 24, 25, 26, 27]
    A, D, N = LossKind.AR, LossKind.MDM, LossKind.NONE
    assert sample.loss_kinds.tolist() == [N, N, N, A, N, A, A, A, N, D, D, D, D]
    ar_weight, mdm_weight = 1 / 4, 1 / (0.25 * len(RESPONSE))  # mean over 4 AR labels; 1 / (p * response length)
    expected = [0, 0, 0, ar_weight, 0, ar_weight, ar_weight, ar_weight, 0] + [mdm_weight] * 4
    assert sample.loss_weights.tolist() == pytest.approx(expected, rel=1e-15)


def test_refusion_layout_masked_slots_stay_in_position_order_and_last_slot_may_be_short():
    plan = RefusionPlan(slot_size=8, mask_prob=0.9, masked=(True, True), clean_order=())
    sample = layout_refusion(Example(PROMPT, RESPONSE), plan, MASK_ID)
    assert sample.input_ids.tolist() == list(PROMPT) + [MASK_ID] * 10
    assert sample.position_ids.tolist() == list(range(13))
    assert sample.labels.tolist()[3:] == list(RESPONSE)
    assert (sample.loss_kinds == LossKind.AR).sum() == 0  # no clean slot: the AR part is empty (weight-free)


@pytest.mark.parametrize("seed", range(40))
def test_refusion_draws_keep_every_invariant(seed):
    response = tuple(range(20, 20 + 3 + seed % 37)) + (EOS_ID,)
    example = Example(PROMPT, response)
    sample = build_refusion(example, MASK_ID, generator(seed))
    P, L = len(PROMPT), len(response)
    assert sample.slot_size in SLOT_SIZES and MASK_EPSILON <= sample.mask_prob <= 1
    # the prompt is first, at its positions, never masked, never scored
    assert sample.input_ids[:P].tolist() == list(PROMPT) and sample.position_ids[:P].tolist() == list(range(P))
    assert (sample.labels[:P] == IGNORE_INDEX).all()
    # every response position appears exactly once
    assert sorted(sample.position_ids[P:].tolist()) == list(range(P, P + L))
    body_ids, body_pos = sample.input_ids[P:].tolist(), sample.position_ids[P:].tolist()
    body_labels, body_kinds = sample.labels[P:].tolist(), sample.loss_kinds[P:].tolist()
    masked = [i for i, t in enumerate(body_ids) if t == MASK_ID]
    # masked tokens come last, in position order, each labelled with the original token at its position
    assert masked == list(range(len(body_ids) - len(masked), len(body_ids)))
    assert [body_pos[i] for i in masked] == sorted(body_pos[i] for i in masked)
    for i in masked:
        assert body_labels[i] == response[body_pos[i] - P] and body_kinds[i] == LossKind.MDM
    # clean tokens are the originals; they come in whole slots of k (the order of slots is shuffled)
    k = sample.slot_size
    clean = range(len(body_ids) - len(masked))
    for i in clean:
        offset = body_pos[i] - P
        assert body_ids[i] == response[offset]
        last_of_slot = offset % k == k - 1 or offset == L - 1
        assert body_labels[i] == (IGNORE_INDEX if last_of_slot else response[offset + 1])
        assert body_kinds[i] == (LossKind.NONE if last_of_slot else LossKind.AR)
        if not last_of_slot:  # the next buffer token is the next token of the same slot
            assert body_pos[i + 1] == body_pos[i] + 1
    # masking is per slot: a slot is either all masked or all clean
    masked_offsets = {body_pos[i] - P for i in masked}
    for start in range(0, L, k):
        slot = set(range(start, min(start + k, L)))
        assert slot <= masked_offsets or not slot & masked_offsets


def test_refusion_shuffles_only_the_clean_slots():
    response = tuple(range(20, 84)) + (EOS_ID,)  # 65 tokens: at least 3 slots for every k
    orders = set()
    for seed in range(200):
        plan = draw_refusion_plan(len(response), generator(seed))
        clean = [i for i, m in enumerate(plan.masked) if not m]
        assert sorted(plan.clean_order) == clean
        orders.add(tuple(plan.clean_order) == tuple(clean))
    assert orders == {True, False}  # clean slots come both in order and out of order


def test_mask_probability_has_the_epsilon_floor():
    assert mask_probability(0.0) == MASK_EPSILON
    assert mask_probability(1.0) == 1.0
    assert mask_probability(0.5) == pytest.approx((1 - MASK_EPSILON) * 0.5 + MASK_EPSILON)
    draws = [draw_refusion_plan(40, generator(s)).mask_prob for s in range(300)]
    assert min(draws) >= MASK_EPSILON and max(draws) <= 1.0


def test_same_generator_state_gives_the_same_sample():
    example = Example(PROMPT, RESPONSE)
    for objective in OBJECTIVES.values():
        a, b = objective.build(example, MASK_ID, generator(7)), objective.build(example, MASK_ID, generator(7))
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
        assert torch.equal(a.labels, b.labels) and torch.equal(a.loss_weights, b.loss_weights)


def test_ar_labels_are_the_shifted_response():
    sample = build_ar(Example(PROMPT, RESPONSE), MASK_ID, generator(0))
    X = IGNORE_INDEX
    assert sample.input_ids.tolist() == list(PROMPT + RESPONSE)
    assert sample.position_ids.tolist() == list(range(13))
    assert sample.labels.tolist() == [X, X] + list(RESPONSE) + [X]  # the last prompt token predicts response[0]
    assert sample.loss_weights.sum().item() == pytest.approx(1.0)
    assert MASK_ID not in sample.input_ids.tolist()


def test_llada_layout_masks_response_tokens_only():
    masked = [True, False, False, True, False, False, False, False, False, True]
    sample = layout_llada(Example(PROMPT, RESPONSE), masked, 0.5, MASK_ID)
    M, X = MASK_ID, IGNORE_INDEX
    assert sample.input_ids.tolist() == [10, 11, 12, M, 21, 22, M, 24, 25, 26, 27, 28, M]
    assert sample.position_ids.tolist() == list(range(13))
    assert sample.labels.tolist() == [X, X, X, 20, X, X, 23, X, X, X, X, X, EOS_ID]
    weights = sample.loss_weights.tolist()
    assert weights[3] == weights[6] == weights[12] == pytest.approx(1 / (0.5 * 10))
    assert sum(w > 0 for w in weights) == 3
    drawn = build_llada(Example(PROMPT, RESPONSE * 4), MASK_ID, generator(3))
    assert drawn.input_ids[:3].tolist() == list(PROMPT) and drawn.mask_prob >= MASK_EPSILON
    assert OBJECTIVES["llada"].bidirectional and not OBJECTIVES["refusion"].bidirectional


def test_dream_scores_each_masked_token_from_the_position_before_it():
    # the same draws as llada (same generator seed), with every label moved one index left
    example = Example(PROMPT, RESPONSE * 2)
    llada, dream = build_llada(example, MASK_ID, generator(4)), build_dream(example, MASK_ID, generator(4))
    assert dream.input_ids.tolist() == llada.input_ids.tolist()
    assert dream.mask_prob == llada.mask_prob
    masked = [i for i, token in enumerate(llada.input_ids.tolist()) if token == MASK_ID]
    assert masked and min(masked) >= len(PROMPT)
    X = IGNORE_INDEX
    assert dream.labels.tolist() == [example_token if i + 1 in masked else X
                                     for i, example_token in enumerate([*PROMPT, *RESPONSE * 2][1:] + [X])]
    assert [i for i, w in enumerate(dream.loss_weights.tolist()) if w > 0] == [i - 1 for i in masked]
    assert OBJECTIVES["dream"].bidirectional and OBJECTIVES["dream"].eos_padding
    with pytest.raises(ValueError, match="needs a prompt"):
        build_dream(Example((), RESPONSE), MASK_ID, generator(4))


@pytest.mark.parametrize("name, shifted", [("llada", False), ("dream", True), ("refusion", None), ("ar", None)])
def test_the_saved_config_records_the_attention_and_the_shift_the_objective_trains(name, shifted):
    from refusion_cli.training.modeling import prepare_for_objective

    objective = OBJECTIVES[name]
    model = tiny_qwen3(seed=1)
    prepare_for_objective(model, objective)
    assert model.config.is_causal is not objective.bidirectional
    assert getattr(model.config, "shifted_logits", None) is shifted


def test_collate_pads_right_and_never_scores_padding():
    short = build_ar(Example((10,), (20, EOS_ID)), MASK_ID, generator(0))
    long = build_ar(Example(PROMPT, RESPONSE), MASK_ID, generator(0))
    batch = collate([short, long], pad_id=PAD_ID)
    assert batch["input_ids"].shape == (2, 13) and batch["lengths"].tolist() == [3, 13]
    assert batch["input_ids"][0].tolist() == [10, 20, EOS_ID] + [PAD_ID] * 10
    assert (batch["labels"][0, 3:] == IGNORE_INDEX).all() and (batch["loss_weights"][0, 3:] == 0).all()
    causal = attention_allowed(batch["lengths"], 13, bidirectional=False)[0, 0]
    bidirectional = attention_allowed(batch["lengths"], 13, bidirectional=True)[0, 0]
    assert not causal[:3, 3:].any() and not bidirectional[:3, 3:].any()  # real tokens never see padding
    assert bidirectional[:3, :3].all() and causal.diagonal().all() and bidirectional.diagonal().all()


# --- the model side: attention, positions, and the loss ---------------------------------------------


def test_refusion_attention_is_causal_over_the_buffer_with_true_positions():
    model = tiny_qwen3(seed=1, init_std=0.2)
    plan = RefusionPlan(slot_size=4, mask_prob=0.5, masked=(False, True, False), clean_order=(2, 0))
    sample = layout_refusion(Example(PROMPT, RESPONSE), plan, MASK_ID)
    full = row_logits(model, sample, bidirectional=False)
    for cut in (4, 8, 11):  # a buffer prefix alone gives the same logits: nothing later is seen
        prefix = type(sample)(*(getattr(sample, f)[:cut] for f in ("input_ids", "position_ids", "labels",
                                                                   "loss_weights", "loss_kinds")))
        torch.testing.assert_close(row_logits(model, prefix, bidirectional=False), full[:cut], rtol=1e-12, atol=1e-12)
    # the true positions matter: the same buffer at consecutive positions gives other logits
    renumbered = type(sample)(sample.input_ids, torch.arange(len(sample.input_ids)), sample.labels,
                              sample.loss_weights, sample.loss_kinds)
    assert not torch.allclose(row_logits(model, renumbered, bidirectional=False)[4:], full[4:])


def test_padding_does_not_change_the_logits_of_real_tokens():
    model = tiny_qwen3(seed=2, init_std=0.2)
    for name, objective in OBJECTIVES.items():
        samples = [objective.build(Example(PROMPT, RESPONSE[:n]), MASK_ID, generator(n)) for n in (3, 10)]
        batch = collate(samples, pad_id=PAD_ID)
        allowed = attention_allowed(batch["lengths"], batch["input_ids"].shape[1], objective.bidirectional)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=model_attention_mask(model, allowed)).logits
        for row, sample in enumerate(samples):
            alone = row_logits(model, sample, objective.bidirectional)
            torch.testing.assert_close(logits[row, :len(alone)], alone, rtol=1e-12, atol=1e-12, msg=name)


def test_llada_attention_is_bidirectional():
    model = tiny_qwen3(seed=3, causal=False, init_std=0.2)
    sample = layout_llada(Example(PROMPT, RESPONSE), [True] * 10, 1.0, MASK_ID)
    changed = type(sample)(sample.input_ids.clone(), sample.position_ids, sample.labels, sample.loss_weights,
                           sample.loss_kinds)
    changed.input_ids[-1] = 5
    assert not torch.allclose(row_logits(model, sample, True)[0], row_logits(model, changed, True)[0])


def test_refusion_loss_equals_a_hand_computed_value():
    model = tiny_qwen3(seed=4, init_std=0.2)
    first = Example(PROMPT, RESPONSE)
    second = Example((10, 11), (30, 31, 32, 33, 34, EOS_ID))
    plans = [RefusionPlan(4, 0.3, (False, True, False), (2, 0)), RefusionPlan(4, 0.7, (True, False), (1,))]
    samples = [layout_refusion(first, plans[0], MASK_ID), layout_refusion(second, plans[1], MASK_ID)]
    parts = compute_loss(model, collate(samples, PAD_ID), "refusion")
    loss, ar, mdm = expected_loss(model, [(samples[0], 10), (samples[1], 6)], bidirectional=False)
    assert parts.loss.item() == pytest.approx(loss, rel=1e-12)
    assert parts.ar_loss.item() == pytest.approx(ar, rel=1e-12)
    assert parts.mdm_loss.item() == pytest.approx(mdm, rel=1e-12)


@pytest.mark.parametrize("name", ["ar", "llada", "dream"])
def test_baseline_losses_equal_hand_computed_values(name):
    objective = OBJECTIVES[name]
    model = tiny_qwen3(seed=5, causal=not objective.bidirectional, init_std=0.2)
    examples = [Example(PROMPT, RESPONSE), Example((10, 11), (30, 31, 32, 33, 34, EOS_ID))]
    samples = [objective.build(e, MASK_ID, generator(11 + i)) for i, e in enumerate(examples)]
    if name == "ar":  # AR: mean CE over the response tokens, written without the loss weights
        expected = 0.0
        for sample, example in zip(samples, examples):
            logits = row_logits(model, sample, False)
            P = len(example.prompt_ids)
            expected += sum(manual_ce(logits[P - 1 + j], t) for j, t in enumerate(example.response_ids)) / len(
                example.response_ids)
        expected /= 2
    else:
        expected = expected_loss(model, [(s, len(e.response_ids)) for s, e in zip(samples, examples)], True)[0]
    parts = compute_loss(model, collate(samples, PAD_ID), objective)
    assert parts.loss.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_one_optimisation_step_lowers_the_loss_on_a_fixed_batch(name):
    objective = OBJECTIVES[name]
    model = tiny_qwen3(seed=6, causal=not objective.bidirectional).train().requires_grad_(True)
    examples = [Example(PROMPT, RESPONSE), Example((10, 11), (30, 31, 32, 33, 34, EOS_ID))]
    batch = collate([objective.build(e, MASK_ID, generator(i)) for i, e in enumerate(examples)], PAD_ID)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = compute_loss(model, batch, objective)
    before.loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = compute_loss(model, batch, objective)
    assert after.loss.item() < before.loss.item()


def test_loss_parts_add_up_and_gradients_flow():
    model = tiny_qwen3(seed=7).train().requires_grad_(True)
    batch = collate([build_refusion(Example(PROMPT, RESPONSE * 3), MASK_ID, generator(s)) for s in range(3)], PAD_ID)
    parts = compute_loss(model, batch, "refusion")
    assert parts.loss.item() == pytest.approx(parts.ar_loss.item() + parts.mdm_loss.item(), rel=1e-12)
    parts.loss.backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
