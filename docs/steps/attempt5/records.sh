#!/usr/bin/env bash
# Copy the fifth attempt's records from ARMS (docs/steps/attempt5/resume.sh) into docs/steps/attempt5/<run>/: each
# run's rl.py args and metrics, each step's `time -v` (wall time, peak), the sha256 of its step adapters, the CPU it
# ran on, and steps.tsv (a line a step: when it finished, its wall time and peak). Then the published step-8
# adapters (adapters/), the evaluation's tables, and scripts/runs_report.py's numbers and picture (runs_report.json,
# runs.png: the README's), made again here by this repository's copy of the report.
#   bash docs/steps/attempt5/records.sh          (from the repository root)
set -eu
ARMS=${ARMS:-/work/arms5}
src=$ARMS/clone/runs/arms5 dst=$(cd "$(dirname "$0")" && pwd)
for run in narrow-s0 broad-s0 narrow-s1 broad-s1 narrow-s2 broad-s2; do
  [ -d "$src/$run/rl" ] || continue
  mkdir -p "$dst/$run"
  cp "$src/$run/rl/args.json" "$dst/$run/rl_args.json"
  cp "$src/$run/rl/metrics.jsonl" "$dst/$run/rl_metrics.jsonl"
  [ -f "$ARMS/cpu-$run.txt" ] && cp "$ARMS/cpu-$run.txt" "$dst/$run/cpu.txt"
  printf 'step\tfinished (UTC)\twall\tpeak (GiB)\n' > "$dst/$run/steps.tsv"
  for k in $(seq 1 8); do
    [ -d "$src/$run/step-$k" ] || continue
    t=$src/$run/rl/time-step-$k.txt
    cp "$t" "$dst/$run/time-step-$k.txt"
    wall=$(sed -n 's/.*Elapsed (wall clock) time (h:mm:ss or m:ss): //p' "$t")
    peak=$(awk '/Maximum resident set size/ {printf "%.1f", $NF / 1048576}' "$t")
    printf '%s\t%s\t%s\t%s\n' "$k" "$(date -u -r "$src/$run/step-$k" '+%Y-%m-%d %H:%M')" "$wall" "$peak" >> "$dst/$run/steps.tsv"
  done
  if compgen -G "$src/$run/step-*" >/dev/null; then
    (cd "$src/$run" && sha256sum step-*/adapter_model.safetensors) > "$dst/$run/adapters.sha256"
  fi
done
if [ -d "$src/published" ]; then                    # the step-8 bf16 copies, their SHA256SUMS and SOURCES.md
  mkdir -p "$dst/adapters" && cp -r "$src/published"/. "$dst/adapters/"
fi
for part in eval-population eval-personas; do       # eval.py's tables and per-task numbers (episodes stay in ARMS)
  for f in args.json results.md results.json eval.png; do
    [ -f "$src/$part/$f" ] && mkdir -p "$dst/$part" && cp "$src/$part/$f" "$dst/$part/$f"
  done
done
if [ -f "$src/eval-population/results.json" ]; then   # the report redrawn by this repository's runs_report.py, not
  repo=$(cd "$dst/../../.." && pwd)                    # the clone's (d344bb6's draws no whisker): it writes into $src
  "${PYTHON:-$repo/.venv/bin/python}" "$repo/scripts/runs_report.py" "$src" 8 > /dev/null
  for f in runs_report.json runs.png; do cp "$src/$f" "$dst/$f"; done
fi
ls -R "$dst" | head -40
