"""The validation loss: the training objective on held-out samples drawn per example (tiny float64 Qwen3)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from tests.tiny import EOS_ID, MASK_ID, PAD_ID, tiny_qwen3

from refusion_cli.training.data import HeldOutDataset, derived_seed
from refusion_cli.training.evaluation import evaluate, score_examples, share
from refusion_cli.training.objectives import OBJECTIVES, Example, collate, pad_with_eos
from tests.training.losses import expected_loss

SEED = 5
CANVAS = 30  # LLaDA pads to the training set's longest response: longer than every eval response here
EXAMPLES = [  # five responses of different lengths: batches are padded, and 5 is not a multiple of 2 or 3
    Example((10, 11, 12), (20, 21, 22, 23, 24, 25, 26, 27, 28, EOS_ID)),
    Example((10, 11), (30, 31, 32, 33, 34, EOS_ID)),
    Example((13,), (40, EOS_ID)),
    Example((10, 11, 12, 13), tuple(range(20, 44)) + (EOS_ID,)),
    Example((12,), (21, 22, 23, EOS_ID)),
]
collate_fn = partial(collate, pad_id=PAD_ID)


@pytest.fixture
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def held_out(name: str) -> tuple[torch.nn.Module, HeldOutDataset]:
    objective = OBJECTIVES[name]
    model = tiny_qwen3(seed=4, causal=not objective.bidirectional, init_std=0.2)
    return model, HeldOutDataset(EXAMPLES, objective, MASK_ID, SEED, response_length=CANVAS)


@pytest.mark.parametrize("name", ["refusion", "llada", "ar"])
def test_validation_loss_is_the_objective_on_samples_drawn_per_eval_example(name, accelerator):
    model, dataset = held_out(name)
    objective = dataset.objective
    record = evaluate(accelerator, model, dataset, 2, collate_fn, step=7)
    samples = []  # by hand: example i's sample from its own (seed, "eval", i) generator, LLaDA on the training canvas
    for index, example in enumerate(EXAMPLES):
        if objective.eos_padding:
            example = pad_with_eos(example, CANVAS)
        generator = torch.Generator().manual_seed(derived_seed(SEED, "eval", index))
        samples.append((objective.build(example, MASK_ID, generator), len(example.response_ids)))
    loss, ar, mdm = expected_loss(model, samples, objective.bidirectional)
    # float64 model; the hand CE (log-sum-exp written out) and F.cross_entropy differ by rounding only
    assert record.loss == pytest.approx(loss, rel=1e-12)
    assert record.ar_loss == pytest.approx(ar, rel=1e-12) and record.mdm_loss == pytest.approx(mdm, rel=1e-12)
    assert (name == "ar") == (record.mdm_loss == 0) and (name == "llada") == (record.ar_loss == 0)
    assert record.step == 7 and record.examples == 5
    assert record.tokens == sum(sample.input_ids.numel() for sample, _ in samples)


def test_an_unchanged_model_scores_the_same_whatever_the_batch_size_in_eval_mode_without_gradients(accelerator):
    model, dataset = held_out("refusion")
    model.train()
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append((module.training, torch.is_grad_enabled())))
    rng_before = torch.get_rng_state()
    first = evaluate(accelerator, model, dataset, 3, collate_fn, step=1)
    again = evaluate(accelerator, model, dataset, 3, collate_fn, step=500)  # the draws do not depend on the step
    assert (again.loss, again.ar_loss, again.mdm_loss) == (first.loss, first.ar_loss, first.mdm_loss)  # exactly
    assert seen == [(False, False)] * 4  # 2 batches of 3 per evaluation, in eval mode, no autograd
    assert model.training  # the training mode is back
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global generator was not drawn from
    # Batch size moves an example's own loss by float64 rounding at most (its rows are padded to other widths;
    # the tiny model computes the same real-token logits to 1e-12, test_objectives' padding test); the sum
    # over examples is math.fsum, exact in any order.
    for batch_size in (1, 2, 5, 8):
        other = evaluate(accelerator, model, dataset, batch_size, collate_fn, step=2)
        assert other.loss == pytest.approx(first.loss, rel=1e-12, abs=0)
        assert other.ar_loss == pytest.approx(first.ar_loss, rel=1e-12, abs=0)
        assert other.mdm_loss == pytest.approx(first.mdm_loss, rel=1e-12, abs=0)
        assert other.tokens == first.tokens and other.examples == first.examples


def test_eval_samples_depend_on_seed_and_index_only():
    dataset = HeldOutDataset(EXAMPLES, OBJECTIVES["refusion"], MASK_ID, SEED)
    again = HeldOutDataset(EXAMPLES, OBJECTIVES["refusion"], MASK_ID, SEED)
    assert all(torch.equal(dataset[i].input_ids, again[i].input_ids) for i in range(len(EXAMPLES)))
    other_seed = HeldOutDataset(EXAMPLES, OBJECTIVES["refusion"], MASK_ID, SEED + 1)
    assert any(not torch.equal(dataset[i].input_ids, other_seed[i].input_ids) for i in range(len(EXAMPLES)))


def test_every_process_runs_the_same_forward_passes_even_with_nothing_left_to_score():
    assert [share(7, 2, rank) for rank in range(2)] == [range(0, 4), range(4, 7)]
    assert [share(2, 3, rank) for rank in range(3)] == [range(0, 1), range(1, 2), range(2, 2)]
    model, dataset = held_out("llada")
    forwards = []
    model.register_forward_hook(lambda module, args, out: forwards.append(1))
    empty = score_examples(model, dataset, range(2, 2), 2, 3, collate_fn, torch.device("cpu"), torch.float64)
    assert len(forwards) == 2 and empty.shape == (6, 4) and not empty.any()  # spare passes, nothing kept
    rows = score_examples(model, dataset, range(3, 5), 2, 1, collate_fn, torch.device("cpu"), torch.float64)
    assert rows[:, 3].tolist() == [1.0, 1.0] and rows[:, 2].tolist() == [4 + CANVAS, 1 + CANVAS]
