"""`python -m tools.tokenizer`: trains the tiny models' tokenizer from any record format `refusion train` reads, and
refuses a bad size, folder or file in one line before writing anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from refusion_cli.tasks.synthetic import generate_problems
from refusion_cli.tasks.tokenizer import EOS_TOKEN
from tools.tokenizer import main


def test_cli_trains_from_a_jsonl_file(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in generate_problems(200, seed=2)), encoding="utf-8")
    main(["--data", str(data), "--out", str(tmp_path / "tok"), "--vocab-size", "300"])
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert len(loaded) == 300
    assert loaded.eos_token == EOS_TOKEN


def test_cli_reads_every_training_record_format_and_names_a_bad_line(tmp_path: Path, capsys) -> None:
    rows = generate_problems(100, seed=3)
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"query": r["question"], "response": r["answer"]}) + "\n" for r in rows[:50])
                    + "".join(json.dumps({"prompt": r["question"], "completion": r["answer"]}) + "\n"
                              for r in rows[50:]), encoding="utf-8")
    main(["--data", str(data), "--out", str(tmp_path / "tok"), "--vocab-size", "300"])
    same = tmp_path / "same.jsonl"  # the same records as question / answer give the same tokenizer
    same.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    main(["--data", str(same), "--out", str(tmp_path / "tok2"), "--vocab-size", "300"])
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (tmp_path / "tok2" / "tokenizer.json").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "response": "r"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(bad), "--out", str(tmp_path / "tok3")])
    assert exit_info.value.code == 2 and not (tmp_path / "tok3").exists()
    assert capsys.readouterr().err.startswith(f"error: {bad}, line 2, has none of the record formats")


@pytest.mark.parametrize("args, message", [
    (["--vocab-size", "10"], "error: --vocab-size must be from 260 (the special tokens and 256 bytes) to 1,000,000, "
                             "got 10"),
    (["--vocab-size", "1000000000000"], "error: --vocab-size must be from 260"),  # the trainer aborted the process
    (["--out", ""], "error: --out is empty"),  # not the working directory
    (["--out", "FILE"], "error: --out FILE is a file, not a directory"),  # transformers logged it and exited 0
    (["--out", "FILE/tok"], "error: --out FILE/tok cannot be created: FILE is a file, not a directory"),
])
def test_cli_refuses_a_bad_size_or_folder_in_one_line(args, message, tmp_path: Path, capsys,
                                                      monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in generate_problems(5, seed=2)), encoding="utf-8")
    file = tmp_path / "a_file"
    file.write_text("keep")
    args = [arg.replace("FILE", str(file)) for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(data), "--out", str(tmp_path / "tok"), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(message.replace("FILE", str(file)))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_file", "train.jsonl"]  # nothing written
