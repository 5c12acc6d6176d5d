"""The validation loss on held-out data (``refusion train --eval-data``).

Contract:
- the same objective as training: each eval example becomes the objective's sample and is scored
  with the training loss function (:func:`example_losses`), giving the same components (loss,
  ar_loss, mdm_loss); in eval mode and without gradients;
- comparable from one evaluation to the next: the random choices for eval example ``i`` come from a
  generator seeded by (seed, "eval", i) (:class:`HeldOutDataset`), so an unchanged model gets the
  same validation loss at every evaluation. No global RNG is drawn from and no DataLoader iterator
  is made, so the training's data order and random streams are untouched;
- averaged per example: the validation loss is the sum over the eval examples of each example's
  loss (ar part + mdm part, as in training), divided by the number of examples. The sum is taken
  with ``math.fsum`` over float64 values, exact whatever the order, so the batch size and the number
  of processes only decide which examples share a forward pass (which moves an example's own loss
  by float rounding at most: the model computes over padded rows of other widths);
- every process takes part: process r scores the r-th contiguous share of ceil(N / P) examples,
  and every process runs the same number of forward passes (a sharded model's forward is a
  collective); the per-example values are then gathered to every process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from refusion_cli.decoding.stats import wide_float
from refusion_cli.training.data import HeldOutDataset
from refusion_cli.training.objectives import Sample, example_losses

VALID = 3  # the column of a score row that marks a real example (1) against a spare one (0)


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation, as written to eval_log.jsonl."""

    step: int  # optimizer steps done when the model was scored (0: before training)
    loss: float  # mean over the eval examples of (ar part + mdm part)
    ar_loss: float
    mdm_loss: float
    examples: int  # eval examples scored (all of them)
    tokens: int  # real (unpadded) tokens of their samples
    seconds: float  # wall time of the evaluation


def share(count: int, processes: int, rank: int) -> range:
    """The eval indices process ``rank`` scores: contiguous shares of ceil(count / processes), the last ones shorter."""
    size = -(-count // processes)
    return range(min(rank * size, count), min((rank + 1) * size, count))


@torch.no_grad()
def score_examples(model: torch.nn.Module, dataset: HeldOutDataset, indices: Sequence[int], passes: int,
                   batch_size: int, collate_fn: Callable[[list[Sample]], dict[str, torch.Tensor]],
                   device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[passes × batch_size, 4] rows: ar part, mdm part, real tokens, 1 for each example of ``indices``; zeros after.

    Runs exactly ``passes`` forward passes: once ``indices`` run out, example 0 is scored again and dropped.
    """
    rows = torch.zeros(passes * batch_size, 4, dtype=dtype, device=device)
    for number in range(passes):
        chosen = list(indices[number * batch_size:(number + 1) * batch_size])
        batch = collate_fn([dataset[index] for index in chosen or [0]])
        batch = {name: value.to(device) for name, value in batch.items()}
        ar, mdm = example_losses(model, batch, dataset.objective)  # [B], [B]
        kept = len(chosen)
        parts = (ar[:kept], mdm[:kept], batch["lengths"][:kept], torch.ones(kept, device=device))
        start = number * batch_size
        rows[start:start + kept] = torch.stack([part.to(dtype) for part in parts], dim=1)
    return rows


def evaluate(accelerator, model: torch.nn.Module, dataset: HeldOutDataset, batch_size: int,
             collate_fn: Callable[[list[Sample]], dict[str, torch.Tensor]], step: int) -> EvalRecord:
    """Score the whole eval set on every process (a collective); see the module docstring for the rules."""
    started = time.perf_counter()
    count, processes = len(dataset), accelerator.num_processes
    passes = -(-len(share(count, processes, 0)) // batch_size)  # the first share is the longest
    dtype = wide_float(accelerator.device)
    was_training = model.training
    model.eval()
    try:
        rows = score_examples(model, dataset, share(count, processes, accelerator.process_index), passes, batch_size,
                              collate_fn, accelerator.device, dtype)
    finally:
        model.train(was_training)
    gathered = accelerator.gather(rows).cpu()  # [processes × passes × batch_size, 4]
    scored = gathered[gathered[:, VALID] > 0].tolist()
    if len(scored) != count:
        raise RuntimeError(f"the evaluation scored {len(scored)} examples of {count}")
    return EvalRecord(step=step, loss=math.fsum(ar + mdm for ar, mdm, _, _ in scored) / count,
                      ar_loss=math.fsum(row[0] for row in scored) / count,
                      mdm_loss=math.fsum(row[1] for row in scored) / count, examples=count,
                      tokens=int(sum(row[2] for row in scored)), seconds=time.perf_counter() - started)
