"""common.py: what the stages (sft.py, rl.py, rl_trl.py, eval.py) share, written once.

  Parser, fail                            argparse with one line per bad value (exit 2)
  add_run_args, add_model_args,           the flags stages share: seed/out/smoke/preset, the model, the user,
  add_user_args, add_episode_args,        an episode's limits, and the GRPO flags of rl.py and rl_trl.py
  add_grpo_args
  fill_preset, CPU_LIMITS                 one preset scheme: PRESETS = {"gpu", "cpu", "smoke"} per stage
  check_args                              bad input caught before any model loads
  start_run                               threads, print and save the arguments, make --out, refuse a resume
                                          with other settings
  user_kwargs                             what run_episodes needs to build the chosen user simulator
  figure, save_figure                     matplotlib without a display, for each stage's PNG
  save_checkpoint, resume                 one checkpoint layout: the last two kept, the newest verified, and
                                          one way to resume from it (adapter, optimizer, scheduler, RNG, metrics)
A stage imports this file, the world (worlds) and the loop (rollout); never another stage.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys

import torch

# The CPU presets' episode limits, shared so that RL trains on what eval measures: the easy tasks need
# 5 agent turns and one correction after a "no" needs 2 more; 80 tokens hold the longest oracle message.
CPU_LIMITS = dict(max_turns=7, max_new_tokens=80, max_context=3072)
TIERS = ("easy", "medium", "hard")


class Parser(argparse.ArgumentParser):
    """argparse, with an error as one line ("rl.py: --lr: ...") and exit status 2, as argparse exits."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}\n")


def fail(flag: str, message: str):
    """One line naming the flag, then exit 2 (argparse's status for bad input)."""
    print(f"{os.path.basename(sys.argv[0]) or 'mua-rl'}: {flag}: {message}", file=sys.stderr)
    raise SystemExit(2)


def add_run_args(p, out: str, smoke: str):
    """--seed, --out, --smoke and --preset: how every stage is started."""
    p.add_argument("--seed", type=int, default=0, help="seed for tasks, users and sampling")
    p.add_argument("--out", default=out, help="everything this run writes goes here")
    p.add_argument("--smoke", action="store_true", help=smoke)
    p.add_argument("--preset", default="auto", choices=["auto", "cpu", "gpu"], help="the sizes of every flag left "
                   "unset (the stage's PRESETS): auto = gpu with CUDA, else cpu; --smoke overrides")


def add_model_args(p, model_default=None, sampler=True):
    """--model and --load-in-4bit; with sampler (a stage that samples from the model) --thinking, --kv-budget."""
    p.add_argument("--model", default=model_default, help="HF model id or local path; default: the bundled "
                   "SmolLM2-135M-Instruct (rollout.DEFAULT_MODEL)")
    p.add_argument("--load-in-4bit", action="store_true", help="NF4 base weights (bitsandbytes), LoRA on top (QLoRA)")
    if not sampler:
        return
    p.add_argument("--thinking", action="store_true", help="Qwen3 thinking mode (off by default, as in the paper)")
    p.add_argument("--kv-budget", type=float, default=0.0, help="GiB of keys/values the sampler may hold; it decodes "
                   "in waves that fit (0 = auto: free GPU memory minus the training step's reserve; CPU: no limit)")


def add_user_args(p, default="scripted", several=False):
    import users
    p.add_argument("--user", default=default, help=f"user simulator: {users.user_help()} (users.USER_KINDS; "
                   "personas and their train / held-out split: users.PERSONAS)" + ("; a comma list evaluates under "
                   "each" * several))
    p.add_argument("--user-base-url", default=None, help="base URL of an openai:MODEL user's server "
                   "(default $OPENAI_BASE_URL; key $OPENAI_API_KEY)")
    p.add_argument("--user-workers", type=int, default=16, help="LLM users asked at once (each round's replies)")


def add_episode_args(p, tokens: bool = True):
    """An episode's limits (preset); tokens: also the agent's tokens per turn and the context."""
    p.add_argument("--max-turns", type=int, default=None, help="agent turns per episode (preset; paper 30)")
    if tokens:
        p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per agent turn (preset)")
        p.add_argument("--max-context", type=int, default=None, help="episode token limit (preset)")


def add_grpo_args(p):
    """The flags of GRPO itself, the same in rl.py and rl_trl.py (TRL's names in brackets)."""
    p.add_argument("--init", default="auto", help="SFT adapter dir (the KL reference is frozen at it), 'base' (no "
                   "cold start: a fresh LoRA, the reference the base model), or 'auto' = runs/sft/adapter if present "
                   "else base")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank from --init base")
    p.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha from --init base")
    p.add_argument("--reward", default="binary", choices=["binary", "shaped"], help="task reward (Env.reward)")
    p.add_argument("--domains", default=None, help="comma-separated train domains (preset)")
    p.add_argument("--tiers", default=None, help="task tiers to train on (preset)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (preset); a larger value resumes a run")
    p.add_argument("--tasks", type=int, default=None, help="groups trained per step (preset; paper 32)")
    p.add_argument("--group-size", type=int, default=None, help="rollouts per task G [num_generations] (preset; "
                   "paper 8)")
    add_episode_args(p)
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (preset; paper 1.0)")
    p.add_argument("--kl-coef", type=float, default=0.001, help="beta for the k3 KL to the reference (paper 0.001) "
                   "[beta; TRL's default is 0]")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon, both sides (paper 0.2) [epsilon]")
    p.add_argument("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean"], help="token-mean: every "
                   "sampled token weighs the same (DAPO, the official code) [dapo]; seq-mean: every rollout does "
                   "(GRPO paper) [grpo]")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (preset)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward "
                   "[per_device_train_batch_size] (preset)")
    p.add_argument("--grad-checkpointing", default=None, choices=["on", "off"], help="recompute activations in "
                   "backward (preset: GPU on; CPU off, which lets the system prompt run once per pass)")


def fill_preset(args, presets: dict, name: str | None = None):
    """Every flag left at None takes the value of the stage's preset: presets[name] if given (sampler.py: its
    tour or its bench), else presets["smoke"] with --smoke, else presets[--preset] (auto: "gpu" where CUDA is,
    else "cpu")."""
    if name is None:
        name = "smoke" if args.smoke else args.preset if args.preset != "auto" else \
            "gpu" if torch.cuda.is_available() else "cpu"
    for k, v in presets[name].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


def check_args(args, at_least=None, finite=None, several_users=False, training=False):
    """Exit 2 with one line on the first bad value, before any model loads or any file is written.
    at_least: {flag name: minimum} for ints; finite: {flag name: (low, strict)} for floats (value > low if
    strict, else >= low); several_users: --user may be a comma list (eval.py); training: a stage that trains on
    --user's conversations (no held-out persona)."""
    import users
    import worlds
    for name, low in (at_least or {}).items():
        v = getattr(args, name)
        if v is not None and v < low:
            fail(f"--{name.replace('_', '-')}", f"{v} is below {low}; use {low} or more")
    for name, (low, strict) in (finite or {}).items():
        v = getattr(args, name)
        if v is not None and (not math.isfinite(v) or v < low or (strict and v == low)):
            fail(f"--{name.replace('_', '-')}", f"{v} is not a finite number {'>' if strict else '>='} {low}")
    if getattr(args, "domains", None) is not None:
        for d in args.domains.split(","):
            if d not in worlds.DOMAINS:
                fail("--domains", f"unknown domain {d!r}; use a comma list of {', '.join(worlds.DOMAINS)}")
    if getattr(args, "tiers", None) is not None:
        for t in args.tiers.split(","):
            if t not in TIERS:
                fail("--tiers", f"unknown tier {t!r}; use a comma list of {', '.join(TIERS)}")
    if getattr(args, "user", None) is not None:       # users.USER_KINDS and users.PERSONAS say what is valid
        for u in args.user.split(",") if several_users else [args.user]:
            if error := users.check_user(u, training):
                fail("--user", error)
    ctx, new = getattr(args, "max_context", None), getattr(args, "max_new_tokens", None)
    if ctx is not None and new is not None and ctx <= new:
        fail("--max-context", f"{ctx} leaves no room for the prompt beside --max-new-tokens {new}; raise it")
    for name in ("init", "adapter"):
        v = getattr(args, name, None)
        if v not in (None, "auto", "base") and not os.path.isfile(os.path.join(v, "adapter_config.json")):
            fail(f"--{name}", f"{v} is not an adapter dir (no adapter_config.json); run `python sft.py` first"
                 + (" or pass --init base" if name == "init" else ""))


def start_run(args, out: str | None = None, may_change=None):
    """The run's preamble: 2 torch threads on a CPU (a shared 2-core machine), the arguments printed and
    saved as <out>/args.json (when given). may_change: when given, a rerun that would resume <out>'s checkpoints with any
    other argument changed is refused (one line), since it would mix two runs in one."""
    if not torch.cuda.is_available():
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(vars(args))
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "args.json")
    if may_change is not None and checkpoints(out) and os.path.exists(path):
        with open(path) as f:
            before = {k: v for k, v in json.load(f).items() if k not in may_change}
        diff = {k: (before.get(k), v) for k, v in vars(args).items() if k not in may_change and before.get(k) != v}
        if diff:
            raise SystemExit(f"{out} holds a run with other settings {diff}: pick another --out or delete it")
    with open(path, "w") as f:
        json.dump(vars(args), f, indent=1)


def user_kwargs(args, model=None, tokenizer=None, user=None) -> dict:
    """run_episodes' user arguments for user (default --user): the server of an openai: user, the model of a local
    one, the pool size."""
    kw, user = {"user_workers": args.user_workers}, user or args.user
    if user.startswith("openai:"):
        kw["base_url"] = args.user_base_url
    if user == "local":
        kw["model"], kw["tokenizer"] = model, tokenizer
    return kw


def figure(ncols: int, size: tuple, **kw):
    """A row of ncols matplotlib axes, drawn without a display. -> (fig, axes)"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(1, ncols, figsize=size, **kw)


def save_figure(fig, path: str, dpi: int = 90):
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- checkpoints
# <out>/ckpt-NNNNNN/ = the state after NNNNNN optimizer steps: adapter/ (the trained LoRA), state.pt (optimizer,
# scheduler, RNG states: tensors and plain types, loaded with weights_only=True), progress.json (step, metrics).
# Written to ckpt-NNNNNN.tmp, flushed to disk, then renamed (atomic); the last two are kept, so a newest one that
# a full disk or a cut copy damaged falls back to the one before.

def _fsync_tree(path):
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(out, step, model, optimizer, metrics, scheduler=None, keep=2):
    final = os.path.join(out, f"ckpt-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(os.path.join(tmp, "adapter"), selected_adapters=["default"])   # not a frozen "ref"
    rng = dict(python=random.getstate(), torch=torch.get_rng_state(),
               cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    torch.save(dict(optimizer=optimizer.state_dict(), rng=rng,
                    scheduler=scheduler.state_dict() if scheduler else None), os.path.join(tmp, "state.pt"))
    with open(os.path.join(tmp, "progress.json"), "w") as f:
        json.dump(dict(step=step, metrics=metrics), f)
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def checkpoints(out) -> list[str]:
    """Complete checkpoint dirs under out, oldest first."""
    names = sorted(n for n in os.listdir(out) if n.startswith("ckpt-") and not n.endswith(".tmp")) \
        if os.path.isdir(out) else []
    return [os.path.join(out, n) for n in names]


def _verified(ckpt):
    """(state, progress) of a checkpoint that loads whole and whose step agrees with its metrics; else raises."""
    from safetensors.torch import load_file
    load_file(os.path.join(ckpt, "adapter", "adapter_model.safetensors"))
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True)
    with open(os.path.join(ckpt, "progress.json")) as f:
        progress = json.load(f)
    steps = [m["step"] for m in progress["metrics"] if "step" in m]
    if progress["step"] != int(os.path.basename(ckpt)[5:]) or (steps and steps[-1] != progress["step"]):
        raise ValueError(f"step {progress['step']} disagrees with its name or its metrics")
    return state, progress


def load_checkpoint(out):
    """The newest checkpoint that verifies -> (dir, state, progress), or (None, None, None) when none does.
    A damaged one is reported in one line and skipped."""
    for ckpt in reversed(checkpoints(out)):
        try:
            state, progress = _verified(ckpt)
        except Exception as e:
            print(f"checkpoint {ckpt} is damaged ({type(e).__name__}: {str(e)[:120]}); trying the one before")
            continue
        return ckpt, state, progress
    return None, None, None


def resume(out, model, optimizer, scheduler=None) -> tuple[int, list[dict]]:
    """Continue from the newest checkpoint that verifies: its adapter weights into the model's trained adapter,
    the optimizer's and scheduler's states, the RNG states. -> (steps done, their metrics); (0, []) when there
    is none. <out>/metrics.jsonl is rewritten to those metrics, dropping steps logged after the checkpoint."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    ckpt, state, progress = load_checkpoint(out)
    start, metrics = (progress["step"], progress["metrics"]) if ckpt else (0, [])
    if ckpt:
        set_peft_model_state_dict(model, load_file(os.path.join(ckpt, "adapter", "adapter_model.safetensors")))
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        print(f"resumed from {ckpt} at step {start}")
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in metrics)
    return start, metrics
