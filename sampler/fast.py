"""sampler/fast.py: the same tokens as sampler/plain.py, faster. The default sampler of rl.py and eval.py.

ModelAgent advances many conversations at once and is tested equal to plain.sample_turn (tests/test_sampler.py):
turns token for token, greedy and at T = 0.7 (each conversation's own stream, plain.sample_next's rule), and
sampled log-probs equal to a teacher-forced recomputation. What it adds:
  - every conversation's keys/values are kept between rounds, so a round prefills only the new turn, and on
    CPU all rows' new turns go through one forward packed end to end, with no padding;
  - the prefix all conversations share (the system prompt) is prefilled once, stored once and attended
    once for all rows (sampler/attention.py);
  - rows decode together in waves that fit a KV budget, so 256 rollouts fit one GPU;
  - on CPU the LoRA delta is merged into the weights while sampling (one matmul per projection);
  - on a GPU a decode step is static, one CUDA graph a token, with no host syncs (sampler/static.py; decode=).

Watch it run, or time it against the plain one: python -m sampler.bench (--bench).
"""
import torch
from transformers.cache_utils import Cache

from rollout import ChatFormat
from sampler.attention import (KVBuffer, attention_implementation, kv_bytes_per_token, lora_merged, plan_waves,
                               prefill_new_turns, sampler_scratch, token_batches, token_slice, wave_scratch,
                               weight_major_linear)
from sampler.plain import sample_next
from sampler.static import Layout, cols_bucket, free_memory, rows_bucket, static_decoder, unsupported


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class ModelAgent:
    """The policy as a sampler: act() advances every waiting conversation by one turn, sampling from
    softmax(logits / T) (no top-k/top-p; T = 0: greedy) by plain.sample_next, each row with the uniforms of its own
    conversation's stream (AgentTurn.rng), and keeping each sampled token's log-prob.

    KV reuse, so a round costs the new tokens only: each conversation's keys/values are remembered
    between rounds (the next round prefills just the user/tool turn appended since), and the prefix all
    conversations share (the ~1.8k-token system prompt) is prefilled once, stored once and, while
    decoding, attended once for all rows (shared_prefix_attention). The memory is dropped when the
    weights change (an optimizer step bumps the parameters' _version counters). On CPU the LoRA delta is
    merged into the weights for each call (sampler.attention.lora_merged; merge_lora=False: not).

    Waves, so 256 rollouts of 8k tokens fit one GPU: rows are decoded in waves whose cache fits
    kv_budget bytes (sampler.attention.plan_waves; None: on CUDA the free memory at the first call minus
    KV_RESERVE for the training step, on CPU no limit). When the rows' keys/values would not fit a
    second time beside the wave (their copies for the next round), they are not kept: only the shared
    prefix is, and next round each row is prefilled again from it. Greedy decoding gives the same turns
    either way (tests/test_rollout.py).

    The decode loop, decode=: "eager" runs the model's forward a token at a time and asks the host which rows
    finished after each (_sample; CPU's default, with merged LoRA and the weight-major layout); "static" runs
    sampler/static.py's step, one CUDA graph a token on a GPU (CUDA's default, for the Llama and Qwen3 layers it is
    written for), with sample_weights "bf16" | "nf4" | "auto" (static.choose_weights). Greedy, the same tokens either
    way (tests/test_static_decode.py); sampled, the static step's log-probs are a teacher-forced pass's (its bf16
    copy of the weights rounds the logits differently, so a sampled token can split where eager would not)."""

    KV_RESERVE = 6 * 2**30      # what the auto budget leaves free on a GPU: the GRPO step's peak beyond the weights

    def __init__(self, model, tokenizer, temperature: float = 1.0, max_new_tokens: int = 256,
                 kv_budget: int | None = None, thinking: bool = False, merge_lora: bool = True, decode: str = "auto",
                 sample_weights: str = "auto", max_context: int | None = None):
        self.model, self.tok, self.fmt = model, tokenizer, ChatFormat(tokenizer, thinking)
        self.merge_lora = merge_lora               # eager: sample with the LoRA delta in the weights (lora_merged)
        if decode not in ("auto", "eager", "static"):
            raise ValueError(f"decode must be 'auto', 'eager' or 'static', got {decode!r}")
        self.decode = decode if decode != "auto" else \
            "static" if model.device.type == "cuda" and not unsupported(model) else "eager"
        self.sample_weights, self.static = sample_weights, None     # static: its StaticDecoder, from the first act()
        self.temperature, self.max_new_tokens, self.kv_budget = temperature, max_new_tokens, kv_budget
        self.max_context = max_context            # the longest conversation the run holds: the static buffer's rows
        self.memo, self.version = [], None    # [(token ids (n,), per layer: consecutive (k, v) pieces)]
        self.waves, self.keeps_rows = [], True   # the last act()'s waves (row indices); were the rows' caches kept

    def forget(self):
        """Drop the remembered keys/values: rl.py calls it before an update, which would make them stale anyway,
        so that every rollout's keys/values do not sit in memory beside the update's activations. A static decoder
        keeps its decode buffer and the graphs that read it: at most the KV budget, which leaves the update its
        reserve (KV_RESERVE)."""
        self.memo, self.version = [], None

    def budget_tokens(self) -> int | None:
        """How many tokens of keys/values the agent may hold at once (None: no limit)."""
        if self.kv_budget is None and self.model.device.type == "cuda":     # once, before any cache exists
            held = self.static.held_bytes() if self.static else 0          # the static buffers are ours to reuse
            self.kv_budget = max(0, free_memory(self.model.device) + held - self.KV_RESERVE)
        if self.kv_budget is None:
            return None
        return self.kv_budget // kv_bytes_per_token(self.model.config, self.model.get_input_embeddings().weight.dtype)

    def _cached(self, ids: torch.Tensor) -> tuple[int, list]:
        """(c, kv): the longest prefix of ids the memo holds, leaving >= 1 token to feed, and its KV."""
        c, kv = max(((min(_common_prefix(m, ids), len(ids) - 1), kv) for m, kv in self.memo),
                    key=lambda x: x[0], default=(0, None))
        return c, [token_slice(pieces, 0, c) for pieces in kv] if c else None

    def _prefill(self, ids: torch.Tensor):
        """Feed ids after their cached prefix (batch 1: no padding). -> (per layer (k, v) of all ids
        as one piece, each (1, kv_heads, n, hd); logits of the last token (V,))."""
        c, kv = self._cached(ids)
        cache = Cache(layers=[KVBuffer(1, pieces[0][0], c, len(ids) - c).put(0, pieces) for pieces in kv]) if c else None
        out = self.model(input_ids=ids[None, c:].to(self.model.device), logits_to_keep=1,
                         past_key_values=cache)                          # positions continue from c
        return [(layer.keys, layer.values) for layer in out.past_key_values.layers], out.logits[0, -1]

    @staticmethod
    def _groups(batch, rows) -> list[tuple[list[int], int]]:
        """Rows grouped by the system prompt they continue (a domain's policy and tools) -> [(row indices,
        P)]: P is the prefix all of the group's rows share, at most each one's length - 1; 0 for a row alone."""
        groups = {}
        for i, turn in enumerate(batch):
            groups.setdefault(turn.messages[0]["content"] if turn.messages else None, []).append(i)
        return [(idx, 0 if len(idx) == 1 else min(min(_common_prefix(rows[idx[0]], rows[i]) for i in idx),
                                                   min(len(rows[i]) for i in idx) - 1)) for idx in groups.values()]

    @torch.no_grad()
    def act(self, batch):
        was_training = self.model.training
        self.model.eval()
        version = sum(p._version for p in self.model.parameters())   # lora_merged writes through .data: no bump
        if version != self.version:
            self.memo, self.version = [], version
        if self.decode == "static":                   # before the budget: bf16's copy is not the sampler's to count
            self.static = static_decoder(self.model, self.sample_weights, self.kv_budget, self.KV_RESERVE)
            self.sample_weights = self.static.weights   # auto is decided once, at the first round
            self.static.begin_round()
        uniforms = torch.stack([torch.rand(self.max_new_tokens, generator=turn.rng, dtype=torch.float64)
                                for turn in batch])   # (B, room): each turn takes all it may use, as sample_turn
        with lora_merged(self.model, self.merge_lora and self.decode == "eager"):
            outs = self._act(batch, [torch.tensor(turn.token_ids) for turn in batch], uniforms)
        self.model.train(was_training)
        return outs

    def _act(self, batch, rows, uniforms):
        groups = self._groups(batch, rows)
        gid, P = [0] * len(rows), [0] * len(rows)
        for g, (idx, p) in enumerate(groups):
            for i in idx:
                gid[i], P[i] = g, p
        own = [len(r) - p for r, p in zip(rows, P)]
        dtype = self.model.get_input_embeddings().weight.dtype         # the budget counts the scratch too, in tokens
        scratch = sampler_scratch(self.model.config, dtype, max(map(len, rows)) + self.max_new_tokens, max(own),
                                  packed=self.model.device.type == "cpu")     # as prefill_new_turns picks
        per_token = kv_bytes_per_token(self.model.config, dtype)
        scratch, budget, prefix = [x / per_token for x in scratch], self.budget_tokens(), sum(p for _, p in groups)
        if self.static:                               # its buffers, made for the run (one copy of the shared prefixes)
            layout = self._static_layout(own, prefix, scratch, budget)
            self.static.prepare(layout)
            scratch[2] += self.static.layout.prefix
            self.waves, self.keeps_rows = plan_waves(own, prefix, self.max_new_tokens, budget, scratch,
                                                     self.static.layout.fits, self.static.layout.tokens)
        else:
            self.waves, self.keeps_rows = plan_waves(own, prefix, self.max_new_tokens, budget, scratch)
        if not self.keeps_rows:                       # keep only the shared prefixes' entries
            self.memo = [m for m in self.memo if len(m[0]) <= max(P)]
        for idx, p in groups:                         # each group's shared prefix: prefilled once, remembered
            if p and any(self._cached(rows[i])[0] < p for i in idx):
                self.memo.append((rows[idx[0]][:p], [[kv] for kv in self._prefill(rows[idx[0]][:p])[0]]))
        outs, memo = [None] * len(rows), {}
        for wave in self.waves:
            wave = sorted(wave, key=lambda i: gid[i])   # a group's rows side by side: its decode rows are a slice
            part = lambda xs: [xs[i] for i in wave]   # noqa: E731
            cache, prefixes, logits = self._prefill_wave(part(rows), part(P), part(gid))
            if self.keeps_rows:                       # (one wave) every row's remembered keys/values are in `cache`
                self.memo = []
            done, kept = self._sample(part(rows), part(P), part(gid), cache, prefixes, logits, uniforms[wave],
                                      remember=self.keeps_rows)
            for i, out in zip(wave, done):
                outs[i] = out
            memo.update(zip(wave, kept))
        if self.keeps_rows:
            self.memo = [memo[i] for i in sorted(memo)]   # in the rows' order: _cached takes the first of equals
        return outs

    def _static_layout(self, own: list[int], prefix: int, scratch: list[float], budget: int | None) -> Layout:
        """The static decoder's buffers for this round, sized for the run: every row up to the run's longest
        conversation (max_context; unknown: twice this round's longest); with no KV budget, this round's rows in one
        wave, the rows times that length of token slots; within a budget, the waves planned as if each had a buffer
        of its own: the largest wave's rows, and as many token slots as the budget leaves beside the largest wave's
        scratch, never fewer than the largest wave needs."""
        room = self.max_new_tokens
        max_cols = cols_bucket(self.max_context or 2 * (max(own) + room))
        prefix_cols = cols_bucket(max(prefix, 1))
        rows = rows_bucket(len(own))
        if budget is None:
            tokens = rows * max_cols
        else:
            with_copy = [scratch[0], scratch[1], scratch[2] + prefix_cols]
            waves, _ = plan_waves(own, prefix, room, budget, with_copy)
            longest = [max(own[i] for i in w) for w in waves]
            rows = max(rows_bucket(len(w)) for w in waves)
            need = max(rows_bucket(len(w)) * cols_bucket(L + room) for w, L in zip(waves, longest))
            spare = budget - max(wave_scratch(len(w), L, prefix, with_copy) for w, L in zip(waves, longest))
            tokens = min(rows * max_cols, max(need, int(spare) // cols_bucket(1) * cols_bucket(1)))
        return Layout(rows=rows, tokens=tokens, max_cols=max(max_cols, cols_bucket(max(own) + room)),
                      prefix=prefix_cols, room=room)

    def _prefill_wave(self, rows: list[torch.Tensor], P: list[int], gid: list[int]):
        """Prefill each row after what the memo holds, straight into a decode cache. Row i continues the
        shared prefix of its group gid[i], P[i] tokens, whose keys/values are kept once per group
        (1, kv_heads, P, hd) per layer; its own part (n_i - P[i] tokens) sits left-padded in a
        (B, L + room) buffer. -> (cache, {group: per-layer prefix (k, v), or None}, last-token logits (B, V)).
        The rows of a group that continue its cached prefix are prefilled together, their new turns in one
        forward (sampler.attention.prefill_new_turns); others (a row alone) one at a time."""
        B, L, room = len(rows), max(len(r) - p for r, p in zip(rows, P)), self.max_new_tokens
        cached = [self._cached(r) for r in rows]
        cache, prefixes, logits = None, {}, [None] * B

        def put(i, layers):                           # row i's own keys/values into the decode buffer
            nonlocal cache
            like = layers[0][0][0]
            cache = cache or Cache(layers=self.static.wave_buffers(B, like, L, room) if self.static else
                                   [KVBuffer(B, like, L, room) for _ in layers])
            for layer, pieces in zip(cache.layers, layers):
                layer.put(i, pieces)
        for g in dict.fromkeys(gid):
            idx, p = [i for i in range(B) if gid[i] == g], P[gid.index(g)]
            if p and all(cached[i][0] >= p for i in idx):     # the usual case: a cached shared prefix
                prefixes[g] = [tuple(torch.cat(x, 2) for x in zip(*token_slice(pieces, 0, p)))
                               for pieces in cached[idx[0]][1]]
                # rows whose new tokens fill one prefill forward: each chunk's keys/values go into the decode
                # buffer before the next chunk's exist
                for batch in token_batches([len(rows[i]) - cached[i][0] for i in idx]):
                    chunk = [idx[k] for k in batch]
                    own, last = prefill_new_turns(self.model, [rows[i] for i in chunk], [cached[i] for i in chunk], p,
                                                  prefixes[g], pad=self.fmt.end_of_turn_id)
                    for i, layers, lg in zip(chunk, own, last):
                        put(i, layers)
                        logits[i] = lg
                    del own, last
                continue
            for i in idx:
                kv, logits[i] = self._prefill(rows[i])
                if p and g not in prefixes:           # a copy, so this row's full keys/values can go
                    prefixes[g] = [(k[:, :, :p].clone(), v[:, :, :p].clone()) for k, v in kv]
                put(i, [[(k[:, :, p:], v[:, :, p:])] for k, v in kv])
        return cache, {g: prefixes.get(g) for g in gid}, torch.stack(logits).float()

    def _sample(self, rows, P, gid, cache, prefixes, logits, uniforms, remember: bool):
        """Decode all rows together until each samples end-of-turn or max_new_tokens. Row i's own part sits
        left-padded in `cache` (the attention mask hides the padding) and it attends its group's shared
        prefix, prefixes[gid[i]] (None: none); positions count the row's own tokens; its token s draws on
        uniforms[i, s]. -> ([(new ids, log-probs)] per row, if remember, memo entries: each row's ids + sampled
        tokens but the last, with their keys/values)."""
        eot, T, dev = self.fmt.end_of_turn_id, self.temperature, self.model.device
        if self.static:
            return self.static.sample(rows, P, gid, cache, prefixes, logits, uniforms, remember=remember, T=T,
                                      eot=eot, room=self.max_new_tokens)
        n, B, room = [len(r) for r in rows], len(rows), self.max_new_tokens
        L = max(a - p for a, p in zip(n, P))
        own_len = torch.tensor([a - p for a, p in zip(n, P)])
        attn = (torch.arange(L + room)[None] >= L - own_len[:, None]).long().to(dev)   # (B, L + room)
        attn[:, L:] = 0                                                     # opened as tokens arrive
        live, group = torch.arange(B), torch.tensor(gid)                    # rows still decoding, their groups
        new, lps, memo = [[] for _ in rows], [[] for _ in rows], [None] * B

        def rows_of(g):                       # a group's live rows: side by side (_act sorts a wave by group), so a
            at = (group == g).nonzero()[:, 0]     # slice, which indexes their keys/values as a view, not a copy
            return slice(int(at[0]), int(at[-1]) + 1)
        with attention_implementation(self.model, "shared_prefix"), weight_major_linear():
            for s in range(room):
                tok, lp = sample_next(logits, T or 1.0, T == 0, uniforms[live, s].to(dev))   # (b,) each
                for i, t, p in zip(live.tolist(), tok.tolist(), lp.tolist()):
                    new[i].append(t)
                    lps[i].append(p)
                done = ((tok == eot) | (s == room - 1)).cpu()
                for j in done.nonzero()[:, 0].tolist() if remember else []:   # its KV: row + sampled tokens but the last
                    i = int(live[j])
                    own = slice(L - int(own_len[i]), L + s)
                    memo[i] = (torch.cat([rows[i], torch.tensor(new[i][:-1], dtype=torch.long)]),
                               [([shared] if shared else []) + [(layer.k[j:j + 1, :, own].clone(),
                                                                 layer.v[j:j + 1, :, own].clone())]
                                for shared, layer in zip(prefixes[gid[i]] or [None] * len(cache.layers), cache.layers)])
                if done.all():
                    break
                if done.any():
                    keep = (~done).nonzero()[:, 0]
                    live, group, tok, attn = live[keep], group[keep], tok[keep.to(dev)], attn[keep.to(dev)]
                    for layer in cache.layers:
                        layer.select(keep.to(dev))
                attn[:, L + s] = 1
                shared = [(rows_of(g), prefixes[g]) for g in dict.fromkeys(group.tolist())]
                logits = self.model(input_ids=tok[:, None], attention_mask=attn[:, :L + s + 1], past_key_values=cache,
                                    position_ids=torch.tensor([[n[i] + s] for i in live.tolist()], device=dev),
                                    shared_prefix=shared).logits[:, -1].float()
        return list(zip(new, lps)), memo if remember else []
