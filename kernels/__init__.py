"""Masked per-token log-probs (Triton + PyTorch reference) and training passes that run a shared prefix
once (kernels/logprobs.py, used by sft.py and rl.py); shared-prefix decoding (kernels/attention.py,
used by rollout.ModelAgent)."""
from .logprobs import (backward_with_shared_prefix, logprobs_torch, logprobs_with_shared_prefix,  # noqa: F401
                       masked_logprobs, masked_logprobs_chunked, sequence_logprobs, shared_prefix_len)
