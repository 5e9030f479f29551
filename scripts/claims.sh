#!/usr/bin/env bash
# MUA-RL's claims, second attempt (docs/results.md, "Pre-registered: the user in the loop, second attempt"), end to
# end, on the world where the user matters (the medium tier, the training and held-out personas):
#   1. the cold starts: gold conversations with the training personas (= python sft.py), and without a user
#   2. one GRPO step of the CPU preset for each arm: (a) varied users (= python rl.py), (b) one user, the cooperative
#      persona, (c) no user, from the no-user cold start, (d) no cold start, from the base model
#   3. every agent on 30 held-out medium tasks of seed 12 under each persona and with no user, paired task by task
#   4. the bar and the tables, printed by scripts/claims_report.py, with one picture, <out>/claims.png
# Each step is skipped when its output exists; after a kill, sft.py and rl.py resume from their checkpoints and
# eval.py from each agent-and-user evaluation it finished. The evaluations the bar needs run first.
# Run from the repository root:   bash scripts/claims.sh     (PYTHON=.venv/bin/python OUT=runs/claims2 by default)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/claims2}
done_() { [ -f "$1/adapter/adapter_config.json" ] && echo "skip: $1 exists"; }
evaluate() {     # $1: agents, $2: users; the pre-registered command's other flags, always the same
  "$PY" eval.py --agents "$1" --user "$2" --domains retail,airline --n-tasks 15 --seed 12 \
      --paired-metric pass1,correct_state,facts_asked,asked_first,turns --out "$OUT/eval"
}
a() { echo "$OUT/$1/adapter"; }
TRAIN=scripted:default,scripted:terse,scripted:chatty,scripted:careless
HELDOUT=scripted:curious,scripted:literal

done_ "$OUT/sft" || "$PY" sft.py --out "$OUT/sft"
done_ "$OUT/rl" || "$PY" rl.py --init "$(a sft)" --out "$OUT/rl"
evaluate "$(a sft),$(a rl)" "$HELDOUT"                                     # the bar's first two rows
done_ "$OUT/rl_one" || "$PY" rl.py --user scripted:default --init "$(a sft)" --out "$OUT/rl_one"
evaluate "$(a rl_one)" "$HELDOUT"                                          # its third
done_ "$OUT/sft_none" || "$PY" sft.py --user none --out "$OUT/sft_none"
done_ "$OUT/rl_none" || "$PY" rl.py --user none --init "$(a sft_none)" --out "$OUT/rl_none"
done_ "$OUT/rl_base" || "$PY" rl.py --init base --out "$OUT/rl_base"
evaluate "$(a sft),$(a rl),$(a rl_one),$(a sft_none),$(a rl_none),$(a rl_base)" "$TRAIN,$HELDOUT,none"   # the grid
"$PY" scripts/claims_report.py "$OUT"
