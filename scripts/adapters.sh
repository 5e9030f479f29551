#!/usr/bin/env bash
# The published adapters (docs/steps/attempt*/adapters/<name>/): their bytes live in this repository's history, not in
# its tree. Each is 9.8 MB; twelve made a clone's tree 122 MiB. A GPU machine lent to this project's sessions gets a
# copy of the working tree and takes at most 64 MiB of it, so eleven left the tree (the twelfth is below). This writes
# each one back from git's objects (the tree's copy, or the last commit that held it), then checks every SHA256SUMS.
#   bash scripts/adapters.sh              # every published adapter, into docs/steps/attempt*/adapters/
#   bash scripts/adapters.sh attempt5     # one attempt's
#   OUT=DIR bash scripts/adapters.sh      # into DIR/docs/steps/... instead (tests/test_eval.py)
# then, e.g.:  python eval.py --agents docs/steps/attempt5/adapters/narrow-s0-step-8
# The cold start the fifth attempt's runs share, attempt4/adapters/narrow-sft, stays in the tree: CI's slow check and
# scripts/runs.sh start from it. The folders written back are ignored by git (.gitignore), so they stay out of the tree.
# Publishing more: commit the folders (git add -f), then remove them in a later commit; this script finds them.
set -euo pipefail
[ -z "${OUT:-}" ] || OUT=$(realpath -m "$OUT")      # relative to where it was called from
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD}
ATTEMPT=${1:-attempt*}
shopt -s nullglob
sums_files=(docs/steps/$ATTEMPT/adapters/SHA256SUMS)
if [ ! -f "${sums_files[0]:-}" ]; then
  published=(docs/steps/*/adapters/SHA256SUMS)
  echo "adapters.sh: no published adapters under docs/steps/$ATTEMPT; there are some under:" \
       "$(for s in "${published[@]}"; do basename "$(dirname "$(dirname "$s")")"; done | xargs)" >&2
  exit 2
fi

for sums in "${sums_files[@]}"; do
  dir=$(dirname "$sums")
  while read -r _ weights; do                   # "<sha256>  <name>/adapter_model.safetensors"
    name=${weights%%/*}
    for file in adapter_config.json adapter_model.safetensors; do
      path=$dir/$name/$file
      if git cat-file -e "HEAD:$path" 2>/dev/null; then
        from=HEAD                                # still in the tree (the shared cold start)
      else                                       # the last commit that touched it took it out; its parent holds it
        removed=$(git rev-list -n 1 HEAD -- "$path" 2>/dev/null || true)
        from=$removed^
        [ -n "$removed" ] && git cat-file -e "$from:$path" 2>/dev/null \
          || { echo "adapters.sh: $path is not in this clone's history (not a git clone, or a shallow one:" \
                    "git fetch --unshallow)" >&2; exit 2; }
      fi
      mkdir -p "$OUT/$dir/$name"
      git show "$from:$path" > "$OUT/$path.tmp" && mv "$OUT/$path.tmp" "$OUT/$path"
    done
  done < "$sums"
  [ "$sums" -ef "$OUT/$dir/SHA256SUMS" ] || cp "$sums" "$OUT/$dir/SHA256SUMS"
  failed=$(cd "$OUT/$dir" && sha256sum -c SHA256SUMS 2>/dev/null | grep -v ': OK$' || true)
  [ -z "$failed" ] || { echo "adapters.sh: differs from $dir/SHA256SUMS: $(echo $failed)" >&2; exit 1; }
  echo "$OUT/$dir: $(wc -l < "$sums") adapters, sha256 as in SHA256SUMS"
done
