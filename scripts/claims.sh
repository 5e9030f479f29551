#!/usr/bin/env bash
# The user in the loop as matched experiments (docs/results.md, "Pre-registered: the user in the loop"), end to end:
#   1. two cold starts on the same 40 train tasks: with the scripted user, and without one (sft.py --user none)
#   2. one GRPO step of the CPU preset from each, on retail and airline, each with the user it was made with
#   3. all four agents on 60 held-out tasks of seed 11, each evaluated with the scripted user, with none, and with
#      the persona no training uses (scripted:curious), paired on the correct end state, pass^1 and behaviour
#   4. the 2 x 2, the unseen-user row, the per-domain gains and the pre-registered bar, printed from results.json,
#      and one picture of both metrics, <out>/claims.png
# Each step is skipped when its output exists; after a kill, sft.py and rl.py resume from their checkpoints and
# eval.py from each agent-and-user evaluation it finished.
# Alone on 2 CPU cores: about 4 hours (2 x ~20 min SFT, 2 x ~30-36 min RL; an agent on 60 tasks: ~12 min with the
# scripted user, 10-16 with none, ~6 with the persona, as measured).
# Run from the repository root:   bash scripts/claims.sh     (PYTHON=.venv/bin/python OUT=runs/claims by default)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/claims}
done_() { [ -f "$1" ] && echo "skip: $1 exists"; }

for arm in user none; do          # the arm's user: "scripted" for user, "none" for none
  done_ "$OUT/sft_$arm/adapter/adapter_config.json" || "$PY" sft.py --user "${arm/user/scripted}" --out "$OUT/sft_$arm"
done
for arm in user none; do
  done_ "$OUT/rl_$arm/adapter/adapter_config.json" || "$PY" rl.py --domains retail,airline --user "${arm/user/scripted}" \
      --init "$OUT/sft_$arm/adapter" --out "$OUT/rl_$arm"
done
done_ "$OUT/eval/results.json" || "$PY" eval.py \
    --agents "$OUT/sft_user/adapter,$OUT/rl_user/adapter,$OUT/sft_none/adapter,$OUT/rl_none/adapter" \
    --user scripted,none,scripted:curious --domains retail,airline --n-tasks 30 --seed 11 \
    --paired-metric correct_state,pass1,finished,asked_first,facts_asked --out "$OUT/eval"

"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
r = json.load(open(os.path.join(out, "eval", "results.json")))
agent = lambda x: f"{out}/{x}/adapter"                                                   # noqa: E731
mean = lambda x, user, m: r["agents"][f"{agent(x)} @ {user}"]["tau"]["behaviour"]["all"][m]["mean"]  # noqa: E731
pair = lambda m, a, b, user, d="": r["paired"][m].get(f"{agent(a)} - {agent(b)} @ {user}" + f" ({d})" * bool(d))  # noqa: E731
flip = lambda p: p and {**p, "diff": 0.0 - p["diff"], "ci": [0.0 - p["ci"][1], 0.0 - p["ci"][0]]}   # noqa: E731; b - a
show = lambda p: "n/a" if p is None else f"{p['diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}]"  # noqa: E731
num = lambda v: "-" if v is None else f"{v:.3f}"                                          # noqa: E731
n = next(iter(r["agents"].values()))["tau"]["overall"]["n_tasks"]
for m in ("correct_state", "pass1"):
    print(f"\n2 x 2 on {m}, {n} tasks: SFT -> RL (RL - SFT, paired 95% CI)")
    print("| trained \\ evaluated | with the user (scripted) | without (none) |\n|---|---|---|")
    for arm in ("user", "none"):
        cells = [f"{num(mean('sft_' + arm, u, m))} -> {num(mean('rl_' + arm, u, m))} "
                 f"({show(pair(m, 'rl_' + arm, 'sft_' + arm, u))})" for u in ("scripted", "none")]
        print(f"| {'with' if arm == 'user' else 'without'} the user | " + " | ".join(cells) + " |")
    for u in ("scripted", "none"):
        print(f"RL with the user - RL without, evaluated with {u}: {show(flip(pair(m, 'rl_none', 'rl_user', u)))}")
    for arm in ("user", "none"):
        print(f"unseen user (scripted:curious), the {arm} arm: {num(mean('sft_' + arm, 'scripted:curious', m))} -> "
              f"{num(mean('rl_' + arm, 'scripted:curious', m))}, RL - SFT "
              f"{show(pair(m, 'rl_' + arm, 'sft_' + arm, 'scripted:curious'))}")
    for d in ("retail", "airline"):
        print(f"{d}, the user arm with the scripted user: RL - SFT {show(pair(m, 'rl_user', 'sft_user', 'scripted', d))}")
state, pass1 = pair("correct_state", "rl_user", "sft_user", "scripted"), pair("pass1", "rl_user", "sft_user", "scripted")
metrics = [json.loads(line) for line in open(os.path.join(out, "rl_user", "metrics.jsonl"))]
minutes = sum(m.get("s_per_step", m.get("eval_s", 0)) for m in metrics) / 60   # step 0: the curve's first point
met = state["diff"] >= 0.10 and state["ci"][0] > 0 and pass1["diff"] >= 0.15 and minutes <= 30
print(f"\nthe bar (the user arm, evaluated with the scripted user, both domains): correct end state {show(state)} "
      f"(>= +0.10, CI above 0), pass^1 {show(pass1)} (>= +0.15), RL {minutes:.1f} min (<= 30): {'MET' if met else 'MISSED'}")

# the picture: both metrics, each agent under each user, every bar labelled (a zero too)
import matplotlib                                                                        # noqa: E402
matplotlib.use("Agg")
import matplotlib.pyplot as plt                                                          # noqa: E402
users = [("scripted", "evaluated with\nthe scripted user"), ("none", "evaluated with\nno user"),
         ("scripted:curious", "evaluated with an\nunseen user (curious)")]
bars = [("sft_user", "SFT, made with the user", "#9ecae1"), ("rl_user", "+ RL with the user", "#2171b5"),
        ("sft_none", "SFT, made without", "#fdbe85"), ("rl_none", "+ RL without", "#d94801")]
fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
for ax, (m, title) in zip(axes, [("pass1", "pass^1 (an episode cut at the turn cap scores 0)"),
                                 ("correct_state", "correct end state (however the episode ended)")]):
    for j, (x, label, color) in enumerate(bars):
        xs = [i + (j - 1.5) * 0.2 for i in range(len(users))]
        ys = [mean(x, u, m) for u, _ in users]
        ax.bar(xs, ys, 0.19, color=color, label=label)
        for xi, yi in zip(xs, ys):
            ax.text(xi, yi + 0.015, f"{yi:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(users)), [t for _, t in users])
    ax.set_title(f"{title}\n{n} held-out tasks (seed 11), retail + airline", fontsize=10)
    ax.set_ylim(0, 1.08)
axes[0].set_ylabel("share of tasks")
fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, frameon=False)
fig.tight_layout(rect=(0, 0.07, 1, 1))
fig.savefig(os.path.join(out, "claims.png"), dpi=110)
print(f"picture: {os.path.join(out, 'claims.png')}")
EOF
