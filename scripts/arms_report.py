"""The third and fourth attempts' result (docs/steps_preregistration.md): the bar, the 2x2 table (narrow and broad
training users x SFT and RL, under the held-out and the training users, with 95% CIs), every effect per held-out
persona as well as pooled, and per domain, each arm's steps with their time, peak and per-user training numbers,
and the picture; from <out>/eval/results.json and <out>/<arm>/rl/. Run by scripts/arms.sh:

    python scripts/arms_report.py runs/arms 8

Prints what is there; an agent or user not yet evaluated prints as "-"."""
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from claims_report import mean, num  # noqa: E402
from claims_report import pooled_agent as pooled  # noqa: E402
from steps_report import print_steps, show, step_records  # noqa: E402
from common import figure, save_figure  # noqa: E402
from eval import METRICS, paired_difference  # noqa: E402

HELDOUT = ["scripted:curious", "scripted:literal"]
POOLS = {"held-out personas (curious, literal; each task under each)": HELDOUT,
         "training personas (one drawn per conversation)": ["scripted:train"],
         "training population (a row drawn per conversation)": ["scripted:population"]}
SINGLE = {f"held-out: {u.split(':')[1]}": [u] for u in HELDOUT}        # each held-out persona alone
ARMS = {"narrow": "narrow (the four training personas)", "broad": "broad (the training population)"}


def agents_of(out, K):
    """(arm, stage) -> the adapter evaluated: the four --agents of <out>/eval/args.json in scripts/arms.sh's order
    (broad SFT, broad RL, narrow SFT, narrow RL), so published copies evaluated with AGENTS= report alike; before
    an evaluation, each arm's own folders under <out>."""
    path = os.path.join(out, "eval", "args.json")
    keys = [(arm, stage) for arm in ("broad", "narrow") for stage in ("SFT", "RL")]
    given = dict(zip(keys, json.load(open(path))["agents"].split(","))) if os.path.exists(path) else {}
    own = {"SFT": "sft/adapter", "RL": f"step-{K}"}
    return {(arm, stage): given.get((arm, stage)) or f"{out}/{arm}/{own[stage]}" for arm in ARMS for stage in own}


def ci_of_mean(per_task, n_boot=10000, seed=0):
    """The mean of a metric over tasks (each task's episodes averaged first) and its bootstrap 95% CI over tasks."""
    if not per_task:
        return None
    xs = [sum(v) / len(v) for v in per_task.values() if v]
    rng = random.Random(seed)
    boot = sorted(sum(rng.choices(xs, k=len(xs))) / len(xs) for _ in range(n_boot))
    return sum(xs) / len(xs), boot[int(0.025 * n_boot)], boot[int(0.975 * n_boot) - 1]


def in_domain(per_task, domain):
    """The tasks of one domain (a task id starts with its domain: "retail-test-00001")."""
    return per_task and {t: v for t, v in per_task.items() if t.startswith(domain + "-")} or None


def cell(per_task):
    m = ci_of_mean(per_task)
    return "-" if m is None else f"{m[0]:.3f} [{m[1]:.3f}, {m[2]:.3f}]"


def main(out, K):
    out = out.rstrip("/")
    path = os.path.join(out, "eval", "results.json")
    results = json.load(open(path))["agents"] if os.path.exists(path) else {}
    agents = agents_of(out, K)

    def diff(a, b, users, metric="pass1"):
        x, y = pooled(results, agents[a], users, metric), pooled(results, agents[b], users, metric)
        return x and y and paired_difference(x, y)

    for arm, label in ARMS.items():
        steps = step_records(os.path.join(out, arm), K)
        print(f"\nthe {label} arm, a step a line:")
        print_steps(steps)

    print(f"\nthe 2x2: pass^1 [95% CI over tasks], SFT and step {K} of each arm")
    for pool, users in {**POOLS, **SINGLE}.items():
        print(f"\n{pool}:")
        print("| training users | SFT | RL | RL - SFT [paired 95% CI] |\n|---|---|---|---|")
        for arm, label in ARMS.items():
            sft, rl = (pooled(results, agents[arm, s], users, "pass1") for s in ("SFT", "RL"))
            print(f"| {label} | {cell(sft)} | {cell(rl)} | {show(diff((arm, 'RL'), (arm, 'SFT'), users))} |")
        for stage in ("SFT", "RL"):
            print(f"| broad - narrow, {stage} | | | {show(diff(('broad', stage), ('narrow', stage), users))} |")

    print("\nper domain (RL's habits carry across domains: one LoRA serves both), pass^1 SFT -> RL and RL - SFT:")
    print("| users | domain | narrow | narrow RL - SFT | broad | broad RL - SFT |\n|---|---|---|---|---|---|")
    for pool, users in {**SINGLE, "training personas": ["scripted:train"]}.items():
        for domain in ("retail", "airline"):
            row = []
            for arm in ARMS:
                sft, rl = (in_domain(pooled(results, agents[arm, s], users, "pass1"), domain) for s in ("SFT", "RL"))
                row += [f"{num(mean(sft))} -> {num(mean(rl))}", show(sft and rl and paired_difference(rl, sft))]
            print(f"| {pool} | {domain} | " + " | ".join(row) + " |")

    print("\nevery metric, pooled per user set (each task's episodes pooled):")
    for pool, users in POOLS.items():
        print(f"\n{pool}:")
        print("| agent | " + " | ".join(METRICS.values()) + " |\n|---|" + "---|" * len(METRICS))
        for (arm, stage), a in agents.items():
            print(f"| {arm} {stage} | " + " | ".join(num(mean(pooled(results, a, users, m))) for m in METRICS) + " |")

    held, train = (diff(("broad", "RL"), ("broad", "SFT"), POOLS[p]) for p in list(POOLS)[:2])
    print(f"\nthe bar (broad RL after {K} steps - broad SFT, pass^1):")
    print(f"  held-out personas: {show(held)} (>= +0.10, CI above 0): "
          + ("-" if not held else "MET" if held["diff"] >= 0.10 and held["ci"][0] > 0 else "MISSED"))
    print(f"  training personas: {show(train)} (not below 0): "
          + ("-" if not train else "MET" if train["diff"] >= 0 else "MISSED"))
    print("beside it, no threshold (held-out personas): broad - narrow, SFT "
          f"{show(diff(('broad', 'SFT'), ('narrow', 'SFT'), HELDOUT))}; RL "
          f"{show(diff(('broad', 'RL'), ('narrow', 'RL'), HELDOUT))}")
    picture(os.path.join(out, "eval", "arms.png"), results, agents, K)


def picture(path, results, agents, K):
    """pass^1 of the four agents under each user set, with the 95% CI over tasks."""
    fig, axes = figure(len(POOLS) + len(SINGLE) - 1, (13, 3.6))
    sets = {"held-out (both)": HELDOUT, **{k.split(": ")[1]: v for k, v in SINGLE.items()},
            "training personas": ["scripted:train"]}
    for ax, (title, users) in zip(axes, sets.items()):
        for j, ((arm, stage), a) in enumerate(agents.items()):
            m = ci_of_mean(pooled(results, a, users, "pass1"))
            y, lo, hi = m if m else (0, 0, 0)
            ax.bar(j, y, 0.7, yerr=[[y - lo], [hi - y]], capsize=3, color=("C0" if arm == "narrow" else "C1"),
                   alpha=0.5 if stage == "SFT" else 1.0)
            ax.text(j, hi + 0.02, "n/a" if not m else f"{y:.2f}", ha="center", fontsize=7)
        ax.set_xticks(range(len(agents)), [f"{arm}\n{stage}" for arm, stage in agents], fontsize=7)
        ax.set(title=title, ylim=(0, 1.15))
        ax.title.set_fontsize(9)
    axes[0].set_ylabel(f"pass^1 (SFT, step {K})")
    save_figure(fig, path, dpi=100)
    print(f"picture: {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/arms", int(sys.argv[2]) if len(sys.argv) > 2 else 8)
