"""Masked per-token log-probs: Triton kernels with a PyTorch reference. See kernels/logprobs.py."""
from .logprobs import (logprobs_torch, masked_logprobs, masked_logprobs_chunked,  # noqa: F401
                              sequence_logprobs)
