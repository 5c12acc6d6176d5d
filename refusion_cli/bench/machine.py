"""What the benchmark ran on, and how much memory a run of decodes took at its peak.

``describe_machine`` names the processor (CPU model, GPU name), torch version, threads and dtype,
for the report header. ``PeakMemory`` measures the most memory in use during a ``with`` block
above the level at its start (the decode's working memory: KV caches, activations, logits; the
weights were loaded before):

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (tensors only, the
  caching allocator's reserve is not counted);
- CPU on Linux: the resident set's high-water mark (``VmHWM`` of ``/proc/self/status``), reset at
  the start of the block by writing ``5`` to ``/proc/self/clear_refs``;
- CPU elsewhere: the growth of the process's lifetime peak RSS (``resource.ru_maxrss``), which
  reads 0 when an earlier peak was higher (a lower bound).

Every result names the method it used (``PeakMemory.method``).
"""

from __future__ import annotations

import gc
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from refusion_cli.decoding.stats import synchronize
from refusion_cli.models.devices import default_dtype, parse_device, parse_dtype

PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Machine:
    device: str  # "cpu", "cuda:0", ...
    processor: str  # the GPU's name on CUDA, else the CPU model
    cpu: str  # the CPU model
    torch: str  # torch version
    threads: int  # torch intra-op threads
    dtype: str  # the models' dtype
    memory_method: str  # how peak memory was measured

    def as_dict(self) -> dict[str, str | int]:
        return asdict(self)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_machine(device: torch.device, dtype: torch.dtype) -> Machine:
    cpu = cpu_model()
    processor = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    return Machine(str(device), processor, cpu, torch.__version__, torch.get_num_threads(),
                   str(dtype).removeprefix("torch."), memory_method(device))


CUDA_METHOD = "CUDA max_memory_allocated above the memory allocated before"
HWM_METHOD = "peak resident set size (VmHWM, reset per row) above the RSS before"
MAXRSS_METHOD = "growth of the process's peak RSS (ru_maxrss; a lower bound)"


def memory_method(device: torch.device) -> str:
    """The method :class:`PeakMemory` uses on ``device`` (probes the VmHWM reset on CPU)."""
    if device.type == "cuda":
        return CUDA_METHOD
    return HWM_METHOD if _reset_rss_peak() else MAXRSS_METHOD


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.delta_mib`` (and ``peak.method``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = ""
        self.start_bytes = 0
        self.peak_bytes = 0

    @property
    def delta_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)

    @property
    def delta_mib(self) -> float:
        return self.delta_bytes / MIB

    def __enter__(self) -> PeakMemory:
        # garbage left by earlier work is freed now: freed inside the block (an automatic collection), it would
        # lower the memory below the start and hide what the block allocates
        gc.collect()
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method, self.start_bytes = CUDA_METHOD, torch.cuda.memory_allocated(self.device)
        elif _reset_rss_peak():
            self.method, self.start_bytes = HWM_METHOD, _status_bytes("VmRSS")
        else:
            self.method, self.start_bytes = MAXRSS_METHOD, _max_rss_bytes()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.method == CUDA_METHOD:
            synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        elif self.method == HWM_METHOD:
            self.peak_bytes = _status_bytes("VmHWM")
        else:
            self.peak_bytes = _max_rss_bytes()


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status, in bytes."""
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_rss_peak() -> bool:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0); False where that is impossible."""
    if not (PROC_STATUS.is_file() and PROC_CLEAR_REFS.exists()):
        return False
    try:
        PROC_CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _max_rss_bytes() -> int:
    import resource  # POSIX only

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


def bench_machine(device: str | None, dtype: str | None) -> Machine:
    """The machine a benchmark runs on (``--device``, ``--dtype``), described before any model loads."""
    where = parse_device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())  # where load_model's model.to("cuda") puts it
    return describe_machine(where, parse_dtype(dtype) if dtype is not None else default_dtype(where))
