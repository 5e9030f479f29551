"""scripts/steps.sh, the pre-registered K-step experiment (docs/steps_preregistration.md): its evaluation command runs
in --smoke form on three adapters (the cold start, step 1, step K) of a tiny Qwen3 (the bundled model would take
minutes to prefill the system prompts), and scripts/steps_report.py prints the bar from what it wrote, with the
paired differences under the held-out personas pooled task by task, and each agent's pass^1 by user and domain
with how its episodes stopped."""
import json
import os
import re
import shutil
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_preregistered_evaluation_runs_in_smoke_form_and_the_report_prints_the_bar(tmp_path):
    import rollout
    from tiny_qwen3 import save_tiny_qwen3
    out, tiny = tmp_path / "steps", save_tiny_qwen3(str(tmp_path / "tiny"))
    model, _ = rollout.load_model(tiny)
    torch.manual_seed(0)
    rollout.add_lora(model, r=16, alpha=32).save_pretrained(out / "sft" / "adapter")   # a fresh adapter: B = 0
    for k in (1, 2):                      # steps.sh skips a part whose adapter is there: only the evaluation runs
        shutil.copytree(out / "sft" / "adapter", out / f"step-{k}")
    (out / "rl").mkdir()
    (out / "rl" / "metrics.jsonl").write_text(json.dumps(dict(step=0, heldout_by_user={"scripted:train": 0.5})) + "\n")
    env = {**os.environ, "SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable, "MODEL": tiny}
    run = subprocess.run(["bash", "scripts/steps.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(run.stdout[-3000:], run.stderr[-2000:])
    assert run.returncode == 0
    agents = json.load(open(out / "eval" / "results.json"))["agents"]
    want = {f"{out}/{a} @ {u}" for a in ("sft/adapter", "step-1", "step-2")
            for u in ("scripted:curious", "scripted:literal", "scripted:train")}
    assert set(agents) == want                                   # every agent under every user, one trial a task
    # three copies of one adapter on the same tasks and user seeds: every paired difference is exactly 0
    bar = run.stdout[run.stdout.index("the bar"):]
    assert "held-out personas: +0.000 [+0.000, +0.000]" in bar and "(>= +0.10, CI above 0): MISSED" in bar
    assert "training personas: +0.000 [+0.000, +0.000]" in bar and "(not below 0): MET" in bar
    table = run.stdout[run.stdout.index("by user and domain"):run.stdout.index("the bar")]
    rows = [line.split(" | ")[1:] for line in table.splitlines() if line.startswith(("| SFT", "| RL"))]
    assert len(rows) == 3 and all(re.match(r"[\d.]+ / [\d.]+ \(\w+ \d+", cell) for row in rows for cell in row)
    assert os.path.exists(out / "eval" / "steps.png")
