"""sampler/bench.py: watch the samplers run, or time them.

  python -m sampler.bench                 # a few episodes with the default model and the scripted user, printed
  python -m sampler.bench --bench         # tok/s of ModelAgent vs PlainAgent at rl.py's CPU rollouts, in the same run,
                                          # against a matmul roofline, and where ModelAgent's seconds go
  python -m sampler.bench --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o
"""
import contextlib
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import common
import envs
from kernels import harness
from rollout import DEFAULT_MODEL, load_adapter, load_model, run_episodes
from sampler.attention import prefill_padded, shared_prefix_attention, weight_major_linear
from sampler.fast import ModelAgent
from sampler.plain import PlainAgent

# The flags left unset: the tour prints a few retail episodes; the bench times the rollouts of rl.py's earlier CPU
# default (airline's easy tier, 7 turns of <= 80 tokens in 3,072, groups of 8, T = 0.7), the workload the speed
# tables in docs/results.md were measured on.
PRESETS = {"tour": dict(domain="retail", group_size=1, max_turns=6, max_new_tokens=128, max_context=8192,
                        temperature=1.0),
           "bench": dict(domain="airline", tiers="easy", group_size=8, max_turns=7, max_new_tokens=80, max_context=3072,
                         temperature=0.7)}


class Profile:
    """Where a rollout's seconds go, from timers wrapped around the sampler's parts while it runs (removed after):
    the agent's calls (the rest is the users, the envs and the chat format); its forwards, decode steps inside the
    decode loop (_sample) and prefill outside it (the shared prefix, each round's new user/tool turns); inside a
    decode step the weight matmuls (every nn.Linear, the LM head's too) and the attention; the rest of the decode
    loop is sampling and per-token Python. The attention's split between the shared prefix and the rows' own
    tokens: every 10th decode call is run again over the own part alone (plain SDPA), timed apart, and its share
    scaled to all calls; those re-runs are the profiler's own cost, reported on a line of their own."""

    def __init__(self, agent):
        self.agent, self.s, self.undo, self.calls = agent, Counter(), [], 0
        self.sampling = self.decoding = False

    def wrap(self, owner, name, key, flag=None, only=None):
        """Time owner.name into self.s[key], or with only (a flag's name, or a function) only while it holds;
        self.<flag> is set while it runs (with only: while both are)."""
        plain, own = getattr(owner, name), isinstance(owner, type) or name in vars(owner)

        def timed(*a, **kw):
            counting = only is None or (only() if callable(only) else getattr(self, only))
            if flag:
                setattr(self, flag, counting)
            t0 = time.perf_counter()
            try:
                return plain(*a, **kw)
            finally:
                if flag:
                    setattr(self, flag, False)
                if counting:
                    self.s[key] += time.perf_counter() - t0
        setattr(owner, name, timed)
        self.undo.append((owner, name, plain, own))

    def attention(self, *a, **kw):
        t0 = time.perf_counter()
        out = shared_prefix_attention(*a, **kw)
        if self.decoding:
            self.s["attention"] += time.perf_counter() - t0
            self.calls += 1
            module, query, key, value, mask = a[:5]
            if self.calls % 10 == 0 and kw.get("shared_prefix") is not None:
                t1 = time.perf_counter()
                sdpa_attention_forward(module, query, key, value, mask, scaling=kw.get("scaling"))
                self.s["own sampled"] += time.perf_counter() - t1
                self.s["attention sampled"] += t1 - t0
        return out

    def __enter__(self):
        agent = self.agent
        self.wrap(agent, "act", "agent")
        self.wrap(agent, "_sample", "sample", flag="sampling")
        self.wrap(agent.model, "forward", "prefill", only=lambda: not self.sampling)
        self.wrap(agent.model, "forward", "decode", flag="decoding", only="sampling")
        self.wrap(torch.nn.Linear, "forward", "weight matmuls", only="decoding")
        AttentionInterface.register("shared_prefix", self.attention)
        return self

    def __exit__(self, *exc):
        AttentionInterface.register("shared_prefix", shared_prefix_attention)
        for owner, name, plain, own in reversed(self.undo):    # own: it was the owner's own attribute
            setattr(owner, name, plain) if own else delattr(owner, name)

    def report(self, total: float) -> str:
        s = self.s
        # the own tokens' share of the attention, estimated from every 10th call run again over them alone; on a
        # busy machine a re-run can take longer than the call it repeats, so the share is capped at all of it
        share = min(1.0, s["own sampled"] / s["attention sampled"]) if s["attention sampled"] else 0.0
        own = s["attention"] * share
        rows = [("users, envs, chat format (outside the agent)", total - s["agent"]),
                ("prefill forwards: the shared prefix, then each round's new user/tool turns", s["prefill"]),
                ("decode: weight matmuls (every linear, the LM head's too)", s["weight matmuls"]),
                ("decode: attention over the shared prefix", s["attention"] - own),
                ("decode: attention over each row's own tokens", own),
                ("decode: the rest of the forward (norms, rotary, residuals, KV writes, framework)",
                 s["decode"] - s["weight matmuls"] - s["attention"] - s["own sampled"]),
                ("the profiler's own re-runs of the attention (for the split above)", s["own sampled"]),
                ("sampling and per-token Python in the decode loop", s["sample"] - s["decode"]),
                ("the agent's other work (memo, caches, waves, LoRA merge)", s["agent"] - s["prefill"] - s["sample"])]
        return "\n".join(f"  {name:<82} {sec:7.1f} s {100 * sec / total:5.1f}%" for name, sec in rows)


def matmul_roofline(model, rows: int, reps: int = 5) -> float:
    """Seconds one decode step of `rows` rows spends in its weight matmuls alone (every nn.Linear of the model
    once, the LM head included, shaped as a decode step calls them, weight-major as the sampler runs them),
    measured now: rows / this is the tok/s a sampler would reach if nothing else took time."""
    shapes = Counter(tuple(m.weight.shape) for name, m in model.named_modules()   # the base weights (LoRA merged)
                     if isinstance(m, torch.nn.Linear) and m.weight.is_floating_point() and "lora_" not in name)
    total = 0.0
    with weight_major_linear():
        for (out, inp), count in shapes.items():
            w, x = torch.randn(out, inp, dtype=model.dtype), torch.randn(rows, 1, inp, dtype=model.dtype)
            total += count * harness.timed(lambda: F.linear(x, w), warmup=1, repeat=reps)[0]
    return total


def bench(model, tok, args):
    """Sampled tokens/s at each --rows (conversations: tasks x --group-size, advanced together as rl.py does),
    in one run: PlainAgent (one conversation at a time, the whole conversation fed every turn: the baseline, run
    at the smallest row count only, since it advances one conversation at a time),
    ModelAgent with the LoRA delta unmerged (only with --adapter), ModelAgent with each round's new turns padded
    into batches (sampler.attention.prefill_padded: the fast sampler as it was before its prefill was packed; the
    same tokens), ModelAgent; each against the weight-matmul roofline measured in the same run. Then where
    ModelAgent's seconds went at the largest row count."""
    g = args.group_size
    rows = sorted({-(-int(r) // g) * g for r in args.rows.split(",")})   # whole groups
    tasks = envs.make_tasks(args.domain, "train", 1000, args.tiers and args.tiers.split(","), seed=args.seed)
    if len(tasks) < max(rows) // g:                  # the first 1000 tasks, filtered by tier: as rl.py's pool
        raise SystemExit(f"--rows {max(rows)}: {args.domain} has {len(tasks)} such tasks, {max(rows) // g} needed")
    tasks = tasks[:max(rows) // g]
    kw = dict(max_turns=args.max_turns, max_context=args.max_context, progress=False, seed=args.seed)
    agents = {"plain": lambda: PlainAgent(model, tok, args.temperature, args.max_new_tokens),
              "unmerged": lambda: ModelAgent(model, tok, args.temperature, args.max_new_tokens, merge_lora=False),
              "padded": lambda: ModelAgent(model, tok, args.temperature, args.max_new_tokens),
              "fast": lambda: ModelAgent(model, tok, args.temperature, args.max_new_tokens)}
    if not args.adapter:
        del agents["unmerged"]
    run_episodes(agents["fast"](), tok, tasks[:1], **{**kw, "max_turns": 1})   # untimed warm-up
    print(f"bench: {args.domain} {args.tiers or 'all tiers'}, groups of {g}, <= {args.max_turns} turns x "
          f"<= {args.max_new_tokens} new tokens, T {args.temperature}, {harness.machine()}\n"
          "roof: the tok/s if a decode step cost only its weight matmuls, measured in this run\n"
          f"{'rows':>5} {'agent':>9} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'vs plain':>8} {'roof':>6} {'of roof':>7}")
    rates, profile, tokens = {}, None, {}
    for n in rows:
        roof = n / matmul_roofline(model, n)
        for name, make in agents.items():
            if name == "plain" and n != rows[0]:          # one conversation at a time: its tok/s is the same at any rows
                rates[n, name] = rates[rows[0], name]
                continue
            agent = make()
            torch.manual_seed(args.seed)
            with (prefill_padded() if name == "padded" else contextlib.nullcontext(),
                  Profile(agent) if name == "fast" and n == rows[-1] else contextlib.nullcontext() as prof):
                dt, trajs = harness.timed(lambda: run_episodes(agent, tok, tasks[:n // g], g, **kw))
            tokens[name] = [t.token_ids for t in trajs]
            toks = sum(sum(t.loss_mask) for t in trajs)
            rates[n, name] = toks / dt
            if prof:
                profile = prof.report(dt)
            print(f"{n:>5} {name:>9} {toks:>7} {dt:>8.1f} {toks / dt:>7.1f} {rates[n, name] / rates[n, 'plain']:>7.2f}x "
                  f"{roof:>6.0f} {100 * toks / dt / roof:>6.1f}%", flush=True)
    lo, hi = rows[0], rows[-1]
    print(f"scaling: ModelAgent at {hi} rows runs at {rates[hi, 'fast'] / rates[lo, 'fast']:.2f}x its tok/s at {lo}")
    print(f"packed vs padded prefill, at {hi} rows: {rates[hi, 'fast'] / rates[hi, 'padded']:.2f}x the tok/s, the "
          f"same tokens: {tokens['fast'] == tokens['padded']}")
    print(f"profile (ModelAgent, {hi} rows): where the rollouts' {dt:.0f} seconds went\n{profile}")


def main(argv=None):
    ap = common.Parser(description="Run a few MUA-RL rollouts and print them, or time the samplers.")
    common.add_model_args(ap, model_default=DEFAULT_MODEL)
    common.add_user_args(ap)
    ap.group("model").add_argument("--adapter", default=None, help="LoRA adapter dir to load (e.g. runs/rl/adapter)")
    g = ap.group("world")
    g.add_argument("--domain", default=None, help="a domain of envs.DOMAINS (retail, airline, tau2-..., ...)")
    g.add_argument("--tiers", default=None, help="only tasks of these tiers, comma-separated")
    g.add_argument("--split", default="train", help="train | test")
    g.add_argument("--tasks", type=int, default=4, help="number of tasks")
    g.add_argument("--group-size", type=int, default=None, help="rollouts per task")
    common.add_episode_args(ap)
    g = ap.group("run")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature, 0: greedy")
    g.add_argument("--seed", type=int, default=0, help="task, user and sampling seed")
    g.add_argument("--bench", action="store_true", help="tok/s of the plain and the fast sampler at --rows "
                   "conversations, against a matmul roofline, and where the fast one's seconds went; with --adapter "
                   "also LoRA unmerged. Its preset is rl.py's CPU rollouts")
    g.add_argument("--rows", default="8,16", help="with --bench: conversations decoded together, comma-separated")
    args = common.parse_with_preset(ap, PRESETS, argv, "bench" if "--bench" in (argv or sys.argv[1:]) else "tour")
    if not all(r.isdigit() and int(r) > 0 for r in args.rows.split(",")):
        common.fail("--rows", f"{args.rows!r} is not a comma-separated list of positive integers")
    if args.domain not in envs.DOMAINS:
        common.fail("--domain", f"unknown domain {args.domain!r}; use one of {', '.join(envs.DOMAINS)}")
    common.check_args(args, at_least=dict(tasks=1, group_size=1, max_turns=1, max_new_tokens=1, max_context=2,
                                          user_workers=1),
                      finite=dict(temperature=(0, False)))
    common.start_run(args)
    model, tok = load_model(args.model, args.load_in_4bit)
    model = load_adapter(model, args.adapter) if args.adapter else model
    if args.bench:
        return bench(model, tok, args)
    torch.manual_seed(args.seed)
    tasks = envs.make_tasks(args.domain, args.split, args.tasks, args.tiers and args.tiers.split(","), seed=args.seed)
    agent = ModelAgent(model, tok, args.temperature, args.max_new_tokens, int(args.kv_budget * 2**30) or None,
                       args.thinking, sample_weights=args.sample_weights) if args.sampler == "fast" else \
        PlainAgent(model, tok, args.temperature, args.max_new_tokens, args.thinking)
    t0 = time.time()
    trajs = run_episodes(agent, tok, tasks, args.group_size, common.user_factory(args, model, tok),
                         max_turns=args.max_turns, max_context=args.max_context, seed=args.seed,
                         user_workers=args.user_workers)
    for t in trajs:
        print(t.show() + "\n")
    reasons = dict(Counter(t.stop_reason for t in trajs))
    print(f"{len(trajs)} rollouts in {time.time() - t0:.0f} s | mean reward "
          f"{sum(t.reward for t in trajs) / len(trajs):.2f} | stop reasons {reasons} | sampled tokens "
          f"{sum(sum(t.loss_mask) for t in trajs)} | total tokens {sum(len(t.token_ids) for t in trajs)}")


if __name__ == "__main__":
    main()
