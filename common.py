"""common.py: what the stages (sft.py, rl.py, scripts/rl_trl.py, eval.py) share, written once.

  Parser, fail                            argparse with one line per bad value (exit 2)
  add_run_args, add_model_args,           the flags stages share: seed/out/smoke/preset, the model, the user, an
  add_user_args, add_episode_args         episode's limits
  parse_with_preset, CPU_LIMITS           one preset scheme: PRESETS = {"gpu", "cpu", "smoke"} per stage, the
                                          numbers in use shown by --help
  check_args                              bad input caught before any model loads
  start_run                               threads, print and save the arguments, make --out, refuse a resume
                                          with other settings
  user_factory                            the one builder of each conversation's simulated user
  asked_before_writing                    did an episode's agent ask to confirm before its first write (eval.py's
                                          metric, rl.py's per-user asking rate)
  log_metrics, plot_panels                a step's line in metrics.jsonl, a stage's PNG
  figure, save_figure                     matplotlib without a display
  save_checkpoint, resume                 one checkpoint layout: the last two kept, the newest verified, and
                                          one way to resume from it (adapter, optimizer, scheduler, RNG, metrics)
The training passes (micro-batches, pi_ref, the fast log-prob pass) are kernels/passes.py.
A stage imports this file, the world (envs) and the loop (rollout); never another stage.
"""
import argparse
import functools
import json
import math
import os
import random
import shutil
import sys
from typing import Callable, NamedTuple

import torch

# The CPU presets' tasks and episode limits, shared so that RL trains on what eval measures. The tasks: one
# medium-tier scenario a domain, whose opening withholds the ids (the user must be asked) and whose write takes one
# id: the seven medium scenarios at 7 gold conversations each left the 135M cold start at 0 successes in 48 rollouts
# (docs/results.md). The limits, from the gold agent on these two under every persona (tests/test_personas.py): its
# longest episode is 9 agent turns (x 1.5 = 14), its longest message 62 tokens, its longest conversation 2,894 tokens,
# system prompt included (retail's 1,759 tokens, airline's 1,581; + a turn's 80, x 1.2 = 3,584).
CPU_TIERS = "change_order_payment,cancel_trip"
CPU_LIMITS = dict(max_turns=14, max_new_tokens=80, max_context=3584)
# The GPU presets' episode limits (rl.py, eval.py): the paper-sized run's 30 agent turns of <= 256 tokens in 8k.
GPU_LIMITS = dict(max_turns=30, max_new_tokens=256, max_context=8192)
EVAL_TASKS = 24          # eval.py's held-out tasks a domain; rl.py's curve takes the ones after them
TIERS = ("easy", "medium", "hard")


class ShowDefaults(argparse.HelpFormatter):
    """--help prints every flag's default in use: the preset's number where a preset sets it."""

    def _get_help_string(self, action):
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS \
            and "%(default)" not in action.help
        return action.help + " (default: %(default)s)" if shown else action.help


class Parser(argparse.ArgumentParser):
    """argparse, with an error as one line ("rl.py: --lr: ...") and exit status 2, as argparse exits, every default
    shown in --help, and the flags in named groups (group(title)): the few a reader meets (the run, the model, the
    world, the algorithm), then one "more" group with the ablations, performance, the user's server and logging."""

    GROUPS = {"run": "the run", "model": "the model", "world": "the world and the user",
              "algorithm": "the algorithm", "more": "more: ablations (the paper's and ours), speed and memory, "
                                                    "the user simulator's server and checks, logging"}

    def __init__(self, *a, **kw):
        super().__init__(*a, formatter_class=ShowDefaults, usage="%(prog)s [flags] (the groups below; --help)", **kw)
        self.groups = {name: self.add_argument_group(title) for name, title in self.GROUPS.items()}   # --help's order

    def group(self, name: str):
        return self.groups[name]

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}\n")


def parse_with_preset(p: Parser, presets: dict, argv=None, name: str | None = None):
    """Parse argv with the preset's numbers as the defaults, so --help shows the numbers in use. The preset is
    presets[name] if given (sampler/bench.py: its tour or its bench), else presets["smoke"] with --smoke, else
    presets[--preset] (auto: "gpu" where CUDA is, else "cpu")."""
    if name is None:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--preset", default="auto")
        pre.add_argument("--smoke", action="store_true")
        known = pre.parse_known_args(argv)[0]
        name = "smoke" if known.smoke else known.preset if known.preset != "auto" else \
            "gpu" if torch.cuda.is_available() else "cpu"
    if name in presets:                          # else p.parse_args names the bad --preset
        p.set_defaults(**presets[name])
        p.epilog = f"Defaults shown: the {name!r} preset ({', '.join(presets)}: the file's PRESETS table)."
    return p.parse_args(argv)


def fail(flag: str, message: str):
    """One line naming the flag, then exit 2 (argparse's status for bad input)."""
    print(f"{os.path.basename(sys.argv[0]) or 'mua-rl'}: {flag}: {message}", file=sys.stderr)
    raise SystemExit(2)


class Device(NamedTuple):
    """What a training step does differently by device, decided once (setup_device), so that the step's functions
    take it and branch on nothing."""
    precision: Callable      # () -> the context the update's forward passes run in: bf16 autocast, or none at all
    checkpointing: bool      # gradient checkpointing: less activation memory; its layers drop the shared prefix's
                             # cache, so the log-prob pass runs every row whole
    sampler: dict            # sampler.make_agent's device settings: kv_budget_gib (0: automatic), sample_weights
    kernel: str = "torch"    # the log-prob kernel (kernels/logprobs.py): "triton" on a GPU, the torch reference on CPU


def native_bf16() -> bool:
    """Does this CPU compute bf16 dot products natively (AVX512-BF16 or AMX)? torch's own probes."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def setup_device(args, lora_r: int = 16) -> Device:
    """Everything that differs by device, in one place, before the model loads: --train-bf16 auto resolved into args
    (bf16 autocast on a CPU with native bf16; off on a GPU, whose weights already compute in bf16, and with 4-bit
    weights); on a GPU the memory plan printed, and refused in one line when it cannot fit; gradient checkpointing
    and the sampler's KV budget and weights as the flags (and presets) say."""
    cuda = torch.cuda.is_available()
    if args.train_bf16 == "auto":
        args.train_bf16 = "on" if native_bf16() and not cuda and not args.load_in_4bit else "off"
    if cuda:
        import rollout
        say_memory_plan(args, rollout.model_config(args.model or rollout.DEFAULT_MODEL),
                        torch.cuda.get_device_properties(0).total_memory, lora_r)
    precision = functools.partial(torch.autocast, "cuda" if cuda else "cpu", torch.bfloat16,
                                  enabled=args.train_bf16 == "on")
    return Device(precision, args.grad_checkpointing == "on",
                  dict(kv_budget_gib=args.kv_budget, sample_weights=args.sample_weights), logprob_kernel())


def logprob_kernel() -> str:
    """The log-prob kernel the passes use, decided once: Triton's on a GPU with triton installed, else the torch
    reference (kernels/logprobs.py)."""
    from kernels.logprobs import HAVE_TRITON
    return "triton" if torch.cuda.is_available() and HAVE_TRITON else "torch"


def say_memory_plan(args, config, card: int, lora_r: int = 16):
    """On a GPU, before the model loads: the run's memory plan, one line (sampler/memory.py); one line naming the
    way out and exit 2 when it cannot fit a card of `card` bytes."""
    from sampler import ModelAgent
    from sampler.memory import memory_plan
    line, error = memory_plan(config, card, args.load_in_4bit, args.sample_weights, int(args.kv_budget * 2**30) or None,
                              args.max_context, lora_r, ModelAgent.KV_RESERVE)
    print(line, flush=True)
    if error:
        fail("memory", error)


def add_run_args(p: Parser, out: str, smoke: str, tracker: bool = False):
    """--seed, --out, --smoke and --preset: how every stage is started; with tracker (rl.py) --report-to."""
    g = p.group("run")
    g.add_argument("--seed", type=int, default=0, help="seed for tasks, users and sampling")
    g.add_argument("--out", default=out, help="everything this run writes goes here")
    g.add_argument("--smoke", action="store_true", help=smoke)
    g.add_argument("--preset", default="auto", choices=["auto", "cpu", "gpu"], help="the sizes of every flag not "
                   "given (the stage's PRESETS): auto = gpu with CUDA, else cpu; --smoke overrides")
    if tracker:
        p.group("more").add_argument("--report-to", default="none", choices=["none", "tensorboard", "wandb"],
                                     help="also send each step's numbers to this tracker, under --out (optional "
                                     "packages: requirements.txt)")


def add_model_args(p: Parser, model_default=None, sampler=True):
    """--model and --load-in-4bit; with sampler (a stage that samples from the model) --thinking, --sampler and
    --kv-budget."""
    g = p.group("model")
    g.add_argument("--model", default=model_default, help="HF model id or local path; none: the bundled "
                   "SmolLM2-135M-Instruct (rollout.DEFAULT_MODEL)")
    g.add_argument("--load-in-4bit", action="store_true", help="NF4 base weights (bitsandbytes), LoRA on top (QLoRA)")
    if not sampler:
        return
    g = p.group("more")
    g.add_argument("--thinking", action="store_true", help="Qwen3 thinking mode (off by default, as in the paper)")
    g.add_argument("--sampler", default="fast", choices=["fast", "plain"], help="fast: sampler/fast.py, many "
                   "conversations at once; plain: sampler/plain.py's sample_turn, one conversation at a time (the "
                   "code to read; greedy, the same tokens, tested; slower)")
    g.add_argument("--kv-budget", type=float, default=0.0, help="GiB of keys/values the fast sampler may hold; it "
                   "decodes in waves that fit (0 = auto: free GPU memory minus the training step's reserve; CPU: no "
                   "limit)")
    g.add_argument("--sample-weights", default="auto", choices=["auto", "bf16", "nf4"], help="the GPU decode step's "
                   "weights: bf16, a copy of the base with the LoRA delta merged, refreshed after an optimizer step "
                   "(12.9 GiB for Qwen3-8B); nf4, bitsandbytes' layers with LoRA unmerged (24 GB cards); auto: bf16 "
                   "when copy + the update's 6 GiB + the KV budget fit the free memory (docs/gpu.md); CPU: unused")


def add_user_args(p: Parser, default="scripted", several=False):
    import envs
    import users
    g = p.group("world")
    g.add_argument("--user", default=default, help=f"user simulator: {envs.user_help()} (envs.USER_KINDS; "
                   "behaviours, personas and their train / held-out split: users.AXES, users.PERSONAS)"
                   + ("; a comma list evaluates under each" if several else ""))
    g = p.group("more")
    g.add_argument("--user-base-url", default=None, help="base URL of an openai:MODEL user's server "
                   "(default $OPENAI_BASE_URL; key $OPENAI_API_KEY)")
    g.add_argument("--user-check", default="on", choices=["on", "off"], help="check each message of an LLM user of "
                   "our domains (envs/llm_users.py's check_turn: a stop before the needed write, a fact the task does not hold, the "
                   "agent's voice, nothing); off: take every message as it comes")
    g.add_argument("--user-retries-on-check", type=int, default=2, help="times a message the check flags is asked "
                   "again (a correction line, a seeded higher temperature); then the episode is left out")
    g.add_argument("--user-price", type=price, default="0,0", metavar="IN,OUT", help="USD per million prompt "
                   "and completion tokens of the user simulator, for the dollars reported (0,0: a local server)")
    g.add_argument("--max-sim-failures", type=float, default=0.25, help="stop when more than this share of a draw's "
                   "(rl.py) or an evaluation's rollouts were left out: their LLM user's simulator failed or broke the "
                   "check (never trained on nor scored; a scripted user or our env that raises stops the run)")
    g.add_argument("--user-workers", type=int, default=users.USER_WORKERS, help="LLM users asked at once (each "
                   "round's replies; 256 = a paper-sized round all in flight; 1 for a server that answers one at a time)")
    g.add_argument("--user-timeout", type=float, default=60.0, help="seconds an LLM user's request may take before "
                   "the client sends it again (a slow local server needs more)")


def price(text: str) -> list[float]:
    """--user-price "IN,OUT" -> [IN, OUT], two finite numbers >= 0 (a list: args.json keeps it as one)."""
    try:
        pair = [float(x) for x in text.split(",")]
    except ValueError:
        pair = []
    if len(pair) != 2 or not all(math.isfinite(x) and x >= 0 for x in pair):
        raise argparse.ArgumentTypeError(f"{text!r} is not IN,OUT: two numbers >= 0 (USD per million tokens)")
    return pair


def add_episode_args(p: Parser, tokens: bool = True):
    """An episode's limits; tokens: also the agent's tokens per turn and the context."""
    g = p.group("world")
    g.add_argument("--max-turns", type=int, default=None, help="agent turns per episode (paper 30)")
    if tokens:
        g = p.group("more")
        g.add_argument("--max-new-tokens", type=int, default=None, help="tokens per agent turn")
        g.add_argument("--max-context", type=int, default=None, help="episode token limit")


def check_args(args, at_least=None, finite=None, several_users=False, training=False):
    """Exit 2 with one line on the first bad value, before any model loads or any file is written.
    at_least: {flag name: minimum} for ints; finite: {flag name: (low, strict)} for floats (value > low if
    strict, else >= low); several_users: --user may be a comma list (eval.py); training: a stage that trains on
    --user's conversations (no held-out persona)."""
    import envs
    at_least = {"user_retries_on_check": 0, **(at_least or {})}       # the user flags, where a stage has them
    finite = {"max_sim_failures": (0, False), "user_timeout": (0, True), **(finite or {})}
    for name, low in at_least.items():
        v = getattr(args, name, None)
        if v is not None and v < low:
            fail(f"--{name.replace('_', '-')}", f"{v} is below {low}; use {low} or more")
    for name, (low, strict) in finite.items():
        v = getattr(args, name, None)
        if v is not None and (not math.isfinite(v) or v < low or (strict and v == low)):
            fail(f"--{name.replace('_', '-')}", f"{v} is not a finite number {'>' if strict else '>='} {low}")
    if getattr(args, "domains", None) is not None:
        for d in args.domains.split(","):
            if d not in envs.DOMAINS:
                fail("--domains", f"unknown domain {d!r}; use a comma list of {', '.join(envs.DOMAINS)}")
    if getattr(args, "tiers", None) is not None:
        from envs import ours
        scenarios = [s for d in ours.DOMAINS for s in ours.SCENARIOS[d]]
        for t in args.tiers.split(","):
            if t not in TIERS and t not in scenarios:
                fail("--tiers", f"unknown tier {t!r}; use a comma list of {', '.join(TIERS)} or of scenario names "
                                f"({', '.join(scenarios)})")
    if getattr(args, "user", None) is not None:       # envs.USER_KINDS and users.PERSONAS say what is valid
        for u in args.user.split(",") if several_users else [args.user]:
            if error := envs.check_user(u, training):
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
    """The run's preamble: 2 torch threads on a CPU (a shared 2-core machine), the arguments printed and saved as
    <out>/args.json (when given). may_change, for a stage that resumes: when <out>/args.json holds a run whose
    settings differ in any argument but these, the rerun is refused in one line (exit 2) before anything is loaded
    or written, since it would mix two runs in one folder (or claim the old one's results as its own). A flag the
    saved run predates is taken as unchanged."""
    path = os.path.join(out, "args.json") if out else None
    if may_change is not None and path and os.path.exists(path):
        with open(path) as f:
            before = json.load(f)
        diff = [f"--{k.replace('_', '-')} {before[k]!r} there, {v!r} now" for k, v in vars(args).items()
                if k not in (*may_change, "out") and k in before and before[k] != v]   # a folder may move
        if diff:
            fail("--out", f"{out} holds a run with other settings ({'; '.join(diff)}): pick another --out, or "
                 "delete it to start over")
    if not torch.cuda.is_available():
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(vars(args))
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(vars(args), f, indent=1)


def user_factory(args, model=None, tokenizer=None, spec=None):
    """The one builder of each conversation's simulated user for spec (default --user): an envs.UserFactory with
    what that kind needs, the server of an openai: user or the model of a local one."""
    import envs
    spec = spec or args.user
    check = {"check_retries": args.user_retries_on_check if args.user_check == "on" else None}
    settings = {}
    if spec.startswith("openai:"):
        settings = {"base_url": args.user_base_url, "timeout": args.user_timeout, **check}
    elif spec == "local":
        settings = {"model": model, "tokenizer": tokenizer, **check}
    return envs.UserFactory(spec, settings)


def asked_before_writing(traj) -> bool | None:
    """Did the agent ask the user to confirm before its first write call? None if it made no write call
    (or the domain has no write list: τ²). "Confirm before acting" is one of the behaviours MUA-RL's user
    in the loop is meant to teach, and the reward, a database check, does not see it: a write that skips
    the confirmation scores 1 when its values happen to be right. Only turns without an executed call
    count as asking: one that also calls a tool has acted before the user could answer. (A turn whose
    call was malformed counts by its text, though the env's error, not the user, answered it.)"""
    from envs import ours
    import users
    writes, asked = ours.WRITE_TOOLS.get(traj.domain), False
    if not writes:
        return None
    for m in traj.messages:
        if m["role"] != "assistant":
            continue
        call = (m.get("tool_calls") or [None])[0]              # the executed one (run_episodes: first only)
        if call and call["name"] in writes:
            return asked
        asked = asked or (not call and users.asks_confirmation(users.visible_text(m["content"])))
    return None


def log_metrics(out: str, metrics: list, m: dict, tracker=None):
    """A step's numbers: appended to metrics and, as a line, to <out>/metrics.jsonl (and to the tracker, if one)."""
    metrics.append(m)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(m) + "\n")
    if tracker is not None:
        tracker.log(m)


class Tracker:
    """--report-to: a step's numbers also go to TensorBoard (event files under <out>/tensorboard) or to Weights &
    Biases (a run under <out>/wandb; WANDB_MODE=offline keeps it on disk), each number under its metrics.jsonl key
    ("user_flags/early_stop" for a nested one). Both packages are optional: imported only when asked for."""

    def __init__(self, kind: str, out: str, config: dict):
        self.kind = kind
        try:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter
                self.run = SummaryWriter(os.path.join(out, "tensorboard"))
            else:
                import wandb
                self.run = wandb.init(project="mua-rl", dir=out, config=config,
                                      name=os.path.basename(os.path.abspath(out)))
        except ImportError as e:
            raise SystemExit(f"--report-to {kind}: {e.name} is not installed; pip install the version requirements.txt "
                             "pins")

    def log(self, m: dict):
        numbers = flat_numbers(m)
        if self.kind == "tensorboard":
            for k, v in numbers.items():
                self.run.add_scalar(k, v, m["step"])
        else:
            self.run.log(numbers, step=m["step"])

    def close(self):
        """Flush and close; for W&B also wait for its service to write the run file (finish() returns before)."""
        if self.kind == "tensorboard":
            self.run.close()
        else:
            import wandb
            self.run.finish()
            wandb.teardown()


def tracker(args) -> Tracker | None:
    """The run's --report-to tracker, None for none."""
    return None if args.report_to == "none" else Tracker(args.report_to, args.out, vars(args))


def flat_numbers(m: dict, prefix: str = "") -> dict:
    """The numbers of a metrics line, nested dicts flattened ("user_flags/early_stop"); None and text left out."""
    out = {}
    for k, v in m.items():
        if isinstance(v, dict):
            out |= flat_numbers(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[prefix + k] = v
    return out


def plot_panels(path: str, panels: list, dpi: int = 90):
    """A stage's PNG: a row of line charts, panels [(title, {label: [(step, value), ...]}, ylim or None)]; x is the
    step, every point marked (a CPU run has a few steps), a None value left out."""
    fig, axes = figure(len(panels), (4 * len(panels), 3.4))
    for ax, (title, lines, ylim) in zip(axes, panels):
        for label, points in lines.items():
            if points := [(x, y) for x, y in points if y is not None]:
                ax.plot(*zip(*points), marker="o", label=label or None)
        ax.set(title=title, xlabel="step", ylim=ylim)
        if any(lines):
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    save_figure(fig, path, dpi)


def figure(ncols: int, size: tuple, **kw):
    """A row of ncols matplotlib axes, drawn without a display, a row even when ncols is 1 (matplotlib would hand
    back a bare Axes). -> (fig, axes)"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=size, squeeze=False, **kw)
    return fig, axes[0]


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


def save_checkpoint(out, step, model, optimizer, metrics, *, scheduler=None, keep=2):
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
