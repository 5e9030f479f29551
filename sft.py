"""sft.py: MUA-RL cold start. Synthesize multi-turn tool-use conversations, keep the ones that solve
their task, and fine-tune a LoRA adapter on the agent's tokens only. The loop is train() below.

What it does
  1. Data. An agent talks to the simulated user through rollout.run_episodes (the same loop and token
     format as RL) on train-split tasks. The agent is the world's gold agent (rollout.OracleAgent; ours
     is envs/oracle.py: ask for missing facts, look up, ask to confirm naming every value, act on a yes,
     report) or any OpenAI-compatible teacher model (--teacher). Only reward == 1
     conversations are kept: <out>/data.jsonl (OpenAI format: messages + tools), <out>/tokens.jsonl
     (the exact token_ids / loss_mask we train on, never decoded and re-tokenized), data_stats.json.
  2. SFT. LoRA on all linear projections (QLoRA with --load-in-4bit). Loss = mean negative log-prob
     over loss_mask tokens (the agent's text and tool calls with their end-of-turn; system, user and
     tool tokens count for nothing), through kernels/passes.py's sequence_logprobs as in rl.py. AdamW, linear
     warmup then cosine decay, gradient accumulation. A batch holds one domain, whose system prompt
     goes through the model once per batch with an exact gradient (passes.shared_prefix_pass;
     `python scripts/bench_update.py --sft` times it against the per-conversation pass). Checkpoints every
     --save-every steps; rerunning the same command resumes. Final adapter: <out>/adapter.

Run
  python sft.py                          # CPU preset -> runs/sft/adapter (sized for <= 15 min on 2 cores)
  python sft.py --smoke --out /tmp/sft   # 1 step on real data (tests/test_sft.py)
  python sft.py --user none --out runs/sft_none   # the no-user cold start: the whole task in the first message,
                                         #   the oracle asks nothing and confirms nothing (rl.py --user none's init)
  python sft.py --teacher gpt-4o         # an LLM teacher makes the data (any OpenAI-compatible server:
                                         #   --teacher-base-url http://localhost:8000/v1; key: $OPENAI_API_KEY)
  python sft.py --model Qwen/Qwen3-8B --load-in-4bit    # on a GPU the "gpu" preset applies (below)
  python sft.py --domains tau2-retail,tau2-airline,tau2-telecom --user oracle   # τ²'s train split, gold oracle
  python eval.py --agents base,sft       # then: held-out pass^1 of base vs SFT

Hyper-parameters: paper -> ours (presets in PRESETS; every value is a flag)
  tuning      full fine-tuning, Qwen3 8-32B -> LoRA r=16, alpha=32 on all linear layers (4-bit base on GPU);
              full FT's fp32 Adam state would not fit a consumer GPU.
  data        ~2,000 conversations, 9 scenarios -> gpu: 167 per scenario x 12 = 2,004; cpu: 20 of each of the
              two scenarios rl.py's CPU preset trains on (common.CPU_TIERS: medium-tier retail
              change_order_payment and airline cancel_trip, whose openings withhold the ids, so the gold
              agent asks); 15 minutes on 2 cores buy about 50 conversations, too few for more scenarios.
  users       GPT-4o -> the training personas (users.PERSONAS), one drawn per
              conversation (--user scripted:train); the held-out ones are refused here.
  epochs      2 -> gpu 2; cpu 1 (new tasks rather than repeats: more ids for the agent to copy).
  batch       128 -> gpu 32 (4 x 8 accumulation); cpu 2: a short run needs more, smaller steps.
  lr          5e-6 -> gpu 1e-4, cpu 1e-3: a LoRA delta starts at zero and, with alpha/r = 2, needs a
              10-100x larger lr than full fine-tuning; the CPU run has few steps.
  schedule    (not stated) -> 10% linear warmup (>= 1 step), cosine decay to 0; AdamW, no weight decay,
              grad-norm clip 1.0.
  max length  (not stated) -> gpu 8192, cpu 4096: whole conversations, never truncated in practice.
Simplifications: template phrasing for the oracle (the paper synthesized with LLMs); the scripted user
stands in for GPT-4o; no sequence packing (micro-batches are right-padded).
"""
import json
import math
import os
import random
import sys
import time
from collections import Counter

import torch

import common
import envs
import rollout
from kernels import passes
from envs import ours


# Sizes by machine: cpu is sized for <= 15 minutes on 2 cores, gpu follows the paper's data size.
ALL_TIERS = "easy,medium,hard"
PRESETS = {
    "gpu":   dict(tasks_per_scenario=167, tiers=ALL_TIERS, user="scripted:train",   # 167 x 12 scenarios = 2,004
                  epochs=2, batch_size=32, micro_batch_size=4, lr=1e-4,               # conversations, as in the paper
                  max_len=8192, save_every=20, max_turns=30,
                  grad_checkpointing="on"),          # 4 x 2.6k tokens of layer activations fit 24 GB only with it
    "cpu":   dict(tasks_per_scenario=20, tiers=common.CPU_TIERS, user="scripted:train", epochs=1, batch_size=2,
                  micro_batch_size=1, lr=1e-3, max_len=4096, save_every=4, max_turns=30, grad_checkpointing="off"),
    "smoke": dict(tasks_per_scenario=1, tiers=ALL_TIERS, epochs=1, batch_size=1, micro_batch_size=1, lr=1e-3,
                  max_len=1800, save_every=1, max_steps=1, max_turns=30, grad_checkpointing="off"),
}


def parse_args(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    common.add_run_args(p, out="runs/sft", smoke="tiny run (< 2 min on CPU) for tests")
    common.add_model_args(p, model_default=rollout.DEFAULT_MODEL, sampler=False)
    g = p.group("model")
    g.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    g.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout")
    g = p.group("world")                          # the data: which conversations the cold start learns from
    g.add_argument("--domains", default=",".join(ours.DOMAINS), help="comma-separated domains")
    g.add_argument("--tasks-per-scenario", type=int, default=None, help="train tasks per scenario")
    g.add_argument("--tiers", default=None, help="scenarios of these tiers only (easy, medium, hard), or these "
                   "scenarios by name")
    g.add_argument("--samples-per-task", type=int, default=1, help="conversations per task (user and phrasing vary)")
    common.add_user_args(p)
    common.add_episode_args(p, tokens=False)
    g.add_argument("--teacher", default=None, help="an OpenAI-compatible model as the agent instead of the oracle "
                   "(key from $OPENAI_API_KEY)")
    g.add_argument("--teacher-base-url", default=None, help="base URL of the teacher's server (default: OpenAI)")
    g = p.group("algorithm")
    g.add_argument("--epochs", type=int, default=None, help="passes over the kept data")
    g.add_argument("--batch-size", type=int, default=None, help="sequences per optimizer step")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--warmup-ratio", type=float, default=0.1, help="fraction of steps with linear warmup (>= 1 step)")
    g.add_argument("--schedule", default="cosine", choices=["cosine", "linear"], help="decay after warmup")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    g.add_argument("--max-len", type=int, default=None, help="truncate sequences to this many tokens")
    g.add_argument("--max-steps", type=int, default=None, help="cap on optimizer steps (none: epochs x data)")
    g = p.group("more")
    g.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward pass")
    g.add_argument("--share-prefix", default="on", choices=["on", "off"],
                   help="run each domain's system prompt once per step, not once per conversation (exact)")
    g.add_argument("--grad-checkpointing", default=None, choices=["on", "off"],
                   help="recompute activations in backward: less memory, slower (scripts/bench_update.py --sft); "
                        "turns --share-prefix off")
    g = p.group("run")
    g.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps, and at the end")
    g.add_argument("--stop-after", type=int, default=None, help="exit after this step as if killed (resume tests)")
    args = common.parse_with_preset(p, PRESETS, argv)
    common.check_args(args, at_least=dict(tasks_per_scenario=1, samples_per_task=1, max_turns=1, user_workers=1,
                                          epochs=1, batch_size=1, micro_batch_size=1, max_len=2, max_steps=1,
                                          lora_r=1, save_every=1, stop_after=1),
                      finite=dict(lr=(0, True), warmup_ratio=(0, False), weight_decay=(0, False),
                                  max_grad_norm=(0, True), lora_dropout=(0, False)), training=True)
    if args.batch_size % args.micro_batch_size:
        common.fail("--batch-size", f"{args.batch_size} is not a multiple of --micro-batch-size {args.micro_batch_size}")
    if args.warmup_ratio > 1 or args.lora_dropout >= 1:
        common.fail("--warmup-ratio" if args.warmup_ratio > 1 else "--lora-dropout", "must be below 1")
    if args.teacher is None and args.user == "local":
        common.fail("--user", "local cannot answer the oracle agent's questions; use scripted (ours), oracle (τ²) "
                    "or openai:MODEL")
    if args.user == "none" and (needs := [d for d in args.domains.split(",") if d not in envs.NO_USER_FORM]):
        common.fail("--user", f"none: {needs[0]} has no no-user form (its tasks are written for a user who says "
                    f"what they want); none works on {', '.join(envs.NO_USER_FORM)}")
    return args


# ----------------------------------------------------------------------------- data

def make_agent(args, tokenizer):
    if args.teacher is None:
        return rollout.OracleAgent(tokenizer)
    return rollout.OpenAIAgent(tokenizer, args.teacher, base_url=args.teacher_base_url, temperature=0.0)


def openai_record(traj, tools) -> dict:
    """A trajectory as one OpenAI-format chat sample (messages + tools), for `datasets`."""
    msgs, n = [], 0
    for m in traj.messages:
        m = {"role": m["role"], "content": m["content"], **({"tool_calls": m["tool_calls"]} if m.get("tool_calls") else {})}
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": f"call_{n}", "type": "function",
                                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                               for c in m["tool_calls"][:1]]
            n += 1
        elif m["role"] == "tool":
            m["tool_call_id"] = f"call_{n - 1}"
        msgs.append(m)
    return {"messages": msgs, "tools": tools, "task_id": traj.task_id, "domain": traj.domain,
            "scenario": traj.scenario, "tier": traj.tier}


def make_data(args, tokenizer) -> list[dict]:
    """Run the agent on train tasks; keep reward-1 conversations; write data files. -> token rows."""
    agent, kept, tried, t0 = make_agent(args, tokenizer), [], Counter(), time.time()
    with open(os.path.join(args.out, "data.jsonl"), "w") as f:
        for domain in args.domains.split(","):
            n = args.tasks_per_scenario * (len(ours.SCENARIOS[domain]) if domain in ours.SCENARIOS else 1)  # τ²: first n
            tasks = envs.make_tasks(domain, "train", n, args.tiers.split(","), args.seed)
            trajs = rollout.run_episodes(agent, tokenizer, tasks, group_size=args.samples_per_task,
                                         user=common.user_factory(args), max_turns=args.max_turns, seed=args.seed,
                                         max_context=max(args.max_len, 8192),   # τ²'s prompts alone are 5-8k tokens
                                         progress=True, user_workers=args.user_workers)
            by_id = {t.id: t for t in tasks}
            for t in trajs:
                tried[f"{domain}/{t.scenario}"] += 1
                if t.reward == 1.0:      # the task's tools, as its env gives them (ACEBench's differ by task)
                    f.write(json.dumps(openai_record(t, envs.make_env(by_id[t.task_id]).tools)) + "\n")
                    kept.append({"task_id": t.task_id, "scenario": f"{domain}/{t.scenario}",
                                 "token_ids": t.token_ids, "loss_mask": t.loss_mask})
    per = {s: {"tried": n, "kept": sum(r["scenario"] == s for r in kept)} for s, n in sorted(tried.items())}
    stats = {"agent": args.teacher or "oracle", "tried": sum(tried.values()), "kept": len(kept),
             "acceptance_rate": len(kept) / max(1, sum(tried.values())), "per_scenario": per,
             "mean_tokens": sum(len(r["token_ids"]) for r in kept) / max(1, len(kept)),
             "mean_trained_tokens": sum(sum(r["loss_mask"]) for r in kept) / max(1, len(kept)),
             "seconds": round(time.time() - t0, 1)}
    json.dump(stats, open(os.path.join(args.out, "data_stats.json"), "w"), indent=1)
    with open(os.path.join(args.out, "tokens.jsonl"), "w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
    print(f"data: kept {len(kept)}/{stats['tried']} ({stats['acceptance_rate']:.0%}), "
          f"mean {stats['mean_tokens']:.0f} tokens ({stats['mean_trained_tokens']:.0f} trained), {stats['seconds']} s")
    for s, c in per.items():
        print(f"  {s:40s} {c['kept']}/{c['tried']}")
    if not kept:
        raise SystemExit("no conversation reached reward 1: nothing to train on (check the agent / teacher)")
    return kept


# ----------------------------------------------------------------------------- SFT pieces

def backward_batch(model, batch: list[dict], args, *, pad: int, n_tok: int, kernel: str = "torch") -> float:
    """Accumulate the gradient of sum(-log p over loss_mask tokens) / n_tok for a batch; -> the loss.
    Rows of one domain share their system prompt (~1.8k of ~2.7k tokens): with --share-prefix on it
    goes through the model once for the group (kernels/passes.py: cut_shared_prefix, shared_prefix_pass; exact).
    A batch holds one domain (epoch_batches). kernel: the log-prob kernel, decided once (common.logprob_kernel)."""
    micro = passes.micro_batches([r["token_ids"] for r in batch], [r["loss_mask"] for r in batch],
                                 args.micro_batch_size, pad, keys=[domain_of(r) for r in batch], max_len=args.max_len,
                                 device=model.get_input_embeddings().weight.device)
    if args.share_prefix == "on" and args.grad_checkpointing == "off":
        micro = passes.cut_shared_prefix(micro)
    total = 0.0
    with passes.shared_prefix_pass(model, impl=kernel) as logprobs:
        for b in micro:
            loss = -logprobs(b).sum() / max(1, n_tok)
            loss.backward()                   # before the next micro-batch: the prefix's gradient adds up
            total += loss.item()
    return total


def lr_lambda(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the peak lr: linear warmup, then cosine or linear decay to 0."""
    if step < warmup:                        # 1/(w+1), ..., w/(w+1): never a wasted lr-0 step
        return (step + 1) / (warmup + 1)
    frac = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac


def domain_of(row: dict) -> str:
    return row.get("scenario", "").split("/")[0]          # "retail/cancel_order" -> "retail"


def epoch_batches(rows: list[dict], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of row indices: a fresh seeded shuffle, cut into batches of one domain each
    (their conversations share the system prompt, which backward_batch then runs once), in seeded
    order. The number of batches is the same every epoch, so resuming needs only the step."""
    rng, order, by_domain = random.Random(seed * 1000 + epoch), list(range(len(rows))), {}
    rng.shuffle(order)
    for j in order:
        by_domain.setdefault(domain_of(rows[j]), []).append(j)
    batches = [idx[i:i + batch_size] for idx in by_domain.values() for i in range(0, len(idx), batch_size)]
    rng.shuffle(batches)
    return batches


def total_steps(args, rows: list[dict]) -> int:
    steps = args.epochs * len(epoch_batches(rows, args.batch_size, args.seed, 0))
    return steps if args.max_steps is None else min(steps, args.max_steps)


def batch_rows(rows, step: int, batch_size: int, seed: int) -> list[dict]:
    """The rows of optimizer step `step`."""
    epoch, i = divmod(step, len(epoch_batches(rows, batch_size, seed, 0)))
    return [rows[j] for j in epoch_batches(rows, batch_size, seed, epoch)[i]]


def plot(metrics: list[dict], path: str):
    common.plot_panels(path, [("SFT loss (nats / agent token)", {"": [(m["step"], m["loss"]) for m in metrics]}, None),
                              ("lr schedule", {"": [(m["step"], m["lr"]) for m in metrics]}, None)], dpi=100)


# ----------------------------------------------------------------------------- main

def train(args, model, tokenizer, rows: list[dict]):
    """The SFT loop. model: a PeftModel with trainable LoRA weights. -> list of per-step metrics."""
    from tqdm import tqdm
    os.makedirs(args.out, exist_ok=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    total, per_epoch = total_steps(args, rows), len(epoch_batches(rows, args.batch_size, args.seed, 0))
    warmup = max(1, round(args.warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup, total, args.schedule))
    start, metrics = common.resume(args.out, model, opt, sched)    # a rerun after a kill goes on from here
    kernel = common.logprob_kernel()                                # the log-prob kernel, decided once
    model.train()
    bar = tqdm(range(start, total), initial=start, total=total, desc="sft", file=sys.stdout)
    for step in bar:
        t0 = time.time()
        batch = batch_rows(rows, step, args.batch_size, args.seed)
        n_tok = sum(sum(r["loss_mask"][:args.max_len]) for r in batch)   # normaliser for the whole batch
        loss_sum = backward_batch(model, batch, args, pad=tokenizer.pad_token_id, n_tok=n_tok, kernel=kernel)
        seen = sum(min(len(r["token_ids"]), args.max_len) for r in batch)
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dt = time.time() - t0
        m = {"step": step + 1, "epoch": step / per_epoch, "loss": loss_sum, "lr": lr,
             "grad_norm": gnorm, "tokens": seen, "trained_tokens": n_tok, "seconds": dt, "tok_per_s": seen / dt,
             "task_ids": [r.get("task_id") for r in batch]}
        common.log_metrics(args.out, metrics, m)
        bar.write(f"step {step + 1:4d}/{total} | loss {loss_sum:.4f} | lr {lr:.2e} | grad {gnorm:.3f} | "
                  f"tokens {seen:6d} ({n_tok} trained) | {dt:5.1f} s | {seen / dt:6.0f} tok/s")
        if (step + 1) % args.save_every == 0 or step + 1 == total:
            common.save_checkpoint(args.out, step + 1, model, opt, metrics, scheduler=sched)
        if args.stop_after is not None and step + 1 >= args.stop_after:
            print(f"stopping after step {step + 1} (--stop-after); rerun to resume")
            break
    return metrics


# may change on resume (the last two change speed and memory, not the numbers)
RESUME_FREE = {"stop_after", "save_every", "share_prefix", "grad_checkpointing"}


def main(argv=None):
    args = parse_args(argv)
    common.start_run(args, args.out, may_change=RESUME_FREE)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t0 = time.time()

    tpath = os.path.join(args.out, "tokens.jsonl")
    model, tokenizer = rollout.load_model(args.model, load_in_4bit=args.load_in_4bit)
    if common.checkpoints(args.out) and os.path.exists(tpath):
        rows = [json.loads(l) for l in open(tpath)]     # resuming: train on the same data
        print(f"data: reusing {len(rows)} conversations from {tpath}")
    else:
        rows = make_data(args, tokenizer)

    rows = [r for r in rows if sum(r["loss_mask"][:args.max_len])]   # something left to learn after truncation
    if not rows:
        raise SystemExit(f"--max-len {args.max_len} cuts every conversation before the agent's first turn: raise it")
    model = rollout.add_lora(model, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout)
    if args.grad_checkpointing == "on":     # transformers drops the prefix cache in checkpointed layers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.print_trainable_parameters()
    metrics = train(args, model, tokenizer, rows)
    if metrics:
        plot(metrics, os.path.join(args.out, "loss.png"))
    total = total_steps(args, rows)
    if not metrics or metrics[-1]["step"] < total:
        return                                          # interrupted on purpose (--stop-after)
    model.save_pretrained(os.path.join(args.out, "adapter"))
    print(f"adapter -> {os.path.join(args.out, 'adapter')}; loss {metrics[0]['loss']:.3f} -> "
          f"{metrics[-1]['loss']:.3f}; {time.time() - t0:.0f} s total")


if __name__ == "__main__":
    main()
