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

from rollout import AgentTurn
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
    return [AgentTurn(None, system, shared + torch.randint(0, 2048, (int(torch.randint(*own, (1,), generator=g)),),
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


def qwen3_8b():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


def test_the_memory_plan_of_qwen3_8b_fits_a_24_gib_card_with_nf4_and_refuses_what_cannot_fit(capsys):
    """The plan rl.py prints on a GPU before the model loads (sampler/memory.py), for Qwen3-8B's config on a simulated
    24 GiB card at the GPU preset's 8k context: weights 5.82 GiB (the H100's measured 5.82), nf4 sampling weights
    (bf16's 12.94 GiB copy would not leave the update its reserve), a round's keys/values in the 12 GiB left, and
    the update's 6 GiB reserve: it fits. bf16 sampling weights there, or a KV budget of 20 GiB, cannot: one line
    naming the way out, exit 2 (common.say_memory_plan, as rl.py calls it)."""
    from types import SimpleNamespace

    import common
    from sampler import ModelAgent
    from sampler.memory import memory_plan
    GiB = 2**30
    config, reserve = qwen3_8b(), ModelAgent.KV_RESERVE
    line, error = memory_plan(config, 24 * GiB, True, "auto", None, 8192, 16, reserve)
    print(line)
    assert error is None and "weights 5.82 GiB" in line and "sampling copy 0.00 (nf4)" in line
    assert "KV budget 12.18 (auto)" in line and line.endswith("= 24.00 GiB")
    line80, _ = memory_plan(config, 80 * GiB, True, "auto", None, 8192, 16, reserve)
    assert "sampling copy 12.94 (bf16)" in line80                    # an 80 GiB card takes the copy (docs/gpu.md)
    args = SimpleNamespace(load_in_4bit=True, sample_weights="nf4", kv_budget=8.0, max_context=8192)
    common.say_memory_plan(args, config, 24 * GiB)
    for change, way_out in ((dict(sample_weights="bf16", kv_budget=0.0), "use --sample-weights nf4"),
                            (dict(kv_budget=20.0), "use a --kv-budget of at most 12.18")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            common.say_memory_plan(SimpleNamespace(**{**vars(args), **change}), config, 24 * GiB)
        err = capsys.readouterr().err.strip().splitlines()
        print(err)
        assert stop.value.code == 2 and len(err) == 1 and ": memory: " in err[0] and way_out in err[0]
