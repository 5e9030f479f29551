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

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow      # the first two attempts' recipe (finished, frozen): an evaluation of three agents, ~17 s alone
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


@pytest.mark.slow      # the third and fourth attempts' recipe (finished, frozen): four agents x four user sets, ~40 s
def test_the_third_attempts_two_arms_evaluate_paired_and_the_report_prints_the_2x2_and_the_bar(tmp_path):
    """scripts/arms.sh in --smoke form, every arm's adapters already there (the cold start and K = 2 steps of a tiny
    Qwen3, all one fresh adapter): one evaluation of the four agents under the held-out personas, the training ones
    and the population, then scripts/arms_report.py's 2x2, the effect under each held-out persona alone, and the bar,
    each paired difference exactly 0 (four copies of one adapter on the same tasks and user seeds)."""
    import rollout
    from tiny_qwen3 import save_tiny_qwen3
    out, tiny = tmp_path / "arms", save_tiny_qwen3(str(tmp_path / "tiny"))
    model, _ = rollout.load_model(tiny)
    torch.manual_seed(0)
    adapter = out / "broad" / "sft" / "adapter"
    rollout.add_lora(model, r=16, alpha=32).save_pretrained(adapter)
    for where in ("broad/step-1", "broad/step-2", "narrow/sft/adapter", "narrow/step-1", "narrow/step-2"):
        shutil.copytree(adapter, out / where)
    for arm in ("broad", "narrow"):
        (out / arm / "rl").mkdir()
        step = dict(step=1, reward=0.5, groups_varied=1, groups_drawn=2, kl=0.001, clip_frac=0.0, rollout_s=1.0,
                    train_s=1.0, s_per_step=2.0, by_user={"gives=one_first": dict(n=4, reward=0.5, asked=1.0)})
        (out / arm / "rl" / "metrics.jsonl").write_text(json.dumps(step) + "\n")
    sums = subprocess.run(["sha256sum", "sft/adapter/adapter_model.safetensors", "step-2/adapter_model.safetensors"],
                          cwd=out / "narrow", capture_output=True, text=True, check=True).stdout
    (tmp_path / "narrow.sha256").write_text(sums)             # the fourth attempt reuses the third's narrow arm
    env = {**os.environ, "SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable, "MODEL": tiny, "K": "2",
           "NARROW_SHA256": str(tmp_path / "narrow.sha256")}
    run = subprocess.run(["bash", "scripts/arms.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(run.stdout[-4000:], run.stderr[-2000:])
    assert run.returncode == 0
    agents = json.load(open(out / "eval" / "results.json"))["agents"]
    users = ("scripted:curious", "scripted:literal", "scripted:train", "scripted:population")
    assert set(agents) == {f"{out}/{a} @ {u}" for a in ("broad/sft/adapter", "broad/step-2", "narrow/sft/adapter",
                                                         "narrow/step-2") for u in users}
    said = run.stdout
    assert "by user, reward / asked before writing / asked again (n): gives=one_first 0.50 / 1.00 / - (4)" in said
    for pool in ("held-out personas", "training personas", "training population", "held-out: curious",
                 "held-out: literal"):
        table = said[said.index(f"\n{pool}"):]
        rows = [line for line in table.splitlines()[2:8] if line.startswith("| ")]   # the header, then four rows
        assert [r.split(" ")[1] for r in rows] == ["training", "narrow", "broad", "broad", "broad"], rows
        assert all(row.endswith("+0.000 [+0.000, +0.000] (0 won, 0 lost, p = 1.000) |") for row in rows[1:]), rows
    bar = said[said.index("the bar"):]
    assert "held-out personas: +0.000 [+0.000, +0.000]" in bar and "(>= +0.10, CI above 0): MISSED" in bar
    assert "training personas: +0.000 [+0.000, +0.000]" in bar and "(not below 0): MET" in bar
    domains = said[said.index("\nper domain"):].splitlines()[4:10]   # past a blank line, the title, header and rule
    assert [r.split(" | ")[1] for r in domains] == ["retail", "airline"] * 3, domains
    assert all(r.count("+0.000 [+0.000, +0.000]") == 2 for r in domains), domains
    assert os.path.exists(out / "eval" / "arms.png")
    (tmp_path / "narrow.sha256").write_text(sums.replace(sums[:8], "0" * 8, 1))   # a narrow file that differs
    run = subprocess.run(["bash", "scripts/arms.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 1 and "differs from" in run.stdout, run.stdout[-2000:]

    # the published copies, named with AGENTS=: no arm's folder, no step trained, no sums; the report names them
    published, names = tmp_path / "published", ["broad-sft", "broad-step-2", "narrow-sft", "narrow-step-2"]
    for name in names:
        shutil.copytree(adapter, published / name)
    env = {**env, "OUT": str(tmp_path / "arms_published"), "AGENTS": ",".join(str(published / n) for n in names)}
    run = subprocess.run(["bash", "scripts/arms.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    agents = json.load(open(tmp_path / "arms_published" / "eval" / "results.json"))["agents"]
    assert set(agents) == {f"{published}/{n} @ {u}" for n in names for u in users}
    assert not (tmp_path / "arms_published" / "broad").exists()
    bar = run.stdout[run.stdout.index("the bar"):]
    assert "held-out personas: +0.000 [+0.000, +0.000]" in bar and "(>= +0.10, CI above 0): MISSED" in bar


@pytest.mark.slow      # the fifth attempt's recipe (finished, frozen): runs.sh's runs, evaluations and report, ~36 s
def test_the_fifth_attempts_runs_publish_evaluate_paired_and_the_report_prints_every_run_and_the_bar(tmp_path):
    """scripts/runs.sh in --smoke form on a tiny Qwen3, every run's K = 2 steps already there (one fresh adapter, so
    every agent is the same policy): each run's step K published as bf16, one evaluation under the held-out
    population (two trials a task) and one under each named held-out persona and the training personas, then
    scripts/runs_report.py: every run's pass^1, each comparison exactly 0 with P(improvement) 0.5 (all ties), and
    the bar; RUNS= trains only the runs it names and evaluates nothing; no INIT is one line."""
    import rollout
    from tiny_qwen3 import save_tiny_qwen3
    out, tiny = tmp_path / "arms5", save_tiny_qwen3(str(tmp_path / "tiny"))
    model, _ = rollout.load_model(tiny)
    torch.manual_seed(0)
    cold = tmp_path / "cold"
    rollout.add_lora(model, r=16, alpha=32).save_pretrained(cold)
    runs = [f"{arm}-s{s}" for s in (0, 1) for arm in ("narrow", "broad")]
    for run in runs:
        for k in (1, 2):
            shutil.copytree(cold, out / run / f"step-{k}")
        (out / run / "rl").mkdir()
        step = dict(step=1, reward=0.5, groups_varied=1, groups_drawn=2, kl=0.001, clip_frac=0.0, rollout_s=1.0,
                    train_s=1.0, s_per_step=2.0, repeated_questions=1.5,
                    by_user={"chatty": dict(n=4, reward=0.5, asked=1.0, repeated=2.0)})
        (out / run / "rl" / "metrics.jsonl").write_text(json.dumps(step) + "\n")
    env = {**os.environ, "SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable, "MODEL": tiny, "K": "2",
           "SEEDS": "0 1", "INIT": str(cold)}
    run = subprocess.run(["bash", "scripts/runs.sh"], cwd=REPO, env={**env, "RUNS": "narrow-s0"},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and (out / "published" / "narrow-s0-step-2").is_dir(), run.stderr[-2000:]
    assert not (out / "published" / "broad-s0-step-2").exists() and not (out / "eval-population").exists()
    run = subprocess.run(["bash", "scripts/runs.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(run.stdout[-5000:], run.stderr[-2000:])
    assert run.returncode == 0
    sources = (out / "published" / "SOURCES.md").read_text()
    assert "python rl.py --user scripted:population --eval-every 4 --seed 1 --init" in sources
    population = json.load(open(out / "eval-population" / "results.json"))["agents"]
    assert set(population) == {str(cold)} | {f"{out}/published/{r}-step-2" for r in runs}
    assert all(len(trials) == 2 for a in population.values() for trials in a["tau"]["metrics"]["pass1"].values())
    said = run.stdout
    assert "by user, reward / asked before writing / asked again (n): chatty 0.50 / 1.00 / 2.0 (4)" in said
    assert "asked again 1.50 a conversation" in said
    for title in ("held-out population (2 draws a task)", "held-out: curious", "held-out: literal",
                  "held-out: mindful", "training personas"):
        block = said[said.index(f"\n{title}: pass^1"):]
        rows = [line for line in block.splitlines()[1:20] if line.startswith("| ") and " RL - " in line]
        means = [line for line in block.splitlines()[1:20] if "RL, mean over 2 runs" in line]
        assert [m.split(",")[0] for m in means] == ["| narrow RL", "| broad RL"], block[:2000]
        assert [r.split(" | ")[0] for r in rows] == ["| narrow RL - SFT", "| broad RL - SFT",
                                                     "| broad RL - narrow RL"], rows
        assert all("+0.000 [+0.000, +0.000], P(improvement) 0.50 [0.50, 0.50]" in r for r in rows), rows
    bar = said[said.index("the bar"):]
    assert "not final: 2 narrow runs of 3; 2 broad runs of 3; 2 tasks of 60" in bar          # no verdict on it
    assert "(>= +0.10, CI above 0): -" in bar and "half-width (CI's width / 2) 0.000 (<= 0.08: -)" in bar
    assert (out / "runs.png").exists()
    del env["INIT"]
    run = subprocess.run(["bash", "scripts/runs.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "set INIT" in run.stderr


def test_the_two_level_bootstrap_and_the_probability_of_improvement_on_known_numbers():
    """scripts/runs_report.py's statistics on hand-made runs: a difference is the mean over runs of the mean over
    tasks; its CI widens when the runs disagree though their mean is the same, and so does one arm's (the picture's
    whisker); P(improvement) counts ties as half; runs_needed grows with the runs' spread."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import runs_report as rr
    import numpy as np
    cold = np.zeros((1, 40))
    alike = np.tile(np.r_[np.ones(20), np.zeros(20)], (3, 1))              # three runs, each 0.5
    apart = np.stack([np.ones(40), np.r_[np.ones(20), np.zeros(20)], np.zeros(40)])   # runs 1.0, 0.5, 0.0
    a, b = rr.compare(alike, cold, n_boot=2000), rr.compare(apart, cold, n_boot=2000)
    assert a["diff"] == b["diff"] == 0.5
    assert (a["ci"][1] - a["ci"][0]) < (b["ci"][1] - b["ci"][0])          # the runs' spread widens the CI
    assert a["run_sd"][0] == 0 and b["run_sd"][0] == 0.5                  # the per-run means 1, 0.5, 0
    assert rr.improvement(alike, cold) == 0.5 + 0.5 * 0.5                 # half the tasks won, half tied
    assert rr.improvement(cold, cold) == 0.5
    (lo, hi), (lo_alike, hi_alike) = rr.mean_ci(apart, n_boot=2000), rr.mean_ci(alike, n_boot=2000)   # whiskers
    assert lo < 0.5 < hi and hi - lo > hi_alike - lo_alike
    assert rr.mean_ci(np.full((3, 40), 0.25), n_boot=200) == [0.25, 0.25]
    assert rr.runs_needed(dict(task_half=0.05, run_sd=[0.0, 0.0])) == 1        # the runs agree: one is enough
    assert rr.runs_needed(dict(task_half=0.05, run_sd=[0.1, 0.1])) == 20       # 1.96 sqrt(.05^2/1.96^2 + .02/n) <= .08
    assert rr.runs_needed(dict(task_half=0.10, run_sd=[0.0, 0.0])) is None     # the tasks alone are wider
    assert rr.runs_needed(dict(task_half=0.05, run_sd=[0.5, 0.5])) == 493      # more than a hundred: still a number


def test_the_bar_meets_at_exactly_its_threshold_and_gives_no_verdict_on_an_incomplete_design(capsys):
    """runs_report.bar: three runs 0.1 above the cold start MEET '>= +0.10' though 0.5 - 0.4 is 0.0999... in floats;
    a half-width over 0.08 says how many runs would do; a design short of its runs or tasks prints no verdict."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import runs_report as rr
    import numpy as np
    cold, runs = np.full((1, 60), 0.4), np.full((3, 60), 0.5)
    wide = dict(diff=0.0, ci=[-0.1, 0.1], poi=0.5, poi_ci=[0.4, 0.6], task_half=0.05, run_sd=[0.1, 0.1])
    rr.bar({"narrow RL - SFT": rr.compare(runs, cold, n_boot=200), "broad RL - narrow RL": wide})
    said = capsys.readouterr().out
    assert "+0.100 [+0.100, +0.100], P(improvement) 1.00 [1.00, 1.00] (each run: +0.100, +0.100, +0.100)" in said
    assert "(>= +0.10, CI above 0): MET" in said and "not final" not in said
    assert "half-width (CI's width / 2) 0.100 (<= 0.08: MISSED: about 20 runs an arm would give it" in said
    rr.bar({"narrow RL - SFT": rr.compare(runs, cold, n_boot=200)}, "2 broad runs of 3")
    said = capsys.readouterr().out
    assert "not final: 2 broad runs of 3" in said and "CI above 0): -" in said


def test_the_picture_draws_one_user_set_as_well_as_several(tmp_path):
    """runs_report.picture: the held-out population alone (the evaluation's first half, before the personas) is a
    picture of one panel; matplotlib hands back a bare Axes for one column unless common.figure tells it not to."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import runs_report as rr
    row = {"cold": 0.4, "narrow": [0.5, 0.6, 0.4], "broad": [0.55, 0.6, 0.5],
           "narrow ci": [0.38, 0.62], "broad ci": [0.48, 0.62]}
    for n in (1, 2):
        path = tmp_path / f"runs-{n}.png"
        rr.picture(str(path), {f"user set {i}": row for i in range(n)}, 8)
        assert path.stat().st_size > 1000
