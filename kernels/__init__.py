"""Masked per-token log-probs (Triton + PyTorch reference, kernels/logprobs.py); shared-prefix decoding
(kernels/attention.py, used by rollout.ModelAgent)."""
from .logprobs import (logprobs_torch, masked_logprobs, masked_logprobs_chunked,  # noqa: F401
                              sequence_logprobs, backward_with_shared_prefix)
