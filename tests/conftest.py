import atexit
import gc
import os
import shutil
import tempfile

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


def pytest_collection_finish(session):
    """The test modules are imported, and torch, transformers and lm-eval behind them: their objects live as long
    as the process, so the garbage collector stops scanning them (a full collection, which the eval and bench
    runners ask for after each model, took 0.2-0.3 s of a worker's heap)."""
    gc.freeze()


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
