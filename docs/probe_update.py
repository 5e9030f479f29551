"""Probe, step 2 of 2: one GRPO update (rl.grpo_update) from the SFT adapter on the first 3 groups with reward
variance of docs/probe_rollouts.py's pickle, then greedy pass^1 on eval.py's 40 tasks (the same tasks, user
seeds and settings as `python eval.py --n-tasks 20`). Variants: loss aggregation, lr, AdamW or plain SGD whose
lr makes the same first-order loss decrease as AdamW's first (sign) step at lr ("sgd-matched").
From the repo root: TEMP=T TRAJS=X.pkl python docs/probe_update.py AGG LR OUT [adamw|sgd-matched]."""
import os, pickle, random, sys, time, json, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rl, rollout, envs
if len(sys.argv) < 4 or "TRAJS" not in os.environ:
    sys.exit(__doc__)
agg, lr, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
T = os.environ.get("TEMP", "1.0")
args = rl.parse_args(f"--domains airline --group-size 8 --lr {lr} --loss-agg {agg} --temperature {T} --eval-every 0 --train-bf16 off --out {out}".split())
torch.set_num_threads(2)
model, tok = rollout.load_model(rollout.DEFAULT_MODEL)
model, _ = rl.load_policy(args, model)
random.seed(0); torch.manual_seed(0)
trajs = pickle.load(open(os.environ["TRAJS"], "rb"))
G = 8
groups = [trajs[i*G:(i+1)*G] for i in range(len(trajs)//G)]
kept = [g for g in groups if len({t.reward for t in g}) > 1][:3]
train = [t for g in kept for t in g]
adv, _ = rl.group_advantages(torch.tensor([t.reward for t in train]), G)
for g in kept:
    a, _ = rl.group_advantages(torch.tensor([t.reward for t in g]), G)
    L = torch.tensor([float(sum(t.loss_mask)) for t in g])
    print(g[0].task_id, "rewards", [t.reward for t in g], "sampled", L.tolist(), "sum A|o|", float((a*L).sum()))
params = [p for p in model.parameters() if p.requires_grad]
opt_name = sys.argv[4] if len(sys.argv) > 4 else "adamw"
opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if opt_name == "adamw" else torch.optim.SGD(params, lr=lr)
before = [p.detach().clone() for p in params]
_step = opt.step
def step_and_report():
    g = [p.grad for p in params]
    l1, l2 = sum(x.abs().sum().item() for x in g), sum(x.pow(2).sum().item() for x in g)
    print(f"grad L1 {l1:.4g} L2^2 {l2:.4g} N {sum(x.numel() for x in g)}; SGD lr matching Adam's first-order step at lr: lr*{l1/l2:.4g}")
    if opt_name == "sgd-matched":        # same first-order loss decrease as Adam's sign step at lr: lr*L1 = eta*L2^2
        for pg in opt.param_groups:
            pg["lr"] = lr * l1 / l2
        print("sgd lr", lr * l1 / l2)
    _step()
opt.step = step_and_report
model.train(); t0 = time.time()
st = rl.grpo_update(model, opt, train, adv, args, tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id)
print("train_s", time.time() - t0, st)
print("update norm", sum((p.detach() - b).pow(2).sum().item() for p, b in zip(params, before)) ** 0.5,
      "adapter norm", sum(b.pow(2).sum().item() for b in before) ** 0.5)
model.save_pretrained(out + "/adapter", selected_adapters=["default"])
tasks = envs.held_out_tasks(["retail", "airline"], 20, ["easy"], 0)
agent = rollout.ModelAgent(model, tok, temperature=0.0, max_new_tokens=80)
model.eval(); t0 = time.time()
res = rollout.run_episodes(agent, tok, tasks, max_turns=7, max_context=3072, seed=0, progress=False)
for d in ("retail", "airline"):
    r = [t for t in res if t.domain == d]
    print(d, sum(t.reward >= 1 for t in r), "/", len(r), "stops", [t.stop_reason for t in r].count("max_turns"))
print("eval_s", time.time() - t0, "pass1", sum(t.reward >= 1 for t in res) / len(res))
json.dump({t.task_id: t.reward for t in res}, open(out + "/rewards.json", "w"))
