"""Tests for kernels/nf4.py: the NF4 dequantize + matmul (Triton under TRITON_INTERPRET=1 on CPU, and the torch
reference) against bitsandbytes' own quantize_4bit / dequantize_4bit + matmul, and swapped into Linear4bit.

Run:  .venv/bin/pytest tests/test_nf4.py -s      (-s shows each test's max difference)

Bound, |got - exact| <= tol * (|x| @ |W|^T), exact the fp64 product of the same (already rounded) x and
bitsandbytes' dequantized W: the kernel reads the very same W values (tested bit for bit), so what is left
is the order of the fp32 sums and the rounding of the output. tol: fp32 1e-6, fp16 2^-10, bf16 2^-8 (the
output's unit roundoff, and a few ulps of fp32 sums over K <= 256 terms).
"""
import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bf  # noqa: E402

from kernels import nf4  # noqa: E402

IMPLS = ["triton", "torch"] if nf4.HAVE_TRITON else ["torch"]
TOL = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-8}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M rows, N out, K in): odd M, K not a multiple of the 64-block (blocks run across rows), odd N * K (a
# padded last byte), a full decode tile of 64 rows
SHAPES = [(1, 20, 63), (3, 37, 100), (16, 64, 128), (64, 48, 256), (5, 130, 192)]


def quantized(N, K, dtype, nested, seed=0):
    """A random weight quantized by bitsandbytes -> (packed uint8 ((N*K+1)//2, 1), its QuantState)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
    return bf.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")


def check_close(name, got, want, x, w, dtype):
    exact = x.double() @ w.double().t()
    bound = TOL[dtype] * (x.double().abs() @ w.double().abs().t()) + 1e-12
    ours, theirs = (got.double() - exact).abs(), (want.double() - exact).abs()
    print(f"{name}: max |ours - bitsandbytes| = {(got.double() - want.double()).abs().max().item():.3g}, max |diff| "
          f"to fp64: ours {ours.max().item():.3g}, bitsandbytes {theirs.max().item():.3g}")
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (ours <= bound).all(), f"{name}: ours {(ours / bound).max().item():.2f} x the bound"


@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("N, K", [(20, 63), (37, 100), (130, 192)])
def test_reference_dequantize_is_bitsandbytes_bit_for_bit(N, K, dtype, nested):
    packed, qs = quantized(N, K, dtype, nested)
    ours, theirs = nf4.dequantize_nf4_torch(packed, qs), bf.dequantize_4bit(packed, qs)
    print(f"N {N} K {K} {dtype} nested {nested}: max |diff| = {(ours.float() - theirs.float()).abs().max().item()}")
    assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("M, N, K", SHAPES)
def test_matmul_matches_bitsandbytes_dequantize_then_matmul(M, N, K, dtype, nested, impl):
    packed, qs = quantized(N, K, dtype, nested, seed=M + N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = bf.dequantize_4bit(packed, qs)                        # (N, K): bitsandbytes' own dequantize
    check_close(f"{impl} M {M} N {N} K {K} {dtype} nested {nested}", nf4.nf4_matmul(x, packed, qs, impl=impl),
                x @ w.t(), x, w, dtype)


@pytest.mark.skipif(not nf4.HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("split", [2, 3])
def test_kernel_split_over_k_sums_its_parts(split):
    """A narrow weight on a GPU is cut along K so that every SM has work; the fp32 parts are summed after."""
    M, N, K, dtype = 7, 40, 320, torch.bfloat16
    packed, qs = quantized(N, K, dtype, nested=True)
    x = torch.randn(2, M, K, generator=torch.Generator().manual_seed(2)).to(dtype)    # (..., K): leading dims kept
    w = bf.dequantize_4bit(packed, qs)
    got = nf4.nf4_matmul_triton(x, packed, qs, split_k=split)
    assert got.shape == (2, M, N)
    check_close(f"split {split}", got.reshape(-1, N), (x @ w.t()).reshape(-1, N), x.reshape(-1, K), w, dtype)


def linear4bit(K, N, dtype, bias=True, seed=0):
    """A bitsandbytes Linear4bit (NF4, nested absmax: Params4bit's default) with random weights, on CPU."""
    torch.manual_seed(seed)
    plain = torch.nn.Linear(K, N, bias=bias)
    q = bnb.nn.Linear4bit(K, N, bias=bias, compute_dtype=dtype, quant_type="nf4", device="meta")
    q.weight = bnb.nn.Params4bit(plain.weight.data.to(dtype), requires_grad=False, quant_type="nf4")
    q.bias = None if not bias else torch.nn.Parameter(plain.bias.data.to(dtype))
    q = q.to("cpu")                                           # .to quantizes the weight
    q.support_avx512bf16_for_cpu = False                      # keep bitsandbytes' layout (no CPU repacking)
    return q


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nf4_decode_swaps_the_kernel_into_linear4bit_for_few_rows_only(dtype, impl, monkeypatch):
    layer, plain = linear4bit(100, 52, dtype), bnb.nn.Linear4bit.forward
    assert layer.weight.quant_state.nested
    calls = []
    matmul = nf4.nf4_matmul
    monkeypatch.setattr(nf4, "nf4_matmul", lambda *a, **kw: calls.append(a[0].shape) or matmul(*a, **kw))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for rows, ours in ((3, True), (nf4.MAX_ROWS, True), (nf4.MAX_ROWS + 1, False)):
            x = torch.randn(rows, 1, 100, generator=g).to(dtype)   # (rows, 1, K): a decode step's shape
            want = layer(x)                                        # bitsandbytes' own forward
            calls.clear()
            with nf4.nf4_decode(impl=impl):
                got = layer(x)
            w = bf.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
            check_close(f"{impl} {dtype} {rows} rows", (got - layer.bias).reshape(rows, -1),
                        (want - layer.bias).reshape(rows, -1), x.reshape(rows, -1), w, dtype)
            assert len(calls) == int(ours), (rows, calls)          # the kernel ran, or (too many rows) did not
    assert bnb.nn.Linear4bit.forward is plain                      # restored on the way out
    with nf4.nf4_decode(enabled=False):                            # the flag off: bitsandbytes' forward
        layer(torch.randn(2, 100).to(dtype))
    assert not calls


def test_nf4_decode_leaves_training_to_bitsandbytes():
    """A call that needs a gradient (the update) is never the kernel's, which has no backward."""
    layer = linear4bit(64, 16, torch.float32)
    x = torch.randn(4, 64, requires_grad=True)
    with nf4.nf4_decode(impl="torch"):
        assert not nf4.takes(layer, x, nf4.MAX_ROWS)
        layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
