"""The plain sampler (sampler.sample_turn / PlainAgent) is the reference; the fast one (ModelAgent: KV kept
between rounds, the shared system prompt once, waves, LoRA merged while sampling) must equal it.

Greedy: the same conversations token for token through run_episodes, with a LoRA adapter on, over several
rounds (so the fast path reuses its caches), in one batch and in waves. Sampled: every stored log-prob of
either sampler equals a teacher-forced recomputation of the policy on the final token ids."""
import contextlib
import copy
import time

import pytest
import torch

from envs import ours
from rollout import run_episodes
from sampler import ModelAgent, PlainAgent, sample_turn


def tasks():
    return [t for d in ours.DOMAINS for t in ours.make_tasks(d, "train", 2)]


def test_sample_turn_greedy_is_argmax_of_a_full_forward(tiny, tok):
    ids = tok("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    new, lps = sample_turn(tiny, ids, max_new_tokens=6, temperature=0.0, end_id=2)
    seq = list(ids)
    for t in new:                                     # no cache: the whole sequence each step
        with torch.no_grad():
            assert t == int(tiny(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(t)
    assert len(new) == len(lps) and (new[-1] == 2 or len(new) == 6)


@pytest.mark.parametrize("waves", [False, True])
def test_fast_sampler_equals_the_plain_one_greedy(tiny_lora, tok, waves):
    """Token for token, message for message: the plain reference and the optimised sampler, greedy, on the same
    tasks and users over up to 3 agent turns; with waves, a KV budget of a few rows' worth forces them."""
    from sampler.attention import kv_bytes_per_token
    kv_budget = 5000 * kv_bytes_per_token(tiny_lora.config, torch.float32) if waves else None
    runs = {}
    for name, agent in (("plain", PlainAgent(tiny_lora, tok, temperature=0.0, max_new_tokens=8)),
                        ("fast", ModelAgent(tiny_lora, tok, temperature=0.0, max_new_tokens=8, kv_budget=kv_budget))):
        runs[name] = run_episodes(agent, tok, tasks(), group_size=2, max_turns=3, progress=False, seed=1,
                                  max_context=8192)
    assert sum(t.turns for t in runs["plain"]) > len(runs["plain"])      # several rounds: caches were reused
    for a, b in zip(runs["plain"], runs["fast"]):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.messages == b.messages
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def cpu_preset_tasks():
    """The CPU preset's training tasks (common.CPU_TIERS), 4 a domain: a step's draw."""
    import common
    return [t for d in ours.DOMAINS for t in ours.make_tasks(d, "train", 40, common.CPU_TIERS.split(","))[:4]]


def at_training_temperature(tiny):
    """The tiny model with LoRA, its end-of-turn bias scaled by 0.7, so that at T = 0.7 a turn still ends after ~4
    tokens (the fixture's bias is set for T = 1)."""
    from conftest import with_lora
    model = copy.deepcopy(tiny)
    model.lm_head.bias.data[2] *= 0.7
    return with_lora(model)


def test_fast_sampler_equals_the_plain_one_at_the_training_temperature(tiny, tok):
    """At T = 0.7, rl.py's CPU temperature: 16 conversations of the CPU preset's tasks (8 tasks x 2 trials), every
    turn, token for token. Each conversation draws from its own stream, one uniform a token, and both samplers turn
    a uniform into a token by the same rule (plain.sample_next). Their logits differ in the last bits (the fast one
    merges the LoRA and packs rows), so a token could split only where a uniform falls within that difference of a
    boundary between two tokens' cumulative probabilities: with |delta log p| below 1e-5 (checked here on the
    sampled tokens; ~2e-6 measured), under 1e-5 a token, about 0.003 over this test's ~300 tokens. It allows none."""
    policy = at_training_temperature(tiny)
    runs = {name: run_episodes(agent, tok, cpu_preset_tasks(), group_size=2, max_turns=4, progress=False, seed=7,
                               max_context=8192)
            for name, agent in (("plain", PlainAgent(policy, tok, temperature=0.7, max_new_tokens=12)),
                                ("fast", ModelAgent(policy, tok, temperature=0.7, max_new_tokens=12)))}
    sampled = sum(sum(t.loss_mask) for t in runs["plain"])
    assert len(runs["plain"]) == 16 and sum(t.turns for t in runs["plain"]) > 16 and sampled > 200
    for a, b in zip(runs["plain"], runs["fast"]):
        assert a.token_ids == b.token_ids and a.messages == b.messages
    gap = max(abs(x - y) for a, b in zip(runs["plain"], runs["fast"]) for x, y in zip(a.logprobs, b.logprobs))
    print(f"{sampled} tokens sampled at T = 0.7, the same in both; max |delta log p| {gap:.1e}")
    assert gap < 1e-5


def test_a_conversations_tokens_do_not_depend_on_its_batch(tiny, tok):
    """One conversation sampled alone and among seven others (both samplers, T = 0.7): the same tokens, since its
    uniforms come from its own stream (seed, task, trial), not from a stream the batch shares."""
    tasks, policy = cpu_preset_tasks(), at_training_temperature(tiny)
    for agent in (PlainAgent(policy, tok, temperature=0.7, max_new_tokens=12),
                  ModelAgent(policy, tok, temperature=0.7, max_new_tokens=12)):
        crowd = run_episodes(agent, tok, tasks, max_turns=3, progress=False, seed=3, max_context=8192)
        alone = run_episodes(agent, tok, tasks[5:6], max_turns=3, progress=False, seed=3, max_context=8192)
        assert crowd[5].token_ids == alone[0].token_ids
        assert crowd[4].token_ids != crowd[5].token_ids          # and the others drew other tokens


def test_forget_empties_the_memo_and_changes_no_token(tiny_lora, tok):
    """rl.py makes the sampler forget its remembered keys/values before each update. An agent that forgets after
    every round (each next round prefilled from the shared prefix again) samples the same turns as one that
    remembers, greedy, over 3 rounds."""
    class Forgetful(ModelAgent):
        def act(self, batch):
            out = super().act(batch)
            assert self.memo
            self.forget()
            assert self.memo == []
            return out
    runs = [run_episodes(cls(tiny_lora, tok, temperature=0.0, max_new_tokens=8), tok, tasks(), group_size=2,
                         max_turns=3, progress=False, seed=1, max_context=8192) for cls in (ModelAgent, Forgetful)]
    assert sum(t.turns for t in runs[0]) > len(runs[0])
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids and a.messages == b.messages


@pytest.mark.parametrize("make", [lambda m, tok: PlainAgent(m, tok, temperature=1.3, max_new_tokens=6),
                                  lambda m, tok: ModelAgent(m, tok, temperature=1.3, max_new_tokens=6)],
                         ids=["plain", "fast"])
def test_sampled_logprobs_equal_a_teacher_forced_recomputation(tiny_lora, tok, make):
    torch.manual_seed(0)
    trajs = run_episodes(make(tiny_lora, tok), tok, tasks()[:2], group_size=2, max_turns=3, progress=False, seed=2,
                         max_context=8192)
    gaps = []
    for t in trajs:
        ids = torch.tensor(t.token_ids)
        with torch.no_grad():
            logp = torch.log_softmax(tiny_lora(ids[None]).logits[0, :-1].float() / 1.3, -1).gather(-1, ids[1:, None])[:, 0]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)      # token j + 1 is predicted at position j
        gaps.append((logp[mask] - torch.tensor(t.logprobs[1:])[mask]).abs())
    gap = torch.cat(gaps)
    print(f"max |sampled - teacher-forced| log-prob: {gap.max():.2e} over {gap.numel()} tokens")
    assert gap.numel() > 10 and gap.max() < 1e-4


def test_the_bench_profile_accounts_for_the_seconds_and_leaves_nothing_behind(tiny_lora, tok):
    """sampler.bench.Profile (what `python -m sampler.bench --bench` prints): its timers nest (no part is negative, so nothing
    is counted twice: a forward is prefill or decode, never both), the decode parts are not empty, the profiled run
    samples the same tokens as an unprofiled one, and afterwards the model, nn.Linear and the attention registry are
    as they were."""
    from transformers import AttentionInterface

    from sampler.attention import shared_prefix_attention
    from sampler.bench import Profile
    linear, runs = torch.nn.Linear.forward, {}
    for profiled in (False, True):
        agent = ModelAgent(tiny_lora, tok, temperature=1.0, max_new_tokens=6)
        torch.manual_seed(0)
        with Profile(agent) if profiled else contextlib.nullcontext() as prof:
            t0 = time.perf_counter()
            runs[profiled] = run_episodes(agent, tok, tasks(), group_size=2, max_turns=2, progress=False, seed=1,
                                          max_context=8192)
            total = time.perf_counter() - t0
    parts = [float(line.split()[-3]) for line in prof.report(total).splitlines()]
    print(prof.report(total))
    assert abs(sum(parts) - total) < 0.05 * total + 0.2 and all(p > -0.05 for p in parts)
    s = prof.s
    assert s["prefill"] + s["sample"] <= s["agent"] <= total and s["decode"] <= s["sample"]
    assert s["weight matmuls"] + s["attention"] + s["own sampled"] <= s["decode"] and s["own sampled"] > 0
    assert prof.s["decode"] > 0 and prof.s["weight matmuls"] > 0 and prof.s["attention"] > 0 and prof.calls > 10
    assert [t.token_ids for t in runs[True]] == [t.token_ids for t in runs[False]]
    assert torch.nn.Linear.forward is linear and "forward" not in vars(tiny_lora) and "act" not in vars(agent)
    assert AttentionInterface()["shared_prefix"] is shared_prefix_attention
