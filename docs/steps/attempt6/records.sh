#!/usr/bin/env bash
# Copy the sixth attempt's records from ARMS (docs/steps/attempt6/resume.sh) into docs/steps/attempt6/<run>/: each
# run's rl.py args and metrics (a line a step: reward, seconds, the curve, per-user numbers), each process's `time -v`
# (wall time, peak), the sha256 of its kept adapters, the CPU it ran on, and its habits a step (scripts/habits.py over
# its rollouts, which stay in ARMS: ~2.5 MB a step); then the published bf16 adapters
# (adapters/: SHA256SUMS, SOURCES.md; their bytes go into the history, scripts/adapters.sh), the evaluations' tables
# and per-task numbers with the CPU of each part, and scripts/runs_report.py's numbers and picture, made here by this
# repository's copy of the report.
#   bash docs/steps/attempt6/records.sh          (from the repository root)
set -eu
ARMS=${ARMS:-/work/arms6}
src=$ARMS/clone/runs/arms6 dst=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$dst/../../.." && pwd)
for s in 20 21 22 23; do
  for run in narrow-s$s broad-s$s; do
    [ -d "$src/$run/rl" ] || continue
    mkdir -p "$dst/$run"
    cp "$src/$run/rl/args.json" "$dst/$run/rl_args.json"
    [ -f "$src/$run/rl/metrics.jsonl" ] && cp "$src/$run/rl/metrics.jsonl" "$dst/$run/rl_metrics.jsonl"
    [ -f "$ARMS/cpu-$run.txt" ] && cp "$ARMS/cpu-$run.txt" "$dst/$run/cpu.txt"
    if compgen -G "$src/$run/rl/rollouts/step-*.jsonl" > /dev/null; then
      "${PYTHON:-$repo/.venv/bin/python}" "$repo/scripts/habits.py" "$src/$run/rl" > "$dst/$run/habits.tsv"
    fi
    for t in "$src/$run/rl"/time-to-step-*.txt; do [ -s "$t" ] && cp "$t" "$dst/$run/"; done   # once written
    if compgen -G "$src/$run/step-*" > /dev/null; then
      (cd "$src/$run" && sha256sum step-*/adapter_model.safetensors) > "$dst/$run/adapters.sha256"
    fi
  done
done
if [ -d "$src/published" ]; then
  mkdir -p "$dst/adapters" && cp -r "$src/published"/. "$dst/adapters/"
fi
[ -f "$src/cpu-eval.tsv" ] && cp "$src/cpu-eval.tsv" "$dst/cpu-eval.tsv"
for part in eval-population eval-personas eval-later eval-sampled; do   # tables and per-task numbers; the episodes
  for f in args.json results.md results.json eval.png; do              # stay in ARMS (~6 MB an agent)
    [ -f "$src/$part/$f" ] && mkdir -p "$dst/$part" && cp "$src/$part/$f" "$dst/$part/$f"
  done
done
if [ -f "$src/eval-population/results.json" ]; then
  "${PYTHON:-$repo/.venv/bin/python}" "$repo/scripts/runs_report.py" "$src" > "$dst/runs_report.txt"
  for f in runs_report.json runs.png; do [ -f "$src/$f" ] && cp "$src/$f" "$dst/$f"; done
fi
ls -R "$dst" | head -40
