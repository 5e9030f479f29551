"""Benchmark masked per-token log-probs: our Triton kernel against the usual ways of computing them.

Run:   python kernels/bench.py                 GPU: correctness check, then the full timing table
       python kernels/bench.py --quick         GPU: N=4096 only, density 100% and 25%
       python kernels/bench.py --json out.json also write every row as JSON
On a machine without CUDA it runs the correctness comparisons only (the kernel under
TRITON_INTERPRET=1, the torch reference and the baselines, all against fp64) and says so:
timings from the CPU or from Triton's interpreter would say nothing about the GPU kernel.

What the GPU table reports, per V in {32000, 151936}, N in {4096, 16384, 32768} bf16 logits,
mask density in {100%, 50%, 25%}, forward-only and forward + backward:
  ms        median of triton.testing.do_bench
  GB/s      the traffic floor divided by the time. Floor, forward: reading the valid rows once,
            2 * N_valid * V bytes. Forward + backward: that, plus reading them again in the
            backward, plus writing the whole (N, V) bf16 gradient: 4 * N_valid * V + 2 * N * V.
  %copy     GB/s as a share of a measured bf16 device-to-device copy (the achievable bandwidth)
  extra     peak memory allocated during the call beyond what existed before (the logits),
            in MB and as a multiple of the logits' size. Forward + backward includes the (N, V)
            logits gradient autograd hands back (1.0x).
Methods: ours (kernels.masked_logprobs, impl="triton"); naive log_softmax + gather in fp32 and in
bf16; a per-sequence loop of log_softmax + gather (as TRL's selective_log_softmax does for bf16,
sequences of --seq-len tokens); torch.compile of the fp32 naive version.
Baselines compute every row and multiply by the mask; ours skips masked rows.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must be set before kernels/ defines its @triton.jit functions
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `python kernels/bench.py` finds kernels/

from kernels import harness  # noqa: E402
from kernels.logprobs import HAVE_TRITON, logprobs_torch, masked_logprobs, masked_logprobs_chunked  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--N", type=int, nargs="+", default=[4096, 16384, 32768], help="token rows")
parser.add_argument("--V", type=int, nargs="+", default=[32000, 151936], help="vocabulary sizes")
parser.add_argument("--density", type=float, nargs="+", default=[1.0, 0.5, 0.25], help="fraction of rows with mask 1")
parser.add_argument("--seq-len", type=int, default=1024, help="rows per iteration of the per-sequence loop baseline")
parser.add_argument("--rep", type=int, default=100, help="do_bench measuring time per case, ms")
parser.add_argument("--quick", action="store_true", help="GPU: N=4096 and densities 1.0, 0.25 only")
parser.add_argument("--json", default=None, help="also write all rows to this JSON file")
parser.add_argument("--seed", type=int, default=0, help="random seed for logits, targets, masks")


# ----------------------------------------------------------------------------------------------
# The methods. Each takes bf16 logits (N, V), targets (N,), mask (N,) bool -> (N,) fp32, 0 where masked.

def ours(x, t, m):
    return masked_logprobs(x, t, m, impl="triton")


def naive_fp32(x, t, m):
    return x.float().log_softmax(-1).gather(1, t[:, None]).squeeze(1) * m


def naive_bf16(x, t, m):
    return x.log_softmax(-1).gather(1, t[:, None]).squeeze(1).float() * m


def make_per_sequence_loop(seq_len):
    def per_sequence_loop(x, t, m):  # one (seq_len, V) log_softmax at a time, like TRL for bf16 inputs
        rows = [x[s:s + seq_len].log_softmax(-1).gather(1, t[s:s + seq_len, None]).squeeze(1)
                for s in range(0, x.shape[0], seq_len)]
        return torch.cat(rows).float() * m
    return per_sequence_loop


def methods(args, device):
    out = {"ours": ours, "naive fp32": naive_fp32, "naive bf16": naive_bf16,
           f"per-seq loop ({args.seq_len})": make_per_sequence_loop(args.seq_len)}
    if device == "cuda":
        out["compiled fp32"] = torch.compile(naive_fp32, dynamic=False)
    return out


# ----------------------------------------------------------------------------------------------
# Correctness: every method against fp64, values and gradients (runs on CPU and GPU).

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def make_inputs(N, V, density, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)  # made on the device: no 20 GB host tensor
    x = torch.randn(N, V, generator=gen, device=device, dtype=dtype).mul_(2)
    t = torch.randint(0, V, (N,), generator=gen, device=device)
    m = torch.rand(N, generator=gen, device=device) < density
    return x, t, m


def correctness(args, device):
    impls = methods(args, device)
    if device == "cpu" and not HAVE_TRITON:
        impls.pop("ours")
    print(f"\ncorrectness on {device}: max |diff| to fp64 (values | gradients w.r.t. logits). fp64 is computed from"
          "\nthe same rounded inputs; 'chunked' computes its logits with a matmul in the input dtype, so its bf16"
          "\nrows include bf16 rounding of the logits (the fp64 reference multiplies in fp64).")
    print(f"{'V':>6} {'N':>4} {'dtype':>5} {'method':<22} {'values':>10} {'grads':>10}")
    for V, N, dtype in [(1000, 33, torch.float32), (4097, 17, torch.bfloat16), (32000, 9, torch.bfloat16)]:
        x, t, m = make_inputs(N, V, 0.6, dtype, device, args.seed)
        g = torch.randn(N, device=device)
        x64 = x.double().requires_grad_()
        ref = logprobs_torch(x64, t, m)
        ref.backward(g.double())
        for name, fn in impls.items():
            xi = x.clone().requires_grad_()  # a fresh leaf: each method's gradient its own
            out = fn(xi, t, m)
            out.backward(g)
            dv = (out.double() - ref).abs().max().item()
            dg = (xi.grad.double() - x64.grad).abs().max().item()
            print(f"{V:>6} {N:>4} {DTYPE_NAMES[dtype]:>5} {name:<22} {dv:>10.2e} {dg:>10.2e}")
        # the chunked path (hidden states + lm_head weight) against the plain path on full logits
        H = 16
        h = torch.randn(N, H, device=device, dtype=dtype, requires_grad=True)
        w = (torch.randn(V, H, device=device) / 2).to(dtype).requires_grad_()
        impl = "triton" if HAVE_TRITON else "torch"
        out = masked_logprobs_chunked(h, w, t, m, chunk=4, impl=impl)
        out.backward(g)
        gh, gw = h.grad.clone(), w.grad.clone()
        h.grad = w.grad = None
        ref = logprobs_torch((h.double() @ w.double().T), t, m)
        ref.backward(g.double())
        print(f"{V:>6} {N:>4} {DTYPE_NAMES[dtype]:>5} {'chunked (' + impl + ')':<22} {(out.double() - ref).abs().max().item():>10.2e} "
              f"{max((gh.double() - h.grad).abs().max().item(), (gw.double() - w.grad).abs().max().item()):>10.2e}")


# ----------------------------------------------------------------------------------------------
# GPU timing.

def copy_bandwidth_gbs():
    import triton.testing
    x = torch.empty(2 ** 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * 2 / ms / 1e6  # read + write, bytes / ms -> GB/s


def measure(fn, x, t, m, backward, rep):
    """-> (median ms, peak extra bytes) or (None, None) on out-of-memory."""
    import triton.testing
    g = torch.randn(x.shape[0], device="cuda")

    def call():
        out = fn(x, t, m)
        if backward:
            out.backward(g)

    try:
        x.grad = None
        torch.cuda.empty_cache()
        with harness.PeakMemory() as mem:
            call()
        x.grad = None
        ms = triton.testing.do_bench(call, rep=rep, grad_to_none=[x] if backward else None, return_mode="median")
        return ms, mem.peak - mem.base
    except torch.cuda.OutOfMemoryError:
        x.grad = None
        torch.cuda.empty_cache()
        return None, None


def gpu_table(args):
    Ns, densities = ([4096], [1.0, 0.25]) if args.quick else (args.N, args.density)
    impls = methods(args, "cuda")
    copy_gbs = copy_bandwidth_gbs()
    print(f"\ndevice: {torch.cuda.get_device_name()}  measured bf16 copy bandwidth: {copy_gbs:.0f} GB/s")
    rows = []
    for backward in [False, True]:
        mode = "forward + backward" if backward else "forward"
        print(f"\n### {mode}\n")
        print("| V | N | density | method | ms | GB/s | % copy | extra MB | extra / logits |")
        print("|---|---|---|---|---|---|---|---|---|")
        for V in args.V:
            for N in Ns:
                for density in densities:
                    x, t, m = make_inputs(N, V, density, torch.bfloat16, "cuda", args.seed)
                    x.requires_grad_(backward)
                    n_valid = int(m.sum())
                    floor = (4 * n_valid * V + 2 * N * V) if backward else 2 * n_valid * V
                    logits_bytes = 2 * N * V
                    for name, fn in impls.items():
                        ms, extra = measure(fn, x, t, m, backward, args.rep)
                        if ms is None:
                            print(f"| {V} | {N} | {density:.0%} | {name} | OOM | | | | |")
                            rows.append(dict(mode=mode, V=V, N=N, density=density, method=name, oom=True))
                            continue
                        gbs = floor / ms / 1e6
                        print(f"| {V} | {N} | {density:.0%} | {name} | {ms:.3f} | {gbs:.0f} | {gbs / copy_gbs:.0%} "
                              f"| {extra / 2**20:.0f} | {extra / logits_bytes:.2f}x |", flush=True)
                        rows.append(dict(mode=mode, V=V, N=N, density=density, method=name, ms=ms, gbs=gbs,
                                         copy_frac=gbs / copy_gbs, extra_bytes=extra, extra_x=extra / logits_bytes))
                    del x, t, m
                    torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs, rows=rows)


def main():
    args = parser.parse_args()
    print(vars(args))
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():
        correctness(args, "cuda")
        result = gpu_table(args)
    else:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        print("No CUDA device: timing is SKIPPED (CPU or Triton-interpreter timings say nothing about the GPU "
              "kernel).\nRunning the correctness comparisons only; the Triton kernel runs under TRITON_INTERPRET=1.")
        seconds, _ = harness.timed(lambda: correctness(args, "cpu"))
        print(f"\ncorrectness comparisons done in {seconds:.1f} s. GPU numbers: not measured on this machine.")
        result = dict(device="cpu", rows=[])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
