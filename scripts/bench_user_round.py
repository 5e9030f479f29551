"""bench_user_round.py: a paper-sized rollout round with the user simulator as a remote API, under load and faults.

What: rl.py's sampling step (rl.sample_groups: 32 tasks x 8 rollouts, failed rollouts left out, the stop past
--max-sim-failures) with the gold agent as the policy (rollout.OracleAgent: no model needed) and an
openai:MODEL user (envs/llm_users.OpenAIUser) talking to tests/fault_server.py, an OpenAI-compatible server on 127.0.0.1
that answers as the scripted user after a latency and injects faults. Each run prints one row: wall time, the
time the round waited on users against the ideal (user rounds x latency), requests and retries, rollouts that
lost their simulator, and the step's outcome (rewards, or rl.py's one-line stop).

Runs (--runs, comma list):
  clean     1-s users, no faults
  faults    --fault-rate of the requests get a 429 (Retry-After 1 s), a 500 or a 503, a third each
  restart   the server goes down for --down s at request --restart-at (mid-round), then comes back
  gone      the server goes away for good at request --restart-at

Run:  python scripts/bench_user_round.py                  # the four runs, about 2 minutes
      python scripts/bench_user_round.py --runs clean --tasks 4 --group-size 2 --latency 0.1   # a quick look
"""
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]          # tests/: the fault server
import common                              # noqa: E402
import envs                                # noqa: E402
import rl                                  # noqa: E402
import rollout                             # noqa: E402
from fault_server import FaultServer       # noqa: E402
from kernels import harness                # noqa: E402


def parse_args(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="clean,faults,restart,gone", help="which runs, comma list (see above)")
    p.add_argument("--tasks", type=int, default=32, help="tasks in the round, half retail, half airline (paper 32)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per task (paper 8)")
    p.add_argument("--latency", type=float, default=1.0, help="seconds the server takes for every answer")
    p.add_argument("--fault-rate", type=float, default=0.05, help="share of requests that fail in the faults run")
    p.add_argument("--restart-at", type=int, default=450, help="the request at which the server goes down "
                   "(restart, gone); a clean round of 256 makes about 900")
    p.add_argument("--down", type=float, default=10.0, help="seconds the server stays down in the restart run")
    p.add_argument("--max-retries", type=int, default=6, help="retries per user message (OpenAIUser's default)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request (OpenAIUser's default)")
    p.add_argument("--user-workers", type=int, default=256, help="users in flight at once (rl.py's default)")
    p.add_argument("--max-sim-failures", type=float, default=0.25, help="rl.py's stop: share of lost rollouts")
    p.add_argument("--seed", type=int, default=0, help="task order and the server's fault draws")
    return p.parse_args(argv)


def run(name, args, tasks, tok, out):
    """One round under one condition -> its row."""
    faults = {f: args.fault_rate / 3 for f in ("429", "500", "503")} if name == "faults" else {}
    restart = {"restart": (args.restart_at, args.down), "gone": (args.restart_at, float("inf"))}.get(name)
    waits, ask = [], rollout.ask_users

    def timed(calls, workers):                      # run_episodes' user rounds (openings included), each timed
        seconds, said = harness.timed(lambda: ask(calls, workers))
        if calls:
            waits.append(seconds)
        return said
    rollout.ask_users = timed
    rl_args = SimpleNamespace(seed=args.seed, group_size=args.group_size, draw=len(tasks), max_draws=1,
                              tasks=len(tasks), screen=0, rollouts=None, out=out, user="openai:scripted",
                              max_turns=30, max_context=8192, reward="binary", max_sim_failures=args.max_sim_failures,
                              user_workers=args.user_workers)
    t0, stop = time.time(), ""
    with FaultServer(tasks, latency=args.latency, faults=faults, retry_after=1.0, seed=args.seed,
                     restart_after=restart, lifetime=1800) as srv:
        make_user = envs.UserFactory("openai:scripted", dict(base_url=srv.url, api_key="none", timeout=args.timeout,
                                                             max_retries=args.max_retries))
        try:
            drawn, left = rl.sample_groups(rl.Sampling(rollout.OracleAgent(tok), tok, make_user), {"all": tasks}, 0,
                                           rl_args)
        except SystemExit as e:                     # rl.py's one line, past --max-sim-failures
            stop = str(e)
    wall = time.time() - t0
    rollout.ask_users = ask
    with open(os.path.join(out, "rollouts", "step-000001-draw-0.jsonl")) as f:   # written before rl's check
        trajs = [json.loads(line) for line in f]
    done = [t for t in trajs if not t["failed"]]
    ideal = len(waits) * args.latency
    return dict(run=name, rollouts=len(trajs), wall_s=wall, user_wait_s=sum(waits), user_rounds=len(waits),
                ideal_s=ideal, wait_over_ideal=sum(waits) / ideal if ideal else None,
                requests_sent=sum(t["stats"]["user_usage"]["requests"] for t in trajs),
                reached_server=srv.requests, retries=sum(t["stats"]["user_usage"]["retries"] for t in trajs),
                injected={k: v for k, v in srv.outcomes.items() if k != "ok"}, max_in_flight=srv.max_in_flight,
                lost=len(trajs) - len(done), complete=len(done),
                reward=sum(t["reward"] for t in done) / len(done) if done else None,
                outcome=stop or f"{len(drawn)} groups drawn, {sum(map(len, drawn))} rollouts scored, "
                                f"{len(left)} left out, {sum(map(rl.has_signal, drawn))} with reward variance")


def main(argv=None):
    args = parse_args(argv)
    common.start_run(args)
    tok = rollout.load_tokenizer()
    half = args.tasks // 2
    tasks = envs.make_tasks("retail", "train", args.tasks - half) + envs.make_tasks("airline", "train", half)
    rows = []
    for name in args.runs.split(","):
        with tempfile.TemporaryDirectory() as out:
            rows.append(run(name, args, tasks, tok, out))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.tasks} tasks x {args.group_size} rollouts, {args.latency:g}-s users, gold agent")
    print("| run | wall s | user wait s | ideal s (rounds x latency) | wait / ideal | requests sent (reached server) "
          "| retries | injected | lost | complete, mean reward | outcome |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        inj = ", ".join(f"{k} {v}" for k, v in sorted(r["injected"].items())) or "-"
        rew = "-" if r["reward"] is None else f"{r['reward']:.3f}"
        print(f"| {r['run']} | {r['wall_s']:.1f} | {r['user_wait_s']:.1f} | {r['ideal_s']:.1f} ({r['user_rounds']} x "
              f"{args.latency:g}) | {r['wait_over_ideal']:.2f}x | {r['requests_sent']} ({r['reached_server']}) | "
              f"{r['retries']} | {inj} | {r['lost']} | {r['complete']}, {rew} | {r['outcome']} |")
    return rows


if __name__ == "__main__":
    main()
