"""The fifth attempt's result (docs/steps_preregistration.md, "The fifth attempt"): one cold start, several training
runs an arm, seven agents on the same tasks. Every run's pass^1, each arm's mean over its runs with a two-level
bootstrap CI (the runs of each arm drawn with replacement, then the tasks, one draw of tasks for every agent
compared), the probability of improvement, the bar, the questions asked again, each run's steps, and the picture;
from <out>/eval-population/results.json, <out>/eval-personas/results.json and <out>/<run>/rl/. Run by
scripts/runs.sh:

    python scripts/runs_report.py runs/arms5 8

An agent is told apart by its folder's name: the cold start is the first of --agents, a run's step K ends with
"<arm>-s<seed>-step-K". What is not there yet prints as "-"."""
import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from steps_report import print_steps, step_records  # noqa: E402
from common import figure, save_figure  # noqa: E402

EVALS = {"held-out population (2 draws a task)": ("eval-population", "scripted:heldout-population"),
         "held-out: curious": ("eval-personas", "scripted:curious"),
         "held-out: literal": ("eval-personas", "scripted:literal"),
         "held-out: mindful": ("eval-personas", "scripted:mindful"),
         "training personas": ("eval-personas", "scripted:train")}
PRIMARY = next(iter(EVALS))
ARMS = ("narrow", "broad")
N_BOOT, HALF_WIDTH = 10_000, 0.08
RUNS_AN_ARM, N_TASKS = 3, 60                  # the design, pre-registered


def load(out, K):
    """-> (cold start label, {arm: {seed: label}}, {user set: {label: {task: [value a trial]}}} for pass1 and
    repeated_questions): eval.py's per-task numbers, each evaluation's agents told apart by folder name."""
    cold, runs, values = None, {arm: {} for arm in ARMS}, {"pass1": {}, "repeated_questions": {}}
    for title, (folder, user) in EVALS.items():
        path, args = (os.path.join(out, folder, f) for f in ("results.json", "args.json"))
        if not os.path.exists(path):
            continue
        agents = json.load(open(args))["agents"].split(",")
        cold = agents[0]
        for label in agents[1:]:
            if m := re.search(rf"(narrow|broad)-s(\d+)-step-{K}$", label.rstrip("/")):
                runs[m[1]][int(m[2])] = label
        results = json.load(open(path))["agents"]
        several = len(json.load(open(args))["user"].split(",")) > 1
        for metric in values:
            values[metric][title] = {a: results[f"{a} @ {user}" if several else a]["tau"]["metrics"][metric]
                                     for a in agents if (f"{a} @ {user}" if several else a) in results}
    return cold, runs, values


def matrix(per_agent, labels, tasks):
    """(agents, tasks) array: each task's value, the mean of its trials (None: the metric did not apply -> nan)."""
    def task_mean(trials):
        kept = [v for v in trials if v is not None]
        return sum(kept) / len(kept) if kept else math.nan
    return np.array([[task_mean(per_agent[a][t]) for t in tasks] for a in labels], dtype=float)


def draws(n_runs: dict, n_tasks: int, n_boot=N_BOOT, seed=0):
    """The two-level bootstrap's indices: for each resample, each group's runs drawn with replacement (as many as
    it has), then the tasks with replacement, one draw of tasks shared by every group (the agents are paired by
    task)."""
    rng = np.random.default_rng(seed)
    runs = {g: rng.integers(0, n, size=(n_boot, n)) for g, n in n_runs.items()}
    return runs, rng.integers(0, n_tasks, size=(n_boot, n_tasks))


def resampled_means(V, run_idx, task_idx):
    """V (runs, tasks) -> (n_boot,): in each resample, the mean over the drawn runs of each run's mean over the
    drawn tasks."""
    per_run = np.stack([np.nanmean(V[r][task_idx], axis=1) for r in range(len(V))])     # (runs, n_boot)
    return np.take_along_axis(per_run.T, run_idx, axis=1).mean(axis=1)


def improvement(X, Y):
    """rliable's probability of improvement P(X > Y): on each task, over every pair of a run of X and a run of Y,
    the share where X is higher plus half the share where they tie; the mean over tasks. X, Y: (runs, tasks), or a
    stack of resamples of them (resamples, runs, tasks), one P a resample."""
    x, y = X[..., :, None, :], Y[..., None, :, :]                    # every pair of runs, task by task
    return ((x > y) + 0.5 * (x == y)).mean(axis=(-3, -2)).mean(axis=-1)


def compare(X, Y, n_boot=N_BOOT, seed=0) -> dict:
    """X - Y, each (runs, tasks) of one arm or agent, paired by task: the mean over runs of the mean over tasks,
    its two-level 95% CI (percentile), the probability of improvement with its CI from the same resamples, and the
    half-width the task draw alone gives (the runs held as they are)."""
    (runs, tasks) = draws({"x": len(X), "y": len(Y)}, X.shape[1], n_boot, seed)
    diff = resampled_means(X, runs["x"], tasks) - resampled_means(Y, runs["y"], tasks)
    poi = improvement(X[runs["x"][:, :, None], tasks[:, None, :]], Y[runs["y"][:, :, None], tasks[:, None, :]])
    fixed = {"x": np.tile(np.arange(len(X)), (n_boot, 1)), "y": np.tile(np.arange(len(Y)), (n_boot, 1))}
    task_only = resampled_means(X, fixed["x"], tasks) - resampled_means(Y, fixed["y"], tasks)
    point = float(np.nanmean(np.nanmean(X, axis=1)) - np.nanmean(np.nanmean(Y, axis=1)))
    return {"diff": point, "ci": [float(np.quantile(diff, 0.025)), float(np.quantile(diff, 0.975))],
            "poi": float(improvement(X, Y)), "poi_ci": [float(np.quantile(poi, 0.025)), float(np.quantile(poi, 0.975))],
            "task_half": float(np.quantile(task_only, 0.975) - np.quantile(task_only, 0.025)) / 2,
            "run_sd": [float(np.std(np.nanmean(M, axis=1), ddof=1)) if len(M) > 1 else 0.0 for M in (X, Y)],
            "per_run": [float(d) for d in np.nanmean(X, axis=1) - np.nanmean(Y)] if len(Y) == 1 else None}


def mean_ci(X, n_boot=N_BOOT, seed=0):
    """One arm's or agent's mean over runs of the mean over tasks, X (runs, tasks): its two-level 95% CI."""
    runs, tasks = draws({"x": len(X)}, X.shape[1], n_boot, seed)
    means = resampled_means(X, runs["x"], tasks)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def runs_needed(c: dict, half=HALF_WIDTH):
    """Runs an arm for a two-level half-width <= half, with the between-run spread of the per-run means held at its
    measured value and the task part held fixed: the least n with 1.96 * sqrt(task part^2 / 1.96^2 + (sd_x^2 +
    sd_y^2) / n) <= half. None when the task part alone is that wide: more tasks would help, not more runs. A rough
    guide: an sd measured on three runs may be half or several times the true one."""
    room = (half / 1.96) ** 2 - (c["task_half"] / 1.96) ** 2
    if room <= 0:
        return None
    return max(1, math.ceil(sum(s ** 2 for s in c["run_sd"]) / room))


def show(c):
    if not c:
        return "-"
    runs = f" (each run: {', '.join(f'{d:+.3f}' for d in c['per_run'])})" if c.get("per_run") else ""
    return (f"{c['diff']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}], P(improvement) {c['poi']:.2f} "
            f"[{c['poi_ci'][0]:.2f}, {c['poi_ci'][1]:.2f}]{runs}")


def main(out, K):
    out = out.rstrip("/")
    cold, runs, values = load(out, K)
    for arm in ARMS:
        for seed in sorted(runs[arm]):
            print(f"\n{arm}, seed {seed}, a step a line:")
            print_steps(step_records(os.path.join(out, f"{arm}-s{seed}"), K))
    table, compared = {}, {}
    for title in EVALS:
        per_agent = values["pass1"].get(title)
        if not per_agent or cold not in per_agent:
            print(f"\n{title}: not evaluated yet")
            continue
        tasks = sorted(per_agent[cold])
        arms = {arm: [runs[arm][s] for s in sorted(runs[arm]) if runs[arm][s] in per_agent] for arm in ARMS}
        M = {arm: matrix(per_agent, labels, tasks) for arm, labels in arms.items() if labels}
        S = matrix(per_agent, [cold], tasks)
        asked = values["repeated_questions"][title]
        print(f"\n{title}: pass^1 of each agent on {len(tasks)} tasks (questions asked again, a conversation)")
        print("| agent | pass^1 | asked again |\n|---|---|---|")
        for label in [cold] + [a for arm in ARMS for a in arms[arm]]:
            print(f"| {label} | {np.nanmean(matrix(per_agent, [label], tasks)):.3f} | "
                  f"{np.nanmean(matrix(asked, [label], tasks)):.2f} |")
        ci = {arm: mean_ci(M[arm]) for arm in M}
        for arm, labels in arms.items():
            if labels:
                (lo, hi), mean = ci[arm], np.mean(np.nanmean(M[arm], axis=1))
                print(f"| {arm} RL, mean over {len(labels)} runs [two-level 95% CI] | {mean:.3f} [{lo:.3f}, {hi:.3f}] "
                      f"| {np.nanmean(matrix(asked, labels, tasks)):.2f} |")
        compared[title] = {f"{arm} RL - SFT": compare(M[arm], S) for arm in M}
        if len(M) == 2:
            compared[title]["broad RL - narrow RL"] = compare(M["broad"], M["narrow"])
        print("| comparison | mean over runs [two-level 95% CI], P(improvement) [CI] |\n|---|---|")
        for name, c in compared[title].items():
            print(f"| {name} | {show(c)} |")
        table[title] = {"cold": float(np.nanmean(S)), **{arm: list(np.nanmean(M[arm], axis=1)) for arm in M},
                        **{f"{arm} ci": ci[arm] for arm in M}}
    bar(compared.get(PRIMARY, {}), missing(cold, runs, values))
    if table:
        picture(os.path.join(out, "runs.png"), table, K)
        with open(os.path.join(out, "runs_report.json"), "w") as f:
            json.dump({"per_run": table, "compared": compared}, f, indent=1)


def bar(c, short=""):
    """The pre-registered bar, under the held-out population; short: what the design lacks (then no verdict). A
    difference is compared rounded to 9 places: pass^1 moves in 120ths, and 0.5 - 0.4 is 0.0999... in floats."""
    print(f"\nthe bar, under the {PRIMARY}:")
    if short:
        print(f"  not final: {short}")
    nr = c.get("narrow RL - SFT")
    print(f"  narrow RL - SFT, mean over runs: {show(nr)} (>= +0.10, CI above 0): "
          + ("-" if not nr or short else "MET" if round(nr["diff"], 9) >= 0.10 and nr["ci"][0] > 0 else "MISSED"))
    bn = c.get("broad RL - narrow RL")
    if not bn:
        print("  broad RL - narrow RL: -")
        return
    half, need = round((bn["ci"][1] - bn["ci"][0]) / 2, 9), runs_needed(bn)
    verdict = "-" if short else "MET" if half <= HALF_WIDTH else "MISSED: " + (
        f"about {need} runs an arm would give it, a rough guide (the runs' spread is measured on "
        f"{RUNS_AN_ARM})" if need else "the task draw alone is that wide: more tasks would help, not more runs")
    print(f"  broad RL - narrow RL: {show(bn)}; half-width (CI's width / 2) {half:.3f} (<= {HALF_WIDTH}: {verdict})")


def missing(cold, runs, values):
    """What the held-out population's evaluation lacks against the pre-registered design: three runs an arm, >= 60
    tasks, two user draws a task, for every agent; '' when nothing."""
    per_agent = values["pass1"].get(PRIMARY, {})
    if cold not in per_agent:
        return "not evaluated"
    short = [f"{len(runs[arm])} {arm} runs of {RUNS_AN_ARM}" for arm in ARMS if len(runs[arm]) != RUNS_AN_ARM]
    if len(per_agent[cold]) < N_TASKS:
        short.append(f"{len(per_agent[cold])} tasks of {N_TASKS}")
    if any(len(trials) != 2 for agent in per_agent.values() for trials in agent.values()):
        short.append("a task without its two user draws")
    return "; ".join(short)


def picture(path, table, K):
    """Each run's pass^1 (a dot) and each arm's mean (a bar) with its two-level 95% CI (a whisker), the cold start a
    line, under each user set."""
    fig, axes = figure(len(table), (3.2 * len(table), 3.4))
    for ax, (title, row) in zip(axes, table.items()):
        ax.axhline(row["cold"], color="grey", ls="--", lw=1, label="cold start")
        for j, arm in enumerate(a for a in ARMS if a in row):
            mean, (lo, hi) = np.mean(row[arm]), row[f"{arm} ci"]
            ax.bar(j, mean, 0.6, color=f"C{j}", alpha=0.4)
            ax.errorbar(j + 0.12, mean, [[mean - lo], [hi - mean]], color="black", capsize=4, lw=1)
            ax.plot([j - 0.12] * len(row[arm]), row[arm], "o", color=f"C{j}")
        ax.set_xticks(range(sum(a in row for a in ARMS)), [f"{a} RL" for a in ARMS if a in row])
        ax.set(title=title, ylim=(0, 1.05))
        ax.title.set_fontsize(8)
    axes[0].set_ylabel(f"pass^1, step {K} (dots: runs; whisker: 95% CI)")
    axes[0].legend(fontsize=7)
    save_figure(fig, path, dpi=100)
    print(f"picture: {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/arms5", int(sys.argv[2]) if len(sys.argv) > 2 else 8)
