"""GRPO with a simulated user inside the rollout loop (the MUA-RL stage, arXiv 2508.18669).

Each step: sample train tasks -> G rollouts per task, each with a fresh Env and a fresh
simulated user -> binary task reward -> group advantages (r - mean) / (std + eps) ->
per-token log-probs of the policy (LoRA on), the old policy (before this step's update) and
the reference (same weights, adapter off) -> PPO-clipped loss + beta * k3 KL, token-mean
over the tokens the policy sampled -> grad clip -> AdamW. All in the `for step` loop in main().

Run:
    python rl.py                        # CPU preset on CPU (<= 20 min on 2 cores), paper sizes on GPU
    python rl.py --smoke --out /tmp/rl  # 2 tiny steps, < 2 min on CPU (used by tests/test_rl.py)
    python rl.py --init base            # ablation: no cold start (default: runs/sft/adapter if present)
    python rl.py --user none            # ablation: whole instruction up front, no user turns
    python rl.py --reward shaped        # ablation: partial credit for correct writes
    python rl.py --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o   # paper scale
    python rl.py --memory-check         # Qwen3-8B shapes, random NF4 weights, one step, peak GPU memory (CPU: tiny shapes)
Everything goes under --out (default runs/rl): args.json, metrics.jsonl, rl.png, checkpoints
(ckpt-NNNNNN/: adapter + optimizer + step + RNG states + metrics), and adapter/ at the end.
Killed and restarted with the same --out, a run resumes from its latest checkpoint (steps
after it are redone, with the same tasks and RNG state); delete --out to start over.

Differences from the paper (and its official code):
- Model: SmolLM2-135M-Instruct (bundled, fp32 on CPU) instead of Qwen3-8B/14B/32B; LoRA
  (r 16) instead of full fine-tuning, so the reference is the same model with the adapter off.
- Environments: our procedural retail/airline domains (envs.py), not tau2-bench. Each step
  draws its tasks from one domain, domains taking turns, so all its rollouts share one
  system prompt (~1.8k tokens) that the agent prefills once per step.
- User: a scripted user by default (a 135M model cannot play a user); the paper uses GPT-4o
  (`--user openai:gpt-4o` here).
- CPU preset (chosen automatically when there is no GPU; the GPU defaults are the paper's
  32 tasks x 8 rollouts, 30 turns, all tiers): 8 steps of 2 tasks x 4 rollouts, at most 6 agent
  turns of 96 new tokens, 3072-token context, easy tier only, a checkpoint every step. Same
  algorithm, tiny numbers: on 2 cores a step's rollouts cost ~1 min, and training ~45-55 s when
  one group has reward variance, ~60-70 s when both do (see CPU_PRESET), so the CPU run shows the
  loop working, not a learning curve. Easy tasks only because a group teaches something only if some but not all of
  its rollouts succeed, and the CPU SFT adapter (trained on the easy tier) solves some of them.
  Raise --steps/--tasks/--tiers when you have time.
- One optimizer step per batch of rollouts by default (--mini-batches 1); then the old
  policy equals the policy, so old log-probs are the detached policy log-probs (no
  extra forward) and the ratio is exactly 1. With --mini-batches > 1 they are computed
  (no grad) before the first update and clipping starts to matter.
- Entropy is estimated as the mean -log p of the sampled tokens (sampler log-probs), not the
  full-vocabulary entropy.
- Learning rate: ours, for LoRA (2e-5 GPU; 1e-4 in the CPU preset, where only a few steps
  run); full fine-tuning would use a smaller one.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import time

import torch

GPU_DEFAULTS = dict(steps=100, tasks=32, group_size=8, max_turns=30, max_new_tokens=256,
                    max_context=8192, micro_batch=1, lr=2e-5, tiers="easy,medium,hard", ckpt_every=10,
                    grad_checkpointing="on")
# CPU (2 cores, fp32, 135M), quiet machine, from the CPU SFT adapter. Measured: rolling out 2 tasks x 4
# (6 rounds of <= 96 tokens) takes 60-69 s a step; training takes 44-54 s when one group has reward
# variance and 59-71 s when both do, the system prompt run once per pass (105-120 s for one group with
# activation checkpointing and a pass per sequence). The oracle needs 4-7 turns on easy/medium tasks, hence 6 turns. Two groups a step: more
# chances of a group with reward variance.
CPU_PRESET = dict(steps=8, tasks=2, group_size=4, max_turns=6, max_new_tokens=96,
                  max_context=3072, micro_batch=2, lr=1e-4, tiers="easy", ckpt_every=1, grad_checkpointing="off")
SMOKE = dict(steps=2, tasks=1, group_size=2, max_turns=1, max_new_tokens=8,
             max_context=2560, micro_batch=2, lr=1e-4, tiers="easy", ckpt_every=1, grad_checkpointing="off")


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
    p.add_argument("--domains", default="retail,airline", help="comma-separated train domains")
    p.add_argument("--task-pool", type=int, default=200, help="train tasks generated per domain to sample from")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (preset)")
    p.add_argument("--tasks", type=int, default=None, help="tasks per step (preset; paper 32)")
    p.add_argument("--group-size", type=int, default=None, help="rollouts per task G (preset; paper 8)")
    p.add_argument("--max-turns", type=int, default=None, help="agent turns per episode (preset; paper 30)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per agent turn (preset)")
    p.add_argument("--max-context", type=int, default=None, help="episode token limit (preset)")
    p.add_argument("--tiers", default=None, help="task tiers to train on (preset)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (paper 1.0)")
    p.add_argument("--kl-coef", type=float, default=0.001, help="beta for the k3 KL to the reference (paper 0.001)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon (paper 0.2)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (preset)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per batch of rollouts")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (preset)")
    p.add_argument("--grad-checkpointing", default=None, choices=["on", "off"],
                   help="recompute activations in backward (preset: GPU on; CPU off, which lets the system "
                        "prompt run once per pass)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank when starting from base")
    p.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha when starting from base")
    p.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every N steps (preset)")
    p.add_argument("--seed", type=int, default=0, help="seed for task sampling, users and sampling")
    p.add_argument("--out", default="runs/rl", help="output dir (everything this run writes)")
    p.add_argument("--smoke", action="store_true", help="2 tiny steps (< 2 min on CPU)")
    p.add_argument("--cpu-preset", default="auto", choices=["auto", "on", "off"], help="auto = on without a GPU")
    p.add_argument("--memory-check", action="store_true", help="one paper-scale GRPO step on random Qwen3-8B shapes in "
                   "NF4, peak memory (GPU); without a GPU the same step at tiny shapes on CPU")
    args = p.parse_args(argv)
    cpu = args.cpu_preset == "on" or (args.cpu_preset == "auto" and not torch.cuda.is_available())
    preset = SMOKE if args.smoke else CPU_PRESET if cpu else GPU_DEFAULTS
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


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


def grpo_loss(logp, old_logp, ref_logp, adv, mask, clip=0.2, beta=0.001, n_tokens=None):
    """PPO-clipped GRPO loss with k3 KL to the reference, token-mean over masked tokens.
    logp/old_logp/ref_logp/mask: (B, T); adv: (B,). n_tokens: the normaliser (default mask.sum();
    pass the whole mini-batch's count when accumulating over micro-batches).
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
    n = n_tokens if n_tokens is not None else m.sum().clamp(min=1)
    loss = per_token.sum() / n
    clipped = ((ratio - 1).abs() > clip) & m
    stats = dict(kl_sum=(kl * m).sum().item(), clipped=clipped.sum().item(), tokens=m.sum().item())
    return loss, stats


def grpo_update(model, optimizer, trajs, adv, args, pad_id):
    """Steps 5-7 for the trajectories of groups with signal: log-probs (policy, old, reference),
    loss, backward, clip, AdamW. Returns summed stats for logging.
    A step's rollouts share their system prompt (one domain a step): without activation
    checkpointing it goes through the model once per pass (kernels.*_with_shared_prefix, exact)."""
    from kernels import backward_with_shared_prefix, logprobs_with_shared_prefix, shared_prefix_len
    dev = next(p for p in model.parameters() if p.requires_grad).device
    P = 0 if args.grad_checkpointing == "on" else shared_prefix_len([t.token_ids for t in trajs],
                                                                      [t.loss_mask for t in trajs])
    prefix = torch.tensor(trajs[0].token_ids[:P], dtype=torch.long, device=dev)
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].token_ids))   # less padding per micro-batch
    micro = []
    for s in range(0, len(order), args.micro_batch):
        idx = order[s:s + args.micro_batch]
        ids, attn, mask = (x[:, P:].to(dev) for x in batch_trajectories([trajs[i] for i in idx], pad_id))
        micro.append(dict(ids=ids, attn=attn, mask=mask, adv=adv[idx].to(dev)))
    inputs = lambda mbs: [(mb["ids"], mb["attn"], mb["mask"]) for mb in mbs]     # noqa: E731
    with torch.no_grad():        # before any update: reference always, old policy only if it can differ
        with model.disable_adapter():
            for mb, ref in zip(micro, logprobs_with_shared_prefix(model, prefix, inputs(micro), args.temperature)):
                mb["ref"] = ref
        if args.mini_batches > 1:
            for mb, old in zip(micro, logprobs_with_shared_prefix(model, prefix, inputs(micro), args.temperature)):
                mb["old"] = old
    params = [p for p in model.parameters() if p.requires_grad]
    total = dict(kl_sum=0.0, clipped=0, tokens=0, grad_norm=0.0, updates=0)
    per = math.ceil(len(micro) / args.mini_batches)
    for s in range(0, len(micro), per):
        chunk = micro[s:s + per]
        n_tokens = max(1, sum(int(mb["mask"].sum()) for mb in chunk))

        def loss_of(i, logp):                                   # logp: (b, T - P), with grad
            mb = chunk[i]
            old = mb["old"] if "old" in mb else logp.detach()
            loss, st = grpo_loss(logp, old, mb["ref"], mb["adv"], mb["mask"], args.clip, args.kl_coef,
                                 n_tokens=n_tokens)
            for k in ("kl_sum", "clipped", "tokens"):
                total[k] += st[k]
            return loss
        optimizer.zero_grad(set_to_none=True)
        backward_with_shared_prefix(model, prefix, inputs(chunk), loss_of, args.temperature)
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
    model.save_pretrained(os.path.join(tmp, "adapter"))
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


def plot(metrics, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    steps = [m["step"] for m in metrics]
    for ax, key in zip(axes, ("reward", "kl", "entropy")):
        ax.plot(steps, [m[key] for m in metrics], marker="o")
        ax.set_title(key)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- the loop

def main(argv=None):
    args = parse_args(argv)
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
    os.makedirs(args.out, exist_ok=True)
    print(vars(args))
    with open(os.path.join(args.out, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=1)

    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL, load_in_4bit=args.load_in_4bit)
    ckpt = latest_checkpoint(args.out)
    if ckpt:
        model = rollout.load_adapter(model, os.path.join(ckpt, "adapter"), trainable=True)
    else:
        init = args.init
        if init == "auto":
            init = "runs/sft/adapter" if os.path.isdir("runs/sft/adapter") else "base"
            if init == "base":
                print("init: runs/sft/adapter not found (run `python sft.py` for the cold start)")
        if init == "base":
            print("init: base model + fresh LoRA (no cold-start SFT adapter)")
            model = rollout.add_lora(model, r=args.lora_r, alpha=args.lora_alpha)
        elif not os.path.isdir(init):
            sys.exit(f"--init {init}: no such adapter dir; run `python sft.py` first or pass --init base")
        else:
            print(f"init: SFT adapter {init}")
            model = rollout.load_adapter(model, init, trainable=True)
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

    tiers, domains = set(args.tiers.split(",")), args.domains.split(",")
    pools = {d: [t for t in envs.make_tasks(d, "train", args.task_pool, seed=args.seed) if t.tier in tiers]
             for d in domains}
    agent = rollout.ModelAgent(model, tok, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                               kv_budget=int(args.kv_budget * 2**30) or None, thinking=args.thinking)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    G = args.group_size
    user_kw = {"base_url": args.user_base_url} if args.user.startswith("openai:") else \
        {"model": model, "tokenizer": tok} if args.user == "local" else {}
    user_kw["user_workers"] = args.user_workers        # run_episodes' own: how many users it asks at once

    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="rl", disable=None)
    for step in bar:
        t0 = time.time()
        # 1. sample tasks: one domain per step, in turn, so every rollout of the step shares one
        #    system prompt (ModelAgent prefills it once). Own RNG: a resumed run redraws the same tasks.
        pool = pools[domains[step % len(domains)]]
        tasks = random.Random(args.seed * 1_000_003 + step).sample(pool, args.tasks)
        # 2. G rollouts per task, fresh Env + fresh simulated user each (inside run_episodes)
        model.eval()                           # generation with KV cache; checkpointing is train-only
        try:
            trajs = rollout.run_episodes(agent, tok, tasks, group_size=G, user=args.user,
                                         max_turns=args.max_turns, max_context=args.max_context,
                                         seed=args.seed * 1_000_003 + step, shaped=args.reward == "shaped",
                                         progress=False, **user_kw)
        except users.UserSimulatorError as e:
            sys.exit(str(e))
        if all(t.stop_reason == "error" for t in trajs):   # e.g. the user server went down mid-run
            sys.exit(f"every rollout failed: {trajs[0].stats.get('error')}")
        t_roll = time.time() - t0
        # 3-4. reward -> group advantages; zero-variance groups are skipped
        rewards = torch.tensor([t.reward for t in trajs])
        adv, zero_var = group_advantages(rewards, G)
        keep = [i for i in range(len(trajs)) if not zero_var[i // G]]
        # 5-7. log-probs (policy / old / reference) -> loss -> clip -> AdamW
        model.train()
        st = dict(kl_sum=0.0, clipped=0, tokens=0, grad_norm=0.0, updates=0)
        if keep:
            st = grpo_update(model, optimizer, [trajs[i] for i in keep], adv[keep], args, pad_id)
        sampled = sum(sum(t.loss_mask) for t in trajs)
        secs = time.time() - t0
        m = dict(step=step + 1, reward=rewards.mean().item(),
                 pass_rate=(rewards >= 1).float().mean().item(),
                 solved_groups=int((rewards.view(-1, G) >= 1).any(1).sum()), groups=len(tasks),
                 zero_var_groups=int(zero_var.sum()),
                 kl=st["kl_sum"] / max(st["tokens"], 1), entropy=-sum(sum(t.logprobs) for t in trajs) / max(sampled, 1),
                 clip_frac=st["clipped"] / max(st["tokens"], 1), grad_norm=st["grad_norm"] / max(st["updates"], 1),
                 tokens=sampled, train_tokens=st["tokens"], turns=sum(t.turns for t in trajs) / len(trajs),
                 rollout_s=t_roll, s_per_step=secs, tok_per_s=sampled / secs)
        metrics.append(m)
        tqdm.write(f"step {m['step']:3d}/{args.steps} | reward {m['reward']:.3f} | solved {m['solved_groups']}/{len(tasks)}"
                   f" | zero-var {m['zero_var_groups']}/{len(tasks)} | kl {m['kl']:.5f} | ent {m['entropy']:.3f}"
                   f" | clip {m['clip_frac']:.3f} | gnorm {m['grad_norm']:.3f} | tok {sampled}"
                   f" | {secs:.1f} s/step | {m['tok_per_s']:.1f} tok/s")
        with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            save_checkpoint(args.out, step + 1, model, optimizer, metrics)
    model.save_pretrained(os.path.join(args.out, "adapter"))
    if metrics:
        plot(metrics, os.path.join(args.out, "rl.png"))
    print(f"adapter -> {os.path.join(args.out, 'adapter')}")
    return metrics


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
                           grad_checkpointing="on")
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
