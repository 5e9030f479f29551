"""The K-step result (docs/steps_preregistration.md): the bar, the paired table and the picture, from
<out>/<eval>/results.json, <out>/rl/metrics.jsonl and each step's /usr/bin/time record. Run by scripts/steps.sh:

    python scripts/steps_report.py runs/steps 4            (the first attempt's evaluation, <out>/eval)
    python scripts/steps_report.py runs/steps 8 eval2      (the second's)

Prints what is there; an agent or user not yet evaluated prints as "-"."""
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from claims_report import clip, mean, num  # noqa: E402
from claims_report import pooled_agent as pooled  # noqa: E402
from common import figure, save_figure  # noqa: E402
from eval import METRICS, paired_difference  # noqa: E402

POOLS = {"held-out personas (curious, literal; each task under each)": ["scripted:curious", "scripted:literal"],
         "training personas (one drawn per conversation)": ["scripted:train"]}
HELDOUT, TRAIN = POOLS


def show(p):
    return "-" if p is None else (f"{p['diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] ({p['only_a']} won, "
                                  f"{p['only_b']} lost, p = {p['mcnemar_p']:.3f})")


def step_records(out, K):
    """Per step of <out>/rl/metrics.jsonl: its metrics (the step line and the curve after it), and the wall seconds
    and peak GiB of its rl.py process (the curve before step 1 ran in step 1's process)."""
    path = os.path.join(out, "rl", "metrics.jsonl")
    ms = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    steps = {m["step"]: m for m in ms}
    for k in range(1, K + 1):
        record = os.path.join(out, "rl", f"time-step-{k}.txt")
        if k in steps and os.path.exists(record):
            text = open(record).read()
            h, m_, s = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", text).groups()
            steps[k]["process_s"] = int(h or 0) * 3600 + int(m_) * 60 + float(s)
            steps[k]["peak_gib"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)[1]) / 2**20
    return steps


def print_steps(steps):
    """A line a step (reward, groups, kl, clip, the questions a conversation asked again, seconds, the process's time
    and peak, the curve where it ran), and under it the reward, asking rate and questions asked again per training
    user (rl.py's by_user: the named personas, or a population's behaviour values), so a slide under one kind of user
    shows step by step. Records from before repeated_questions was counted print "-" for it."""
    for k, m in sorted(steps.items()):
        curve = ", ".join(f"{v:.3f} {u}" for u, v in m.get("heldout_by_user", {}).items())
        if k == 0:
            print(f"  step 0: curve {curve}")
            continue
        process = (f"process {m['process_s']:.0f} s, peak {m['peak_gib']:.1f} GiB" if "process_s" in m
                   else "no time record")                  # /usr/bin/time -v's, where the run kept one
        print(f"  step {k}: reward {m['reward']:.3f}, groups with signal {m['groups_varied']} of {m['groups_drawn']}, "
              f"kl {num(m['kl'], '.5f')}, {clip(m)}, asked again "
              f"{num(m.get('repeated_questions'), '.2f')} a conversation, rollouts {m['rollout_s']:.0f} s, update "
              f"{m['train_s']:.0f} s, step {m['s_per_step']:.0f} s; {process}" + (f"; curve {curve}" if curve else ""))
        by = m.get("by_user") or {}                        # the named personas, or a population's values
        if by:
            named = {u: v for u, v in by.items() if "=" not in u} or by
            print("    by user, reward / asked before writing / asked again (n): " + ", ".join(
                f"{u} {v['reward']:.2f} / {num(v['asked'], '.2f')} / {num(v.get('repeated'), '.1f')} ({v['n']})"
                for u, v in named.items()))


def main(out, K, evaluation="eval"):
    out = out.rstrip("/")
    path, args = (os.path.join(out, evaluation, f) for f in ("results.json", "args.json"))
    results = json.load(open(path))["agents"] if os.path.exists(path) else {}
    seed = json.load(open(args))["seed"] if os.path.exists(args) else "-"
    evaluated = [k for k in range(1, K + 1) if any(a.startswith(f"{out}/step-{k} @ ") for a in results)]
    agents = {"SFT (the cold start)": f"{out}/sft/adapter"}   # then each step evaluated (1 and K before any record)
    for k in evaluated or sorted({1, K}):
        agents[f"RL, step {k} (the default)" if k == 1 else f"RL, step {k}"] = f"{out}/step-{k}"
    sft = agents["SFT (the cold start)"]

    def diff(a, users, metric="pass1"):
        x, y = pooled(results, a, users, metric), pooled(results, sft, users, metric)
        return x and y and paired_difference(x, y)

    steps = step_records(out, K)
    print("the run, a step a line (the curve: greedy pass^1 on 8 held-out tasks under each user set):")
    print_steps(steps)
    for pool, users in POOLS.items():
        print(f"\n{pool}, 40 tasks of seed {seed} (each task's episodes pooled):")
        print("| agent | " + " | ".join(METRICS.values()) + " | - SFT, pass^1 [95% CI] |\n|---|"
              + "---|" * (len(METRICS) + 1))
        for label, a in agents.items():
            print(f"| {label} | " + " | ".join(num(mean(pooled(results, a, users, m))) for m in METRICS) + " | "
                  + ("" if a == sft else show(diff(a, users))) + " |")
    where_it_fails(results, agents)
    last = agents[list(agents)[-1]]
    held, train = diff(last, POOLS[HELDOUT]), diff(last, POOLS[TRAIN])
    print(f"\nthe bar (RL after {K} steps - SFT, pass^1):")
    print(f"  held-out personas: {show(held)} (>= +0.10, CI above 0): "
          + ("-" if held is None else "MET" if held["diff"] >= 0.10 and held["ci"][0] > 0 else "MISSED"))
    print(f"  training personas: {show(train)} (not below 0): "
          + ("-" if train is None else "MET" if train["diff"] >= 0 else "MISSED"))
    finals = {label: [mean(pooled(results, a, users, "pass1")) for users in POOLS.values()]
              for label, a in agents.items()}
    picture(os.path.join(out, evaluation, "steps.png"), steps, finals, held, K)


def where_it_fails(results, agents):
    """pass^1 of each agent under each user, a domain at a time, and how its episodes stopped: which personas and
    tasks the steps move, and whether the failures run out of turns (max_turns) or end on a wrong state."""
    users = [u for pool in POOLS.values() for u in pool]
    print("\nby user and domain (pass^1 retail / airline; how the episodes stopped):")
    print("| agent | " + " | ".join(users) + " |\n|---|" + "---|" * len(users))
    for label, a in agents.items():
        cells = []
        for u in users:
            r = results.get(f"{a} @ {u}", {}).get("tau")
            if r is None:
                cells.append("-")
                continue
            by = [num(r["per_domain"][d]["pass^k"]["1"]) for d in ("retail", "airline") if d in r["per_domain"]]
            stops = ", ".join(f"{k} {v}" for k, v in sorted(r["stop_reasons"].items()))
            cells.append(f"{' / '.join(by)} ({stops})")
        print(f"| {label} | " + " | ".join(cells) + " |")


def picture(path, steps, finals, held, K):
    """Left: the curve over the K steps under each user set; right: the paired evaluation's pass^1 of each agent."""
    fig, (left, right) = figure(2, (11, 3.8))
    users = sorted({u for m in steps.values() for u in m.get("heldout_by_user", {})})
    for u in users:
        points = [(k, m["heldout_by_user"][u]) for k, m in sorted(steps.items()) if u in m.get("heldout_by_user", {})]
        left.plot(*zip(*points), marker="o", label=f"under {u}")
    left.set(title="held-out pass^1 during the run (8 tasks)", xlabel="GRPO step", ylim=(-0.02, 1.05),
             xticks=range(K + 1))
    left.legend(fontsize=8, loc="lower right")
    for j, (label, ys) in enumerate(finals.items()):
        xs = [i + (j - (len(finals) - 1) / 2) * 0.25 for i in range(len(POOLS))]
        right.bar(xs, [y or 0 for y in ys], 0.23, label=label)
        for x, y in zip(xs, ys):
            right.text(x, (y or 0) + 0.015, "n/a" if y is None else f"{y:.2f}", ha="center", fontsize=7)
    right.set_xticks(range(len(POOLS)), [p.split(" (")[0] for p in POOLS])
    right.set(ylabel="pass^1", ylim=(0, 1.22), title=f"40 fresh tasks, paired: step {K} - SFT under the held-out "
              f"personas {'-' if held is None else format(held['diff'], '+.2f')} [" + (
                  "-, -]" if held is None else f"{held['ci'][0]:+.2f}, {held['ci'][1]:+.2f}]"))
    right.title.set_fontsize(9)
    right.legend(fontsize=7, loc="upper center", ncol=len(finals))      # above the bars
    save_figure(fig, path, dpi=100)
    print(f"picture: {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/steps", int(sys.argv[2]) if len(sys.argv) > 2 else 4,
         sys.argv[3] if len(sys.argv) > 3 else "eval")
