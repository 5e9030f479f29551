"""A decode step's 4-bit matmuls: bitsandbytes NF4 weights dequantized inside the matmul, for a few rows.

Why. A decode step multiplies a few rows (one token per conversation, 8-64) by every weight of the model.
bitsandbytes runs one row through a fused 4-bit GEMV, but for more than one row it dequantizes the whole
weight to bf16 (2 bytes a weight written, then read again) and calls cuBLAS: 4 bytes of traffic per weight
instead of half a byte. This kernel reads each packed weight once per step for all rows and dequantizes it
in registers, so a step moves ~0.5 byte per weight, the memory roofline of a 4-bit model.

bitsandbytes' NF4 layout (bitsandbytes/backends/default/ops.py, quantize_4bit / dequantize_4bit), which the
kernel reads as it is stored:
  - the weight W (N out, K in), row-major, flattened: element e = n * K + k;
  - packed uint8, two 4-bit codes a byte: element e in byte e // 2, the high nibble for even e, the low for odd
    (an odd N * K pads the last byte);
  - the code indexes the 16-value NF4 table (quant_state.code), scaled by the absmax of its block of
    `blocksize` (64) consecutive elements: W[e] = code[nibble(e)] * absmax[e // blocksize], in fp32, then cast
    to the compute dtype; a block may run across a row's end when K is not a multiple of the block;
  - nested ("double") quantization (compress_statistics=True, Params4bit's default): absmax itself is stored
    as uint8 codes of bitsandbytes' 8-bit dynamic map (state2.code) in blocks of 256, each with an fp32 absmax
    (state2.absmax), around a mean (offset): absmax[b] = code2[q[b]] * absmax2[b // 256] + offset.

The PyTorch reference (`dequantize_nf4_torch`, `nf4_matmul_torch`) is the specification in a few lines; `impl=`
picks: "triton" (on CPU tensors it needs TRITON_INTERPRET=1 set before this module is imported, as
tests/conftest.py does) or "torch". `nf4_decode()` swaps the kernel into every bitsandbytes Linear4bit's
forward for calls of at most `max_rows` rows (a decode step) and leaves every other call (prefill, training,
one-row GEMV on CPU) to bitsandbytes. Tested in tests/test_nf4.py against bitsandbytes' own dequantize_4bit +
matmul and against a Linear4bit's own forward.

Simplifications: NF4 only (not FP4), no gradient (sampling only), a fixed tile (no autotuning); the split over
K (more programs for a narrow weight) sums fp32 partials in a second, tiny torch op.
"""
import contextlib
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # the torch reference still works without triton
    HAVE_TRITON = False

# Triton reads this when a @triton.jit function is defined, i.e. when this module is imported.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_ROWS = 64           # the most rows the kernel takes (a decode step's); more fall back to bitsandbytes


# ----------------------------------------------------------------------------------------------
# PyTorch reference: the specification.

def absmax_of(qs) -> torch.Tensor:
    """Each 64-element block's scale, fp32 (n_blocks,): stored as is, or decoded from the nested 8-bit form."""
    if getattr(qs, "state2", None) is None:
        return qs.absmax.float()
    blk2 = torch.arange(qs.absmax.numel(), device=qs.absmax.device) // qs.state2.blocksize
    return qs.state2.code[qs.absmax.long()] * qs.state2.absmax[blk2] + qs.offset


def dequantize_nf4_torch(packed: torch.Tensor, qs) -> torch.Tensor:
    """packed uint8 ((N*K+1)//2, 1) + quant state -> W (N, K) in qs.dtype, as bitsandbytes' dequantize_4bit."""
    b = packed.reshape(-1)
    codes = torch.stack([b >> 4, b & 15], 1).reshape(-1)[:qs.shape[0] * qs.shape[1]]   # high nibble first
    scale = absmax_of(qs).repeat_interleave(qs.blocksize)[:codes.numel()]              # its block's absmax
    return (qs.code[codes.long()] * scale).to(qs.dtype).reshape(qs.shape)


def nf4_matmul_torch(x: torch.Tensor, packed: torch.Tensor, qs, bias=None) -> torch.Tensor:
    """x (..., K) @ W^T -> (..., N): dequantize the whole weight, then one matmul in x's dtype."""
    return F.linear(x, dequantize_nf4_torch(packed, qs).to(x.dtype), bias)


# ----------------------------------------------------------------------------------------------
# Triton kernel: one program per (BLOCK_N output columns, one K split), all rows at once.

if HAVE_TRITON:
    @triton.jit
    def _nf4_matmul_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr,
                           M, N, K, k_per_split, stride_xm, stride_om, stride_os,
                           NESTED: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr,
                           INTERPRET_BF16: tl.constexpr):
        pid_n, pid_s = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)                                  # rows (decode: one token per conversation)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                # output columns = weight rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_s * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=(rm < M)[:, None] & (rk < k_end)[None, :], other=0.0)          # (BLOCK_M, BLOCK_K)
            wmask = (rn < N)[:, None] & (rk < k_end)[None, :]
            e = rn[:, None].to(tl.int64) * K + rk[None, :]                                  # (BLOCK_N, BLOCK_K) flat
            byte = tl.load(w_ptr + e // 2, mask=wmask, other=0).to(tl.int32)
            nibble = tl.where(e % 2 == 0, byte >> 4, byte & 15)     # even element: high nibble
            value = tl.load(code_ptr + nibble)                      # the NF4 table, fp32
            block = e // BLOCKSIZE
            if NESTED:                                              # absmax = code2[q] * absmax2[block // 256] + offset
                q = tl.load(absmax_ptr + block, mask=wmask, other=0).to(tl.int32)
                scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=wmask, other=0.0) \
                    + tl.load(offset_ptr)
            else:
                scale = tl.load(absmax_ptr + block, mask=wmask, other=0.0)
            w = value * scale                                       # fp32, as bitsandbytes computes it
            if INTERPRET_BF16:      # the interpreter casts to bf16 by truncation: round to nearest even, as a GPU
                bits = w.to(tl.int32, bitcast=True)
                w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            else:
                w = w.to(x.dtype)                                   # then cast to the compute dtype, as bitsandbytes
            if FP32:                                                # fp32 input, or the interpreter (below)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))                       # bf16 x bf16 -> fp32 accumulate
        out = out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def _split_k(n_blocks: int, K: int, block_k: int, device) -> int:
    """How many parts K is cut into, so that a narrow weight still gives every SM a couple of programs."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-2 * sms // n_blocks), -(-K // block_k), 16))


def nf4_matmul_triton(x: torch.Tensor, packed: torch.Tensor, qs, bias=None, block_n: int = 64, block_k: int = 64,
                      split_k: int | None = None) -> torch.Tensor:
    """nf4_matmul_torch's result from the kernel: x (..., K) with at most MAX_ROWS rows."""
    N, K = qs.shape
    x2 = x.reshape(-1, K).contiguous()                              # (M, K)
    M = x2.shape[0]
    assert M <= MAX_ROWS and qs.quant_type == "nf4" and x.shape[-1] == K, (M, qs.quant_type, x.shape, qs.shape)
    n_blocks = triton.cdiv(N, block_n)
    split = split_k or _split_k(n_blocks, K, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k      # a whole number of BLOCK_K steps
    split = triton.cdiv(K, k_per_split)
    # (split, M, N): fp32 partials, summed below; one part is written in x's dtype (fp32 under the interpreter,
    # which casts to bf16 by truncation: torch rounds it)
    out = torch.empty(split, M, N, device=x.device, dtype=x.dtype if split == 1 and x.is_cuda else torch.float32)
    nested = getattr(qs, "state2", None) is not None
    absmax2, code2, offset = (qs.state2.absmax, qs.state2.code, qs.offset.reshape(1)) if nested else (qs.absmax,) * 3
    _nf4_matmul_kernel[(n_blocks, split)](
        x2, packed, qs.absmax, qs.code, absmax2, code2, offset, out, M, N, K, k_per_split,
        x2.stride(0), out.stride(1), out.stride(0), NESTED=nested, BLOCKSIZE=qs.blocksize,
        BLOCKSIZE2=qs.state2.blocksize if nested else 1, BLOCK_M=max(16, triton.next_power_of_2(M)),
        BLOCK_N=block_n, BLOCK_K=block_k,
        # Triton's interpreter gets a bf16 x bf16 tl.dot wrong (~1e10 off); in fp32 the same bf16 values multiply
        # exactly, so only the order of the fp32 sums differs from the GPU's bf16 dot
        FP32=x.dtype == torch.float32 or not x.is_cuda, INTERPRET_BF16=x.dtype == torch.bfloat16 and not x.is_cuda)
    y = (out[0] if split == 1 else out.sum(0)).to(x.dtype).reshape(*x.shape[:-1], N)   # (..., N)
    return y if bias is None else y + bias.to(y.dtype)


def nf4_matmul(x, packed, qs, bias=None, impl="triton"):
    """x (..., K) @ W^T (+ bias) for an NF4 weight of bitsandbytes. impl: "triton" | "torch" (the reference)."""
    if impl == "torch":
        return nf4_matmul_torch(x, packed, qs, bias)
    if impl != "triton":
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    if not HAVE_TRITON:
        raise RuntimeError("impl='triton' needs the triton package; or use impl='torch'")
    if not x.is_cuda and not TRITON_INTERPRET:
        raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before `kernels` is imported "
                           "(tests/conftest.py does this); or use impl='torch'")
    return nf4_matmul_triton(x, packed, qs, bias)


# ----------------------------------------------------------------------------------------------
# Swapped into bitsandbytes' Linear4bit for a decode step's few rows.

def takes(module, x, max_rows: int) -> bool:
    """Whether nf4_decode's kernel runs this call: few rows, no gradient, NF4 in bitsandbytes' own layout
    (on CPUs with AVX512-BF16 an eval-mode Linear4bit repacks its weight for its own CPU kernel: left to it)."""
    qs = module.weight.quant_state
    return (x.numel() // x.shape[-1] <= max_rows and not (torch.is_grad_enabled() and x.requires_grad)
            and qs.quant_type == "nf4" and not getattr(qs, "packing_format_for_cpu", False)
            and (x.is_cuda or TRITON_INTERPRET))


def nf4_linear_forward(module, x, impl="triton"):
    """What Linear4bit.forward returns, computed by nf4_matmul: x cast to the compute dtype and back."""
    qs = module.weight.quant_state
    dtype = module.compute_dtype or x.dtype
    bias = None if module.bias is None else module.bias.to(dtype)
    return nf4_matmul(x.to(dtype), module.weight.data, qs, bias, impl).to(x.dtype)


@contextlib.contextmanager
def nf4_decode(enabled: bool = True, max_rows: int = MAX_ROWS, impl: str = "triton"):
    """Inside: every bitsandbytes Linear4bit call of at most max_rows rows (a decode step) runs nf4_matmul;
    the rest (prefill, training) runs bitsandbytes' own forward. enabled=False: nothing changes (the flag)."""
    if not enabled:
        yield
        return
    from bitsandbytes.nn import Linear4bit
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module
    plain = Linear4bit.forward

    def forward(self, x):
        fix_4bit_weight_quant_state_from_module(self)              # as bitsandbytes' forward starts
        return nf4_linear_forward(self, x, impl) if takes(self, x, max_rows) else plain(self, x)
    Linear4bit.forward = forward
    try:
        yield
    finally:
        Linear4bit.forward = plain
