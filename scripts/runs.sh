#!/usr/bin/env bash
# The experiment runner (docs/steps_preregistration.md, "The sixth attempt"): one cold start for every run, the
# training users the only difference between the arms, several runs an arm, then paired evaluations on fresh tasks.
#   narrow   the four named training personas, one drawn per conversation (rl.py's default --user)
#   broad    a row of training behaviours drawn per conversation (--user scripted:population)
#   1. the runs, for S in SEEDS: narrow-sS to step K, then broad-sS on to step LONG, each from INIT with --seed S
#      into OUT/<run>/rl; one rl.py process to each of the run's checkpoints (K; the broad runs' LATER too), whose
#      adapter is kept as OUT/<run>/step-k and published as bf16 into OUT/published/<run>-step-k
#   2. the evaluations on N_TASKS fresh held-out tasks a domain (task seed SEED), paired, an agent at a time, each
#      agent's part and the CPU that ran it in OUT/cpu-eval.tsv:
#      a. eval-population: the cold start and every run's step K, greedy, the held-out population, 2 draws a task
#      b. eval-personas: the same agents under each named held-out persona and the training personas
#      c. eval-later: the broad runs' later checkpoints (LATER), as (a)
#      d. eval-sampled: the cold start and the broad runs' step LONG at the training temperature T, TRIALS draws a
#         task under the held-out population; then the broad runs' step K the same way (the part cut first)
#   3. the report: scripts/runs_report.py OUT
# Every part is skipped when its output exists, so a rerun after a kill goes on where it stopped (rl.py resumes from
# its last checkpoint; eval.py from each agent it finished). The evaluations wait until every run is published.
# Run from the repository root (docs/steps/attempt6/resume.sh runs it in the background, from a fixed-commit clone):
#   INIT=docs/steps/attempt4/adapters/narrow-sft bash scripts/runs.sh   (PYTHON=.venv/bin/python OUT=runs/arms6 K=8
#   LONG=16 LATER="12 16" SEED=151 SEEDS="20 21 22 23" T=0.7 TRIALS=4)
#   RUNS="narrow-s20 broad-s20" trains only those runs (a session's share), and evaluates nothing
#   SMOKE=1 MODEL=DIR K=2 LONG=3 LATER=3 OUT=DIR: every command in its --smoke form on a model DIR (tests/test_runs.py)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/arms6} K=${K:-8} LONG=${LONG:-16} LATER=${LATER:-"12 16"} SEED=${SEED:-151}
SEEDS=${SEEDS:-"20 21 22 23"} T=${T:-0.7} TRIALS=${TRIALS:-4} EVAL_EVERY=${EVAL_EVERY:-4}
: "${INIT:?runs.sh: set INIT to the cold start every run starts from (an adapter dir)}"
[ -f "$INIT/adapter_config.json" ] || { echo "runs.sh: INIT=$INIT holds no adapter (adapter_config.json)" >&2; exit 2; }
N_TASKS=30 SMOKE_FLAG=
[ -n "${SMOKE:-}" ] && N_TASKS=1 SMOKE_FLAG=--smoke
ALL=$(for s in $SEEDS; do printf 'narrow-s%s broad-s%s ' "$s" "$s"; done)
flags=$(grep -o -w -E 'avx2|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | paste -sd ' ')
CPU="$(lscpu | sed -n 's/^Model name: *//p') (model $(lscpu | sed -n 's/^Model: *//p'); $flags)"

checkpoints() {                    # a run's checkpoints: step K, and for a broad run its later ones
  case $1 in broad-*) echo "$K $LATER" ;; *) echo "$K" ;; esac
}

for run in ${RUNS:-$ALL}; do
  seed=${run##*-s} spec=()
  [ "${run%-s*}" = broad ] && spec=(--user scripted:population)
  for k in $(checkpoints "$run"); do
    step=$OUT/$run/step-$k copy=$OUT/published/$run-step-$k
    if [ ! -f "$step/adapter_config.json" ]; then
      mkdir -p "$OUT/$run/rl"
      /usr/bin/time -v -o "$OUT/$run/rl/time-to-step-$k.txt" "$PY" rl.py $SMOKE_FLAG ${MODEL:+--model "$MODEL"} \
          "${spec[@]}" --eval-every "$EVAL_EVERY" --seed "$seed" --init "$INIT" --steps "$k" --out "$OUT/$run/rl"
      rm -rf "$step.tmp" && cp -r "$OUT/$run/rl/adapter" "$step.tmp" && mv "$step.tmp" "$step"
    fi
    [ -f "$copy/adapter_config.json" ] || "$PY" scripts/publish_adapter.py "$step" "$copy" \
        "python rl.py${spec[*]:+ ${spec[*]}} --eval-every $EVAL_EVERY --seed $seed --init $INIT --steps $k --out $OUT/$run/rl"
  done
done
[ -n "${RUNS:-}" ] && exit 0

evaluate() {                       # evaluate FOLDER AGENT [eval.py flags]: one agent's part, and the CPU that ran it
  mkdir -p "$OUT/$1/done"
  local before
  before=$(ls "$OUT/$1/done")
  "$PY" eval.py --domains retail,airline --n-tasks "$N_TASKS" --seed "$SEED" --paired-metric pass1,repeated_questions \
      ${MODEL:+--model "$MODEL"} $SMOKE_FLAG --agents "$2" "${@:3}" --out "$OUT/$1"
  comm -13 <(echo "$before") <(ls "$OUT/$1/done") | while read -r part; do
    printf '%s\t%s\t%s\t%s\n' "$1" "$part" "$(date -u '+%F %H:%M')" "$CPU" >> "$OUT/cpu-eval.tsv"
  done
}
population=(--user scripted:heldout-population --trials 2)
personas=(--user scripted:curious,scripted:literal,scripted:mindful,scripted:train --trials 1)
sampled=(--user scripted:heldout-population --trials "$TRIALS" --temperature "$T")
at_k=$INIT later= long= broad_k=
for run in $ALL; do
  at_k="$at_k,$OUT/published/$run-step-$K"
  case $run in broad-*)
    broad_k="$broad_k,$OUT/published/$run-step-$K" long="$long,$OUT/published/$run-step-$LONG"
    for k in $LATER; do later="$later,$OUT/published/$run-step-$k"; done ;;
  esac
done
for agent in ${at_k//,/ }; do evaluate eval-population "$agent" "${population[@]}"; done
for agent in ${at_k//,/ }; do evaluate eval-personas "$agent" "${personas[@]}"; done
for agent in ${later//,/ }; do evaluate eval-later "$agent" "${population[@]}"; done
for agent in $INIT ${long//,/ } ${broad_k//,/ }; do evaluate eval-sampled "$agent" "${sampled[@]}"; done
# each folder's tables over all its agents (every part is done: nothing is evaluated again)
evaluate eval-population "$at_k" "${population[@]}"
evaluate eval-personas "$at_k" "${personas[@]}"
evaluate eval-later "${later#,}" "${population[@]}"
evaluate eval-sampled "$INIT$long$broad_k" "${sampled[@]}"
"$PY" scripts/runs_report.py "$OUT" "$K" $LATER
