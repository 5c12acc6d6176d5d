"""The fast data construction and the broadcast attention masks against slow references: exactly equal.

The references are the straightforward implementations (a per-token loop and ``torch.tensor`` on
lists; the dense [B, 1, S, S] mask) that the training path replaced for speed: samples must be equal
element for element with the same dtypes, and the loss and every gradient bit for bit (float64
tiny Qwen3), so that losses, resumes and the data stream stay exactly what they were.
"""

from __future__ import annotations

import pytest
import torch
from tests.tiny import EOS_ID, MASK_ID, PAD_ID, tiny_qwen3

from refusion_cli.training.objectives import (
    IGNORE_INDEX,
    OBJECTIVES,
    Example,
    LossKind,
    RefusionPlan,
    attention_allowed,
    broadcast_attention_allowed,
    build_ar,
    collate,
    compute_loss,
    draw_refusion_plan,
    layout_llada,
    layout_refusion,
    model_attention_mask,
    slot_bounds,
    tensor_of,
    weighted_losses,
)

FIELDS = ("input_ids", "position_ids", "labels", "loss_weights", "loss_kinds")


def reference_layout_refusion(example: Example, plan: RefusionPlan, mask_id: int) -> dict[str, torch.Tensor]:
    """One token at a time, as the buffer is described in docs/training.md."""
    prompt, response = example.prompt_ids, example.response_ids
    P = len(prompt)
    slots = slot_bounds(len(response), plan.slot_size)
    ids, positions, labels, kinds = list(prompt), list(range(P)), [IGNORE_INDEX] * P, [LossKind.NONE] * P
    for slot in plan.clean_order:
        start, end = slots[slot]
        for j in range(start, end):
            last = j == end - 1
            ids.append(response[j])
            positions.append(P + j)
            labels.append(IGNORE_INDEX if last else response[j + 1])
            kinds.append(LossKind.NONE if last else LossKind.AR)
    for slot, is_masked in enumerate(plan.masked):
        if is_masked:
            for j in range(*slots[slot]):
                ids.append(mask_id)
                positions.append(P + j)
                labels.append(response[j])
                kinds.append(LossKind.MDM)
    n_ar = kinds.count(LossKind.AR)
    weights = [1.0 / n_ar if k == LossKind.AR else 1.0 / (plan.mask_prob * len(response)) if k == LossKind.MDM
               else 0.0 for k in kinds]
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions), "labels": torch.tensor(labels),
            "loss_weights": torch.tensor(weights, dtype=torch.float64),
            "loss_kinds": torch.tensor([int(k) for k in kinds], dtype=torch.int8)}


def assert_same_sample(sample, expected: dict[str, torch.Tensor]) -> None:
    for field in FIELDS:
        value = getattr(sample, field)
        assert value.dtype == expected[field].dtype, field
        assert torch.equal(value, expected[field]), field


EXAMPLES = [
    Example((10, 11, 12), (20, 21, 22, 23, 24, 25, 26, 27, 28, EOS_ID)),
    Example((), (20, 21, 22, 23, 24, EOS_ID)),  # no prompt
    Example((10,), (EOS_ID,)),  # one response token
    Example((10, 11), tuple(range(20, 57)) + (EOS_ID,)),  # 38 tokens: a short last slot for every k
]


@pytest.mark.parametrize("seed", range(60))
def test_refusion_layout_equals_the_per_token_reference(seed):
    example = EXAMPLES[seed % len(EXAMPLES)]
    plan = draw_refusion_plan(len(example.response_ids), torch.Generator().manual_seed(seed))
    assert_same_sample(layout_refusion(example, plan, MASK_ID), reference_layout_refusion(example, plan, MASK_ID))


@pytest.mark.parametrize("masked", [(True, True, True), (False, False, False), (False, True, False)])
def test_refusion_layout_equals_the_reference_with_all_none_or_some_slots_masked(masked):
    example = EXAMPLES[0]  # k = 4: slots [0, 4), [4, 8), [8, 10)
    clean = tuple(reversed([i for i, m in enumerate(masked) if not m]))
    plan = RefusionPlan(slot_size=4, mask_prob=0.3, masked=masked, clean_order=clean)
    assert_same_sample(layout_refusion(example, plan, MASK_ID), reference_layout_refusion(example, plan, MASK_ID))


def test_a_plan_for_other_slots_is_still_refused():
    with pytest.raises(ValueError, match="does not match"):
        layout_refusion(EXAMPLES[0], RefusionPlan(4, 0.5, (False, True), (0,)), MASK_ID)
    with pytest.raises(ValueError, match="does not match"):
        layout_refusion(EXAMPLES[0], RefusionPlan(4, 0.5, (False, True, False), (0,)), MASK_ID)


@pytest.mark.parametrize("example", EXAMPLES)
def test_ar_and_llada_samples_equal_the_list_built_reference(example):
    P, response = len(example.prompt_ids), example.response_ids
    ids = torch.tensor(list(example.prompt_ids) + list(response))
    labels = torch.full((len(ids),), IGNORE_INDEX)
    targets = torch.tensor(response)[0 if P else 1:]
    labels[max(P - 1, 0):max(P - 1, 0) + len(targets)] = targets
    kinds = torch.where(labels != IGNORE_INDEX, int(LossKind.AR), int(LossKind.NONE)).to(torch.int8)
    assert_same_sample(build_ar(example, MASK_ID, torch.Generator()), {
        "input_ids": ids, "position_ids": torch.arange(len(ids)), "labels": labels, "loss_kinds": kinds,
        "loss_weights": (kinds == LossKind.AR).to(torch.float64) / max(len(targets), 1)})

    masked = [j % 3 == 0 for j in range(len(response))]
    flags = torch.tensor([False] * P + masked)
    assert_same_sample(layout_llada(example, masked, 0.4, MASK_ID), {
        "input_ids": torch.where(flags, MASK_ID, ids), "position_ids": torch.arange(len(ids)),
        "labels": torch.where(flags, ids, IGNORE_INDEX),
        "loss_kinds": torch.where(flags, int(LossKind.MDM), int(LossKind.NONE)).to(torch.int8),
        "loss_weights": flags.to(torch.float64) / (0.4 * len(response))})


@pytest.mark.parametrize(("values", "dtype"), [([5, -100, 2**40, 0], torch.long), ([3, 0, 1, 2], torch.int8),
                                               ([True, False, True], torch.bool), ((7, 8), torch.long),
                                               ([], torch.long)])
def test_tensor_of_equals_torch_tensor(values, dtype):
    made = tensor_of(values, dtype)
    expected = torch.tensor(values, dtype=dtype)
    assert made.dtype == expected.dtype and made.shape == expected.shape and torch.equal(made, expected)


# --- broadcast masks: the same attention for every real token -------------------------------------


def batch_of(objective_name: str, response_lengths: tuple[int, ...]) -> dict[str, torch.Tensor]:
    objective = OBJECTIVES[objective_name]
    samples = [objective.build(Example((10, 11, 12)[:1 + i % 3], tuple(range(20, 20 + n - 1)) + (EOS_ID,)),
                               MASK_ID, torch.Generator().manual_seed(i))
               for i, n in enumerate(response_lengths)]
    return collate(samples, PAD_ID)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_broadcast_mask_allows_what_the_dense_mask_allows_for_every_real_query(bidirectional):
    lengths = torch.tensor([3, 9, 1, 9])
    dense = attention_allowed(lengths, 9, bidirectional)  # [B, 1, S, S]
    compact = broadcast_attention_allowed(lengths, 9, bidirectional)
    assert compact.shape == ((4, 1, 1, 9) if bidirectional else (1, 1, 9, 9))
    expanded = compact.expand(dense.shape)
    for row, length in enumerate(lengths.tolist()):
        assert torch.equal(expanded[row, 0, :length], dense[row, 0, :length])  # real queries: the same keys
        assert expanded[row, 0].any(dim=-1).all()  # no query, real or pad, is left without a key
    if not bidirectional:
        assert torch.equal(expanded, dense)  # causal: identical everywhere


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_loss_and_gradients_with_the_broadcast_mask_equal_the_dense_ones_bit_for_bit(name, attention):
    objective = OBJECTIVES[name]
    model = tiny_qwen3(seed=8, causal=not objective.bidirectional, init_std=0.2).train().requires_grad_(True)
    model.set_attn_implementation(attention)
    batch = batch_of(name, (4, 13, 9, 2))
    assert batch["lengths"].unique().numel() > 1  # rows of several lengths: there is padding

    def loss_and_grads(allowed_fn):
        model.zero_grad(set_to_none=True)
        allowed = allowed_fn(batch["lengths"], batch["input_ids"].shape[1], objective.bidirectional)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=model_attention_mask(model, allowed), use_cache=False).logits
        ar, mdm = weighted_losses(logits, batch)
        (ar + mdm).mean().backward()
        return ar.detach(), mdm.detach(), [p.grad.clone() for p in model.parameters()]

    dense_ar, dense_mdm, dense_grads = loss_and_grads(attention_allowed)
    ar, mdm, grads = loss_and_grads(broadcast_attention_allowed)
    assert torch.equal(ar, dense_ar) and torch.equal(mdm, dense_mdm)
    assert all(torch.equal(g, d) for g, d in zip(grads, dense_grads, strict=True))
    assert any(g.abs().sum() > 0 for g in grads)
    # and compute_loss, which the loop calls, is the broadcast path
    parts = compute_loss(model, batch, objective)
    assert parts.loss.item() == (dense_ar + dense_mdm).mean().item()
