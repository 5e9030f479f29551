"""Evaluation: pass^k on held-out tasks (base vs SFT vs RL), paired comparisons, τ², BFCL, ACEBench, failures.

What it does
  1. pass^k on the held-out test split of any world (envs/: our retail and airline, τ²-bench's domains,
     ACEBench's agent category, BFCL-v3 multi-turn's four categories), tau-bench's definition:
     pass^k = mean over tasks of C(c, k) / C(n, k), where c of n trials succeeded (reward 1.0),
     with a bootstrap 95% CI over tasks, overall, per domain and per scenario. All trials of all
     tasks go through ONE rollout.run_episodes call (the same loop and user simulators as training);
     a benchmark world prints its comparison with the paper (envs.reports).
  2. Paired comparisons of every two agents on the same tasks and user seeds (pair_up).
  3. Beside pass^1, what the agent did (behaviour, METRICS; docs/reference.md "Metrics"): the correct end state however the
     episode ended, finished (not cut off at the turn cap, which scores 0 as in τ²-bench: ours.Env.score),
     asked before writing, the withheld facts it asked for, turns, the questions asked again for a fact the user
     had given (repeated_questions); per agent and domain, and any of them can be
     the paired comparison's metric (--paired-metric). Under several users (--user scripted,none) every agent
     meets each, and a grid of agents x users shows the metric: the 2 x 2 of trained with / without a user
     against evaluated with / without one (the claims experiment, docs/results.md). Under each rule-based user
     (scripted, its personas, none) the gold agent's own metrics stand beside them as the "ceiling": what the
     limits let a careful agent reach (eval.ceiling).
  4. Failure analysis: every failed episode's DB diff goes to failures.jsonl; failed tasks are re-run
     with another user seed and flagged `user_sim_suspect` if they then succeed (tau2-bench found
     user-simulator errors behind up to 30% of retail failures).

Run
  python eval.py                                  # base, SFT (runs/sft/adapter), RL (runs/rl/adapter): whichever exist
  python eval.py --agents base,rl --trials 4      # pick agents; an adapter dir path also works as an agent
  python eval.py --sampler plain                  # sampler/plain.py, the sampler to read: the same episodes
  python eval.py --agents openai:gpt-4o-mini --openai-base-url http://localhost:8000/v1   # any endpoint
  python eval.py --user openai:gpt-4o             # the paper's LLM user instead of the scripted one
  python eval.py --user scripted,none,scripted:curious --paired-metric correct_state,pass1   # each agent under
                                                  # each user, paired on the correct end state and on pass^1
  python eval.py --domains tau2-retail,tau2-airline,tau2-telecom --user openai:gpt-4o   # τ²-bench's test split
  python eval.py --domains bfcl-base,bfcl-miss-func,bfcl-miss-param,bfcl-long-context --n-tasks 20 \
                 --max-turns 80 --max-context 16384    # BFCL multi-turn: the first 20 entries of each category
  python eval.py --smoke --out /tmp/eval          # tiny, < 2 min on CPU (tests/test_eval.py)
  Writes under --out (default runs/eval): args.json, results.json (agents, paired, ceiling), results.md, eval.png,
  failures_<agent>.jsonl, episodes_<agent>.jsonl, done/ (each agent and user evaluated, with its adapter's digest:
  a killed run, rerun, evaluates only what is left, a rerun with more --agents or --user only what is new, and an
  adapter trained again at the same path anew). `python scripts/viewer.py
  runs/eval` shows the episodes as one page, and the tasks one agent solved and another did not, side by side.

Simplifications vs the paper
  * our procedural retail/airline domains by default, scripted user; τ²-bench itself with
    --domains tau2-retail,tau2-airline,tau2-telecom --user openai:MODEL (its test split, its evaluators;
    envs/benchmarks/tau2_domains.py), printed beside the paper's Qwen3-8B and MUA-RL-8B pass^1;
  * CPU preset: few tasks and trials, short turns (PRESETS["cpu"]); the GPU preset is larger;
  * BFCL runs through our loop (envs/benchmarks/bfcl_domains.py says how it differs from BFCL's runner);
  * the agent decodes greedily by default (--temperature 0), as tau-bench runs its agents; trials
    then differ by the user's seed (the scripted user varies its phrasing), so pass^k measures
    consistency across users. With --temperature > 0, user_sim_suspect also catches agent sampling
    luck: read it as "failed, yet solvable with another user", then look at the transcripts;
  * besides pass^k, the table counts the agent's tool calls per agent turn (ok = executed without
    error, err = the env refused it, malformed = not parseable): a format learned shows there first.
"""
import hashlib
import json
import math
import os
import pickle
import random
import re
import sys
import time
from collections import Counter, defaultdict

import torch

import common
from envs import ours
from envs import oracle
import rollout
import sampler
import users
import envs
from envs import llm_users

# CPU: the tier the CPU presets of sft.py and rl.py train on, 24 held-out tasks per domain (48 in all, enough
# to tell two agents apart when they differ by ~0.15), greedy, one trial each, under the training personas and
# under the held-out ones; the episode limits rl.py's CPU preset trains with (common.CPU_LIMITS).
PRESETS = {
    "gpu": dict(n_tasks=common.EVAL_TASKS, trials=4, tiers="easy,medium,hard", user="scripted:train,scripted:heldout",
                **common.GPU_LIMITS, recheck=16),
    "cpu": dict(n_tasks=common.EVAL_TASKS, trials=1, tiers=common.CPU_TIERS, user="scripted:train,scripted:heldout",
                **common.CPU_LIMITS, recheck=0),
    "smoke": dict(n_tasks=1, trials=2, tiers="easy,medium,hard", max_turns=1, max_new_tokens=8, max_context=2048,
                  recheck=1),
}
# What each episode is scored on (episode_metrics; one README line each), beside pass^k: name -> its table heading
METRICS = {"pass1": "pass^1", "correct_state": "correct end state", "finished": "finished",
           "asked_first": "asked before writing", "facts_asked": "facts asked for", "turns": "turns",
           "repeated_questions": "questions asked again"}


def parse_args(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    common.add_run_args(p, out="runs/eval", smoke="tiny run for tests (< 2 min on CPU)")
    common.add_model_args(p)
    g = p.group("model")
    g.add_argument("--agents", default="base,sft,rl",
                   help="comma list: base | sft | rl | an adapter dir | openai:MODEL (sft and rl are skipped when "
                        "their adapter does not exist)")
    g.add_argument("--sft-adapter", default="runs/sft/adapter", help="adapter dir used for agent 'sft'")
    g.add_argument("--rl-adapter", default="runs/rl/adapter", help="adapter dir used for agent 'rl'")
    g.add_argument("--openai-base-url", default=None, help="base URL for openai:MODEL agents (none: OpenAI)")
    common.add_user_args(p, several=True)
    g = p.group("world")
    g.add_argument("--domains", default="retail,airline", help="comma-separated test domains (envs.DOMAINS)")
    g.add_argument("--n-tasks", type=int, default=None, help="held-out test tasks per domain")
    g.add_argument("--tiers", default=None, help="only test tasks of these tiers (easy, medium, "
                   "hard) or these scenarios by name, comma-separated")
    common.add_episode_args(p)
    g = p.group("algorithm")                      # what is measured, and how
    g.add_argument("--trials", type=int, default=None, help="trials per task n; pass^k for k = 1..n")
    g.add_argument("--temperature", type=float, default=0.0, help="agent temperature (0: greedy, as tau-bench; "
                   "rl.py samples at its --temperature: 0.7 on CPU, 1.0 on a GPU)")
    g.add_argument("--recheck", type=int, default=None, help="failed tasks re-run with another user seed (0 = off)")
    g.add_argument("--paired-metric", default="pass1", help=f"comma list of the metrics paired comparisons are "
                   f"made on: {', '.join(METRICS)} (the first is plotted)")
    g.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples for the CI")
    args = common.parse_with_preset(p, PRESETS, argv)
    common.check_args(args, at_least=dict(n_tasks=1, trials=1, max_turns=1, max_new_tokens=1, max_context=2,
                                          recheck=0, n_boot=1, user_workers=1),
                      finite=dict(temperature=(0, False)), several_users=True)
    for m in args.paired_metric.split(","):
        if m not in METRICS:
            common.fail("--paired-metric", f"unknown metric {m!r}; use a comma list of {', '.join(METRICS)}")
    for spec in args.agents.split(","):
        if spec not in ("base", "sft", "rl") and not spec.startswith("openai:") and \
                not os.path.isfile(os.path.join(spec, "adapter_config.json")):
            published = " (published ones: bash scripts/adapters.sh puts them back)" if "docs/steps/" in spec else ""
            common.fail("--agents", f"{spec!r} is not base, sft, rl, openai:MODEL or an adapter dir{published}")
    return args


# ----------------------------------------------------------------------------- pass^k

def _successes(rewards) -> tuple[int, int]:
    return sum(r >= 1.0 for r in rewards), len(rewards)   # (c, n); success = binary reward 1.0


def pass_hat_k(results, k: int) -> float:
    """tau-bench pass^k: mean over tasks of C(c, k) / C(n, k).

    results: {task_id: [reward of each trial]} or a list of such reward lists. pass^1 is the plain
    success rate; pass^k is the chance that k trials drawn without replacement ALL succeed.
    """
    rows = list(results.values()) if isinstance(results, dict) else list(results)
    if not rows:
        return float("nan")
    per_task = []
    for rewards in rows:
        c, n = _successes(rewards)
        if k > n:
            raise ValueError(f"pass^{k} needs at least {k} trials per task, got {n}")
        per_task.append(math.comb(c, k) / math.comb(n, k))
    return sum(per_task) / len(per_task)


def bootstrap_ci(results, k: int, n_boot: int = 1000, seed: int = 0, alpha: float = 0.05) -> tuple[float, float]:
    """Percentile bootstrap over tasks (trials of a task stay together)."""
    rows = list(results.values()) if isinstance(results, dict) else list(results)
    rng = random.Random(seed)
    stats = sorted(pass_hat_k(rng.choices(rows, k=len(rows)), k) for _ in range(n_boot))
    return stats[int(alpha / 2 * n_boot)], stats[min(n_boot - 1, int((1 - alpha / 2) * n_boot))]


def summarize(results: dict, n_boot: int = 1000, seed: int = 0) -> dict:
    """{"n_tasks", "trials", "pass^k": {k: value}, "ci": {k: [lo, hi]}} for one group of tasks."""
    trials = min(len(r) for r in results.values())
    ks = range(1, trials + 1)
    return {"n_tasks": len(results), "trials": trials,
            "pass^k": {k: pass_hat_k(results, k) for k in ks},
            "ci": {k: list(bootstrap_ci(results, k, n_boot, seed)) for k in ks}}


def paired_difference(a: dict, b: dict, n_boot: int = 10000, seed: int = 0, alpha: float = 0.05) -> dict | None:
    """Agent a minus agent b on one metric ({task_id: [its value in each trial]}, e.g. pass1: 1.0 or 0.0),
    evaluated on the same tasks with the same user seeds (trial j of a task meets the same simulated user in
    both runs); a trial where either value is None (the metric does not apply) leaves both. The mean
    difference, a paired bootstrap CI over tasks (each resample keeps a task's a and b results together), and
    the exact sign test (McNemar's on a 0/1 metric): of the episodes where the two differ, a was higher in
    only_a and b in only_b; under "no difference" each is a fair coin, so p = P(a two-sided binomial tail
    at least that lopsided). None when no trial pairs up."""
    if set(a) != set(b) or any(len(a[t]) != len(b[t]) for t in a):
        raise ValueError("paired comparison needs the same tasks and trials for both agents")
    pairs = {t: [(x, y) for x, y in zip(a[t], b[t]) if x is not None and y is not None] for t in sorted(a)}
    ids = [t for t in pairs if pairs[t]]
    if not ids:
        return None
    diffs = [sum(x - y for x, y in pairs[t]) / len(pairs[t]) for t in ids]
    rng = random.Random(seed)
    boot = sorted(sum(rng.choices(diffs, k=len(ids))) / len(ids) for _ in range(n_boot))
    only_a = sum(x > y for t in ids for x, y in pairs[t])
    only_b = sum(y > x for t in ids for x, y in pairs[t])
    n = only_a + only_b
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2 ** n) if n else 1.0
    return {"diff": sum(diffs) / len(ids), "ci": [boot[int(alpha / 2 * n_boot)], boot[int((1 - alpha / 2) * n_boot) - 1]],
            "only_a": only_a, "only_b": only_b, "mcnemar_p": p, "n_tasks": len(ids)}


# ----------------------------------------------------------------------------- agents

def adapter_of(spec: str, args) -> str | None:
    """The adapter dir an --agents entry loads (None: base, or an openai: endpoint)."""
    if spec.startswith("openai:"):
        return None
    return {"base": None, "sft": args.sft_adapter, "rl": args.rl_adapter}.get(spec, spec)


def build_agent(spec: str, args):
    """(agent, tokenizer, label) for one --agents entry, or None when its adapter does not exist."""
    if spec.startswith("openai:"):
        tok = rollout.load_tokenizer(args.model or rollout.DEFAULT_MODEL)   # only to count tokens
        return rollout.OpenAIAgent(tok, spec.split(":", 1)[1], args.openai_base_url, temperature=args.temperature), tok, spec
    adapter = adapter_of(spec, args)
    if adapter is not None and not os.path.exists(os.path.join(adapter, "adapter_config.json")):
        print(f"skipping agent {spec!r}: no adapter at {adapter}")
        return None
    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL, args.load_in_4bit)
    if adapter is not None:
        model = rollout.load_adapter(model, adapter)
    model.eval()
    agent = sampler.make_agent(args.sampler, model, tok, args.temperature, args.max_new_tokens, args.kv_budget,
                               args.thinking, args.sample_weights, max_context=args.max_context)
    return agent, tok, spec


# ----------------------------------------------------------------------------- pass^k evaluation

def evaluate(agent, tokenizer, tasks, trials: int = 2, user=envs.UserFactory("scripted"), *, seed: int = 0,
             max_turns: int, max_context: int, recheck: int = 0, n_boot: int = 1000, progress: bool = True,
             user_workers: int = users.USER_WORKERS, price=(0.0, 0.0), max_sim_failures: float = 1.0) -> dict:
    """pass^k of `agent` (run_episodes' agent: ModelAgent, OpenAIAgent, ...) on `tasks`, `trials` each, with the
    user each conversation gets from `user` (an envs.UserFactory). A task with a trial whose
    user simulator failed or broke the check leaves pass^k; more than max_sim_failures of the
    episodes left out stops the evaluation with one line. "users": what the users did and cost (llm_users.user_report,
    dollars at price), the re-runs of the failure analysis included.

    Returns {"overall", "per_domain", "per_tier", "per_scenario"} summaries (see summarize), "rewards"
    {task_id: [r, ...]}, "failures" (one record per failed episode, DB diff included), "episodes" (every
    Trajectory, those that lost their simulator included),
    "stop_reasons", "calls" (agent turns; tool calls executed ok / refused by the env / malformed), "metrics"
    {metric: {task_id: [its value in each trial]}} and their means "behaviour" (see behaviour), "seconds".
    """
    t0 = time.time()
    run = dict(user=user, max_turns=max_turns, max_context=max_context, progress=progress, user_workers=user_workers)
    every = rollout.run_episodes(agent, tokenizer, tasks, group_size=trials, seed=seed, **run)
    llm_users.stop_if_many_left_out(every, max_sim_failures, "evaluation")
    lost = {tr.task_id for tr in every if tr.failed}  # a failed simulator is no evidence about the agent: such a
    trajs = [tr for tr in every if tr.task_id not in lost]   # task leaves pass^k (its trials pair up no more)
    rewards = {}
    for tr in trajs:
        rewards.setdefault(tr.task_id, []).append(tr.reward)
    tasks = [t for t in tasks if t.id in rewards]
    if not tasks:
        raise SystemExit(f"every episode lost its user simulator or environment: {every[0].stats.get('error')}")

    failures = []
    for i, tr in enumerate(trajs):
        if tr.reward < 1.0:
            failures.append({"task_id": tr.task_id, "domain": tr.domain, "scenario": tr.scenario, "tier": tr.tier,
                             "trial": tr.trial, "stop_reason": tr.stop_reason, "turns": tr.turns,
                             "diff": tr.diff, "stats": tr.stats, "messages": tr.messages})
    # Failure analysis: re-run failed tasks once with a different user seed. A task that then succeeds
    # failed (at least partly) because of the user simulator, not the agent.
    failed = [t for t in tasks if min(rewards[t.id]) < 1.0][:recheck]
    reran = rollout.run_episodes(agent, tokenizer, failed, group_size=1, seed=seed + 7919, **run) if failed else []
    rerun = [tr for tr in reran if not tr.failed]
    rescued = {tr.task_id for tr in rerun if tr.reward >= 1.0}
    for f in failures:
        f["rechecked"] = any(t.id == f["task_id"] for t in failed)
        f["user_sim_suspect"] = f["task_id"] in rescued

    def per(attr):                          # {domain or scenario: summary of its tasks}
        groups = defaultdict(dict)
        for t in tasks:
            groups[getattr(t, attr)][t.id] = rewards[t.id]
        return {g: summarize(r, n_boot, seed) for g, r in sorted(groups.items())}
    values = {m: defaultdict(list) for m in METRICS}        # metric -> task id -> its value in each trial
    by_id = {t.id: t for t in tasks}
    for tr in trajs:
        for m, v in episode_metrics(by_id[tr.task_id], tr).items():
            values[m][tr.task_id].append(v)
    n = lambda key: sum(tr.stats[key] for tr in trajs)   # noqa: E731; tool_calls counts every executed call
    calls = {"turns": sum(tr.turns for tr in trajs), "ok": n("tool_calls") - n("tool_errors"),
             "err": n("tool_errors"), "malformed": n("malformed_calls")}
    extras = defaultdict(lambda: defaultdict(list))    # domain -> extra score (ACEBench's process) -> values
    for tr in trajs:
        for k, v in tr.stats.get("extras", {}).items():
            extras[tr.domain][k].append(v)
    return {"overall": summarize(rewards, n_boot, seed), "per_domain": per("domain"), "per_tier": per("tier"),
            "per_scenario": per("scenario"), "sim_failures": sum(tr.failed != "" for tr in every),
            "tasks_lost": len(lost),
            "extras": {d: {k: sum(v) / len(v) for k, v in e.items()} for d, e in extras.items()},
            "rewards": rewards, "failures": failures, "episodes": every, "rechecked": len(failed),
            "user_sim_suspects": len(rescued),
            "stop_reasons": dict(Counter(tr.stop_reason for tr in trajs)), "calls": calls,
            "metrics": {m: dict(v) for m, v in values.items()}, "seconds": time.time() - t0,
            "users": llm_users.user_report(every + reran, time.time() - t0, price),
            "behaviour": behaviour(values, {t.id: t.domain for t in tasks})}


def episode_metrics(task, traj) -> dict:
    """One episode's METRICS, None where one does not apply (no write to ask before, no fact withheld)."""
    asked = common.asked_before_writing(traj)
    return {"pass1": float(traj.reward >= 1), "correct_state": traj.stats["correct_state"],
            "finished": float(traj.stop_reason in ours.ENDED), "asked_first": None if asked is None else float(asked),
            "facts_asked": facts_asked(task, traj), "turns": traj.turns,
            "repeated_questions": repeated_questions(traj)}


def repeated_questions(traj) -> int | None:
    """How many times the agent asked again for a fact the user had already given (users.repeated_questions, kept
    by run_episodes as the messages' indices); None in a world without hidden facts."""
    at = traj.stats.get("repeated_at")
    return None if at is None else len(at)


def behaviour(values: dict, domain_of: dict) -> dict:
    """{"all" and each domain: {metric: {"mean" over the episodes it applies to (None: none), "n": their number}}}."""
    groups = ["all", *sorted(set(domain_of.values()))]
    means = lambda vs: {"mean": sum(vs) / len(vs) if vs else None, "n": len(vs)}    # noqa: E731
    return {g: {m: means([v for t, trials in per_task.items() if g in ("all", domain_of[t]) for v in trials
                          if v is not None]) for m, per_task in values.items()} for g in groups}


CEILING_USERS = ("scripted", "none")   # rule-based users: the gold agent's score under them costs no model or server


def ceiling(tok, tasks, user: str, args) -> dict | None:
    """The ceiling: the gold agent (envs/oracle.py via rollout.OracleAgent) under `user`, on the eval's tasks of our domains,
    with its trials, user seeds and episode limits: what a careful agent can reach there. Below 1, the turn cap or
    the context cuts tasks that can be solved, and no agent can pass them. -> {"behaviour" (as evaluate's),
    "longest": its longest episode in agent turns, "stop_reasons", "episodes"}; None under an LLM user (each of its
    replies costs a call) or with no task of ours (a benchmark's gold agent needs its own gold user)."""
    procedural = [t for t in tasks if envs.DOMAINS[t.domain] == "ours"]
    if user.partition(":")[0] not in CEILING_USERS or not procedural:
        return None
    trajs = rollout.run_episodes(rollout.OracleAgent(tok), tok, procedural, group_size=args.trials,
                                 user=envs.UserFactory(user), seed=args.seed, max_turns=args.max_turns,
                                 max_context=args.max_context, progress=False)
    values, by_id = {m: defaultdict(list) for m in METRICS}, {t.id: t for t in procedural}
    for tr in trajs:
        for m, v in episode_metrics(by_id[tr.task_id], tr).items():
            values[m][tr.task_id].append(v)
    return {"behaviour": behaviour(values, {t.id: t.domain for t in procedural}),
            "longest": max(tr.turns for tr in trajs), "stop_reasons": dict(Counter(tr.stop_reason for tr in trajs)), "episodes": len(trajs)}


def ceiling_markdown(ceilings: dict) -> str:
    """The ceiling rows, one per user and domain: the behaviour table's columns and the longest episode."""
    if not ceilings:
        return ""
    lines = ["", "Ceiling: the gold agent (envs/oracle.py) under each user, on the same tasks, trials, user seeds and limits; "
             "below 1, the limits cut tasks that can be solved.", "",
             "| ceiling | user | domain | episodes | " + " | ".join(METRICS.values()) + " | longest episode |",
             "|---" * (len(METRICS) + 5) + "|"]
    for user, c in ceilings.items():
        for g, b in c["behaviour"].items():
            cells = ["-" if b[m]["mean"] is None else f"{b[m]['mean']:.3f}" for m in METRICS]
            lines.append(f"| gold agent | {user} | {g} | {b['pass1']['n']} | " + " | ".join(cells) +
                         f" | {c['longest'] if g == 'all' else ''} |")
    return "\n".join(lines) + "\n"


def facts_asked(task, traj) -> float | None:
    """Of the facts the task needs that the user's opening withheld (oracle.withheld), the share the agent's text
    asked for (users.mentions: the words the scripted user listens for). None when none was withheld (an easy
    task's opening names them all, and --user none gives them all) or the world has no hidden facts (τ²)."""
    if not hasattr(task, "hidden_facts"):
        return None
    missing = oracle.withheld(task, next(m["content"] for m in traj.messages if m["role"] == "user").lower())
    said = " ".join(users.visible_text(m["content"]).lower() for m in traj.messages if m["role"] == "assistant")
    return sum(users.mentions(k, said) for k in missing) / len(missing) if missing else None


def save_episodes(path: str, agent: str, trajs):
    """Every episode of one agent, a Trajectory a line (token ids, masks, log-probs, messages, reward, diff, stop
    reason) with the agent's label: `python scripts/viewer.py OUT` shows them, and where the agents differ."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"agent": agent, **vars(t)}) + "\n" for t in trajs)


# ----------------------------------------------------------------------------- report

def pair_up(results: dict, domain_of: dict, seed: int = 0, metric: str = "pass1") -> tuple[dict, dict]:
    """Every later agent against every earlier one that met the same user ("rl - sft"; with several users the
    labels are "agent @ user" and the pairs "rl - sft @ none"), on `metric`, over all tasks; and, when the tasks
    span several domains, over each domain's ("rl - sft (airline)"): RL trained on one domain can gain there and
    lose on another, which the overall difference averages away. Pairs with no episode to compare are left out."""
    labels, domains = list(results), sorted(set(domain_of.values()))
    def pair(b, a, domain=None):            # on the tasks both agents kept (a lost simulator drops a task)
        both = set(results[a]["tau"]["rewards"]) & set(results[b]["tau"]["rewards"])
        keep = lambda x: {t: v for t, v in results[x]["tau"]["metrics"][metric].items()  # noqa: E731
                          if t in both and domain in (None, domain_of[t])}
        return paired_difference(keep(b), keep(a), seed=seed)
    def name(b, a):
        (agent_b, _, user), agent_a = b.partition(" @ "), a.partition(" @ ")[0]
        return f"{agent_b} - {agent_a}" + (f" @ {user}" if user else "")
    duos = [(b, a) for i, a in enumerate(labels) for b in labels[i + 1:] if a.partition(" @ ")[2] == b.partition(" @ ")[2]]
    overall = {name(b, a): pair(b, a) for b, a in duos}
    per_domain = {f"{name(b, a)} ({d})": pair(b, a, d) for d in domains if len(domains) > 1 for b, a in duos}
    return {k: v for k, v in overall.items() if v}, {k: v for k, v in per_domain.items() if v}


def markdown(results: dict, pairs: dict | None = None) -> str:
    """Side-by-side table of every agent: pass^k overall with CI, pass^1 per domain, per tier and per scenario;
    the behaviour metrics per agent and domain; under several users, a grid of agents x users per paired metric;
    then the paired comparisons, pairs = {metric: {comparison: paired_difference}}."""
    agents = list(results)
    first = results[agents[0]]["tau"]
    ks = list(first["overall"]["pass^k"])
    groups = [(g, s) for key in ("per_domain", "per_tier") for g, s in first[key].items()]
    fmt = lambda s, k: f"{s['pass^k'][k]:.3f} [{s['ci'][k][0]:.2f}, {s['ci'][k][1]:.2f}]"
    counts = ", ".join(f"{g}: {s['n_tasks']}" for g, s in groups)
    met = {r.get("user") for r in results.values()}               # several users: each label names its own
    under = f", user {met.pop()}" if len(met) == 1 and None not in met else ""
    lines = [f"Held-out test tasks: {first['overall']['n_tasks']} ({counts}), {first['overall']['trials']} trials "
             f"each{under}; pass^k with 95% bootstrap CI over tasks.", "",
             "| agent | " + " | ".join(f"pass^{k}" for k in ks) + " | " +
             " | ".join(f"{g} pass^1" for g, _ in groups) + " | tool calls ok / err / malformed per 100 "
             "turns | user-sim suspects |",
             "|---" * (len(ks) + len(groups) + 4) + "|"]
    for a in agents:
        tau = results[a]["tau"]
        row = [fmt(tau["overall"], k) for k in ks] + [fmt(tau[key][g], 1) for key in ("per_domain", "per_tier")
                                                      for g in first[key]]
        c = tau["calls"]
        row += [" / ".join(f"{100 * c[k] / max(1, c['turns']):.0f}" for k in ("ok", "err", "malformed")) +
                f" ({c['turns']} turns)"]
        row += [f"{tau['user_sim_suspects']} of {tau['rechecked']} rechecked" if tau["rechecked"] else "-"]
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    lines += users_table(results)
    lines += ["", "What the agents did (docs/reference.md, Metrics): each metric's mean over the episodes it applies to, with "
              "their number where it is not every episode's.", "",
              "| agent | domain | episodes | " + " | ".join(METRICS.values()) + " |", "|---" * (len(METRICS) + 3) + "|"]

    def cell(v, n=0):                       # a mean, with the episodes it is over where it is not every one of n
        return "-" if v["mean"] is None else f"{v['mean']:.3f}" + (f" ({v['n']})" if v["n"] < n else "")
    for a in agents:
        for g, b in results[a]["tau"]["behaviour"].items():
            n = b["pass1"]["n"]
            lines.append(f"| {a} | {g} | {n} | " + " | ".join(cell(b[m], n) for m in METRICS) + " |")
    users_ = list(dict.fromkeys(a.partition(" @ ")[2] for a in agents))
    for m in pairs if len(users_) > 1 else []:      # the 2 x 2: trained with / without a user, evaluated with / without
        lines += ["", f"| {METRICS[m]}, all tasks: agent, evaluated with | " + " | ".join(users_) + " |",
                  "|---" * (len(users_) + 1) + "|"]
        for x in dict.fromkeys(a.partition(" @ ")[0] for a in agents):
            lines.append(f"| {x} | " + " | ".join(cell(results[f"{x} @ {u}"]["tau"]["behaviour"]["all"][m])
                                                 if f"{x} @ {u}" in results else "-" for u in users_) + " |")
    for m, ps in ((m, ps) for m, ps in (pairs or {}).items() if ps):
        lines += ["", f"Paired on the same tasks and user seeds: the difference in {METRICS[m]}, with a 95% paired "
                  "bootstrap CI over tasks and the exact sign test (McNemar's on a 0/1 metric) on the episodes where "
                  "the two differ.", "", "| comparison | difference | 95% CI | first higher | second higher | p |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {d['diff']:+.3f} | [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] | {d['only_a']} | "
                  f"{d['only_b']} | {d['mcnemar_p']:.4f} |" for name, d in ps.items()]
    lines += ["", "| scenario | tasks | " + " | ".join(f"{a} pass^1" for a in agents) + " |",
              "|---" * (len(agents) + 2) + "|"]
    for s, summary in first["per_scenario"].items():
        lines.append(f"| {s} | {summary['n_tasks']} | " +
                     " | ".join(f"{results[a]['tau']['per_scenario'][s]['pass^k'][1]:.3f}" for a in agents) + " |")
    return "\n".join(lines) + "\n"


def users_table(results: dict) -> list[str]:
    """The users of each agent's evaluation (llm_users.user_report), a row each: [] when none was reported."""
    rows = {a: r["tau"]["users"] for a, r in results.items() if r["tau"].get("users")}
    counts = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"   # noqa: E731
    share = lambda u: "" if u["user_wait_share"] is None else f" ({u['user_wait_share']:.0%})"   # noqa: E731
    return ["", "What the simulated users did and cost: requests sent (of them, the client's retries and the check's "
            "re-asks), tokens, dollars at --user-price, seconds waited on them (their share of the evaluation's); the "
            "messages the check flagged, and the episodes left out of pass^k (their user broke the check or failed), "
            "per reason (docs/reference.md, The check on the LLM user).", "",
            "| agent | requests (retried, asked again) | prompt + completion tokens | $ | waited | flagged by the check "
            "| left out |", "|---|---|---|---|---|---|---|"] + [
        f"| {a} | {u['user_requests']} ({u['user_retries']}, {u['user_asked_again']}) | {u['user_prompt_tokens']} + "
        f"{u['user_completion_tokens']} | {u['user_dollars']:.2f} | {u['user_wait_s']:.0f} s{share(u)} | "
        f"{counts(u['user_flags'])} | {counts(u['left_out'])} |" for a, u in rows.items()] if rows else []


def paper_tables(results: dict) -> str:
    """Each benchmark world's comparison with the paper (τ², ACEBench, BFCL), per agent; "" when none ran."""
    out = []
    for a, r in results.items():
        scores = {d: {**s, "pass1": s["pass^k"][1], "extras": r["tau"]["extras"].get(d, {})}
                  for d, s in r["tau"]["per_domain"].items()}
        text = envs.reports(scores)
        out += [f"\n### {a}\n{text}"] if text else []
    return "".join(out)


def plot(results: dict, path: str, pairs: dict | None = None, metric: str = "pass1"):
    """Three panels, each titled in one line: pass^1 of every agent with its 95% CI; pass^1 per domain; and each
    paired difference in `metric` with its 95% paired CI (a point left of 0: the first agent did worse)."""
    short = lambda a: re.sub(r"^runs/(agents/)?|/adapter\b", "", a)   # noqa: E731; runs/X/adapter -> X
    agents = list(results)
    domains = list(results[agents[0]]["tau"]["per_domain"])
    pairs = pairs or {}
    fig, axes = common.figure(3 if pairs else 2, (13 if pairs else 9, 3.6),
                              gridspec_kw={"width_ratios": [1, 1.2, 1.3][:3 if pairs else 2]})
    overall = [results[a]["tau"]["overall"] for a in agents]
    vals = [o["pass^k"][1] for o in overall]
    err = [[v - o["ci"][1][0] for v, o in zip(vals, overall)], [o["ci"][1][1] - v for v, o in zip(vals, overall)]]
    ax = axes[0]
    ax.bar(range(len(agents)), vals, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(agents))])
    ax.set_xticks(range(len(agents)), [short(a) for a in agents])
    for i, v in enumerate(vals):
        ax.text(i, 0.03, f"{v:.3f}", ha="center", color="white", fontweight="bold")   # inside the bar, off the CI
    ax.set(ylabel="pass^1", ylim=(0, 1.05), title=f"pass^1, {overall[0]['n_tasks']} tasks (95% CI)")
    ax, width = axes[1], 0.8 / len(agents)
    for i, a in enumerate(agents):
        ax.bar([j + i * width for j in range(len(domains))],
               [results[a]["tau"]["per_domain"][d]["pass^k"][1] for d in domains], width, label=short(a),
               color=f"C{i}")
    ax.set_xticks([j + width * (len(agents) - 1) / 2 for j in range(len(domains))], domains)
    ax.set(ylim=(0, 1.05), title="pass^1 per domain")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(agents), frameon=False)   # below the axes
    if pairs:
        ax = axes[2]
        names = list(pairs)[::-1]                                     # the first pair on top
        for y, name in enumerate(names):
            d = pairs[name]
            ax.errorbar(d["diff"], y, xerr=[[d["diff"] - d["ci"][0]], [d["ci"][1] - d["diff"]]], fmt="o", capsize=4,
                        color="C3" if d["ci"][0] > 0 else "0.3")
            ax.text(d["ci"][1] + 0.02, y, f"{d['diff']:+.3f}", va="center")
        ax.axvline(0, color="0.6", lw=1)
        ax.set_yticks(range(len(names)), [" - ".join(map(short, n.split(" - "))) for n in names])
        lo = min(-0.1, *(pairs[n]["ci"][0] for n in names)) - 0.05
        ax.set(xlim=(lo, max(0.1, *(pairs[n]["ci"][1] for n in names)) + 0.2), ylim=(-0.6, len(names) - 0.4),
               title=f"paired difference in {METRICS[metric]} (95% CI)")
    common.save_figure(fig, path)


def out_file(args, prefix: str, label: str, suffix: str) -> str:
    """<out>/<prefix><label><suffix>, the label's path-unsafe characters as _."""
    return os.path.join(args.out, prefix + re.sub(r"[^A-Za-z0-9_.-]", "_", label) + suffix)


RESUME_FREE = ("agents", "user", "paired_metric")   # flags that leave each agent-and-user's evaluation as it is


def done_before(args, name: str, user: str, digest: str | None) -> dict | None:
    """A killed eval.py resumes agent by user: each agent's evaluation with each user is saved with the run's other
    arguments and its adapter's digest (<out>/done/<agent @ user>.pkl, pickled: its pass^k keys are ints) and read
    back, not re-run, by a rerun whose arguments are the same but for RESUME_FREE and whose adapter files are the
    same (so a run may also grow its --agents or --user, and an ablation's arms share one baseline).
    digest: adapter_digest of the agent now."""
    path = done_file(args, name, user)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        saved = pickle.load(f)
    if saved["args"] != resume_key(args):
        return None
    if saved.get("adapter") != digest:
        print(f"== {name} with user {user}: its adapter changed since {path} was written; evaluating it again")
        return None
    print(f"== {name} with user {user}: evaluated before with these arguments and this adapter, read from {path}")
    return saved["tau"]


def save_done(args, name: str, user: str, tau: dict, digest: str | None):
    with open(done_file(args, name, user), "wb") as f:
        pickle.dump({"args": resume_key(args), "adapter": digest, "tau": tau}, f)


def done_file(args, name: str, user: str) -> str:
    return out_file(args, "done/", f"{name} @ {user}", ".pkl")


def adapter_digest(name: str, args) -> str | None:
    """sha256 of the agent's adapter files (adapter_*), so that an adapter trained again at the same path, e.g.
    runs/rl/adapter after another rl.py run, is evaluated again, not read back. None: no adapter (base, openai:)."""
    adapter = adapter_of(name, args)
    if adapter is None or not os.path.isdir(adapter):
        return None
    digest = hashlib.sha256()
    for file in sorted(f for f in os.listdir(adapter) if f.startswith("adapter_")):
        digest.update(file.encode() + b"\0")
        with open(os.path.join(adapter, file), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def resume_key(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in RESUME_FREE}


def main(argv=None):
    args = parse_args(argv)                 # bad input: one line, exit 2, before anything loads
    common.start_run(args, args.out)
    if torch.cuda.is_available():           # the memory plan, before anything loads; one that cannot fit stops
        common.say_memory_plan(args, rollout.model_config(args.model or rollout.DEFAULT_MODEL),
                               torch.cuda.get_device_properties(0).total_memory)
    os.makedirs(os.path.join(args.out, "done"), exist_ok=True)
    tasks = envs.held_out_tasks(args.domains.split(","), args.n_tasks, args.tiers.split(","), args.seed)
    user_specs, metrics, results = args.user.split(","), args.paired_metric.split(","), {}
    for spec in args.agents.split(","):
        name, agent = spec.strip(), None    # every agent meets every user: one label each, "agent @ user" if several
        digest = adapter_digest(name, args)  # before loading: an adapter rewritten meanwhile will not match it
        for user in user_specs:
            label = name if len(user_specs) == 1 else f"{name} @ {user}"
            if (tau := done_before(args, name, user, digest)) is not None:
                results[label] = {"tau": tau, "user": user}
                continue
            if agent is None:               # loaded only for what is left to evaluate
                if (built := build_agent(name, args)) is None:
                    break
                agent, tok, _ = built
            make_user = common.user_factory(args, *(rollout.load_model(args.model or rollout.DEFAULT_MODEL)   # local:
                                                    if user == "local" else ()), spec=user)   # the base model plays it
            print(f"== {label}: {len(tasks)} tasks x {args.trials} trials, user {user}")
            tau = evaluate(agent, tok, tasks, args.trials, make_user, seed=args.seed, max_turns=args.max_turns,
                           max_context=args.max_context, recheck=args.recheck, n_boot=args.n_boot,
                           user_workers=args.user_workers, price=args.user_price,
                           max_sim_failures=args.max_sim_failures)
            results[label] = {"tau": tau, "user": user}
            with open(out_file(args, "failures_", label, ".jsonl"), "w") as f:
                for rec in tau["failures"]:
                    f.write(json.dumps(rec) + "\n")
            save_episodes(out_file(args, "episodes_", label, ".jsonl"), label, tau.pop("episodes"))
            save_done(args, name, user, tau, digest)
            o, b = tau["overall"], tau["behaviour"]["all"]
            print(f"{label}: " + "  ".join(f"pass^{k} {v:.3f}" for k, v in o["pass^k"].items()) + "  " +
                  "  ".join(f"{METRICS[m]} {b[m]['mean']:.3f}" for m in METRICS if m != "pass1" and b[m]["mean"] is not None) +
                  f"  failures {len(tau['failures'])}  user-sim suspects {tau['user_sim_suspects']}/{tau['rechecked']}"
                  f"  simulator failures {tau['sim_failures']} ({tau['tasks_lost']} tasks left out)  stops {tau['stop_reasons']}"
                  f"  {tau['seconds']:.0f}s" + (f"  {llm_users.user_line(tau['users'])}" if tau["users"] else ""))
        del agent
    if not results:
        raise SystemExit("no agent to evaluate: check --agents and the adapter paths")
    for r in results.values():              # the failures live in their own files
        r["tau"]["n_failed"] = len(r["tau"].pop("failures"))
    gold_tok = rollout.load_tokenizer(args.model or rollout.DEFAULT_MODEL)   # the gold agent only counts tokens
    ceilings = {u: c for u in user_specs if (c := ceiling(gold_tok, tasks, u, args)) is not None}
    for u, c in ceilings.items():
        print(f"ceiling @ {u}: " + "  ".join(f"{METRICS[m]} {v['mean']:.3f}" for m, v in c["behaviour"]["all"].items()
                                              if v["mean"] is not None) + f"  longest episode {c['longest']} turns")
    pairs = {m: pair_up(results, {t.id: t.domain for t in tasks}, args.seed, m) for m in metrics}
    all_pairs = {m: overall | per_domain for m, (overall, per_domain) in pairs.items()}   # the plot: overall only
    table = markdown(results, all_pairs) + ceiling_markdown(ceilings) + paper_tables(results)
    print(table)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"agents": results, "paired": all_pairs, "ceiling": ceilings}, f, indent=2)
    plot(results, os.path.join(args.out, "eval.png"), pairs[metrics[0]][0], metrics[0])
    print(f"wrote {args.out}/results.md, results.json, eval.png")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
