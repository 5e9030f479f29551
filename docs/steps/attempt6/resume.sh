#!/usr/bin/env bash
# The sixth attempt's runs and evaluations (docs/steps_preregistration.md, "The sixth attempt"), started or resumed in
# the background where the last session's end killed them:
#   bash docs/steps/attempt6/resume.sh          (from the repository root; ARMS=/work/arms6 holds everything)
# - ARMS/clone: a clone of this repository at the fixed commit c114433, the pre-registration's (made if missing; its
#   .venv is this one's); scripts/runs.sh runs there, each part skipped when its output exists.
# - The pre-registration's rule: a run is never spliced across machines. ARMS/cpu-<run>.txt names the CPU a run
#   began on (written here for every run not begun, since runs.sh goes from one run to the next by itself); a begun,
#   unfinished run that finds another CPU has its steps moved to ARMS/lost/ and starts again from step 1. A finished
#   run (its last checkpoint published) is kept, whatever CPU ran it. runs.sh itself names the CPU of each
#   evaluation part (runs/arms6/cpu-eval.tsv).
# - ARMS/runs.log: runs.sh's output and each start with its CPU; ARMS/runs.pid: its process group.
#   docs/steps/attempt6/records.sh copies the records into the repository.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
ARMS=${ARMS:-/work/arms6} COMMIT=c114433
OUT=$ARMS/clone/runs/arms6 LOG=$ARMS/runs.log SEEDS="20 21 22 23"
flags=$(grep -o -w -E 'avx2|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | paste -sd ' ')
cpu="$(lscpu | sed -n 's/^Model name: *//p') (model $(lscpu | sed -n 's/^Model: *//p'); $flags)"
if [ -f "$ARMS/runs.pid" ] && kill -0 "$(cat "$ARMS/runs.pid")" 2>/dev/null; then
  echo "resume.sh: already running (pid $(cat "$ARMS/runs.pid"))"; exit 0
fi
mkdir -p "$ARMS"
if [ ! -d "$ARMS/clone" ]; then
  git clone -q "$REPO" "$ARMS/clone"
  git -C "$ARMS/clone" checkout -q "$COMMIT"
  ln -s "$REPO/.venv" "$ARMS/clone/.venv"
fi
for s in $SEEDS; do
  for run in narrow-s$s broad-s$s; do                  # every run whose last checkpoint is not yet published
    last=8
    [ "${run%-s*}" = broad ] && last=16
    [ -f "$OUT/published/$run-step-$last/adapter_config.json" ] && continue
    if [ -d "$OUT/$run" ] && [ -f "$ARMS/cpu-$run.txt" ] && [ "$(cat "$ARMS/cpu-$run.txt")" != "$cpu" ]; then
      mkdir -p "$ARMS/lost"
      mv "$OUT/$run" "$ARMS/lost/$run-$(date -u +%Y%m%dT%H%M)"
      rm -rf "$OUT/published/$run-step-"*
      echo "$(date -u): $run began on $(cat "$ARMS/cpu-$run.txt"), this is $cpu: its steps moved to lost/, step 1 again" >> "$LOG"
    fi
    [ -d "$OUT/$run" ] || echo "$cpu" > "$ARMS/cpu-$run.txt"   # a run not begun begins, if at all, on this CPU
  done
done
echo "$(date -u): started on $cpu" >> "$LOG"
cd "$ARMS/clone"
PYTHON=.venv/bin/python INIT=docs/steps/attempt4/adapters/narrow-sft OUT=runs/arms6 K=8 LONG=16 LATER="12 16" \
  SEEDS="$SEEDS" SEED=151 T=0.7 TRIALS=4 \
  setsid nohup bash -c 'bash scripts/runs.sh; echo "runs.sh exited $? at $(date -u)"' >> "$LOG" 2>&1 < /dev/null &
echo $! > "$ARMS/runs.pid"
echo "resume.sh: runs.sh started in the background (pid $!, log $LOG); to pause: kill -- -$!"
