#!/usr/bin/env bash
# The fifth attempt's six runs (docs/steps_preregistration.md, "The fifth attempt"), started or resumed in the
# background where the last session's end killed them:
#   bash docs/steps/attempt5/resume.sh          (from the repository root; ARMS=/work/arms5 holds everything)
# - ARMS/clone: a clone of this repository at the fixed commit d344bb6 (made if missing; its .venv is this one's);
#   scripts/runs.sh runs there, a process a step, each part skipped when its output exists.
# - The pre-registration's rule: a run is never spliced across machines. ARMS/cpu-<run>.txt names the CPU a run
#   started on (written here for every run not begun, since runs.sh begins the next run itself); a begun, unfinished
#   run that finds another CPU has its steps so far moved to ARMS/lost/ and starts again from step 1. A finished
#   (published) run is kept, whatever CPU ran it.
# - ARMS/runs.log: runs.sh's output and each start with its CPU; ARMS/runs.pid: its process group. docs/steps/attempt5/records.sh copies the records.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
ARMS=${ARMS:-/work/arms5} COMMIT=d344bb6
OUT=$ARMS/clone/runs/arms5 LOG=$ARMS/runs.log
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
for run in narrow-s0 broad-s0 narrow-s1 broad-s1 narrow-s2 broad-s2; do   # every run not yet published
  [ -f "$OUT/published/$run-step-8/adapter_config.json" ] && continue
  if [ -d "$OUT/$run" ] && [ -f "$ARMS/cpu-$run.txt" ] && [ "$(cat "$ARMS/cpu-$run.txt")" != "$cpu" ]; then
    mkdir -p "$ARMS/lost"
    mv "$OUT/$run" "$ARMS/lost/$run-$(date -u +%Y%m%dT%H%M)"
    echo "$(date -u): $run began on $(cat "$ARMS/cpu-$run.txt"), this is $cpu: its steps moved to lost/, step 1 again" >> "$LOG"
  fi
  # A run not begun yet begins, if at all before this machine goes, on this CPU (runs.sh goes from one run to the
  # next in this background process): name it now. A begun run keeps the CPU it began on.
  [ -d "$OUT/$run" ] || echo "$cpu" > "$ARMS/cpu-$run.txt"
done
echo "$(date -u): started on $cpu" >> "$LOG"
cd "$ARMS/clone"
PYTHON=.venv/bin/python INIT=docs/steps/attempt4/adapters/narrow-sft OUT=runs/arms5 K=8 SEED=97 SEEDS="0 1 2" \
  setsid nohup bash -c 'bash scripts/runs.sh; echo "runs.sh exited $? at $(date -u)"' >> "$LOG" 2>&1 < /dev/null &
echo $! > "$ARMS/runs.pid"
echo "resume.sh: runs.sh started in the background (pid $!, log $LOG); to pause: kill -- -$!"
