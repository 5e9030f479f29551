"""Evaluation: pass^k on held-out tasks (base vs SFT vs RL), BFCL-v3 multi-turn offline, failures.

What it does
  1. pass^k on the held-out test split of envs.py (retail, airline; or τ²-bench's own), tau-bench's definition:
     pass^k = mean over tasks of C(c, k) / C(n, k), where c of n trials succeeded (reward 1.0),
     with a bootstrap 95% CI over tasks, overall, per domain and per scenario. All trials of all
     tasks go through ONE rollout.run_episodes call (the same loop and user simulators as training).
  2. BFCL-v3 multi-turn, offline, from the `bfcl-eval` package: its four categories (base, miss_func,
     miss_param, long_context; the paper's "BFCL-V3 Multi Turn" is all four), its
     per-turn user queries as the user's messages, its simulated API classes executing the model's
     calls, and its own multi-turn checker (state + execution-result checks after every turn).
  3. Beside pass^1: the episodes whose first write came after asking to confirm, and how episodes ended
     (the user's stop, or the turn cap, which scores 0 as in τ²-bench: envs.Env.reward).
  4. Failure analysis: every failed episode's DB diff goes to failures.jsonl; failed tasks are re-run
     with another user seed and flagged `user_sim_suspect` if they then succeed (tau2-bench found
     user-simulator errors behind up to 30% of retail failures).

Run
  python eval.py                                  # base, SFT (runs/sft/adapter), RL (runs/rl/adapter): whichever exist
  python eval.py --agents base,rl --trials 4      # pick agents; an adapter dir path also works as an agent
  python eval.py --agents openai:gpt-4o-mini --openai-base-url http://localhost:8000/v1   # any endpoint
  python eval.py --user openai:gpt-4o             # the paper's LLM user instead of the scripted one
  python eval.py --domains tau2-retail,tau2-airline,tau2-telecom --user openai:gpt-4o   # τ²-bench's test split
  python eval.py --bfcl 20                        # also BFCL multi-turn: the first 20 entries of each category
  python eval.py --smoke --out /tmp/eval          # tiny, < 2 min on CPU (tests/test_eval.py)
  Writes under --out (default runs/eval): args.json, results.json, results.md, eval.png,
  failures_<agent>.jsonl, episodes_<agent>.jsonl, bfcl_<agent>.jsonl. `python viewer.py runs/eval` shows
  the episodes as one page, and the tasks one agent solved and another did not, side by side.
  BFCL needs `pip install --no-deps bfcl-eval==2026.3.23` (its full dependency tree would downgrade
  numpy; the data, API classes and checker need only filelock and mpmath, which torch brings).

Simplifications vs the paper
  * our procedural retail/airline domains by default, scripted user; τ²-bench itself with
    --domains tau2-retail,tau2-airline,tau2-telecom --user openai:MODEL (its test split, its evaluators;
    tau2_domains.py), printed beside the paper's Qwen3-8B and MUA-RL-8B pass^1;
  * CPU preset: few tasks and trials, short turns (see CPU_PRESET); the GPU defaults are larger;
  * BFCL: tools are given as OpenAI-style schemas without BFCL's "response"
    field (saves ~25% context; still 3-5k tokens, so on 2 CPU cores an entry takes minutes: off by
    default); at most --bfcl-steps agent steps per turn (BFCL: 20), more is a force-terminated entry
    as in BFCL; all calls of a step are executed, as BFCL does. Our Hermes calls become BFCL's
    python-call strings in BFCL's own format (its convert_to_function_call lives in a module that
    imports tree-sitter, so to_python_call writes the same one line instead of adding 4 packages);
  * the agent decodes greedily by default (--temperature 0), as tau-bench runs its agents; trials
    then differ by the user's seed (the scripted user varies its phrasing), so pass^k measures
    consistency across users. With --temperature > 0, user_sim_suspect also catches agent sampling
    luck: read it as "failed, yet solvable with another user", then look at the transcripts;
  * besides pass^k, the table counts the agent's tool calls per agent turn (ok = executed without
    error, err = the env refused it, malformed = not parseable): a format learned shows there first;
    and the episodes whose first write came after a request to confirm (asked_before_writing), which
    the reward does not check.
"""
import itertools
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict

import torch

import common
import envs
import rollout
import sampler
import users
import worlds

GPU_DEFAULTS = dict(n_tasks=24, trials=4, tiers="easy,medium,hard", max_turns=30, max_new_tokens=256,
                    max_context=8192, recheck=16, bfcl_steps=20)
# CPU: the tier the CPU presets of sft.py and rl.py train on, 24 held-out tasks per domain (48 in all, enough
# to tell two agents apart when they differ by ~0.15), greedy, one trial each; sized for a few minutes an agent
# on 2 cores; the episode limits rl.py's CPU preset trains with (common.CPU_LIMITS).
CPU_PRESET = dict(n_tasks=24, trials=1, tiers="easy", **common.CPU_LIMITS, recheck=0, bfcl_steps=4)
BFCL_CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
SMOKE = dict(n_tasks=1, trials=2, tiers="easy,medium,hard", max_turns=1, max_new_tokens=8, max_context=2048,
             recheck=1, bfcl_steps=1)


def parse_args(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", default="base,sft,rl",
                   help="comma list: base | sft | rl | an adapter dir | openai:MODEL (sft and rl are skipped when "
                        "their adapter does not exist)")
    common.add_model_args(p)
    common.add_user_args(p)
    p.add_argument("--sft-adapter", default="runs/sft/adapter", help="adapter dir used for agent 'sft'")
    p.add_argument("--rl-adapter", default="runs/rl/adapter", help="adapter dir used for agent 'rl'")
    p.add_argument("--openai-base-url", default=None, help="base URL for openai:MODEL agents (default: OpenAI)")
    p.add_argument("--domains", default="retail,airline", help="comma-separated test domains (worlds.py)")
    p.add_argument("--n-tasks", type=int, default=None, help="held-out test tasks per domain (preset)")
    p.add_argument("--tiers", default=None, help="only test tasks of these tiers, comma-separated (preset: cpu easy)")
    p.add_argument("--trials", type=int, default=None, help="trials per task n; pass^k for k = 1..n (preset)")
    p.add_argument("--max-turns", type=int, default=None, help="agent turns per episode (preset)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per agent turn (preset)")
    p.add_argument("--max-context", type=int, default=None, help="episode token limit (preset)")
    p.add_argument("--temperature", type=float, default=0.0, help="agent temperature (0: greedy, as tau-bench; "
                   "training samples at 1.0)")
    p.add_argument("--recheck", type=int, default=None, help="failed tasks re-run with another user seed (preset; 0 = off)")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples for the CI")
    p.add_argument("--bfcl", type=int, default=0, help="BFCL multi-turn entries per category (4 of them) per agent (0 = skip)")
    p.add_argument("--bfcl-steps", type=int, default=None, help="max agent steps per BFCL turn (preset; BFCL 20)")
    p.add_argument("--seed", type=int, default=0, help="task generation and rollout seed")
    p.add_argument("--smoke", action="store_true", help="tiny run for tests (< 2 min on CPU)")
    p.add_argument("--out", default="runs/eval", help="output directory")
    args = p.parse_args(argv)
    common.fill_preset(args, SMOKE if args.smoke else GPU_DEFAULTS if torch.cuda.is_available() else CPU_PRESET)
    common.check_args(args, at_least=dict(n_tasks=1, trials=1, max_turns=1, max_new_tokens=1, max_context=2,
                                          recheck=0, n_boot=1, bfcl=0, bfcl_steps=1, user_workers=1),
                      finite=dict(temperature=(0, False)))
    for spec in args.agents.split(","):
        if spec not in ("base", "sft", "rl") and not spec.startswith("openai:") and \
                not os.path.isfile(os.path.join(spec, "adapter_config.json")):
            common.fail("--agents", f"{spec!r} is not base, sft, rl, openai:MODEL or an adapter dir")
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


def paired_difference(a: dict, b: dict, n_boot: int = 10000, seed: int = 0, alpha: float = 0.05) -> dict:
    """Agent a minus agent b, evaluated on the same tasks with the same user seeds (trial j of a task
    meets the same simulated user in both runs). pass^1 difference, a paired bootstrap CI over tasks
    (each resample keeps a task's a and b results together), and the exact McNemar test: of the
    episodes where exactly one agent succeeded, only_a went to a and only_b to b; under "no difference"
    each such episode is a fair coin, so p = P(a two-sided binomial tail at least that lopsided)."""
    if set(a) != set(b) or any(len(a[t]) != len(b[t]) for t in a):
        raise ValueError("paired comparison needs the same tasks and trials for both agents")
    ids = sorted(a)
    diffs = [sum((x >= 1) - (y >= 1) for x, y in zip(a[t], b[t])) / len(a[t]) for t in ids]
    rng = random.Random(seed)
    boot = sorted(sum(rng.choices(diffs, k=len(ids))) / len(ids) for _ in range(n_boot))
    only_a = sum(x >= 1 > y for t in ids for x, y in zip(a[t], b[t]))
    only_b = sum(y >= 1 > x for t in ids for x, y in zip(a[t], b[t]))
    n = only_a + only_b
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2 ** n) if n else 1.0
    return {"diff": sum(diffs) / len(ids), "ci": [boot[int(alpha / 2 * n_boot)], boot[int((1 - alpha / 2) * n_boot) - 1]],
            "only_a": only_a, "only_b": only_b, "mcnemar_p": p, "n_tasks": len(ids)}


# ----------------------------------------------------------------------------- agents

def build_agent(spec: str, args):
    """(agent, tokenizer, label) for one --agents entry, or None when its adapter does not exist."""
    if spec.startswith("openai:"):
        tok = rollout.load_tokenizer(args.model or rollout.DEFAULT_MODEL)   # only to count tokens
        return rollout.OpenAIAgent(tok, spec.split(":", 1)[1], args.openai_base_url, temperature=args.temperature), tok, spec
    adapter = {"base": None, "sft": args.sft_adapter, "rl": args.rl_adapter}.get(spec, spec)
    if adapter is not None and not os.path.exists(os.path.join(adapter, "adapter_config.json")):
        print(f"skipping agent {spec!r}: no adapter at {adapter}")
        return None
    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL, args.load_in_4bit)
    if adapter is not None:
        model = rollout.load_adapter(model, adapter)
    model.eval()
    agent = sampler.ModelAgent(model, tok, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                               kv_budget=int(args.kv_budget * 2**30) or None, thinking=args.thinking)
    return agent, tok, spec


# ----------------------------------------------------------------------------- pass^k evaluation

def evaluate(agent, tokenizer, tasks, trials: int = 2, user: str = "scripted", seed: int = 0,
             max_turns: int = 8, max_context: int = 3072, temperature: float = 0.0, max_new_tokens: int = 96,
             recheck: int = 0, n_boot: int = 1000, progress: bool = True, **user_kw) -> dict:
    """pass^k of `agent` (a rollout agent, or a model to wrap in ModelAgent) on `tasks`, `trials` each.

    Returns {"overall", "per_domain", "per_tier", "per_scenario"} summaries (see summarize), "rewards"
    {task_id: [r, ...]}, "failures" (one record per failed episode, DB diff included), "episodes" (every
    Trajectory, those that lost their simulator included),
    "stop_reasons", "calls" (agent turns; tool calls executed ok / refused by the env / malformed), "seconds".
    """
    if not hasattr(agent, "act"):
        agent = sampler.ModelAgent(agent, tokenizer, temperature=temperature, max_new_tokens=max_new_tokens)
    t0 = time.time()
    torch.manual_seed(seed)                 # run_episodes samples from torch's global RNG
    run = dict(user=user, max_turns=max_turns, max_context=max_context, progress=progress, **user_kw)
    every = rollout.run_episodes(agent, tokenizer, tasks, group_size=trials, seed=seed, **run)
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
    rerun = [tr for tr in rollout.run_episodes(agent, tokenizer, failed, group_size=1, seed=seed + 7919, **run)
             if not tr.failed] if failed else []
    rescued = {tr.task_id for tr in rerun if tr.reward >= 1.0}
    for f in failures:
        f["rechecked"] = any(t.id == f["task_id"] for t in failed)
        f["user_sim_suspect"] = f["task_id"] in rescued

    def per(attr):                          # {domain or scenario: summary of its tasks}
        groups = defaultdict(dict)
        for t in tasks:
            groups[getattr(t, attr)][t.id] = rewards[t.id]
        return {g: summarize(r, n_boot, seed) for g, r in sorted(groups.items())}
    asked = [a for a in map(asked_before_writing, trajs) if a is not None]
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
            "writes": {"episodes": len(asked), "asked_first": sum(asked)}, "seconds": time.time() - t0}


def save_episodes(path: str, agent: str, trajs):
    """Every episode of one agent, a Trajectory a line (token ids, masks, log-probs, messages, reward, diff, stop
    reason) with the agent's label: `python viewer.py OUT` shows them, and where the agents differ."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"agent": agent, **vars(t)}) + "\n" for t in trajs)


def asked_before_writing(traj) -> bool | None:
    """Did the agent ask the user to confirm before its first write call? None if it made no write call
    (or the domain has no write list: τ²). "Confirm before acting" is one of the behaviours MUA-RL's user
    in the loop is meant to teach, and the reward, a database check, does not see it: a write that skips
    the confirmation scores 1 when its values happen to be right. Only turns without an executed call
    count as asking: one that also calls a tool has acted before the user could answer. (A turn whose
    call was malformed counts by its text, though the env's error, not the user, answered it.)"""
    writes, asked = envs.WRITE_TOOLS.get(traj.domain), False
    if not writes:
        return None
    for m in traj.messages:
        if m["role"] != "assistant":
            continue
        call = (m.get("tool_calls") or [None])[0]              # the executed one (run_episodes: first only)
        if call and call["name"] in writes:
            return asked
        asked = asked or (not call and users.asks_confirmation(users.visible_text(m["content"])))
    return None


# ----------------------------------------------------------------------------- BFCL multi-turn (offline)

def _bfcl():
    """Import bfcl-eval's pieces we use (its import creates result/score dirs: keep them in our cache)."""
    os.environ.setdefault("BFCL_PROJECT_ROOT", os.path.join(rollout.CACHE_DIR, "bfcl"))
    try:
        from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
        from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry
    except ImportError as e:
        raise SystemExit(f"BFCL needs bfcl-eval ({e}): pip install --no-deps bfcl-eval==2026.3.23")
    return GORILLA_TO_OPENAPI, multi_turn_utils, multi_turn_checker, load_dataset_entry, load_ground_truth_entry


def load_bfcl(n: int, category: str = "multi_turn_base") -> tuple[list[dict], list[list[list[str]]]]:
    """The first n entries of a BFCL multi-turn category and their ground truth (per turn, python calls)."""
    *_, load_dataset_entry, load_ground_truth_entry = _bfcl()
    entries, truth = load_dataset_entry(category)[:n], load_ground_truth_entry(category)[:n]
    assert [e["id"] for e in entries] == [g["id"] for g in truth]
    return entries, [g["ground_truth"] for g in truth]


def bfcl_tools(entry: dict) -> list[dict]:
    """BFCL's function docs as OpenAI tool schemas (BFCL's Gorilla types mapped as its own converter does)."""
    to_openai, *_ = _bfcl()

    def cast(schema):
        schema = dict(schema)
        schema["type"] = to_openai.get(schema.get("type", "string"), "string")
        if "properties" in schema:
            schema["properties"] = {k: cast(v) for k, v in schema["properties"].items()}
        if "items" in schema:
            schema["items"] = cast(schema["items"])
        return schema
    return [{"type": "function", "function": {"name": f["name"], "description": f["description"],
                                              "parameters": cast(f["parameters"])}} for f in entry["function"]]


def to_python_call(call: dict, allowed: set[str]) -> str | None:
    """Hermes {"name", "arguments"} -> BFCL's python-call string `cd(folder='x')` (as BFCL's
    convert_to_function_call writes it), or None for a name/argument that is not a plain identifier
    of this entry's functions: BFCL's executor eval()s the string, so nothing else may get through."""
    name, args = call.get("name"), call.get("arguments")
    if name not in allowed or not isinstance(args, dict) or not all(str(k).isidentifier() for k in args):
        return None
    return f"{name}({','.join(f'{k}={v!r}' for k, v in args.items())})"


_RUN_IDS = itertools.count()


def _forget(name: str):
    """Drop the API instances BFCL's executor keeps in its module globals as `{name}_{entry id}_{class}_instance`."""
    _, utils, *_ = _bfcl()
    for key in [k for k in vars(utils) if k.startswith(name + "_")]:
        delattr(utils, key)


def bfcl_category(entry: dict) -> str:
    return entry["id"].rsplit("_", 1)[0]    # "multi_turn_miss_func_12" -> "multi_turn_miss_func", as BFCL reads it


def bfcl_score(entry: dict, decoded: list[list[list[str]]], truth: list[list[str]]) -> dict:
    """BFCL's multi-turn checker on one entry. decoded: per turn, per step, the python-call strings."""
    _, _, multi_turn_checker, *_ = _bfcl()
    if len(decoded) != len(truth):         # BFCL: force-terminated entries fail without a check
        return {"valid": False, "error_type": "multi_turn:force_terminated"}
    name = f"mua_{os.getpid()}_{next(_RUN_IDS)}"   # BFCL keeps API instances in globals keyed by this name
    try:
        return multi_turn_checker(decoded, truth, entry, bfcl_category(entry), name)
    finally:
        _forget(name)


BFCL_POLICY = "You are a helpful assistant. Complete the user's requests by calling the provided functions."


def run_bfcl(agent, tokenizer, entries: list[dict], max_steps: int = 4, max_context: int = 8192,
             progress: bool = True) -> list[dict]:
    """BFCL's multi-turn inference loop, batched over entries: each turn the user's query comes in,
    the agent calls functions (executed on BFCL's API classes) until it answers in text or runs out
    of steps. Returns per entry {"id", "decoded" (per turn, per step, python calls), "messages", ...}.
    miss_func: a turn whose functions BFCL held back brings them in the user's message, as BFCL's
    prompting handlers do (our system prompt is already in the cache); long_context: BFCL's long states."""
    _, utils, *_ = _bfcl()
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING as HELD
    fmt, name = getattr(agent, "fmt", None) or rollout.ChatFormat(tokenizer), f"mua_{os.getpid()}_{next(_RUN_IDS)}"
    max_new = getattr(agent, "max_new_tokens", 256)
    convs = []
    for e in entries:
        system = rollout.system_prompt(BFCL_POLICY, bfcl_tools(e))
        first = "\n".join(m["content"] for m in e["question"][0])
        convs.append({"entry": e, "ids": fmt.prompt_ids(system, first), "turn": 0, "steps": 0, "decoded": [[]],
                      "messages": [{"role": "system", "content": system}, {"role": "user", "content": first}],
                      "done": False, "reason": "", "allowed": {f["name"] for f in e["function"]}})
    rounds = 0
    while active := [c for c in convs if not c["done"]]:
        for c in active:
            if len(c["ids"]) + max_new > max_context:
                c["done"], c["reason"] = True, "context_limit"
        active = [c for c in active if not c["done"]]
        if not active:
            break
        outs = agent.act([(c["entry"], c["messages"], c["ids"]) for c in active])
        rounds += 1
        if progress:
            print(f"bfcl round {rounds}: {len(active)} active, turns {[c['turn'] for c in active]}")
        for c, (new_ids, _) in zip(active, outs):
            text = tokenizer.decode(new_ids[:-1] if new_ids and new_ids[-1] == fmt.end_of_turn_id else new_ids)
            c["ids"] = c["ids"] + list(new_ids)
            calls, _err = rollout.parse_tool_calls(text)
            c["messages"].append({"role": "assistant", "content": text, "tool_calls": calls})
            e = c["entry"]
            if calls:                       # execute every call of the step, as BFCL does
                strs = [to_python_call(call, c["allowed"]) for call in calls]
                ok = [s for s in strs if s is not None]
                results, _ = utils.execute_multi_turn_func_call(ok, e["initial_config"], e["involved_classes"],
                                                                name, e["id"], "long_context" in e["id"])
                it = iter(results)
                obs = "\n".join(next(it) if s else f"Error: unknown function or bad arguments in {call}"
                                for s, call in zip(strs, calls))
                if ok:
                    c["decoded"][-1].append(ok)
                c["steps"] += 1
                if c["steps"] <= max_steps:
                    c["messages"].append({"role": "tool", "content": obs})
                    c["ids"] += fmt.delta_ids("tool", obs)
                    continue
                c["done"], c["reason"] = True, "force_terminated"   # BFCL: too many steps fails the entry
                continue
            c["turn"] += 1                  # a text answer (or an unparsable one) ends the turn, as in BFCL
            if c["turn"] == len(e["question"]):
                c["done"], c["reason"] = True, "finished"
                continue
            query = "\n".join(m["content"] for m in e["question"][c["turn"]])
            held = e.get("missed_function", {}).get(str(c["turn"]))
            if held:                        # miss_func: the functions held back until this turn arrive now
                c["allowed"] |= {f["name"] for f in held}
                query = HELD.format(functions="\n".join(json.dumps(t) for t in bfcl_tools({"function": held})))
            c["steps"], c["decoded"] = 0, c["decoded"] + [[]]
            c["messages"].append({"role": "user", "content": query})
            c["ids"] += fmt.delta_ids("user", query)
    _forget(name)
    return [{"id": c["entry"]["id"], "decoded": c["decoded"], "reason": c["reason"], "messages": c["messages"]}
            for c in convs]


def evaluate_bfcl(agent, tokenizer, n: int, max_steps: int = 4, max_context: int = 8192, progress=True,
                  categories=BFCL_CATEGORIES) -> dict:
    """BFCL-v3 multi-turn as the paper reports it: the first n entries of each of its four categories (base,
    miss_func, miss_param, long_context), scored by BFCL's checker; accuracy per category and their mean."""
    entries, truth = [sum(x, []) for x in zip(*(load_bfcl(n, c) for c in categories))]
    t0 = time.time()
    runs = run_bfcl(agent, tokenizer, entries, max_steps, max_context, progress)
    records = []
    for e, gt, r in zip(entries, truth, runs):
        decoded = r["decoded"] if r["reason"] == "finished" else r["decoded"][:-1]   # unfinished -> force-terminated
        score = bfcl_score(e, decoded, gt)
        records.append({"id": e["id"], "valid": score["valid"], "error_type": score.get("error_type", ""),
                        "reason": r["reason"], "decoded": r["decoded"], "ground_truth": gt, "messages": r["messages"]})
    per = {c: [r["valid"] for r in records if bfcl_category(r) == c] for c in categories}
    per = {c: sum(v) / len(v) for c, v in per.items() if v}
    return {"n": len(records), "accuracy": sum(per.values()) / max(1, len(per)), "per_category": per,
            "records": records, "seconds": time.time() - t0}


# ----------------------------------------------------------------------------- report

def pair_up(results: dict, domain_of: dict, seed: int = 0) -> tuple[dict, dict]:
    """Every later agent against every earlier one ("rl - sft"), on all tasks; and, when the tasks span
    several domains, on each domain's tasks ("rl - sft (airline)"): RL trained on one domain can gain
    there and lose on another, which the overall difference averages away."""
    labels, domains = list(results), sorted(set(domain_of.values()))
    def pair(b, a, domain=None):            # on the tasks both agents kept (a lost simulator drops a task)
        both = set(results[a]["tau"]["rewards"]) & set(results[b]["tau"]["rewards"])
        keep = lambda rewards: {t: r for t, r in rewards.items() if t in both and domain in (None, domain_of[t])}  # noqa: E731
        return paired_difference(keep(results[b]["tau"]["rewards"]), keep(results[a]["tau"]["rewards"]), seed=seed)
    duos = [(b, a) for i, a in enumerate(labels) for b in labels[i + 1:]]
    return ({f"{b} - {a}": pair(b, a) for b, a in duos},
            {f"{b} - {a} ({d})": pair(b, a, d) for d in domains if len(domains) > 1 for b, a in duos})


def markdown(results: dict, pairs: dict | None = None) -> str:
    """Side-by-side table of every agent: pass^k overall with CI, pass^1 per domain, per tier and per scenario;
    then the paired comparisons (see paired_difference)."""
    agents = list(results)
    first = results[agents[0]]["tau"]
    ks = list(first["overall"]["pass^k"])
    groups = [(g, s) for key in ("per_domain", "per_tier") for g, s in first[key].items()]
    fmt = lambda s, k: f"{s['pass^k'][k]:.3f} [{s['ci'][k][0]:.2f}, {s['ci'][k][1]:.2f}]"
    counts = ", ".join(f"{g}: {s['n_tasks']}" for g, s in groups)
    lines = [f"Held-out test tasks: {first['overall']['n_tasks']} ({counts}), {first['overall']['trials']} trials "
             "each; pass^k with 95% bootstrap CI over tasks.", "",
             "| agent | " + " | ".join(f"pass^{k}" for k in ks) + " | " +
             " | ".join(f"{g} pass^1" for g, _ in groups) + " | tool calls ok / err / malformed per 100 "
             "turns | first write after asking to confirm | user-sim suspects | BFCL multi-turn (base / miss_func / miss_param / long_context: mean) |",
             "|---" * (len(ks) + len(groups) + 5) + "|"]
    for a in agents:
        tau, bfcl = results[a]["tau"], results[a].get("bfcl")
        row = [fmt(tau["overall"], k) for k in ks] + [fmt(tau[key][g], 1) for key in ("per_domain", "per_tier")
                                                      for g in first[key]]
        c = tau["calls"]
        row += [" / ".join(f"{100 * c[k] / max(1, c['turns']):.0f}" for k in ("ok", "err", "malformed")) +
                f" ({c['turns']} turns)"]
        w = tau["writes"]
        row += [f"{w['asked_first']} of {w['episodes']} episodes" if w["episodes"] else "-"]
        row += [f"{tau['user_sim_suspects']} of {tau['rechecked']} rechecked" if tau["rechecked"] else "-",
                " / ".join(f"{v:.3f}" for v in bfcl["per_category"].values()) +
                f": {bfcl['accuracy']:.3f} ({bfcl['n']} entries)" if bfcl else "-"]
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    if pairs:
        lines += ["", "Paired on the same tasks and user seeds: pass^1 difference with a 95% paired bootstrap CI "
                  "over tasks; McNemar exact test on the episodes where exactly one agent succeeded.", "",
                  "| comparison | difference | 95% CI | only the first solved | only the second solved | McNemar p |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {d['diff']:+.3f} | [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] | {d['only_a']} | "
                  f"{d['only_b']} | {d['mcnemar_p']:.4f} |" for name, d in pairs.items()]
    lines += ["", "| scenario | tasks | " + " | ".join(f"{a} pass^1" for a in agents) + " |",
              "|---" * (len(agents) + 2) + "|"]
    for s, summary in first["per_scenario"].items():
        lines.append(f"| {s} | {summary['n_tasks']} | " +
                     " | ".join(f"{results[a]['tau']['per_scenario'][s]['pass^k'][1]:.3f}" for a in agents) + " |")
    return "\n".join(lines) + "\n"


def paper_tables(results: dict) -> str:
    """Each benchmark world's comparison with the paper (τ², ACEBench), per agent; "" when none ran."""
    out = []
    for a, r in results.items():
        scores = {d: {**s, "pass1": s["pass^k"][1], "extras": r["tau"]["extras"].get(d, {})}
                  for d, s in r["tau"]["per_domain"].items()}
        text = worlds.reports(scores)
        out += [f"\n### {a}\n{text}"] if text else []
    return "".join(out)


def plot(results: dict, path: str, pairs: dict | None = None):
    """Three panels, each titled in one line: pass^1 of every agent with its 95% CI; pass^1 per domain; and each
    paired difference with its 95% paired CI (a point left of 0: the first agent did worse)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    short = lambda a: re.sub(r"^runs/(agents/)?|/adapter$", "", a)   # noqa: E731; runs/X/adapter -> X
    agents = list(results)
    domains = list(results[agents[0]]["tau"]["per_domain"])
    pairs = pairs or {}
    fig, axes = plt.subplots(1, 3 if pairs else 2, figsize=(13 if pairs else 9, 3.6),
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
               title="paired difference in pass^1 (95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)                 # bad input: one line, exit 2, before anything loads
    common.start_run(args, args.out)
    tasks = worlds.held_out_tasks(args.domains.split(","), args.n_tasks, args.tiers.split(","), args.seed)
    user_kw = common.user_kwargs(args)
    results = {}
    for spec in args.agents.split(","):
        built = build_agent(spec.strip(), args)
        if built is None:
            continue
        agent, tok, label = built
        if args.user == "local":            # a local HF-model user: the base model plays the user
            user_kw["model"], user_kw["tokenizer"] = rollout.load_model(args.model or rollout.DEFAULT_MODEL)
        print(f"== {label}: {len(tasks)} tasks x {args.trials} trials, user {args.user}")
        tau = evaluate(agent, tok, tasks, args.trials, args.user, args.seed, args.max_turns, args.max_context,
                       recheck=args.recheck, n_boot=args.n_boot, **user_kw)
        results[label] = {"tau": tau}
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
        with open(os.path.join(args.out, f"failures_{safe}.jsonl"), "w") as f:
            for rec in tau["failures"]:
                f.write(json.dumps(rec) + "\n")
        save_episodes(os.path.join(args.out, f"episodes_{safe}.jsonl"), label, tau.pop("episodes"))
        o = tau["overall"]
        print(f"{label}: " + "  ".join(f"pass^{k} {v:.3f}" for k, v in o["pass^k"].items()) +
              f"  failures {len(tau['failures'])}  user-sim suspects {tau['user_sim_suspects']}/{tau['rechecked']}"
              f"  simulator failures {tau['sim_failures']} ({tau['tasks_lost']} tasks left out)  stops {tau['stop_reasons']}  asked before writing {tau['writes']['asked_first']}/{tau['writes']['episodes']}"
              f"  {tau['seconds']:.0f}s")
        if args.bfcl:
            bfcl = evaluate_bfcl(agent, tok, args.bfcl, args.bfcl_steps, max(args.max_context, 8192))
            with open(os.path.join(args.out, f"bfcl_{safe}.jsonl"), "w") as f:
                for rec in bfcl["records"]:
                    f.write(json.dumps(rec) + "\n")
            results[label]["bfcl"] = {k: v for k, v in bfcl.items() if k != "records"}
            print(f"{label}: BFCL multi-turn {bfcl['per_category']}, mean {bfcl['accuracy']:.3f}, {bfcl['n']} entries "
                  f"({bfcl['seconds']:.0f}s)")
        del agent
    if not results:
        raise SystemExit("no agent to evaluate: check --agents and the adapter paths")
    for r in results.values():              # the failures live in their own files
        r["tau"]["n_failed"] = len(r["tau"].pop("failures"))
    pairs, domain_pairs = pair_up(results, {t.id: t.domain for t in tasks}, args.seed)
    all_pairs = pairs | domain_pairs       # the plot shows the overall ones only
    table = markdown(results, all_pairs) + paper_tables(results)
    print(table)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"agents": results, "paired": all_pairs}, f, indent=2)
    plot(results, os.path.join(args.out, "eval.png"), pairs)
    print(f"wrote {args.out}/results.md, results.json, eval.png")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
