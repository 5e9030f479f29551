"""Per-token log-probs of the chosen tokens, only where a mask is 1: Triton kernels + PyTorch reference.

What it computes. For logits (N, V), targets (N,) and mask (N,):

    out[i] = log softmax(logits[i] / T)[targets[i]]    where mask[i] == 1,   out[i] = 0 elsewhere

GRPO and SFT need exactly this for every token of a trajectory that the policy sampled
(loss_mask == 1). The logits are the biggest tensor of a training step (N tokens x V vocab,
V = 151,936 for Qwen3), so the kernel reads them once in the forward and once in the backward,
and never builds a softmax or log-softmax tensor of the same size.

How (Triton, one program per row):
  forward   online log-sum-exp over vocabulary blocks of BLOCK columns, fp32 accumulation
            whatever the input dtype; keeps the running max m and the running sum
            s = sum exp((x - m) / T); out = (x_target - m) / T - log s. Subtracting m before
            dividing by T keeps big logits (1e4) exact. Rows with mask 0 run zero loop
            iterations: nothing is read and the output is 0. Saves m and log s per row (8 bytes).
  backward  d out / d x_j = (onehot_j - softmax_j) / T, so grad_x = g * (onehot - p) / T with
            p = exp((x - m) / T - log s) recomputed block by block from the saved m and log s.
            Masked rows get exactly 0 (their upstream gradient is forced to 0 and no logits are read).
The PyTorch reference `logprobs_torch` (5 lines) is the specification; `impl=` picks one:
  "auto" -> Triton on CUDA tensors, the reference on CPU; "triton" -> the kernel (on CPU it needs
  TRITON_INTERPRET=1 set before this module is imported, as tests/conftest.py does); "torch".

Chunked path. `masked_logprobs_chunked(hidden, weight, ...)` takes hidden states (N, H) and the
lm_head weight (V, H) instead of logits. It keeps only the rows with mask 1, multiplies them by
the weight `chunk` rows at a time, and recomputes each chunk's logits in the backward, so at most
(chunk, V) logits (plus their gradient) exist at once and the full (N, V) logits never do.
`sequence_logprobs(model, ...)` runs a causal LM body and then this path; sft.py and rl.py use it.

Shared prefix. In a training batch every sequence starts with the same system prompt (two thirds of
its tokens here). `backward_with_shared_prefix` runs that prefix once, with an exact gradient (the
remainders backprop into detached copies of its keys/values, then one backward goes through the
prefix); `logprobs_with_shared_prefix` is the no-grad version for reference/old-policy passes.
`prefix_batches` groups a batch's sequences by prefix and pads the rest into micro-batches for them
(`PrefixBatch`); `split_mini_batches` cuts those into optimizer steps.

Special values (tested):
  - a row whose logits are all -inf except the target: out = 0, gradient 0.
  - -inf at the target (finite elsewhere): out = -inf; the gradient of that row is finite
    (-g/T at the target, -g*p/T elsewhere), so nothing non-finite reaches other rows.
  - a row with every logit -inf is not a distribution: out = NaN for that row only, as
    torch.log_softmax gives. If that row is masked, it is 0 like any masked row.
  - targets of masked rows are ignored (e.g. -100 is fine). Targets of unmasked rows must be in [0, V).

Simplifications: no label smoothing, no logit soft-capping or lm_head bias (sequence_logprobs
refuses such models with a clear error); one program per row (no split-V parallelism for tiny N).
"""
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # the torch reference still works without triton (e.g. on macOS)
    HAVE_TRITON = False

# Triton reads this when a @triton.jit function is defined, i.e. when this module is imported.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_BLOCK = 4096  # vocabulary columns per loop iteration; 4096 bf16 = 8 KB per row per step


# ----------------------------------------------------------------------------------------------
# PyTorch reference: the specification the kernels are tested against.

def logprobs_torch(logits, targets, mask, temperature=1.0):
    """(N, V) logits -> (N,) log p(target) in fp32 (fp64 for fp64 input); 0 where mask is 0."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)).masked_fill(~mask[:, None], 0.0)
    x = (x - x.amax(dim=-1, keepdim=True).detach()) / temperature  # shift first: exact for big logits
    lp = x.gather(1, targets[:, None]).squeeze(1) - x.logsumexp(dim=-1)
    return lp.masked_fill(~mask, 0.0)


# ----------------------------------------------------------------------------------------------
# Triton kernels.

if HAVE_TRITON:

    @triton.jit
    def _logprobs_fwd_kernel(logits_ptr, stride_row, targets_ptr, mask_ptr, out_ptr, max_ptr, logz_ptr,
                             V, inv_temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2**31 at N*V > 2.1e9
        valid = tl.load(mask_ptr + row) != 0
        row_ptr = logits_ptr + row * stride_row
        cols = tl.arange(0, BLOCK)
        run_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)  # scalar -inf, fp32
        run_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)                 # scalar 0, fp32
        end = tl.where(valid, V, 0)  # masked rows: zero iterations, nothing read
        for start in range(0, end, BLOCK):
            x = tl.load(row_ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, tl.max(x, axis=0))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: avoid inf - inf
            run_sum = run_sum * tl.exp((run_max - safe_max) * inv_temp) \
                + tl.sum(tl.exp((x - safe_max) * inv_temp), axis=0)
            run_max = new_max
        target = tl.load(targets_ptr + row)
        x_t = tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32)
        logz = tl.log(tl.where(valid, run_sum, 1.0))  # log sum exp((x - max) / T); masked rows: 0
        out = (x_t - run_max) * inv_temp - logz
        tl.store(out_ptr + row, tl.where(valid, out, 0.0))
        tl.store(max_ptr + row, tl.where(valid, run_max, 0.0))
        tl.store(logz_ptr + row, tl.where(valid, logz, 0.0))

    @triton.jit
    def _logprobs_bwd_kernel(logits_ptr, stride_row, grad_logits_ptr, grad_stride_row, targets_ptr, mask_ptr,
                             grad_out_ptr, max_ptr, logz_ptr, V, inv_temp, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        valid = tl.load(mask_ptr + row) != 0
        g = tl.where(valid, tl.load(grad_out_ptr + row).to(tl.float32) * inv_temp, 0.0)  # masked: exactly 0
        row_max = tl.load(max_ptr + row)
        logz = tl.load(logz_ptr + row)
        target = tl.load(targets_ptr + row)
        row_ptr = logits_ptr + row * stride_row
        grad_row_ptr = grad_logits_ptr + row * grad_stride_row
        cols = tl.arange(0, BLOCK)
        read_end = tl.where(valid, V, 0)  # masked rows read nothing: x = -inf -> p = 0, g = 0 -> grad 0
        for start in range(0, V, BLOCK):
            x = tl.load(row_ptr + start + cols, mask=start + cols < read_end, other=float("-inf")).to(tl.float32)
            p = tl.exp((x - row_max) * inv_temp - logz)  # softmax, recomputed; never stored
            onehot = tl.where(start + cols == target, 1.0, 0.0)
            grad = g * (onehot - p)
            tl.store(grad_row_ptr + start + cols, grad.to(grad_logits_ptr.dtype.element_ty), mask=start + cols < V)


def _launch_config(V):
    block = min(triton.next_power_of_2(V), MAX_BLOCK)
    return block, (8 if block >= 2048 else 4)


def _triton_forward(logits, targets, mask, temperature):
    """-> out (N,) fp32, row max (N,) fp32, log-normaliser (N,) fp32 (the last two for the backward)."""
    N, V = logits.shape
    out = torch.empty(N, dtype=torch.float32, device=logits.device)
    row_max, logz = torch.empty_like(out), torch.empty_like(out)
    if N == 0:
        return out, row_max, logz
    block, warps = _launch_config(V)
    _logprobs_fwd_kernel[(N,)](logits, logits.stride(0), targets, mask.view(torch.uint8), out, row_max, logz,
                               V, 1.0 / temperature, BLOCK=block, num_warps=warps)
    return out, row_max, logz


def _triton_backward(logits, targets, mask, row_max, logz, grad_out, temperature):
    """-> gradient w.r.t. logits, (N, V) in the logits dtype; rows with mask 0 are exactly 0."""
    N, V = logits.shape
    grad_logits = torch.empty((N, V), dtype=logits.dtype, device=logits.device)
    if N == 0:
        return grad_logits
    block, warps = _launch_config(V)
    _logprobs_bwd_kernel[(N,)](logits, logits.stride(0), grad_logits, grad_logits.stride(0), targets,
                               mask.view(torch.uint8), grad_out.contiguous(), row_max, logz,
                               V, 1.0 / temperature, BLOCK=block, num_warps=warps)
    return grad_logits


class _TritonLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mask, temperature):
        out, row_max, logz = _triton_forward(logits, targets, mask, temperature)
        ctx.save_for_backward(logits, targets, mask, row_max, logz)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, mask, row_max, logz = ctx.saved_tensors
        grad = _triton_backward(logits, targets, mask, row_max, logz, grad_out, ctx.temperature)
        return grad, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API.

def _pick_impl(impl, x):
    if impl == "auto":
        return "triton" if (x.is_cuda and HAVE_TRITON) else "torch"
    if impl == "torch":
        return impl
    if impl == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("impl='triton' needs the triton package (pip install triton); or use impl='torch'")
        if not x.is_cuda and not TRITON_INTERPRET:
            raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before `kernels` "
                               "is imported (tests/conftest.py does this); or use impl='torch'")
        return impl
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")


def _check(logits_or_hidden, targets, mask):
    if logits_or_hidden.dim() != 2 or targets.shape != mask.shape or targets.shape[0] != logits_or_hidden.shape[0]:
        raise ValueError(f"expected (N, V or H), (N,), (N,); got {tuple(logits_or_hidden.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(mask.shape)}")
    mask = mask.to(device=logits_or_hidden.device, dtype=torch.bool)
    # masked rows may carry any target (e.g. -100); point them at column 0 so nothing indexes out of range
    targets = targets.to(device=logits_or_hidden.device, dtype=torch.long).masked_fill(~mask, 0)
    return targets.contiguous(), mask.contiguous()


def masked_logprobs(logits, targets, mask, temperature=1.0, impl="auto"):
    """logits (N, V), targets (N,) long, mask (N,) bool -> (N,) fp32 log p(target | row), 0 where mask is 0.

    Differentiable w.r.t. logits; masked rows get exactly 0 gradient. impl: "auto" | "triton" | "torch".
    """
    targets, mask = _check(logits, targets, mask)
    impl = _pick_impl(impl, logits)
    if impl == "torch":
        return logprobs_torch(logits, targets, mask, temperature)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _TritonLogprobs.apply(logits, targets, mask, float(temperature))


def _chunk_forward(logits, targets, temperature, impl):
    """Every row of a chunk is valid. -> log-probs (n,) fp32 and what the backward needs."""
    mask = torch.ones_like(targets, dtype=torch.bool)
    if impl == "torch":
        return logprobs_torch(logits, targets, mask, temperature).float(), None, None
    return _triton_forward(logits, targets, mask, temperature)


def _chunk_grad(logits, targets, grad_out, row_max, logz, temperature, impl):
    """-> d(sum grad_out * logprobs) / d logits for one chunk, (n, V) in the logits dtype."""
    mask = torch.ones_like(targets, dtype=torch.bool)
    if impl == "torch":  # differentiate the reference itself
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            lp = logprobs_torch(x, targets, mask, temperature)
            return torch.autograd.grad(lp, x, grad_out.to(lp.dtype))[0]
    return _triton_backward(logits, targets, mask, row_max, logz, grad_out, temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    """hidden (n, H) of valid rows only, weight (V, H) -> (n,) fp32; logits exist one chunk at a time.
    Autocast off inside, forward and backward (which recomputes the logits): under a bf16 autocast body
    (rl.py --train-bf16) the head keeps the weights' dtype, as bf16-rounded logits (~20 at 2^-8 relative
    precision) would move each log-prob by up to ~0.04 nat and its gradient would not match the forward's."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, impl):
        with torch.autocast(hidden.device.type, enabled=False):
            n = hidden.shape[0]
            w = weight.to(hidden.dtype)
            out = torch.empty(n, dtype=torch.float32, device=hidden.device)
            row_max, logz = torch.empty_like(out), torch.empty_like(out)
            for s in range(0, n, chunk):
                logits = hidden[s:s + chunk] @ w.T  # (chunk, V) <- the only big tensor; freed each iteration
                lp, m, z = _chunk_forward(logits, targets[s:s + chunk], temperature, impl)
                out[s:s + chunk] = lp
                if m is not None:
                    row_max[s:s + chunk], logz[s:s + chunk] = m, z
            ctx.save_for_backward(hidden, weight, targets, row_max, logz)
            ctx.temperature, ctx.chunk, ctx.impl = temperature, chunk, impl
            return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, row_max, logz = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            chunk = ctx.chunk
            w = weight.to(hidden.dtype)
            grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
                if ctx.needs_input_grad[1] else None  # fp32 accumulator across chunks
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk]
                logits = h @ w.T  # (chunk, V) recomputed: one more matmul instead of keeping N x V
                grad_logits = _chunk_grad(logits, targets[s:s + chunk], grad_out[s:s + chunk].contiguous(),
                                          row_max[s:s + chunk], logz[s:s + chunk], ctx.temperature, ctx.impl)
                del logits
                if grad_hidden is not None:
                    grad_hidden[s:s + chunk] = grad_logits @ w
                if grad_weight is not None:
                    grad_weight.add_(grad_logits.T @ h)
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
            return grad_hidden, grad_weight, None, None, None, None


def masked_logprobs_chunked(hidden, weight, targets, mask, temperature=1.0, chunk=4096, impl="auto"):
    """hidden (N, H), lm_head weight (V, H) -> (N,) fp32 log p(target), 0 where mask is 0.

    Same numbers as masked_logprobs(hidden @ weight.T, ...), but only rows with mask 1 are multiplied
    by the weight, `chunk` rows at a time, so the full (N, V) logits are never materialised.
    Differentiable w.r.t. hidden and weight (the weight gradient only if it requires grad).
    """
    targets, mask = _check(hidden, targets, mask)
    impl = _pick_impl(impl, hidden)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (V, H={hidden.shape[1]}), got {tuple(weight.shape)}")
    rows = mask.nonzero().squeeze(1)  # valid rows only: no matmul for system/user/tool tokens (one sync)
    lp = _ChunkedLogprobs.apply(hidden.index_select(0, rows), weight, targets.index_select(0, rows),
                                float(temperature), int(chunk), impl)
    return torch.zeros(mask.shape[0], dtype=torch.float32, device=hidden.device).index_copy(0, rows, lp)


def sequence_logprobs(model, input_ids, attention_mask, loss_mask, temperature=1.0, chunk=4096,
                      past_key_values=None):
    """out[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) where loss_mask[b, t] == 1, else 0. (B, T) fp32.

    model: a HF causal LM or a peft model wrapping one. LoRA is active unless called inside
    `with model.disable_adapter():` (the reference policy). Runs the decoder body only, then the
    chunked path with the lm_head weight, so (B, T, V) logits are never materialised.
    Positions count real tokens (attention_mask.cumsum - 1), as HF generate does with left padding;
    for right-padded sequences that start at position 0 they are simply 0, 1, 2, ...
    Position t = 0 has no context and is always 0. chunk: token rows per lm_head matmul.
    past_key_values: a cache of P tokens that every row continues (see backward_with_shared_prefix);
    positions then start at P, and column 0 is still 0 (its context ends inside the cache).
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
    prefix_ids and micro_batches as in backward_with_shared_prefix. -> [logp (B_i, T_i)].
    Meant for log-probs without grad (reference and old policies): call it under torch.no_grad()."""
    kv = _prefix_kv(model, prefix_ids)
    return [sequence_logprobs(model, ids, attn, mask, temperature, chunk, past_key_values=_cache(kv, len(ids)))
            for ids, attn, mask in micro_batches]


def batch_logprobs(model, batches: list[PrefixBatch], temperature=1.0) -> dict:
    """logprobs_with_shared_prefix of every micro-batch -> {tuple(its rows): logp (b, T - P)}. Under no_grad."""
    return {tuple(rows): lp for b in batches
            for rows, lp in zip(b.rows, logprobs_with_shared_prefix(model, b.prefix, b.micro, temperature))}


def backward_with_shared_prefix(model, prefix_ids, micro_batches, loss_of, temperature=1.0, chunk=4096):
    """Backpropagate sum_i loss_of(i, logp_i) for micro-batches that all continue the same prefix
    (in SFT and GRPO: the ~1.8k-token system prompt of a domain), running the prefix once instead of
    once per sequence. The gradient is exact: the same as one full forward/backward per sequence.

      1. the prefix goes forward once, with grad, caching its keys/values per layer;
      2. each micro-batch goes forward against detached copies of those keys/values and is
         backpropagated at once (its graph freed); this also sums dloss/d(prefix keys, values)
         over the micro-batches into the copies' .grad;
      3. one backward through the prefix with those sums.

    prefix_ids: (P,) long (P may be 0). micro_batches: [(input_ids, attention_mask, loss_mask)], each
    (B_i, T_i), right-padded, the tokens that follow the prefix. loss_mask[:, 0] must be 0 if P > 0
    (shared_prefix_len picks such a P). loss_of(i, logp): a scalar tensor from logp (B_i, T_i), laid
    out as sequence_logprobs returns it. Returns the loss values. P > 0 needs activation
    checkpointing off (transformers drops the cache inside checkpointed layers); P = 0 is the plain
    pass, one forward/backward per micro-batch.
    """
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) and model.training
    if len(prefix_ids) and checkpointed:
        raise ValueError("backward_with_shared_prefix needs gradient checkpointing off: "
                         "transformers ignores past_key_values in checkpointed layers")
    kv = _prefix_kv(model, prefix_ids)                                           # in the graph
    leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kv]
    losses = []
    for i, (ids, attn, mask) in enumerate(micro_batches):
        logp = sequence_logprobs(model, ids, attn, mask, temperature, chunk, past_key_values=_cache(leaves, len(ids)))
        loss = loss_of(i, logp)
        loss.backward()
        losses.append(loss.item())
    if kv:
        torch.autograd.backward([t for pair in kv for t in pair], [t.grad for pair in leaves for t in pair])
    return losses
