"""Tests for rl.py: the GRPO pieces on hand-computed numbers, a tiny random Llama + LoRA for
the KL / gradient-mask / update checks, then a 2-step --smoke run and a real SIGKILL resume."""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import common
import rl as rl_module
from kernels.passes import cut_shared_prefix, micro_batches, reference_policy
from rl import group_advantages, grpo_loss, has_signal


def batch_trajectories(trajs, pad_id):
    """All rows in one right-padded micro-batch: (ids, attention mask, loss mask), each (B, T)."""
    b = micro_batches([t.token_ids for t in trajs], [t.loss_mask for t in trajs], len(trajs), pad_id)[0]
    return b.ids, b.attn, b.mask

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- pure functions

def two_groups_advantages():
    """The advantages of two groups of two rollouts, rewards (1, 0) and (0, 1): the rows of the tiny updates below."""
    return torch.cat([group_advantages(torch.tensor([1.0, 0.0])), group_advantages(torch.tensor([0.0, 1.0]))])


def test_group_advantages_normalise_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0,   1.0, 1.0, 0.0, 0.0])   # two groups of G=4
    adv = torch.cat([group_advantages(r[:4], eps=0.0), group_advantages(r[4:], eps=0.0)])
    # group 0: mean 0.25, population std sqrt(0.25*0.75)=0.4330
    s = math.sqrt(0.25 * 0.75)
    assert torch.allclose(adv[:4], torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]))
    assert torch.allclose(adv[4:], torch.tensor([1.0, 1.0, -1.0, -1.0]))
    assert torch.allclose(adv.view(2, 4).mean(1), torch.zeros(2), atol=1e-6)


def test_zero_variance_groups_have_no_signal_and_zero_advantage():
    r = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.5])     # G=2: groups (0,0) (1,1) (1,0) (.5,.5)
    adv = torch.cat([group_advantages(r[i:i + 2]) for i in range(0, 8, 2)])
    groups = [[SimpleNamespace(reward=x) for x in r[i:i + 2].tolist()] for i in range(0, 8, 2)]
    assert [has_signal(g) for g in groups] == [False, False, True, False]
    assert adv[[0, 1, 2, 3, 6, 7]].abs().max().item() == 0.0
    assert adv[4].item() == pytest.approx(1.0, abs=1e-3) and adv[5].item() == pytest.approx(-1.0, abs=1e-3)


@pytest.mark.parametrize("first, finished", [([0, 1, 0, 0], [1]), ([1, 1, 0, 1], [2]), ([0, 0, 0, 0], []),
                                             ([0, 0.5, 0, 1], [1, 3]),
                                             ([1, 0, 1, 0], [1, 3])])
def test_screening_finishes_the_tasks_whose_first_rollout_got_a_rare_reward(first, finished, monkeypatch):
    """--screen 1: a task's group is finished when its first reward differs from the batch's most common one: a
    success among failures, a failure among successes, any shaped value off the mode. A rollout whose simulator
    failed (reward 0, failed) neither counts towards the mode nor finishes its task. A tie goes to the reward seen
    first."""
    calls = []

    def fake_draw(sampling, tasks, args, *, step, index, trials=None):
        calls.append(([t.id for t in tasks], trials))
        return [[SimpleNamespace(task_id=t.id, trial=g, failed="user" if t.id == "lost" else None, loss_mask=[1],
                                 reward=0.0 if t.id == "lost" or g else first[int(t.id)]) for g in range(*trials)]
                for t in tasks]
    ids = [str(i) for i in range(len(first))] + ["lost"]
    monkeypatch.setattr(rl_module, "sample_draw", fake_draw)
    groups = rl_module.screened(None, [SimpleNamespace(id=i) for i in ids], SimpleNamespace(screen=1, group_size=4),
                                step=0, index=0)
    assert calls == [(ids, (0, 1))] + ([([str(i) for i in finished], (1, 4))] if finished else [])
    assert [len(g) for g in groups] == [4 if i in finished else 1 for i in range(len(first))] + [1]
    assert all([t.trial for t in g] == list(range(len(g))) for g in groups)


def test_grpo_loss_matches_hand_computation():
    nan = 123.0                                        # garbage at masked positions must not matter
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    adv = torch.tensor([1.0, -1.0])
    logp = torch.tensor([[nan, -1.0, -2.0], [nan, -0.5, nan]], requires_grad=True)
    old = torch.tensor([[nan, -1.2, -2.0], [nan, -0.5, nan]])
    ref = torch.tensor([[nan, -1.0, -2.5], [nan, -0.3, nan]])
    loss, st = grpo_loss(logp, old, ref, adv, mask, clip=0.2, beta=0.1, agg="token-mean")
    # token a: ratio e^0.2 = 1.2214 > 1.2 and A = +1 -> clipped surrogate 1.2; KL d=0 -> 0
    # token b: ratio 1, A = +1 -> surrogate 1;  KL d = -0.5 -> e^-0.5 + 0.5 - 1 = 0.106531
    # token c: ratio 1, A = -1 -> surrogate -1; KL d = 0.2 -> e^0.2 - 0.2 - 1 = 0.021403
    kl_b, kl_c = math.exp(-0.5) + 0.5 - 1, math.exp(0.2) - 0.2 - 1
    expected = (-1.2 - 1.0 + 1.0 + 0.1 * (0.0 + kl_b + kl_c)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(-0.3957355, abs=1e-6)
    assert (st["clip_high"], st["clip_low"], st["tokens"]) == (1, 0, 3)   # token a: above the band, A > 0: binds
    assert st["kl_sum"] == pytest.approx(kl_b + kl_c, abs=1e-6)
    loss.backward()
    g = logp.grad
    # masked positions: exactly zero; clipped token with d=0: exactly zero (constant surrogate, KL' = 0)
    assert g[0, 0].item() == 0.0 and g[1, 0].item() == 0.0 and g[1, 2].item() == 0.0
    assert g[0, 1].item() == 0.0
    # token b: d/dlogp[-ratio*A + beta*(e^(ref-logp) - (ref-logp) - 1)] = -1 + 0.1*(1 - e^-0.5), over 3 tokens
    assert g[0, 2].item() == pytest.approx((-1.0 + 0.1 * (1 - math.exp(-0.5))) / 3, abs=1e-6)
    assert g[1, 1].item() == pytest.approx((1.0 + 0.1 * (1 - math.exp(0.2))) / 3, abs=1e-6)


def test_seq_mean_averages_each_rollouts_token_mean():
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    logp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    ref = torch.tensor([[0.0, -1.0, -2.5], [0.0, -0.3, 0.0]])
    loss, _ = grpo_loss(logp, logp, ref, torch.tensor([1.0, -1.0]), mask, clip=0.2, beta=0.1, agg="seq-mean")
    kl_b, kl_c = math.exp(-0.5) + 0.5 - 1, math.exp(0.2) - 0.2 - 1
    assert loss.item() == pytest.approx(((-1 - 1 + 0.1 * kl_b) / 2 + (1 + 0.1 * kl_c) / 1) / 2, abs=1e-6)


@pytest.mark.parametrize("agg, push", [("seq-mean", 0.0), ("token-mean", -1 / 3)])
def test_a_token_every_rollout_emits_gets_no_push_only_under_seq_mean(agg, push):
    """One group: the success is 2 tokens long, the failure 4 (it looped), and every token is the same
    format token at the same probability. Advantages sum to 0, so the format should not move: seq-mean
    leaves its log-prob alone; token-mean pushes it down by sum_i A_i |o_i| / sum_i |o_i| = (2 - 4) / 6."""
    logp = torch.tensor(math.log(0.5), requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    per_token = logp.expand(2, 4)
    loss, _ = grpo_loss(per_token, per_token.detach(), per_token.detach(), torch.tensor([1.0, -1.0]), mask,
                        clip=0.2, beta=0.0, agg=agg)
    loss.backward()
    assert -logp.grad.item() == pytest.approx(push, abs=1e-7)      # gradient descent moves logp by -grad


def test_negative_advantage_clips_low_side():
    mask = torch.ones(1, 1)
    loss, st = grpo_loss(torch.tensor([[math.log(0.5)]]), torch.zeros(1, 1), torch.zeros(1, 1),
                         torch.tensor([-1.0]), mask, clip=0.2, beta=0.0, agg="token-mean")
    assert loss.item() == pytest.approx(0.8) and (st["clip_low"], st["clip_high"]) == (1, 0)   # min(-0.5, -0.8)


def test_the_clip_is_counted_only_where_it_binds_on_the_advantages_side():
    """TRL's clip_ratio: a ratio past 1 + eps binds only when A > 0 (the surrogate would grow it further), past
    1 - eps only when A < 0; on the other side the min keeps the unclipped term and its gradient. Four rows, one
    token each: ratio 1.5 and 0.5, each with A = +1 and A = -1; and a fifth, ratio 1, which never binds."""
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    logp = ratio.log()[:, None].requires_grad_()
    zeros = torch.zeros(5, 1)
    _, st = grpo_loss(logp, zeros, zeros, adv, torch.ones(5, 1), clip=0.2, beta=0.0, agg="token-mean")
    assert (st["clip_high"], st["clip_low"], st["tokens"]) == (1, 1, 5)        # rows 0 and 3, not rows 1 and 2
    loss, _ = grpo_loss(logp, zeros, zeros, adv, torch.ones(5, 1), clip=0.2, beta=0.0, agg="token-mean")
    loss.backward()
    bound = logp.grad[:, 0] == 0                                               # where it binds, no gradient
    assert bound.tolist() == [True, False, False, True, False]


def test_micro_batches_keep_a_keys_rows_together_and_the_fast_pass_cuts_its_prefix_once():
    """Rows of one key (domain) go into micro-batches together, shortest first; cut_shared_prefix cuts the
    untrained prefix they share off every row and keeps it once, one tensor for the key, for the fast pass."""
    sys_a, sys_b = [9, 8, 7, 6], [5, 4, 3]
    ids = [sys_a + [1, 2], sys_b + [1], sys_a + [3], sys_a + [4, 5, 6]]
    masks = [[0] * 4 + [1, 1], [0] * 3 + [1], [0] * 4 + [1], [0] * 4 + [1, 1, 1]]
    micro = micro_batches(ids, masks, 2, 0, keys=["a", "b", "a", "a"], shortest_first=True)
    assert [b.rows for b in micro] == [[1], [2, 0], [3]] and [b.key for b in micro] == ["b", "a", "a"]
    assert micro[1].ids.tolist() == [sys_a + [3, 0], sys_a + [1, 2]] and micro[1].attn.tolist()[0] == [1] * 5 + [0]
    assert all(b.prefix is None for b in micro)
    cut = cut_shared_prefix(micro)
    assert [b.prefix.tolist() for b in cut] == [[5, 4]] + [[9, 8, 7]] * 2    # minus one: the last predicts row 1
    assert cut[1].prefix is cut[2].prefix                                      # one tensor, run once a pass
    assert cut[1].ids.tolist() == [[6, 3, 0], [6, 1, 2]] and cut[1].mask.tolist() == [[0, 1, 0], [0, 1, 1]]
    assert [b.rows for b in micro_batches(ids, masks, 4, 0)] == [[0, 1, 2, 3]]    # no keys, as given


def test_collate_masks_from_positions_not_pad_ids():
    eos = 2                                            # pad == eos: the trained end-of-turn token is id 2 too
    a = SimpleNamespace(token_ids=[5, 6, 7, eos], loss_mask=[0, 0, 1, 1])
    b = SimpleNamespace(token_ids=[5, eos], loss_mask=[0, 1])
    ids, attn, mask = batch_trajectories([a, b], pad_id=eos)
    assert ids.tolist() == [[5, 6, 7, eos], [5, eos, eos, eos]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


# ---------------------------------------------------------------- tiny model + LoRA

def tiny_lora_model(seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def fake_trajs(n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = 10 + 3 * i
        ids = torch.randint(3, 64, (T,), generator=g).tolist()
        out.append(SimpleNamespace(token_ids=ids, loss_mask=[0] * 5 + [1] * (T - 5), domain=None))
    return out


ARGS = SimpleNamespace(micro_batch=2, mini_batches=1, temperature=1.0, clip=0.2, kl_coef=0.1, max_grad_norm=1.0,
                      grad_checkpointing="off", loss_agg="token-mean", train_bf16="off", logprob_pass="fast",
                      load_in_4bit=False, kv_budget=0.0, sample_weights="auto")


def update(model, opt, trajs, adv, args, pad_id=2, seed=0):
    """rl.grpo_step's update on these rollouts with these advantages: the rollouts handed in as one group (rewards
    that differ, so it trains), group_advantages giving the advantages given; the mini-batches' seed is `seed`
    (args.seed 0, step `seed`); the device set up from args, as rl.py's main sets it up. -> the update's sums."""
    group = [SimpleNamespace(**vars(t), reward=i, failed="") for i, t in enumerate(trajs)]
    sampling = rl_module.Sampling(None, SimpleNamespace(pad_token_id=pad_id), None)
    args = SimpleNamespace(**{**vars(args), "seed": 0, "tasks": 1, "rollouts": None})
    with mock.patch.object(rl_module, "group_advantages", lambda rewards: adv):
        return rl_module.grpo_step(model, opt, sampling, {}, seed, args=args, setup=common.setup_device(args),
                                   groups=[group]).stats


def test_kl_is_zero_when_policy_equals_reference_then_positive_after_update():
    from kernels.passes import sequence_logprobs
    model = tiny_lora_model()                           # fresh LoRA: B = 0, so policy == reference
    trajs = fake_trajs()
    ids, attn, mask = batch_trajectories(trajs, pad_id=2)
    with torch.no_grad():
        pol = sequence_logprobs(model, ids, attn, mask)
        with model.disable_adapter():
            ref = sequence_logprobs(model, ids, attn, mask)
    _, st = grpo_loss(pol, pol, ref, torch.ones(4), mask, clip=0.2, beta=0.001, agg="token-mean")
    assert st["kl_sum"] == 0.0
    adv = two_groups_advantages()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = update(model, opt, trajs, adv, ARGS, pad_id=2, seed=0)
    assert total["kl_sum"] == 0.0 and total["tokens"] == int(mask.sum()) and total["updates"] == 1
    assert total["grad_norm"] > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)        # only the adapter trains
    total2 = update(model, opt, trajs, adv, ARGS, pad_id=2, seed=0)
    assert total2["kl_sum"] / total2["tokens"] > 0.0


def test_an_update_makes_rewarded_rollouts_likelier_than_unrewarded_ones():
    """The sign of the whole path (advantages -> loss -> shared-prefix backward -> optimizer): after one
    small SGD step, sum_i adv_i * log p(rollout i) goes up, i.e. the rewarded rollouts of each group
    gain on the unrewarded ones. The rollouts share their prompt, so the shared-prefix pass is used."""
    from kernels.passes import sequence_logprobs
    model = tiny_lora_model()
    for n, p in model.named_parameters():              # non-zero B: A gets gradient too
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    trajs = fake_trajs()
    for t in trajs[1:]:
        t.token_ids[:5] = trajs[0].token_ids[:5]
    ids, attn, mask = batch_trajectories(trajs, pad_id=2)
    adv = two_groups_advantages()

    def score():
        with torch.no_grad():
            return float((adv * (sequence_logprobs(model, ids, attn, mask) * mask).sum(1)).sum())
    before = score()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    update(model, opt, trajs, adv, ARGS, pad_id=2, seed=0)
    after = score()
    print(f"sum adv * log p: {before:.4f} -> {after:.4f}")
    assert after > before + 1e-3
    update(model, opt, trajs, -adv, ARGS, pad_id=2, seed=0)    # the opposite rewards undo it
    assert score() < after - 1e-3


def sft_policy_and_reference(tmp_path):
    """rl.load_policy's layout for --init <SFT adapter>: a trained adapter (non-zero B, far from the base)
    as the trainable "default", and a frozen copy of it as "ref"."""
    from peft import PeftModel
    sft = tiny_lora_model()
    for n, p in sft.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(p.numel()), std=0.5)
    sft.save_pretrained(tmp_path / "sft")
    base = sft.unload()                                 # the same random base without LoRA layers
    model = PeftModel.from_pretrained(base, tmp_path / "sft", is_trainable=True)
    model.load_adapter(tmp_path / "sft", adapter_name="ref", is_trainable=False)
    return model


def test_reference_is_the_frozen_starting_adapter_not_the_base(tmp_path):
    """From an SFT adapter the KL reference is that adapter, frozen (peft's "ref" beside the trained
    "default"): KL is 0 at the first update though the adapter is far from the base, rises after it,
    and the reference's weights never move."""
    model = sft_policy_and_reference(tmp_path)
    trajs = fake_trajs()
    ids, attn, mask = batch_trajectories(trajs, pad_id=2)
    with torch.no_grad():
        from kernels.passes import sequence_logprobs
        pol = sequence_logprobs(model, ids, attn, mask)
        with model.disable_adapter():
            off = sequence_logprobs(model, ids, attn, mask)
    _, st = grpo_loss(pol, pol, off, torch.ones(4), mask, clip=0.2, beta=0.001, agg="token-mean")
    assert st["kl_sum"] / st["tokens"] > 1e-3          # the adapter-off base would NOT read 0
    ref_before = {n: p.detach().clone() for n, p in model.named_parameters() if ".ref." in n}
    assert ref_before and not any(p.requires_grad for n, p in model.named_parameters() if ".ref." in n)
    adv = two_groups_advantages()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = update(model, opt, trajs, adv, ARGS, pad_id=2, seed=0)
    print(f"KL at the first update {first['kl_sum'] / first['tokens']:.2e} (adapter-off base: "
          f"{st['kl_sum'] / st['tokens']:.3f})")
    assert first["kl_sum"] / first["tokens"] < 1e-6
    second = update(model, opt, trajs, adv, ARGS, pad_id=2, seed=0)
    assert second["kl_sum"] / second["tokens"] > 1e-4
    assert all(torch.equal(p, ref_before[n]) for n, p in model.named_parameters() if ".ref." in n)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)      # reference_policy() restored them
    with reference_policy(model), torch.no_grad():      # and it still computes the starting policy
        assert torch.allclose(sequence_logprobs(model, ids, attn, mask), pol, atol=1e-6)


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_skipping_the_reference_pass_before_the_first_step_is_exact(tmp_path, mini_batches):
    """Before RL's first optimizer step the policy is its reference, so rl.py skips the reference pass
    (until the optimizer holds a state): the update and the logged KL are the ones the pass gives."""
    trajs, adv = fake_trajs(), torch.tensor([1.0, -1.0, 0.5, -0.5])
    runs = {}
    for skip in (False, True):
        model = sft_policy_and_reference(tmp_path / str(skip))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1.0)                                   # update = gradient
        if not skip:                            # a state, as after a step (plain SGD keeps none): the pass is taken
            opt.state[params[0]]["as if a step was taken"] = True
        st = update(model, opt, trajs, adv, SimpleNamespace(**{**vars(ARGS), "mini_batches": mini_batches}),
                    pad_id=2, seed=0)
        runs[skip] = st, [p.detach().clone() for p in params]
    (st_pass, w_pass), (st_skip, w_skip) = runs[False], runs[True]
    print(st_pass, st_skip)
    # one mini-batch: KL 0; two: the second is measured after the first's step, against the old log-probs
    assert st_skip["kl_sum"] == pytest.approx(st_pass["kl_sum"], rel=1e-5, abs=1e-6 * st_pass["tokens"])
    assert (st_skip["kl_sum"] == 0.0) == (mini_batches == 1)
    assert st_skip["grad_norm"] == pytest.approx(st_pass["grad_norm"], rel=1e-5) and st_skip["grad_norm"] > 0
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(w_pass, w_skip))


def test_bf16_autocast_update_follows_the_fp32_one():
    """--train-bf16 on: the body's matmuls run in bf16 (weights and LoRA fp32), the log-probs come from an
    fp32 head. The update differs from fp32's (the autocast really ran) but points the same way, and the
    log-probs stay fp32 and within bf16 rounding of the fp32 ones."""
    from kernels.passes import sequence_logprobs
    trajs, adv = fake_trajs(), torch.tensor([1.0, -1.0, 0.5, -0.5])
    updates = {}
    for bf16 in ("off", "on"):
        model = tiny_lora_model()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(p.numel()), std=0.1)
        before = [p.detach().clone() for p in params]
        update(model, torch.optim.SGD(params, lr=1.0), trajs, adv,
                    SimpleNamespace(**{**vars(ARGS), "train_bf16": bf16}), pad_id=2, seed=0)
        updates[bf16] = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before)])
    cos = torch.nn.functional.cosine_similarity(updates["on"], updates["off"], dim=0)
    print(f"cosine(bf16 update, fp32 update) = {cos:.5f}")
    assert not torch.equal(updates["on"], updates["off"]) and cos > 0.99
    ids, attn, mask = batch_trajectories(trajs, pad_id=2)
    with torch.no_grad():
        fp32 = sequence_logprobs(model, ids, attn, mask)
        with torch.autocast("cpu", torch.bfloat16):
            bf = sequence_logprobs(model, ids, attn, mask)
    assert bf.dtype == torch.float32 and not torch.equal(bf, fp32) and torch.allclose(bf, fp32, atol=0.05)


def test_masked_tokens_get_zero_gradient_through_the_model():
    """Prompt/user positions and right padding: changing what sits after a sequence's end
    (pads) changes neither loss nor gradient, and d loss / d logp is exactly 0 where mask == 0."""
    from kernels.passes import sequence_logprobs
    model = tiny_lora_model()
    for p in model.parameters():                         # make LoRA B non-zero so gradients reach A too
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    trajs = fake_trajs()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])

    def loss_and_grads(pad_id):
        ids, attn, mask = batch_trajectories(trajs, pad_id=pad_id)
        model.zero_grad()
        logp = sequence_logprobs(model, ids, attn, mask)
        logp.retain_grad()
        with torch.no_grad(), model.disable_adapter():
            ref = sequence_logprobs(model, ids, attn, mask)
        loss, _ = grpo_loss(logp, logp.detach(), ref, adv, mask, clip=0.2, beta=0.1, agg="token-mean")
        loss.backward()
        assert logp.grad[mask == 0].abs().max().item() == 0.0
        assert logp.grad[mask == 1].abs().min().item() > 0.0
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    l1, g1 = loss_and_grads(pad_id=2)
    l2, g2 = loss_and_grads(pad_id=61)
    assert l1 == pytest.approx(l2, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g2))


@pytest.mark.parametrize("mini_batches, domains, agg", [(1, 1, "token-mean"), (2, 1, "token-mean"),
                                                      (1, 2, "token-mean"), (2, 2, "seq-mean")])
def test_the_fast_pass_gives_the_plain_passs_update(mini_batches, domains, agg):
    """--logprob-pass plain (one forward of each whole row, full logits) and fast (each domain's system prompt once
    a pass with activation checkpointing off, or every row's with it on; the lm_head in chunks): the same stats and
    the same updated weights, with one domain in the step or two, in one mini-batch or two."""
    prompts = [torch.randint(3, 64, (4,), generator=torch.Generator().manual_seed(5 + d)).tolist() for d in range(2)]
    trajs = fake_trajs(6)
    for i, t in enumerate(trajs):
        t.domain = ["retail", "airline"][i % domains]
        t.token_ids[:4] = prompts[i % domains]           # mask 0 there: shared_prefix_len = 4 within a domain
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -0.25])
    runs = {}
    for how, ckpt in [("plain", "off"), ("fast", "on"), ("fast", "off")]:   # "on" only picks the per-row pass here
        model = tiny_lora_model()
        for p in model.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(p.numel()), std=0.1)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)   # update = gradient
        args = SimpleNamespace(**{**vars(ARGS), "grad_checkpointing": ckpt, "mini_batches": mini_batches,
                                  "loss_agg": agg, "logprob_pass": how})
        runs[how, ckpt] = update(model, opt, trajs, adv, args, pad_id=2, seed=0), [p.detach().clone() for p in model.parameters()]
    (st, w), others = runs["plain", "off"], [runs["fast", "on"], runs["fast", "off"]]
    print(st, [o[0] for o in others])
    for st_fast, w_fast in others:
        assert st_fast["tokens"] == st["tokens"] and st_fast["kl_sum"] == pytest.approx(st["kl_sum"], rel=1e-4)
        assert st_fast["grad_norm"] == pytest.approx(st["grad_norm"], rel=1e-4) and st["grad_norm"] > 0
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(w, w_fast))


def test_each_mini_batch_is_a_seeded_random_subset_of_both_domains(monkeypatch):
    """--mini-batches 2 on 12 rollouts given domain by domain (as micro-batches are ordered): each AdamW step trains
    on rollouts of both domains, together all 12 once; the same seed splits them the same way, another seed not.
    Each rollout's advantage is its own number, so the loss's calls say which rollouts each step saw."""
    trajs = fake_trajs(12)
    for i, t in enumerate(trajs):
        t.domain = "retail" if i < 6 else "airline"
    adv = torch.arange(1, 13) / 100                           # rollout i's advantage: (i + 1) / 100
    loss = rl_module.grpo_loss

    def split(seed):
        seen = []                                             # per grpo_loss call, the rollouts of its micro-batch
        monkeypatch.setattr(rl_module, "grpo_loss", lambda logp, old, ref, a, *rest, **kw: seen.append(
            [round(x * 100) - 1 for x in a.tolist()]) or loss(logp, old, ref, a, *rest, **kw))
        model = tiny_lora_model()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        steps, step = [], opt.step
        opt.step = lambda *a, **kw: steps.append(len(seen)) or step(*a, **kw)    # the calls before each AdamW step
        st = update(model, opt, trajs, adv, SimpleNamespace(**{**vars(ARGS), "mini_batches": 2}), pad_id=2, seed=seed)
        assert st["updates"] == 2 and len(steps) == 2
        return [sorted(i for rows in seen[a:b] for i in rows) for a, b in zip([0] + steps[:-1], steps)]
    first = split(seed=5)
    print(f"seed 5: {first}; seed 6: {split(seed=6)}")
    assert sorted(first[0] + first[1]) == list(range(12)) and len(first[0]) == len(first[1]) == 6
    assert all({trajs[i].domain for i in mini} == {"retail", "airline"} for mini in first)
    assert split(seed=5) == first and split(seed=6) != first


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_micro_batches_add_up_to_the_whole_batch(agg):
    """Gradient accumulation over micro-batches of 1 gives the update of one micro-batch of all 4."""
    trajs, adv = fake_trajs(), torch.tensor([1.0, -1.0, 0.5, -0.5])
    updates = []
    for micro in (1, 4):
        model = tiny_lora_model()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(p.numel()), std=0.1)
        before = [p.detach().clone() for p in params]
        opt = torch.optim.SGD(params, lr=1.0)                                   # update = gradient
        update(model, opt, trajs, adv, SimpleNamespace(**{**vars(ARGS), "micro_batch": micro, "loss_agg": agg}),
                    pad_id=2, seed=0)
        updates.append([p.detach() - b for p, b in zip(params, before)])
    assert max(u.abs().max().item() for u in updates[0]) > 1e-4
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*updates))


def test_mini_batches_make_ratio_depart_from_one():
    model = tiny_lora_model()
    trajs = fake_trajs()
    adv = two_groups_advantages()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5)
    args = SimpleNamespace(**{**vars(ARGS), "mini_batches": 2})
    total = update(model, opt, trajs, adv, args, pad_id=2, seed=0)
    assert total["updates"] == 2
    assert total["clip_low"] + total["clip_high"] > 0   # big lr: 2nd mini-batch sees ratio far from 1


# ---------------------------------------------------------------- end to end

def run_rl(out, *extra, wait=True, init="base"):
    cmd = [sys.executable, os.path.join(REPO, "rl.py"), "--smoke", "--init", init, "--out", str(out), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if wait:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)   # generous: shared CPUs
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_records(out, step):
    """What rl.py did with each of a step's groups, as scripts/viewer.py recomputes it from the saved rollouts."""
    from scripts import viewer
    return [g["record"] for s, _, groups in viewer.read_rl(str(out))[1] if s == step for g in groups]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama with the default model's tokenizer (so the chat format is real), built so
    that each sampled token is " delivered" or <|im_end|> about half the time: every embedding has a
    large constant first coordinate, which survives the small random layers and RMSNorm as a constant
    direction, and lm_head reads it for those two tokens only. On retail's refuse_cancel_delivered
    task (reward 1 iff "delivered" is said and the DB is unchanged) some rollouts of a group succeed and
    some fail, so GRPO takes real optimizer steps in seconds. Also an adapter for it ("sft") to start from."""
    import rollout
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = rollout.load_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    delivered, eot = tok(" delivered", add_special_tokens=False).input_ids, tok.convert_tokens_to_ids("<|im_end|>")
    assert len(delivered) == 1
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 40.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[[delivered[0], eot], 0] = 3.0      # logit ~ 3 * sqrt(32) = 17 for these two
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path / "model")
    tok.save_pretrained(path / "model")
    torch.manual_seed(1)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for n, p in lora.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    lora.save_pretrained(path / "sft")
    return str(path)


def test_smoke_two_steps_writes_everything_under_out(tmp_path):
    """The real default model (SmolLM2-135M), tiny sizes."""
    r = run_rl(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = read_metrics(tmp_path)
    assert [x["step"] for x in m] == [0, 1, 2]          # 0: held-out pass^1 of the starting policy
    assert all(x["heldout_pass1"] is not None for x in (m[0], m[2])) and "heldout_pass1" not in m[1]
    assert all(0.0 <= x["reward"] <= 1.0 and x["tokens"] > 0 and x["groups_trained"] <= x["groups_drawn"]
               for x in m[1:])
    assert all(x["entropy"] > 0 for x in m[1:])          # sampled at temperature 1 from a real model
    assert all(x["kl"] is None for x in m[1:] if x["groups_trained"] == 0)   # no update: no KL measured
    for name in ("args.json", "rl.png", "adapter/adapter_config.json", "ckpt-000002/state.pt"):
        assert os.path.exists(tmp_path / name), name
    assert json.load(open(tmp_path / "args.json"))["out"] == str(tmp_path)
    assert "step   2/2 | reward" in r.stdout + r.stderr
    assert "init: base model" in r.stdout
    # bitsandbytes' probe finds our kernels/ package instead of the hub's and would log a false error
    # (kernels/__init__.py filters exactly that record; tests/test_layout.py checks a real one still prints)
    assert "kernels-community" not in r.stderr and "get_kernel" not in r.stderr


TRAINS = ["--steps", "4", "--max-turns", "2", "--domains", "retail", "--tiers", "hard", "--draw", "2",
          "--max-draws", "3", "--group-size", "4", "--eval-every", "0", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """The 4-step run from the tiny model's adapter, never killed: what every resumed run must end as."""
    out = tmp_path_factory.mktemp("uninterrupted")
    r = run_rl(out, "--model", os.path.join(tiny_model_dir, "model"), *TRAINS, init=os.path.join(tiny_model_dir, "sft"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_sigkill_then_restart_resumes_from_last_checkpoint(tmp_path, tiny_model_dir, uninterrupted):
    """A run that takes optimizer steps before and after the kill, from an adapter (so the frozen
    reference is a second adapter that must come back too): the resumed run ends exactly where the
    uninterrupted one does, step by step (rewards, KL to the reference, gradient norms)."""
    steps = ["--model", os.path.join(tiny_model_dir, "model"), *TRAINS]
    init = os.path.join(tiny_model_dir, "sft")
    out = tmp_path / "killed"
    p = run_rl(out, *steps, wait=False, init=init)
    while not os.path.exists(out / "ckpt-000002") and p.poll() is None:
        time.sleep(0.02)
    assert p.poll() is None, "the run ended before it could be killed: " + p.stdout.read()[-3000:]
    os.kill(p.pid, signal.SIGKILL)                    # a real kill: no handler, no cleanup
    p.wait()
    p.stdout.close()
    done = max(int(n[5:]) for n in os.listdir(out) if n.startswith("ckpt-") and not n.endswith(".tmp"))
    assert 2 <= done < 4
    before, saved = read_metrics(out), (out / "args.json").read_bytes()
    other = run_rl(out, *steps, init="base")          # another --init into this run's folder: refused, one line
    assert other.returncode == 2 and other.stderr.strip().count("\n") == 0 and "--init" in other.stderr, other.stderr
    assert (out / "args.json").read_bytes() == saved and read_metrics(out) == before    # and nothing overwritten
    r = run_rl(out, *steps, init=init)                # the same command resumes
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"at step {done}" in r.stdout
    after, uninterrupted = read_metrics(out), read_metrics(uninterrupted)
    assert [x["step"] for x in after] == [1, 2, 3, 4]  # every step once: none lost, none repeated
    assert after[:done] == before[:done]              # steps up to the checkpoint are kept as they were
    trained = [x["step"] for x in after if x["groups_trained"]]
    print("steps that trained:", trained, "KL:", [x["kl"] for x in after])
    assert any(s <= done for s in trained) and any(s > done for s in trained)   # updates before and after the kill
    assert after[0]["kl"] is not None and after[0]["kl"] < 1e-6       # step 1: the policy is its reference
    for x in after:                                   # the viewer's groups, from the rollouts, match the counts,
        g = step_records(out, x["step"])              # and only groups whose rewards differ were trained
        assert len(g) == x["groups_drawn"] and sum(y["trained"] for y in g) == x["groups_trained"]
        assert all(len(set(y["rewards"])) > 1 for y in g if y["trained"])
        assert x["groups_trained"] <= x["groups_varied"] == sum(len(set(y["rewards"])) > 1 for y in g)
    same = lambda ms: [(x["reward"], x["groups_trained"], x["tokens"], round(x["entropy"], 4),
                        None if x["kl"] is None else round(x["kl"], 6),
                        None if x["grad_norm"] is None else round(x["grad_norm"], 5)) for x in ms]
    assert same(after) == same(uninterrupted)


def adapter_tensors(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "adapter_model.safetensors"))


@pytest.mark.parametrize("damage", ["truncate the adapter",
                                    pytest.param("delete the optimizer state", marks=pytest.mark.slow)])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, tiny_model_dir, uninterrupted, damage):
    """The newest checkpoint (the last step's, of a copy of the uninterrupted run without its final adapter)
    damaged as a full disk or a cut copy leaves it: the rerun says so in one line, resumes from the checkpoint
    before, trains the last step again and ends with exactly the adapter of the run that was never damaged."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt-")) == ["ckpt-000003", "ckpt-000004"]   # last two
    shutil.rmtree(out / "adapter")
    if damage == "truncate the adapter":
        path = out / "ckpt-000004" / "adapter" / "adapter_model.safetensors"
        path.write_bytes(path.read_bytes()[:100])
    else:
        os.remove(out / "ckpt-000004" / "state.pt")
    r = run_rl(out, "--model", os.path.join(tiny_model_dir, "model"), *TRAINS, init=os.path.join(tiny_model_dir, "sft"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = [line for line in r.stdout.splitlines() if " is damaged " in line]
    assert len(said) == 1 and "ckpt-000004" in said[0], r.stdout[-3000:]
    assert "resumed from" in r.stdout and "ckpt-000003 at step 3" in r.stdout
    assert [x["step"] for x in read_metrics(out)] == [1, 2, 3, 4]
    want, got = adapter_tensors(uninterrupted / "adapter"), adapter_tensors(out / "adapter")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_rollout_whose_user_failed_is_left_out_and_the_rest_of_its_group_trains(tmp_path, tiny_model_dir):
    """An LLM user server (a real HTTP server on 127.0.0.1) that fails one conversation, its opening (a 401 is
    not retried): that rollout leaves its group, which trains on the other three; the step logs one simulator
    failure. The users say the order was delivered and stop after the agent's first turn, so the tiny
    model's rollouts succeed when they say "delivered" (retail's refuse_cancel_delivered)."""
    from chat_server import FakeServer
    n = {"requests": 0}

    def answer(body):
        n["requests"] += 1
        if n["requests"] == 2:
            return "401"
        opening = len(body["messages"]) == 2                     # the user's system prompt and the agent's greeting
        return {"content": "Please cancel my order #W0000001." if opening else "Thanks. ###STOP###"}
    with FakeServer(answer) as srv:
        r = run_rl(tmp_path, "--model", os.path.join(tiny_model_dir, "model"), "--steps", "1", "--max-turns", "1",
                   "--domains", "retail", "--tiers", "hard", "--draw", "2", "--group-size", "4", "--eval-every", "0",
                   "--user", "openai:m", "--user-base-url", srv.url, "--user-workers", "1", "--seed", "4",
                   "--user-check", "off", init=os.path.join(tiny_model_dir, "sft"))   # this user's order id is
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]        # invented and it stops before the answer:
    m, groups = read_metrics(tmp_path)[0], step_records(tmp_path, 1)    # the check (test_user_check.py) would flag it
    print(groups, m["groups_trained"])
    assert m["sim_failures"] == 1
    assert [len(g["rewards"]) for g in groups] == [3, 4]            # the second opening asked was the lost one
    assert groups[0]["trained"] and len(set(groups[0]["rewards"])) > 1


@pytest.mark.slow
def test_a_user_server_gone_for_good_stops_the_run_with_one_line_and_the_last_checkpoint_survives(tmp_path,
                                                                                                 tiny_model_dir):
    """Step 1 with an LLM user over tests/fault_server.py (it plays the scripted user); then the server is gone for
    good and the run goes on to step 2: every rollout loses its simulator, rl.py stops with one line past
    --max-sim-failures (no traceback), and step 1's checkpoint is still there, unchanged, to resume from."""
    import common
    import envs
    from fault_server import FaultServer
    pool = envs.make_tasks("retail", "train", rl_module.TASK_POOL, ["hard"], 4)
    run = ["--model", os.path.join(tiny_model_dir, "model"), "--max-turns", "1", "--domains", "retail", "--tiers",
           "hard", "--draw", "2", "--group-size", "4", "--eval-every", "0", "--ckpt-every", "1", "--seed", "4",
           "--user", "openai:scripted"]
    with FaultServer(pool) as srv:
        first = run_rl(tmp_path, *run, "--user-base-url", srv.url, "--steps", "1", init=os.path.join(tiny_model_dir, "sft"))
    assert first.returncode == 0 and srv.requests >= 8, first.stdout[-3000:] + first.stderr[-3000:]
    adapter = (tmp_path / "ckpt-000001" / "adapter" / "adapter_model.safetensors").read_bytes()
    gone = run_rl(tmp_path, *run, "--user-base-url", srv.url, "--steps", "2", init=os.path.join(tiny_model_dir, "sft"))
    said = [line for line in gone.stderr.replace("\r", "\n").splitlines() if "rollouts left out" in line]
    print(said)
    assert gone.returncode == 1 and "Traceback" not in gone.stderr and len(said) == 1
    assert said[0].startswith("step 2: 8 of 8 rollouts left out (their user simulator failed or broke the check), "
                              "more than --max-sim-failures 0.25")
    assert [os.path.basename(c) for c in common.checkpoints(tmp_path)] == ["ckpt-000001"]
    assert (tmp_path / "ckpt-000001" / "adapter" / "adapter_model.safetensors").read_bytes() == adapter
    assert [m["step"] for m in read_metrics(tmp_path)] == [1]


def test_replaying_saved_rollouts_compares_update_rules_on_identical_rollouts(tmp_path, tiny_model_dir, uninterrupted):
    """--rollouts DIR trains on another run's saved rollouts instead of sampling: with the same update rule it
    ends at exactly that run's adapter; with another (seq-mean) every step sees the same groups, rewards and
    tokens, and only the update differs."""
    steps = ["--model", os.path.join(tiny_model_dir, "model"), *TRAINS, "--rollouts", str(uninterrupted / "rollouts")]
    init = os.path.join(tiny_model_dir, "sft")
    same, other = run_rl(tmp_path / "same", *steps, init=init), run_rl(tmp_path / "other", *steps, "--loss-agg",
                                                                      "seq-mean", init=init)
    assert same.returncode == other.returncode == 0, same.stdout[-2000:] + other.stdout[-2000:]
    want = adapter_tensors(uninterrupted / "adapter")
    got, changed = adapter_tensors(tmp_path / "same" / "adapter"), adapter_tensors(tmp_path / "other" / "adapter")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert not all(torch.equal(want[k], changed[k]) for k in want)
    seen = lambda out: [(x["groups_drawn"], x["groups_trained"], x["reward"], x["tokens"], x["train_tokens"])   # noqa
                        for x in read_metrics(out)]
    assert seen(tmp_path / "other") == seen(uninterrupted) == seen(tmp_path / "same")


@pytest.mark.slow          # four runs, about a minute and a half alone on 2 cores
def test_the_plain_sampler_runs_rl_and_eval_with_the_fast_ones_tokens(tmp_path, tiny_model_dir):
    """`--sampler plain` puts sampler/plain.py's sample_turn on the path that runs. eval.py, greedy: the same
    episodes token for token as the fast sampler's. rl.py: a step samples, trains and checkpoints through it, and
    its greedy held-out curve starts where the fast sampler's does."""
    import eval as evaluate
    model = os.path.join(tiny_model_dir, "model")
    episodes = {}
    for kind in ("plain", "fast"):
        out = tmp_path / f"eval_{kind}"
        evaluate.main(["--model", model, "--agents", "base", "--domains", "retail", "--n-tasks", "2", "--tiers", "hard",
                       "--max-turns", "2", "--max-new-tokens", "6", "--user", "scripted", "--sampler", kind,
                       "--out", str(out)])
        with open(out / "episodes_base.jsonl") as f:
            episodes[kind] = [json.loads(line) for line in f]
    assert len(episodes["plain"]) == 2 and sum(e["turns"] for e in episodes["plain"]) >= 2
    for a, b in zip(episodes["plain"], episodes["fast"]):
        assert a["token_ids"] == b["token_ids"] and a["loss_mask"] == b["loss_mask"] and a["reward"] == b["reward"]
    curves = {}
    for kind in ("plain", "fast"):
        r = run_rl(tmp_path / f"rl_{kind}", "--model", model, *TRAINS[2:], "--steps", "1", "--max-draws", "1",
                   "--eval-every", "1", "--eval-tasks", "2", "--sampler", kind, init=os.path.join(tiny_model_dir, "sft"))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        m = read_metrics(tmp_path / f"rl_{kind}")
        curves[kind] = m[0]["heldout_pass1"]
        assert m[1]["tokens"] > 0 and os.path.exists(tmp_path / f"rl_{kind}" / "adapter" / "adapter_config.json")
    assert curves["plain"] == curves["fast"]
    with open(next((tmp_path / "rl_plain" / "rollouts").iterdir())) as f:
        assert all(sum(json.loads(line)["loss_mask"]) > 0 for line in f)     # the plain sampler's own tokens


def results_table_commands() -> list[str]:
    """The sft.py and rl.py commands of the README's results table, in its order."""
    results = open(os.path.join(REPO, "README.md")).read().split("\n## Results", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|[^|\n]*\| `(python (?:sft|rl)\.py[^`]*)`[^|\n]*\|", results, re.M)


@pytest.mark.slow      # three trainings in subprocesses and a refusal: most of a minute
def test_every_results_table_command_trains_into_its_own_folder(tmp_path, tiny_model_dir):
    """The README's results table, copied in order into a fresh folder as a newcomer would (each in --smoke form on
    the tiny model, rl.py shortened to one step and no curve): every command trains (a step logged, an adapter saved)
    into a folder of its own, whose args.json holds that row's other flags. Then an arm's command rerun into the
    default's folder is refused in one line (exit 2) before anything loads, and the default's run there is left as
    it was."""
    tiny, made = os.path.join(tiny_model_dir, "model"), {}
    cmds = results_table_commands()
    assert len(cmds) == 3 and cmds[:2] == ["python sft.py", "python rl.py --steps 8 --eval-every 4"], cmds
    quick = ["--steps", "1", "--eval-every", "0"]        # rl.py: one step and no curve, enough to see it train

    def run(cmd):
        script, *flags = cmd.split()[1:]
        return flags, subprocess.run([sys.executable, os.path.join(REPO, script), *flags, "--smoke", "--model", tiny,
                                      *(quick if script == "rl.py" else [])],
                                     cwd=tmp_path, capture_output=True, text=True, timeout=900)
    for cmd in cmds:
        flags, r = run(cmd)
        assert r.returncode == 0, cmd + "\n" + r.stdout[-2000:] + r.stderr[-2000:]
        given = {k: v for k, v in zip(flags[::2], flags[1::2]) if k not in quick[::2]}   # the row's other flags
        out = tmp_path / given.get("--out", "runs/" + cmd.split()[1][:-3])
        assert out not in made.values(), f"{cmd} trained into {made} 's folder"
        made[cmd] = out
        saved = json.load(open(out / "args.json"))
        assert all(saved[flag[2:].replace("-", "_")] == value for flag, value in given.items()), (cmd, saved)
        assert any("loss" in m or "reward" in m for m in read_metrics(out)), cmd      # a step was logged
        assert (out / "adapter" / "adapter_model.safetensors").is_file(), cmd
    files = ("args.json", "metrics.jsonl", "adapter/adapter_model.safetensors")
    before = {(d, f): (tmp_path / "runs" / d / f).read_bytes() for d in ("sft", "rl") for f in files}
    for cmd in ("python rl.py --init base", "python rl.py --user scripted:population",
                "python sft.py --user scripted:population"):
        _, r = run(cmd)                                  # no --out: the default's folder
        print(r.stderr)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--out" in r.stderr, r.stderr
        assert "init: " not in r.stdout and "trainable params" not in r.stdout     # refused before a model loads
    assert all((tmp_path / "runs" / d / f).read_bytes() == b for (d, f), b in before.items())


def test_same_adapters_fails_on_one_ulp(tmp_path):
    """scripts/same_adapters.py, the bit-for-bit check of the default run before and after a change: equal
    adapters pass, one weight moved by one ulp fails, a missing adapter is exit 2."""
    from safetensors.torch import save_file
    from scripts import same_adapters
    w = {"a.lora_A.weight": torch.randn(4, 8), "a.lora_B.weight": torch.randn(8, 4)}
    moved = {k: v.clone() for k, v in w.items()}
    moved["a.lora_B.weight"][3, 1] = torch.nextafter(moved["a.lora_B.weight"][3, 1], torch.tensor(1e9))
    for name, tensors in (("before", w), ("same", {k: v.clone() for k, v in w.items()}), ("moved", moved)):
        os.makedirs(tmp_path / name)
        save_file(tensors, str(tmp_path / name / "adapter_model.safetensors"))
    before, same, moved_dir = (str(tmp_path / n) for n in ("before", "same", "moved"))
    assert same_adapters.main([before, same]) == 0
    assert same_adapters.main([before, same, before, moved_dir]) == 1
    assert same_adapters.main([before, str(tmp_path / "nowhere")]) == 2


# ---------------------------------------------------------------- --report-to: the step's numbers in a tracker

def wandb_logged(path: str, key: str) -> list[str]:
    """The values logged under key in a W&B run file, in order, read from its raw bytes (wandb 0.31 reads its run files
    only in its Go core): each history item is a protobuf message whose key (field 2, tag 0x12) comes before its
    value_json (field 16, tag 0x82 0x01), each a length byte and the text. An item stands there twice (the client's
    partial history, then the history record): each value is kept once."""
    data, k = open(path, "rb").read(), key.encode()
    return list(dict.fromkeys(data[m.end():m.end() + m.group(1)[0]].decode() for m in re.finditer(
        re.escape(b"\x12" + bytes([len(k)]) + k + b"\x82\x01") + rb"(.)", data, re.S)))


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_report_to_sends_each_steps_numbers_to_the_tracker_offline(tmp_path, monkeypatch, kind):
    """--report-to: rl.log hands each metrics line to the tracker (common.log_metrics), every number under its
    metrics.jsonl key, a nested one as "user_flags/early_stop", None and text left out. Read back from TensorBoard's
    event file and from the offline W&B run file, both under --out."""
    import glob
    import common
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lines = [dict(step=1, reward=0.25, user_requests=12, user_flags={"early_stop": 3}, kl=None, note="text"),
             dict(step=2, reward=0.75, user_requests=7, user_flags={})]
    tracker, metrics = common.tracker(SimpleNamespace(report_to=kind, out=str(tmp_path), lr=1e-4)), []
    for m in lines:
        common.log_metrics(str(tmp_path), metrics, m, tracker)
    tracker.close()
    assert metrics == lines and len(open(tmp_path / "metrics.jsonl").readlines()) == 2
    if kind == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        got = {k: [(s.step, s.value) for s in events.Scalars(k)] for k in events.Tags()["scalars"]}
        assert got == {"step": [(1, 1.0), (2, 2.0)], "reward": [(1, 0.25), (2, 0.75)],
                       "user_requests": [(1, 12.0), (2, 7.0)], "user_flags/early_stop": [(1, 3.0)]}
    else:
        path, = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert wandb_logged(path, "reward") == ["0.25", "0.75"] and wandb_logged(path, "_step") == ["1", "2"]
        assert wandb_logged(path, "user_flags/early_stop") == ["3"] and wandb_logged(path, "kl") == []


def test_report_to_without_its_package_is_one_line(monkeypatch):
    import common
    monkeypatch.setitem(sys.modules, "wandb", None)               # as if it were not installed
    with pytest.raises(SystemExit, match=r"^--report-to wandb: wandb is not installed; pip install the version"):
        common.tracker(SimpleNamespace(report_to="wandb", out="/nonexistent", lr=1e-4))
