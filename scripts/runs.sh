#!/usr/bin/env bash
# MUA-RL's claim over runs and over a held-out population (docs/steps_preregistration.md, "The fifth attempt"): one
# cold start for both arms, the training users the only difference, several training runs an arm, then one paired
# evaluation of the cold start and every run's step K.
#   narrow   the four named training personas, one drawn per conversation (rl.py's default --user)
#   broad    a row of training behaviours drawn per conversation (--user scripted:population)
#   1. each run, for S in SEEDS, narrow then broad: K GRPO steps from INIT with --seed S, a process a step
#      (scripts/steps.sh, EVAL=none) into OUT/<arm>-s<S>; its step K published as bf16 (scripts/publish_adapter.py)
#      into OUT/published/<arm>-s<S>-step-K
#   2. the cold start and the published copies on 30 fresh held-out tasks a domain (task seed SEED), greedy, paired:
#      under the held-out population, two user draws a task (--trials 2), into OUT/eval-population; under each named
#      held-out persona and the training personas, into OUT/eval-personas
#   3. the bar, every run's numbers and the two-level CIs: scripts/runs_report.py OUT K
# Every part is skipped when its output exists, so a rerun after a kill goes on where it stopped (a kill loses at most
# the step it was in). The evaluation waits until every run is published.
# Run from the repository root:
#   INIT=docs/steps/attempt4/adapters/narrow-sft bash scripts/runs.sh   (PYTHON=.venv/bin/python OUT=runs/arms5 K=8
#   SEED=97 SEEDS="0 1 2")
#   RUNS="narrow-s0 broad-s0" trains only those runs (a session's share), and evaluates nothing
#   SMOKE=1 MODEL=DIR K=2 OUT=DIR: every command in its --smoke form on a model DIR (tests/test_steps.py, -m slow)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/arms5} K=${K:-8} SEED=${SEED:-97} SEEDS=${SEEDS:-"0 1 2"} EVAL_EVERY=${EVAL_EVERY:-4}
: "${INIT:?runs.sh: set INIT to the cold start every run starts from (an adapter dir)}"
N_TASKS=30 SMOKE_FLAG=
[ -n "${SMOKE:-}" ] && N_TASKS=1 SMOKE_FLAG=--smoke
ALL=$(for s in $SEEDS; do printf 'narrow-s%s broad-s%s ' "$s" "$s"; done)
export PYTHON=$PY K EVAL_EVERY INIT

for run in ${RUNS:-$ALL}; do
  arm=${run%-s*} seed=${run##*-s} spec=""
  [ "$arm" = broad ] && spec=scripted:population
  OUT="$OUT/$run" USER_SPEC=$spec RUN_SEED=$seed EVAL=none bash scripts/steps.sh
  copy="$OUT/published/$run-step-$K"
  made="python rl.py${spec:+ --user $spec} --eval-every $EVAL_EVERY --seed $seed --init $INIT --steps k"
  [ -f "$copy/adapter_config.json" ] || "$PY" scripts/publish_adapter.py "$OUT/$run/step-$K" "$copy" \
      "$made --out $OUT/$run/rl for k = 1..$K, a process a step"
done
[ -n "${RUNS:-}" ] && exit 0

agents=$INIT
for run in $ALL; do agents="$agents,$OUT/published/$run-step-$K"; done
common=(--agents "$agents" --domains retail,airline --n-tasks "$N_TASKS" --seed "$SEED"
        --paired-metric pass1,repeated_questions ${MODEL:+--model "$MODEL"} $SMOKE_FLAG)
"$PY" eval.py "${common[@]}" --user scripted:heldout-population --trials 2 --out "$OUT/eval-population"
"$PY" eval.py "${common[@]}" --user scripted:curious,scripted:literal,scripted:mindful,scripted:train --trials 1 \
    --out "$OUT/eval-personas"
"$PY" scripts/runs_report.py "$OUT" "$K"
