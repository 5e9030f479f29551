"""A GRPO step and an evaluation against an earlier commit, side by side on this machine, and whether the two give
the same bytes: the check behind "exact changes only" (issue 99, item 1).

    python scripts/bench_step.py BASE [--out DIR] [--n-tasks 15]

Each side, BASE (a clone at that commit under --out, on this .venv) and this tree, runs alone, one after the other:
  1. the default step from the shared cold start, `python rl.py --init COLD --steps 1 --eval-every 0`: its rollout
     and update seconds (metrics.jsonl) and its process's wall time and peak (/usr/bin/time -v);
  2. the sixth attempt's evaluation on --n-tasks tasks a domain, `python eval.py --agents COLD --user
     scripted:heldout-population --trials 2 --seed 97`: its seconds.
Then the checks: the rollouts and the episodes the same token for token (every field but the users' waiting seconds
and the sampled tokens' log-probs, which are counted where they differ: a row's place in the sampler's batch can move
their last bits), and the adapters bit for bit (scripts/same_adapters.py). A line a part, with the ratio BASE / here;
exit 1 if a token or the adapter differs.
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLD = "docs/steps/attempt4/adapters/narrow-sft"     # the one cold start every run of attempts 5 and 6 starts from


def run(side: str, cwd: str, out: str, n_tasks: int) -> dict:
    """One side's step and evaluation, each under /usr/bin/time -v -> their seconds and peaks."""
    py = os.path.join(ROOT, ".venv", "bin", "python")
    commands = {"step": [py, "rl.py", "--init", COLD, "--steps", "1", "--eval-every", "0", "--out", f"{out}/rl"],
                "eval": [py, "eval.py", "--agents", COLD, "--domains", "retail,airline", "--n-tasks", str(n_tasks),
                         "--seed", "97", "--user", "scripted:heldout-population", "--trials", "2",
                         "--out", f"{out}/eval"]}
    seconds = {}
    for part, cmd in commands.items():
        print(f"{side}: {' '.join(cmd[1:])}", flush=True)
        with open(f"{out}/{part}.log", "w") as log:
            subprocess.run(["/usr/bin/time", "-v", "-o", f"{out}/time-{part}.txt", *cmd], cwd=cwd, check=True,
                           stdout=log, stderr=subprocess.STDOUT)
        timed = open(f"{out}/time-{part}.txt").read()
        h, m, s = re.search(r"wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", timed).groups()
        seconds[part] = int(h or 0) * 3600 + int(m) * 60 + float(s)
        seconds[f"{part} peak GiB"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timed)[1]) / 2**20
    step = [json.loads(line) for line in open(f"{out}/rl/metrics.jsonl")][-1]
    seconds |= {"rollouts": step["rollout_s"], "update": step["train_s"]}
    return seconds


def compare_files(a: str, b: str) -> tuple[bool, int, int, float]:
    """Two files of trajectories -> (equal in every field but the sampled tokens' log-probs and the users' waiting
    seconds, stats' *_s; log-probs that differ, of how many, the largest difference)."""
    def strip(t):
        return {**t, "logprobs": None, "stats": {k: v for k, v in t["stats"].items() if not k.endswith("_s")}}
    with open(a) as fa, open(b) as fb:
        x, y = [json.loads(line) for line in fa], [json.loads(line) for line in fb]
    pairs = [(p, q) for s, t in zip(x, y) for p, q in zip(s["logprobs"], t["logprobs"])]
    apart = [abs(p - q) for p, q in pairs if p != q]
    return [strip(t) for t in x] == [strip(t) for t in y], len(apart), len(pairs), max(apart, default=0.0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", help="the commit to compare against")
    p.add_argument("--out", default="/tmp/bench_step", help="where both sides write (and the BASE clone)")
    p.add_argument("--n-tasks", type=int, default=15, help="the evaluation's tasks a domain")
    args = p.parse_args()
    clone = os.path.join(args.out, "clone")
    if not os.path.isdir(clone):
        subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    subprocess.run(["git", "-C", clone, "checkout", "-q", args.base], check=True)
    times = {}
    for side, cwd in (("base", clone), ("here", ROOT)):
        os.makedirs(f"{args.out}/{side}", exist_ok=True)
        times[side] = run(side, cwd, f"{args.out}/{side}", args.n_tasks)
    b, h = times["base"], times["here"]
    for part in ("step", "rollouts", "update", "eval"):
        print(f"{part:9s} base {b[part]:7.1f} s  here {h[part]:7.1f} s  x{b[part] / h[part]:.2f}")
    for part in ("step", "eval"):
        print(f"{part} peak  base {b[f'{part} peak GiB']:.1f} GiB  here {h[f'{part} peak GiB']:.1f} GiB")
    print(f"outside the step (process start, model load, saving): base {b['step'] - b['rollouts'] - b['update']:.1f} s"
          f"  here {h['step'] - h['rollouts'] - h['update']:.1f} s")
    ok = True
    rollouts = sorted(os.listdir(f"{args.out}/base/rl/rollouts"))
    episodes = sorted(f for f in os.listdir(f"{args.out}/base/eval") if f.startswith("episodes_"))
    for kind, folder, names in (("rollouts", "rl/rollouts", rollouts), ("episodes", "eval", episodes)):
        seen = [compare_files(f"{args.out}/base/{folder}/{n}", f"{args.out}/here/{folder}/{n}") for n in names]
        print(f"{kind}: {sum(s[0] for s in seen)} of {len(names)} files the same token for token (every field but "
              f"log-probs and seconds); log-probs: {sum(s[1] for s in seen)} of {sum(s[2] for s in seen)} differ, "
              f"by at most {max((s[3] for s in seen), default=0):.2e}")
        ok &= all(s[0] for s in seen) and bool(names)
    adapters = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "same_adapters.py"),
                               f"{args.out}/base/rl/adapter", f"{args.out}/here/rl/adapter"])
    sys.exit(0 if ok and adapters.returncode == 0 else 1)


if __name__ == "__main__":
    main()
