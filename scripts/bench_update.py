"""A training update's cost, measured: python scripts/bench_update.py [--sft | --memory-check] [the stage's flags].

  (default)        one GRPO update (rl.grpo_step on groups handed in) of --init's adapter on a default-sized group
                   (rl.py's flags), timed four ways after an untimed warm-up: fp32 with the reference pass (the
                   baseline), fp32 without it (the first step's case), both under bf16 autocast. AdamW at lr 0, so
                   every way times the same update.
  --sft            SFT's training pass (sft.backward_batch, sft.py's flags, e.g. --load-in-4bit) on one batch of 4
                   retail conversations (the oracle's), timed three ways, each after a warm-up pass: the system prompt
                   once per batch (sft.py's default), once per conversation (the baseline), and once per conversation
                   with activation checkpointing; their losses are equal (the shared prefix is exact).
  --memory-check   one paper-scale GRPO step: Qwen3-8B's shapes with random NF4 weights, LoRA r16, 8
                   sequences of 8k tokens, activation checkpointing; the weights' size and the step's peak
                   GPU memory (target <= 20 GiB on a 24 GiB card). Without a GPU the same step runs at tiny
                   Qwen3 shapes on CPU: the code path, not the numbers.
The first two print a line a way: its seconds and the speedup against the baseline measured in the same run; SFT's
also its loss and peak memory (on a CPU the process's peak RSS so far, so its ways run lowest memory first).
"""
import contextlib
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import rl  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402
from envs import ours  # noqa: E402
from kernels import harness, passes  # noqa: E402


def bench_update(args, rows=4, prefix=1644, own=990):
    """The four ways of one GRPO update (rl.grpo_step on groups handed in, the preset's micro-batches), on random
    tokens shaped like a default rollout group's: a shared system prompt of `prefix` tokens, then `own` tokens a row,
    a third sampled; groups of two rollouts, rewards 1 and 0."""
    import tempfile
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(100, 40000, (prefix,), generator=g).tolist()
    trajs = [SimpleNamespace(token_ids=shared + torch.randint(100, 40000, (own,), generator=g).tolist(), domain=None,
                             loss_mask=[0] * (prefix + 1) + (torch.rand(own - 1, generator=g) < 1 / 3).long().tolist(),
                             reward=float(i % 2 == 0), failed="") for i in range(rows)]
    groups = [trajs[i:i + 2] for i in range(0, rows, 2)]
    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL)
    with tempfile.TemporaryDirectory() as out:            # load_policy writes the frozen reference there
        model = rollout.load_policy(model, args.init, os.path.join(out, "reference"), args.lora_r, args.lora_alpha)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    print(f"bench-update: {rows} rows of {prefix} shared + {own} own tokens, micro-batch {args.micro_batch}, "
          f"{harness.machine()}")

    def update(bf16: str, skip: bool):      # skip: no optimizer state yet, as at the first step: no reference pass
        way = SimpleNamespace(**{**vars(args), "train_bf16": bf16, "tasks": len(groups), "seed": 0, "rollouts": None})
        if skip:
            opt.state.clear()
        rl.grpo_step(model, opt, rl.Sampling(None, tok, None), {}, 0, args=way, setup=common.setup_device(way),
                     groups=groups)
    update("off", True)                                    # the untimed warm-up, once without a state, once with
    update("off", False)
    base = None
    for name, bf16, skip in (("fp32, reference pass", "off", False), ("fp32, no reference pass", "off", True),
                             ("bf16, reference pass", "on", False), ("bf16, no reference pass", "on", True)):
        seconds = harness.timed(lambda: update(bf16, skip))[0]
        base = base or seconds                             # the first way is the baseline
        print(f"{name:>24}: {seconds:6.1f} s  {base / seconds:.2f}x", flush=True)


def bench_sft(args):
    """One batch of 4 retail conversations (the oracle's), forward+backward three ways, lowest memory first."""
    model, tokenizer = rollout.load_model(args.model, load_in_4bit=args.load_in_4bit)
    trajs = rollout.run_episodes(rollout.OracleAgent(tokenizer), tokenizer, ours.make_tasks("retail", "train", 4),
                                 max_turns=30, max_context=8192)
    rows = [{"token_ids": t.token_ids, "loss_mask": t.loss_mask, "scenario": f"retail/{t.scenario}"} for t in trajs]
    model, n_tok = rollout.add_lora(model, r=16, alpha=32), sum(sum(r["loss_mask"]) for r in rows)
    model.train()
    print(f"bench-sft: {len(rows)} conversations, {sum(len(r['token_ids']) for r in rows)} tokens ({n_tok} trained), "
          f"shared prefix {passes.shared_prefix_len([r['token_ids'] for r in rows], [r['loss_mask'] for r in rows])} "
          f"tokens, {harness.machine()}")
    measured, kernel = {}, common.logprob_kernel()
    for name, share, ckpt in (("prompt per conversation, activation checkpointing", "off", "on"),  # lowest memory first
                              ("prompt once per batch", "on", "off"), ("prompt per conversation", "off", "off")):
        if ckpt == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        mode = SimpleNamespace(**{**vars(args), "share_prefix": share, "grad_checkpointing": ckpt})

        def one_pass():
            loss = sft.backward_batch(model, rows, mode, pad=tokenizer.pad_token_id, n_tok=n_tok, kernel=kernel)
            model.zero_grad(set_to_none=True)
            return loss
        with harness.PeakMemory() as mem:
            seconds, loss = harness.timed(one_pass, warmup=1)       # the warm-up pass warms up the allocator
        measured[name] = loss, seconds, mem.peak
    base = measured["prompt per conversation"][1]                    # the baseline, measured last
    for name, (loss, seconds, peak) in measured.items():
        print(f"{name:52s} loss {loss:.5f}  {seconds:6.1f} s  {base / seconds:.2f}x  peak {peak / 2**30:.1f} GiB"
              + ("" if torch.cuda.is_available() else " (RSS so far)"))


# ---------------------------------------------------------------- paper-scale memory check

def qwen3_shapes(tiny: bool = False):
    """Qwen3-8B's config (random weights are all a memory check needs), or the same architecture at toy size."""
    from transformers import Qwen3Config
    if tiny:
        return Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


def nf4_lora_model(config, device):
    """Random weights of `config` with every decoder Linear in bitsandbytes NF4, embeddings and lm_head in the
    compute dtype, LoRA r16 on all linear projections. Made on `device`: the random init runs there (seconds on
    a GPU for Qwen3-8B, where a CPU takes minutes), then each decoder Linear is quantized in place, its
    bf16 weight freed as it goes: the build peaks at the bf16 model (16 GiB for Qwen3-8B)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)     # random weights, on the device

    def to_nf4(module):
        for name, child in module.named_children():
            if isinstance(child, torch.nn.Linear):
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=dtype, quant_type="nf4", device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                q.bias = child.bias
                setattr(module, name, q.to(device))                      # .to quantizes the weight
            else:
                to_nf4(child)
    to_nf4(model.model.layers)
    return rollout.add_lora(model, r=16, alpha=32)


def memory_check(config=None, seq_len=8192, n_seq=8, device="cuda", model=None):
    """One GRPO step at paper scale: Qwen3-8B shapes with random weights, NF4 + LoRA r16, n_seq sequences
    of seq_len tokens (loss on the second half), activation checkpointing, micro-batch 1. Prints the
    weights' size and the step's peak memory (GPU: torch's allocator, all this process holds; CPU: the
    process's peak RSS). On CPU main() runs it at tiny Qwen3 shapes: the same code path, numbers that say
    nothing about 8B. model: nf4_lora_model(config, device) made already (scripts/gpu_check.py samples with it
    after)."""
    from sampler.attention import kv_bytes_per_token
    config = config or qwen3_shapes()
    model = nf4_lora_model(config, device) if model is None else model
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    cuda = device == "cuda"
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(n_seq):     # system/user tokens then sampled tokens: loss on the second half
        ids = torch.randint(0, config.vocab_size, (seq_len,), generator=g).tolist()
        trajs.append(SimpleNamespace(token_ids=ids, loss_mask=[0] * (seq_len // 2) + [1] * (seq_len - seq_len // 2),
                                     domain=None, reward=float(i % 2 == 0), failed=""))
    groups = [trajs[i:i + 2] for i in range(0, n_seq, 2)]                 # rewards 1 and 0 in each
    args = SimpleNamespace(micro_batch=1, mini_batches=1, temperature=1.0, clip=0.2, kl_coef=0.001, max_grad_norm=1.0,
                           grad_checkpointing="on", loss_agg="token-mean", train_bf16="off", logprob_pass="fast",
                           tasks=len(groups), seed=0, rollouts=None)
    setup = common.Device(contextlib.nullcontext, checkpointing=True, sampler={},   # the memory check's own
                          kernel=common.logprob_kernel())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    sampling = rl.Sampling(None, SimpleNamespace(pad_token_id=0), None)
    with harness.PeakMemory(cuda) as mem:     # on a GPU, what is allocated at entry is the weights
        seconds, done = harness.timed(lambda: rl.grpo_step(model, opt, sampling, {}, 0, args=args, setup=setup,
                                                           groups=groups))
    st = done.stats
    weights_gib = mem.base / 2**30 if cuda else \
        sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**30
    peak = mem.peak / 2**30
    kv = kv_bytes_per_token(config, model.get_input_embeddings().weight.dtype)
    print(f"memory-check ({device}): {config.num_hidden_layers} layers x {config.hidden_size} NF4+LoRA, {n_seq}x{seq_len} "
          f"tokens, one GRPO step: weights {weights_gib:.2f} GiB, peak {peak:.2f} GiB "
          f"({'allocated' if cuda else 'process RSS'}; target <= 20 at Qwen3-8B shapes), {seconds:.0f} s, "
          f"{st['tokens']} trained tokens, grad norm {st['grad_norm']:.3f}, KV {kv / 1024:.1f} KiB/token"
          + (f" -> {'OK' if peak <= 20 else 'OVER'}" if cuda else ""))
    return dict(weights_gib=weights_gib, peak_gib=peak, seconds=seconds, grad_norm=st["grad_norm"], tokens=st["tokens"],
                kv_bytes=kv)


def main():
    argv = sys.argv[1:]
    if "--memory-check" in argv:
        if torch.cuda.is_available():
            return memory_check()
        print("--memory-check: no GPU here, so the same step runs at tiny Qwen3 shapes on CPU (the code path, not the numbers)")
        return memory_check(qwen3_shapes(tiny=True), seq_len=256, n_seq=2, device="cpu")
    if "--sft" in argv:
        args = sft.parse_args([a for a in argv if a != "--sft"])
        common.start_run(args)
        return bench_sft(args)
    args = rl.parse_args(argv)
    common.start_run(args)
    return bench_update(args)


if __name__ == "__main__":
    main()
