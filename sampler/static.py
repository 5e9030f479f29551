"""sampler/static.py: a decode step whose shapes are fixed and which never asks the host, so that on a GPU it is one
CUDA graph a token. The same tokens as sampler/plain.py (tests/test_static_decode.py); sampler.ModelAgent decodes
with it on CUDA (decode="static"), and its prefill stays eager and chunked (sampler/fast.py).

Why. The eager decode step of the 8B NF4 sampler launched ~1,000 kernels from Python and asked the host which rows
had finished after every token: 72% of a 64-row round had no kernel running, the 4-bit matmuls took 4%
(docs/gpu.md). Here
  - every row's keys/values sit in one preallocated buffer, the wave's rows bucket x its length bucket, left-padded
    as sampler.attention.KVBuffer and reused from wave to wave; the shared system prompts' keys/values sit in
    another, read once a step for all rows;
  - the token each row feeds, its position, the column it is written to, the stop flags, and the sampled tokens
    with their log-probs are device tensors (StepState) that the step updates in place;
  - sampling is on the device: a draw from softmax(logits / T) by the Gumbel-max trick (the argmax of log p plus
    Gumbel noise -log E, E ~ Exp(1), is a draw from p), the argmax at T = 0, and the drawn token's log-prob;
  - decode_step calls no .item(), .tolist(), .cpu(), nonzero or boolean index (tests/test_static_decode.py fails
    if one is added), so on CUDA it is captured once per (rows bucket, length bucket, prefix bucket, T) as a CUDA
    graph and replayed. On CPU it runs eagerly, the same code.
The host looks at the stop flags once every CHECK_EVERY steps: it ends the wave when every row is done, and moves
the live rows to the front of a smaller rows bucket when they fit one.

decode_step is a Llama / Qwen3 decoder layer written out over the model's own modules: RMSNorm, the q/k/v
projections, Qwen3's per-head q/k RMSNorm, rotary, attention over [shared prefix ; own keys], o, RMSNorm, the SwiGLU
MLP; then the final norm and lm_head.

Sampling weights (sample_weights; the seven projections of each layer, the rest is the model's own):
  bf16  a dense copy of each projection in the compute dtype (bf16 on a GPU) with the LoRA delta merged,
        W + s B A summed in fp32 and rounded once: exact up to one rounding. W is the weight the model multiplies
        by (bitsandbytes' NF4 dequantized as its forward does), so no second copy of the base is kept: each refresh
        dequantizes it again, in place, once a round at most (when an optimizer step changed the weights). One
        matmul a projection; 2 bytes a weight more (Qwen3-8B: 12.9 GiB).
  nf4   the model's own projection modules, bitsandbytes NF4 with --load-in-4bit and peft's LoRA unmerged (its two
        small matmuls inside the graph): no copy, the fit for a 24 GiB card.
  auto  bf16 where the copy, the update's reserve and the KV budget fit the free memory, else nf4 (choose_weights).
"""
import math
import sys
import time
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from sampler.attention import KVBuffer

CHECK_EVERY = 16            # decode steps between two looks of the host at the stop flags
ROWS_STEP, COLS_STEP = 8, 128   # rows buckets: 1, 2, 4, then multiples of 8; length buckets: multiples of 128
BUFFER_STEP = 1.25          # the keys/values buffer comes in sizes 1.25x apart, so that nearby waves share one
MIN_KV_BF16 = 8 * 2**30     # auto with an automatic KV budget: bf16 only if it leaves this much for keys/values
WEIGHTS = ("auto", "bf16", "nf4")


def rows_bucket(n: int) -> int:
    return n if n <= 2 else 4 if n <= 4 else -(-n // ROWS_STEP) * ROWS_STEP


def cols_bucket(n: int) -> int:
    return -(-n // COLS_STEP) * COLS_STEP


def buffer_tokens(tokens: int) -> int:
    """The size of keys/values buffer that holds `tokens` (rows x columns): 1024 x BUFFER_STEP^k tokens."""
    k = math.ceil(math.log(max(tokens, 1024) / 1024, BUFFER_STEP) - 1e-9)
    return math.ceil(1024 * BUFFER_STEP ** k)


def free_memory(device) -> int:
    """Bytes a CUDA device can still give: what the driver has free, plus what torch holds unused."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


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


class MergedLinear:
    """bf16 mode's projection: y = x W^T + bias with one dense weight in the compute dtype, the active LoRA adapters'
    deltas merged in. refresh() rewrites W in place, so captured graphs read the new weights."""

    def __init__(self, module, dtype: torch.dtype):
        base = base_of(module)
        if getattr(module, "lora_variant", None):
            raise NotImplementedError("sample_weights='bf16' merges plain LoRA only (no DoRA or other variants)")
        self.module, self.bias = module, None if base.bias is None else base.bias.detach().to(dtype)
        self.weight = torch.empty(base.out_features, base.in_features, dtype=dtype, device=base.weight.device)
        self.refresh()

    def refresh(self):
        """W + sum of s B A over the active adapters, summed in fp32, rounded once into the copy."""
        m = self.module
        w = dense_weight(base_of(m)).float()
        if hasattr(m, "lora_A") and not m.disable_adapters and not m.merged:    # merged: already in the base
            for name in m.active_adapters:
                if name in m.lora_A:
                    w = w + m.scaling[name] * (m.lora_B[name].weight.float() @ m.lora_A[name].weight.float())
        self.weight.copy_(w)

    def __call__(self, x):
        return F.linear(x, self.weight, self.bias)


class Projections(NamedTuple):
    """One layer's seven projections as the step calls them: modules (nf4) or MergedLinear (bf16)."""
    q: Callable
    k: Callable
    v: Callable
    o: Callable
    gate: Callable
    up: Callable
    down: Callable


def layer_modules(layer) -> tuple:
    a, m = layer.self_attn, layer.mlp
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj


def copy_bytes(model) -> int:
    """What bf16 mode's copy takes: every projection's out x in weights in the compute dtype."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    size = lm.get_input_embeddings().weight.element_size()
    return sum(base_of(m).out_features * base_of(m).in_features * size
               for layer in lm.model.layers for m in layer_modules(layer))


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
    """The decode step's device tensors for at most `rows` rows, a shared prefix of at most `prefix` columns and
    `room` sampled tokens; the step updates them in place, so a replayed graph carries on from where it stopped.
      tok (rows,)            the token each row feeds next; after a step, the one it sampled
      pos (rows,)            that token's position
      start (rows,)          the first column of the row's own keys (own parts are left-padded to the wave's L)
      done (rows,) bool      sampled end-of-turn (or a padding row)
      prefix_bias (rows, P)  0 where a row sees a shared-prefix key (its group's), -inf elsewhere
      out_tok, out_lp (rows, room)   the sampled tokens and their log-probs, token t in column t
      col (1,)               the column the fed token's keys/values go to: L + t - 1
      t (1,)                 the index of the token the step samples"""
    NAMES = ("tok", "pos", "start", "done", "prefix_bias", "out_tok", "out_lp", "col", "t")

    def __init__(self, rows: int, prefix: int, room: int, device):
        long = dict(dtype=torch.long, device=device)
        self.tok, self.pos, self.start = (torch.zeros(rows, **long) for _ in range(3))
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.prefix_bias = torch.full((rows, prefix), float("-inf"), device=device)
        self.out_tok, self.out_lp = torch.zeros(rows, room, **long), torch.zeros(rows, room, device=device)
        self.col, self.t = torch.zeros(1, **long), torch.zeros(1, **long)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.NAMES]


def sample_tokens(logits: torch.Tensor, T: float):
    """logits (b, V) fp32 -> (tokens (b,), their log-probs under softmax(logits / T)), T = 0 greedy, all on the
    device. A draw: argmax(log p - log E), E ~ Exp(1) (Gumbel-max; torch's exponential_ never returns 0)."""
    logp = torch.log_softmax(logits / (T or 1.0), -1)
    tok = logits.argmax(-1) if T == 0 else (logp - torch.empty_like(logp).exponential_().log()).argmax(-1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def rotate(x, cos, sin):
    """Rotary position embedding of x (b, heads, 1, hd) with cos, sin (b, 1, hd), as HF's apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


def attention(attn, p: Projections, h, cos, sin, kv, prefix, own_bias, prefix_bias, col):
    """One layer's attention for one new token a row. h (b, 1, hidden); kv: the rows' own (K, V), each
    (b, kv_heads, S, hd), the new token's keys/values written at column col; prefix: (PK, PV) each (kv_heads, Pb, hd),
    every group's shared prefix one after another; own_bias (b, S), prefix_bias (b, Pb): 0 where a key is seen,
    -inf where not. Scores against both are concatenated before one softmax: attention over [prefix ; own].
    -> (b, 1, hidden) after o_proj."""
    (K, V), (PK, PV) = kv, prefix
    b, D, kvh = h.shape[0], attn.head_dim, K.shape[1]
    q = p.q(h).view(b, 1, -1, D)
    k = p.k(h).view(b, 1, kvh, D)
    if hasattr(attn, "q_norm"):                     # Qwen3: RMSNorm over each head's q and k
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)   # (b, heads / kv_heads, 1, hd)
    K.index_copy_(2, col, k)
    V.index_copy_(2, col, p.v(h).view(b, 1, kvh, D).transpose(1, 2))
    g = q.shape[1] // kvh
    q = q.reshape(b, kvh, g, D)                      # query heads grouped by the kv head they share
    s_own = q @ K.transpose(2, 3)                    # (b, kvh, g, S)
    qk = q.permute(1, 0, 2, 3).reshape(kvh, b * g, D)
    s_prefix = (qk @ PK.transpose(1, 2)).view(kvh, b, g, -1).permute(1, 0, 2, 3)    # (b, kvh, g, Pb): PK read once
    scores = torch.cat([s_prefix.float() + prefix_bias[:, None, None], s_own.float() + own_bias[:, None, None]], -1)
    w = torch.softmax(scores * attn.scaling, -1).to(V.dtype)
    Pb = PK.shape[1]
    w_prefix = w[..., :Pb].permute(1, 0, 2, 3).reshape(kvh, b * g, Pb)
    out = (w_prefix @ PV).view(kvh, b, g, D).permute(1, 0, 2, 3) + w[..., Pb:] @ V     # (b, kvh, g, hd)
    return p.o(out.reshape(b, 1, -1))


class Body(NamedTuple):
    """The modules a decode step runs (no reference to the model object: sampler/static.py keys its decoders by it)."""
    embed: torch.nn.Module
    rotary: torch.nn.Module
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    head: torch.nn.Module


def decode_step(body: Body, proj: list[Projections], kv, prefix, st: StepState, b: int, T: float, eot: int):
    """One token for rows [:b]: feed st.tok at st.pos, write its keys/values at column st.col, sample the next token
    into st.tok, st.out_tok[:, t], st.out_lp[:, t], and mark a row done when it is end-of-turn. kv: per layer the
    rows' (K, V), each (b, kv_heads, S, hd); prefix: per layer (PK, PV), each (kv_heads, Pb, hd). Every shape is
    fixed by (b, S, Pb) and nothing reads a value back to the host: one CUDA graph."""
    tok, pos = st.tok[:b], st.pos[:b]
    S = kv[0][0].shape[2]
    x = body.embed(tok)[:, None]                                    # (b, 1, hidden)
    cos, sin = body.rotary(x, pos[:, None])                         # (b, 1, hd) each
    cols = torch.arange(S, device=tok.device)
    seen = (cols >= st.start[:b, None]) & (cols <= st.col)          # (b, S): the row's own keys up to the new one
    own_bias = torch.zeros(b, S, device=tok.device).masked_fill_(~seen, float("-inf"))
    prefix_bias = st.prefix_bias[:b, :prefix[0][0].shape[1]]
    for layer, p, layer_kv, layer_prefix in zip(body.layers, proj, kv, prefix):
        x = x + attention(layer.self_attn, p, layer.input_layernorm(x), cos, sin, layer_kv, layer_prefix, own_bias,
                          prefix_bias, st.col)
        h = layer.post_attention_layernorm(x)
        x = x + p.down(layer.mlp.act_fn(p.gate(h)) * p.up(h))
    logits = body.head(body.norm(x))[:, 0].float()                  # (b, V)
    new, lp = sample_tokens(logits, T)
    st.out_tok[:b].index_copy_(1, st.t, new[:, None])
    st.out_lp[:b].index_copy_(1, st.t, lp[:, None])
    st.done[:b].logical_or_(new == eot)
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
    agent of the model (rl.py's sampler and its held-out one), so the bf16 copy exists once."""
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
    """decode_step over one model, its buffers and its CUDA graphs. sample() does ModelAgent._sample's job.
    weights: "bf16" | "nf4" (see the module's docstring)."""

    def __init__(self, model, weights: str):
        if unsupported(model):
            raise NotImplementedError(f"{unsupported(model)}: use ModelAgent(decode='eager')")
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.weights, self.device = weights, model.device
        self.body = Body(lm.model.embed_tokens, lm.model.rotary_emb, lm.model.layers, lm.model.norm, lm.lm_head)
        dtype = lm.get_input_embeddings().weight.dtype
        self.proj = [Projections(*(MergedLinear(m, dtype) if weights == "bf16" else m for m in layer_modules(layer)))
                     for layer in lm.model.layers]
        self.lora = [m for layer in lm.model.layers for m in layer_modules(layer) if hasattr(m, "lora_A")]
        self.params = [p for layer in self.proj for m in layer for p in
                       (m.module if isinstance(m, MergedLinear) else m).parameters()]
        self.signature = self._signature()
        self.kv = self.prefix = self.state = None       # the buffers, made by the first wave
        self.graphs, self.pool = {}, None
        self.new_round = True
        self.captures, self.capture_s = 0, 0.0        # CUDA graphs captured and the seconds it took (the GPU check)
        self.graph_error = None                        # why a capture failed: the step then runs without graphs

    # -- the weights follow the model's
    def _signature(self):
        """(the projections' parameter versions: an optimizer step bumps them; each LoRA layer's adapter state and
        parameter addresses: what a captured peft forward read)."""
        return (sum(p._version for p in self.params),
                tuple((m.disable_adapters, m.merged, tuple(m.active_adapters),
                       tuple(p.data_ptr() for p in m.parameters())) for m in self.lora))

    def begin_round(self):
        """Before a round: bf16's copy rewritten if the weights changed; nf4's graphs dropped if an adapter was
        switched (the captured peft forward took the branch of the old state)."""
        self.new_round = True
        signature = self._signature()
        if signature == self.signature:
            return
        if self.weights == "bf16":
            for layer in self.proj:
                for m in layer:
                    m.refresh()
        elif signature[1] != self.signature[1]:
            self._drop_graphs()
        self.signature = signature

    def held_bytes(self) -> int:
        """The buffers this decoder holds and reuses (not bf16's copy)."""
        return sum(t.numel() * t.element_size() for t in [self.kv, self.prefix] if t is not None)

    def decode_tokens(self, rows: int, n: int) -> int:
        """The buffer a wave of `rows` rows of n tokens (own part + room) takes, in tokens: plan_waves' decode."""
        return buffer_tokens(rows_bucket(rows) * cols_bucket(n))

    def prefix_tokens(self, prefix: int) -> int:
        """The shared prefixes' copy the step reads (once a step for all rows), in tokens."""
        return max(cols_bucket(max(prefix, 1)), 0 if self.prefix is None else self.prefix.shape[-2])

    # -- buffers
    def wave_buffers(self, rows: int, like: torch.Tensor, L: int, room: int) -> list[KVBuffer]:
        """The wave's decode cache, per layer a KVBuffer over one buffer kept from wave to wave:
        rows_bucket(rows) rows (the ones past `rows` are padding) of cols_bucket(L + room) columns. The buffer is
        sized by the round's first wave and grows for a larger one (as plan_waves counts it); a new one drops the
        graphs, which read the old."""
        b, S, layers, kvh, hd = rows_bucket(rows), cols_bucket(L + room), len(self.proj), like.shape[1], like.shape[3]
        need = self.decode_tokens(rows, L + room) * kvh * hd
        if self.kv is None or need > self.kv.shape[-1] or (self.new_round and need != self.kv.shape[-1]):
            self.kv = None                             # the old buffer goes before the new one is made
            self._drop_graphs()
            self.kv = like.new_zeros(2, layers, need)  # zeros: padding is masked, but 0 * NaN would still be NaN
        self.new_round = False
        view = self.kv[..., :b * kvh * S * hd].view(2, layers, b, kvh, S, hd)
        return [KVBuffer(b, like, L, S - L, storage=(view[0, i], view[1, i])) for i in range(layers)]

    def _load_prefixes(self, prefixes: dict, gid: list[int], like: torch.Tensor) -> tuple[int, dict]:
        """Every group's shared prefix one after another into self.prefix (2, layers, kv_heads, cap, hd) ->
        (Pb, {group: its first column})."""
        groups = [g for g in dict.fromkeys(gid) if prefixes[g] is not None]
        total = sum(prefixes[g][0][0].shape[2] for g in groups)
        Pb = cols_bucket(max(total, 1))
        if self.prefix is None or self.prefix.shape[-2] < Pb:
            self.prefix, self.state = None, None
            self._drop_graphs()
            self.prefix = like.new_zeros(2, len(self.proj), like.shape[1], Pb, like.shape[3])
        offset, first = 0, {}
        for g in groups:
            P = prefixes[g][0][0].shape[2]
            for i, (k, v) in enumerate(prefixes[g]):
                self.prefix[0, i, :, offset:offset + P], self.prefix[1, i, :, offset:offset + P] = k[0], v[0]
            first[g], offset = offset, offset + P
        return Pb, first

    def _state(self, rows: int, room: int) -> StepState:
        st = self.state
        if st is None or st.tok.shape[0] < rows or st.out_tok.shape[1] < room:
            self.state = None
            self._drop_graphs()
            self.state = StepState(max(rows, 0 if st is None else st.tok.shape[0]), self.prefix.shape[-2],
                                   max(room, 0 if st is None else st.out_tok.shape[1]), self.device)
        return self.state

    # -- the step, eager or replayed
    def _drop_graphs(self):
        """The graphs read the buffers by address: a new buffer, or a peft forward captured in another adapter state,
        makes them stale. Their memory pool goes with them."""
        self.graphs, self.pool = {}, None

    def _step(self, views, b: int, T: float, eot: int):
        kv, prefix = views
        run = lambda: decode_step(self.body, self.proj, kv, prefix, self.state, b, T, eot)   # noqa: E731
        if self.device.type != "cuda" or self.graph_error:
            return run()
        key = (b, kv[0][0].shape[2], prefix[0][0].shape[1], T, eot)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(key, run)
            except RuntimeError as e:    # the capture failed: go on without graphs (a failing step raises again)
                self.graph_error = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"sampler/static.py: capturing the decode step as a CUDA graph failed ({self.graph_error}); "
                      "decoding without graphs", file=sys.stderr, flush=True)
                return run()
        graph.replay()

    def _capture(self, key, run):
        """Capture one step as a CUDA graph. A warm-up run on a side stream first (lazy initialisation must not
        happen inside a capture), the state put back after it. All graphs share one memory pool: the step's results
        go to the decoder's own tensors, so no graph holds pool memory once its replay ends."""
        t0 = time.perf_counter()
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
        self.pool = self.pool or graph.pool()
        self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        self.captures, self.capture_s = self.captures + 1, self.capture_s + time.perf_counter() - t0
        return graph

    # -- a wave
    @torch.no_grad()
    def sample(self, rows, P, gid, cache, prefixes, logits, remember: bool, T: float, eot: int, room: int):
        """ModelAgent._sample with the static step: decode the wave's rows (cache: wave_buffers' KVBuffers, own
        parts left-padded to L; prefixes: {group: per layer (k, v) (1, kv_heads, P, hd), or None}; logits (B, V) of
        each row's last token) until each samples end-of-turn or `room` tokens. -> ([(new ids, log-probs)] per row,
        if remember, memo entries: each row's ids + sampled tokens but the last, with their keys/values)."""
        B, dev = len(rows), logits.device
        layer0 = cache.layers[0]
        Bb, S, L = layer0.k.shape[0], layer0.k.shape[2], layer0.n
        Pb, first = self._load_prefixes(prefixes, gid, layer0.k)
        st = self._state(Bb, room)
        own_len = [len(r) - p for r, p in zip(rows, P)]
        tok, lp = sample_tokens(logits, T)                       # the first token, from the prefill's logits
        st.tok[:Bb], st.done[:Bb] = eot, True                    # padding rows: done from the start
        st.tok[:B], st.done[:B] = tok, tok == eot
        st.pos[:B] = torch.tensor([len(r) for r in rows], device=dev)
        st.start[:Bb] = L
        st.start[:B] = torch.tensor([L - n for n in own_len], device=dev)
        st.prefix_bias.fill_(float("-inf"))
        for i, g in enumerate(gid):
            if prefixes[g] is not None:
                st.prefix_bias[i, first[g]:first[g] + prefixes[g][0][0].shape[2]] = 0
        st.out_tok[:B, 0], st.out_lp[:B, 0] = tok, lp
        st.col.fill_(L)
        st.t.fill_(1)
        kv = [(layer.k, layer.v) for layer in cache.layers]
        pre = [(self.prefix[0, i, :, :Pb], self.prefix[1, i, :, :Pb]) for i in range(len(kv))]

        def views(b):                                            # the first b rows of everything the step reads
            return [(k[:b], v[:b]) for k, v in kv], pre
        slots: list = list(range(B)) + [None] * (Bb - B)         # slot j holds row slots[j]; None: done or padding
        b, outs, memo = Bb, [None] * B, [None] * B

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
        step_views = views(b)
        for s in range(1, room):
            if s % CHECK_EVERY == 0:                             # the host's look at the stop flags
                done = st.done[:b].tolist()
                collect([j for j in range(b) if done[j] and slots[j] is not None], s)
                live = [j for j in range(b) if slots[j] is not None]
                if not live:
                    break
                if rows_bucket(len(live)) < b:                   # move the live rows to the front, a smaller bucket
                    b = self._compact(kv, st, live, rows_bucket(len(live)))
                    slots = [slots[j] for j in live] + [None] * (b - len(live))
                    step_views = views(b)
            self._step(step_views, b, T, eot)
        else:
            s = room
        collect([j for j in range(b) if slots[j] is not None], s)
        return list(outs), memo if remember else []

    def _compact(self, kv, st: StepState, live: list[int], b: int) -> int:
        """Rows `live` (ascending) to slots 0.., one layer at a time (a temporary of one layer's live rows);
        the slots after them up to b become padding. -> b."""
        idx = torch.tensor(live, device=st.tok.device)
        n = len(live)
        for k, v in kv:
            k[:n], v[:n] = k[idx], v[idx]
        for x in (st.tok, st.pos, st.start, st.done, st.prefix_bias, st.out_tok, st.out_lp):
            x[:n] = x[idx]
        st.done[n:b] = True
        return b
