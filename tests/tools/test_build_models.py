"""The model card's raw records: `make models` copies each run's step log and trainer state next to the card."""

import gzip
import json

from tools.build_models import DREAM_STAGES, card_row, keep_records, parse_args


def test_a_runs_records_are_kept_whole_and_byte_stable(tmp_path):
    run = tmp_path / "work" / "ar-tiny"
    run.mkdir(parents=True)
    log = "".join(json.dumps({"step": i, "loss": 1.0 / i, "tokens": 40 + i, "seconds": 0.25}) + "\n" for i in range(1, 6))
    (run / "loss_log.jsonl").write_text(log)
    (run / "trainer_state.json").write_text('{"step": 5}')
    first, second = tmp_path / "a" / "ar-tiny", tmp_path / "b" / "ar-tiny"
    keep_records(run, first)
    keep_records(run, second)
    packed = (first / "loss_log.jsonl.gz").read_bytes()
    assert gzip.decompress(packed).decode() == log
    assert packed == (second / "loss_log.jsonl.gz").read_bytes()  # no time or file name in the gzip header
    assert (first / "trainer_state.json").read_text() == '{"step": 5}'


def test_a_runs_row_of_the_card_is_computed_from_its_records(tmp_path):
    run = tmp_path / "dream-tiny-2"
    run.mkdir()
    log = [{"step": i, "loss": 0.5 if i < 3 else 0.25, "tokens": 1000, "seconds": 30.0} for i in range(1, 23)]
    (run / "loss_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (run / "trainer_state.json").write_text(json.dumps({"run": {"batch_size": 128}}))
    (run / "model.safetensors").write_bytes(b"0" * 2_500_000)
    # 22 steps of 1,000 tokens and 30 s; the last 20 steps' mean loss is 0.25
    assert card_row(run, "dream") == "| dream-tiny-2 | dream | 22 | 128 | 22,000 | cpu (not recorded) | 11.0 | 0.2500 | 2.5 |"


def test_dream_tiny_is_built_with_its_recorded_chain_of_schedules_unless_given_one(tmp_path):
    args = parse_args(["--work", str(tmp_path / "work")])
    assert args.dream_stage == list(DREAM_STAGES) == [(1000, 64, 1e-3, 0.05), (800, 128, 5e-4, 0.02),
                                                       (2000, 128, 3e-4, 0.01)]
    chain = parse_args(["--work", str(tmp_path / "work"), "--dream-stage", "5", "8", "0.01", "0"])
    assert chain.dream_stage == [(5, 8, 0.01, 0.0)]
