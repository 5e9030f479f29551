"""GRPO with a simulated user inside the rollout loop: the RL stage of MUA-RL (arXiv 2508.18669).

One step, grpo_step, top to bottom: G conversations of each drawn task, each with a fresh env and simulated user ->
the groups whose rewards differ -> advantages within each group -> pi_old's and pi_ref's log-probs -> the PPO-clipped
loss + beta * k3 KL to the frozen start over the sampled tokens -> an AdamW step a mini-batch. main() loops it and
measures held-out pass^1 every --eval-every steps.

    python rl.py                        # from runs/sft/adapter; the CPU preset without a GPU, paper sizes with one
    python rl.py --steps 3              # resume that run for two more steps
    python rl.py --sampler plain --logprob-pass plain     # the code to read: the same tokens, the update up to rounding
    python rl.py --init base --out runs/rl_base           # an ablation (README: each into its own --out)
    python rl.py --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o   # paper scale, one GPU
Writes args.json, metrics.jsonl, rl.png, rollouts/, reference/ (the starting adapter), ckpt-NNNNNN/, adapter/ under
--out. The same command resumes after a kill; a folder holding a run with other settings is refused.

Simplifications versus the paper: SmolLM2-135M on CPU and LoRA, the reference a frozen copy of the starting adapter;
our procedural domains and scripted users (a 135M model cannot play a user); PRESETS["cpu"] the same algorithm at
small sizes; dynamic sampling (DAPO: only groups whose rewards differ are trained) and --screen are ours.
"""
import contextlib
import math
import os
import random
import time
from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_

import common
import rollout
from kernels import passes
import sampler
import envs
from envs import llm_users
import users

# Every number a preset sets stands here only, but the CPU episode limits and tasks, which eval.py measures with too
# (common.CPU_LIMITS, CPU_TIERS). CPU: 8 tasks x 6 rollouts (4 tasks a domain; their openings withhold the ids), two
# mini-batches so the clip can act, a curve on 4 held-out tasks a domain. T = 0.7: at 1.0 most of the 135M policy's
# failures are sampling noise. lr 1e-4: at 2e-4 one Adam step collapsed the policy (docs/results.md).
PRESETS = {
    "gpu": dict(steps=100, tasks=32, draw=32, max_draws=3, group_size=8, **common.GPU_LIMITS, micro_batch=1,
                mini_batches=1, lr=2e-5, temperature=1.0, domains="retail,airline",
                tiers="easy,medium,hard", user="scripted:train", ckpt_every=10, eval_every=10, eval_tasks=24,
                grad_checkpointing="on"),
    "cpu": dict(steps=1, tasks=8, draw=8, max_draws=1, group_size=6, **common.CPU_LIMITS, micro_batch=2,
                mini_batches=2, lr=1e-4, temperature=0.7, domains="retail,airline", tiers=common.CPU_TIERS,
                user="scripted:train", ckpt_every=1, eval_every=1, eval_tasks=4, grad_checkpointing="off"),
    "smoke": dict(steps=2, tasks=1, draw=1, max_draws=1, group_size=2, max_turns=1, max_new_tokens=8,
                  max_context=2560, micro_batch=2, mini_batches=1, lr=1e-4, temperature=1.0, domains="retail,airline",
                  tiers="easy", user="scripted", ckpt_every=1, eval_every=2, eval_tasks=1, grad_checkpointing="off"),
}
TASK_POOL = 1000     # train tasks generated per domain to draw from
# A step's seeds from --seed: seed * SEED_STRIDE + step (its task order, its mini-batches), and seed * SEED_STRIDE +
# step * 101 + draw (a draw's episodes): a resumed run draws, samples and splits as the first run did.
SEED_STRIDE = 1_000_003
ROLLOUTS = "step-{step:06d}-draw-{index}{trials}.jsonl"   # a draw's rollouts in <out>/rollouts (trials: --screen's)
RESUME_FREE = {"steps", "ckpt_every", "user_workers", "user_base_url", "kv_budget", "max_sim_failures", "user_timeout"}


def add_grpo_args(p: common.Parser):
    """The flags of GRPO itself, rl.py's and scripts/rl_trl.py's (TRL's names in brackets)."""
    p.group("run").add_argument("--steps", type=int, help="GRPO steps; a larger value resumes a run")
    p.group("model").add_argument("--init", default="auto", help="SFT adapter dir (the KL reference is frozen at "
                                  "it), 'base' (a fresh LoRA, the reference the base model), or 'auto' = "
                                  "runs/sft/adapter if present, else base")
    g = p.group("world")
    g.add_argument("--domains", help="comma-separated train domains")
    g.add_argument("--tiers", help="task tiers, or scenario names, to train on")
    common.add_episode_args(p)
    g = p.group("algorithm")
    g.add_argument("--tasks", type=int, help="groups trained per step (paper 32)")
    g.add_argument("--group-size", type=int, help="rollouts per task G [num_generations] (paper 8)")
    g.add_argument("--temperature", type=float, help="sampling temperature (paper 1.0)")
    g.add_argument("--kl-coef", type=float, default=0.001, help="beta for the k3 KL to the reference (paper 0.001) "
                   "[beta; TRL's default is 0]")
    g.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon, both sides (paper 0.2) [epsilon]")
    g.add_argument("--lr", type=float, help="AdamW learning rate")
    g = p.group("more")
    g.add_argument("--lora-r", type=int, default=16, help="LoRA rank from --init base")
    g.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha from --init base")
    g.add_argument("--reward", default="binary", choices=["binary", "shaped"], help="ablation: shaped, partial "
                   "credit for correct writes (Env.score)")
    g.add_argument("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean"], help="token-mean: every "
                   "sampled token weighs the same (DAPO, the official code) [dapo]; seq-mean: every rollout [grpo]")
    g.add_argument("--micro-batch", type=int, help="sequences per forward/backward [per_device_train_batch_size]")
    g.add_argument("--grad-checkpointing", choices=["on", "off"], help="recompute activations in backward (less "
                   "memory; the fast pass then runs every row's system prompt)")


def parse_args(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    common.add_run_args(p, out="runs/rl", smoke="2 tiny steps (tests)", tracker=True)
    common.add_model_args(p)
    common.add_user_args(p, default=None)
    add_grpo_args(p)
    g = p.group("algorithm")
    g.add_argument("--mini-batches", type=int, help="AdamW steps on a step's rollouts, each on a random subset of "
                   "them (> 1: the clip can act)")
    g.add_argument("--eval-every", type=int, help="held-out pass^1 every N steps, and before step 1 (0 = never)")
    g = p.group("more")
    g.add_argument("--draw", type=int, help="tasks per rollout batch")
    g.add_argument("--max-draws", type=int, help="dynamic sampling: draws a step to find --tasks groups that teach")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    g.add_argument("--eval-tasks", type=int, help="held-out tasks per domain for the curve")
    g.add_argument("--eval-users", help="the curve's users (default: --user, and scripted:heldout when it is scripted)")
    g.add_argument("--eval-skip", type=int, default=common.EVAL_TASKS, help="the curve skips the first N held-out "
                   "tasks a domain: those eval.py measures")
    g.add_argument("--ckpt-every", type=int, help="checkpoint every N steps")
    g.add_argument("--screen", type=int, default=0, help="ablation: each drawn task first gets this many rollouts, "
                   "the rest of its group only if one got a reward other than the batch's most common one (0 = off)")
    g.add_argument("--rollouts", help="ablation: train on another run's saved rollouts/ instead of sampling (update "
                   "rules compared on identical rollouts)")
    g.add_argument("--logprob-pass", default="fast", choices=["fast", "plain"], help="the update's log-probs. plain: "
                   "one forward of each whole row (plain_logprobs, the code to read); fast: each domain's system "
                   "prompt once a pass, the lm_head in chunks (kernels/passes.py): the same numbers up to "
                   "fp32 rounding")
    g.add_argument("--train-bf16", default="auto", choices=["auto", "on", "off"], help="the update under bf16 "
                   "autocast (weights, AdamW, log-softmax fp32); auto: on for a CPU with AVX512-BF16 or AMX only")
    args = common.parse_with_preset(p, PRESETS, argv)
    common.check_args(args, at_least=dict(steps=1, tasks=1, draw=1, max_draws=1, group_size=2, max_turns=1,
                                          max_new_tokens=1, max_context=2, micro_batch=1, mini_batches=1,
                                          ckpt_every=1, eval_every=0, eval_tasks=1, eval_skip=0, lora_r=1,
                                          user_workers=1),
                      finite=dict(lr=(0, True), kl_coef=(0, False), clip=(0, True), temperature=(0, True),
                                  max_grad_norm=(0, True), weight_decay=(0, False)),
                      training=True)
    if not 0 <= args.screen < args.group_size:
        common.fail("--screen", f"{args.screen}: 0 (off) or fewer rollouts than --group-size {args.group_size}")
    if args.rollouts and not os.path.isdir(args.rollouts):
        common.fail("--rollouts", f"{args.rollouts} is not a dir; use another run's <out>/rollouts")
    if not args.eval_users:                       # the curve: the training user, and the held-out personas with it
        args.eval_users = args.user + (",scripted:heldout" if args.user.startswith("scripted") else "")
    for u in args.eval_users.split(","):
        if error := envs.check_user(u):
            common.fail("--eval-users", error)
    if args.user == "oracle":                     # the gold agent's own user (sft.py, tests)
        common.fail("--user", "oracle plays only the gold agent's user; RL needs scripted, none, local or openai:MODEL")
    return args


# ---------------------------------------------------------------- one GRPO step, top to bottom

class Step(NamedTuple):
    """What a GRPO step did (grpo_step): the groups drawn and those trained on, the rollouts left out (an LLM user
    failed), the update's sums (None when no group was kept) and the seconds of sampling and of the update."""
    drawn: list
    kept: list
    left: list
    stats: dict | None
    rollout_s: float | None                       # None: the rollouts were read back (--rollouts), not sampled
    train_s: float


class Sampling(NamedTuple):
    """What sampling takes: the policy as a sampler (sampler.make_agent: plain or fast, the same tokens), its
    tokenizer, and the factory of each conversation's simulated user (common.user_factory)."""
    agent: object
    tok: object
    make_user: object


def grpo_step(model, optimizer, sampling: Sampling, pools, step, *, args, setup, groups=None) -> Step:
    """One GRPO step, in the paper's order: G conversations of each drawn task with the user in the loop, the groups
    whose rewards differ, their advantages, the log-probs of the three policies, the clipped loss with its KL, an
    AdamW step a mini-batch. setup: the device's decisions (common.setup_device); groups: the step's groups handed
    in (a benchmark's, a test's) instead of sampled."""
    t0 = time.time()
    # 1. draws of --draw tasks, G conversations each with a fresh env and simulated user, and their rewards
    model.eval()
    drawn, left = sample_groups(sampling, pools, step, args) if groups is None else (groups, [])
    # 2. the groups whose rewards differ: a group whose rewards all agree has advantage 0 and teaches nothing
    kept = [g for g in drawn if has_signal(g)][:args.tasks]
    sampled_s, stats = time.time() - t0, None
    if kept:
        # 3. advantages, within each group
        rollouts = [t for g in kept for t in g]
        adv = torch.cat([group_advantages(torch.tensor([t.reward for t in g])) for g in kept]).to(model.device)
        # 4. --mini-batches random subsets of the rollouts, an AdamW step each, in micro-batches of --micro-batch
        model.train()
        minis = mini_batches(rollouts, args, sampling.tok.pad_token_id, args.seed * SEED_STRIDE + step, model.device,
                             whole_rows=setup.checkpointing)
        moved = bool(optimizer.state)             # an AdamW step was taken before: pi_ref is no longer pi_old
        precision = setup.precision()             # bf16 autocast, or nothing
        # pi_old sampled the rollouts, and no step has moved it yet: a no-grad pass now gives its log-probs; the first
        # mini-batch's come from its own forward below, taken before any step (its ratio is exactly 1)
        olds = [None]
        for mini in minis[1:]:
            with torch.no_grad(), precision, logprob_pass(model, args, setup.kernel) as logprobs:
                olds.append([logprobs(b) for b in mini])
        stats = dict(kl_sum=0.0, clip_low=0, clip_high=0, tokens=0, grad_norm=0.0, updates=len(minis))
        for mini, old in zip(minis, olds):
            if moved:                             # pi_ref, the frozen start: a no-grad pass with its adapter
                with torch.no_grad(), precision, passes.reference_policy(model), \
                        logprob_pass(model, args, setup.kernel) as logprobs:
                    refs = [logprobs(b) for b in mini]
            n_tokens, n_seqs = max(1, sum(int(b.mask.sum()) for b in mini)), sum(len(b.rows) for b in mini)
            optimizer.zero_grad(set_to_none=True)
            with precision, logprob_pass(model, args, setup.kernel) as logprobs:
                for i, b in enumerate(mini):      # each micro-batch's backward before the next one's forward
                    logp = logprobs(b)                                         # pi, trained
                    logp_old = logp.detach() if old is None else old[i]        # pi_old, the sampler
                    logp_ref = refs[i] if moved else logp_old                  # pi_ref, the frozen start
                    loss, counts = grpo_loss(logp, logp_old, logp_ref, adv[b.rows], b.mask, clip=args.clip,
                                             beta=args.kl_coef, agg=args.loss_agg, n_tokens=n_tokens, n_seqs=n_seqs)
                    loss.backward()
                    stats = {k: v + counts.get(k, 0) for k, v in stats.items()}
            stats["grad_norm"] += float(clip_grad_norm_(optimizer.param_groups[0]["params"], args.max_grad_norm))
            optimizer.step()
    return Step(drawn, kept, left, stats, None if args.rollouts else sampled_s, time.time() - t0 - sampled_s)


# ---------------------------------------------------------------- 1-2. sample, reward, keep the groups that teach

def sample_groups(sampling: Sampling, pools, step, args):
    """Draws of --draw tasks until --tasks groups have reward variance, or --max-draws, a group a task
    (sample_draw; --screen: screened). A rollout whose user simulator failed or broke the check is left out (its 0 is
    not the agent's). -> (the drawn groups, the rollouts left out)."""
    rng = random.Random(args.seed * SEED_STRIDE + step)      # its own: a resumed run redraws the same tasks
    shuffled = [rng.sample(pool, len(pool)) for pool in pools.values()]
    order = [t for row in zip(*shuffled) for t in row][:args.draw * args.max_draws]   # the domains alternate
    drawn, left = [], []
    for index in range(args.max_draws):
        tasks = order[index * args.draw:(index + 1) * args.draw]
        if args.screen:                           # ablation: a group's rest only where its first K rollouts differ
            groups = screened(sampling, tasks, args, step=step, index=index)
        else:
            groups = sample_draw(sampling, tasks, args, step=step, index=index)
        failed = [t for g in groups for t in g if t.failed]   # an LLM user failed or broke the check
        if failed:
            llm_users.stop_if_many_left_out([t for g in groups for t in g], args.max_sim_failures, f"step {step + 1}")
        left += failed
        drawn += [[t for t in g if not t.failed] for g in groups]
        if sum(map(has_signal, drawn)) >= args.tasks:
            break
    sampling.agent.forget()                       # its keys/values go stale with the update: not kept beside it
    return drawn, left


def sample_draw(sampling: Sampling, tasks, args, *, step, index, trials=None) -> list[list]:
    """A draw's conversations: trials [a, b) of every task (None: the whole group), a group a task, with a fresh env
    and simulated user each, saved to <out>/rollouts/ROLLOUTS (viewer.py shows them). --rollouts: another run's
    saved ones instead, read back (saved_draw)."""
    if args.rollouts:                             # ablation: update rules compared on identical rollouts
        return saved_draw(args, tasks, step=step, index=index, trials=trials)
    a, b = trials or (0, args.group_size)
    trajs = rollout.run_episodes(sampling.agent, sampling.tok, tasks, group_size=b - a, first_trial=a,
                                 user=sampling.make_user, max_turns=args.max_turns, max_context=args.max_context,
                                 seed=args.seed * SEED_STRIDE + step * 101 + index, shaped=args.reward == "shaped",
                                 user_workers=args.user_workers)
    name = ROLLOUTS.format(step=step + 1, index=index, trials=f"-trials-{a}-{b}" if trials else "")
    rollout.save_trajectories(os.path.join(args.out, "rollouts", name), trajs)
    return [trajs[s:s + b - a] for s in range(0, len(trajs), b - a)]


def saved_draw(args, tasks, *, step, index, trials=None) -> list[list]:
    """--rollouts: sample_draw's groups as another run saved them, read back."""
    name = ROLLOUTS.format(step=step + 1, index=index, trials=f"-trials-{trials[0]}-{trials[1]}" if trials else "")
    if not os.path.isfile(path := os.path.join(args.rollouts, name)):
        raise SystemExit(f"--rollouts {args.rollouts}: no {os.path.basename(path)}; that run drew fewer steps or "
                         "batches, or screened differently (--screen)")
    trajs, size = rollout.load_trajectories(path), (trials[1] - trials[0]) if trials else args.group_size
    return [trajs[s:s + size] for s in range(0, len(trajs), size)]


def screened(sampling: Sampling, tasks, args, *, step, index) -> list[list]:
    """--screen K, an ablation of the draw: trials 0..K-1 of every task, then K..G-1 only of the tasks where one of
    the first K got a reward other than the batch's most common one (the others stay groups of K that teach nothing)."""
    K, G = args.screen, args.group_size
    first = sample_draw(sampling, tasks, args, step=step, index=index, trials=(0, K))
    seen = Counter(t.reward for g in first for t in g if not t.failed).most_common(1)
    go = [i for i, g in enumerate(first) if any(not t.failed and t.reward != seen[0][0] for t in g)]
    rest = sample_draw(sampling, [tasks[i] for i in go], args, step=step, index=index, trials=(K, G)) if go else []
    for i, more in zip(go, rest):
        first[i] = first[i] + more
    return first


def has_signal(group) -> bool:
    """Do the group's rewards differ? If not, every advantage is 0: it teaches nothing."""
    return len({t.reward for t in group}) > 1


# ---------------------------------------------------------------- 3. advantages

def group_advantages(rewards, eps=1e-4):
    """One group's rewards (G,) -> its advantages (G,): (r - mean) / (std + eps), the std over the group's G
    (population). A group may be short of G when an LLM user failed: it is normalised over what it kept."""
    r = rewards.float().view(1, -1)                             # (1, G)
    mean, std = r.mean(1, keepdim=True), r.std(1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).view(-1)


# ---------------------------------------------------------------- 4. the log-probs and the loss

def mini_batches(trajs, args, pad_id, seed, device, *, whole_rows=False) -> list[list]:
    """--mini-batches random subsets of the rollouts (a shuffle seeded by `seed`: a rerun splits the same way), each
    cut into micro-batches of --micro-batch. The plain pass: the subset's rows in order, right-padded. The fast pass
    (kernels/passes.py): a domain's rows together, shortest first, each domain's system prompt cut out once. A
    MicroBatch's rows index trajs (and adv)."""
    order = list(range(len(trajs)))
    random.Random(seed).shuffle(order)
    size = math.ceil(len(order) / args.mini_batches)
    subsets = [order[s:s + size] for s in range(0, len(order), size)]
    if args.logprob_pass == "plain":
        return [[padded(trajs, rows[s:s + args.micro_batch], pad_id, device)
                 for s in range(0, len(rows), args.micro_batch)] for rows in subsets]
    ids, masks, domains = [t.token_ids for t in trajs], [t.loss_mask for t in trajs], [t.domain for t in trajs]
    minis = [passes.micro_batches(ids, masks, args.micro_batch, pad_id, domains, shortest_first=True, device=device,
                                  rows=rows) for rows in subsets]
    if not whole_rows:                                 # checkpointed layers drop the prefix's cache: every row whole
        minis = [passes.cut_shared_prefix(micro) for micro in minis]
    return minis


def padded(trajs, rows, pad_id, device) -> passes.MicroBatch:
    """The rows' token ids, attention masks and loss masks, right-padded to the longest: (b, T) each."""
    pad = lambda seqs, value: torch.nn.utils.rnn.pad_sequence(   # noqa: E731
        [torch.tensor(x) for x in seqs], batch_first=True, padding_value=value).to(device)
    ids = [trajs[r].token_ids for r in rows]
    return passes.MicroBatch(rows, pad(ids, pad_id), pad([[1] * len(x) for x in ids], 0),
                             pad([trajs[r].loss_mask for r in rows], 0))


def logprob_pass(model, args, kernel="torch"):
    """--logprob-pass's seam: a block in which logprobs(b) is micro-batch b's (b, T) fp32 log-probs. plain: a forward
    of whole rows; fast (passes.shared_prefix_pass): a domain's system prompt once, each backward before the next
    forward."""
    if args.logprob_pass == "plain":
        return contextlib.nullcontext(lambda b: plain_logprobs(model, b, args.temperature))
    return passes.shared_prefix_pass(model, args.temperature, impl=kernel)


def plain_logprobs(model, b, temperature):
    """logp (b, T) fp32 of a micro-batch b: logp[r, t] = log pi(ids[r, t] | ids[r, :t]), one forward of the whole
    right-padded rows (positions 0, 1, 2, ..., as the sampler's), the log-softmax of position t's logits scoring
    token t + 1, as simple_GRPO and TRL compute it. Token 0 has no context: logp 0. Pads and prompt tokens get a
    number too; grpo_loss masks them out."""
    logits = model(input_ids=b.ids, attention_mask=b.attn).logits[:, :-1]        # (b, T - 1, V)
    logp = torch.stack([torch.log_softmax(row.float() / temperature, -1).gather(1, nxt[:, None]).squeeze(1)
                        for row, nxt in zip(logits, b.ids[:, 1:])])   # row by row: a no-grad pass holds one row's
    return F.pad(logp, (1, 0))                                        # fp32 (T - 1, V) at a time, not b


def grpo_loss(logp, logp_old, logp_ref, adv, mask, *, clip, beta, agg, n_tokens=None, n_seqs=None):
    """PPO-clipped GRPO loss with k3 KL to the reference over masked tokens. logp (pi's log-probs of the sampled
    tokens), logp_old (pi_old's), logp_ref (pi_ref's), mask: (B, T); adv: (B,). agg: "token-mean", the sum over masked
    tokens / n_tokens (a long rollout weighs more: DAPO, the official code); "seq-mean", each rollout's token mean
    summed / n_seqs (every rollout weighs the same: the GRPO paper; a token every rollout emits at the same rate, like
    the tool-call format, gets no net push). n_tokens / n_seqs: the whole mini-batch's, when accumulating
    micro-batches. -> (loss, counts summed over tokens: kl_sum, clip_low, clip_high, tokens). The clip binds where
    the ratio is past the band on the side the advantage pushes it (TRL's clip_ratio): below 1 - clip with A < 0
    (clip_low), above 1 + clip with A > 0 (clip_high); elsewhere a ratio outside the band still has its gradient."""
    m = mask.bool()
    # zero masked positions first: pads may hold anything, and their gradient must be exactly 0
    logp, logp_old, logp_ref = (x.masked_fill(~m, 0.0) for x in (logp, logp_old, logp_ref))
    ratio = torch.exp(logp - logp_old)                          # (B, T)
    a = adv.view(-1, 1)
    surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
    # k3 estimator of KL(pi || ref): exp(ref - pi) - (ref - pi) - 1 >= 0, unbiased, low variance
    d = logp_ref - logp
    kl = torch.exp(d) - d - 1
    per_token = (-surrogate + beta * kl) * m
    if agg == "token-mean":
        loss = per_token.sum() / (n_tokens if n_tokens is not None else m.sum().clamp(min=1))
    elif agg == "seq-mean":
        loss = (per_token.sum(1) / m.sum(1).clamp(min=1)).sum() / (n_seqs if n_seqs is not None else len(m))
    else:
        raise ValueError(f"agg {agg!r}: token-mean or seq-mean")
    low, high = (ratio < 1 - clip) & (a < 0) & m, (ratio > 1 + clip) & (a > 0) & m
    counts = dict(kl_sum=(kl * m).sum().item(), clip_low=low.sum().item(), clip_high=high.sum().item(),
                  tokens=m.sum().item())
    return loss, counts


# ---------------------------------------------------------------- the loop

def main(argv=None):
    args = parse_args(argv)                       # bad input: one line, exit 2, before anything loads
    setup = common.setup_device(args, args.lora_r)   # what differs by device, once (on a GPU: the memory plan)
    common.start_run(args, args.out, may_change=RESUME_FREE)   # as must a folder holding a run of other settings
    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL, load_in_4bit=args.load_in_4bit)
    model = rollout.load_policy(model, args.init, os.path.join(args.out, "reference"), args.lora_r, args.lora_alpha,
                                resuming=bool(common.checkpoints(args.out)))   # start_run checked --init is the run's
    if setup.checkpointing:                       # less activation memory, more compute, no shared prefix
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=args.weight_decay)
    start, metrics = common.resume(args.out, model, optimizer)     # a rerun after a kill goes on from here
    if not start:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
    tiers, domains = args.tiers.split(","), args.domains.split(",")
    pools = {d: envs.make_tasks(d, "train", TASK_POOL, tiers, args.seed) for d in domains}
    heldout = [t for d in domains for t in    # the curve's: held-out tasks past those eval.py's CPU preset reports
               envs.make_tasks(d, "test", args.eval_skip + args.eval_tasks, tiers, args.seed)[args.eval_skip:]]
    agent = sampler.make_agent(args.sampler, model, tok, args.temperature, args.max_new_tokens, thinking=args.thinking,
                               max_context=args.max_context, **setup.sampler)   # the plain sampler or the fast one
    sampling, tracker = Sampling(agent, tok, common.user_factory(args, model, tok)), common.tracker(args)
    if start == 0 and args.eval_every:            # where the curve starts: the policy RL starts from
        log(args, metrics, dict(step=0, **heldout_pass1(model, tok, heldout, args, setup)), tracker)
    for step in range(start, args.steps):
        t0 = time.time()
        m = step_metrics(step, grpo_step(model, optimizer, sampling, pools, step, args=args, setup=setup),
                         args.user_price)
        if args.eval_every and (step + 1) % args.eval_every == 0:     # the held-out curve
            m.update(heldout_pass1(model, tok, heldout, args, setup))
        log(args, metrics, m | dict(s_per_step=time.time() - t0), tracker)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            common.save_checkpoint(args.out, step + 1, model, optimizer, metrics)
    if tracker:
        tracker.close()
    model.save_pretrained(os.path.join(args.out, "adapter"), selected_adapters=["default"])
    plot(metrics, os.path.join(args.out, "rl.png"), args.temperature)
    print(f"adapter -> {os.path.join(args.out, 'adapter')}")
    return metrics


def heldout_pass1(model, tok, tasks, args, setup) -> dict:
    """pass^1 of the greedy policy on the fixed held-out tasks under each of --eval-users (all in one batch), and its
    seconds; heldout_pass1 is the first user's, the training user's."""
    t0, specs = time.time(), args.eval_users.split(",")
    agent = sampler.make_agent(args.sampler, model, tok, 0.0, args.max_new_tokens, thinking=args.thinking,
                               max_context=args.max_context, **setup.sampler)
    model.eval()
    makers = [common.user_factory(args, model, tok, u) for u in specs]             # each spec checked once
    trajs = rollout.run_episodes(agent, tok, tasks * len(specs), max_turns=args.max_turns, seed=args.seed,
                                 user=[make for make in makers for _ in tasks],
                                 max_context=args.max_context, progress=False, user_workers=args.user_workers)
    ok = [[t for t in trajs[k * len(tasks):(k + 1) * len(tasks)] if not t.failed] for k in range(len(specs))]
    by_user = {u: sum(t.reward >= 1 for t in mine) / max(len(mine), 1) for u, mine in zip(specs, ok)}
    return dict(heldout_pass1=by_user[specs[0]], heldout_by_user=by_user, eval_s=time.time() - t0)


# ---------------------------------------------------------------- output: the log line, metrics.jsonl, the plot

def step_metrics(step, s: Step, price) -> dict:
    """The step's numbers: reward, pass rate, groups, KL, the share of trained tokens where the clip binds (each side
    and both: clip_low, clip_high, clip_binds), grad norm, entropy, tokens, seconds, and what its LLM users did and
    cost (llm_users.user_report, nothing for scripted users; their waiting's share of the step's sampling and update
    time). Entropy is the mean -log p of the sampled tokens."""
    every, stats = [t for g in s.drawn for t in g], s.stats
    rewards = torch.tensor([t.reward for t in every])
    sampled = sum(sum(t.loss_mask) for t in every)

    def per(k):                                          # an update's sum, per trained token
        return stats[k] / max(stats["tokens"], 1) if stats else None
    return dict(step=step + 1, reward=rewards.mean().item(), pass_rate=(rewards >= 1).float().mean().item(),
                groups_drawn=len(s.drawn), groups_varied=sum(map(has_signal, s.drawn)),
                signal_token_share=sum(sum(t.loss_mask) for g in s.drawn if has_signal(g) for t in g) / max(sampled, 1),
                groups_trained=len(s.kept), kl=per("kl_sum"), clip_low=per("clip_low"), clip_high=per("clip_high"),
                clip_binds=per("clip_low") + per("clip_high") if stats else None,
                grad_norm=stats["grad_norm"] / max(stats["updates"], 1) if stats else None,
                entropy=-sum(sum(t.logprobs) for t in every) / max(sampled, 1), tokens=sampled,
                train_tokens=stats["tokens"] if stats else 0, turns=sum(t.turns for t in every) / len(every),
                repeated_questions=mean_repeated(every), sim_failures=len(s.left), rollout_s=s.rollout_s,
                train_s=s.train_s, tok_per_s=sampled / s.rollout_s if s.rollout_s else None, by_user=by_user(every),
                **llm_users.user_report(every + s.left, s.rollout_s + s.train_s if s.rollout_s else None, price))


def mean_repeated(trajs) -> float | None:
    """The questions a conversation asked again for a fact its user had given (users.repeated_questions), on
    average; None in a world without hidden facts."""
    counts = [len(t.stats["repeated_at"]) for t in trajs if t.stats.get("repeated_at") is not None]
    return sum(counts) / len(counts) if counts else None


def by_user(trajs) -> dict:
    """Reward, the asking rate (asked to confirm before the first write, over the episodes that wrote) and the
    questions asked again (mean_repeated) per training user: each named persona, and each behaviour value
    ("gives=one_first"), so a slide under one kind of user shows while it trains, not only in the evaluation after
    it. Scripted users only."""
    groups = {}
    for t in trajs:
        if "behaviour" not in t.stats:
            continue
        keys = [f"{axis}={value}" for axis, value in t.stats["behaviour"].items()]
        if "=" not in t.stats["user"] and t.stats["user"] not in users.POPULATIONS:
            keys.insert(0, t.stats["user"])
        for key in keys:
            groups.setdefault(key, []).append(t)
    out = {}
    for key, mine in sorted(groups.items(), key=lambda kv: ("=" in kv[0], kv[0])):   # the personas, then the values
        asked = [a for a in map(common.asked_before_writing, mine) if a is not None]
        out[key] = dict(n=len(mine), reward=sum(t.reward for t in mine) / len(mine),
                        asked=sum(asked) / len(asked) if asked else None, repeated=mean_repeated(mine))
    return out


def log(args, metrics, m, tracker=None):
    """Append m to metrics and <out>/metrics.jsonl (and the --report-to tracker), and print its line(s)."""
    common.log_metrics(args.out, metrics, m, tracker)
    f = lambda x, spec: "-" if x is None else format(x, spec)                    # noqa: E731
    if "reward" in m:
        print(f"step {m['step']:3d}/{args.steps} | reward {m['reward']:.3f} | groups {m['groups_trained']} of "
              f"{m['groups_varied']} with signal of {m['groups_drawn']} ({m['signal_token_share']:.0%} of tokens) | "
              f"kl {f(m['kl'], '.5f')} | ent {m['entropy']:.3f} | clip {f(m['clip_binds'], '.3f')} | gnorm "
              f"{f(m['grad_norm'], '.3f')} | held-out {f(m.get('heldout_pass1'), '.3f')} | tok {m['tokens']} | "
              f"{m['s_per_step']:.0f} s/step | {f(m['tok_per_s'], '.1f')} tok/s"
              + (f" | {llm_users.user_line(m)}" if "user_requests" in m else ""), flush=True)   # an LLM user's cost
    if m.get("by_user"):                          # the named personas, or (a population) each behaviour value
        named = {k: v for k, v in m["by_user"].items() if "=" not in k} or m["by_user"]
        print(f"step {m['step']:3d} | by user, reward / asked before writing / questions asked again: " + ", ".join(
              f"{k} {v['reward']:.2f} / {f(v['asked'], '.2f')} / {f(v.get('repeated'), '.1f')}"
              for k, v in named.items()), flush=True)
    if "heldout_by_user" in m:
        print(f"step {m['step']:3d} | held-out pass^1 " + ", ".join(f"{v:.3f} under {u}" for u, v in
              m["heldout_by_user"].items()) + f" on {args.eval_tasks * len(args.domains.split(','))} tasks", flush=True)


def plot(metrics, path, temperature):
    """pass^1 of the training rollouts and of the greedy policy on held-out tasks (the curve that matters), the KL to
    the reference, and the groups drawn / with reward variance / trained per step."""
    trained = [m for m in metrics if "reward" in m]
    passes = {f"training rollouts (T = {temperature:g})": [(m["step"], m["pass_rate"]) for m in trained]}
    for m in metrics:                             # a curve per user of --eval-users
        for user, v in m.get("heldout_by_user", {}).items():
            passes.setdefault(f"held-out, greedy, {user}", []).append((m["step"], v))
    common.plot_panels(path, [("pass^1", passes, (-0.02, 1.1)),
                              ("KL to the starting policy (k3)", {"": [(m["step"], m["kl"]) for m in trained]}, None),
                              ("groups per step", {k: [(m["step"], m[f"groups_{k}"]) for m in trained]
                                                   for k in ("drawn", "varied", "trained")}, None)])


if __name__ == "__main__":
    main()
