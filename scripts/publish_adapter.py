"""An adapter published in the repository: a LoRA adapter that training wrote in fp32, copied with its weights as
bf16 safetensors (half the bytes; a 135M model's r=16 adapter is ~10 MB) and its config unchanged, so that `python
eval.py --agents DST` evaluates it on any task seed and under any user without hours of training. DST's folder keeps
a SHA256SUMS (`sha256sum -c SHA256SUMS` checks the copies) and a SOURCES.md table: each copy's command, the fp32
source's sha256 and the copy's. PEFT loads the bf16 weights into the fp32 LoRA layers (cast up when loaded): the
published adapter is the trained one rounded to bf16, not bit for bit the same policy.

    python scripts/publish_adapter.py SRC DST "the command that made SRC"

The command goes into SOURCES.md as given (Markdown: the command itself in backticks, a note beside it).
Adapter folders under docs/steps/*/adapters/ are ignored by git, as their bytes live in the history
(scripts/adapters.sh puts them back): publish with `git add -f DST`, then remove DST in a later commit.
"""
import hashlib
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
USAGE = 'python scripts/publish_adapter.py SRC DST "the command that made SRC"'
SOURCES_HEADER = ["| adapter (bf16) | the command that made it (fp32) | sha256 of the fp32 weights "
                  "| sha256 of the bf16 weights |", "|---|---|---|---|"]


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def bad(message: str):
    """One line, exit 2, nothing written."""
    print(f"publish_adapter.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def publish(src: str, dst: str, command: str) -> str:
    """Writes DST's bf16 weights and config; adds (or replaces) DST's lines in its parent's SHA256SUMS and
    SOURCES.md. Returns the bf16 file's sha256."""
    if not all(os.path.isfile(os.path.join(src, f)) for f in (CONFIG, WEIGHTS)):
        bad(f"no LoRA adapter at {src} (it needs {CONFIG} and {WEIGHTS})")
    if not command.strip():
        bad("say the command that made the adapter")
    os.makedirs(dst, exist_ok=True)
    weights = load_file(os.path.join(src, WEIGHTS))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sorted(weights.items())},
              os.path.join(dst, WEIGHTS), metadata={"format": "pt"})
    shutil.copyfile(os.path.join(src, CONFIG), os.path.join(dst, CONFIG))
    folder, name = os.path.split(os.path.normpath(dst))
    digest = sha256(os.path.join(dst, WEIGHTS))
    replace_lines(os.path.join(folder, "SHA256SUMS"), f"  {name}/{WEIGHTS}", f"{digest}  {name}/{WEIGHTS}")
    replace_lines(os.path.join(folder, "SOURCES.md"), f"| `{name}` |",
                  f"| `{name}` | {command} | {sha256(os.path.join(src, WEIGHTS))} | {digest} |", SOURCES_HEADER)
    return digest


def replace_lines(path: str, key: str, line: str, header: tuple | list = ()):
    """The file rewritten as the header, then its rows sorted: the row containing `key` replaced by `line` (or
    `line` added)."""
    old = open(path).read().splitlines() if os.path.exists(path) else []
    rows = sorted([x for x in old if key not in x and x not in header] + [line])
    with open(path, "w") as f:
        f.write("\n".join([*header, *rows]) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        bad("usage: " + USAGE)
    print(publish(*sys.argv[1:]))
