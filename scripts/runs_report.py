"""The experiment's report (docs/steps_preregistration.md, "The sixth attempt"): one cold start, several training
runs an arm, every agent on the same tasks. From <out>/eval-*/results.json and <out>/<run>/rl/ (scripts/runs.sh):

    python scripts/runs_report.py runs/arms6 [K LATER...]     (the design's: 8 12 16)

It prints each run's steps; under the held-out population (the primary), each named held-out persona and the
training personas, every run's pass^1 at step K and each arm's mean with two intervals: the two-level bootstrap's
(an arm's runs drawn with replacement, then the tasks, one draw of tasks shared by every agent) and a t-interval on
the runs' differences from the cold start (a few runs resampled understate their spread); the arms' between-run
spread and their runs below the cold start; the bar; the broad runs' later checkpoints; the sampled evaluation
(pass^1 and pass^4); the fifth attempt's runs pooled with these (secondary); and the picture, runs.png. An agent is
told apart by its folder's name: a run's step k ends with "<arm>-s<seed>-step-<k>", any other is the cold start.
What is not there yet prints as "-"."""
import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from common import figure, save_figure  # noqa: E402

POPULATION = "held-out population (2 draws a task)"
EVALS = {POPULATION: ("eval-population", "scripted:heldout-population"),
         "held-out: curious": ("eval-personas", "scripted:curious"),
         "held-out: literal": ("eval-personas", "scripted:literal"),
         "held-out: mindful": ("eval-personas", "scripted:mindful"),
         "training personas": ("eval-personas", "scripted:train")}
ARMS = ("narrow", "broad")
K, LATER = 8, (12, 16)                          # the design, pre-registered: the bar's step, the broad runs' later
RUNS_AN_ARM, N_TASKS, BAR = 4, 60, 0.10
N_BOOT = 10_000
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}   # t(0.975, df)
ATTEMPT5 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "steps", "attempt5",
                        "eval-population", "results.json")
RUN = re.compile(r"(narrow|broad)-s(\d+)-step-(\d+)$")


# ----------------------------------------------------------------------------- reading eval.py's numbers

def per_task(out, folder, user, metric="pass1") -> dict:
    """{agent label: {task: [its value in each trial]}} of one evaluation folder under one user ({} if not there)."""
    path = os.path.join(out, folder, "results.json")
    if not os.path.exists(path):
        return {}
    agents = json.load(open(path))["agents"]
    several = any(" @ " in label for label in agents)
    return {label.split(" @ ")[0]: a["tau"]["metrics"][metric] for label, a in agents.items()
            if not several or label.endswith(f" @ {user}")}


def runs_of(per_agent, step) -> dict:
    """{arm: [labels of its runs' step `step`, by seed]} and the cold start's label (None if absent)."""
    runs, cold = {arm: [] for arm in ARMS}, None
    for label in sorted(per_agent, key=lambda a: int(m[2]) if (m := RUN.search(a.rstrip("/"))) else -1):
        m = RUN.search(label.rstrip("/"))
        if m is None:
            cold = label
        elif int(m[3]) == step:
            runs[m[1]].append(label)
    return runs, cold


def matrix(per_agent, labels, tasks, reduce=None):
    """(agents, tasks): each task's value, the mean of its trials (reduce: another function of them, e.g. all
    solved for pass^k); None values (the metric did not apply) are left out, a task with none is nan."""
    def value(trials):
        kept = [v for v in trials if v is not None]
        return math.nan if not kept else (reduce(kept) if reduce else sum(kept) / len(kept))
    return np.array([[value(per_agent[a][t]) for t in tasks] for a in labels], dtype=float)


# ----------------------------------------------------------------------------- statistics

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


def t_interval(d) -> list:
    """mean +- t(0.975, n - 1) x sd / sqrt(n) of per-run differences d; [mean, mean] for one run (no spread known)."""
    d = np.asarray(d, dtype=float)
    mean = float(d.mean())
    if len(d) < 2:
        return [mean, mean]
    half = T975[len(d) - 1] * float(d.std(ddof=1)) / math.sqrt(len(d))
    return [mean - half, mean + half]


def compare(X, Y, n_boot=N_BOOT, seed=0) -> dict:
    """X - Y, each (runs, tasks) of one arm or agent, paired by task: the mean over runs of the mean over tasks, its
    two-level 95% CI (percentile), P(improvement) with its CI from the same resamples, and, against one agent (the
    cold start), each run's difference with their t-interval, their sd and how many are below 0."""
    (runs, tasks) = draws({"x": len(X), "y": len(Y)}, X.shape[1], n_boot, seed)
    diff = resampled_means(X, runs["x"], tasks) - resampled_means(Y, runs["y"], tasks)
    poi = improvement(X[runs["x"][:, :, None], tasks[:, None, :]], Y[runs["y"][:, :, None], tasks[:, None, :]])
    point = float(np.nanmean(np.nanmean(X, axis=1)) - np.nanmean(np.nanmean(Y, axis=1)))
    c = {"diff": point, "ci": [float(np.quantile(diff, 0.025)), float(np.quantile(diff, 0.975))],
         "poi": float(improvement(X, Y)), "poi_ci": [float(np.quantile(poi, 0.025)), float(np.quantile(poi, 0.975))],
         "run_sd": [float(np.std(np.nanmean(M, axis=1), ddof=1)) if len(M) > 1 else 0.0 for M in (X, Y)]}
    if len(Y) == 1:
        per_run = np.nanmean(X, axis=1) - np.nanmean(Y)
        c |= {"per_run": [float(d) for d in per_run], "t": t_interval(per_run), "below": int((per_run < 0).sum())}
    return c


def mean_ci(X, n_boot=N_BOOT, seed=0):
    """One arm's or agent's mean over runs of the mean over tasks, X (runs, tasks): its two-level 95% CI."""
    runs, tasks = draws({"x": len(X)}, X.shape[1], n_boot, seed)
    means = resampled_means(X, runs["x"], tasks)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def show(c):
    if not c:
        return "-"
    s = (f"{c['diff']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}], P(improvement) {c['poi']:.2f} "
         f"[{c['poi_ci'][0]:.2f}, {c['poi_ci'][1]:.2f}]")
    if "per_run" in c:
        each = ", ".join(f"{d:+.3f}" for d in c["per_run"])
        s += (f"; t-interval [{c['t'][0]:+.3f}, {c['t'][1]:+.3f}]; each run {each}"
              f"; {c['below']} of {len(c['per_run'])} below the cold start")
    return s


# ----------------------------------------------------------------------------- the report's parts

def steps_of(out, run) -> None:
    """A run's steps, a line each: reward, groups with signal, kl, the questions asked again, seconds, the curve."""
    path = os.path.join(out, run, "rl", "metrics.jsonl")
    if not os.path.exists(path):
        return
    print(f"\n{run}, a step a line:")
    for m in map(json.loads, open(path)):
        curve = ", ".join(f"{v:.3f} {u}" for u, v in m.get("heldout_by_user", {}).items())
        if "reward" not in m:
            print(f"  step {m['step']}: curve {curve}")
            continue
        asked = m.get("repeated_questions")
        print(f"  step {m['step']}: reward {m['reward']:.3f}, groups with signal {m['groups_varied']} of "
              f"{m['groups_drawn']}, kl {m['kl'] if m['kl'] is None else format(m['kl'], '.5f')}, asked again "
              f"{'-' if asked is None else format(asked, '.2f')}, {m['s_per_step']:.0f} s"
              + (f"; curve {curve}" if curve else ""))


def at_step_k(out, k=K) -> tuple[dict, dict]:
    """Every user set's table at step K: agents' pass^1, the arms' means and intervals, the comparisons."""
    table, compared = {}, {}
    for title, (folder, user) in EVALS.items():
        per_agent, asked = per_task(out, folder, user), per_task(out, folder, user, "repeated_questions")
        runs, cold = runs_of(per_agent, k)
        if cold is None:
            print(f"\n{title}: not evaluated yet")
            continue
        tasks = sorted(per_agent[cold])
        M = {arm: matrix(per_agent, labels, tasks) for arm, labels in runs.items() if labels}
        S = matrix(per_agent, [cold], tasks)
        print(f"\n{title}: pass^1 of each agent at step {k} on {len(tasks)} tasks "
              "(questions asked again a conversation)")
        print("| agent | pass^1 | asked again |\n|---|---|---|")
        for label in [cold] + [a for arm in ARMS for a in runs[arm]]:
            print(f"| {label} | {np.nanmean(matrix(per_agent, [label], tasks)):.3f} | "
                  f"{np.nanmean(matrix(asked, [label], tasks)):.2f} |")
        ci = {arm: mean_ci(M[arm]) for arm in M}
        for arm in M:
            means = np.nanmean(M[arm], axis=1)
            print(f"| {arm} RL, mean over {len(means)} runs [two-level 95% CI], sd between runs | {means.mean():.3f} "
                  f"[{ci[arm][0]:.3f}, {ci[arm][1]:.3f}], sd {np.std(means, ddof=1) if len(means) > 1 else 0:.3f} | |")
        compared[title] = {f"{arm} RL - SFT": compare(M[arm], S) for arm in M}
        if len(M) == 2:
            compared[title]["broad RL - narrow RL"] = compare(M["broad"], M["narrow"])
        print("| comparison | mean over runs [two-level 95% CI], P(improvement) [CI]; against the cold start also the "
              "t-interval and each run |\n|---|---|")
        for name, c in compared[title].items():
            print(f"| {name} | {show(c)} |")
        table[title] = {"cold": float(np.nanmean(S)), **{arm: [float(x) for x in np.nanmean(M[arm], axis=1)]
                                                          for arm in M}, **{f"{arm} ci": ci[arm] for arm in M}}
    return table, compared


def bar(c: dict, short: str, k=K) -> str:
    """The pre-registered bar under the held-out population: broad RL - SFT >= +0.10 with its two-level CI above
    0, and every broad run above the cold start. short: what the design lacks (then no verdict). A difference is
    compared rounded to 9 places: pass^1 moves in 120ths, and 0.5 - 0.4 is 0.0999... in floats."""
    print(f"\nthe bar, under the {POPULATION}, at step {k}:")
    if short:
        print(f"  not final: {short}")
    b = c.get("broad RL - SFT")
    met = b and round(b["diff"], 9) >= BAR and b["ci"][0] > 0 and all(round(d, 9) > 0 for d in b["per_run"])
    verdict = "-" if not b or short else "MET" if met else "MISSED"
    print(f"  broad RL - SFT: {show(b)}\n  (>= +{BAR:.2f} with the two-level CI above 0, and every broad run above "
          f"the cold start): {verdict}")
    print(f"  beside it, no threshold: narrow RL - SFT {show(c.get('narrow RL - SFT'))}; broad RL - narrow RL "
          f"{show(c.get('broad RL - narrow RL'))}")
    return verdict


def missing(out, k=K) -> str:
    """What the held-out population's evaluation lacks against the design: four runs an arm, >= 60 tasks, two user
    draws a task, for every agent; '' when nothing."""
    per_agent = per_task(out, *EVALS[POPULATION])
    runs, cold = runs_of(per_agent, k)
    if cold is None:
        return "not evaluated"
    short = [f"{len(runs[arm])} {arm} runs of {RUNS_AN_ARM}" for arm in ARMS if len(runs[arm]) != RUNS_AN_ARM]
    if len(per_agent[cold]) < N_TASKS:
        short.append(f"{len(per_agent[cold])} tasks of {N_TASKS}")
    if any(len(trials) != 2 for agent in per_agent.values() for trials in agent.values()):
        short.append("a task without its two user draws")
    return "; ".join(short)


def later_steps(out, k=K, later=LATER) -> dict:
    """The broad runs' later checkpoints under the held-out population (eval-later), against the step-K cold start's
    numbers on the same tasks: each run's pass^1, the arm's mean with its two-level CI, broad RL - SFT."""
    first, later = per_task(out, *EVALS[POPULATION]), per_task(out, "eval-later", EVALS[POPULATION][1])
    _, cold = runs_of(first, k)
    curve = {}
    if cold is None or not later:
        print("\nlater steps: not evaluated yet")
        return curve
    tasks, S = sorted(first[cold]), matrix(first, [cold], sorted(first[cold]))
    print(f"\nthe broad runs' later steps, {POPULATION} (cold start {np.nanmean(S):.3f}):")
    for step in (k, *later):
        labels = runs_of(first if step == k else later, step)[0]["broad"]
        if labels:
            M = matrix(first if step == k else later, labels, tasks)
            c, ci = compare(M, S), mean_ci(M)
            curve[step] = {"runs": [float(x) for x in np.nanmean(M, axis=1)], "ci": ci, "compared": c}
            print(f"  step {step}: each run {', '.join(f'{x:.3f}' for x in curve[step]['runs'])}; mean "
                  f"{np.mean(curve[step]['runs']):.3f} [{ci[0]:.3f}, {ci[1]:.3f}]; broad RL - SFT {show(c)}")
    return curve


def sampled(out, k=K, later=LATER) -> dict:
    """The sampled evaluation (eval-sampled, T > 0, several trials a task): pass^1 (the mean of a task's trials)
    and pass^n (all its trials solved) of the cold start and each broad run at each step evaluated so."""
    per_agent = per_task(out, "eval-sampled", EVALS[POPULATION][1])
    _, cold = runs_of(per_agent, k)
    if cold is None:
        print("\nsampled: not evaluated yet")
        return {}
    tasks = sorted(per_agent[cold])
    n = len(per_agent[cold][tasks[0]])
    every = lambda kept: float(all(v >= 1 for v in kept))       # noqa: E731; pass^n of a task: every trial solved
    result = {}
    print(f"\nsampled at the training temperature, {n} trials a task, {POPULATION.split(' (')[0]}:")
    for name, reduce in (("pass^1", None), (f"pass^{n}", every)):
        S = matrix(per_agent, [cold], tasks, reduce)
        result[name] = {"cold": float(np.nanmean(S))}
        print(f"  {name}: cold start {np.nanmean(S):.3f}")
        for step in (k, *later):
            labels = runs_of(per_agent, step)[0]["broad"]
            if labels:
                M = matrix(per_agent, labels, tasks, reduce)
                c = compare(M, S)
                result[name][step] = {"runs": [float(x) for x in np.nanmean(M, axis=1)], "ci": mean_ci(M),
                                      "compared": c}
                print(f"    broad, step {step}: each run {', '.join(f'{x:.3f}' for x in result[name][step]['runs'])}"
                      f"; broad RL - SFT {show(c)}")
    return result


def pooled(table_population) -> dict:
    """Secondary, said to be one: the fifth attempt's runs (task seed 97) pooled with these, each run's difference
    from the cold start on its own attempt's tasks; their mean with its t-interval, and how many are below 0."""
    if not table_population or not os.path.exists(ATTEMPT5):
        return {}
    five = {label: a["tau"]["metrics"]["pass1"] for label, a in json.load(open(ATTEMPT5))["agents"].items()}
    runs5, cold5 = runs_of(five, 8)
    tasks5 = sorted(five[cold5])
    print(f"\nsecondary: the fifth attempt's runs pooled with these, {POPULATION}, each run - its cold start:")
    out = {}
    for arm in ARMS:
        d = [float(x) for x in np.nanmean(matrix(five, runs5[arm], tasks5), axis=1) - np.nanmean(
            matrix(five, [cold5], tasks5))] + [x - table_population["cold"] for x in table_population.get(arm, [])]
        out[arm] = {"per_run": d, "t": t_interval(d), "below": sum(x < 0 for x in d)}
        print(f"  {arm}: {len(d)} runs, mean {np.mean(d):+.3f}, t-interval [{out[arm]['t'][0]:+.3f}, "
              f"{out[arm]['t'][1]:+.3f}], {out[arm]['below']} below the cold start")
    return out


def picture(path, table, curve, sample, k=K, later=LATER):
    """Greedy pass^1 under the held-out population at steps k and later: each run (a dot, the broad runs' joined), each
    arm's mean with its two-level band, the cold start a line, the sampled pass^1 (hollow); then each user set's step
    K runs beside it."""
    others = [t for t in table if t != POPULATION]
    fig, axes = figure(1 + len(others), (4.6 + 2.2 * len(others), 3.6))
    ax, row = axes[0], table.get(POPULATION)
    if row:
        ax.axhline(row["cold"], color="grey", ls="--", lw=1, label="cold start (greedy)")
        steps = sorted(curve)
        for j, arm in enumerate(ARMS):
            if arm not in row:
                continue
            x = k - 0.5 * (arm == "narrow")                         # narrow beside the broad runs' line
            ax.plot([x] * len(row[arm]), row[arm], "o", color=f"C{j}", label=f"{arm} runs (greedy)")
            ax.errorbar(x - 0.15, np.mean(row[arm]), [[np.mean(row[arm]) - row[f"{arm} ci"][0]],
                        [row[f"{arm} ci"][1] - np.mean(row[arm])]], color=f"C{j}", capsize=4, lw=2, marker="_")
        if len(steps) > 1:
            runs = np.array([curve[s]["runs"] for s in steps])          # (steps, runs)
            ax.plot(steps, runs, "-", color="C1", alpha=0.35, lw=1)
            ax.fill_between(steps, [curve[s]["ci"][0] for s in steps], [curve[s]["ci"][1] for s in steps], color="C1",
                            alpha=0.15, label="broad: mean's two-level 95% CI")
            ax.plot(steps, runs.mean(axis=1), "-", color="C1", lw=2)
        for step, points in ((s, v) for s, v in sample.get("pass^1", {}).items() if s != "cold"):
            ax.plot([step + 0.5] * len(points["runs"]), points["runs"], "o", mfc="none", color="C1")
        if sample.get("pass^1"):
            ax.axhline(sample["pass^1"]["cold"], color="grey", ls=":", lw=1, label="cold start, sampled (hollow: runs)")
        ax.set(xlabel="GRPO step", ylabel="pass^1", title=POPULATION, ylim=(0, 1.05), xticks=[k, *later])
        ax.title.set_fontsize(9)
        ax.legend(fontsize=6)
    for ax, title in zip(axes[1:], others):
        r = table[title]
        ax.axhline(r["cold"], color="grey", ls="--", lw=1)
        for j, arm in enumerate(a for a in ARMS if a in r):
            ax.plot([j] * len(r[arm]), r[arm], "o", color=f"C{j}")
            ax.errorbar(j + 0.15, np.mean(r[arm]), [[np.mean(r[arm]) - r[f"{arm} ci"][0]],
                        [r[f"{arm} ci"][1] - np.mean(r[arm])]], color="black", capsize=4, lw=1)
        ax.set_xticks(range(sum(a in r for a in ARMS)), [a for a in ARMS if a in r])
        ax.set(title=f"{title}, step {k}", ylim=(0, 1.05))
        ax.title.set_fontsize(8)
    save_figure(fig, path, dpi=100)
    print(f"picture: {path}")


def main(out, k=K, later=LATER):
    out = out.rstrip("/")
    for seed in sorted({int(m[1]) for d in os.listdir(out) if (m := re.fullmatch(r"(?:narrow|broad)-s(\d+)", d))}
                       if os.path.isdir(out) else []):
        for arm in ARMS:
            steps_of(out, f"{arm}-s{seed}")
    table, compared = at_step_k(out, k)
    verdict = bar(compared.get(POPULATION, {}), missing(out, k), k)
    curve, sample = later_steps(out, k, later), sampled(out, k, later)
    pool = pooled(table.get(POPULATION))
    if table:
        picture(os.path.join(out, "runs.png"), table, curve, sample, k, later)
        with open(os.path.join(out, "runs_report.json"), "w") as f:
            json.dump({"bar": verdict, "at_step_k": table, "compared": compared, "later": curve, "sampled": sample,
                       "pooled_with_attempt5": pool}, f, indent=1)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0] if a else "runs/arms6", int(a[1]) if len(a) > 1 else K, tuple(map(int, a[2:])) or LATER)
