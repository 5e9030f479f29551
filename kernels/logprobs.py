"""Per-token log-probs of the chosen tokens, only where a mask is 1: Triton kernels + PyTorch reference.

What it computes. For logits (N, V), targets (N,) and mask (N,):

    out[i] = log softmax(logits[i] / T)[targets[i]]    where mask[i] == 1,   out[i] = 0 elsewhere

GRPO and SFT need exactly this for every token of a trajectory that the policy sampled
(loss_mask == 1). The logits are the biggest tensor of a training step (N tokens x V vocab,
V = 151,936 for Qwen3), so the kernel reads them once in the forward and once in the backward,
and never builds a softmax or log-softmax tensor of the same size.

How (Triton, one program per row):
  forward   online log-sum-exp over vocabulary blocks of BLOCK columns, fp32 accumulation
            whatever the input dtype; keeps the running max m and the running sum
            s = sum exp((x - m) / T); out = (x_target - m) / T - log s. Subtracting m before
            dividing by T keeps big logits (1e4) exact. Rows with mask 0 run zero loop
            iterations: nothing is read and the output is 0. Saves m and log s per row (8 bytes).
  backward  d out / d x_j = (onehot_j - softmax_j) / T, so grad_x = g * (onehot - p) / T with
            p = exp((x - m) / T - log s) recomputed block by block from the saved m and log s.
            Masked rows get exactly 0 (their upstream gradient is forced to 0 and no logits are read).
The PyTorch reference `logprobs_torch` (5 lines) is the specification; `impl=` picks one:
  "auto" -> Triton on CUDA tensors, the reference on CPU; "triton" -> the kernel (on CPU it needs
  TRITON_INTERPRET=1 set before this module is imported, as tests/conftest.py does); "torch".

Chunked path. `masked_logprobs_chunked(hidden, weight, ...)` takes hidden states (N, H) and the
lm_head weight (V, H) instead of logits. It keeps only the rows with mask 1, multiplies them by
the weight `chunk` rows at a time, and recomputes each chunk's logits in the backward, so at most
(chunk, V) logits (plus their gradient) exist at once and the full (N, V) logits never do.
kernels/passes.py's sequence_logprobs runs a causal LM body and then this path; sft.py and rl.py use it. The
training passes hand it only rows with mask 1, so in training the kernel's mask is all ones; the mask
is there for callers with logits of every position (scripts/gpu_check.py's kernel part, the tests).

Special values (tested):
  - a row whose logits are all -inf except the target: out = 0, gradient 0.
  - -inf at the target (finite elsewhere): out = -inf; the gradient of that row is finite
    (-g/T at the target, -g*p/T elsewhere), so nothing non-finite reaches other rows.
  - a row with every logit -inf is not a distribution: out = NaN for that row only, as
    torch.log_softmax gives. If that row is masked, it is 0 like any masked row.
  - targets of masked rows are ignored (e.g. -100 is fine). Targets of unmasked rows must be in [0, V).

Simplifications: no label smoothing, no logit soft-capping or lm_head bias (passes.sequence_logprobs
refuses such models with a clear error); one program per row (no split-V parallelism for tiny N).
"""
import os

import torch

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # the torch reference still works without triton (e.g. on macOS)
    HAVE_TRITON = False

# Triton reads this when a @triton.jit function is defined, i.e. when this module is imported.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_BLOCK = 4096  # vocabulary columns per loop iteration; 4096 bf16 = 8 KB per row per step


# ----------------------------------------------------------------------------------------------
# PyTorch reference: the specification the kernels are tested against.

def logprobs_torch(logits, targets, mask, temperature=1.0):
    """(N, V) logits -> (N,) log p(target) in fp32 (fp64 for fp64 input); 0 where mask is 0."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)).masked_fill(~mask[:, None], 0.0)
    x = (x - x.amax(dim=-1, keepdim=True).detach()) / temperature  # shift first: exact for big logits
    lp = x.gather(1, targets[:, None]).squeeze(1) - x.logsumexp(dim=-1)
    return lp.masked_fill(~mask, 0.0)


# ----------------------------------------------------------------------------------------------
# Triton kernels.

if HAVE_TRITON:

    @triton.jit
    def _logprobs_fwd_kernel(logits_ptr, stride_row, targets_ptr, mask_ptr, out_ptr, max_ptr, logz_ptr,
                             V, inv_temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2**31 at N*V > 2.1e9
        valid = tl.load(mask_ptr + row) != 0
        row_ptr = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK)
        run_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)  # scalar -inf, fp32
        run_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)                 # scalar 0, fp32
        end = tl.where(valid, V, 0)  # masked rows: zero iterations, nothing read
        for start in range(0, end, BLOCK):
            x = tl.load(row_ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, tl.max(x, axis=0))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: avoid inf - inf
            run_sum = run_sum * tl.exp((run_max - safe_max) * inv_temp) \
                + tl.sum(tl.exp((x - safe_max) * inv_temp), axis=0)
            run_max = new_max
        target = tl.load(targets_ptr + row)
        x_t = tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32)
        logz = tl.log(tl.where(valid, run_sum, 1.0))  # log sum exp((x - max) / T); masked rows: 0
        out = (x_t - run_max) * inv_temp - logz
        tl.store(out_ptr + row, tl.where(valid, out, 0.0))
        tl.store(max_ptr + row, tl.where(valid, run_max, 0.0))
        tl.store(logz_ptr + row, tl.where(valid, logz, 0.0))

    @triton.jit
    def _logprobs_bwd_kernel(logits_ptr, stride_row, grad_logits_ptr, grad_stride_row, targets_ptr, mask_ptr,
                             grad_out_ptr, max_ptr, logz_ptr, V, inv_temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        valid = tl.load(mask_ptr + row) != 0
        g = tl.where(valid, tl.load(grad_out_ptr + row).to(tl.float32) * inv_temp, 0.0)  # masked: exactly 0
        row_max = tl.load(max_ptr + row)
        logz = tl.load(logz_ptr + row)
        target = tl.load(targets_ptr + row)
        row_ptr = logits_ptr + row * stride_row
        grad_row_ptr = grad_logits_ptr + row * grad_stride_row
        cols = tl.arange(0, BLOCK)
        read_end = tl.where(valid, V, 0)  # masked rows read nothing: x = -inf -> p = 0, g = 0 -> grad 0
        for start in range(0, V, BLOCK):
            x = tl.load(row_ptr + start + cols, mask=start + cols < read_end, other=float("-inf")).to(tl.float32)
            p = tl.exp((x - row_max) * inv_temp - logz)  # softmax, recomputed; never stored
            onehot = tl.where(start + cols == target, 1.0, 0.0)
            grad = g * (onehot - p)
            tl.store(grad_row_ptr + start + cols, grad.to(grad_logits_ptr.dtype.element_ty), mask=start + cols < V)


def _launch_config(V):
    block = min(triton.next_power_of_2(V), MAX_BLOCK)
    return block, (8 if block >= 2048 else 4)


def _triton_forward(logits, targets, mask, temperature):
    """-> out (N,) fp32, row max (N,) fp32, log-normaliser (N,) fp32 (the last two for the backward)."""
    N, V = logits.shape
    out = torch.empty(N, dtype=torch.float32, device=logits.device)
    row_max, logz = torch.empty_like(out), torch.empty_like(out)
    if N == 0:
        return out, row_max, logz
    block, warps = _launch_config(V)
    _logprobs_fwd_kernel[(N,)](logits, logits.stride(0), targets, mask.view(torch.uint8), out, row_max, logz,
                               V, 1.0 / temperature, BLOCK=block, num_warps=warps)
    return out, row_max, logz


def _triton_backward(logits, targets, mask, row_max, logz, grad_out, temperature):
    """-> gradient w.r.t. logits, (N, V) in the logits dtype; rows with mask 0 are exactly 0."""
    N, V = logits.shape
    grad_logits = torch.empty((N, V), dtype=logits.dtype, device=logits.device)
    if N == 0:
        return grad_logits
    block, warps = _launch_config(V)
    _logprobs_bwd_kernel[(N,)](logits, logits.stride(0), grad_logits, grad_logits.stride(0), targets,
                               mask.view(torch.uint8), grad_out.contiguous(), row_max, logz,
                               V, 1.0 / temperature, BLOCK=block, num_warps=warps)
    return grad_logits


class _TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mask, temperature):
        out, row_max, logz = _triton_forward(logits, targets, mask, temperature)
        ctx.save_for_backward(logits, targets, mask, row_max, logz)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, mask, row_max, logz = ctx.saved_tensors
        grad = _triton_backward(logits, targets, mask, row_max, logz, grad_out, ctx.temperature)
        return grad, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API.

def _pick_impl(impl, x):
    if impl == "auto":
        return "triton" if (x.is_cuda and HAVE_TRITON) else "torch"
    if impl == "torch":
        return impl
    if impl == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("impl='triton' needs the triton package (pip install triton); or use impl='torch'")
        if not x.is_cuda and not TRITON_INTERPRET:
            raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before `kernels` "
                               "is imported (tests/conftest.py does this); or use impl='torch'")
        return impl
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check(logits_or_hidden, targets, mask):
    if logits_or_hidden.dim() != 2 or targets.shape != mask.shape or targets.shape[0] != logits_or_hidden.shape[0]:
        raise ValueError(f"expected (N, V or H), (N,), (N,); got {tuple(logits_or_hidden.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(mask.shape)}")
    mask = mask.to(device=logits_or_hidden.device, dtype=torch.bool)
    # masked rows may carry any target (e.g. -100); point them at column 0 so nothing indexes out of range
    targets = targets.to(device=logits_or_hidden.device, dtype=torch.long).masked_fill(~mask, 0)
    return targets.contiguous(), mask.contiguous()


def masked_logprobs(logits, targets, mask, temperature=1.0, impl="auto"):
    """logits (N, V), targets (N,) long, mask (N,) bool -> (N,) fp32 log p(target | row), 0 where mask is 0.

    Differentiable w.r.t. logits; masked rows get exactly 0 gradient. impl: "auto" | "triton" | "torch".
    """
    targets, mask = _check(logits, targets, mask)
    impl = _pick_impl(impl, logits)
    if impl == "torch":
        return logprobs_torch(logits, targets, mask, temperature)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _TritonLogprobs.apply(logits, targets, mask, float(temperature))


def _chunk_forward(logits, targets, temperature, impl):
    """Every row of a chunk is valid. -> log-probs (n,) fp32 and what the backward needs."""
    mask = torch.ones_like(targets, dtype=torch.bool)
    if impl == "torch":
        return logprobs_torch(logits, targets, mask, temperature).float(), None, None
    return _triton_forward(logits, targets, mask, temperature)


def _chunk_grad(logits, targets, grad_out, row_max, logz, temperature, impl):
    """-> d(sum grad_out * logprobs) / d logits for one chunk, (n, V) in the logits dtype."""
    mask = torch.ones_like(targets, dtype=torch.bool)
    if impl == "torch":  # differentiate the reference itself
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            lp = logprobs_torch(x, targets, mask, temperature)
            return torch.autograd.grad(lp, x, grad_out.to(lp.dtype))[0]
    return _triton_backward(logits, targets, mask, row_max, logz, grad_out, temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    """hidden (n, H) of valid rows only, weight (V, H) -> (n,) fp32; logits exist one chunk at a time.
    Autocast off inside, forward and backward (which recomputes the logits): under a bf16 autocast body
    (rl.py --train-bf16) the head keeps the weights' dtype, as bf16-rounded logits (~20 at 2^-8 relative
    precision) would move each log-prob by up to ~0.04 nat and its gradient would not match the forward's."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, impl):
        with torch.autocast(hidden.device.type, enabled=False):
            n = hidden.shape[0]
            w = weight.to(hidden.dtype)
            out = torch.empty(n, dtype=torch.float32, device=hidden.device)
            row_max, logz = torch.empty_like(out), torch.empty_like(out)
            for s in range(0, n, chunk):
                logits = hidden[s:s + chunk] @ w.T  # (chunk, V) <- the only big tensor; freed each iteration
                lp, m, z = _chunk_forward(logits, targets[s:s + chunk], temperature, impl)
                out[s:s + chunk] = lp
                if m is not None:
                    row_max[s:s + chunk], logz[s:s + chunk] = m, z
            ctx.save_for_backward(hidden, weight, targets, row_max, logz)
            ctx.temperature, ctx.chunk, ctx.impl = temperature, chunk, impl
            return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, row_max, logz = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            chunk = ctx.chunk
            w = weight.to(hidden.dtype)
            grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
                if ctx.needs_input_grad[1] else None  # fp32 accumulator across chunks
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk]
                logits = h @ w.T  # (chunk, V) recomputed: one more matmul instead of keeping N x V
                grad_logits = _chunk_grad(logits, targets[s:s + chunk], grad_out[s:s + chunk].contiguous(),
                                          row_max[s:s + chunk], logz[s:s + chunk], ctx.temperature, ctx.impl)
                del logits
                if grad_hidden is not None:
                    grad_hidden[s:s + chunk] = grad_logits @ w
                if grad_weight is not None:
                    grad_weight.add_(grad_logits.T @ h)
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
            return grad_hidden, grad_weight, None, None, None, None


def masked_logprobs_chunked(hidden, weight, targets, mask, temperature=1.0, chunk=4096, impl="auto"):
    """hidden (N, H), lm_head weight (V, H) -> (N,) fp32 log p(target), 0 where mask is 0.

    Same numbers as masked_logprobs(hidden @ weight.T, ...), but only rows with mask 1 are multiplied
    by the weight, `chunk` rows at a time, so the full (N, V) logits are never materialised.
    Differentiable w.r.t. hidden and weight (the weight gradient only if it requires grad).
    """
    targets, mask = _check(hidden, targets, mask)
    impl = _pick_impl(impl, hidden)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (V, H={hidden.shape[1]}), got {tuple(weight.shape)}")
    rows = mask.nonzero().squeeze(1)  # valid rows only: no matmul for system/user/tool tokens (one sync)
    lp = _ChunkedLogprobs.apply(hidden.index_select(0, rows), weight, targets.index_select(0, rows),
                                float(temperature), int(chunk), impl)
    return torch.zeros(mask.shape[0], dtype=torch.float32, device=hidden.device).index_copy(0, rows, lp)
