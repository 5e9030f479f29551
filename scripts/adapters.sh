#!/usr/bin/env bash
# The published adapters (docs/steps/attempt*/adapters/<name>/): their bytes live in this repository's history, not in
# its tree. Each is 9.8 MB; twelve made a clone's tree 122 MiB, past the 64 MiB a lent GPU machine takes with the
# working tree. This puts each one back from the last commit that held it, then checks every SHA256SUMS.
#   bash scripts/adapters.sh              # every published adapter, into docs/steps/attempt*/adapters/
#   bash scripts/adapters.sh attempt5     # one attempt's
#   OUT=DIR bash scripts/adapters.sh      # into DIR/docs/steps/... instead (tests/test_eval.py)
# then, e.g.:  python eval.py --agents docs/steps/attempt5/adapters/narrow-s0-step-8
# The cold start the fifth attempt's runs share, attempt4/adapters/narrow-sft, stays in the tree: CI's slow check and
# scripts/runs.sh start from it. The restored folders are ignored by git (.gitignore), so they never travel again.
# Publishing more: commit the folders (git add -f), then remove them in a later commit; this script finds them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
ATTEMPT=${1:-attempt*}
shopt -s nullglob
sums_files=(docs/steps/$ATTEMPT/adapters/SHA256SUMS)
[ -f "${sums_files[0]:-}" ] \
  || { echo "adapters.sh: no published adapters under docs/steps/$ATTEMPT (attempt3, attempt4, attempt5)" >&2; exit 2; }

for sums in "${sums_files[@]}"; do
  dir=$(dirname "$sums")
  while read -r _ weights; do                   # "<sha256>  <name>/adapter_model.safetensors"
    name=${weights%%/*}
    for file in adapter_config.json adapter_model.safetensors; do
      path=$dir/$name/$file
      [ -f "$OUT/$path" ] && continue
      if [ -f "$path" ]; then                    # still in the tree (the shared cold start)
        mkdir -p "$OUT/$dir/$name" && cp "$path" "$OUT/$path"
        continue
      fi
      # the last commit that touched it took it out of the tree; that commit's parent holds it
      removed=$(git rev-list -n 1 HEAD -- "$path" 2>/dev/null || true)
      [ -n "$removed" ] && git cat-file -e "$removed^:$path" 2>/dev/null \
        || { echo "adapters.sh: $path is not in this clone's history (not a git clone, or a shallow one:" \
                  "git fetch --unshallow)" >&2; exit 2; }
      mkdir -p "$OUT/$dir/$name"
      git show "$removed^:$path" > "$OUT/$path.tmp" && mv "$OUT/$path.tmp" "$OUT/$path"
    done
  done < "$sums"
  [ "$OUT" = . ] || cp "$sums" "$OUT/$dir/SHA256SUMS"
  (cd "$OUT/$dir" && sha256sum --quiet -c SHA256SUMS) || { echo "adapters.sh: $dir: a sha256 differs" >&2; exit 1; }
  echo "$OUT/$dir: $(wc -l < "$sums") adapters, sha256 as in SHA256SUMS"
done
