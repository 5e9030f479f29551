"""kernels/passes.py: the training passes of sft.py and rl.py, around the log-prob kernel: trajectories as
micro-batches, the reference policy pi_ref, and the fast log-prob pass (rl.py's default --logprob-pass fast, every
sft.py step). rl.py's plain pass (plain_logprobs: one forward, a log-softmax) is the same numbers up to rounding.

  MicroBatch, micro_batches   rows of a pass, right-padded, a key's (a domain's) rows together
  reference_policy            the model as the KL reference: the frozen "ref" adapter, or the base model
  sequence_logprobs           the log-probs of the trained tokens: the decoder body, then the lm_head in chunks
                              (masked_logprobs_chunked), never the (B, T, V) logits
  cut_shared_prefix,          each domain's system prompt (~1.8k of ~2.7k tokens a row) cut off its rows and run
  shared_prefix_pass          once a pass, exact, the gradient included
Imports nothing of ours outside kernels/.
"""
import contextlib
import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.logprobs import masked_logprobs_chunked


# ----------------------------------------------------------------------------- micro-batches and pi_ref

class MicroBatch(NamedTuple):
    """Rows of a training pass: ids, attn (attention mask), mask (loss mask), each (b, T) long, right-padded.
    key: the rows' domain. prefix: the untrained tokens all of a key's rows start with, when a pass has cut them
    off the rows to run them once (cut_shared_prefix); None: nothing cut."""
    rows: list                  # indices into the sequences given
    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    key: object = None
    prefix: torch.Tensor | None = None


def micro_batches(token_ids, loss_masks, size: int, pad_id: int, keys=None, *, shortest_first=False, max_len=None,
                  device=None, rows=None) -> list[MicroBatch]:
    """Sequences (each row's token ids and loss mask) -> micro-batches of `size` rows: a key's rows together (keys
    in first-seen order), rows as given or shortest first (less padding; a stable sort), each right-padded and cut at
    max_len. rows: which sequences, in that order (rl.py's mini-batch, a random subset); None: all. A MicroBatch's
    rows index the sequences given. The masks come from positions, never from pad ids: SmolLM2's pad == eos ==
    <|im_end|>, which the policy samples and is trained on."""
    by_key, order = {}, range(len(token_ids)) if rows is None else rows
    for i in sorted(order, key=lambda i: len(token_ids[i])) if shortest_first else order:
        by_key.setdefault(None if keys is None else keys[i], []).append(i)
    out = []
    for key, idx in by_key.items():
        for rows in (idx[s:s + size] for s in range(0, len(idx), size)):
            T = min(max(len(token_ids[i]) for i in rows), max_len or math.inf)
            ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
            attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
            for r, i in enumerate(rows):
                n = min(T, len(token_ids[i]))
                ids[r, :n], attn[r, :n] = torch.tensor(token_ids[i][:n]), 1
                mask[r, :n] = torch.tensor(loss_masks[i][:n])
            out.append(MicroBatch(rows, ids.to(device), attn.to(device), mask.to(device), key))
    return out


@contextlib.contextmanager
def reference_policy(model):
    """The model as the KL reference, pi_ref: the frozen adapter "ref" (load_policy), or the base model with the
    adapter off when RL started from a fresh LoRA."""
    if "ref" not in getattr(model, "peft_config", {}):
        with model.disable_adapter():
            yield
        return
    model.set_adapter("ref", inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter("default")          # trainable again


# ----------------------------------------------------------------------------- the fast log-prob pass
# Most rows start with their domain's system prompt. What follows cuts that shared prefix off and runs it once a
# pass, and gives the per-token log-probs of the tokens that were sampled (masked_logprobs_chunked under the lm_head).

def sequence_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0, *, chunk=4096,
                      past_key_values=None, impl="torch"):
    """out[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) where loss_mask[b, t] == 1, else 0. (B, T) fp32.

    model: a HF causal LM or a peft model wrapping one. LoRA is active unless called inside
    `with model.disable_adapter():` (the reference policy). Runs the decoder body only, then the
    chunked path with the lm_head weight, so (B, T, V) logits are never materialised.
    Positions count real tokens (attention_mask.cumsum - 1), as HF generate does with left padding;
    for right-padded sequences that start at position 0 they are simply 0, 1, 2, ...
    Position t = 0 has no context and is always 0. chunk: token rows per lm_head matmul.
    past_key_values: a cache of P tokens that every row continues (see shared_prefix_pass);
    positions then start at P, and column 0 is still 0 (its context ends inside the cache).
    impl: the log-prob kernel, decided by the caller's setup (common.logprob_kernel).
    """
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
                                 mask.reshape(-1), temperature, chunk, impl)
    return F.pad(lp.view(B, T - 1), (1, 0))  # (B, T): column 0 has no context


def cut_shared_prefix(micro: list) -> list:
    """micro_batches' micro-batches with the tokens each key's rows all start with and none trains on (shared_prefix_len)
    cut off the rows and kept once, as the micro-batches' prefix: shared_prefix_pass runs it once a pass."""
    out = []
    for _, run in itertools.groupby(micro, key=lambda b: b.key):     # a key's micro-batches are consecutive
        run = list(run)
        rows = [(b.ids[r, :n].tolist(), b.mask[r, :n].tolist()) for b in run for r, n in enumerate(b.attn.sum(1))]
        P = shared_prefix_len([ids for ids, _ in rows], [mask for _, mask in rows])
        prefix = run[0].ids[0, :P].clone()                                       # (P,) long, one tensor for the key
        out += [b._replace(ids=b.ids[:, P:].contiguous(), attn=b.attn[:, P:].contiguous(),
                           mask=b.mask[:, P:].contiguous(), prefix=prefix) for b in run]
    return out


@contextlib.contextmanager
def shared_prefix_pass(model, temperature=1.0, chunk=4096, impl="torch"):
    """The fast log-prob pass over micro-batches whose rows had their key's prefix cut off (cut_shared_prefix): inside
    the block, logprobs(b) gives micro-batch b's sequence_logprobs (b, T - P), each key's prefix through the model
    once, when its first micro-batch comes.

        with shared_prefix_pass(model) as logprobs:
            for b in micro:
                loss_of(logprobs(b), b).backward()        # each micro-batch's backward before the next forward

    With grad on, a key's rows run against detached copies of its prefix's keys/values, whose gradients add up there;
    when its micro-batches end (the next key's first micro-batch, or the block's end) one backward takes them through
    the prefix: the gradient of one full pass per row, exact. Under no_grad, a forward of every row, the prefix once.
    Needs activation checkpointing off when a prefix is cut (transformers drops the cache in checkpointed layers).
    impl: the log-prob kernel (common.logprob_kernel)."""
    key, kv, leaves = object(), [], []              # the key under way, its prefix's keys/values and their copies

    def through_prefix():                           # the key's rows are done: their gradient through the prefix
        if kv and kv[0][0].requires_grad:
            torch.autograd.backward([t for pair in kv for t in pair], [t.grad for pair in leaves for t in pair])

    def logprobs(b):
        nonlocal key, kv, leaves
        if b.key != key:
            through_prefix()
            if b.prefix is not None and len(b.prefix) and model.training and \
                    any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
                raise ValueError("shared_prefix_pass needs gradient checkpointing off: transformers ignores "
                                 "past_key_values in checkpointed layers")
            key, kv = b.key, _prefix_kv(model, b.prefix)                  # in the graph when grad is on
            leaves = [(k.detach().requires_grad_(k.requires_grad), v.detach().requires_grad_(v.requires_grad))
                      for k, v in kv]
        return sequence_logprobs(model, b.ids, b.attn, b.mask, temperature, chunk=chunk,
                                 past_key_values=_cache(leaves, len(b.ids)), impl=impl)
    yield logprobs
    through_prefix()


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
    if prefix_ids is None or not len(prefix_ids):
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
