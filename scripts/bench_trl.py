"""One GRPO step of rl.py against one of scripts/rl_trl.py (TRL's GRPOTrainer), side by side, in one run on one machine.

Both sides: the same model (--init base), the same train tasks (the first --tasks/2 easy train tasks of retail and of
airline: both stages' train pools are cut to exactly those, so each draws all of them), the same group size, turn
cap, tokens per turn, temperature, learning rate, micro-batch and fp32 update (rl.py --train-bf16 off). Each runs as
its own subprocess (`python scripts/bench_trl.py --child STAGE ...` -> STAGE.main(argv)), so its peak RSS is its own
(os.wait4). By default rollout t of each group scores t % 2, so every group has reward variance and both update on
every group (rl.py skips groups without variance, TRL does not): this measures cost, not learning; --real-rewards
keeps Env.reward.

What each side does in its step: rl.py samples with its own sampler (KV kept between turns, the system prompt
prefilled once) and runs the update once over the shared system prompt, with no reference pass on step 1 (the
reference is the policy); scripts/rl_trl.py samples through TRL's transformers generate (the whole conversation fed again
each turn) and TRL runs a reference pass, then the loss pass, over every full sequence.

Run:  python scripts/bench_trl.py                     # 2 tasks x 4 rollouts, 3 turns, 32 tokens a turn
      python scripts/bench_trl.py --model PATH --tasks 4 --group-size 8
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
from kernels import harness  # noqa: E402


def child(stage: str, task_ids: list[str], real_rewards: bool, argv: list[str]):
    """In the subprocess: cut the train pools to task_ids, optionally give every group variance, run STAGE.main."""
    import rollout
    import envs
    make_tasks = envs.make_tasks
    envs.make_tasks = lambda domain, split, n, tiers=None, seed=0: [
        t for t in make_tasks(domain, split, n, tiers, seed) if split != "train" or t.id in task_ids]
    if not real_rewards:
        run_episodes = rollout.run_episodes

        def by_trial(*a, **k):
            trajs = run_episodes(*a, **k)
            for t in trajs:
                t.reward = float(t.trial % 2)
            return trajs
        rollout.run_episodes = by_trial
    module = importlib.import_module("scripts.rl_trl" if stage == "rl_trl" else stage)   # scale-out lives in scripts/
    if stage == "rl_trl":              # the step's wall time, rollout + update + optimizer step, as rl.py's s_per_step
        from transformers import TrainerCallback
        build, out = module.build_trainer, argv[argv.index("--out") + 1]

        class StepClock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t0 = time.time()

            def on_step_end(self, *a, **k):
                with open(os.path.join(out, "step_seconds.json"), "w") as f:
                    json.dump(time.time() - self.t0, f)

        def build_trainer(args):
            trainer = build(args)
            trainer.add_callback(StepClock())
            return trainer
        module.build_trainer = build_trainer
    module.main(argv)


def run(stage, task_ids, args, argv):
    """-> (wall seconds, peak RSS GiB, return code) of `python scripts/bench_trl.py --child STAGE ...`."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", stage, "--task-ids", ",".join(task_ids)] + \
        (["--real-rewards"] if args.real_rewards else []) + ["--"] + argv
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1"))
    wall, (_, status, usage) = harness.timed(lambda: os.wait4(proc.pid, 0))   # its own rusage: ru_maxrss in KiB
    return wall, usage.ru_maxrss / 2**20, os.waitstatus_to_exitcode(status)


def task_ids(tasks: int) -> list[str]:
    """The first tasks/2 easy train tasks of retail and of airline."""
    import envs
    return [t.id for d in ("retail", "airline") for t in envs.make_tasks(d, "train", 1000, ["easy"])[:tasks // 2]]


def stage_argv(stage: str, args, out: str) -> list[str]:
    """STAGE.main's flags: the settings both sides share, then the stage's own (rl.py: one batch of exactly the
    step's tasks, one optimizer step on them as TRL's, no held-out curve, an fp32 update), then --out. The workload is
    fixed here, not taken from the CPU presets, so the measurement stays comparable when the default changes."""
    shared = ["--init", "base", "--steps", "1", "--domains", "retail,airline", "--tiers", "easy", "--user", "scripted",
              "--tasks", str(args.tasks), "--group-size", str(args.group_size), "--max-turns", str(args.max_turns),
              "--max-new-tokens", str(args.max_new_tokens), "--max-context", str(args.max_context),
              "--micro-batch", str(args.micro_batch), "--temperature", "1.0", "--lr", "1e-4",
              "--grad-checkpointing", "off"] + (["--model", args.model] if args.model else [])
    own = ["--draw", str(args.tasks), "--max-draws", "1", "--mini-batches", "1", "--eval-every", "0",
           "--train-bf16", "off"] if stage == "rl" \
        else ["--vllm", "off"]             # scripts/rl_trl.py's GPU preset colocates vLLM: both sides generate on their own
    return shared + own + ["--out", out]


def step_row(stage: str, out: str, args, wall: float, rss: float) -> dict:
    """One side's step from what it wrote under out: seconds (wall, step, rollout, update), sampled tokens, peak RSS."""
    m = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))][-1]
    if stage == "rl":
        step, roll, tokens, trained = m["s_per_step"], m["rollout_s"], m["tokens"], m["groups_trained"] * args.group_size
    else:
        step = json.load(open(os.path.join(out, "step_seconds.json")))
        roll, tokens = m["rollout_s"], round(m["completions/mean_length"] * args.tasks * args.group_size)
        trained = args.tasks * args.group_size
    return dict(wall=wall, step=step, rollout=roll, update=step - roll, tokens=tokens, tok_s=tokens / roll, rss=rss,
                trained=trained, metrics=m)


def main():
    p = common.Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model of both sides (default: the bundled SmolLM2)")
    p.add_argument("--tasks", type=int, default=2, help="tasks in the step, half retail, half airline")
    p.add_argument("--group-size", type=int, default=4, help="rollouts per task")
    p.add_argument("--max-turns", type=int, default=3, help="agent turns per episode")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per agent turn")
    p.add_argument("--max-context", type=int, default=3072, help="episode token limit")
    p.add_argument("--micro-batch", type=int, default=2, help="rows per forward/backward, both sides")
    p.add_argument("--real-rewards", action="store_true", help="Env.reward (rl.py then trains only groups with variance)")
    p.add_argument("--out", default=None, help="where both runs write (default: a temp dir)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--task-ids", default="", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.child:
        return child(args.child, args.task_ids.split(","), args.real_rewards, [a for a in rest if a != "--"])
    if args.tasks % 2:
        raise SystemExit(f"--tasks {args.tasks}: use an even number (half retail, half airline)")
    ids = task_ids(args.tasks)
    out = args.out or tempfile.mkdtemp(prefix="bench_trl-")
    print(f"tasks {ids} x {args.group_size} rollouts, {args.max_turns} turns, {args.max_new_tokens} tokens a turn; "
          f"rewards {'Env.reward' if args.real_rewards else 'rollout t scores t % 2'}; out {out}", flush=True)
    rows = {}
    for stage in ("rl", "rl_trl"):
        wall, rss, rc = run(stage, ids, args, stage_argv(stage, args, os.path.join(out, stage)))
        if rc:
            raise SystemExit(f"{stage}.py exited with {rc}; see its output above")
        rows[stage] = step_row(stage, os.path.join(out, stage), args, wall, rss)
    print(f"\n{'':>12} {'wall s':>8} {'step s':>8} {'rollout s':>10} {'update s':>9} {'sampled':>8} "
          f"{'tok/s':>7} {'peak RSS GiB':>13} {'rows trained':>13}")
    for name, r in (("rl.py", rows["rl"]), ("scripts/rl_trl.py", rows["rl_trl"])):
        print(f"{name:>12} {r['wall']:8.1f} {r['step']:8.1f} {r['rollout']:10.1f} {r['update']:9.1f} {r['tokens']:8d} "
              f"{r['tok_s']:7.2f} {r['rss']:13.2f} {r['trained']:13d}")
    a, b = rows["rl_trl"], rows["rl"]
    print(f"{'trl / rl':>12} {a['wall'] / b['wall']:8.2f} {a['step'] / b['step']:8.2f} {a['rollout'] / b['rollout']:10.2f} "
          f"{a['update'] / max(b['update'], 1e-9):9.2f} {'':>8} {a['tok_s'] / b['tok_s']:7.2f} {a['rss'] / b['rss']:13.2f}")
    print("(tok/s = sampled tokens / rollout seconds; update = step - rollout; sampled counts differ: each side "
          "samples its own conversations)")
    return rows


if __name__ == "__main__":
    main()
