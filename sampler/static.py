"""sampler/static.py: a decode step whose shapes are fixed and which never asks the host, so that on a GPU it is one
CUDA graph a token, captured once per rows bucket for the run. Greedy, the same tokens as sampler/plain.py; sampled,
log-probs equal to a teacher-forced pass's (tests/test_static_decode.py). sampler.ModelAgent decodes with it on CUDA
(decode="static"), and its prefill stays eager and chunked (sampler/fast.py).

Why. The eager decode step of the 8B NF4 sampler launched ~1,000 kernels from Python and asked the host which rows
had finished after every token: 72% of a 64-row round had no kernel running, the 4-bit matmuls took 4%
(docs/gpu.md). Here, as nano-vllm does it:
  - one keys/values buffer for the run (Layout): a flat block of token slots per layer that a rows bucket b views as
    (b, kv_heads, cols(b), head_dim), cols(b) = its slots / b, at most the run's longest row. It is made once, as
    large as the KV budget leaves, and grown only when a round needs more rows or a longer row than it holds;
    the shared system prompts' keys/values sit in another, read once a step for all rows;
  - a row's length, its shared prefix and its stop live in device tensors (StepState: positions, the column each
    row writes, masks, stop flags, the temperature and the end token), never in a shape: so the graph of a rows
    bucket serves every round, every length and every prefix width. Sampling is on the device, by
    plain.sample_next (the one rule every sampler calls): the inverse CDF of softmax(logits / T) at the row's
    uniform for that token, drawn on the host from its conversation's stream before the wave and copied in
    (StepState.u), the argmax at T = 0, and the drawn token's log-prob;
  - decode_step calls no .item(), .tolist(), .cpu(), nonzero or boolean index (tests/test_static_decode.py fails if
    one is added). On CUDA the step of every rows bucket is captured when the buffer is made, largest first, into
    one memory pool, before any row is in it; the capture seconds are counted (captures, capture_s). On CPU the same
    code runs eagerly, and graph_keys records what would have been captured.
The host looks at the stop flags once every CHECK_EVERY steps: it ends the wave when every row is done, and moves
the live rows to the front of a smaller rows bucket when they fit one.

decode_step is a Llama / Qwen3 decoder layer written out over the model's own modules: RMSNorm, the q/k/v
projections as one call, Qwen3's per-head q/k RMSNorm, rotary, attention over [shared prefix ; own keys] with fp32
scores (two attentions that each return their log-sum-exp, merged: the trainer's SDPA does not round its scores to
bf16 either), o, RMSNorm, gate and up as one call, the SwiGLU, down; then the final norm and lm_head.

Sampling weights (sample_weights; the seven projections of each layer, the rest is the model's own):
  bf16  a dense copy in the compute dtype (bf16 on a GPU) with the LoRA delta merged, W + s B A summed in fp32 and
        rounded once: exact up to one rounding; q, k and v one weight, gate and up another (4 matmuls a layer). W is
        the weight the model multiplies by (bitsandbytes' NF4 dequantized as its forward does), so no second copy of
        the base is kept: each refresh dequantizes it again, in place, once a round at most (when an optimizer step
        changed the weights). 2 bytes a weight more (Qwen3-8B: 12.9 GiB).
  nf4   the model's own base layers (bitsandbytes NF4 with --load-in-4bit), and the LoRA adapter beside them in one
        small matmul pair a group (q/k/v, gate/up, o, down): the A matrices stacked, the B matrices (times the
        scale) block-diagonal, refreshed in place like bf16's copy. No copy of the base: the fit for a 24 GiB card.
  auto  bf16 where the copy, the update's reserve and the KV budget fit the free memory, else nf4 (choose_weights).
"""
import sys
import time
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sampler.attention import KVBuffer
from sampler.plain import sample_next

CHECK_EVERY = 16            # decode steps between two looks of the host at the stop flags
ROWS_STEP, COLS_STEP = 16, 128   # rows buckets: 1, 2, 4, 8, then multiples of 16; columns: multiples of 128
MIN_KV_BF16 = 8 * 2**30     # auto with an automatic KV budget: bf16 only if it leaves this much for keys/values
WEIGHTS = ("auto", "bf16", "nf4")


def rows_bucket(n: int) -> int:
    return n if n <= 2 else 4 if n <= 4 else 8 if n <= 8 else -(-n // ROWS_STEP) * ROWS_STEP


def rows_buckets(rows: int) -> list[int]:
    """Every rows bucket up to rows' own, largest first: the graphs a buffer of that many rows captures."""
    small = [b for b in (1, 2, 4, 8) if b <= rows]
    return sorted(set(small + list(range(ROWS_STEP, rows_bucket(rows) + 1, ROWS_STEP))), reverse=True)


def cols_bucket(n: int) -> int:
    return -(-n // COLS_STEP) * COLS_STEP


def free_memory(device) -> int:
    """Bytes a CUDA device can still give: what the driver has free, plus what torch holds unused."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class Layout(NamedTuple):
    """The run's buffers: `tokens` slots of keys/values a layer for the rows' own parts, at most `rows` rows, no row
    longer than `max_cols`; `prefix` columns for the shared prefixes; `room` tokens a turn. Rows bucket b sees the
    slots as (b, cols(b)): fewer rows, longer rows."""
    rows: int
    tokens: int
    max_cols: int
    prefix: int
    room: int

    def cols(self, b: int) -> int:
        return min(self.max_cols, self.tokens // b // COLS_STEP * COLS_STEP)

    def fits(self, rows: int, n: int) -> bool:
        """Does a wave of `rows` rows of at most n tokens (own part + room) fit?"""
        b = rows_bucket(rows)
        return b <= self.rows and cols_bucket(n) <= self.cols(b)

    def holds(self, other: "Layout") -> bool:
        return all(a >= b for a, b in zip(self, other))


# ----------------------------------------------------------------------------- the sampling weights

def base_of(module):
    """A projection's base layer: peft's LoRA wraps it, else the module itself."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def dense_weight(base) -> torch.Tensor:
    """The (out, in) weight a base layer multiplies by: nn.Linear's own, or bitsandbytes' NF4 dequantized as its
    forward dequantizes it (to the dtype it was quantized from)."""
    if not hasattr(base.weight, "quant_state"):
        return base.weight
    import bitsandbytes.functional as bnbf
    data, state = base.weight.data, base.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):     # a CPU with AVX512-BF16 repacked it for its own kernel
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse
        data, state = _convert_weight_packed_for_cpu_inverse(data, state)
    return bnbf.dequantize_4bit(data, state)


def lora_parts(module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """The (A (r, in), B (out, r), scale) of each active LoRA adapter of a peft layer; none while adapters are
    disabled, merged into the base, or the module is a plain layer."""
    if not hasattr(module, "lora_A") or module.disable_adapters or module.merged:
        return []
    if getattr(module, "lora_variant", None):
        raise NotImplementedError("the static decode step takes plain LoRA only (no DoRA or other variants)")
    return [(module.lora_A[n].weight, module.lora_B[n].weight, module.scaling[n]) for n in module.active_adapters
            if n in module.lora_A]


class Merged:
    """bf16 mode: one or more projections that read the same input as one matmul with one dense weight in the compute
    dtype (their weights stacked), each with its active LoRA deltas merged. refresh() rewrites it in place, so
    captured graphs read the new weights. -> the projections' outputs."""

    def __init__(self, modules: list, dtype: torch.dtype):
        bases = [base_of(m) for m in modules]
        self.modules, self.sizes = modules, [b.out_features for b in bases]
        self.weight = torch.empty(sum(self.sizes), bases[0].in_features, dtype=dtype, device=bases[0].weight.device)
        biases = [b.bias for b in bases]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(n, device=self.weight.device) if b is None else b.detach() for b, n in zip(biases, self.sizes)]
        ).to(dtype)
        self.refresh()

    @torch.no_grad()
    def refresh(self):
        """W + sum of s B A over the active adapters, summed in fp32, rounded once into the copy."""
        for m, rows in zip(self.modules, self.weight.split(self.sizes)):
            w = dense_weight(base_of(m)).float()
            for A, B, s in lora_parts(m):
                w = w + s * (B.float() @ A.float())
            rows.copy_(w)

    def __call__(self, x) -> tuple:
        return F.linear(x, self.weight, self.bias).split(self.sizes, -1)


class BaseAndLoRA:
    """nf4 mode: one or more projections that read the same input, each through its own base layer (bitsandbytes
    NF4, unmerged), and their LoRA adapters in two matmuls: x A_all^T with every adapter's A stacked (sum r, in),
    then B_all, every s B block-diagonal (sum out, sum r): zeros off the blocks add exactly nothing. refresh() copies
    the adapters in place (zeros while they are disabled). -> the projections' outputs, each added to as peft adds
    (in the adapter's dtype, then back)."""

    def __init__(self, modules: list):
        self.modules, self.bases = modules, [base_of(m) for m in modules]
        self.sizes = [b.out_features for b in self.bases]
        self.ranks = [sum(m.lora_A[n].weight.shape[0] for n in m.active_adapters if n in m.lora_A)
                      if hasattr(m, "lora_A") else 0 for m in modules]
        like = next((m.lora_A[n].weight for m in modules if hasattr(m, "lora_A") for n in m.active_adapters
                     if n in m.lora_A), None)
        self.A = None if like is None else like.new_zeros(sum(self.ranks), self.bases[0].in_features)
        self.B = None if like is None else like.new_zeros(sum(self.sizes), sum(self.ranks))
        self.refresh()

    @torch.no_grad()
    def refresh(self):
        if self.A is None:
            return
        self.A.zero_()
        self.B.zero_()
        r0, o0 = 0, 0
        for m, size, rank in zip(self.modules, self.sizes, self.ranks):
            r = r0
            for A, B, s in lora_parts(m):
                self.A[r:r + A.shape[0]].copy_(A)
                self.B[o0:o0 + size, r:r + A.shape[0]].copy_(s * B.float())
                r += A.shape[0]
            if r not in (r0, r0 + rank):               # the shapes are fixed for the run
                raise RuntimeError("a LoRA adapter's rank changed under the static decoder: make a new ModelAgent")
            r0, o0 = r0 + rank, o0 + size

    def __call__(self, x) -> tuple:
        outs = [base(x) for base in self.bases]
        if self.A is None:
            return tuple(outs)
        delta = F.linear(F.linear(x.to(self.A.dtype), self.A), self.B).split(self.sizes, -1)
        return tuple((o + d).to(o.dtype) for o, d in zip(outs, delta))


class Projections(NamedTuple):
    """One layer's projections as the step calls them, each -> a tuple of outputs."""
    qkv: object
    o: object
    gate_up: object
    down: object


def layer_groups(layer) -> list[list]:
    """A layer's projections grouped by the input they read: [q, k, v], [o], [gate, up], [down]."""
    a, m = layer.self_attn, layer.mlp
    return [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]]


def copy_bytes(model) -> int:
    """What bf16 mode's copy takes: every projection's out x in weights in the compute dtype."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    size = lm.get_input_embeddings().weight.element_size()
    return sum(base_of(m).out_features * base_of(m).in_features * size
               for layer in lm.model.layers for group in layer_groups(layer) for m in group)


def choose_weights(model, kv_budget: int | None, reserve: int) -> str:
    """auto: bf16 when its copy, the update's reserve and the KV budget (kv_budget bytes, or MIN_KV_BF16 when the
    budget is automatic) fit the free memory; else nf4. On CPU nf4: the static step is the tests' path there.
    Qwen3-8B in NF4 + LoRA holds 5.8 GiB and its copy takes 12.9: an 80 GiB card has ~73 GiB free >= 12.9 + 6 + 8
    -> bf16; a 24 GiB card ~17.5 < 26.9 -> nf4 (docs/gpu.md)."""
    if model.device.type != "cuda":
        return "nf4"
    held = _decoders.get(model)                        # a decoder made before: its buffers and copy are ours to reuse
    free = free_memory(model.device) + (held.held_bytes() + copy_bytes(model) * (held.weights == "bf16") if held else 0)
    return "bf16" if copy_bytes(model) + reserve + (kv_budget or MIN_KV_BF16) <= free else "nf4"


# ----------------------------------------------------------------------------- the step

class StepState:
    """The decode step's device tensors for at most `rows` rows, `prefix` shared-prefix columns and `room` sampled
    tokens; the step updates them in place, so a replayed graph carries on from where it stopped.
      tok (rows,)            the token each row feeds next; after a step, the one it sampled
      pos (rows,)            that token's position
      start (rows,)          the first column of the row's own keys (own parts are left-padded to the wave's L)
      done (rows,) bool      sampled end-of-turn (or a padding row)
      prefix_bias (rows, P)  0 where a row sees a shared-prefix key (its group's), -inf elsewhere
      has_prefix (rows,) bool    the row continues a shared prefix (a row alone has none)
      out_tok, out_lp (rows, room)   the sampled tokens and their log-probs, token t in column t
      u (rows, room) fp64    each row's uniforms for this turn, from its conversation's stream: token t draws u[:, t]
      col (1,)               the column the fed token's keys/values go to: L + t - 1
      t (1,)                 the index of the token the step samples
      temp (1,), greedy (1,) bool, eot (1,)    T (1 at T = 0), T == 0, and the end-of-turn token"""
    NAMES = ("tok", "pos", "start", "done", "prefix_bias", "has_prefix", "out_tok", "out_lp", "u", "col", "t",
             "temp", "greedy", "eot")

    def __init__(self, rows: int, prefix: int, room: int, device):
        long = dict(dtype=torch.long, device=device)
        self.tok, self.pos, self.start = (torch.zeros(rows, **long) for _ in range(3))
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.prefix_bias = torch.full((rows, prefix), float("-inf"), device=device)
        self.has_prefix = torch.zeros(rows, dtype=torch.bool, device=device)
        self.out_tok, self.out_lp = torch.zeros(rows, room, **long), torch.zeros(rows, room, device=device)
        self.col, self.t, self.eot = (torch.zeros(1, **long) for _ in range(3))
        self.u = torch.zeros(rows, room, dtype=torch.float64, device=device)
        self.temp = torch.ones(1, device=device)
        self.greedy = torch.ones(1, dtype=torch.bool, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.NAMES]

    def sample_at(self, T: float, eot: int):
        self.temp.fill_(T or 1.0)
        self.greedy.fill_(T == 0)
        self.eot.fill_(eot)


def rotate(x, cos, sin):
    """Rotary position embedding of x (b, heads, 1, hd) with cos, sin (b, 1, hd), as HF's apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


def attend(q, k, v, bias, scale):
    """Softmax attention with fp32 scores and its log-sum-exp: q (B, H, M, hd), k, v (B, H, N, hd), bias in q's dtype
    added to the scores (0 seen, -inf not): (B or 1, 1, M, N) on CPU, (B, H, M, N) on CUDA. -> (out (B, H, M, hd), lse (B, H, M) fp32). The fused kernels keep
    the scores in fp32, as the trainer's SDPA does: CPU flash attention, CUDA memory-efficient attention."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)[:2]
        return out, lse[..., :q.shape[2]]           # the kernel pads the log-sum-exps' last dim
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)[:2]


def attention(attn, p: Projections, h, cos, sin, kv, prefix, own_bias, prefix_bias, has_prefix, col):
    """One layer's attention for one new token a row. h (b, 1, hidden); kv: the rows' own (K, V), each
    (b, kv_heads, S, hd), the new token's keys/values written at column col; prefix: (PK, PV) each (kv_heads, P, hd),
    every group's shared prefix one after another; own_bias (b, 1, 1, S), prefix_bias (1, 1, b * group, P): 0 where
    a key is seen, -inf where not. The rows' queries attend the prefix in one call and their own keys in another,
    merged by their log-sum-exps: o = o1 + (o2 - o1) sigmoid(lse2 - lse1), softmax attention over [prefix ; own]
    with its denominator split in two (a row with no prefix takes o2). -> (b, 1, hidden) after o_proj."""
    (K, V), (PK, PV) = kv, prefix
    b, D, kvh = h.shape[0], attn.head_dim, K.shape[1]
    q, k, v = p.qkv(h)
    q, k = q.view(b, 1, -1, D), k.view(b, 1, kvh, D)
    if hasattr(attn, "q_norm"):                     # Qwen3: RMSNorm over each head's q and k
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)   # (b, heads / kv_heads, 1, hd)
    K.index_copy_(2, col, k)
    V.index_copy_(2, col, v.view(b, 1, kvh, D).transpose(1, 2))
    g = q.shape[1] // kvh
    q = q.reshape(b, kvh, g, D)                      # query heads grouped by the kv head they share
    o2, lse2 = attend(q, K, V, own_bias, attn.scaling)                                   # (b, kvh, g, hd), (b, kvh, g)
    qp = q.permute(1, 0, 2, 3).reshape(1, kvh, b * g, D)                                 # every row's queries at once
    o1, lse1 = attend(qp, PK[None], PV[None], prefix_bias, attn.scaling)                 # the prefix read once
    o1, lse1 = o1.view(kvh, b, g, D).transpose(0, 1), lse1.view(kvh, b, g).transpose(0, 1)
    w = torch.sigmoid(lse2 - lse1)[..., None]
    out = torch.where(has_prefix[:, None, None, None], o1 + (o2 - o1) * w.to(o1.dtype), o2)
    return p.o(out.reshape(b, 1, -1).to(h.dtype))[0]


class Body(NamedTuple):
    """The modules a decode step runs (no reference to the model object: sampler/static.py keys its decoders by it)."""
    embed: torch.nn.Module
    rotary: torch.nn.Module
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    head: torch.nn.Module


def decode_step(body: Body, proj: list[Projections], kv, prefix, st: StepState, b: int):
    """One token for rows [:b]: feed st.tok at st.pos, write its keys/values at column st.col, sample the next token
    into st.tok, st.out_tok[:, t], st.out_lp[:, t], and mark a row done when it is end-of-turn. kv: per layer the
    rows' (K, V), each (b, kv_heads, S, hd); prefix: per layer (PK, PV), each (kv_heads, P, hd). Every shape is
    fixed by b (the Layout fixes S and P for the run) and nothing reads a value back to the host: one CUDA graph."""
    tok, pos = st.tok[:b], st.pos[:b]
    S, P = kv[0][0].shape[2], prefix[0][0].shape[1]
    x = body.embed(tok)[:, None]                                    # (b, 1, hidden)
    cos, sin = body.rotary(x, pos[:, None])                         # (b, 1, hd) each
    kvh, g, dtype = kv[0][0].shape[1], body.layers[0].self_attn.num_key_value_groups, kv[0][0].dtype
    cols = torch.arange(S, device=tok.device)
    seen = (cols >= st.start[:b, None]) & (cols <= st.col)          # (b, S): the row's own keys up to the new one
    own_bias = torch.zeros(b, 1, 1, S, dtype=dtype, device=tok.device).masked_fill_(~seen[:, None, None], float("-inf"))
    prefix_bias = st.prefix_bias[:b, None, :P].expand(b, g, P).reshape(1, 1, b * g, P).to(dtype)   # as the queries
    if tok.device.type == "cuda":           # the memory-efficient kernel takes a bias of the scores' own shape
        own_bias, prefix_bias = own_bias.expand(b, kvh, g, S).contiguous(), prefix_bias.expand(1, kvh, b * g, P).contiguous()
    has_prefix = st.has_prefix[:b]
    for layer, p, layer_kv, layer_prefix in zip(body.layers, proj, kv, prefix):
        x = x + attention(layer.self_attn, p, layer.input_layernorm(x), cos, sin, layer_kv, layer_prefix, own_bias,
                          prefix_bias, has_prefix, st.col)
        gate, up = p.gate_up(layer.post_attention_layernorm(x))
        x = x + p.down(layer.mlp.act_fn(gate) * up)[0]
    logits = body.head(body.norm(x))[:, 0].float()                  # (b, V)
    new, lp = sample_next(logits, st.temp, st.greedy, st.u[:b].index_select(1, st.t)[:, 0])
    st.out_tok[:b].index_copy_(1, st.t, new[:, None])
    st.out_lp[:b].index_copy_(1, st.t, lp[:, None])
    st.done[:b].logical_or_(new == st.eot)
    tok.copy_(new)
    pos.add_(1)
    st.col.add_(1)
    st.t.add_(1)


# ----------------------------------------------------------------------------- the decoder

def unsupported(model) -> str | None:
    """Why the static step cannot decode this model (None: it can): it is written for Llama and Qwen3 layers, with
    the rotary embedding of a fixed table (a dynamic one would read the positions back) and no sliding window."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if config.model_type not in ("llama", "qwen3"):
        return f"the static decode step is written for Llama and Qwen3, not {config.model_type}"
    if rope.get("rope_type") in ("dynamic", "longrope") or getattr(config, "use_sliding_window", False):
        return "the static decode step has no dynamic rotary scaling or sliding window"
    return None


_decoders = weakref.WeakKeyDictionary()          # model -> its StaticDecoder: one copy and one buffer, however many
                                                 # agents


def static_decoder(model, weights: str = "auto", kv_budget: int | None = None, reserve: int = 0) -> "StaticDecoder":
    """The model's StaticDecoder with these sampling weights (auto: choose_weights), made once and shared by every
    agent of the model (rl.py's sampler and its held-out one), so the bf16 copy and the buffers exist once."""
    if weights not in WEIGHTS:
        raise ValueError(f"sample_weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "auto":
        weights = choose_weights(model, kv_budget, reserve)
    decoder = _decoders.get(model)
    if decoder is None or decoder.weights != weights:
        _decoders.pop(model, None)
        decoder = None                           # the other mode's copy and buffers go before this one's are made
        decoder = _decoders[model] = StaticDecoder(model, weights)
    return decoder


class StaticDecoder:
    """decode_step over one model, the run's buffers (a Layout) and a CUDA graph a rows bucket. prepare() sizes the
    buffers before a round; sample() does ModelAgent._sample's job. weights: "bf16" | "nf4" (the module's docstring)."""

    def __init__(self, model, weights: str):
        if unsupported(model):
            raise NotImplementedError(f"{unsupported(model)}: use ModelAgent(decode='eager')")
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.weights, self.device = weights, model.device
        self.body = Body(lm.model.embed_tokens, lm.model.rotary_emb, lm.model.layers, lm.model.norm, lm.lm_head)
        dtype = self.dtype = lm.get_input_embeddings().weight.dtype      # the compute dtype: the keys/values'
        config = lm.config
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.proj = [Projections(*(Merged(group, dtype) if weights == "bf16" else BaseAndLoRA(group)
                                   for group in layer_groups(layer))) for layer in lm.model.layers]
        self.lora = [m for layer in lm.model.layers for group in layer_groups(layer) for m in group
                     if hasattr(m, "lora_A")]
        self.params = [p for layer in lm.model.layers for group in layer_groups(layer) for m in group
                       for p in m.parameters()]
        self.signature = self._signature()
        self.layout = self.kv = self.prefix = self.state = None     # the buffers, made by prepare()
        self.graphs, self.pool = {}, None
        self.graph_keys = []                           # every graph captured (on CPU: that would have been), in order
        self.captures, self.capture_s = 0, 0.0         # CUDA graphs captured and the seconds it took (the GPU check)
        self.graph_error = None                        # why a capture failed: the step then runs without graphs

    # -- the weights follow the model's
    def _signature(self):
        """(the projections' parameter versions: an optimizer step bumps them; each LoRA layer's adapter state)."""
        return (sum(p._version for p in self.params),
                tuple((m.disable_adapters, m.merged, tuple(m.active_adapters)) for m in self.lora))

    def begin_round(self):
        """Before a round: the sampling weights rewritten in place if the model's changed (an optimizer step, another
        adapter made active): the captured graphs read them by address, so they stay."""
        signature = self._signature()
        if signature != self.signature:
            for layer in self.proj:
                for group in layer:
                    group.refresh()
        self.signature = signature

    def held_bytes(self) -> int:
        """The buffers this decoder holds and reuses (not bf16's copy)."""
        return sum(t.numel() * t.element_size() for t in [self.kv, self.prefix] if t is not None)

    # -- the buffers and graphs, once for the run
    def prepare(self, want: Layout):
        """Make the buffers hold `want`: nothing if they do, else they are made anew, at least as large as before in
        every way, and every rows bucket's step captured. Called before a round's prefill, so no row is in the
        buffer while the graphs' warm-up steps write to it."""
        old = self.layout
        if old is not None and old.holds(want):
            return
        if old is not None:
            want = Layout(*(max(a, b) for a, b in zip(old, want)))
        self.layout = self.kv = self.prefix = self.state = None    # the old buffers go before the new are made
        self._drop_graphs()
        layers, kvh, hd, like = len(self.proj), self.kv_heads, self.head_dim, dict(dtype=self.dtype, device=self.device)
        # zeros: padding is masked, but 0 * NaN would still be NaN
        self.kv = torch.zeros(2, layers, want.tokens * kvh * hd, **like)
        self.prefix = torch.zeros(2, layers, kvh, want.prefix, hd, **like)
        self.state = StepState(want.rows, want.prefix, want.room, self.device)
        self.layout = want
        for b in rows_buckets(want.rows):             # largest first: the smaller graphs reuse the pool's memory
            self._capture(b)

    def views(self, b: int) -> tuple[list, list]:
        """Rows bucket b's view of the buffers: per layer the rows' (K, V), each (b, kv_heads, cols(b), hd), and the
        prefixes' (PK, PV), each (kv_heads, P, hd)."""
        S, kvh, hd = self.layout.cols(b), self.prefix.shape[2], self.prefix.shape[4]
        own = self.kv[..., :b * kvh * S * hd].view(2, len(self.proj), b, kvh, S, hd)
        return ([(own[0, i], own[1, i]) for i in range(len(self.proj))],
                [(self.prefix[0, i], self.prefix[1, i]) for i in range(len(self.proj))])

    def wave_buffers(self, rows: int, like: torch.Tensor, L: int, room: int) -> list[KVBuffer]:
        """The wave's decode cache, per layer a KVBuffer over rows bucket rows_bucket(rows)'s view of the buffer (the
        rows past `rows` are padding), each row's own part left-padded to L, then room."""
        b = rows_bucket(rows)
        kv, _ = self.views(b)
        return [KVBuffer(b, like, L, k.shape[2] - L, storage=(k, v)) for k, v in kv]

    def _load_prefixes(self, prefixes: dict, gid: list[int]) -> dict:
        """Every group's shared prefix one after another into self.prefix -> {group: its first column}."""
        offset, first = 0, {}
        for g in [g for g in dict.fromkeys(gid) if prefixes[g] is not None]:
            P = prefixes[g][0][0].shape[2]
            for i, (k, v) in enumerate(prefixes[g]):
                self.prefix[0, i, :, offset:offset + P], self.prefix[1, i, :, offset:offset + P] = k[0], v[0]
            first[g], offset = offset, offset + P
        return first

    # -- the step, eager or replayed
    def _drop_graphs(self):
        """The graphs read the buffers by address: new buffers make them stale. Their memory pool goes with them."""
        self.graphs, self.pool = {}, None

    def _step(self, b: int):
        if b in self.graphs:
            self.graphs[b].replay()
        else:                                          # CPU, or a capture that failed
            decode_step(self.body, self.proj, *self.views(b), self.state, b)

    def _capture(self, b: int):
        """Capture rows bucket b's step as a CUDA graph (CPU: only recorded in graph_keys). A warm-up run on a side
        stream first (lazy initialisation must not happen inside a capture), the state put back after it. All graphs
        share one memory pool: the step's results go to the decoder's own tensors, so no graph holds pool memory once
        its replay ends. A capture that fails is said once, and the step runs without graphs."""
        self.graph_keys.append(b)
        if self.device.type != "cuda" or self.graph_error:
            return
        t0 = time.perf_counter()
        run = lambda: decode_step(self.body, self.proj, *self.views(b), self.state, b)   # noqa: E731
        try:
            saved = [x.clone() for x in self.state.tensors()]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                run()
                for x, y in zip(self.state.tensors(), saved):
                    x.copy_(y)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                run()
        except RuntimeError as e:
            self.graph_error = f"{type(e).__name__}: {str(e)[:300]}"
            self._drop_graphs()
            print(f"sampler/static.py: capturing the decode step as a CUDA graph failed ({self.graph_error}); "
                  "decoding without graphs", file=sys.stderr, flush=True)
            return
        self.pool = self.pool or graph.pool()
        self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.captures, self.capture_s = self.captures + 1, self.capture_s + time.perf_counter() - t0

    # -- a wave
    @torch.no_grad()
    def sample(self, rows, P, gid, cache, prefixes, logits, uniforms, *, remember: bool, T: float, eot: int,
               room: int):
        """ModelAgent._sample with the static step: decode the wave's rows (cache: wave_buffers' KVBuffers, own
        parts left-padded to L; prefixes: {group: per layer (k, v) (1, kv_heads, P, hd), or None}; logits (B, V) of
        each row's last token; uniforms (B, room): each row's for this turn) until each samples end-of-turn or
        `room` tokens. -> ([(new ids, log-probs)] per row,
        if remember, memo entries: each row's ids + sampled tokens but the last, with their keys/values)."""
        B, dev, st = len(rows), logits.device, self.state
        layer0 = cache.layers[0]
        Bb, L = layer0.k.shape[0], layer0.n
        first = self._load_prefixes(prefixes, gid)
        own_len = [len(r) - p for r, p in zip(rows, P)]
        st.sample_at(T, eot)
        st.u[:B] = uniforms.to(dev)                              # copied in before the graphs run, never read back
        tok, lp = sample_next(logits, st.temp, st.greedy, st.u[:B, 0])   # the first token, from the prefill's logits
        st.tok[:Bb], st.done[:Bb] = eot, True                    # padding rows: done from the start
        st.tok[:B], st.done[:B] = tok, tok == eot
        st.pos[:B] = torch.tensor([len(r) for r in rows], device=dev)
        st.start[:Bb] = L
        st.start[:B] = torch.tensor([L - n for n in own_len], device=dev)
        st.prefix_bias.fill_(float("-inf"))
        st.has_prefix.fill_(False)
        for i, g in enumerate(gid):
            if prefixes[g] is not None:
                st.prefix_bias[i, first[g]:first[g] + prefixes[g][0][0].shape[2]] = 0
                st.has_prefix[i] = True
        st.out_tok[:B, 0], st.out_lp[:B, 0] = tok, lp
        st.col.fill_(L)
        st.t.fill_(1)
        slots: list = list(range(B)) + [None] * (Bb - B)         # slot j holds row slots[j]; None: done or padding
        b, outs, memo = Bb, [None] * B, [None] * B
        kv = self.views(b)[0]

        def collect(js, n):                                      # rows in slots js are done, n tokens sampled so far
            if not js:
                return
            toks, lps = st.out_tok[:b, :n].tolist(), st.out_lp[:b, :n].tolist()
            for j in js:
                i, new = slots[j], toks[j]
                end = new.index(eot) + 1 if eot in new else n
                outs[i] = (new[:end], lps[j][:end])
                if remember:                                     # its KV: row + sampled tokens but the last
                    own = slice(L - own_len[i], L + end - 1)
                    memo[i] = (torch.cat([rows[i], torch.tensor(new[:end - 1], dtype=torch.long)]),
                               [([shared] if shared else []) + [(k[j:j + 1, :, own].clone(),
                                                                 v[j:j + 1, :, own].clone())]
                                for shared, (k, v) in zip(prefixes[gid[i]] or [None] * len(kv), kv)])
                slots[j] = None
        for s in range(1, room):
            if s % CHECK_EVERY == 0:                             # the host's look at the stop flags
                done = st.done[:b].tolist()
                collect([j for j in range(b) if done[j] and slots[j] is not None], s)
                live = [j for j in range(b) if slots[j] is not None]
                if not live:
                    break
                if rows_bucket(len(live)) < b:                   # move the live rows to the front, a smaller bucket
                    b, kv = self._compact(kv, live, rows_bucket(len(live)))
                    slots = [slots[j] for j in live] + [None] * (b - len(live))
            self._step(b)
        else:
            s = room
        collect([j for j in range(b) if slots[j] is not None], s)
        return list(outs), memo if remember else []

    def _compact(self, kv, live: list[int], b: int):
        """Rows `live` (ascending) of the current bucket's view kv to slots 0.. of bucket b's view, whose rows are
        longer and laid out anew in the same storage: one layer's live rows through a temporary at a time. The slots
        after them up to b become padding. -> (b, bucket b's view of the rows' keys/values)."""
        st, idx = self.state, torch.tensor(live, device=self.device)
        n, S = len(live), kv[0][0].shape[2]
        new = self.views(b)[0]
        for (k, v), (k2, v2) in zip(kv, new):
            moved_k, moved_v = k[idx], v[idx]                    # (n, kv_heads, S, hd): copies, before any write
            k2[:n, :, :S], v2[:n, :, :S] = moved_k, moved_v
        for x in (st.tok, st.pos, st.start, st.done, st.prefix_bias, st.has_prefix, st.out_tok, st.out_lp, st.u):
            x[:n] = x[idx]
        st.done[n:b] = True
        return b, new
