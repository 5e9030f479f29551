"""scripts/claims_report.py: the second claims experiment's bar is computed from the evaluation's per-task values as
pre-registered (the held-out personas' episodes of a task pooled, paired task by task), on made-up results."""
import json
import os

from scripts import claims_report


def fake_results(out, cells):
    """cells: {(arm, user): {task: pass1}}; facts asked for is pass1 too, the other metrics 1.0."""
    agents = {}
    for (arm, user), per_task in cells.items():
        values = {t: [v] for t, v in per_task.items()}
        agents[f"{out}/{arm}/adapter @ {user}"] = {"user": user, "tau": {"metrics": {
            m: values if m in ("pass1", "facts_asked") else {t: [1.0] for t in per_task}
            for m in claims_report.METRICS}}}
    os.makedirs(os.path.join(out, "eval"))
    json.dump({"agents": agents, "paired": {}, "ceiling": {}}, open(os.path.join(out, "eval", "results.json"), "w"))


def test_the_bar_pools_the_held_out_personas_by_task_and_says_met_or_missed(tmp_path, capsys):
    out = str(tmp_path)
    tasks = [f"t{i}" for i in range(10)]
    sft = {t: 0.0 for t in tasks}
    rl = {t: float(i < 5) for i, t in enumerate(tasks)}         # solves 5 of 10 under curious
    one = {t: float(i < 2) for i, t in enumerate(tasks)}
    fake_results(out, {("sft", "scripted:curious"): sft, ("sft", "scripted:literal"): sft,
                       ("rl", "scripted:curious"): rl, ("rl", "scripted:literal"): sft,
                       ("rl_one", "scripted:curious"): one, ("rl_one", "scripted:literal"): sft})
    claims_report.main(out)
    printed = capsys.readouterr().out
    # pooled: RL 5 of 20 held-out episodes, SFT 0 -> +0.250; every task with a win is a task won
    line = next(x for x in printed.splitlines() if "RL(a) - SFT, pass^1:" in x)
    assert line.startswith("  RL(a) - SFT, pass^1: +0.250 [+") and "(5 won, 0 lost)" in line and line.endswith(": MET")
    assert "RL(a) - SFT, facts asked for: +0.250" in printed and "(>= +0.10): MET" in printed
    assert "RL(a) - RL(b), pass^1 (vary the user; no threshold): +0.150" in printed
    # the between-arms table pairs the same way, and prints a dash where an arm is not evaluated yet
    assert ("(a) RL, training personas - (b) RL, one persona (default), held-out personas: +0.150 [" in printed
            and "(3 won, 0 lost)" in printed)
    assert "(a) RL, training personas - (d) RL from the base model, held-out personas: -; -" in printed
    assert os.path.exists(os.path.join(out, "claims.png"))


def test_a_cell_not_yet_evaluated_prints_as_a_dash(tmp_path, capsys):
    out = str(tmp_path)
    fake_results(out, {("sft", "scripted:curious"): {"t0": 1.0}})             # literal and RL not run yet
    claims_report.main(out)
    assert "RL(a) - SFT, pass^1: - (>= +0.10, CI above 0): -" in capsys.readouterr().out
