"""The sampler's KV budget counts everything it allocates: ModelAgent.act's peak of allocated bytes (torch's
profiler, every CPU allocation and free in time order) stays within --kv-budget, on a tiny Qwen3 with the GPU
check's workload (one system prompt shared by every row, own parts of different lengths, every row new), in
one wave with the rows' keys/values kept and in several waves, with the eager decode loop and with the static step
(sampler/static.py: its buffer, reused from wave to wave and rounded up to its buckets, counted as plan_waves does;
its own copy of the shared prefix). The old arithmetic (keys/values only, and every
prefill batch's keys/values alive at once beside the decode buffer) went over the same budget: tested too, so
this test can tell the two apart."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import sampler.attention
import sampler.static
from sampler import ModelAgent

MiB = 2**20


def peak_allocated(fn):
    """(bytes allocated at the peak above the start while fn runs, fn's result): the running sum of the profiler's
    [memory] records (+ allocation, - free)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = peak = 0
    for _, n in records:
        now += n
        peak = max(peak, now)
    return peak, out


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def workload(rows, seed=0, prefix=300, own=(100, 400)):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 2048, (prefix,), generator=g).tolist()
    system = [{"role": "system", "content": "one system prompt for every row"}]
    return [(None, system, shared + torch.randint(0, 2048, (int(torch.randint(*own, (1,), generator=g)),),
                                                  generator=g).tolist()) for _ in range(rows)]


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("rows, budget_mib, waves", [(8, 40, 1), (24, 24, 3)])
def test_peak_stays_within_the_kv_budget(qwen3, tok, rows, budget_mib, waves, decode):
    sampler.static._decoders.pop(qwen3, None)        # a static decoder from an earlier test would hold its buffer
    agent = ModelAgent(qwen3, tok, temperature=1.0, max_new_tokens=16, kv_budget=budget_mib * MiB, decode=decode)
    torch.manual_seed(0)
    peak, outs = peak_allocated(lambda: agent.act(workload(rows)))
    print(f"{decode}, {rows} rows, budget {budget_mib} MiB: {len(agent.waves)} wave(s) of {[len(w) for w in agent.waves]}, "
          f"rows kept {agent.keeps_rows}; peak {peak / MiB:.2f} MiB = {peak / (budget_mib * MiB):.0%} of the budget")
    assert all(ids for ids, _ in outs)
    assert len(agent.waves) >= waves and agent.keeps_rows == (waves == 1)
    assert peak <= budget_mib * MiB


def test_the_old_arithmetic_went_over_the_same_budget(qwen3, tok, monkeypatch):
    """Keys/values only, each round's prefill held whole: the plan packs more rows a wave and the peak passes the
    budget. (The sampler's chunked prefill is undone by one prefill chunk of every row.)"""
    monkeypatch.setattr("sampler.fast.sampler_scratch", lambda *a, **kw: (0, 0, 0))
    monkeypatch.setattr(sampler.attention, "PREFILL_TOKENS", 10**9)
    budget = 6 * MiB
    agent = ModelAgent(qwen3, tok, temperature=1.0, max_new_tokens=16, kv_budget=budget)
    torch.manual_seed(0)
    peak, _ = peak_allocated(lambda: agent.act(workload(24)))
    print(f"old arithmetic: {[len(w) for w in agent.waves]} rows a wave, peak {peak / MiB:.2f} MiB "
          f"= {peak / budget:.0%} of the {budget / MiB:.0f} MiB budget")
    assert peak > budget
