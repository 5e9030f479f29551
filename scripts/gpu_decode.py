"""The GPU check's `decode` part (scripts/gpu_check.py --parts decode): where a decode step of the 8B NF4 sampler
spends its milliseconds, and the NF4 kernel (kernels/nf4.py) against bitsandbytes, on the model the update part
built (Qwen3-8B's shapes, random NF4 weights + LoRA r16). --cpu runs every line at toy shapes (no timing).

  nf4       each 4-bit projection shape of the model at 8, 32 and 64 rows: our kernel (nf4_decode) against the
            module's own bitsandbytes forward, max |diff| (checked against the bf16 bound of tests/test_nf4.py)
            and ms each, with the kernel's GB/s of packed weights
  profile   one round of the sampler's workload (gpu_check's: 1.8k shared + own tokens, <= 64 sampled) at 8, 32
            and 64 rows, bitsandbytes ("before") and nf4_decode ("after"): tok/s, decode ms a step (the round's
            seconds less a 1-token round's, over the tokens after the first), the peak above the weights against
            the budget, and the GPU's kernel time split by torch.profiler into 4-bit matmuls, other matmuls
            (LoRA, lm_head), attention, the rest; the wall time no kernel fills is Python and launches; host
            syncs are the device-to-host copies counted
  logprobs  the sampler's log-probs of 8 rows against the training forward's (common.sequence_logprobs) on the
            same tokens: max and mean |delta log p| (reported, not tuned away)
"""
import math
import time
import traceback
from collections import Counter

import torch

GIB = 2**30
ROWS = (8, 32, 64)


def _ms(fn, cuda, reps=20):
    if not cuda:
        return None
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def nf4_rows(model, cuda, part, check):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf
    from kernels.nf4 import MAX_ROWS, nf4_decode, takes
    layers = {}
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False           # the rehearsal: bitsandbytes' layout, as on a GPU
            layers.setdefault(tuple(m.weight.quant_state.shape), m)
    for (N, K), m in layers.items():                       # a CPU with AVX512-BF16 repacked an eval-mode layer for
        if getattr(m.weight.quant_state, "packing_format_for_cpu", False):   # its own kernel: a fresh one instead
            q = bnb.nn.Linear4bit(K, N, bias=False, compute_dtype=m.compute_dtype, quant_type="nf4", device="meta")
            q.weight = bnb.nn.Params4bit(torch.randn(N, K, dtype=m.compute_dtype) * 0.02, requires_grad=False,
                                         quant_type="nf4")
            layers[N, K] = q.to(m.weight.device)
            layers[N, K].support_avx512bf16_for_cpu = False
    worst = 0.0
    for rows in ROWS if cuda else (3, 8):
        for (N, K), m in layers.items():
            dtype = m.compute_dtype or torch.float32
            x = torch.randn(rows, 1, K, device=m.weight.device, dtype=dtype)
            if not takes(m, x, MAX_ROWS):
                raise RuntimeError(f"the NF4 kernel would not take the {N} x {K} layer")
            with torch.no_grad():
                want = m(x)
                with nf4_decode():
                    got = m(x)
                w = bf.dequantize_4bit(m.weight.data, m.weight.quant_state).double()
                bound = (2**-8 if dtype != torch.float32 else 1e-6) * (x.reshape(rows, K).double().abs() @ w.abs().t())
                ratio = ((got - want).double().reshape(rows, N).abs() / (2 * bound + 1e-9)).max().item()
                ms_bnb = _ms(lambda: m(x), cuda)
                with nf4_decode():
                    ms_ours = _ms(lambda: m(x), cuda)
            worst = max(worst, ratio)
            gbs = N * K / 2 / ms_ours / 1e6 if ms_ours else None
            part["nf4"].append(dict(rows=rows, N=N, K=K, diff=(got - want).abs().max().item(), ratio=ratio,
                                    ms_bnb=ms_bnb, ms_ours=ms_ours, gbs=gbs))
            print(f"  nf4 {rows:>2} rows {N:>5} x {K:<5} max |ours - bitsandbytes| {part['nf4'][-1]['diff']:.2e}"
                  + (f", ms bitsandbytes {ms_bnb:.3f} / ours {ms_ours:.3f} ({gbs:.0f} GB/s of packed weights)"
                     if cuda else ""), flush=True)
    check(part, "NF4 kernel within the bf16 bound of bitsandbytes' forward (both sides' rounding)", worst <= 1,
          f"{worst:.2f} of the bound")


def _category(name: str) -> str:
    n = name.lower()
    if "nf4" in n or "dequant" in n or "4bit" in n:                # ours, or bitsandbytes' dequantize / gemv
        return "4-bit matmuls"
    if "gemm" in n or "gemv" in n or "cutlass" in n or "matmul" in n or "sm90_xmma" in n or "nvjet" in n:
        return "other matmuls (LoRA, lm_head, attention bmm)"
    if "flash" in n or "attention" in n or "fmha" in n or "softmax" in n:
        return "attention"
    return "the rest (norms, rotary, elementwise, copies, sampling)"


def profile_rows(model, tok, cuda, part, check, budget, batch, new):
    from kernels.nf4 import nf4_decode
    from sampler import ModelAgent
    held = torch.cuda.memory_allocated() if cuda else 0
    for after in (False, True):
        with nf4_decode(after):                         # warm-up: kernels compiled, cuBLAS handles made
            ModelAgent(model, tok, temperature=1.0, max_new_tokens=4, kv_budget=budget).act(batch(8))
        for rows in ROWS if cuda else (8,):
            b = batch(rows)
            times = {}
            for n in (1, new):                          # a 1-token round: prefill + the first token
                agent = ModelAgent(model, tok, temperature=1.0, max_new_tokens=n, kv_budget=budget)
                torch.manual_seed(0)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                with nf4_decode(after):
                    outs = agent.act(b)
                if cuda:
                    torch.cuda.synchronize()
                times[n] = time.perf_counter() - t0
            tokens = sum(len(ids) for ids, _ in outs)
            steps = max(max(len(ids) for ids, _ in outs) - 1, 1)
            step_ms = (times[new] - times[1]) / steps * 1e3 / max(len(agent.waves), 1)
            peak = (torch.cuda.max_memory_allocated() - held) / GIB if cuda else None
            r = dict(after=after, rows=rows, tokens=tokens, tok_s=tokens / times[new], decode_step_ms=step_ms,
                     prefill_s=times[1], seconds=times[new], waves=len(agent.waves), peak_gib=peak,
                     budget_gib=budget / GIB if budget else None, split=None)
            if cuda and rows == ROWS[-1] or not cuda:     # the kernel split of one round at the most rows
                r["split"] = kernel_split(model, tok, b, budget, new, after, cuda)
            part["profile"].append(r)
            print(f"  {'after ' if after else 'before'} {rows:>2} rows: {tokens} tokens in {times[new]:.2f} s = "
                  f"{r['tok_s']:.0f} tok/s, {len(agent.waves)} wave(s), decode step {step_ms:.1f} ms, prefill round "
                  f"{times[1]:.2f} s" + (f", peak {peak:.2f} GiB above the weights (budget {budget / GIB:.2f})"
                                         if cuda else ""), flush=True)
            if r["split"]:
                print(f"    one round under the profiler, {r['split']['wall_ms']:.0f} ms: " + "; ".join(
                    f"{k} {v:.0f} ms" for k, v in r["split"]["ms"].items()) + f"; {r['split']['host_syncs']} host syncs",
                    flush=True)
            check(part, f"{'after' if after else 'before'} {rows} rows: every row sampled, log-probs finite and <= 0",
                  all(ids for ids, _ in outs) and all(math.isfinite(x) and x <= 1e-6 for _, lps in outs for x in lps),
                  f"{tokens} tokens")


def kernel_split(model, tok, b, budget, new, after, cuda) -> dict:
    """One round under torch.profiler -> ms by kind of GPU kernel, the wall time no kernel fills (Python, launches,
    syncs) and the count of device-to-host copies (host syncs). On CPU: CPU op time by the same kinds."""
    from torch.profiler import ProfilerActivity, profile
    from kernels.nf4 import nf4_decode
    from sampler import ModelAgent
    agent = ModelAgent(model, tok, temperature=1.0, max_new_tokens=new, kv_budget=budget)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    torch.manual_seed(0)
    with profile(activities=acts) as prof, nf4_decode(after):
        t0 = time.perf_counter()
        agent.act(b)
        torch.cuda.synchronize() if cuda else None
        wall = (time.perf_counter() - t0) * 1e3
    split, syncs = Counter(), 0
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:       # a kernel or a copy on the GPU
            split[_category(e.name)] += e.time_range.elapsed_us() / 1e3
            syncs += "memcpy dtoh" in e.name.lower()                       # .tolist() / .item(): the host waits
        elif not cuda and e.cpu_parent is None and e.name.startswith("aten::"):
            split[_category(e.name)] += e.cpu_time_total / 1e3
    busy = sum(split.values())
    split["no kernel running: Python, launches, host syncs"] = max(wall - busy, 0.0)
    return dict(ms=dict(split), host_syncs=syncs, wall_ms=wall)


def logprob_mismatch(model, tok, part, check, batch):
    """The sampler's log-probs against the training forward's on the same tokens, 8 rows, T = 1."""
    from common import sequence_logprobs
    from sampler import ModelAgent
    b = batch(8)
    torch.manual_seed(0)
    outs = ModelAgent(model, tok, temperature=1.0, max_new_tokens=32).act(b)
    deltas = []
    with torch.no_grad():
        for (_, _, ids), (new, lps) in zip(b, outs):
            seq = torch.tensor([ids + new], device=model.device)
            mask = torch.zeros_like(seq)
            mask[0, len(ids):] = 1
            train = sequence_logprobs(model, seq, torch.ones_like(seq), mask.bool())[0, len(ids):]
            deltas += (train.float().cpu() - torch.tensor(lps)).abs().tolist()
    part["logprobs"] = dict(tokens=len(deltas), max=max(deltas), mean=sum(deltas) / len(deltas))
    print(f"  log-probs, sampler vs training forward, {len(deltas)} tokens: max |delta| {max(deltas):.3e}, mean "
          f"{part['logprobs']['mean']:.3e}", flush=True)
    check(part, "sampler vs training log-probs: finite", all(math.isfinite(d) for d in deltas), f"max {max(deltas):.2e}")


def part_decode(args, ctx, part, check, budget, batch, new):
    """Each step in turn; one that raises is a failed check, and the next still runs (one GPU try is all there is)."""
    cuda = not args.cpu
    part.update(nf4=[], profile=[])
    for name, step in (("nf4", lambda: nf4_rows(ctx.model, cuda, part, check)),
                       ("profile", lambda: profile_rows(ctx.model, ctx.tok, cuda, part, check, budget, batch, new)),
                       ("logprobs", lambda: logprob_mismatch(ctx.model, ctx.tok, part, check, batch))):
        try:
            step()
        except Exception as e:
            traceback.print_exc()
            check(part, f"{name} ran", False, f"{type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache() if cuda else None


def decode_rows(part):
    out = []
    for r in part.get("profile", []):
        memory = "" if r["peak_gib"] is None else (f"peak {r['peak_gib']:.2f} <= budget {r['budget_gib']:.2f} GiB: "
                                                   + ("OK" if r["peak_gib"] <= r["budget_gib"] else "OVER"))
        out.append((f"decode {'after (nf4 kernel)' if r['after'] else 'before (bitsandbytes)'} {r['rows']} rows: "
                    "tok/s, decode step ms, waves", f"{r['tok_s']:.0f}, {r['decode_step_ms']:.1f}, {r['waves']}", memory))
        if r["split"]:
            out.append((f"  where a round's {r['split']['wall_ms']:.0f} ms went ({r['rows']} rows)",
                        "; ".join(f"{k} {v:.0f}" for k, v in r["split"]["ms"].items()),
                        f"{r['split']['host_syncs']} host syncs"))
    if "logprobs" in part:
        lp = part["logprobs"]
        out.append(("decode: sampler vs training log-probs, max / mean |delta|", f"{lp['max']:.2e} / {lp['mean']:.2e}",
                    f"{lp['tokens']} tokens"))
    return out
