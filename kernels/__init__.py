"""kernels/: per-token log-probs of the chosen tokens, a Triton kernel beside its PyTorch reference, and the
chunked lm_head path that never builds the (N, V) logits (logprobs.py; scripts/gpu_check.py's kernel part times them
against peers); the training passes of sft.py and rl.py around it (passes.py: micro-batches, pi_ref, the fast
log-prob pass); harness.py, the benchmarks' clock. Imports nothing of ours outside kernels/."""
import logging
import os

from .logprobs import logprobs_torch, masked_logprobs, masked_logprobs_chunked  # noqa: F401


# What follows is not a kernel: bitsandbytes, imported by peft or transformers, probes the hub's `kernels` package,
# finds this one, and logs a false error; this filter drops exactly that record.
class _NotTheHubKernels(logging.Filter):
    """bitsandbytes (CPU with AVX512-BF16) probes the Hugging Face `kernels` package with
    `from kernels import get_kernel`, finds this package of the same name, and logs "Failed to load CPU
    gemm_4bit_forward from kernels-community: cannot import name 'get_kernel' from 'kernels' (<here>)".
    It then falls back to its own CPU path, so the line is a false alarm: drop exactly that record
    (an ImportError raised from this package) and let every other bitsandbytes message through."""

    def filter(self, record):
        exc = record.args[0] if isinstance(record.args, tuple) and record.args else None
        ours = isinstance(exc, ImportError) and os.path.dirname(exc.path or "") == os.path.dirname(__file__)
        return not (ours and str(record.msg).startswith("Failed to load CPU gemm_4bit_forward"))


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NotTheHubKernels())
