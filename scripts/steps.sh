#!/usr/bin/env bash
# MUA-RL's result on our default: K GRPO steps against the cold start, on users no stage trained on, as
# pre-registered in docs/steps_preregistration.md (its settings, evaluation and bar are this script's).
#   1. the cold start: python sft.py
#   2. K steps of the CPU default, one rl.py process a step (each resumes the last; /usr/bin/time -v keeps each
#      step's wall time and peak memory in <out>/rl/time-step-N.txt), each step's adapter kept as <out>/step-N
#   3. the SFT adapter and the steps EVAL_STEPS (step 1 and step K) on 40 fresh held-out tasks (20 a domain, task seed
#      SEED = 31), greedy, paired task by task, under each held-out persona and under the training personas (one
#      drawn per conversation), into <out>/EVAL (eval)
#   4. the bar, the tables and the curve: scripts/steps_report.py <out> K EVAL
# Each part is skipped when its output exists, so a rerun after a kill goes on where it stopped (sft.py and rl.py
# resume from their checkpoints, eval.py from each agent and user it finished).
# Run from the repository root:   bash scripts/steps.sh        (PYTHON=.venv/bin/python OUT=runs/steps K=4)
#   the second attempt: K=8 EVAL_STEPS="1 4 8" SEED=41 EVAL=eval2 bash scripts/steps.sh (steps 5-8 resume the run)
#   the third attempt's arms (scripts/arms.sh): USER_SPEC=scripted:population passes --user to sft.py and rl.py,
#   EVAL_EVERY=4 passes --eval-every (the curve at steps 0, 4, 8), EVAL=none stops after the steps
#   the fifth attempt's runs (scripts/runs.sh): INIT=DIR starts the steps from that adapter instead of running the
#   cold start (one cold start for every run), RUN_SEED=S passes --seed S to rl.py (a run's seed)
#   SMOKE=1 bash scripts/steps.sh: every command in its --smoke form, K=2, OUT a temp dir; MODEL=DIR passes --model DIR
#   to each (tests/test_steps.py, a tiny model, -m slow: the whole script, and its training part in runs.sh's test)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
if [ -n "${SMOKE:-}" ]; then
  OUT=${OUT:-$(mktemp -d)} K=${K:-2} SMOKE=--smoke N_TASKS=1
else
  OUT=${OUT:-runs/steps} K=${K:-4} SMOKE= N_TASKS=20
fi
MODEL=${MODEL:+--model $MODEL} SEED=${SEED:-31} EVAL=${EVAL:-eval} EVAL_STEPS=${EVAL_STEPS:-"1 $K"}
ARM="${USER_SPEC:+--user $USER_SPEC}" CURVE="${EVAL_EVERY:+--eval-every $EVAL_EVERY}"
RUN="${RUN_SEED:+--seed $RUN_SEED}"
done_() { [ -f "$1/adapter_config.json" ] && echo "skip: $1 exists"; }
timed() { /usr/bin/time -v -o "$1" "${@:2}"; }      # $1: where the wall time and peak memory go

mkdir -p "$OUT/rl"
if [ -n "${INIT:-}" ]; then
  [ -f "$INIT/adapter_config.json" ] || { echo "steps.sh: INIT=$INIT holds no adapter (adapter_config.json)"; exit 2; }
else
  INIT=$OUT/sft/adapter
  done_ "$INIT" || timed "$OUT/time-sft.txt" "$PY" sft.py $SMOKE $MODEL $ARM --out "$OUT/sft"
fi
for k in $(seq 1 "$K"); do
  done_ "$OUT/step-$k" && continue
  timed "$OUT/rl/time-step-$k.txt" "$PY" rl.py $SMOKE $MODEL $ARM $CURVE $RUN --init "$INIT" --steps "$k" \
      --out "$OUT/rl"
  cp -r "$OUT/rl/adapter" "$OUT/step-$k.tmp" && mv "$OUT/step-$k.tmp" "$OUT/step-$k"
done
[ "$EVAL" = none ] && exit 0
agents="$INIT"
for k in $(printf '%s\n' $EVAL_STEPS | sort -nu); do agents="$agents,$OUT/step-$k"; done
"$PY" eval.py $SMOKE $MODEL --agents "$agents" --user scripted:curious,scripted:literal,scripted:train \
    --domains retail,airline --n-tasks $N_TASKS --seed "$SEED" \
    --paired-metric pass1,correct_state,finished,facts_asked,asked_first,turns --out "$OUT/$EVAL"
"$PY" scripts/steps_report.py "$OUT" "$K" "$EVAL"
