"""SFT's training pass, timed three ways: python scripts/bench_sft.py [any sft.py flag, e.g. --load-in-4bit].

One batch of 4 retail conversations (the oracle's) goes forward and backward with the system prompt run once per
batch (sft.py's default, common.shared_prefix_logprobs), once per conversation, and once per conversation
with activation checkpointing; the loss of each (equal: the shared prefix is exact), seconds and peak RSS.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from envs import ours  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402
from common import shared_prefix_len  # noqa: E402


def bench(args):
    """One batch of 4 retail conversations (the oracle's), forward+backward three ways. Lowest memory
    first, so the process's peak RSS after each way is that way's peak (on CPU)."""
    import resource
    model, tokenizer = rollout.load_model(args.model, load_in_4bit=args.load_in_4bit)
    trajs = rollout.run_episodes(rollout.OracleAgent(tokenizer), tokenizer, ours.make_tasks("retail", "train", 4))
    rows = [{"token_ids": t.token_ids, "loss_mask": t.loss_mask, "scenario": f"retail/{t.scenario}"} for t in trajs]
    model, n_tok = rollout.add_lora(model, r=16, alpha=32), sum(sum(r["loss_mask"]) for r in rows)
    model.train()
    print(f"{len(rows)} conversations, {sum(len(r['token_ids']) for r in rows)} tokens ({n_tok} trained), "
          f"shared prefix {shared_prefix_len([r['token_ids'] for r in rows], [r['loss_mask'] for r in rows])} tokens")
    for name, share, ckpt in [("prompt per conversation, activation checkpointing", "off", "on"),
                              ("prompt once per batch", "on", "off"), ("prompt per conversation", "off", "off")]:
        if ckpt == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        mode = argparse.Namespace(**{**vars(args), "share_prefix": share, "grad_checkpointing": ckpt})
        for _ in range(2):                                      # the first pass warms up the allocator
            t0 = time.time()
            loss = sft.backward_batch(model, rows, mode, tokenizer.pad_token_id, n_tok)
            dt = time.time() - t0
            model.zero_grad(set_to_none=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6   # KB on Linux
        print(f"{name:52s} loss {loss:.5f}  {dt:6.1f} s  peak RSS so far {peak:.1f} GB")


if __name__ == "__main__":
    args = sft.parse_args(sys.argv[1:])
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    bench(args)
