"""scripts/runs.sh, the experiment runner (docs/steps_preregistration.md, "The sixth attempt"), and
scripts/runs_report.py, its report: the statistics on hand-made numbers, the bar at its edges, the picture, and the
whole recipe in --smoke form on a tiny Qwen3 (-m slow); scripts/habits.py, the habits read from the conversations."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import habits  # noqa: E402
import runs_report as rr  # noqa: E402


def test_the_two_level_ci_widens_with_the_runs_spread_and_the_t_interval_is_the_per_run_differences():
    """A difference is the mean over runs of the mean over tasks; runs that disagree widen its CI though their mean
    is the same; against one agent, each run's difference, their t-interval (mean +- t(0.975, n - 1) sd / sqrt(n),
    by hand) and the runs below it; P(improvement) counts ties as half."""
    cold = np.zeros((1, 40))
    alike = np.tile(np.r_[np.ones(20), np.zeros(20)], (3, 1))                  # three runs, each 0.5
    apart = np.stack([np.ones(40), np.r_[np.ones(20), np.zeros(20)], np.zeros(40) - 0.0])   # 1.0, 0.5, 0.0
    a, b = rr.compare(alike, cold, n_boot=2000), rr.compare(apart, cold, n_boot=2000)
    assert a["diff"] == b["diff"] == 0.5
    assert (a["ci"][1] - a["ci"][0]) < (b["ci"][1] - b["ci"][0])
    assert a["t"] == [0.5, 0.5] and a["below"] == 0
    assert b["per_run"] == [1.0, 0.5, 0.0] and b["run_sd"][0] == 0.5
    assert b["t"] == pytest.approx([0.5 - 4.303 * 0.5 / 3 ** 0.5, 0.5 + 4.303 * 0.5 / 3 ** 0.5])
    assert rr.improvement(alike, cold) == 0.5 + 0.5 * 0.5 and rr.improvement(cold, cold) == 0.5
    below = rr.compare(np.stack([np.full(40, 0.2), np.full(40, 0.6)]), np.full((1, 40), 0.4), n_boot=200)
    assert below["below"] == 1 and below["per_run"] == pytest.approx([-0.2, 0.2])
    assert rr.mean_ci(np.full((3, 40), 0.25), n_boot=200) == [0.25, 0.25]


def test_the_bar_needs_the_mean_and_every_broad_run_and_gives_no_verdict_on_an_incomplete_design(capsys):
    """runs_report.bar: four broad runs 0.1 above the cold start MEET '>= +0.10' (though 0.5 - 0.4 is 0.0999... in
    floats); the same mean with one run at the cold start MISSES it; a design short of its runs prints no verdict."""
    cold = np.full((1, 60), 0.4)
    assert rr.bar({"broad RL - SFT": rr.compare(np.full((4, 60), 0.5), cold, n_boot=200)}, "") == "MET"
    said = capsys.readouterr().out
    assert "+0.100 [+0.100, +0.100], P(improvement) 1.00 [1.00, 1.00]; t-interval [+0.100, +0.100]" in said
    one_at_cold = np.stack([np.full(60, 0.4)] + [np.full(60, 0.5333333333333333)] * 3)   # mean +0.100, one run +0
    c = rr.compare(one_at_cold, cold, n_boot=200)
    assert round(c["diff"], 9) == 0.1 and c["ci"][0] > 0
    assert rr.bar({"broad RL - SFT": c}, "") == "MISSED"
    assert rr.bar({"broad RL - SFT": rr.compare(np.full((3, 60), 0.5), cold, n_boot=200)}, "3 broad runs of 4") == "-"
    assert "not final: 3 broad runs of 4" in capsys.readouterr().out


def test_the_picture_draws_step_k_alone_and_with_the_later_steps_and_the_sampled_points(tmp_path):
    """runs_report.picture: the held-out population at step K alone (before the other evaluations), and with the broad
    runs' later steps, the sampled points and the named personas beside it."""
    row = {"cold": 0.4, "narrow": [0.5, 0.6, 0.4, 0.3], "broad": [0.55, 0.6, 0.5, 0.7],
           "narrow ci": [0.35, 0.62], "broad ci": [0.48, 0.68]}
    curve = {s: {"runs": [0.5, 0.6, 0.55, 0.7], "ci": [0.45, 0.7]} for s in (8, 12, 16)}
    sample = {"pass^1": {"cold": 0.3, 16: {"runs": [0.4, 0.5, 0.45, 0.6]}}}
    for name, args in (("alone", ({rr.POPULATION: row}, {}, {})),
                       ("all", ({rr.POPULATION: row, "held-out: curious": row}, curve, sample))):
        path = tmp_path / f"{name}.png"
        rr.picture(str(path), *args)
        assert path.stat().st_size > 1000


def conversation(reward, *turns):
    """A saved conversation: turns are (role, text) or ("call", name, {argument: value}); tool errors counted, and
    a malformed call is a tool message "Error: tool call is not valid JSON"."""
    msgs = [{"role": "system", "content": "Tools: get_order_details(order_id)."}]
    for t in turns:
        msgs.append({"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": [
            {"name": t[1], "arguments": t[2]}]} if t[0] == "call" else {"role": t[0], "content": t[1]})
    errors = [m["content"] for m in msgs if m["role"] == "tool" and m["content"].startswith("Error")]
    malformed = sum("not valid JSON" in e for e in errors)
    return {"messages": msgs, "reward": reward, "stats": {"tool_errors": len(errors) - malformed,
                                                          "malformed_calls": malformed}}


def test_habits_count_asking_once_made_up_ids_and_claimed_success_a_row_a_step_or_agent(tmp_path, capsys):
    """scripts/habits.py on hand-made conversations: one that asks only in its first message, then calls with an id
    nobody gave ("order_id", which only the system prompt shows) and ends "Done" unsolved; one that asks twice and
    calls with the id the user gave, solved. A row a step from rollouts/, a row an agent from episodes_*.jsonl; a
    folder with neither is one line and exit 2."""
    once = conversation(0.0, ("user", "Hi, change my order."), ("assistant", "Please give me your order id."),
                        ("user", "It is #W12."), ("call", "get_order_details", {"order_id": "order_id"}),
                        ("tool", "Error: order not found"), ("assistant", "<tool_call>{\"name\": }</tool_call>"),
                        ("tool", "Error: tool call is not valid JSON"), ("assistant", "Done: your order is changed."))
    twice = conversation(1.0, ("user", "Hi."), ("assistant", "Could you tell me your email?"),
                         ("user", "a@b.c"), ("assistant", "Thanks. Which order id, please?"), ("user", "#W12"),
                         ("call", "get_order_details", {"order_id": "#W12"}), ("tool", "{\"status\": \"pending\"}"))
    h = habits.habits([once, twice])
    assert h == {"convs": 2, "solved": 0.5, "asks": 1.5, "asks_once": 0.5, "made_up": 0.5, "tool_errors": 0.5,
                 "malformed": 0.5, "says_done": 1.0}
    assert habits.made_up_calls(twice["messages"]) == 0 and habits.made_up_calls(once["messages"]) == 1
    (tmp_path / "rl" / "rollouts").mkdir(parents=True)
    for step, convs in ((1, [twice]), (2, [once, twice]), (10, [once])):
        (tmp_path / "rl" / "rollouts" / f"step-{step:06d}-draw-0.jsonl").write_text(
            "".join(json.dumps(c) + "\n" for c in convs))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "episodes_sft.jsonl").write_text(json.dumps(twice) + "\n")
    habits.main([str(tmp_path / "rl")])
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[:3] for r in rows[1:]] == [["step 1", "1", "1.000"], ["step 2", "2", "0.500"], ["step 10", "1", "0.000"]]
    header, step10 = rows[0], dict(zip(rows[0], rows[3]))
    assert header[3:] == ["asks", "asks_once", "made_up", "tool_errors", "malformed", "says_done"]
    assert step10["asks_once"] == step10["made_up"] == "1.000"           # step 10 is the conversation that asks once
    habits.main([str(tmp_path / "eval")])
    assert capsys.readouterr().out.splitlines()[1].split("\t")[:2] == ["sft", "1"]
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "habits.py"), str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not r.stdout


@pytest.mark.slow      # the recipe: a real rl.py run, four evaluation folders and the report, ~1-2 min
def test_the_runner_trains_publishes_evaluates_each_agent_with_its_cpu_and_the_report_reads_it_all(tmp_path):
    """scripts/runs.sh in --smoke form on a tiny Qwen3 (K = 2, the broad runs on to 3), seeds 20 and 21: RUNS= trains
    only the run it names, for real, and evaluates nothing; then every run (the others' checkpoints already there:
    copies of one fresh adapter, so every agent is the same policy) published as bf16 with its command, each agent
    evaluated by itself with the CPU that ran it, the tables over all agents, and the report: every comparison exactly
    0 (all ties), no verdict on a short design. No INIT is one line."""
    import rollout
    from tiny_qwen3 import save_tiny_qwen3
    out, tiny = tmp_path / "arms6", save_tiny_qwen3(str(tmp_path / "tiny"))
    model, _ = rollout.load_model(tiny)
    torch.manual_seed(0)
    cold = tmp_path / "cold"
    rollout.add_lora(model, r=16, alpha=32).save_pretrained(cold)
    env = {**os.environ, "SMOKE": "1", "OUT": str(out), "PYTHON": sys.executable, "MODEL": tiny, "K": "2",
           "LONG": "3", "LATER": "3", "SEEDS": "20 21", "TRIALS": "2", "INIT": str(cold)}
    run = subprocess.run(["bash", "scripts/runs.sh"], cwd=REPO, env={**env, "RUNS": "narrow-s20"},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert [json.loads(x)["step"] for x in open(out / "narrow-s20" / "rl" / "metrics.jsonl")][-1] == 2
    assert (out / "published" / "narrow-s20-step-2").is_dir() and (out / "narrow-s20/rl/time-to-step-2.txt").exists()
    assert not (out / "broad-s20").exists() and not (out / "eval-population").exists()
    for run_, steps in (("broad-s20", (2, 3)), ("narrow-s21", (2,)), ("broad-s21", (2, 3))):
        for k in steps:
            shutil.copytree(cold, out / run_ / f"step-{k}")
    run = subprocess.run(["bash", "scripts/runs.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(run.stdout[-6000:], run.stderr[-2000:])
    assert run.returncode == 0
    sources = (out / "published" / "SOURCES.md").read_text()
    assert "python rl.py --user scripted:population --eval-every 4 --seed 21 --init" in sources
    assert "--steps 3 --out" in sources
    runs = ["narrow-s20", "broad-s20", "narrow-s21", "broad-s21"]
    agents = lambda folder: set(json.load(open(out / folder / "results.json"))["agents"])   # noqa: E731
    assert agents("eval-population") == {str(cold)} | {f"{out}/published/{r}-step-2" for r in runs}
    assert agents("eval-later") == {f"{out}/published/broad-s{s}-step-3" for s in (20, 21)}
    assert agents("eval-sampled") == {str(cold)} | {f"{out}/published/broad-s{s}-step-{k}" for s in (20, 21)
                                                    for k in (2, 3)}
    assert len(agents("eval-personas")) == 5 * 4                      # five agents under four user sets
    sampled = json.load(open(out / "eval-sampled" / "args.json"))
    assert sampled["temperature"] == 0.7 and sampled["trials"] == 2
    cpu = [line.split("\t") for line in (out / "cpu-eval.tsv").read_text().splitlines()]
    assert len(cpu) == 5 + 5 * 4 + 2 + 5 and all(len(line) == 4 and line[3] for line in cpu)   # each part once
    said = run.stdout
    assert "broad RL - SFT: +0.000 [+0.000, +0.000], P(improvement) 0.50 [0.50, 0.50]" in said
    assert "not final: 2 narrow runs of 4; 2 broad runs of 4; 2 tasks of 60" in said and ": -" in said
    assert "the broad runs' later steps" in said and "broad, step 3" in said and "secondary" in said
    assert (out / "runs.png").exists() and json.load(open(out / "runs_report.json"))["bar"] == "-"
    del env["INIT"]
    run = subprocess.run(["bash", "scripts/runs.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "set INIT" in run.stderr
