"""The training loss written out by hand, for the objective and validation-loss tests to compare against."""

from __future__ import annotations

import torch

from refusion_cli.training.objectives import IGNORE_INDEX, LossKind, attention_allowed, collate, model_attention_mask
from tests.tiny import PAD_ID


def row_logits(model, sample, bidirectional: bool) -> torch.Tensor:
    """Logits of one unpadded sample, computed alone."""
    batch = collate([sample], pad_id=PAD_ID)
    allowed = attention_allowed(batch["lengths"], batch["input_ids"].shape[1], bidirectional)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                attention_mask=model_attention_mask(model, allowed))
    return out.logits[0]


def manual_ce(logits: torch.Tensor, target: int) -> float:
    """-log softmax(logits)[target], written out."""
    shifted = logits - logits.max()
    return float(torch.log(torch.exp(shifted).sum()) - shifted[target])


def expected_loss(model, samples, bidirectional: bool) -> tuple[float, float, float]:
    """Per example: mean CE over AR labels + Σ CE / p / response length over masks; then mean over examples."""
    ar_parts, mdm_parts = [], []
    for sample, response_length in samples:
        logits = row_logits(model, sample, bidirectional)
        ar_terms, mdm_sum = [], 0.0
        for i, label in enumerate(sample.labels.tolist()):
            if label == IGNORE_INDEX:
                continue
            ce = manual_ce(logits[i], label)
            if sample.loss_kinds[i] == LossKind.AR:
                ar_terms.append(ce)
            else:
                mdm_sum += ce / sample.mask_prob
        ar_parts.append(sum(ar_terms) / len(ar_terms) if ar_terms else 0.0)
        mdm_parts.append(mdm_sum / response_length)
    n = len(samples)
    return (sum(ar_parts) + sum(mdm_parts)) / n, sum(ar_parts) / n, sum(mdm_parts) / n
