"""--device parsing: a device this machine has, or one clear UserError."""

import pytest
import torch

from refusion_cli.errors import UserError
from refusion_cli.models.devices import parse_device
from tests.envs import cache_env


def test_cpu_and_default():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_misspelt_device_is_refused():
    with pytest.raises(UserError, match="unknown device 'foo'"):
        parse_device("foo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(UserError, match="no usable CUDA device"):
        parse_device("cuda:0")


def test_error_is_one_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "refusion_cli", "chat", "--device", "foo", "--prompt", "hi"],
                         capture_output=True, text=True, env={"COLUMNS": "40", "PATH": "/usr/bin:/bin", **cache_env()})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: unknown device 'foo' (hint: use cpu, cuda, cuda:N or mps)"]
    assert out.stdout == ""
