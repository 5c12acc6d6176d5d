import atexit
import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on two cores: one thread each, and
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the commands they start
# caches (datasets' Arrow files of the eval tests' data, matplotlib's font list) in a temporary
# folder, not in the user's home: subprocesses inherit these
_CACHES = tempfile.mkdtemp(prefix="refusion-tests-")
atexit.register(shutil.rmtree, _CACHES, ignore_errors=True)
os.environ["HF_HOME"] = os.path.join(_CACHES, "huggingface")
os.environ["MPLCONFIGDIR"] = os.path.join(_CACHES, "matplotlib")

import pytest


DURATIONS = Path(__file__).with_name("durations.json")  # seconds per file of a full run: tools/test_durations.py
UNKNOWN_SECONDS_PER_TEST = 0.5  # a file the last full run did not have


def pytest_collection_modifyitems(session, config, items):
    """Under xdist the files go to the workers longest first (``make test`` passes ``--no-loadscope-reorder``,
    so pytest-xdist keeps this order instead of its own, most tests first): a long file left for the end would
    keep one worker busy while the other idles. Each file's tests keep their order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    known = json.loads(DURATIONS.read_text(encoding="utf-8")) if DURATIONS.is_file() else {}
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def seconds(path: str) -> float:
        return known.get(path, UNKNOWN_SECONDS_PER_TEST * len(files[path]))

    items[:] = [item for path in sorted(files, key=lambda path: -seconds(path)) for item in files[path]]


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """No garbage collection while the test modules import torch, transformers and lm-eval: each full collection
    would scan their growing heap (3 of a worker's 15 s of collection). Their objects live as long as the process,
    so afterwards the collector stops scanning them (a full collection, which the eval and bench runners ask for
    after each model, took 0.2-0.3 s of a worker's heap). Under xdist the controller collects nothing."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


@pytest.fixture(scope="session", autouse=True)
def standins_cache(tmp_path_factory):
    """``tools.standins`` converts Qwen's BPE ranks once per run, into a folder the xdist workers share."""
    from tests.envs import shared_folder
    from tools.standins import CACHE_ENV

    folder = shared_folder(tmp_path_factory) / "standins-cache"
    folder.mkdir(exist_ok=True)
    os.environ[CACHE_ENV] = str(folder)


@pytest.fixture(scope="session")
def causal_checkpoint(tmp_path_factory):
    """A random tiny causal Qwen3 checkpoint directory with the synthetic task's tokenizer."""
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("causal-ckpt"), causal=True)


@pytest.fixture(scope="session")
def bidirectional_checkpoint(tmp_path_factory):
    """The same, with bidirectional attention (config.is_causal = False), for the MDM decoders."""
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("mdm-ckpt"), causal=False, seed=1)
