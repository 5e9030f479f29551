"""Probe, step 1 of 2: the rollouts rl.py's first step draws for `--domains airline --group-size 8 --draw 6`
at seed 0 (the same tasks, user seeds and samples, token for token), pickled for docs/probe_update.py.
From the repo root: python docs/probe_rollouts.py TEMPERATURE OUT.pkl (README, "one update on fixed rollouts")."""
import os, pickle, random, sys, time, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rl, rollout, envs
args = rl.parse_args("--domains airline --group-size 8 --draw 6 --max-draws 1 --tasks 6 --steps 1 --lr 2e-4 --eval-every 0 --out runs/rl_probe".split())
torch.set_num_threads(2)
model, tok = rollout.load_model(rollout.DEFAULT_MODEL)
model, _ = rl.load_policy(args, model)
random.seed(0); torch.manual_seed(0)
pool = envs.train_tasks("airline", args.task_pool, ["easy"], 0)
rng = random.Random(0 * 1_000_003 + 0)
order = rng.sample(pool, len(pool))[:6]
if len(sys.argv) != 3:
    sys.exit(__doc__)
T, path = float(sys.argv[1]), sys.argv[2]
agent = rollout.ModelAgent(model, tok, temperature=T, max_new_tokens=80)
model.eval(); t0 = time.time()
trajs = rollout.run_episodes(agent, tok, order, group_size=8, max_turns=7, max_context=3072, seed=0, progress=False)
print("rollout_s", time.time() - t0)
for i in range(6):
    g = trajs[i*8:(i+1)*8]; print(g[0].task_id, [t.reward for t in g], [len(t.token_ids) for t in g], [sum(t.loss_mask) for t in g])
pickle.dump(trajs, open(path, "wb"))
