"""One ``--model`` value resolved once into one record: its kind, where its files are, and the fingerprint that
keys ``refusion eval``'s journal (the same string as before for embedded models, folders and adapter folders, so
earlier journals resume; a hub id's commit, so a new revision of the same id is noticed)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from refusion_cli.errors import UserError
from refusion_cli.models.checkpoint import ASSETS, Kind, resolve_checkpoint
from refusion_cli.models.loading import load_model
from refusion_cli.paths import folder_fingerprint

REFUSION_TINY = ASSETS / "refusion-tiny"


def old_model_fingerprint(folder: Path) -> str:
    """What ``harness.runner.model_fingerprint`` computed for an embedded model or a local folder before the record."""
    return folder_fingerprint(folder, "config.json",
                              sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")))


@pytest.mark.skipif(not (REFUSION_TINY / "config.json").is_file(), reason="the embedded refusion-tiny is not built")
def test_an_embedded_model_keeps_the_fingerprint_earlier_journals_were_keyed_by():
    checkpoint = resolve_checkpoint("refusion-tiny")
    assert (checkpoint.kind, checkpoint.label, checkpoint.revision) == (Kind.EMBEDDED, "refusion-tiny", None)
    assert checkpoint.fingerprint == old_model_fingerprint(REFUSION_TINY)


def test_a_local_folder_keeps_its_fingerprint_and_an_adapter_folder_its_own(causal_checkpoint, tmp_path):
    from tools.standins import build_standin

    checkpoint = resolve_checkpoint(str(causal_checkpoint))
    assert checkpoint.kind is Kind.FOLDER and checkpoint.fingerprint == old_model_fingerprint(causal_checkpoint)
    base = build_standin("llada-8b-instruct", tmp_path / "llada")
    adapter = build_standin("d2f-llada-lora", tmp_path / "lora", base=base)
    with_adapter = resolve_checkpoint(f"{base}+{adapter}")
    old_adapter = folder_fingerprint(adapter, "adapter_config.json",
                                     [adapter / "adapter_model.safetensors", adapter / "adapter_model.bin"])
    assert with_adapter.fingerprint == f"{old_model_fingerprint(base)}+{old_adapter}"
    assert with_adapter.adapter.folder == adapter and with_adapter.label == "lora"  # the adapter names the row


def fake_hub_snapshot(cache: Path, repo: str, commit: str, files: Path) -> Path:
    """The layout huggingface_hub's cache gives a downloaded repository: ``refs/main`` naming ``commit``, and
    the files under ``snapshots/<commit>/``."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return Path(shutil.copytree(files, storage / "snapshots" / commit))


def test_a_hub_id_is_pinned_to_its_commit_and_a_new_revision_is_a_new_fingerprint(causal_checkpoint, tmp_path,
                                                                                 monkeypatch):
    """Offline, from the local cache: the id resolves to the commit refs/main names, every file loads at it, and
    the fingerprint carries it, so a newer revision of the same id does not reuse the older one's samples."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo, first, second = "refusion-tests/tiny", "a" * 40, "b" * 40
    fake_hub_snapshot(tmp_path / "hub", repo, first, causal_checkpoint)
    checkpoint = resolve_checkpoint(repo)
    assert (checkpoint.kind, checkpoint.source, checkpoint.revision) == (Kind.HUB, repo, first)
    assert checkpoint.fingerprint == f"{repo}@{first}" and checkpoint.label == "tiny"
    loaded = load_model(checkpoint, "cpu", torch.float32)
    assert loaded.source == repo and loaded.family == "qwen3"

    snapshot = fake_hub_snapshot(tmp_path / "hub", repo, second, causal_checkpoint)  # the same id, a new commit
    assert resolve_checkpoint(repo).fingerprint == f"{repo}@{second}"
    shutil.rmtree(snapshot)
    with pytest.raises(UserError, match=f"'{repo}' is not a local directory, the model hub is unreachable, and it is "
                                        "not in the local cache"):
        resolve_checkpoint(repo)  # refs/main names a commit the cache does not hold
    with pytest.raises(UserError, match="not in the local cache"):
        resolve_checkpoint("refusion-tests/never-downloaded")  # no commit known offline: refused, never keyed by id


def test_the_record_is_made_once_and_read_by_the_fit_check_and_the_loader(causal_checkpoint, monkeypatch):
    """Given the record, neither the fit check nor the loader resolves the value again."""
    from refusion_cli.models import checkpoint as module, loading

    checkpoint = resolve_checkpoint(str(causal_checkpoint))

    def resolve_again(*args, **kwargs):
        raise AssertionError("resolved again")

    monkeypatch.setattr(loading, "resolve_checkpoint", resolve_again)
    monkeypatch.setattr(module, "resolve_checkpoint", resolve_again)
    loading.check_model_fits("ar", checkpoint)
    with pytest.raises(UserError, match="needs a bidirectional"):
        loading.check_model_fits("llada", checkpoint)
    assert load_model(checkpoint, "cpu", require_mask=False).source == str(causal_checkpoint)
