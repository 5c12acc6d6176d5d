"""`refusion bench --batch-size`: a batched row decodes every prompt as batch 1 does, and reports throughput."""

from __future__ import annotations

import pytest

from refusion_cli.bench.prompts import load_prompts
from refusion_cli.bench.runner import BenchSettings, plan_entries, run_bench
from refusion_cli.errors import UserError


def test_batch_sizes_add_rows_after_each_batch_1_row():
    settings = BenchSettings(decoders=("refusion", "ar"), gen_lengths=(32,), batch_sizes=(1, 4, 4, 2), device="cpu",
                             ablation=True)
    assert [(e.label, e.batch_size) for e in plan_entries(settings)] == [
        ("ar", 1), ("ar (batch 4)", 4), ("ar (batch 2)", 2),
        ("refusion", 1), ("refusion (batch 4)", 4), ("refusion (batch 2)", 2), ("refusion (recompute)", 1)]
    with pytest.raises(UserError, match="--batch-size must be a positive integer or auto, got 0"):
        BenchSettings(batch_sizes=(0,), device="cpu")


def test_a_batched_row_has_the_tokens_of_batch_1_and_its_throughput_is_tokens_over_wall_time():
    settings = BenchSettings(decoders=("refusion", "ar"), gen_lengths=(24,), batch_sizes=(1, 3), ablation=False,
                             warmup=0, device="cpu", overrides={"refusion": {"slot_size": "4", "block_size": "8"}})
    samples = []
    rows = {row.decoder: row for row in run_bench(settings, load_prompts(None, 5), on_sample=samples.append)}
    assert set(rows) == {"ar", "ar (batch 3)", "refusion", "refusion (batch 3)"}
    for decoder in ("ar", "refusion"):
        alone = [s for s in samples if s.decoder == decoder]
        batched = [s for s in samples if s.decoder == f"{decoder} (batch 3)"]
        assert [(s.prompt, s.output, s.tokens, s.forwards) for s in alone] == [
            (s.prompt, s.output, s.tokens, s.forwards) for s in batched]
        one, three = rows[decoder], rows[f"{decoder} (batch 3)"]
        assert (one.batch_size, three.batch_size, one.accuracy, one.tpf) == (1, 3, three.accuracy, three.tpf)
        assert one.throughput == one.tps  # batch 1: the paper's TPS
        total = sum(s.tokens for s in batched)
        # throughput: tokens over the run's wall time, which lasts at least the longest row's latency (a row's
        # seconds run from its admission) and at most all rows' latencies end to end
        assert total / sum(s.seconds for s in batched) < three.throughput <= total / max(s.seconds for s in batched)
        assert three.tps == pytest.approx(total / sum(s.seconds for s in batched))  # per request: own latencies
        assert three.mem_per_row_mib == three.peak_mem_mib / 3
        assert three.speedup_vs_ar is None
