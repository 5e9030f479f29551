"""Probe: can the 135M cold start read the bag count when its data holds both requests equally?
`python sft.py` draws its 20 airline add_bags tasks as they come (at seed 0: 14 ask for 1 more bag, 6 for
2 more). This runs the same CPU-preset SFT, with the same retail tasks, but with the first 10 train tasks
of each count instead. From the repo root:
    python docs/probe_balanced_sft.py runs/sft_bal         # then: python eval.py --agents sft,runs/sft_bal/adapter
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs, sft

if len(sys.argv) != 2:
    sys.exit(__doc__)
train_tasks = envs.train_tasks


def bags_asked(task) -> int:
    return int(task.hidden_facts["bags"].split()[0])   # "1 more" or "2 more"


def balanced(domain, n, tiers, seed=0):
    """Retail as sft.py draws it; airline: the first 10 easy train tasks asking for 1 more bag, and the first 10
    asking for 2 more (both from a pool 10x larger than sft.py's)."""
    tasks = train_tasks(domain, n * (10 if domain == "airline" else 1), tiers, seed)
    if domain != "airline":
        return tasks
    return [t for k in (1, 2) for t in [t for t in tasks if bags_asked(t) == k][:10]]


envs.train_tasks = balanced
sft.main(["--out", sys.argv[1]])
