"""The model card's raw records: `make models` copies each run's step log and trainer state next to the card."""

import gzip
import json

from tools.build_models import keep_records


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
