"""The speed benchmarks' shared harness (sampler/bench.py, scripts/bench_*.py, scripts/gpu_check.py):
which machine the numbers came from, a timed call, and the peak memory of some work. A speed claim is a ratio against
a baseline measured in the same run, never a timed test. The harness lives in kernels/, which imports nothing of ours
and which everything may import, so each benchmark reaches it without a path hack or an import against the layers
(tests/test_layout.py)."""
import resource
import time

import torch


def machine() -> str:
    """Where the numbers came from: the GPU's name, or the CPU's torch threads and whether it has native bf16."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return f"cpu, {torch.get_num_threads()} threads, native bf16: {bf16}"


def sync():
    """Wait for the work queued on the GPU, so that a clock read next counts it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, warmup: int = 0, repeat: int = 1):
    """-> (mean seconds of `repeat` calls of fn(), the last call's result), after `warmup` untimed calls (a first
    call pays for allocations, caches and compilation)."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    sync()
    return (time.perf_counter() - t0) / repeat, out


class PeakMemory:
    """`with PeakMemory() as mem: work()`, then mem.peak: the most memory held during the block, in bytes. On CUDA,
    the allocator's peak since entry, and mem.base what was allocated at entry. On a CPU, the process's peak RSS so
    far (Linux cannot reset it, so a benchmark runs its lowest-memory case first); mem.base is None there."""

    def __init__(self, cuda: bool | None = None):
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.base = None

    def __enter__(self):
        if self.cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        sync()
        self.peak = torch.cuda.max_memory_allocated() if self.cuda else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024        # KiB on Linux
