"""GRPO with a simulated user inside the rollout loop (the MUA-RL stage, arXiv 2508.18669).

Each step, in the `for step` loop of main(): roll out G conversations per train task, each with a
fresh Env and a fresh simulated user -> binary task reward -> keep the groups whose rewards differ
(dynamic sampling: draw more tasks until enough such groups are found, capped) -> group advantages
(r - mean) / (std + eps) -> per-token log-probs of the policy, the old policy and the reference (the
policy RL started from, frozen) -> PPO-clipped loss + beta * k3 KL, averaged over the tokens the
policy sampled (--loss-agg: per token, or per rollout first) -> grad clip -> AdamW. Every --eval-every
steps: held-out pass^1, the curve to trust.

Run:
    python rl.py                        # from runs/sft/adapter; CPU preset on CPU, paper sizes on GPU
    python rl.py --smoke --out /tmp/rl  # 2 tiny steps (tests/test_rl.py)
    python rl.py --init base            # ablation: no cold start
    python rl.py --user none            # ablation: the whole instruction up front, no user turns
    python rl.py --user local           # ablation: another user simulator (the base model plays the user)
    python rl.py --reward shaped        # ablation: partial credit for correct writes
    python rl.py --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o   # paper scale
    python rl.py --domains tau2-retail,tau2-airline,tau2-telecom --user openai:gpt-4o   # τ²-bench's train split
    python rl.py --bench-update         # one update's seconds: fp32 vs bf16 autocast, with and without the reference pass
    python rl.py --memory-check         # Qwen3-8B shapes, random NF4 weights, one step, peak GPU memory (CPU: tiny shapes)
Everything goes under --out (default runs/rl): args.json, metrics.jsonl (a line a step, with each
drawn group's task, rewards and whether it was trained), rl.png, reference/ (the starting adapter),
checkpoints (ckpt-NNNNNN/: adapter, optimizer, RNG states, metrics) and adapter/ at the end. Rerun the
same command after a kill: it resumes from the latest checkpoint.

Simplifications versus the paper and its official code:
- SmolLM2-135M-Instruct (bundled, fp32 on CPU) instead of Qwen3-8B/14B/32B; LoRA (r 16) instead of full
  fine-tuning, so the frozen reference is a second small adapter on the same base weights.
- Our procedural retail/airline domains (envs.py); a step's tasks alternate between them, and the rows
  of a domain share its system prompt, which the sampler prefills and the training pass runs once.
- A scripted user by default (a 135M model cannot play one); the paper's GPT-4o is --user openai:gpt-4o.
- CPU preset: the same algorithm at small sizes, airline's easy tier only (what the CPU cold start
  solves some of: a group teaches only if some but not all of its rollouts succeed), sampled at
  T = 0.7 (the paper's 1.0 on GPU); see CPU_PRESET.
- Dynamic sampling (DAPO) is ours; the paper's GRPO trains on every group, zero-variance ones included
  (they contribute nothing but the KL term).
- One optimizer step per batch of rollouts (--mini-batches 1): the old policy is the policy, so its
  log-probs are the detached policy log-probs and the ratio is exactly 1; with more mini-batches
  they are computed before the first update and clipping matters.
- Entropy is the mean -log p of the sampled tokens, an estimate of the full-vocabulary entropy.
- Before the first optimizer step the reference is the policy, so its pass is skipped (exact: KL 0).
- On a CPU with native bf16 (AVX512-BF16 or AMX) the update's forward and backward run under bf16
  autocast (--train-bf16 auto; weights, LoRA, AdamW and the log-softmax stay fp32), as GPU training
  runs in bf16: `python rl.py --bench-update` times it. The rollouts sample in exact fp32 by default;
  --sample-bf16 on prefills their new turns under bf16 autocast (the sampler is then the policy up to
  bf16 rounding; the loss never reads the sampler's log-probs, the update recomputes them).
- A rollout cut off at --max-turns or --max-context scores 0, as in τ² (envs.Env.reward): the database
  check alone paid an agent that made its write and then re-asked until the cap (README).
- Learning rates are ours, for LoRA; full fine-tuning would use smaller ones.
"""
import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time

import torch

GPU_DEFAULTS = dict(steps=100, tasks=32, draw=32, max_draws=3, group_size=8, max_turns=30, max_new_tokens=256,
                    max_context=8192, micro_batch=1, lr=2e-5, temperature=1.0, loss_agg="token-mean",
                    domains="retail,airline", tiers="easy,medium,hard", ckpt_every=10, eval_every=10,
                    eval_tasks=24, grad_checkpointing="on")
# CPU (2 cores, fp32, 135M), from the CPU SFT adapter, sized for ~20 minutes (README has the timings, which
# differ 2x between machines): one step, held-out pass^1 on 12 tasks before and after it. Airline only: the
# CPU cold start solves every easy retail task already, and airline's add_bags is what it half solves, where
# groups have reward variance. 8 tasks x 8 rollouts in one draw, every group with variance trained: GRPO needs
# both kinds of add_bags request in one update, and groups of 4 had variance less often (README, the fifth
# attempt). 7 turns: the easy tasks need 5, one correction after a "no" needs 2 more. T = 0.7: at T = 1 the
# 135M policy's failed rollouts are mostly sampling noise. lr 1e-4: Adam's first step moves every weight by
# ~lr, and at 2e-4 one step on fewer groups wrecked the policy (README). `python rl.py --steps N` resumes this
# run for more steps (README: resumed to 3 steps it beats SFT by the issue's bar, though step 2 alone fell
# below SFT); `--max-draws 2 --tasks 16` averages one step over twice the groups: on the same tasks it beat
# SFT by more than this preset's step, at twice the wall time.
CPU_PRESET = dict(steps=1, tasks=8, draw=8, max_draws=1, group_size=8, max_turns=7, max_new_tokens=80,
                  max_context=3072, micro_batch=2, lr=1e-4, temperature=0.7, loss_agg="token-mean",
                  domains="airline", tiers="easy", ckpt_every=1, eval_every=1, eval_tasks=12,
                  grad_checkpointing="off")
SMOKE = dict(steps=2, tasks=1, draw=1, max_draws=1, group_size=2, max_turns=1, max_new_tokens=8,
             max_context=2560, micro_batch=2, lr=1e-4, temperature=1.0, loss_agg="token-mean",
             domains="retail,airline", tiers="easy", ckpt_every=1, eval_every=2, eval_tasks=1,
             grad_checkpointing="off")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model name/path (default: rollout.DEFAULT_MODEL)")
    p.add_argument("--load-in-4bit", action="store_true", help="NF4 base weights (bitsandbytes), bf16 compute")
    p.add_argument("--init", default="auto", help="SFT adapter dir, 'base' (no cold start), or 'auto' "
                   "= runs/sft/adapter if present else base")
    p.add_argument("--user", default="scripted", help="user simulator: scripted | local (the base model, "
                   "adapter off) | openai:MODEL | none (whole instruction up front, no user turns)")
    p.add_argument("--user-base-url", default=None, help="base URL for an openai:MODEL user (default $OPENAI_BASE_URL)")
    p.add_argument("--user-workers", type=int, default=16, help="LLM users asked at once (each round's replies)")
    p.add_argument("--kv-budget", type=float, default=0.0, help="GiB of keys/values the rollout sampler may hold; it "
                   "decodes in waves that fit (0 = auto: free GPU memory minus the training step's reserve; CPU: no limit)")
    p.add_argument("--thinking", action="store_true", help="Qwen3 thinking mode (default off, as in the paper): the "
                   "policy writes and is trained on its <think> reasoning")
    p.add_argument("--reward", default="binary", choices=["binary", "shaped"], help="task reward")
    p.add_argument("--domains", default=None, help="comma-separated train domains (preset)")
    p.add_argument("--task-pool", type=int, default=1000, help="train tasks generated per domain to sample from")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (preset)")
    p.add_argument("--tasks", type=int, default=None, help="groups with reward variance to train on per step "
                   "(preset; paper 32 tasks)")
    p.add_argument("--draw", type=int, default=None, help="tasks per rollout batch (preset)")
    p.add_argument("--max-draws", type=int, default=None, help="dynamic sampling: at most this many rollout batches "
                   "a step to find --tasks groups with reward variance (preset; 1 = plain GRPO)")
    p.add_argument("--group-size", type=int, default=None, help="rollouts per task G (preset; paper 8)")
    p.add_argument("--max-turns", type=int, default=None, help="agent turns per episode (preset; paper 30)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per agent turn (preset)")
    p.add_argument("--max-context", type=int, default=None, help="episode token limit (preset)")
    p.add_argument("--tiers", default=None, help="task tiers to train on (preset)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (preset; paper 1.0)")
    p.add_argument("--kl-coef", type=float, default=0.001, help="beta for the k3 KL to the reference (paper 0.001)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon (paper 0.2)")
    p.add_argument("--loss-agg", default=None, choices=["token-mean", "seq-mean"], help="token-mean: every sampled "
                   "token weighs the same (DAPO, official code); seq-mean: every rollout does (GRPO paper) (preset)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (preset)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per batch of rollouts")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (preset)")
    p.add_argument("--grad-checkpointing", default=None, choices=["on", "off"],
                   help="recompute activations in backward (preset: GPU on; CPU off, which lets the system "
                        "prompt run once per pass)")
    p.add_argument("--train-bf16", default="auto", choices=["auto", "on", "off"], help="run the update's forward and "
                   "backward under bf16 autocast (weights, LoRA, AdamW and the log-softmax stay fp32); auto = on for a "
                   "CPU with native bf16 dot products (AVX512-BF16 or AMX), where it makes the update a quarter to a "
                   "third cheaper (README); off on GPU, whose weights are bf16 already")
    p.add_argument("--sample-bf16", default="off", choices=["auto", "on", "off"], help="prefill the rollouts' new "
                   "turns under bf16 autocast (decoding stays fp32; held-out evals stay exact fp32); auto = as "
                   "--train-bf16 auto. The sampler is then the policy up to bf16 rounding, not exactly it; off by "
                   "default: 1.08x in rollout.py's bench at 8-16 rows, no gain seen at a draw's 64 (README)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank when starting from base")
    p.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha when starting from base")
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every N steps (preset)")
    p.add_argument("--eval-every", type=int, default=None, help="held-out pass^1 every N steps, and before step 1 "
                   "(preset; 0 = never)")
    p.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks per domain for that curve (preset)")
    p.add_argument("--eval-skip", type=int, default=24, help="the curve uses held-out tasks after the first N per "
                   "domain, which eval.py's CPU preset reports: monitoring never looks at the final eval")
    p.add_argument("--seed", type=int, default=0, help="seed for task sampling, users and sampling")
    p.add_argument("--out", default="runs/rl", help="output dir (everything this run writes)")
    p.add_argument("--smoke", action="store_true", help="2 tiny steps (< 2 min on CPU)")
    p.add_argument("--cpu-preset", default="auto", choices=["auto", "on", "off"], help="auto = on without a GPU")
    p.add_argument("--bench-update", action="store_true", help="seconds of one GRPO update of --init's adapter on a "
                   "default-sized group: fp32 vs bf16 autocast, with and without the reference pass")
    p.add_argument("--memory-check", action="store_true", help="one paper-scale GRPO step on random Qwen3-8B shapes in "
                   "NF4, peak memory (GPU); without a GPU the same step at tiny shapes on CPU")
    args = p.parse_args(argv)
    cpu = args.cpu_preset == "on" or (args.cpu_preset == "auto" and not torch.cuda.is_available())
    preset = SMOKE if args.smoke else CPU_PRESET if cpu else GPU_DEFAULTS
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    bf16_cpu = native_bf16_cpu() and not torch.cuda.is_available() and not args.load_in_4bit
    for k in ("train_bf16", "sample_bf16"):
        if getattr(args, k) == "auto":
            setattr(args, k, "on" if bf16_cpu else "off")
    return args


def native_bf16_cpu() -> bool:
    """Does this CPU have bf16 dot products (AVX512-BF16 or AMX)? --train/sample-bf16 auto autocast only there."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# ---------------------------------------------------------------- GRPO pieces (tested)

def group_advantages(rewards, group_size, eps=1e-4):
    """rewards (N,) task-major -> advantages (N,), zero_var (N // G,) bool.
    (r - mean_group) / (std_group + eps); a group whose rewards are all equal has advantage 0
    everywhere and carries no signal: zero_var marks it so the loop can skip it."""
    r = rewards.float().view(-1, group_size)                    # (groups, G)
    mean, std = r.mean(1, keepdim=True), r.std(1, unbiased=False, keepdim=True)
    adv = (r - mean) / (std + eps)
    zero_var = (r.max(1).values - r.min(1).values) == 0
    return adv.view(-1), zero_var


def batch_trajectories(trajs, pad_id):
    """Right-pad trajectories into (B, T) long tensors input_ids, attention_mask, loss_mask.
    Masks come from positions (lengths, the trajectory's loss_mask), never from pad ids:
    pad == eos == <|im_end|>, which the policy samples and is trained on."""
    T = max(len(t.token_ids) for t in trajs)
    ids = torch.full((len(trajs), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(trajs), T, dtype=torch.long)
    mask = torch.zeros(len(trajs), T, dtype=torch.long)
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(t.loss_mask)
    return ids, attn, mask


def grpo_loss(logp, old_logp, ref_logp, adv, mask, clip=0.2, beta=0.001, agg="token-mean", n_tokens=None,
              n_seqs=None):
    """PPO-clipped GRPO loss with k3 KL to the reference, over masked tokens.
    logp/old_logp/ref_logp/mask: (B, T); adv: (B,). agg, how per-token terms become one number:
      "token-mean": the sum over all masked tokens / n_tokens (default mask.sum()): a long rollout weighs
        more (DAPO; the official code's default);
      "seq-mean": each rollout's token mean, summed / n_seqs (default B): every rollout weighs the same
        (the GRPO paper's 1/|o_i|). A group's advantages sum to 0, so a token every rollout emits at the
        same rate (the tool-call format) gets no net push. Under token-mean it gets sum_i A_i |o_i|, which
        is negative when failures run longer (they loop to the turn cap): the shared format is pushed down.
    Pass the whole mini-batch's n_tokens / n_seqs when accumulating over micro-batches.
    Returns (loss, stats) with stats summed over tokens so micro-batches add up."""
    m = mask.bool()
    # zero masked positions first: pads may hold anything, and their gradient must be exactly 0
    logp, old_logp, ref_logp = (x.masked_fill(~m, 0.0) for x in (logp, old_logp, ref_logp))
    ratio = torch.exp(logp - old_logp)                          # (B, T)
    a = adv.view(-1, 1)
    surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
    # k3 estimator of KL(pi || ref): exp(ref - pi) - (ref - pi) - 1 >= 0, unbiased, low variance
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    per_token = (-surrogate + beta * kl) * m
    if agg == "token-mean":
        loss = per_token.sum() / (n_tokens if n_tokens is not None else m.sum().clamp(min=1))
    elif agg == "seq-mean":
        loss = (per_token.sum(1) / m.sum(1).clamp(min=1)).sum() / (n_seqs if n_seqs is not None else len(m))
    else:
        raise ValueError(f"agg {agg!r}: token-mean or seq-mean")
    clipped = ((ratio - 1).abs() > clip) & m
    stats = dict(kl_sum=(kl * m).sum().item(), clipped=clipped.sum().item(), tokens=m.sum().item())
    return loss, stats


def grpo_update(model, optimizer, trajs, adv, args, pad_id, ref_is_policy=False):
    """Steps 5-7 for the trajectories of groups with signal: log-probs (policy, old, reference),
    loss, backward, clip, AdamW. Returns summed stats for logging.
    Trajectories of one domain share its system prompt: without activation checkpointing it goes
    through the model once per pass for all of them (kernels.*_with_shared_prefix, exact).
    ref_is_policy: no optimizer step since RL started, so the reference IS the policy before this
    update and its log-probs are the old ones: the reference pass is skipped (exact: KL 0 and its
    gradient 0). args.train_bf16: the passes run under bf16 autocast (weights, LoRA and AdamW stay fp32)."""
    from kernels import backward_with_shared_prefix, logprobs_with_shared_prefix, shared_prefix_len
    dev = next(p for p in model.parameters() if p.requires_grad).device
    parts = {}                                   # domain -> its trajectories, shortest first (less padding)
    for i in sorted(range(len(trajs)), key=lambda i: len(trajs[i].token_ids)):
        parts.setdefault(getattr(trajs[i], "domain", None), []).append(i)
    micro = []                                   # micro-batches, each within one domain
    for idx in parts.values():
        P = 0 if args.grad_checkpointing == "on" else shared_prefix_len([trajs[i].token_ids for i in idx],
                                                                          [trajs[i].loss_mask for i in idx])
        prefix = torch.tensor(trajs[idx[0]].token_ids[:P], dtype=torch.long, device=dev)
        for s in range(0, len(idx), args.micro_batch):
            mb = idx[s:s + args.micro_batch]
            ids, attn, mask = (x[:, P:].to(dev) for x in batch_trajectories([trajs[i] for i in mb], pad_id))
            micro.append(dict(prefix=prefix, ids=ids, attn=attn, mask=mask, adv=adv[mb].to(dev)))

    def by_prefix(mbs):                          # [(prefix, its micro-batches)], in order
        out = {}
        for mb in mbs:
            out.setdefault(id(mb["prefix"]), (mb["prefix"], []))[1].append(mb)
        return list(out.values())
    inputs = lambda mbs: [(mb["ids"], mb["attn"], mb["mask"]) for mb in mbs]     # noqa: E731
    bf16 = torch.autocast(dev.type, torch.bfloat16, enabled=args.train_bf16 == "on")
    with torch.no_grad(), bf16:  # before any update: reference (unless it is the policy), old policy if it can differ
        for prefix, mbs in by_prefix(micro):
            if not ref_is_policy:
                with reference_policy(model):
                    for mb, ref in zip(mbs, logprobs_with_shared_prefix(model, prefix, inputs(mbs), args.temperature)):
                        mb["ref"] = ref
            if args.mini_batches > 1:
                for mb, old in zip(mbs, logprobs_with_shared_prefix(model, prefix, inputs(mbs), args.temperature)):
                    mb["old"] = old
    params = [p for p in model.parameters() if p.requires_grad]
    total = dict(kl_sum=0.0, clipped=0, tokens=0, grad_norm=0.0, updates=0)
    per = math.ceil(len(micro) / args.mini_batches)
    for s in range(0, len(micro), per):
        chunk = micro[s:s + per]
        n_tokens = max(1, sum(int(mb["mask"].sum()) for mb in chunk))
        n_seqs = sum(len(mb["ids"]) for mb in chunk)
        optimizer.zero_grad(set_to_none=True)
        for prefix, mbs in by_prefix(chunk):     # gradients add up over the domains of the mini-batch

            def loss_of(i, logp, mbs=mbs):       # logp: (b, T - P), with grad
                mb = mbs[i]
                old = mb["old"] if "old" in mb else logp.detach()
                loss, st = grpo_loss(logp, old, mb.get("ref", old), mb["adv"], mb["mask"], args.clip, args.kl_coef,
                                     args.loss_agg, n_tokens, n_seqs)
                for k in ("kl_sum", "clipped", "tokens"):
                    total[k] += st[k]
                return loss
            with bf16:
                backward_with_shared_prefix(model, prefix, inputs(mbs), loss_of, args.temperature)
        total["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        optimizer.step()
        total["updates"] += 1
    return total


# ---------------------------------------------------------------- checkpoints

def latest_checkpoint(out):
    """The newest complete checkpoint dir (written as .tmp, then renamed: rename is atomic)."""
    names = sorted(n for n in os.listdir(out) if n.startswith("ckpt-") and not n.endswith(".tmp")) \
        if os.path.isdir(out) else []
    return os.path.join(out, names[-1]) if names else None


def save_checkpoint(out, step, model, optimizer, metrics):
    """ckpt-NNNNNN = state after `step` completed steps: adapter, optimizer, RNG states, metrics."""
    final = os.path.join(out, f"ckpt-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(os.path.join(tmp, "adapter"), selected_adapters=["default"])   # not the frozen "ref"
    rng = dict(python=random.getstate(), torch=torch.get_rng_state(),
               cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    torch.save(dict(optimizer=optimizer.state_dict(), rng=rng), os.path.join(tmp, "state.pt"))
    with open(os.path.join(tmp, "progress.json"), "w") as f:
        json.dump(dict(step=step, metrics=metrics), f)
    os.rename(tmp, final)
    for n in os.listdir(out):        # keep only the newest checkpoint
        if n.startswith("ckpt-") and os.path.join(out, n) != final:
            shutil.rmtree(os.path.join(out, n), ignore_errors=True)


def restore_checkpoint(ckpt, optimizer):
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    with open(os.path.join(ckpt, "progress.json")) as f:
        p = json.load(f)
    return p["step"], p["metrics"]


def plot(metrics, path, temperature):
    """Training reward and held-out pass^1 (the curve that matters), KL to the reference, groups trained."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.3))
    trained = [m for m in metrics if "reward" in m]
    evals = [m for m in metrics if m.get("heldout_pass1") is not None]
    axes[0].plot([m["step"] for m in trained], [m["pass_rate"] for m in trained], marker=".", label=f"train rollouts (T={temperature:g})")
    axes[0].plot([m["step"] for m in evals], [m["heldout_pass1"] for m in evals], marker="o", label="held-out (greedy)")
    axes[0].set(title="pass^1", xlabel="step", ylim=(-0.02, 1.02))
    axes[0].legend(fontsize=8)
    kl = [m for m in trained if m["kl"] is not None]
    axes[1].plot([m["step"] for m in kl], [m["kl"] for m in kl], marker=".")
    axes[1].set(title="KL to the reference (k3)", xlabel="step")
    axes[2].bar([m["step"] for m in trained], [m["groups_drawn"] for m in trained], color="0.8", label="drawn")
    axes[2].bar([m["step"] for m in trained], [m["groups_varied"] for m in trained], color="C9",
                label="with reward variance")                       # >= trained: --tasks caps it
    axes[2].bar([m["step"] for m in trained], [m["groups_trained"] for m in trained], label="trained")
    axes[2].set(title="groups per step", xlabel="step")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


@contextlib.contextmanager
def reference_policy(model):
    """The KL reference is the policy RL started from: the frozen copy of the starting adapter, loaded as
    adapter "ref" beside the trained "default" (LoRA weights are small; the base weights stay one copy),
    or, when RL starts from a fresh LoRA (zero delta), the base model with the adapter switched off."""
    if "ref" not in getattr(model, "peft_config", {}):
        with model.disable_adapter():
            yield
        return
    model.set_adapter("ref", inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter("default")          # trainable again


def load_policy(args, model):
    """The trained adapter ("default") and the frozen reference ("ref"): from the latest checkpoint when
    resuming, else from --init. The starting adapter is copied to <out>/reference, so a resumed run
    gets the same reference even if --init has changed since. -> (model, checkpoint dir or None)."""
    import rollout
    ckpt, ref_dir = latest_checkpoint(args.out), os.path.join(args.out, "reference")
    init = args.init
    if init == "auto":
        init = "runs/sft/adapter" if os.path.isdir("runs/sft/adapter") else "base"
    if ckpt:
        model = rollout.load_adapter(model, os.path.join(ckpt, "adapter"), trainable=True)
    elif init == "base":
        print("init: base model + fresh LoRA (no cold-start SFT adapter; run `python sft.py` for one)")
        model = rollout.add_lora(model, r=args.lora_r, alpha=args.lora_alpha)
    else:
        print(f"init: SFT adapter {init}")
        model = rollout.load_adapter(model, init, trainable=True)
        shutil.copytree(init, ref_dir, dirs_exist_ok=True)
    if os.path.isdir(ref_dir):
        model.load_adapter(ref_dir, adapter_name="ref", is_trainable=False)
    return model, ckpt


def heldout_pass1(model, tok, tasks, args, user_kw) -> float:
    """pass^1 of the greedy policy on fixed held-out tasks (eval.py's settings)."""
    import rollout
    agent = rollout.ModelAgent(model, tok, temperature=0.0, max_new_tokens=args.max_new_tokens,
                               kv_budget=int(args.kv_budget * 2**30) or None, thinking=args.thinking)
    model.eval()
    trajs = rollout.run_episodes(agent, tok, tasks, user=args.user, max_turns=args.max_turns,
                                 max_context=args.max_context, seed=args.seed, progress=False, **user_kw)
    return sum(t.reward >= 1 for t in trajs) / len(tasks)


# ---------------------------------------------------------------- the loop

def main(argv=None):
    args = parse_args(argv)
    if args.bench_update:
        return bench_update(args)
    if args.memory_check:
        if torch.cuda.is_available():
            return memory_check()
        print("--memory-check: no GPU here, so the same step runs at tiny Qwen3 shapes on CPU (the code path, not the numbers)")
        return memory_check(qwen3_shapes(tiny=True), seq_len=256, n_seq=2, device="cpu")
    import envs
    import rollout
    import users
    from tqdm import tqdm
    if rollout.DEVICE == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.init not in ("auto", "base") and not os.path.isdir(args.init):
        sys.exit(f"--init {args.init}: no such adapter dir; run `python sft.py` first or pass --init base")
    os.makedirs(args.out, exist_ok=True)
    print(vars(args))
    with open(os.path.join(args.out, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=1)

    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL, load_in_4bit=args.load_in_4bit)
    model, ckpt = load_policy(args, model)
    if args.grad_checkpointing == "on":    # less activation memory, more compute, no shared prefix
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    start, metrics = 0, []
    if ckpt:
        start, metrics = restore_checkpoint(ckpt, optimizer)
        print(f"resumed from {ckpt} at step {start}")
    else:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:   # rewrite: drop steps after the checkpoint
        f.writelines(json.dumps(m) + "\n" for m in metrics)

    tiers, domains, G = args.tiers.split(","), args.domains.split(","), args.group_size
    pools = {d: envs.train_tasks(d, args.task_pool, tiers, args.seed) for d in domains}   # τ²: its train split
    heldout = envs.held_out_tasks(domains, args.eval_skip + args.eval_tasks, tiers, args.seed)
    heldout = [t for d in domains for t in [t for t in heldout if t.domain == d][args.eval_skip:]]
    agent = rollout.ModelAgent(model, tok, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                               kv_budget=int(args.kv_budget * 2**30) or None, thinking=args.thinking,
                               prefill_bf16=args.sample_bf16 == "on")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    user_kw = {"base_url": args.user_base_url} if args.user.startswith("openai:") else \
        {"model": model, "tokenizer": tok} if args.user == "local" else {}
    user_kw["user_workers"] = args.user_workers        # run_episodes' own: how many users it asks at once

    def log(m):
        metrics.append(m)
        with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")

    if start == 0 and args.eval_every:                    # where the curve starts: the policy RL starts from
        t0 = time.time()
        log(dict(step=0, heldout_pass1=heldout_pass1(model, tok, heldout, args, user_kw), eval_s=time.time() - t0))
        print(f"step   0 | held-out pass^1 {metrics[-1]['heldout_pass1']:.3f} on {len(heldout)} tasks")
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="rl", disable=None)
    for step in bar:
        t0 = time.time()
        # 1-2. rollouts with dynamic sampling: batches of --draw tasks x G rollouts (fresh Env and simulated
        #    user each, inside run_episodes) until --tasks groups have reward variance or --max-draws batches
        #    ran. Domains alternate in a batch; each domain's system prompt is prefilled once for its rows.
        #    Own RNG: a resumed run redraws the same tasks.
        rng = random.Random(args.seed * 1_000_003 + step)
        shuffled = [rng.sample(pools[d], len(pools[d])) for d in domains]
        order = [t for row in zip(*shuffled) for t in row][:args.draw * args.max_draws]
        model.eval()                           # generation with KV cache; checkpointing is train-only
        drawn, varied = [], []
        for d in range(args.max_draws):
            tasks = order[d * args.draw:(d + 1) * args.draw]
            try:
                trajs = rollout.run_episodes(agent, tok, tasks, group_size=G, user=args.user, max_turns=args.max_turns,
                                             max_context=args.max_context, seed=args.seed * 1_000_003 + step * 101 + d,
                                             shaped=args.reward == "shaped", progress=False, **user_kw)
            except users.UserSimulatorError as e:
                sys.exit(str(e))
            if all(t.stop_reason == "error" for t in trajs):   # e.g. the user server went down mid-run
                sys.exit(f"every rollout failed: {trajs[0].stats.get('error')}")
            groups = [trajs[i * G:(i + 1) * G] for i in range(len(tasks))]
            drawn += groups
            varied += [g for g in groups if len({t.reward for t in g}) > 1]    # the rest carry no signal
            if len(varied) >= args.tasks:
                break
        kept, rollouts = varied[:args.tasks], [t for g in drawn for t in g]
        per_group = [dict(task=g[0].task_id, scenario=g[0].scenario, rewards=[t.reward for t in g],
                          trained=any(g is k for k in kept)) for g in drawn]
        t_roll = time.time() - t0
        # 3-4. reward -> group advantages, within each kept group
        train, st = [t for g in kept for t in g], None                 # st None: no group, no update
        if train:
            adv, _ = group_advantages(torch.tensor([t.reward for t in train]), G)
            # 5-7. log-probs (policy / old / reference) -> loss -> clip -> AdamW
            model.train()
            st = grpo_update(model, optimizer, train, adv, args, pad_id, ref_is_policy=not optimizer.state)
        t_train = time.time() - t0 - t_roll
        rewards = torch.tensor([t.reward for t in rollouts])
        sampled = sum(sum(t.loss_mask) for t in rollouts)
        m = dict(step=step + 1, reward=rewards.mean().item(), pass_rate=(rewards >= 1).float().mean().item(),
                 groups_drawn=len(drawn), groups_varied=len(varied), groups_trained=len(kept),
                 draws=len(drawn) // args.draw,
                 kl=st["kl_sum"] / max(st["tokens"], 1) if st else None,       # None: no group, no update
                 clip_frac=st["clipped"] / max(st["tokens"], 1) if st else None,
                 grad_norm=st["grad_norm"] / max(st["updates"], 1) if st else None,
                 entropy=-sum(sum(t.logprobs) for t in rollouts) / max(sampled, 1), tokens=sampled,
                 train_tokens=st["tokens"] if st else 0, turns=sum(t.turns for t in rollouts) / len(rollouts),
                 rollout_s=t_roll, train_s=t_train, per_group=per_group)   # which groups taught what
        if args.eval_every and (step + 1) % args.eval_every == 0:
            t1 = time.time()
            m.update(heldout_pass1=heldout_pass1(model, tok, heldout, args, user_kw), eval_s=time.time() - t1)
        m.update(s_per_step=time.time() - t0, tok_per_s=sampled / t_roll)
        log(m)
        f = lambda x, spec: "-" if x is None else format(x, spec)           # noqa: E731
        tqdm.write(f"step {m['step']:3d}/{args.steps} | reward {m['reward']:.3f} | groups {len(kept)} of {len(varied)}"
                   f" with signal of {len(drawn)} | kl {f(m['kl'], '.5f')} | ent {m['entropy']:.3f} | clip {f(m['clip_frac'], '.3f')}"
                   f" | gnorm {f(m['grad_norm'], '.3f')} | held-out {f(m.get('heldout_pass1'), '.3f')}"
                   f" | tok {sampled} | {m['s_per_step']:.0f} s/step | {m['tok_per_s']:.1f} tok/s")
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            save_checkpoint(args.out, step + 1, model, optimizer, metrics)
    model.save_pretrained(os.path.join(args.out, "adapter"), selected_adapters=["default"])
    if metrics:
        plot(metrics, os.path.join(args.out, "rl.png"), args.temperature)
    print(f"adapter -> {os.path.join(args.out, 'adapter')}")
    return metrics


# ---------------------------------------------------------------- the update's cost
def bench_update(args, rows=4, prefix=1644, own=990):
    """Seconds of one GRPO update (grpo_update, the preset's micro-batches) of --init's adapter, on random
    tokens shaped like a default rollout group's: a shared system prompt of `prefix` tokens, then `own`
    tokens a row, a third of them sampled. Timed four ways in this run, after one untimed warm-up: fp32
    with the reference pass (the baseline), fp32 without it (the first step's case), and both under bf16
    autocast; speedup = the baseline's seconds / these. AdamW at lr 0, so every way times the same update."""
    import tempfile
    from types import SimpleNamespace
    import rollout
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(100, 40000, (prefix,), generator=g).tolist()
    trajs = [SimpleNamespace(token_ids=shared + torch.randint(100, 40000, (own,), generator=g).tolist(),
                             loss_mask=[0] * (prefix + 1) + (torch.rand(own - 1, generator=g) < 1 / 3).long().tolist())
             for _ in range(rows)]
    adv = torch.tensor([1.0, -1.0] * (rows // 2))
    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL)
    with tempfile.TemporaryDirectory() as out:            # load_policy writes the frozen reference there
        model, _ = load_policy(SimpleNamespace(**{**vars(args), "out": out}), model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    print(f"bench-update: {rows} rows of {prefix} shared + {own} own tokens, micro-batch {args.micro_batch}, "
          f"{torch.get_num_threads()} threads, {rollout.DEVICE}; native bf16: {native_bf16_cpu()}")
    base = None
    for name, bf16, skip in (("warm-up", "off", False), ("fp32, reference pass", "off", False),
                             ("fp32, no reference pass", "off", True), ("bf16, reference pass", "on", False),
                             ("bf16, no reference pass", "on", True)):
        t0 = time.time()
        grpo_update(model, opt, trajs, adv, SimpleNamespace(**{**vars(args), "train_bf16": bf16}), tok.pad_token_id,
                    ref_is_policy=skip)
        dt = time.time() - t0
        if name != "warm-up":
            base = base or dt
            print(f"{name:>24}: {dt:6.1f} s  {base / dt:.2f}x", flush=True)


# ---------------------------------------------------------------- paper-scale memory check

def qwen3_shapes(tiny: bool = False):
    """Qwen3-8B's config (random weights are all a memory check needs), or the same architecture at toy size."""
    from transformers import Qwen3Config
    if tiny:
        return Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


def nf4_lora_model(config, device):
    """Random weights of `config` with every decoder Linear in bitsandbytes NF4 (quantized as it moves to
    `device`), embeddings and lm_head in the compute dtype, LoRA r16 on all linear projections."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM
    import rollout
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)      # on CPU, random weights

    def to_nf4(module):
        for name, child in module.named_children():
            if isinstance(child, torch.nn.Linear):
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=dtype, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                q.bias = child.bias
                setattr(module, name, q)
            else:
                to_nf4(child)
    to_nf4(model.model.layers)
    return rollout.add_lora(model.to(device), r=16, alpha=32)


def memory_check(config=None, seq_len=8192, n_seq=8, device="cuda"):
    """One GRPO step at paper scale: Qwen3-8B shapes with random weights, NF4 + LoRA r16, n_seq sequences
    of seq_len tokens (loss on the second half), activation checkpointing, micro-batch 1. Prints the
    weights' size and the step's peak memory (GPU: torch's allocator; CPU: the process's peak RSS).
    On CPU main() runs it at tiny Qwen3 shapes: the same code path, numbers that say nothing about 8B."""
    import resource
    from types import SimpleNamespace
    from kernels.attention import kv_bytes_per_token
    config = config or qwen3_shapes()
    model = nf4_lora_model(config, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    cuda = device == "cuda"
    weights_gib = torch.cuda.memory_allocated() / 2**30 if cuda else \
        sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**30
    torch.cuda.reset_peak_memory_stats() if cuda else None
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(n_seq):     # system/user tokens then sampled tokens: loss on the second half
        ids = torch.randint(0, config.vocab_size, (seq_len,), generator=g).tolist()
        trajs.append(SimpleNamespace(token_ids=ids, loss_mask=[0] * (seq_len // 2) + [1] * (seq_len - seq_len // 2)))
    adv, _ = group_advantages(torch.tensor([1.0, 0.0] * (n_seq // 2)), n_seq)
    args = SimpleNamespace(micro_batch=1, mini_batches=1, temperature=1.0, clip=0.2, kl_coef=0.001, max_grad_norm=1.0,
                           grad_checkpointing="on", loss_agg=GPU_DEFAULTS["loss_agg"], train_bf16="off")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    t0 = time.time()
    st = grpo_update(model, opt, trajs, adv, args, pad_id=0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kv = kv_bytes_per_token(config, model.get_input_embeddings().weight.dtype)
    print(f"memory-check ({device}): {config.num_hidden_layers} layers x {config.hidden_size} NF4+LoRA, {n_seq}x{seq_len} "
          f"tokens, one GRPO step: weights {weights_gib:.2f} GiB, peak {peak:.2f} GiB "
          f"({'allocated' if cuda else 'process RSS'}; target <= 20 at Qwen3-8B shapes), {time.time() - t0:.0f} s, "
          f"{st['tokens']} trained tokens, grad norm {st['grad_norm']:.3f}, KV {kv / 1024:.1f} KiB/token"
          + (f" -> {'OK' if peak <= 20 else 'OVER'}" if cuda else ""))
    return dict(weights_gib=weights_gib, peak_gib=peak, grad_norm=st["grad_norm"], tokens=st["tokens"], kv_bytes=kv)


if __name__ == "__main__":
    main()
