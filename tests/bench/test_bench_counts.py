"""What decodes cost besides the model (``refusion_cli.bench.counts``), on the embedded tiny models: the counts of
an AR decode are numbers known in advance, a batch's rows attend one call each per layer unless packed, eager
attention is named rather than counted as 0, and ``refusion bench --counts`` writes the columns."""

from __future__ import annotations

import torch
import pytest

from refusion_cli.bench.counts import CostMode, DecodeCounts, counting
from refusion_cli.bench.figures import BenchRow
from refusion_cli.bench.prompts import synthetic_prompts
from refusion_cli.bench.report import is_counted
from refusion_cli.decoding.engine import Engine, run_decoder
from refusion_cli.decoding.spec import default_config
from refusion_cli.models.chat import user_prompt_ids
from refusion_cli.models.loading import load_model
from tests.bench.helpers import read_csv, run_bench_cli

GEN_LENGTH = 8


@pytest.fixture(scope="module")
def ar_tiny():
    loaded = load_model("ar-tiny", device="cpu", require_mask=False)
    prompts = [user_prompt_ids(loaded.tokenizer, prompt.text) for prompt in synthetic_prompts(2)]
    return loaded, prompts


def decode_ar(loaded, prompts, engine: Engine):
    return run_decoder("ar", loaded.model, prompts, default_config("ar", "ar-tiny", GEN_LENGTH), mask_token_id=None,
                       eos_token_id=loaded.stop_token_ids, engine=engine)


def test_an_ar_decode_alone_takes_a_step_a_call_and_a_position_per_token(ar_tiny):
    loaded, prompts = ar_tiny
    layers = loaded.model.config.num_hidden_layers
    engine = Engine(loaded.model, max_rows=1)
    with counting(loaded.model) as counts:
        [result] = decode_ar(loaded, prompts[:1], engine)
    tokens, prompt = result.stats.tokens, len(prompts[0])
    # the prompt rides in the first call, which yields the first token; every later token is fed once
    assert (counts.engine_steps, counts.model_calls, counts.positions) == (tokens, tokens, prompt + tokens - 1)
    assert counts.sdpa_calls == layers * tokens and counts.attention_per_layer() == 1.0
    assert counts.per_token(tokens)[0] == (prompt + tokens - 1) / tokens
    [runner] = engine.calls.values()  # the causal runner's own count of the K/V it moved agrees
    assert counts.kv_copied == runner.counts.kv_bytes_copied


@pytest.mark.parametrize("packed", [False, True], ids=["row-by-row", "packed"])
def test_rows_of_a_batch_attend_a_call_each_per_layer_unless_packed(ar_tiny, packed):
    loaded, prompts = ar_tiny
    layers = loaded.model.config.num_hidden_layers
    with counting(loaded.model) as counts:
        results = decode_ar(loaded, prompts, Engine(loaded.model, max_rows=2, packed_attention=packed))
    tokens = [result.stats.tokens for result in results]
    assert counts.model_calls == counts.engine_steps == max(tokens)  # both rows start in the first step
    assert counts.positions == sum(len(prompt) + n - 1 for prompt, n in zip(prompts, tokens))  # packed: no padding
    attended = max(tokens) if packed else sum(tokens)  # a row is in as many calls as it has tokens
    assert counts.sdpa_calls == layers * attended
    assert counts.attention_per_layer() == attended / max(tokens)


def test_eager_attention_is_named_not_counted_as_none():
    loaded = load_model("mdm-tiny", device="cpu")
    loaded.model.set_attn_implementation("eager")
    prompt = user_prompt_ids(loaded.tokenizer, synthetic_prompts(1)[0].text)
    with counting(loaded.model) as counts:
        run_decoder("llada", loaded.model, prompt, default_config("llada", "mdm-tiny", GEN_LENGTH),
                    mask_token_id=loaded.mask_token_id, eos_token_id=loaded.stop_token_ids)
    assert counts.model_calls == GEN_LENGTH and counts.sdpa_calls == 0  # one token a step, eager's matmuls
    assert counts.attention_per_layer() is None and counts.attention_label() == "eager (not counted)"


def test_syncs_and_kv_writes_by_the_rule(ar_tiny):
    loaded, _ = ar_tiny
    with counting(loaded.model) as counts:
        flags = torch.tensor([True, False])
        torch.tensor([1]).item(), bool(flags[0]), torch.arange(2)[flags]  # three syncs; flags[0] is none
    assert counts.host_syncs == 3
    counts = DecodeCounts(layers=1, kv_bytes_per_position=0, attention="sdpa")
    half = torch.zeros(1, 2, 3, 4)  # [rows, kv heads, columns, half a head of 8]
    with CostMode(counts, kv_heads=2, head_dim=8):
        torch.cat([half, half], dim=-1)  # rotary's halves of a head: not a copy
        torch.cat([torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 1, 8)], dim=2)  # K/V grown a column: 4 written
    assert counts.kv_written == 2 * 4 * 8 * 4  # kv heads × columns × head dim × float32 bytes


def test_the_counters_leave_nothing_behind(ar_tiny):
    loaded, _ = ar_tiny
    step = Engine.step
    with counting(loaded.model) as counts:
        assert Engine.step is not step
    torch.tensor([1]).item()
    assert Engine.step is step and not loaded.model._forward_pre_hooks and counts.host_syncs == 0


def test_bench_counts_writes_its_columns(monkeypatch, capsys, tmp_path):
    code, out, err = run_bench_cli(["--decoder", "ar", "--limit", "2", "--gen-length", str(GEN_LENGTH),
                                    "--warmup", "0", "--counts", "--output", str(tmp_path)], monkeypatch, capsys)
    assert code == 0, err
    [row] = read_csv(tmp_path / "bench.csv")
    assert float(row["syncs_per_step"]) > 0 and row["attention_calls_per_layer"] == "1.0"
    assert float(row["ops_per_step"]) > 0  # at least the token's argmax and its readback
    assert row["attention_implementation"] == "sdpa"
    assert row["counted_positions_per_token"] == row["positions_per_token"]  # a causal row's calls: no padding
    assert "| syncs/step | ops/step | attn calls/layer | counted positions/token | counted K/V copied/token |" in \
        (tmp_path / "bench.md").read_text()
    assert "syncs/step" in out and "K/V copied/token" in out


def test_rows_without_counts_show_no_counts_columns():
    row = BenchRow("ar", "ar-tiny", 8, 1, 1, 1.0, 1.0, 1.0, 8.0, 8.0, 1.0, 1.0, 0.0, None, 0, "gen_length=8")
    assert not is_counted([row])


def test_engine_counts_loads_the_counter_from_this_tree_by_its_path():
    from tools.engine_counts import COUNTS_FILE, load_counts

    module = load_counts()
    assert module.__file__ == str(COUNTS_FILE) and module.counting is not counting
    assert issubclass(module.CostMode, torch.overrides.TorchFunctionMode)
