"""GRPO with a simulated user inside the rollout loop: the RL stage of MUA-RL (arXiv 2508.18669).

The loop, in main(): for each task draw G rollouts, each a conversation with a fresh environment and a fresh
simulated user (rollout.run_episodes) -> binary task reward -> keep the groups whose rewards differ (drawing
more tasks when too few do) -> group advantages (r - mean) / (std + eps) -> PPO-clipped loss + beta * k3 KL
to the frozen starting policy, over the tokens the policy sampled -> AdamW. Every --eval-every steps:
held-out pass^1, the curve to trust.

Run:
    python rl.py                        # from runs/sft/adapter; CPU preset without a GPU, paper sizes with one
    python rl.py --steps 3              # resume that run for two more steps
    python rl.py --init base            # ablation: no cold start
    python rl.py --user none --init runs/sft_none/adapter   # ablation: no user (the whole task up front), from
                                                           #   the matched cold start, sft.py --user none
    python rl.py --user scripted:default                   # one training persona only, the cooperative one
    python rl.py --reward shaped        # ablation: partial credit for correct writes
    python rl.py --sampler plain        # the sampler to read (sampler/plain.py), one conversation at a time
    python rl.py --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o   # paper scale, one GPU
    python rl.py --rollouts runs/rl/rollouts --loss-agg seq-mean --out runs/rl_seqmean   # same rollouts, other update
Writes under --out (default runs/rl): args.json, metrics.jsonl (a line a step), rl.png, rollouts/ (each step's
conversations: token ids, masks, log-probs, messages, rewards, diffs), reference/ (the starting adapter),
ckpt-NNNNNN/ (the last two) and adapter/. Rerun the same command after a kill: it resumes.
`python scripts/viewer.py runs/rl` shows the saved rollouts as one page: trained tokens, rewards, advantages.

Simplifications versus the paper:
- SmolLM2-135M-Instruct on CPU and LoRA instead of full fine-tuning; the reference is a frozen copy of the
  starting adapter on the same base weights.
- Our procedural domains and a scripted user by default (a 135M model cannot play a user); PRESETS["cpu"] is the
  same algorithm at small sizes, on one medium-tier scenario of each domain (common.CPU_TIERS).
- Dynamic sampling (DAPO) is ours: only groups whose rewards differ are trained. So is --screen (off by default):
  a group is finished only after its first rollouts showed a rare reward.
- The CPU preset takes two optimizer steps per batch of rollouts (--mini-batches 2): the second sees a ratio away
  from 1, so the clip can act. With --mini-batches 1 the ratio is exactly 1 and the clip inactive.
- Entropy is logged as the mean -log p of the sampled tokens.
"""
import contextlib
import itertools
import json
import os
import random
import shutil
import time
from collections import Counter

import torch

import common
import rollout
import sampler
import envs
import users

# CPU (2 cores, fp32, 135M), from the CPU SFT adapter, sized for <= 30 minutes: one step of 8 tasks x 6 rollouts
# in one draw (4 a domain), every group with reward variance trained, in two mini-batches (two optimizer steps on
# the step's rollouts, so the ratio leaves 1 and the clip and KL can act). The CPU tasks (common.CPU_TIERS), one
# medium scenario a domain: their openings withhold the ids, so an agent must ask. The training personas, one drawn
# per conversation; the curve (4 tasks a domain, a rough check: eval.py measures) also under the held-out ones, in
# one batch. T = 0.7: at 1.0 most of the 135M policy's failures are sampling noise. lr 1e-4: Adam's first step moves
# every LoRA weight by ~lr, and at 2e-4 one step collapsed the policy (docs/results.md).
PRESETS = {
    "gpu": dict(steps=100, tasks=32, draw=32, max_draws=3, group_size=8, max_turns=30, max_new_tokens=256,
                max_context=8192, micro_batch=1, lr=2e-5, temperature=1.0, domains="retail,airline",
                tiers="easy,medium,hard", user="scripted:train", ckpt_every=10, eval_every=10, eval_tasks=24,
                grad_checkpointing="on"),
    "cpu": dict(steps=1, tasks=8, draw=8, max_draws=1, group_size=6, **common.CPU_LIMITS, micro_batch=2,
                mini_batches=2, lr=1e-4, temperature=0.7, domains="retail,airline", tiers=common.CPU_TIERS,
                user="scripted:train", ckpt_every=1, eval_every=1, eval_tasks=4, grad_checkpointing="off"),
    "smoke": dict(steps=2, tasks=1, draw=1, max_draws=1, group_size=2, max_turns=1, max_new_tokens=8,
                  max_context=2560, micro_batch=2, lr=1e-4, temperature=1.0, domains="retail,airline", tiers="easy",
                  ckpt_every=1, eval_every=2, eval_tasks=1, grad_checkpointing="off"),
}
TASK_POOL = 1000     # train tasks generated per domain to draw from


def parse_args(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    common.add_run_args(p, out="runs/rl", smoke="2 tiny steps (tests)")
    common.add_model_args(p)
    common.add_user_args(p)
    common.add_grpo_args(p)
    g = p.group("algorithm")
    g.add_argument("--draw", type=int, default=None, help="tasks per rollout batch")
    g.add_argument("--max-draws", type=int, default=None, help="dynamic sampling: at most this many rollout batches "
                   "a step to find --tasks groups with reward variance (1 = plain GRPO)")
    g.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per batch of rollouts (> 1: the "
                   "ratio departs from 1 and the clip can act)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    g = p.group("ablation")
    g.add_argument("--screen", type=int, default=0, help="screening: each drawn task first gets this many rollouts, "
                   "and the rest of its group only if one of them got a reward other than the batch's most common "
                   "one (rollouts go to groups likely to differ; 0 = off, every task its whole group)")
    g.add_argument("--rollouts", default=None, help="train on the rollouts another run saved (its rollouts/ dir) "
                   "instead of sampling: compares update rules on identical rollouts")
    p.group("performance").add_argument("--train-bf16", default="auto", choices=["auto", "on", "off"], help="the "
                                        "update's forward and backward under bf16 autocast (weights, LoRA, AdamW and "
                                        "the log-softmax stay fp32); auto = on for a CPU with native bf16 dot "
                                        "products (AVX512-BF16 or AMX), off on GPU (bf16 already)")
    g = p.group("run")
    g.add_argument("--max-sim-failures", type=float, default=0.25, help="stop when more than this fraction of a "
                   "step's rollouts lost their user simulator or environment (those rollouts are never trained on)")
    g.add_argument("--ckpt-every", type=int, default=None, help="checkpoint every N steps")
    g.add_argument("--eval-every", type=int, default=None, help="held-out pass^1 every N steps, and before step 1 "
                   "(0 = never)")
    g.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks per domain for that curve")
    g.add_argument("--eval-users", default=None, help="comma list of the users the curve is measured under "
                   "(default: --user, and the held-out personas, scripted:heldout, when --user is scripted)")
    g.add_argument("--eval-skip", type=int, default=24, help="the curve uses the held-out tasks after the first N "
                   "of each domain, the ones eval.py's CPU preset reports")
    args = common.parse_with_preset(p, PRESETS, argv)
    if args.train_bf16 == "auto":
        args.train_bf16 = "on" if native_bf16_cpu() and not torch.cuda.is_available() and not args.load_in_4bit else "off"
    common.check_args(args, at_least=dict(steps=1, tasks=1, draw=1, max_draws=1, group_size=2, max_turns=1,
                                          max_new_tokens=1, max_context=2, micro_batch=1, mini_batches=1,
                                          ckpt_every=1, eval_every=0, eval_tasks=1, eval_skip=0, lora_r=1,
                                          user_workers=1),
                      finite=dict(lr=(0, True), kl_coef=(0, False), clip=(0, True), temperature=(0, True),
                                  max_grad_norm=(0, True), weight_decay=(0, False), max_sim_failures=(0, False)),
                      training=True)
    if not 0 <= args.screen < args.group_size:
        common.fail("--screen", f"{args.screen}: 0 (off) or fewer rollouts than --group-size {args.group_size}")
    if args.rollouts and not os.path.isdir(args.rollouts):
        common.fail("--rollouts", f"{args.rollouts} is not a dir; use another run's <out>/rollouts")
    if args.eval_users is None:
        args.eval_users = args.user + ",scripted:heldout" * args.user.startswith("scripted")
    for u in args.eval_users.split(","):
        if error := users.check_user(u):
            common.fail("--eval-users", error)
    if args.user == "oracle":
        common.fail("--user", "oracle is the gold user of the oracle agent (sft.py, tests); RL needs scripted, none, "
                    "local or openai:MODEL")
    return args


def native_bf16_cpu() -> bool:
    """Does this CPU have bf16 dot products (AVX512-BF16 or AMX)? --train-bf16 auto autocasts only there."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# ---------------------------------------------------------------- GRPO pieces (tested)

def has_signal(group) -> bool:
    """A group whose rewards all agree has advantage 0 everywhere: it teaches nothing, and is not trained on."""
    return len({t.reward for t in group}) > 1


def group_advantages(rewards, group_size, eps=1e-4):
    """rewards (N,) task-major -> advantages (N,): (r - mean_group) / (std_group + eps)."""
    r = rewards.float().view(-1, group_size)                    # (groups, G)
    mean, std = r.mean(1, keepdim=True), r.std(1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).view(-1)


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
    """One GRPO update on the kept groups' rollouts, the README's objective read top to bottom:
      1. the reference's and the old policy's log-probs of every rollout, before any optimizer step;
      2. per mini-batch (--mini-batches): the policy's log-probs -> grpo_loss -> backward, then clip -> AdamW.
    The old policy is the one that sampled the rollouts. With one mini-batch (the default) it is the policy being
    updated, so its log-probs are the policy's own, detached: the ratio is exactly 1 and the clip never acts. The
    clip acts from the second optimizer step on the same rollouts (--mini-batches > 1).
    ref_is_policy: no optimizer step since RL started, so the reference IS the policy: its pass is skipped (exact:
    KL 0 and its gradient 0). args.train_bf16: the passes run under bf16 autocast (weights, LoRA and AdamW stay
    fp32). Rows of a domain share its system prompt, which goes through the model once a pass
    (common.prefix_batches, prefix_run_once). -> stats summed for the log."""
    dev = next(p for p in model.parameters() if p.requires_grad).device
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].token_ids))     # shortest first: less padding
    trajs, adv = [trajs[i] for i in order], adv[order].to(dev)
    batches = common.prefix_batches([t.token_ids for t in trajs], [t.loss_mask for t in trajs],
                                    [getattr(t, "domain", None) for t in trajs], args.micro_batch, pad_id,
                                    share=args.grad_checkpointing == "off", device=dev)
    bf16 = torch.autocast(dev.type, torch.bfloat16, enabled=args.train_bf16 == "on")
    old = ref = None                              # {micro-batch rows: log-probs (b, T - P)}; None: computed below
    with torch.no_grad(), bf16:
        if not ref_is_policy:
            with reference_policy(model):
                ref = common.batch_logprobs(model, batches, args.temperature)
        if args.mini_batches > 1:                 # later optimizer steps need the sampling policy's log-probs
            old = common.batch_logprobs(model, batches, args.temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    total = dict(kl_sum=0.0, clipped=0, tokens=0, grad_norm=0.0, updates=0)
    for part in common.split_mini_batches(batches, args.mini_batches):
        n_tokens = max(1, sum(int(mask.sum()) for b in part for _, _, mask in b.micro))
        n_seqs = sum(len(ids) for b in part for ids, _, _ in b.micro)
        optimizer.zero_grad(set_to_none=True)
        for b in part:                            # gradients add up over the domains of the mini-batch
            with bf16, common.prefix_run_once(model, b.prefix) as cache_for:
                for rows, (ids, attn, mask) in zip(b.rows, b.micro):
                    rows = tuple(rows)
                    logp = common.sequence_logprobs(model, ids, attn, mask, args.temperature,
                                                    past_key_values=cache_for(len(ids)))    # (b, T - P), with grad
                    old_logp = old[rows] if old is not None else logp.detach()
                    ref_logp = ref[rows] if ref is not None else old_logp     # the reference is the old policy
                    loss, st = grpo_loss(logp, old_logp, ref_logp, adv[list(rows)], mask, args.clip, args.kl_coef,
                                         args.loss_agg, n_tokens, n_seqs)
                    loss.backward()
                    for k in ("kl_sum", "clipped", "tokens"):
                        total[k] += st[k]
        total["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        optimizer.step()
        total["updates"] += 1
    return total


def plot(metrics, path, temperature):
    """Three panels: pass^1 of the training rollouts and of the greedy policy on held-out tasks (the curve that
    matters), the KL to the reference, and the groups drawn / with reward variance / trained per step."""
    fig, axes = common.figure(3, (12, 3.4))
    trained = [m for m in metrics if "reward" in m]
    evals = [m for m in metrics if m.get("heldout_pass1") is not None]
    axes[0].plot([m["step"] for m in trained], [m["pass_rate"] for m in trained], marker=".",
                 label=f"training rollouts (T = {temperature:g})")
    curves = {}                                   # a curve per user of --eval-users
    for m in evals:
        for user, v in (m.get("heldout_by_user") or {"--user": m["heldout_pass1"]}).items():
            curves.setdefault(user, []).append((m["step"], v))
    for user, points in curves.items():
        axes[0].plot(*zip(*points), marker="o", label=f"held-out, greedy, {user}")
        for x, y in points:
            axes[0].annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    axes[0].set(title="pass^1", xlabel="step", ylim=(-0.02, 1.1))
    axes[0].set_xticks(sorted({m["step"] for m in metrics}))
    kl = [m for m in trained if m["kl"] is not None]
    axes[1].plot([m["step"] for m in kl], [m["kl"] for m in kl], marker=".")
    axes[1].set(title="KL to the starting policy (k3)", xlabel="step")
    axes[1].set_xticks([m["step"] for m in kl])
    steps = [m["step"] for m in trained]
    axes[2].bar(steps, [m["groups_drawn"] for m in trained], color="0.8", label="drawn")
    axes[2].bar(steps, [m["groups_varied"] for m in trained], color="C9", label="rewards differ")
    axes[2].bar(steps, [m["groups_trained"] for m in trained], label="trained")    # <= varied: --tasks caps it
    axes[2].set(title="groups per step", xlabel="step")
    axes[2].set_xticks(steps)
    for ax in (axes[0], axes[2]):
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    common.save_figure(fig, path)


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


# ---------------------------------------------------------------- the loop's helpers

def load_policy(args, model):
    """The trained adapter ("default") and the frozen KL reference ("ref"), both the policy RL starts from: --init's
    adapter, copied to <out>/reference, so a resumed run starts from its own (common.resume then loads the newest
    checkpoint's weights into "default"). From base: a fresh LoRA and no "ref" (the reference is the base model
    with the adapter off, see reference_policy)."""
    ref_dir, init = os.path.join(args.out, "reference"), args.init
    if common.checkpoints(args.out):              # resuming: the run's own starting point, whatever --init says now
        init = ref_dir if os.path.isdir(ref_dir) else "base"
    elif init == "auto":
        init = "runs/sft/adapter" if os.path.isdir("runs/sft/adapter") else "base"
    if init == "base":
        print("init: base model + fresh LoRA (no cold-start SFT adapter; run `python sft.py` for one)")
        return rollout.add_lora(model, r=args.lora_r, alpha=args.lora_alpha)
    print(f"init: SFT adapter {init}")
    model = rollout.load_adapter(model, init, trainable=True)
    if init != ref_dir:
        shutil.copytree(init, ref_dir, dirs_exist_ok=True)
    model.load_adapter(ref_dir, adapter_name="ref", is_trainable=False)
    return model


def task_sets(args):
    """Each domain's pool of train tasks, and the fixed held-out tasks of the curve (a slice eval.py never reports)."""
    tiers, domains = args.tiers.split(","), args.domains.split(",")
    pools = {d: envs.make_tasks(d, "train", TASK_POOL, tiers, args.seed) for d in domains}
    heldout = [t for d in domains for t in
               envs.make_tasks(d, "test", args.eval_skip + args.eval_tasks, tiers, args.seed)[args.eval_skip:]]
    return pools, heldout


def sample_groups(agent, tok, pools, step, args, user_kw):
    """Steps 1-2: batches of --draw tasks x G rollouts (a fresh env and simulated user each, inside
    run_episodes; with --screen, `screened`) until --tasks groups have reward variance or --max-draws batches
    ran. Domains alternate in a batch; each domain's system prompt is prefilled once for its rows. The task order
    has its own RNG, so a resumed run redraws the same tasks. A rollout whose user simulator or environment
    failed is left out of its group: its 0 would be the infrastructure's, not the agent's. -> (drawn groups, kept
    groups, the number of rollouts left out)."""
    rng, G = random.Random(args.seed * 1_000_003 + step), args.group_size
    shuffled = [rng.sample(pool, len(pool)) for pool in pools.values()]
    order = [t for row in zip(*shuffled) for t in row][:args.draw * args.max_draws]
    drawn, varied, lost = [], [], 0
    for d in range(args.max_draws):
        tasks = order[d * args.draw:(d + 1) * args.draw]
        groups = screened(agent, tok, tasks, step, d, args, user_kw) if args.screen else \
            split(rollouts(agent, tok, tasks, step, d, args, user_kw), [G] * len(tasks))
        trajs = [t for g in groups for t in g]
        failed = [t for t in trajs if t.failed]
        if len(failed) > args.max_sim_failures * len(trajs):
            raise SystemExit(f"step {step + 1}: {len(failed)} of {len(trajs)} rollouts lost their simulator, more "
                             f"than --max-sim-failures {args.max_sim_failures}: {failed[0].stats.get('error')}")
        lost += len(failed)
        groups = [[t for t in g if not t.failed] for g in groups]
        drawn += groups
        varied += [g for g in groups if has_signal(g)]
        if len(varied) >= args.tasks:
            break
    return drawn, varied[:args.tasks], lost


def split(trajs, sizes):
    """Consecutive rollouts cut into groups of the given sizes."""
    ends = list(itertools.accumulate(sizes))
    return [trajs[e - n:e] for n, e in zip(sizes, ends)]


def screened(agent, tok, tasks, step, d, args, user_kw):
    """--screen K: trials 0..K-1 of every task first; then trials K..G-1 only of the tasks where one of the first
    K got a reward other than the batch's most common one. With a weak policy most rewards are 0, so a group is
    finished only after a success, and the rollouts of tasks the policy never solves stop at K. A task that is not
    finished stays a group of K that teaches nothing (for K >= 2 its rewards can only be equal). The selection
    looks at a finished group's first rollouts, as dynamic sampling looks at whole groups: the kept groups lean
    towards the outcome that is rare in the batch. -> groups, one per task."""
    K, G = args.screen, args.group_size
    first = split(rollouts(agent, tok, tasks, step, d, args, user_kw, trials=(0, K)), [K] * len(tasks))
    seen = Counter(t.reward for g in first for t in g if not t.failed).most_common(1)
    go = [i for i, g in enumerate(first) if any(not t.failed and t.reward != seen[0][0] for t in g)]
    rest = split(rollouts(agent, tok, [tasks[i] for i in go], step, d, args, user_kw, trials=(K, G)),
                 [G - K] * len(go)) if go else []
    for i, more in zip(go, rest):
        first[i] = first[i] + more
    return first


def rollouts(agent, tok, tasks, step, d, args, user_kw, trials=None):
    """Trials [a, b) of every task (None: the whole group), task-major, saved as <out>/rollouts/step-S-draw-D.jsonl
    (with --screen: ...-draw-D-trials-a-b.jsonl; whole Trajectories: token ids, masks, sampler log-probs, messages,
    rewards, diffs; scripts/viewer.py shows them); with --rollouts DIR, read from another run's files instead of sampled,
    so update rules (--loss-agg, --lr, --kl-coef, ...) can be compared on identical rollouts."""
    a, b = trials or (0, args.group_size)
    name = f"step-{step + 1:06d}-draw-{d}" + (f"-trials-{a}-{b}" if trials else "") + ".jsonl"
    if args.rollouts:
        path = os.path.join(args.rollouts, name)
        if not os.path.isfile(path):
            raise SystemExit(f"--rollouts {args.rollouts}: no {name}; that run drew fewer steps or batches, or "
                             "screened differently (--screen)")
        with open(path) as f:
            return [rollout.Trajectory(**json.loads(line)) for line in f]
    trajs = rollout.run_episodes(agent, tok, tasks, group_size=b - a, first_trial=a, user=args.user,
                                 max_turns=args.max_turns, max_context=args.max_context,
                                 seed=args.seed * 1_000_003 + step * 101 + d, shaped=args.reward == "shaped",
                                 progress=True, **user_kw)
    os.makedirs(os.path.join(args.out, "rollouts"), exist_ok=True)
    with open(os.path.join(args.out, "rollouts", name), "w") as f:
        for t in trajs:
            f.write(json.dumps(vars(t)) + "\n")
    return trajs


def step_metrics(step, drawn, kept, lost, st, adv, seconds):
    """The step's log line fields: reward, pass rate, groups, KL, clip, grad norm, entropy, tokens, seconds; and
    per_group, what scripts/viewer.py shows: each drawn group's task, its rollouts (trials) and rewards, and either the
    advantages it was trained with (adv: the kept groups' advantages, concatenated in `kept` order, None when
    none was kept) or why it was filtered. A group whose every rollout lost its simulator is not listed."""
    rollouts = [t for g in drawn for t in g]
    rewards, sampled = torch.tensor([t.reward for t in rollouts]), sum(sum(t.loss_mask) for t in rollouts)
    per = lambda k: st[k] / max(st["tokens"], 1) if st else None                  # noqa: E731; None: no update
    trained, rest = {}, [] if adv is None else adv.tolist()
    for g in kept:                                  # id(group) -> its slice of adv
        trained[id(g)], rest = rest[:len(g)], rest[len(g):]

    def group(g):                                   # trained with these advantages, or filtered, and why
        why = "" if id(g) in trained else "no variance" if len({t.reward for t in g}) == 1 else "over --tasks cap"
        return dict(task=g[0].task_id, scenario=g[0].scenario, trials=[t.trial for t in g],
                    rewards=[t.reward for t in g], trained=id(g) in trained, advantages=trained.get(id(g)), filtered=why)
    return dict(step=step + 1, reward=rewards.mean().item(), pass_rate=(rewards >= 1).float().mean().item(),
                groups_drawn=len(drawn), groups_varied=sum(map(has_signal, drawn)),
                signal_token_share=sum(sum(t.loss_mask) for g in drawn if has_signal(g) for t in g) / max(sampled, 1),
                groups_trained=len(kept), kl=per("kl_sum"), clip_frac=per("clipped"),
                grad_norm=st["grad_norm"] / max(st["updates"], 1) if st else None,
                entropy=-sum(sum(t.logprobs) for t in rollouts) / max(sampled, 1), tokens=sampled,
                train_tokens=st["tokens"] if st else 0, turns=sum(t.turns for t in rollouts) / len(rollouts),
                sim_failures=lost, **seconds,
                tok_per_s=sampled / seconds["rollout_s"] if seconds["rollout_s"] else None,
                per_group=[group(g) for g in drawn if g])


def log_line(m, steps) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)                    # noqa: E731
    return (f"step {m['step']:3d}/{steps} | reward {m['reward']:.3f} | groups {m['groups_trained']} of "
            f"{m['groups_varied']} with signal of {m['groups_drawn']} ({m['signal_token_share']:.0%} of tokens) | kl "
            f"{f(m['kl'], '.5f')} | ent {m['entropy']:.3f} | clip {f(m['clip_frac'], '.3f')} | gnorm "
            f"{f(m['grad_norm'], '.3f')} | held-out {f(m.get('heldout_pass1'), '.3f')} | tok {m['tokens']} | "
            f"{m['s_per_step']:.0f} s/step | {f(m['tok_per_s'], '.1f')} tok/s")


def heldout_pass1(model, tok, tasks, args, user_kw) -> dict:
    """pass^1 of the greedy policy on the fixed held-out tasks (eval.py's settings) under each of --eval-users, all
    users' episodes in one batch, and its seconds. heldout_pass1 is the first user's (the training user's): the
    curve the plot draws."""
    t0, specs = time.time(), args.eval_users.split(",")
    agent = sampler.make_agent(args.sampler, model, tok, 0.0, args.max_new_tokens, args.kv_budget, args.thinking)
    model.eval()
    trajs = rollout.run_episodes(agent, tok, tasks * len(specs), user=[u for u in specs for _ in tasks],
                                 max_turns=args.max_turns, max_context=args.max_context, seed=args.seed,
                                 progress=False, **user_kw)
    by_user = {}
    for k, user in enumerate(specs):
        ok = [t for t in trajs[k * len(tasks):(k + 1) * len(tasks)] if not t.failed]
        by_user[user] = sum(t.reward >= 1 for t in ok) / max(len(ok), 1)
    return dict(heldout_pass1=by_user[specs[0]], heldout_by_user=by_user, eval_s=time.time() - t0)


def heldout_line(m) -> str:
    return ", ".join(f"{v:.3f} under {u}" for u, v in m["heldout_by_user"].items())


# ---------------------------------------------------------------- the loop

def main(argv=None):
    args = parse_args(argv)                       # bad input: one line, exit 2, before anything loads
    common.start_run(args, args.out)
    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL, load_in_4bit=args.load_in_4bit)
    model = load_policy(args, model)
    if args.grad_checkpointing == "on":           # less activation memory, more compute, no shared prefix
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    start, metrics = common.resume(args.out, model, optimizer)     # a rerun after a kill goes on from here
    if not start:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
    pools, heldout = task_sets(args)
    agent = sampler.make_agent(args.sampler, model, tok, args.temperature, args.max_new_tokens, args.kv_budget,
                               args.thinking)
    user_kw = common.user_kwargs(args, model, tok)

    def log(m):
        metrics.append(m)
        with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")

    if start == 0 and args.eval_every:            # where the curve starts: the policy RL starts from
        log(dict(step=0, **heldout_pass1(model, tok, heldout, args, user_kw)))
        print(f"step   0 | held-out pass^1 {heldout_line(metrics[-1])} on {len(heldout)} tasks")
    for step in range(start, args.steps):
        t0 = time.time()
        model.eval()                              # 1-2. rollouts with the user in the loop, rewards, dynamic sampling
        drawn, kept, lost = sample_groups(agent, tok, pools, step, args, user_kw)
        agent.forget()                            # its keys/values go stale with the update: not kept beside it
        t_roll, st, adv = time.time() - t0, None, None
        if kept:                                  # 3. advantages within each kept group
            adv = torch.cat([group_advantages(torch.tensor([t.reward for t in g]), len(g)) for g in kept])
            model.train()                         # 4. log-probs -> clipped loss + k3 KL -> AdamW
            st = grpo_update(model, optimizer, [t for g in kept for t in g], adv, args, tok.pad_token_id,
                             ref_is_policy=not optimizer.state)
        m = step_metrics(step, drawn, kept, lost, st, adv, dict(rollout_s=None if args.rollouts else t_roll,
                                                                    train_s=time.time() - t0 - t_roll))
        if args.eval_every and (step + 1) % args.eval_every == 0:     # 5. the held-out curve
            m.update(heldout_pass1(model, tok, heldout, args, user_kw))
        m["s_per_step"] = time.time() - t0
        log(m)
        print(log_line(m, args.steps), flush=True)
        if "heldout_by_user" in m:
            print(f"step {step + 1:3d} | held-out pass^1 {heldout_line(m)} on {len(heldout)} tasks", flush=True)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            common.save_checkpoint(args.out, step + 1, model, optimizer, metrics)
    model.save_pretrained(os.path.join(args.out, "adapter"), selected_adapters=["default"])
    plot(metrics, os.path.join(args.out, "rl.png"), args.temperature)
    print(f"adapter -> {os.path.join(args.out, 'adapter')}")
    return metrics


if __name__ == "__main__":
    main()
