#!/usr/bin/env bash
# MUA-RL's result tried a third and a fourth time (docs/steps_preregistration.md, "The third attempt", "The fourth
# attempt"): two arms on the same budget, each its own cold start and K GRPO steps, then one paired evaluation of the
# four agents.
#   broad    users drawn from the training population, a row of training behaviours per conversation
#            (--user scripted:population for sft.py and rl.py)
#   narrow   the four named training personas, one drawn per conversation (the CPU preset's scripted:train)
#   1. each arm: bash scripts/steps.sh with OUT=<out>/<arm>, EVAL=none (the cold start, K steps, a step a process,
#      each step's adapter kept as <out>/<arm>/step-N, its wall time and peak in <out>/<arm>/rl/time-step-N.txt)
#   2. the SFT adapter and step K of both arms on 30 fresh held-out tasks a domain (task seed SEED), greedy, paired
#      task by task, under each held-out persona, the training personas and the population, into <out>/eval
#   3. the bar, the 2x2 table, the per-user numbers and the picture: scripts/arms_report.py <out> K
# Every part is skipped when its output exists, so a rerun after a kill goes on where it stopped.
# Run from the repository root:   bash scripts/arms.sh      (PYTHON=.venv/bin/python OUT=runs/arms K=8 SEED=73)
#   ARMS="broad" runs one arm's steps only (no evaluation until both are there)
#   the fourth attempt: ARMS=broad SEED=89 NARROW_SHA256=docs/steps/attempt3/narrow/adapters.sha256, the third
#   attempt's narrow arm copied into OUT/narrow; every file the sums name is checked before the evaluation
#   AGENTS=A,B,C,D evaluates those four adapter folders instead (broad SFT, broad step K, narrow SFT, narrow step K:
#   the published bf16 copies, say), trains nothing and checks no sums; the report reads them from the evaluation
#   SMOKE=1 MODEL=DIR K=2 OUT=DIR: every command in its --smoke form on a model DIR (tests/test_steps.py, -m slow)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/arms} K=${K:-8} SEED=${SEED:-73} ARMS=${ARMS:-"broad narrow"} EVAL_EVERY=${EVAL_EVERY:-4}
N_TASKS=30 SMOKE_FLAG=
[ -n "${SMOKE:-}" ] && N_TASKS=1 SMOKE_FLAG=--smoke
export PYTHON=$PY K EVAL_EVERY
if [ -z "${AGENTS:-}" ]; then
  for arm in $ARMS; do
    spec=""
    [ "$arm" = broad ] && spec=scripted:population
    OUT="$OUT/$arm" USER_SPEC=$spec EVAL=none bash scripts/steps.sh
  done
  for arm in broad narrow; do
    [ -f "$OUT/$arm/step-$K/adapter_config.json" ] \
      || { echo "arms.sh: $arm has no step $K yet: no evaluation"; exit 0; }
  done
  if [ -n "${NARROW_SHA256:-}" ]; then
    sums=$(realpath "$NARROW_SHA256")
    (cd "$OUT/narrow" && sha256sum --quiet -c "$sums") || { echo "arms.sh: $OUT/narrow differs from $sums"; exit 1; }
  fi
  AGENTS="$OUT/broad/sft/adapter,$OUT/broad/step-$K,$OUT/narrow/sft/adapter,$OUT/narrow/step-$K"
fi
"$PY" eval.py $SMOKE_FLAG ${MODEL:+--model $MODEL} --agents "$AGENTS" \
    --user scripted:curious,scripted:literal,scripted:train,scripted:population --domains retail,airline \
    --n-tasks $N_TASKS --seed "$SEED" --paired-metric pass1,correct_state,finished,facts_asked,asked_first,turns \
    --out "$OUT/eval"
"$PY" scripts/arms_report.py "$OUT" "$K"
