"""How much code one GRPO step runs: a line trace of rl.py's step on a tiny model, per file.

    python scripts/trace_step.py                 # --sampler plain --logprob-pass plain, the path a reader follows
    python scripts/trace_step.py --default       # the default samplers and passes instead

The trace is on only while the step's own work runs: rl.sample_groups (a --smoke sampling step: one task, two
conversations of one agent turn, a tiny random Llama with the default model's tokenizer), then rl.grpo_step on
those two rollouts handed in, their rewards set to 1 and 0 so the group teaches (older commits: group_advantages
and grpo_update, while main held the lines between them). It counts the distinct lines executed and the distinct
functions entered in this repository's files, and prints them per file: the step's own code first, then the
world's (envs/, users.py: the tasks, tools and users it talks to). Functions are named ones (a comprehension or a
lambda is part of the function it sits in); a line is every source line of a statement run (a call written over
three lines is three) and the def line of a function entered; the update takes the CPU preset's two mini-batches.
Loading, logging and checkpoints are outside the trace.

It runs on the code before the step was made plain too (copy it into a clone at c450feb): docs/results.md gives
both counts.
"""
import argparse
import ast
import functools
import inspect
import os
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import envs  # noqa: E402
import rl  # noqa: E402
import rollout  # noqa: E402
import sampler  # noqa: E402

WORLD = ("envs/", "users.py")


class Tracer:
    """sys.settrace that keeps, for files of this repository, the lines run and the functions entered."""

    def __init__(self):
        self.lines, self.functions = defaultdict(set), defaultdict(set)

    def __call__(self, frame, event, arg):
        path = os.path.relpath(frame.f_code.co_filename, ROOT)
        if path.startswith(("..", ".venv", "scripts/")) or not path.endswith(".py"):
            return None                                   # not ours: do not trace inside it
        if event == "call" and not frame.f_code.co_name.startswith("<"):   # named: no comprehension or lambda
            self.functions[path].add((frame.f_code.co_qualname, frame.f_code.co_firstlineno))
        return self.local

    def local(self, frame, event, arg):
        if event == "line":
            self.lines[os.path.relpath(frame.f_code.co_filename, ROOT)].add(frame.f_lineno)
        return self.local

    def physical_lines(self, path: str) -> set:
        """The source lines of the statements run: all of a simple statement's lines (a call written over three
        lines is three), a compound statement's header (its `for ...:` or `with ...:` lines, not its body), and the
        `def` line of each function entered."""
        spans = {}
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if isinstance(node, ast.stmt):
                body = getattr(node, "body", None)
                end = body[0].lineno - 1 if isinstance(body, list) and body and not isinstance(node, ast.Lambda) \
                    else node.end_lineno
                spans.setdefault(node.lineno, range(node.lineno, max(end, node.lineno) + 1))
        lines = set()
        for n in self.lines[path] | {first for _, first in self.functions[path]}:
            lines |= set(spans.get(n, [n]))
        return lines

    def run(self, fn, *a, **kw):
        sys.settrace(self)
        try:
            return fn(*a, **kw)
        finally:
            sys.settrace(None)


def tiny_model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return rollout.add_lora(LlamaForCausalLM(cfg), r=4, alpha=8)


def step_args(default: bool, out: str):
    """rl.py's --smoke arguments, with the plain sampler and pass unless default (a flag the code does not have
    is left out, so that an older rl.py can be traced too)."""
    argv = ["--smoke", "--out", out, "--init", "base", "--mini-batches", "2"]   # the CPU preset's update
    if not default:
        argv += ["--sampler", "plain"] + (["--logprob-pass", "plain"] if "--logprob-pass" in inspect.getsource(rl) else [])
    return rl.parse_args(argv)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--default", action="store_true", help="the default sampler and log-prob pass")
    ns = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    args = step_args(ns.default, tempfile.mkdtemp())
    tok = rollout.load_tokenizer()
    model = tiny_model(tok)
    pools = {d: envs.make_tasks(d, "train", rl.TASK_POOL, args.tiers.split(","), args.seed)
             for d in args.domains.split(",")}
    agent = sampler.make_agent(args.sampler, model, tok, args.temperature, args.max_new_tokens)
    torch.manual_seed(0)
    trace = Tracer()
    if hasattr(rl, "grpo_step"):                                # the step one function: its sampling, then the rest
        sampling = rl.Sampling(agent, tok, rl.common.user_factory(args))
        drawn, lost = trace.run(rl.sample_groups, sampling, pools, 0, args)
        trajs = [t for g in drawn for t in g][:2]
        for t, r in zip(trajs, (1.0, 0.0)):
            t.reward = r
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
        trace.run(rl.grpo_step, model, optimizer, sampling, pools, 0, args=args, setup=rl.common.setup_device(args),
                  groups=[trajs])
        report(trace)
        return
    users = inspect.signature(rl.sample_groups).parameters      # older commits' ways, so their step traces too
    if {"draw", "make_groups"} & set(users):                    # main hands sample_groups the draw
        draw = functools.partial(rl.sample_draw, agent, tok, args, rl.common.user_factory(args))
        drawn, kept, lost = trace.run(rl.sample_groups, draw, pools, 0, args)
    else:
        user = rl.common.user_factory(args) if "make_user" in users else {"user_workers": 1}
        drawn, kept, lost = trace.run(rl.sample_groups, agent, tok, pools, 0, args, user)
    trajs = [t for g in drawn for t in g][:2]
    for t, r in zip(trajs, (1.0, 0.0)):
        t.reward = r
    takes_g = "group_size" in inspect.signature(rl.group_advantages).parameters   # older commits: (rewards, G)
    adv = trace.run(rl.group_advantages, torch.tensor([t.reward for t in trajs]), *([2] if takes_g else []))
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    model.train()
    params = inspect.signature(rl.grpo_update).parameters       # older commits' names, so their step traces too
    first = "at_start" if "at_start" in params else "ref_is_policy"
    setup = {"setup": rl.common.setup_device(args)} if "setup" in params else {}   # older commits: none
    trace.run(rl.grpo_update, model, optimizer, trajs, adv, args, pad_id=tok.pad_token_id,
              **{first: True, **({"seed": 0} if "seed" in params else {}), **setup})
    report(trace)


def report(trace):
    """The traced lines and functions a file, the step's files and the world's apart."""
    lines = {f: trace.physical_lines(f) for f in trace.lines}
    rows = sorted(lines, key=lambda f: (f.startswith(WORLD), f))
    print(f"{'file':<28}{'lines':>7}{'functions':>11}")
    for part, world in (("the step", False), ("the world", True)):
        files = [f for f in rows if f.startswith(WORLD) == world]
        for f in files:
            print(f"{f:<28}{len(lines[f]):>7}{len(trace.functions[f]):>11}")
        print(f"{part + ': ' + str(len(files)) + ' files':<28}{sum(len(lines[f]) for f in files):>7}"
              f"{sum(len(trace.functions[f]) for f in files):>11}\n")
    for f in [f for f in rows if not f.startswith(WORLD)]:
        print(f, ", ".join(sorted(name for name, _ in trace.functions[f])))

if __name__ == "__main__":
    main()
