"""Decoding many conversations at once: a KV cache that grows in place, attention that reads a prefix all
rows share (the system prompt) once per step, and waves of rows that fit a KV budget. Pure PyTorch; used by
sampler.ModelAgent.

KVBuffer       one layer's keys/values for a batch of rows, left-padded, with room reserved for the
               tokens still to come: transformers' DynamicLayer torch.cat's the whole cache at every
               decode step (at 16 rows x 2k tokens that copy was 60% of a CPU decode step).
shared_prefix_attention
               attention when every row continues the same P-token prefix (a decode step, or a batch
               of rows prefilling their new turns). The prefix's keys/values are stored once,
               (1, kv_heads, P, head_dim), and read once for all rows; each row's own keys/values sit in
               the KVBuffer. Scores against both are concatenated before one softmax, so it equals
               attention over [prefix ; row].
               Registered with transformers as the attention implementation "shared_prefix"; a
               forward without the shared_prefix= argument falls through to plain SDPA.
weight_major_linear
               a decode step's linear layers in the weight-major layout, much faster on CPU for few rows.
lora_merged    the LoRA delta folded into the weights while sampling (CPU), the weights restored bit for bit.
prefill_new_turns
               a round's new turns of many rows that continue one shared prefix, prefilled together: on CPU
               packed, all rows' new tokens in one sequence with no padding, their attention reading the
               prefix once for every row and merging it with each row's own part by log-sum-exp
               (prefill_packed); on GPU padded into batches (prefill_together, also the CPU bench's baseline
               under prefill_padded).
kv_bytes_per_token, plan_waves
               what one token of cache costs, and how many rows to decode together so that their
               cache fits a budget (Qwen3-8B: 144 KiB a token; 256 rollouts x 6k tokens would be 220 GB);
               wave_scratch, what a wave holds besides it.
Tested in tests/test_rollout.py and tests/test_sampler.py (sampled log-probs == a teacher-forced recomputation;
waves == one batch) and tests/test_kernels.py (packed prefill == attention over each whole row).
"""
import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


class KVBuffer(DynamicLayer):
    """One layer's KV cache: `rows` rows, left-padded to `length`, with `room` free slots after it.
    put(i, pieces) writes row i, every row once; keys/values (what attention reads) are views of the filled part.
    storage: the (k, v) tensors to hold it, each (rows, kv_heads, length + room, head_dim), e.g. views of the static
    decoder's buffer that every wave reuses (sampler/static.py); None: its own, uninitialised (put zeroes the padding,
    and a free slot is written before it is read)."""

    def __init__(self, rows: int, like: torch.Tensor, length: int, room: int, storage: tuple | None = None):
        super().__init__()                               # like: any (1, kv_heads, m, head_dim) of the model
        self.k, self.v = storage or [like.new_empty(rows, like.shape[1], length + room, like.shape[3])
                                     for _ in range(2)]  # (B, kv_heads, cap, hd)
        self.n, self.dtype, self.device, self.is_initialized = length, like.dtype, like.device, True
        self.keys, self.values = self.k[:, :, :length], self.v[:, :, :length]

    def put(self, i: int, pieces: list[tuple]):
        """Row i's keys/values, consecutive pieces [(k, v), ...] each (1, kv_heads, m, head_dim), ending at `length`;
        the padding before them zeroed (masked, but 0 * NaN would still be NaN)."""
        end = self.n
        for k, v in reversed(pieces):
            self.k[i, :, end - k.shape[2]:end], self.v[i, :, end - k.shape[2]:end] = k[0], v[0]
            end -= k.shape[2]
        self.k[i, :, :end], self.v[i, :, :end] = 0, 0
        return self

    def update(self, keys, values, *args, **kwargs):
        start, self.n = self.n, self.n + keys.shape[2]
        self.k[:, :, start:self.n], self.v[:, :, start:self.n] = keys, values
        self.keys, self.values = self.k[:, :, :self.n], self.v[:, :, :self.n]
        return self.keys, self.values

    def select(self, rows: torch.Tensor):
        """Keep only `rows` (ascending), moved up in place one row at a time: no second buffer."""
        for j, r in enumerate(rows.tolist()):
            if r != j:
                self.k[j], self.v[j] = self.k[r], self.v[r]
        self.k, self.v = self.k[:len(rows)], self.v[:len(rows)]
        self.keys, self.values = self.k[:, :, :self.n], self.v[:, :, :self.n]


def token_slice(pieces: list[tuple], start: int, stop: int) -> list[tuple]:
    """Tokens [start, stop) of consecutive (k, v) pieces, each (1, kv_heads, m, head_dim), as pieces (views)."""
    out, offset = [], 0
    for k, v in pieces:
        a, b = max(start - offset, 0), min(stop - offset, k.shape[2])
        if a < b:
            out.append((k[:, :, a:b], v[:, :, a:b]))
        offset += k.shape[2]
    return out


@contextlib.contextmanager
def weight_major_linear(max_rows: int = 64):
    """Inside: on CPU, F.linear(x, W) of at most max_rows rows is computed as (W @ x^T)^T, the same product.
    A decode step feeds one token per conversation, and for so few rows the BLAS torch ships (MKL) runs this
    layout several times faster than x @ W^T; prefill and training rows keep the
    usual layout, which is as fast or faster there. Every nn.Linear (LoRA's too) goes through F.linear."""
    plain = F.linear

    def linear(x, weight, bias=None):
        rows = x.numel() // x.shape[-1]
        if x.device.type != "cpu" or rows > max_rows:
            return plain(x, weight, bias)
        y = (weight @ x.reshape(rows, x.shape[-1]).t()).t().reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    F.linear = linear
    try:
        yield
    finally:
        F.linear = plain


@contextlib.contextmanager
def lora_merged(model, enabled: bool = True):
    """Sample with the active LoRA adapter folded into the weights, W + (alpha / r) B A: one matmul per
    projection instead of three. The weights come back bit for bit afterwards
    (unmerging alone subtracts in floating point and leaves rounding behind), so training and the KL
    reference see the weights they saw before. CPU and unquantized only: on a GPU a saved copy of 8B
    weights would not fit beside them, and NF4 weights cannot take a delta. Not while the adapter is
    disabled (the base model is what samples then), nor with enabled=False."""
    from peft.tuners.lora import LoraLayer
    lora = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not (enabled and lora and model.device.type == "cpu") or any(m.disable_adapters or m.merged for m in lora) \
            or any(not m.get_base_layer().weight.is_floating_point() for m in lora):
        yield
        return
    saved = [m.get_base_layer().weight.detach().clone() for m in lora]
    model.merge_adapter()
    try:
        yield
    finally:
        model.unmerge_adapter()
        for m, w in zip(lora, saved):
            m.get_base_layer().weight.data.copy_(w)


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run the model with another registered attention implementation (e.g. "shared_prefix" below)."""
    plain, model.config._attn_implementation = model.config._attn_implementation, name
    try:
        yield
    finally:
        model.config._attn_implementation = plain


PREFILL_TOKENS = 4096           # new tokens per batched prefill forward: bounds its attention's size


def token_batches(sizes: list[int]) -> list[list[int]]:
    """Consecutive indices of sizes grouped so that each group's sizes add up to at most PREFILL_TOKENS (a size
    over it alone): prefill_packed's forwards, and the sampler's prefill chunks, the same groups."""
    batches = []
    for i, n in enumerate(sizes):
        if batches and sum(sizes[j] for j in batches[-1]) + n <= PREFILL_TOKENS:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def prefill_new_turns(model, rows, cached, P: int, prefix, pad: int):
    """A round's new turns of rows that continue one shared prefix: packed on CPU (prefill_packed), padded into
    batches on GPU (prefill_together: there the batched SDPA kernels take the padding in their stride)."""
    if model.device.type == "cpu" and not _padded:
        return prefill_packed(model, rows, cached, P, prefix)
    return prefill_together(model, rows, cached, P, prefix, pad)


_padded = False                 # set by prefill_padded()


@contextlib.contextmanager
def prefill_padded():
    """Inside: prefill_new_turns pads on CPU too (prefill_together), the sampler's prefill before packing: the
    sampler bench's baseline, the same tokens."""
    global _padded
    _padded = True
    try:
        yield
    finally:
        _padded = False


@torch.no_grad()
def prefill_together(model, rows, cached, P: int, prefix, pad: int):
    """Feed the new tokens of rows that all continue one shared prefix (prefix: per layer (k, v), each
    (1, kv_heads, P, hd)), batches of rows per forward. cached[i] = (c_i >= P, row i's cached keys/values as
    per-layer pieces). In a batch the cached own parts sit left-padded in a KVBuffer and the new tokens are
    right-aligned after them, so the last position holds every row's last token; the mask hides both
    paddings, positions continue from c_i, and all rows attend the prefix once (shared_prefix_attention).
    -> (per row, per layer: its own keys/values after P as pieces; logits of its last token (V,))."""
    new = [len(r) - c for r, (c, _) in zip(rows, cached)]
    batches = []
    own = [c - P for c, _ in cached]                             # cached own tokens, copied into the batch's buffer
    for i in sorted(range(len(rows)), key=lambda i: -new[i]):   # longest first: rows of a batch pad little
        if batches and (len(batches[-1]) + 1) * (new[batches[-1][0]] + max(own[j] for j in batches[-1] + [i])) \
                <= PREFILL_TOKENS:                              # the batch's buffer, (b, Lc + D), bounded
            batches[-1].append(i)
        else:
            batches.append([i])
    own, logits, dev = [None] * len(rows), [None] * len(rows), model.device
    for batch in batches:
        b, D = len(batch), new[batch[0]]
        Lc = max(cached[i][0] for i in batch) - P
        ids = torch.full((b, D), pad, dtype=torch.long)
        attn, pos = torch.zeros(b, Lc + D, dtype=torch.long), torch.zeros(b, D, dtype=torch.long)
        cache = Cache(layers=[KVBuffer(b, k, Lc, D) for k, _ in prefix])
        for j, i in enumerate(batch):
            c, kv = cached[i]
            ids[j, D - new[i]:] = rows[i][c:]
            attn[j, Lc - (c - P):Lc], attn[j, Lc + D - new[i]:] = 1, 1
            pos[j] = (torch.arange(D) + c - (D - new[i])).clamp(min=0)
            for layer, pieces in zip(cache.layers, kv):
                layer.put(j, token_slice(pieces, P, c))
        with attention_implementation(model, "shared_prefix"):
            out = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
                        past_key_values=cache, shared_prefix=[(None, prefix)], logits_to_keep=1)
        for j, i in enumerate(batch):
            c = cached[i][0]
            keep = [slice(Lc - (c - P), Lc), slice(Lc + D - new[i], Lc + D)]     # cached, then new
            own[i] = [[(layer.k[j:j + 1, :, s], layer.v[j:j + 1, :, s]) for s in keep] for layer in cache.layers]
            logits[i] = out.logits[j, -1]
    return own, logits


@torch.no_grad()
def prefill_packed(model, rows, cached, P: int, prefix):
    """prefill_together without padding (CPU): the new tokens of all rows one after another in one sequence, as
    many rows per forward as fit PREFILL_TOKENS, so the weights multiply only real tokens; the attention
    (packed_prefill_attention) reads the shared prefix once for every row's queries and each row's own keys apart.
    The same result as prefill_together (nothing is padded, so no pad id)."""
    new = [len(r) - c for r, (c, _) in zip(rows, cached)]
    batches = token_batches(new)
    own, logits, dev = [None] * len(rows), [None] * len(rows), model.device
    group = model.config.num_attention_heads // prefix[0][0].shape[1]
    for batch in batches:
        ends = torch.tensor([new[i] for i in batch]).cumsum(0).tolist()
        bounds = list(zip([0] + ends[:-1], ends))
        cached_own = [[token_slice(pieces, P, cached[i][0]) for pieces in cached[i][1]] for i in batch]
        masks = []
        for i in batch:                                # new token t sees the row's cached keys and new ones up to t
            n, m = new[i], cached[i][0] - P + new[i]
            seen = torch.ones(n, m, dtype=torch.bool).tril(m - n).repeat(group, 1)    # (group * n, m)
            masks.append(torch.zeros(seen.shape, device=dev).masked_fill_(~seen.to(dev), float("-inf"))[None, None])
        layout = Packed(bounds, [[([k for k, _ in pieces], [v for _, v in pieces]) for pieces in layers]
                                 for layers in cached_own], masks, prefix)
        ids = torch.cat([rows[i][cached[i][0]:] for i in batch])[None].to(dev)
        pos = torch.cat([torch.arange(cached[i][0], len(rows[i])) for i in batch])[None].to(dev)
        with attention_implementation(model, "packed_prefill"):
            out = model(input_ids=ids, position_ids=pos, use_cache=True, packed=layout,
                        logits_to_keep=torch.tensor(ends, device=dev) - 1)
        for j, (i, (s, e)) in enumerate(zip(batch, bounds)):
            own[i] = [pieces + [(layer.keys[:, :, s:e], layer.values[:, :, s:e])]
                      for pieces, layer in zip(cached_own[j], out.past_key_values.layers)]
            logits[i] = out.logits[0, j]
    return own, logits


_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu    # -> (out, log-sum-exp of scores)


class Packed(NamedTuple):
    """Where each row's new tokens sit in a packed prefill, and what they attend besides each other."""
    bounds: list                # per row (start, end): its new tokens in the packed sequence
    own: list                   # per row, per layer: ([k pieces], [v pieces]) of its cached own tokens (may be empty)
    masks: list                 # per row: float mask (1, 1, group * n, m), its n new tokens against its m own keys
    prefix: list                # per layer (k, v), each (1, kv_heads, P, hd): the prefix every row continues


def packed_prefill_attention(module, query, key, value, attention_mask, scaling=None, packed=None, **kw):
    """query (1, heads, T, hd), key/value (1, kv_heads, T, hd): the new tokens of several rows one after another
    (packed: Packed). A row's new token attends the shared prefix, the row's cached own tokens and its new tokens
    up to itself. Two attentions, each returning its log-sum-exp: every row's queries against the prefix in one
    call, each row's against its own keys apart; then merged, o = o1 + (o2 - o1) * sigmoid(lse2 - lse1), which is
    softmax attention over [prefix ; own] with its denominator split in two. -> (1, T, heads, hd)."""
    _, H, T, D = query.shape
    pk, pv = (x.contiguous() for x in packed.prefix[module.layer_idx])    # the op misreads a strided last dim
    kvh, scale = pk.shape[1], scaling or D ** -0.5
    g = H // kvh
    q = query.reshape(1, kvh, g * T, D)             # query heads grouped by the kv head they share
    out, lse = _flash_with_lse(q, pk, pv, scale=scale)
    out, lse, q = out.view(1, kvh, g, T, D), lse.view(1, kvh, g, T), q.view(1, kvh, g, T, D)
    for (s, e), layers, mask in zip(packed.bounds, packed.own, packed.masks):
        ks, vs = layers[module.layer_idx]
        k, v = torch.cat(ks + [key[:, :, s:e]], 2), torch.cat(vs + [value[:, :, s:e]], 2)
        o2, lse2 = _flash_with_lse(q[:, :, :, s:e].reshape(1, kvh, g * (e - s), D), k, v, attn_mask=mask, scale=scale)
        o1 = out[:, :, :, s:e]
        w = torch.sigmoid(lse2.view(1, kvh, g, e - s) - lse[:, :, :, s:e])[..., None]
        out[:, :, :, s:e] = o1 + (o2.view(1, kvh, g, e - s, D) - o1) * w
    return out.reshape(1, H, T, D).transpose(1, 2), None


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys + values of one token in every layer: layers x kv_heads x head_dim x 2 (K, V) x bytes.
    Qwen3-8B in bf16: 36 x 8 x 128 x 2 x 2 = 147,456 bytes (144 KiB)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * kv_heads * head_dim * 2 * torch.finfo(dtype).bits // 8


def sampler_scratch(config, dtype: torch.dtype, context: int, own: int, packed: bool) -> tuple[int, int, int]:
    """What the sampler allocates beside the keys/values plan_waves counts, in bytes: (per row of a wave, per
    token of its longest prefill forward, once), for rows of at most `context` tokens (shared prefix + own + room),
    `own` of them after the shared prefix; packed: prefill_new_turns packs (CPU) rather than pads. A prefill forward takes at most PREFILL_TOKENS new tokens
    (prefill_new_turns batches them so, and the sampler puts each batch into the decode buffer before the next
    exists), more only for a row prefilled alone. Upper bounds, term by term:
      per row    the decode step's logits (V,) and their fp32 copies (the float, / T, log-softmax, exp): 5 x V x 4;
                 its attention scores over [prefix ; own] in the compute dtype and fp32: heads x context x 24;
                 padded, a prefill batch's attention of one layer, the prefix's keys/values expanded per row and
                 repeated per query head: context x (1 + heads / kv_heads) x 2 x kv_heads x head_dim x bytes;
      per token  a prefill forward's keys/values and activations, every tensor a layer holds at once
                 (8 x hidden + 4 x intermediate + 2 x (q, k, v) widths), and packed, the attention masks of its
                 rows (heads / kv_heads x own floats a new token);
      once       bitsandbytes' dequantized copy of the widest weight (it dequantizes for more than one row)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads, H, I = config.num_attention_heads, config.hidden_size, config.intermediate_size
    kvh = getattr(config, "num_key_value_heads", None) or heads
    b = torch.finfo(dtype).bits // 8
    per_row = 5 * config.vocab_size * 4 + heads * context * 24 \
        + (0 if packed else context * (1 + heads // kvh) * 2 * kvh * head_dim * b)
    per_token = kv_bytes_per_token(config, dtype) + (8 * H + 4 * I + 2 * (heads + 2 * kvh) * head_dim) * b \
        + (heads // kvh * own * 4 if packed else 0)
    return per_row, per_token, max(I, heads * head_dim) * H * b


def wave_scratch(b: int, L: int, prefix: int, scratch: tuple[float, float, float]) -> float:
    """What a wave of b rows, the longest with L own tokens, holds besides its decode buffer and the copies of its
    rows' caches, in tokens of cache: the shared prefix (its keys/values and their copy in the decode buffer's
    reach), the row being prefilled, and scratch (sampler_scratch: per row, per prefill token, once); its longest
    prefill forward takes the shared prefix, or at most PREFILL_TOKENS of its b rows' L own tokens each."""
    prefill = max(prefix, L, min(PREFILL_TOKENS, b * L))
    return 2 * prefix + L + b * scratch[0] + prefill * scratch[1] + scratch[2]


def plan_waves(own: list[int], prefix: int, room: int, budget: int | None,
               scratch: tuple[float, float, float] = (0, 0, 0), fits=None, held: int = 0) -> tuple[list[list[int]], bool]:
    """(waves, keep): rows (indices) in waves to decode one after the other, each fitting `budget` cache
    tokens (None: no limit), and whether the rows' caches may be kept for the next round.
    own[i]: row i's tokens after the `prefix` tokens all rows share; room: tokens a row may still sample.
    A wave of b rows, the longest with L own tokens, holds wave_scratch and its (b, L + room) decode buffer. If all
    rows fit in one wave with as much again for the copies of their caches kept for the next round: one wave, in
    order, keep. Else no copies (keep False), and the waves take the longest rows first, so a wave pads little.
    A row that alone exceeds the budget still gets a wave of its own.
    fits(b, n): when the decode buffer is one buffer of `held` tokens made for the run (the static decoder's Layout),
    whether a wave of b rows of n tokens fits in it; every wave then holds that buffer. None: each wave its own."""
    def ok(b, L, copies):
        buffer = held if fits else b * (L + room)
        return (budget is None or wave_scratch(b, L, prefix, scratch) + buffer + copies * b * (L + room) <= budget) \
            and (fits is None or fits(b, L + room))
    if not own or ok(len(own), max(own), 1):
        return [list(range(len(own)))], True
    waves = []
    for i in sorted(range(len(own)), key=lambda i: -own[i]):
        if waves and ok(len(waves[-1]) + 1, own[waves[-1][0]], 0):   # its first row is its longest
            waves[-1].append(i)
        else:
            waves.append([i])
    return waves, False


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, shared_prefix=None, **kw):
    """query (B, heads, q, hd): q new tokens a row (1 when decoding, a turn when prefilling); key/value
    (B, kv_heads, n, hd): each row's own part, ending with the new tokens; attention_mask (B, 1, q, n) bool
    (False: padding, or a later token) or None. shared_prefix: [(rows, layers)], one entry per prefix the
    rows continue: rows a slice of the batch (None: all rows; a slice reads the rows' keys/values in place, where a
    tensor of indices would copy them every layer and token), layers per layer (k, v), each
    (1, kv_heads, P, hd), seen by every new token of those rows (None: rows that share no prefix).
    -> (B, q, heads, hd), as transformers' SDPA wrapper returns."""
    if shared_prefix is None:                       # any other call (the prefix itself, training): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)
    out = None
    for rows, layers in shared_prefix:              # a prefix per system prompt: one or two groups of rows
        sub = (lambda x: x) if rows is None else (lambda x: None if x is None else x[rows])   # noqa: E731
        if layers is None:
            o = sdpa_attention_forward(module, sub(query), sub(key), sub(value), sub(attention_mask),
                                       scaling=scaling, **kw)[0]
        else:
            o = _attend_with_prefix(module, sub(query), sub(key), sub(value), sub(attention_mask),
                                    *layers[module.layer_idx], scaling, **kw)
        if rows is None:
            return o, None
        out = o.new_empty(query.shape[0], *o.shape[1:]) if out is None else out
        out[rows] = o
    return out, None


def _attend_with_prefix(module, query, key, value, attention_mask, pk, pv, scaling, **kw):
    """Attention over [prefix ; row] for rows that all continue one prefix pk, pv (1, kv_heads, P, hd)."""
    B, H, Q, D = query.shape
    kvh, P, n = pk.shape[1], pk.shape[2], key.shape[2]
    if Q > 1:                                        # prefilling: SDPA, the prefix visible to every new token
        if attention_mask is None:                   # new token i sees own keys up to its own place, n - q + i
            attention_mask = torch.ones(Q, n, dtype=torch.bool, device=query.device).tril(n - Q)[None, None]
        mask = torch.cat([attention_mask.new_ones(B, 1, Q, P), attention_mask.expand(B, 1, Q, n)], -1)
        k, v = torch.cat([pk.expand(B, -1, -1, -1), key], 2), torch.cat([pv.expand(B, -1, -1, -1), value], 2)
        return sdpa_attention_forward(module, query, k, v, mask, scaling=scaling, **kw)[0]
    # decoding, one token a row: the prefix's keys/values are read once for all rows, not copied per row
    q = query.reshape(B, kvh, H // kvh, D)           # query heads grouped by the kv head they share
    qk = q.permute(1, 0, 2, 3).reshape(kvh, -1, D)   # (kv_heads, B * group, hd)
    s_prefix = (qk @ pk[0].transpose(1, 2)).view(kvh, B, -1, P).permute(1, 0, 2, 3)   # (B, kvh, group, P)
    s_row = q @ key.transpose(2, 3)                  # (B, kvh, group, n)
    if attention_mask is not None:                   # (B, 1, 1, n) bool: False on left padding
        s_row = s_row.masked_fill(~attention_mask, float("-inf"))
    p = torch.softmax(torch.cat([s_prefix, s_row], -1).float() * (scaling or D ** -0.5), -1).to(value.dtype)
    p_prefix = p[..., :P].permute(1, 0, 2, 3).reshape(kvh, -1, P)                     # (kvh, B * group, P)
    out = (p_prefix @ pv[0]).view(kvh, B, -1, D).permute(1, 0, 2, 3) + p[..., P:] @ value   # (B, kvh, group, hd)
    return out.reshape(B, 1, H, D)                   # (B, q_len, heads, hd), as SDPA's wrapper returns


AttentionInterface.register("shared_prefix", shared_prefix_attention)
AttentionMaskInterface.register("shared_prefix", sdpa_mask)
AttentionInterface.register("packed_prefill", packed_prefill_attention)
AttentionMaskInterface.register("packed_prefill", lambda *a, **kw: None)    # the attention knows each row's bounds
