"""The second claims experiment's tables, bar and picture (docs/results.md, "Pre-registered: the user in the loop,
second attempt"), from <out>/eval/results.json and each arm's metrics.jsonl. Run by scripts/claims.sh:

    python scripts/claims_report.py runs/claims2

Prints what is there; a cell whose evaluation has not run yet prints as "-" (the grid may run in pieces)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from eval import METRICS, paired_difference  # noqa: E402

ARMS = {"sft": "SFT, training personas (cold start of a, b)", "rl": "(a) RL, training personas",
        "rl_one": "(b) RL, one persona (default)", "sft_none": "SFT, no user (cold start of c)",
        "rl_none": "(c) RL, no user", "rl_base": "(d) RL from the base model"}
TRAIN = ["scripted:default", "scripted:terse", "scripted:chatty", "scripted:careless"]
HELDOUT = ["scripted:curious", "scripted:literal"]
POOLS = {"training personas": TRAIN, "held-out personas": HELDOUT, "no user": ["none"]}


def pooled(results, out, arm, users, metric):
    """{task: [its value under each of users]} of arm's adapter (pooled_agent)."""
    return pooled_agent(results, f"{out}/{arm}/adapter", users, metric)


def pooled_agent(results, agent, users, metric):
    """{task: [its value under each of users]} of one agent of an eval.py results.json: the users' episodes of a task
    kept together; None if any is missing (scripts/steps_report.py pools the same way)."""
    per_task = {}
    for u in users:
        r = results.get(f"{agent} @ {u}")
        if r is None:
            return None
        for task, values in r["tau"]["metrics"][metric].items():
            per_task.setdefault(task, []).extend(values)
    return per_task


def mean(per_task):
    vals = [v for vs in (per_task or {}).values() for v in vs if v is not None]
    return sum(vals) / len(vals) if vals else None


def show(p):
    return "-" if p is None else (f"{p['diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] ({p['only_a']} won, "
                                  f"{p['only_b']} lost)")


def num(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def clip(m) -> str:
    """A step's clip: the share of trained tokens where it binds (clip_binds, the advantage's side), or, in records
    from before that was counted, the share whose ratio left the band on either side (clip_frac)."""
    if "clip_binds" in m:
        return f"clip binds {num(m['clip_binds'])}"
    return f"ratio out of the band {num(m.get('clip_frac'))}"


def rl_minutes(out, arm):
    path = os.path.join(out, arm, "metrics.jsonl")
    if not os.path.exists(path):
        return None, None
    ms = [json.loads(line) for line in open(path)]
    return sum(m.get("s_per_step", m.get("eval_s", 0)) for m in ms) / 60, ms


def main(out):
    out = out.rstrip("/")
    path = os.path.join(out, "eval", "results.json")
    saved = json.load(open(path)) if os.path.exists(path) else {"agents": {}, "ceiling": {}}
    results = saved["agents"]
    diff = lambda a, b, users, m: (lambda x, y: x and y and paired_difference(x, y))(   # noqa: E731
        pooled(results, out, a, users, m), pooled(results, out, b, users, m))
    for pool, users in POOLS.items():
        print(f"\n{pool} ({', '.join(users)}), each task's episodes pooled:")
        print("| agent | " + " | ".join(METRICS.values()) + " |\n|---|" + "---|" * len(METRICS))
        for arm, label in ARMS.items():
            print(f"| {label} | " + " | ".join(num(mean(pooled(results, out, arm, users, m))) for m in METRICS) + " |")
        for u in users:
            c = saved["ceiling"].get(u)
            if c:
                print(f"| ceiling @ {u} (gold agent) | " + " | ".join(num(c["behaviour"]["all"][m]["mean"])
                                                                     for m in METRICS) + " |")
    print("\nper persona, pass^1:")
    print("| agent | " + " | ".join(TRAIN + HELDOUT + ["none"]) + " |\n|---|" + "---|" * 7)
    for arm, label in ARMS.items():
        print(f"| {label} | " + " | ".join(num(mean(pooled(results, out, arm, [u], "pass1")))
                                           for u in TRAIN + HELDOUT + ["none"]) + " |")
    print("\nRL - its cold start, paired (pass^1; facts asked for):")
    for rl, sft in (("rl", "sft"), ("rl_one", "sft"), ("rl_none", "sft_none")):
        for pool, users in POOLS.items():
            print(f"  {ARMS[rl]} - {ARMS[sft]}, {pool}: {show(diff(rl, sft, users, 'pass1'))}; "
                  f"{show(diff(rl, sft, users, 'facts_asked'))}")
    print("\n(a) - each other arm, paired (pass^1; facts asked for): vary the user (b), the user in the loop (c), "
          "the cold start (d):")
    for other in ("rl_one", "rl_none", "rl_base"):
        for pool, users in POOLS.items():
            print(f"  {ARMS['rl']} - {ARMS[other]}, {pool}: {show(diff('rl', other, users, 'pass1'))}; "
                  f"{show(diff('rl', other, users, 'facts_asked'))}")
    print("\nRL runs:")
    for arm in ("rl", "rl_one", "rl_none", "rl_base"):
        minutes, ms = rl_minutes(out, arm)
        if ms:
            step = [m for m in ms if "reward" in m]
            print(f"  {ARMS[arm]}: {minutes:.1f} min; " + "; ".join(
                f"step {m['step']}: reward {m['reward']:.3f}, groups with variance {m['groups_varied']} of "
                f"{m['groups_drawn']}, trained {m['groups_trained']}, {clip(m)}, kl "
                f"{'-' if m['kl'] is None else format(m['kl'], '.5f')}"
                for m in step) + "; held-out curve " + " -> ".join(
                json.dumps(m["heldout_by_user"]) for m in ms if "heldout_by_user" in m))
    p1, facts, vary = (diff("rl", "sft", HELDOUT, "pass1"), diff("rl", "sft", HELDOUT, "facts_asked"),
                       diff("rl", "rl_one", HELDOUT, "pass1"))
    minutes = {arm: rl_minutes(out, arm)[0] for arm in ("rl", "rl_one", "rl_none", "rl_base")}
    print("\nthe bar (held-out personas, curious and literal pooled):")
    print(f"  RL(a) - SFT, pass^1: {show(p1)} (>= +0.10, CI above 0): "
          + ("-" if p1 is None else "MET" if p1["diff"] >= 0.10 and p1["ci"][0] > 0 else "MISSED"))
    print(f"  RL(a) - SFT, facts asked for: {show(facts)} (>= +0.10): "
          + ("-" if facts is None else "MET" if facts["diff"] >= 0.10 else "MISSED"))
    print(f"  RL(a) - RL(b), pass^1 (vary the user; no threshold): {show(vary)}")
    print("  RL minutes (<= 30 each): " + ", ".join(f"{a} {num(m) if m is None else f'{m:.1f}'}"
                                                    for a, m in minutes.items()))
    picture(results, out)


def picture(results, out):
    """pass^1 of each agent under the training personas, the held-out ones and no user: one bar each, labelled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 4.6))
    colors = ["#9ecae1", "#2171b5", "#6baed6", "#fdbe85", "#d94801", "#74c476"]
    for j, ((arm, label), color) in enumerate(zip(ARMS.items(), colors)):
        xs = [i + (j - 2.5) * 0.14 for i in range(len(POOLS))]
        ys = [mean(pooled(results, out, arm, users, "pass1")) for users in POOLS.values()]
        ax.bar(xs, [y or 0 for y in ys], 0.13, color=color, label=label)
        for x, y in zip(xs, ys):
            ax.text(x, (y or 0) + 0.015, "n/a" if y is None else f"{y:.2f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(POOLS)), [f"evaluated with\n{p}" if p == "no user" else f"evaluated under the\n{p}"
                                      for p in POOLS])
    ax.set(ylabel="pass^1", ylim=(0, 1.08), title="30 held-out medium tasks (seed 12), retail + airline, greedy")
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=3, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(os.path.join(out, "claims.png"), dpi=110)
    print(f"picture: {os.path.join(out, 'claims.png')}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/claims2")
