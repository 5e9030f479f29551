"""common.py: what the stages (sft.py, rl.py, scripts/rl_trl.py, eval.py) share, written once.

  Parser, fail                            argparse with one line per bad value (exit 2)
  add_run_args, add_model_args,           the flags stages share: seed/out/smoke/preset, the model, the user,
  add_user_args, add_episode_args,        an episode's limits, and the GRPO flags of rl.py and scripts/rl_trl.py
  add_grpo_args
  parse_with_preset, CPU_LIMITS           one preset scheme: PRESETS = {"gpu", "cpu", "smoke"} per stage, the
                                          numbers in use shown by --help
  check_args                              bad input caught before any model loads
  start_run                               threads, print and save the arguments, make --out, refuse a resume
                                          with other settings
  user_kwargs                             what run_episodes needs to build the chosen user simulator
  figure, save_figure                     matplotlib without a display, for each stage's PNG
  save_checkpoint, resume                 one checkpoint layout: the last two kept, the newest verified, and
                                          one way to resume from it (adapter, optimizer, scheduler, RNG, metrics)
A stage imports this file, the world (envs) and the loop (rollout); never another stage.
"""
import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

# The CPU presets' tasks and episode limits, shared so that RL trains on what eval measures. The tasks: one
# medium-tier scenario a domain, whose opening withholds the ids (the user must be asked) and whose write takes one
# id: the seven medium scenarios at 7 gold conversations each left the 135M cold start at 0 successes in 48 rollouts
# (docs/results.md). The limits, from the gold agent on these two under every persona (tests/test_personas.py): its
# longest episode is 9 agent turns (x 1.5 = 14), its longest message 62 tokens, its longest conversation 2,894 tokens
# with the ~2,300-token system prompt (+ a turn's 80, x 1.2 = 3,584).
CPU_TIERS = "change_order_payment,cancel_trip"
CPU_LIMITS = dict(max_turns=14, max_new_tokens=80, max_context=3584)
TIERS = ("easy", "medium", "hard")


class ShowDefaults(argparse.HelpFormatter):
    """--help prints every flag's default in use: the preset's number where a preset sets it."""

    def _get_help_string(self, action):
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS \
            and "%(default)" not in action.help
        return action.help + " (default: %(default)s)" if shown else action.help


class Parser(argparse.ArgumentParser):
    """argparse, with an error as one line ("rl.py: --lr: ...") and exit status 2, as argparse exits, every default
    shown in --help, and the flags in named groups (group(title)): the algorithm's apart from ablations and
    performance."""

    GROUPS = {"run": "the run", "model": "the model", "world": "the world and the user",
              "algorithm": "the algorithm", "ablation": "ablations (the paper's and ours)",
              "performance": "performance: speed and memory"}

    def __init__(self, *a, **kw):
        super().__init__(*a, formatter_class=ShowDefaults, **kw)
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


def add_run_args(p: Parser, out: str, smoke: str):
    """--seed, --out, --smoke and --preset: how every stage is started."""
    g = p.group("run")
    g.add_argument("--seed", type=int, default=0, help="seed for tasks, users and sampling")
    g.add_argument("--out", default=out, help="everything this run writes goes here")
    g.add_argument("--smoke", action="store_true", help=smoke)
    g.add_argument("--preset", default="auto", choices=["auto", "cpu", "gpu"], help="the sizes of every flag not "
                   "given (the stage's PRESETS): auto = gpu with CUDA, else cpu; --smoke overrides")


def add_model_args(p: Parser, model_default=None, sampler=True):
    """--model and --load-in-4bit; with sampler (a stage that samples from the model) --thinking, --sampler and
    --kv-budget."""
    g = p.group("model")
    g.add_argument("--model", default=model_default, help="HF model id or local path; none: the bundled "
                   "SmolLM2-135M-Instruct (rollout.DEFAULT_MODEL)")
    g.add_argument("--load-in-4bit", action="store_true", help="NF4 base weights (bitsandbytes), LoRA on top (QLoRA)")
    if not sampler:
        return
    g.add_argument("--thinking", action="store_true", help="Qwen3 thinking mode (off by default, as in the paper)")
    g = p.group("performance")
    g.add_argument("--sampler", default="fast", choices=["fast", "plain"], help="fast: sampler/fast.py, many "
                   "conversations at once; plain: sampler/plain.py's sample_turn, one conversation at a time (the "
                   "code to read; greedy, the same tokens, tested; slower)")
    g.add_argument("--kv-budget", type=float, default=0.0, help="GiB of keys/values the fast sampler may hold; it "
                   "decodes in waves that fit (0 = auto: free GPU memory minus the training step's reserve; CPU: no "
                   "limit)")


def add_user_args(p: Parser, default="scripted", several=False):
    import users
    g = p.group("world")
    g.add_argument("--user", default=default, help=f"user simulator: {users.user_help()} (users.USER_KINDS; "
                   "personas and their train / held-out split: users.PERSONAS)" + ("; a comma list evaluates under "
                   "each" * several))
    g.add_argument("--user-base-url", default=None, help="base URL of an openai:MODEL user's server "
                   "(default $OPENAI_BASE_URL; key $OPENAI_API_KEY)")
    p.group("performance").add_argument("--user-workers", type=int, default=256, help="LLM users asked at once "
                                        "(each round's replies; 256 = a paper-sized round all in flight)")


def add_episode_args(p: Parser, tokens: bool = True):
    """An episode's limits; tokens: also the agent's tokens per turn and the context."""
    g = p.group("world")
    g.add_argument("--max-turns", type=int, default=None, help="agent turns per episode (paper 30)")
    if tokens:
        g.add_argument("--max-new-tokens", type=int, default=None, help="tokens per agent turn")
        g.add_argument("--max-context", type=int, default=None, help="episode token limit")


def add_grpo_args(p: Parser):
    """The flags of GRPO itself, the same in rl.py and scripts/rl_trl.py (TRL's names in brackets)."""
    g = p.group("run")
    g.add_argument("--steps", type=int, default=None, help="GRPO steps; a larger value resumes a run")
    g = p.group("model")
    g.add_argument("--init", default="auto", help="SFT adapter dir (the KL reference is frozen at it), 'base' (no "
                   "cold start: a fresh LoRA, the reference the base model), or 'auto' = runs/sft/adapter if present "
                   "else base")
    g.add_argument("--lora-r", type=int, default=16, help="LoRA rank from --init base")
    g.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha from --init base")
    g = p.group("world")
    g.add_argument("--domains", default=None, help="comma-separated train domains")
    g.add_argument("--tiers", default=None, help="task tiers to train on")
    add_episode_args(p)
    g = p.group("algorithm")
    g.add_argument("--tasks", type=int, default=None, help="groups trained per step (paper 32)")
    g.add_argument("--group-size", type=int, default=None, help="rollouts per task G [num_generations] (paper 8)")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (paper 1.0)")
    g.add_argument("--kl-coef", type=float, default=0.001, help="beta for the k3 KL to the reference (paper 0.001) "
                   "[beta; TRL's default is 0]")
    g.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip epsilon, both sides (paper 0.2) [epsilon]")
    g.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    g = p.group("ablation")
    g.add_argument("--reward", default="binary", choices=["binary", "shaped"], help="task reward (Env.reward); "
                   "shaped: partial credit for correct writes")
    g.add_argument("--loss-agg", default="token-mean", choices=["token-mean", "seq-mean"], help="token-mean: every "
                   "sampled token weighs the same (DAPO, the official code) [dapo]; seq-mean: every rollout does "
                   "(GRPO paper) [grpo]")
    g = p.group("performance")
    g.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward "
                   "[per_device_train_batch_size]")
    g.add_argument("--grad-checkpointing", default=None, choices=["on", "off"], help="recompute activations in "
                   "backward (GPU on; CPU off, which lets the system prompt run once per pass)")


def check_args(args, at_least=None, finite=None, several_users=False, training=False):
    """Exit 2 with one line on the first bad value, before any model loads or any file is written.
    at_least: {flag name: minimum} for ints; finite: {flag name: (low, strict)} for floats (value > low if
    strict, else >= low); several_users: --user may be a comma list (eval.py); training: a stage that trains on
    --user's conversations (no held-out persona)."""
    import users
    import envs
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
            if d not in envs.DOMAINS:
                fail("--domains", f"unknown domain {d!r}; use a comma list of {', '.join(envs.DOMAINS)}")
    if getattr(args, "tiers", None) is not None:
        from envs import ours
        scenarios = [s for d in ours.DOMAINS for s in ours.SCENARIOS[d]]
        for t in args.tiers.split(","):
            if t not in TIERS and t not in scenarios:
                fail("--tiers", f"unknown tier {t!r}; use a comma list of {', '.join(TIERS)} or of scenario names "
                                f"({', '.join(scenarios)})")
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


# ----------------------------------------------------------------------------- training passes
# sft.py and rl.py train on batches of trajectories: token ids with a loss mask, most of them starting with their
# domain's system prompt. What follows pads them into micro-batches, runs that shared prefix once a pass, and gives
# the per-token log-probs of the tokens that were sampled (kernels.masked_logprobs_chunked under the lm_head).

def sequence_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0, chunk=4096,
                      past_key_values=None):
    """out[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) where loss_mask[b, t] == 1, else 0. (B, T) fp32.

    model: a HF causal LM or a peft model wrapping one. LoRA is active unless called inside
    `with model.disable_adapter():` (the reference policy). Runs the decoder body only, then the
    chunked path with the lm_head weight, so (B, T, V) logits are never materialised.
    Positions count real tokens (attention_mask.cumsum - 1), as HF generate does with left padding;
    for right-padded sequences that start at position 0 they are simply 0, 1, 2, ...
    Position t = 0 has no context and is always 0. chunk: token rows per lm_head matmul.
    past_key_values: a cache of P tokens that every row continues (see prefix_run_once);
    positions then start at P, and column 0 is still 0 (its context ends inside the cache).
    """
    # imported here, not at the top: importing common must not import triton, so that scripts/gpu_check.py --cpu
    # can set TRITON_INTERPRET first
    from kernels import masked_logprobs_chunked
    body, lm_head = model.get_decoder(), model.get_output_embeddings()
    if not isinstance(lm_head, torch.nn.Linear) or lm_head.bias is not None:
        raise ValueError(f"sequence_logprobs needs a plain bias-free nn.Linear lm_head, got {type(lm_head).__name__}"
                         " (LoRA on lm_head or a quantized lm_head is not supported)")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("models with final_logit_softcapping are not supported by sequence_logprobs")
    attention_mask = torch.as_tensor(attention_mask, device=input_ids.device).long()
    loss_mask = torch.as_tensor(loss_mask, device=input_ids.device)
    P = 0 if past_key_values is None else past_key_values.get_seq_length()
    if P and loss_mask[:, 0].any():
        raise ValueError("loss_mask[:, 0] must be 0 after a cached prefix: the prefix must end before the "
                         "first trained token (see shared_prefix_len)")
    positions = P + (attention_mask.cumsum(-1) - 1).clamp(min=0)  # same ids the sampler used
    full_mask = F.pad(attention_mask, (P, 0), value=1)             # the cached prefix is all real tokens
    hidden = body(input_ids=input_ids, attention_mask=full_mask, position_ids=positions,
                  past_key_values=past_key_values, use_cache=past_key_values is not None).last_hidden_state
    B, T, H = hidden.shape
    # the hidden state at t-1 predicts token t
    mask = (loss_mask[:, 1:] != 0) & (attention_mask[:, 1:] != 0)
    lp = masked_logprobs_chunked(hidden[:, :-1].reshape(-1, H), lm_head.weight, input_ids[:, 1:].reshape(-1),
                                 mask.reshape(-1), temperature, chunk)
    return F.pad(lp.view(B, T - 1), (1, 0))  # (B, T): column 0 has no context


def pad_right(seqs, pad_id: int, max_len: int | None = None):
    """seqs: (token_ids, loss_mask) pairs -> input_ids, attention_mask, loss_mask, each (B, T) long, right-padded
    and cut at max_len. Masks come from positions, never from pad ids: SmolLM2's pad == eos == <|im_end|>, which
    the policy samples and is trained on."""
    T = max(len(ids) for ids, _ in seqs)
    T = min(T, max_len) if max_len else T
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (tok, m) in enumerate(seqs):
        n = min(T, len(tok))
        ids[i, :n] = torch.tensor(tok[:n])
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(m[:n])
    return ids, attn, mask


class PrefixBatch(NamedTuple):
    """Sequences that start with the same untrained prefix (a domain's system prompt), cut into micro-batches."""
    prefix: torch.Tensor        # (P,) long: run once a pass for every row (P = 0: no sharing)
    micro: list                 # [(input_ids, attention_mask, loss_mask)], each (b, T - P), the rest of each row
    rows: list                  # [row indices of each micro-batch], into the sequences given


def prefix_batches(token_ids, loss_masks, keys, micro_batch: int, pad_id: int, share: bool = True,
                   max_len: int | None = None, device=None) -> list[PrefixBatch]:
    """Group sequences by key (rows of one key share their prefix; keys in first-seen order, rows in the order
    given), find the longest prefix a group shares and trains on none of (shared_prefix_len; 0 without share),
    and pad the rest of each row into micro-batches of micro_batch rows, cut at max_len in all."""
    by_key = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    out = []
    for idx in by_key.values():
        P = shared_prefix_len([token_ids[i] for i in idx], [loss_masks[i] for i in idx]) if share else 0
        P = min(P, max_len - 1) if max_len else P
        rows = [idx[s:s + micro_batch] for s in range(0, len(idx), micro_batch)]
        micro = [tuple(x.to(device) for x in pad_right([(token_ids[i][P:], loss_masks[i][P:]) for i in r], pad_id,
                                                        max_len - P if max_len else None)) for r in rows]
        out.append(PrefixBatch(torch.tensor(token_ids[idx[0]][:P], dtype=torch.long, device=device), micro, rows))
    return out


def split_mini_batches(batches: list[PrefixBatch], n: int) -> list[list[PrefixBatch]]:
    """The micro-batches cut into n consecutive parts (one optimizer step each), each part's micro-batches still
    under their prefix."""
    flat = [(b, j) for b in batches for j in range(len(b.micro))]
    per, parts = math.ceil(len(flat) / n), []
    for s in range(0, len(flat), per):
        part = {}
        for b, j in flat[s:s + per]:
            part.setdefault(id(b), (b, []))[1].append(j)
        parts.append([PrefixBatch(b.prefix, [b.micro[j] for j in js], [b.rows[j] for j in js]) for b, js in part.values()])
    return parts


def shared_prefix_len(token_ids: list[list[int]], loss_masks: list[list[int]]) -> int:
    """How many leading tokens all sequences share and none is trained on, minus one: the token after
    the prefix starts each remainder, and its log-prob needs the prefix's last hidden state."""
    first = min(m.index(1) if 1 in m else len(m) for m in loss_masks)
    n = 0
    while n < min(map(len, token_ids)) and all(x[n] == token_ids[0][n] for x in token_ids):
        n += 1
    return max(0, min(n, first - 1))


def _prefix_kv(model, prefix_ids):
    """The prefix's keys and values, per layer, from one forward of the decoder (none if it is empty)."""
    if not len(prefix_ids):
        return []
    out = model.get_decoder()(input_ids=prefix_ids[None], use_cache=True)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def _cache(kv, rows: int):
    """A cache of the prefix for `rows` sequences (None for an empty prefix)."""
    from transformers import DynamicCache
    if not kv:
        return None
    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
    return cache


def logprobs_with_shared_prefix(model, prefix_ids, micro_batches, temperature=1.0, chunk=4096):
    """sequence_logprobs of micro-batches that all continue prefix_ids, the prefix run once.
    prefix_ids (P,) long; micro_batches [(input_ids, attention_mask, loss_mask)], each (B_i, T_i). -> [logp (B_i, T_i)].
    Meant for log-probs without grad (reference and old policies): call it under torch.no_grad()."""
    kv = _prefix_kv(model, prefix_ids)
    return [sequence_logprobs(model, ids, attn, mask, temperature, chunk, past_key_values=_cache(kv, len(ids)))
            for ids, attn, mask in micro_batches]


def batch_logprobs(model, batches: list[PrefixBatch], temperature=1.0) -> dict:
    """logprobs_with_shared_prefix of every micro-batch -> {tuple(its rows): logp (b, T - P)}. Under no_grad."""
    return {tuple(rows): lp for b in batches
            for rows, lp in zip(b.rows, logprobs_with_shared_prefix(model, b.prefix, b.micro, temperature))}


@contextlib.contextmanager
def prefix_run_once(model, prefix_ids):
    """Train on micro-batches that all continue the same untrained prefix (in SFT and GRPO: a domain's ~1.8k-token
    system prompt) while the prefix goes through the model once, not once per sequence. Exact: the same gradient
    as one full forward/backward per sequence.

        with prefix_run_once(model, prefix) as cache_for:       # 1. the prefix forward, once, with grad
            for ids, attn, mask in micro_batches:                 # 2. each micro-batch against detached copies
                logp = sequence_logprobs(model, ids, attn, mask,  #    of its keys/values; backward at once,
                                         past_key_values=cache_for(len(ids)))    # which sums d loss/d (k, v)
                loss_of(logp).backward()
                                                                  # 3. on exit: one backward through the prefix

    prefix_ids: (P,) long; P = 0 is the plain pass (cache_for gives None). loss_mask[:, 0] must be 0 after a
    prefix (shared_prefix_len picks such a P). Needs activation checkpointing off when P > 0 (transformers
    drops the cache inside checkpointed layers)."""
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) and model.training
    if len(prefix_ids) and checkpointed:
        raise ValueError("prefix_run_once needs gradient checkpointing off: transformers ignores past_key_values "
                         "in checkpointed layers")
    kv = _prefix_kv(model, prefix_ids)                                           # in the graph
    leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kv]
    yield lambda rows: _cache(leaves, rows)
    if kv:
        torch.autograd.backward([t for pair in kv for t in pair], [t.grad for pair in leaves for t in pair])
