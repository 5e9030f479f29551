"""The GPU check's `decode` part (scripts/gpu_check.py --parts decode): the sampler's decode before and after the
static step, with each sampling weights mode, on the model the update part built (Qwen3-8B's shapes, random NF4
weights + LoRA r16). --cpu runs every line at toy shapes (no CUDA graphs: the code path, not the numbers).

  ways      "eager": before, ModelAgent(decode="eager"), the model's forward a token at a time and the host asked
            which rows finished after each; "static nf4" and "static bf16": after, sampler/static.py's step, one CUDA
            graph a token, over the NF4 layers with LoRA unmerged or over a bf16 copy with LoRA merged
  rows      each way at 8, 32 and 64 rows of the sampler part's workload (1.8k shared + 0.6-1.4k own tokens a row, every
            row new, <= 64 sampled): sampled tok/s of the decode (the decode loops' seconds, ModelAgent._sample, device
            work included, CUDA graph captures left out: they happen once a run, reported apart) and of the whole round
            (prefill included), ms per decode step, the peak above the weights (and bf16's copy) against the KV budget
  profile   a 64-row round of each static way under torch.profiler: GPU time by kind of kernel, the wall time no
            kernel fills (Python, launches, host syncs) and the device-to-host copies counted (host syncs)
  logprobs  each way's sampled log-probs of 8 rows against a teacher-forced pass of the training model
            (common.sequence_logprobs) on the same tokens: max and mean |delta log p|, what the update's ratio sees
Targets (issue 64, on an H100 or H200): >= 1,500 sampled tok/s of the decode at 32 and 64 rows, an 8-row decode step
<= 15 ms, the 64-row peak within the budget. Printed OK / SHORT / OVER; they do not fail the check.
"""
import gc
import math
import time
import traceback
from collections import Counter

import torch

GIB = 2**30
ROWS = (8, 32, 64)
WAYS = {"eager": dict(decode="eager"), "static nf4": dict(decode="static", sample_weights="nf4"),
        "static bf16": dict(decode="static", sample_weights="bf16")}
TARGET_TOK_S, TARGET_STEP_MS = 1500, 15


def sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def timed_decode(agent, cuda: bool) -> dict:
    """Wrap agent._sample (one call a wave: the decode loop) to add up its seconds, device work included, and its
    decode steps (a wave's longest turn less the token sampled from the prefill's logits). -> the running totals."""
    clock, sample = dict(seconds=0.0, steps=0), agent._sample

    def timed(*args, **kwargs):
        sync(cuda)
        t0 = time.perf_counter()
        outs, memo = sample(*args, **kwargs)
        sync(cuda)
        clock["seconds"] += time.perf_counter() - t0
        clock["steps"] += max(len(ids) for ids, _ in outs) - 1
        return outs, memo
    agent._sample = timed
    return clock


def one_round(model, tok, way: str, batch, new: int, budget: int, cuda: bool) -> dict:
    """One round of `way` on batch (every row new), timed: tokens, seconds, decode seconds and steps, captures, peak."""
    from sampler import ModelAgent
    from sampler.static import static_decoder
    kw = WAYS[way]
    decoder = static_decoder(model, kw["sample_weights"]) if kw["decode"] == "static" else None
    captures, capture_s = (decoder.captures, decoder.capture_s) if decoder else (0, 0.0)
    agent = ModelAgent(model, tok, temperature=1.0, max_new_tokens=new, kv_budget=budget, **kw)
    clock = timed_decode(agent, cuda)
    sync(cuda)
    # what is held besides the sampler: the weights (and bf16's copy), not the decoder's reusable buffers
    held = torch.cuda.memory_allocated() - (decoder.held_bytes() if decoder else 0) if cuda else 0
    torch.cuda.reset_peak_memory_stats() if cuda else None
    torch.manual_seed(0)
    t0 = time.perf_counter()
    outs = agent.act(batch)
    sync(cuda)
    seconds = time.perf_counter() - t0
    captures, capture_s = (decoder.captures - captures, decoder.capture_s - capture_s) if decoder else (0, 0.0)
    tokens = sum(len(ids) for ids, _ in outs)
    decode_s = clock["seconds"] - capture_s
    return dict(way=way, rows=len(batch), tokens=tokens, seconds=seconds - capture_s, decode_s=decode_s,
                steps=clock["steps"], tok_s=tokens / decode_s, round_tok_s=tokens / (seconds - capture_s),
                step_ms=decode_s / max(clock["steps"], 1) * 1e3, waves=len(agent.waves), captures=captures,
                capture_s=capture_s, graph_error=decoder.graph_error if decoder else None,
                peak_gib=(torch.cuda.max_memory_allocated() - held) / GIB if cuda else None, budget_gib=budget / GIB, ok=all(ids for ids, _ in outs) and all(
                    math.isfinite(x) and x <= 1e-6 for _, lps in outs for x in lps))


def rows_of(model, tok, cuda, part, check, budget, batches, new):
    from sampler.static import copy_bytes, static_decoder
    for way in WAYS:
        if way == "static bf16":                     # its copy, made once a run (dequantize + merge every projection)
            sync(cuda)
            t0 = time.perf_counter()
            static_decoder(model, "bf16")
            sync(cuda)
            part["bf16_copy"] = dict(seconds=time.perf_counter() - t0, gib=copy_bytes(model) / GIB)
            print(f"  static bf16: its copy of the projections, {part['bf16_copy']['gib']:.2f} GiB, made in "
                  f"{part['bf16_copy']['seconds']:.2f} s", flush=True)
        for rows, batch in batches.items():
            r = one_round(model, tok, way, batch, new, budget, cuda)
            part["rows"].append(r)
            print(f"  {way:<11} {rows:>2} rows: {r['tokens']} tokens, decode {r['tok_s']:.0f} tok/s "
                  f"({r['step_ms']:.1f} ms "
                  f"a step, {r['steps']} steps), round {r['round_tok_s']:.0f} tok/s in {r['seconds']:.2f} s, "
                  f"{r['waves']} wave(s); {r['captures']} CUDA graph(s) captured in {r['capture_s']:.2f} s"
                  + (f"; peak {r['peak_gib']:.2f} GiB above the weights (budget {r['budget_gib']:.2f})"
                     if cuda else ""),
                  flush=True)
            check(part, f"{way} {rows} rows: every row sampled, log-probs finite and <= 0", r["ok"],
                  f"{r['tokens']} tokens")
            if cuda and way != "eager":
                check(part, f"{way} {rows} rows: decoded as CUDA graphs", not r["graph_error"],
                      r["graph_error"] or f"{r['captures']} captured")
        gc.collect()                                 # the way's agents and decoder go before the next way's
        torch.cuda.empty_cache() if cuda else None


def _category(name: str) -> str:
    n = name.lower()
    if "dequant" in n or "4bit" in n:                                # bitsandbytes' dequantize / 4-bit gemv
        return "4-bit matmuls"
    if "gemm" in n or "gemv" in n or "cutlass" in n or "matmul" in n or "sm90_xmma" in n or "nvjet" in n:
        return "other matmuls (LoRA, lm_head, bf16 copy, attention bmm)"
    if "flash" in n or "attention" in n or "fmha" in n or "softmax" in n:
        return "attention"
    return "the rest (norms, rotary, elementwise, copies, sampling)"


def kernel_split(model, tok, batch, budget, new, way, cuda) -> dict:
    """One round under torch.profiler -> ms by kind of GPU kernel, the wall time no kernel fills (Python, launches,
    syncs) and the count of device-to-host copies (host syncs). On CPU: CPU op time by the same kinds."""
    from torch.profiler import ProfilerActivity, profile
    from sampler import ModelAgent
    agent = ModelAgent(model, tok, temperature=1.0, max_new_tokens=new, kv_budget=budget, **WAYS[way])
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    torch.manual_seed(0)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        agent.act(batch)
        sync(cuda)
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


def profile_of(model, tok, cuda, part, budget, batches, new):
    rows = max(batches)
    for way in [w for w in WAYS if w != "eager"]:   # the eager round's split is issue 64's: 72% no kernel running
        split = kernel_split(model, tok, batches[rows], budget, new, way, cuda)
        part["profile"].append(dict(way=way, rows=rows, **split))
        print(f"  {way} {rows} rows, one round under the profiler, {split['wall_ms']:.0f} ms: " + "; ".join(
            f"{k} {v:.0f} ms" for k, v in split["ms"].items()) + f"; {split['host_syncs']} host syncs", flush=True)
        gc.collect()


def logprob_mismatch(model, tok, part, check, batch):
    """Each way's sampled log-probs of 8 rows against the training forward's on the same tokens, T = 1."""
    from common import sequence_logprobs
    from sampler import ModelAgent
    for way, kw in WAYS.items():
        torch.manual_seed(0)
        outs = ModelAgent(model, tok, temperature=1.0, max_new_tokens=32, **kw).act(batch)
        deltas = []
        with torch.no_grad():
            for (_, _, ids), (new, lps) in zip(batch, outs):
                seq = torch.tensor([ids + new], device=model.device)
                mask = torch.zeros_like(seq)
                mask[0, len(ids):] = 1
                train = sequence_logprobs(model, seq, torch.ones_like(seq), mask.bool())[0, len(ids):]
                deltas += (train.float().cpu() - torch.tensor(lps)).abs().tolist()
        part["logprobs"][way] = dict(tokens=len(deltas), max=max(deltas), mean=sum(deltas) / len(deltas))
        print(f"  log-probs, {way} sampler vs the training forward, {len(deltas)} tokens: max |delta| "
              f"{max(deltas):.3e}, mean {part['logprobs'][way]['mean']:.3e}", flush=True)
        check(part, f"{way} vs training log-probs: finite", all(math.isfinite(d) for d in deltas),
              f"max {max(deltas):.2e}")
        gc.collect()


def part_decode(args, ctx, part, check, budget, batch, new):
    """Each step in turn; one that raises is a failed check, and the next still runs (one GPU try is all there is)."""
    cuda = not args.cpu
    batches = {rows: batch(rows) for rows in (ROWS if cuda else (8,))}     # the same rows for every way
    part.update(rows=[], profile=[], logprobs={})
    for name, step in (("rows", lambda: rows_of(ctx.model, ctx.tok, cuda, part, check, budget, batches, new)),
                       ("profile", lambda: profile_of(ctx.model, ctx.tok, cuda, part, budget, batches, new)),
                       ("logprobs", lambda: logprob_mismatch(ctx.model, ctx.tok, part, check, batches[min(batches)]))):
        try:
            step()
        except Exception as e:
            traceback.print_exc()
            check(part, f"{name} ran", False, f"{type(e).__name__}: {str(e)[:300]}")
        gc.collect()
        torch.cuda.empty_cache() if cuda else None


def verdict(ok: bool, word: str = "SHORT") -> str:
    return "OK" if ok else word


def decode_rows(part):
    out = []
    if "bf16_copy" in part:
        out.append(("decode: static bf16's copy of the projections, GiB / seconds to make",
                    f"{part['bf16_copy']['gib']:.2f} / {part['bf16_copy']['seconds']:.2f}", "once a run"))
    for r in part.get("rows", []):
        targets = []
        if r["way"] != "eager" and r["peak_gib"] is not None:
            if r["rows"] >= 32:
                targets.append(f"decode >= {TARGET_TOK_S} tok/s: {verdict(r['tok_s'] >= TARGET_TOK_S)}")
            if r["rows"] == 8:
                targets.append(f"step <= {TARGET_STEP_MS} ms: {verdict(r['step_ms'] <= TARGET_STEP_MS)}")
        if r["peak_gib"] is not None:
            targets.append(f"peak {r['peak_gib']:.2f} <= budget {r['budget_gib']:.2f} GiB: "
                           + verdict(r["peak_gib"] <= r["budget_gib"], "OVER"))
        out.append((f"decode {r['way']} {r['rows']} rows: decode tok/s, ms a step, round tok/s, waves, graphs (s)",
                    f"{r['tok_s']:.0f}, {r['step_ms']:.1f}, {r['round_tok_s']:.0f}, {r['waves']}, "
                    f"{r['captures']} ({r['capture_s']:.1f})", "; ".join(targets)))
    for p in part.get("profile", []):
        out.append((f"  where a {p['way']} round's {p['wall_ms']:.0f} ms went ({p['rows']} rows)",
                    "; ".join(f"{k} {v:.0f}" for k, v in p["ms"].items()), f"{p['host_syncs']} host syncs"))
    for way, lp in part.get("logprobs", {}).items():
        out.append((f"decode: {way} sampler vs training log-probs, max / mean |delta|",
                    f"{lp['max']:.2e} / {lp['mean']:.2e}", f"{lp['tokens']} tokens"))
    return out
