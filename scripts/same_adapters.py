"""Are two runs' adapters the same, bit for bit? The check behind "the default run's numbers did not change".

    python scripts/same_adapters.py BEFORE/runs/sft/adapter AFTER/runs/sft/adapter BEFORE/runs/rl/adapter ...

Arguments come in pairs (before, after). Each pair's adapter_model.safetensors must hold the same tensor names,
shapes, dtypes and bytes. Prints one line a pair (tensors compared, the largest absolute difference) and exits 1
if any pair differs, 2 on a missing file.
"""
import os
import sys

import torch
from safetensors.torch import load_file


def compare(before: str, after: str) -> bool:
    a, b = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (before, after))
    if a.keys() != b.keys():
        print(f"DIFFER {before} vs {after}: tensor names differ ({sorted(a.keys() ^ b.keys())[:3]} ...)")
        return False
    same = [k for k in a if a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])]
    worst = max(((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].shape == b[k].shape),
                default=0.0)
    ok = len(same) == len(a)
    print(f"{'SAME' if ok else 'DIFFER'} {before} vs {after}: {len(same)} of {len(a)} tensors bit for bit, "
          f"max |difference| {worst:.3g}")
    return ok


def main(paths: list[str]) -> int:
    if not paths or len(paths) % 2:
        print("same_adapters.py: give adapter dirs in pairs: BEFORE AFTER [BEFORE AFTER ...]", file=sys.stderr)
        return 2
    missing = [p for p in paths if not os.path.isfile(os.path.join(p, "adapter_model.safetensors"))]
    if missing:
        print(f"same_adapters.py: {missing[0]} holds no adapter_model.safetensors", file=sys.stderr)
        return 2
    results = [compare(paths[i], paths[i + 1]) for i in range(0, len(paths), 2)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
