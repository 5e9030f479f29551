"""Shared test setup.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is
set here, before any test module imports kernels/. On a machine with CUDA the kernel
tests run the real compiled kernel instead.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end checks that take minutes; run with -m slow")
