"""sampler.py: the policy as a sampler, token ids in, token ids and their log-probs out.

Read sample_turn first: the whole idea in a dozen lines, an HF forward pass with a KV cache, one token at a
time, each sampled from softmax(logits / T) (T = 0: greedy) with its log-prob kept for the GRPO ratio.
PlainAgent runs it for each waiting conversation, one after another. ModelAgent is the same sampler made
fast for many conversations at once, and tested equal to sample_turn (tests/test_sampler.py): greedy turns
token for token, and sampled log-probs equal to a teacher-forced recomputation. What it adds:
  - every conversation's keys/values are kept between rounds, so a round prefills only the new turn, and on
    CPU all rows' new turns go through one forward packed end to end, with no padding;
  - the prefix all conversations share (the system prompt) is prefilled once, stored once and attended
    once for all rows (kernels/attention.py);
  - rows decode together in waves that fit a KV budget, so 256 rollouts fit one GPU;
  - on CPU the LoRA delta is merged into the weights while sampling (one matmul per projection).

Run
  python sampler.py                 # a few episodes with the default model and the scripted user, printed
  python sampler.py --bench         # tok/s of ModelAgent vs PlainAgent at rl.py's CPU rollouts, in the same run,
                                    # against a matmul roofline, and where ModelAgent's seconds go
  python sampler.py --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o
"""
import contextlib
import time
from collections import Counter

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import common
import worlds
from kernels.attention import (PREFILL_TOKENS, KVBuffer, attention_implementation, kv_bytes_per_token, lora_merged,
                               plan_waves, prefill_new_turns, prefill_padded, sampler_scratch, shared_prefix_attention,
                               token_slice, weight_major_linear)
from rollout import DEFAULT_MODEL, ChatFormat, load_adapter, load_model, run_episodes

# The flags left unset: the tour prints a few retail episodes; the bench times rl.py's CPU rollouts (airline's easy
# tier, its turn and token limits, groups of 8, T = 0.7).
PRESETS = {"tour": dict(domain="retail", group_size=1, max_turns=6, max_new_tokens=128, max_context=8192,
                        temperature=1.0),
           "bench": dict(domain="airline", tiers="easy", group_size=8, **common.CPU_LIMITS, temperature=0.7)}


# ----------------------------------------------------------------------------- the plain sampler

@torch.no_grad()
def sample_turn(model, ids: list[int], max_new_tokens: int, temperature: float, end_id: int, generator=None):
    """One agent turn: feed the conversation so far, then sample one token at a time until end_id or
    max_new_tokens. -> (new token ids, the log-prob of each under softmax(logits / T))."""
    cache = DynamicCache()
    x = torch.tensor([ids], device=model.device)                    # (1, n): the whole prompt, once
    new, logprobs = [], []
    for _ in range(max_new_tokens):
        logits = model(input_ids=x, past_key_values=cache).logits[0, -1].float()   # (V,) for the last position
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        tok = logits.argmax() if temperature == 0 else torch.multinomial(logp.exp(), 1, generator=generator)[0]
        new.append(int(tok))
        logprobs.append(float(logp[tok]))
        if new[-1] == end_id:
            break
        x = tok.view(1, 1)                                           # next step feeds one token; the cache has the rest
    return new, logprobs


class PlainAgent:
    """run_episodes' agent interface over sample_turn: act(batch) advances each waiting conversation by one
    turn, one conversation after another. batch: [(task, messages, token_ids)] -> [(new ids, log-probs)]."""

    def __init__(self, model, tokenizer, temperature=1.0, max_new_tokens=256, thinking=False, generator=None):
        self.model, self.fmt, self.generator = model, ChatFormat(tokenizer, thinking), generator
        self.temperature, self.max_new_tokens = temperature, max_new_tokens

    def act(self, batch):
        was_training = self.model.training
        self.model.eval()
        outs = [sample_turn(self.model, ids, self.max_new_tokens, self.temperature, self.fmt.end_of_turn_id,
                            self.generator) for _, _, ids in batch]
        self.model.train(was_training)
        return outs


# ----------------------------------------------------------------------------- the fast sampler

def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class ModelAgent:
    """The policy as a sampler: act() advances every waiting conversation by one turn, sampling from
    softmax(logits / T) (no top-k/top-p; T = 0: greedy) and keeping each sampled token's log-prob.

    KV reuse, so a round costs the new tokens only: each conversation's keys/values are remembered
    between rounds (the next round prefills just the user/tool turn appended since), and the prefix all
    conversations share (the ~1.8k-token system prompt) is prefilled once, stored once and, while
    decoding, attended once for all rows (shared_prefix_attention). The memory is dropped when the
    weights change (an optimizer step bumps the parameters' _version counters). On CPU the LoRA delta is
    merged into the weights for each call (kernels.attention.lora_merged; merge_lora=False: not).

    Waves, so 256 rollouts of 8k tokens fit one GPU: rows are decoded in waves whose cache fits
    kv_budget bytes (kernels.attention.plan_waves; None: on CUDA the free memory at the first call minus
    KV_RESERVE for the training step, on CPU no limit). When the rows' keys/values would not fit a
    second time beside the wave (their copies for the next round), they are not kept: only the shared
    prefix is, and next round each row is prefilled again from it. Greedy decoding gives the same turns
    either way (tests/test_rollout.py)."""

    KV_RESERVE = 6 * 2**30      # what the auto budget leaves free on a GPU: the GRPO step's peak beyond the weights

    def __init__(self, model, tokenizer, temperature: float = 1.0, max_new_tokens: int = 256,
                 kv_budget: int | None = None, thinking: bool = False, merge_lora: bool = True):
        self.model, self.tok, self.fmt = model, tokenizer, ChatFormat(tokenizer, thinking)
        self.merge_lora = merge_lora               # sample with the LoRA delta in the weights (lora_merged)
        self.temperature, self.max_new_tokens, self.kv_budget = temperature, max_new_tokens, kv_budget
        self.memo, self.version = [], None    # [(token ids (n,), per layer: consecutive (k, v) pieces)]
        self.waves, self.keeps_rows = [], True   # the last act()'s waves (row indices); were the rows' caches kept

    def forget(self):
        """Drop the remembered keys/values: rl.py calls it before an update, which would make them stale anyway,
        so that every rollout's keys/values do not sit in memory beside the update's activations."""
        self.memo, self.version = [], None

    def budget_tokens(self) -> int | None:
        """How many tokens of keys/values the agent may hold at once (None: no limit)."""
        if self.kv_budget is None and self.model.device.type == "cuda":     # once, before any cache exists
            free = torch.cuda.mem_get_info(self.model.device)[0] + torch.cuda.memory_reserved() \
                - torch.cuda.memory_allocated()                              # + what torch holds unused
            self.kv_budget = max(0, free - self.KV_RESERVE)
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
        for i, (_, messages, _) in enumerate(batch):
            groups.setdefault(messages[0]["content"] if messages else None, []).append(i)
        return [(idx, 0 if len(idx) == 1 else min(min(_common_prefix(rows[idx[0]], rows[i]) for i in idx),
                                                   min(len(rows[i]) for i in idx) - 1)) for idx in groups.values()]

    @torch.no_grad()
    def act(self, batch):
        was_training = self.model.training
        self.model.eval()
        version = sum(p._version for p in self.model.parameters())   # lora_merged writes through .data: no bump
        if version != self.version:
            self.memo, self.version = [], version
        with lora_merged(self.model, self.merge_lora):
            outs = self._act(batch, [torch.tensor(ids) for _, _, ids in batch])
        self.model.train(was_training)
        return outs

    def _act(self, batch, rows):
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
        self.waves, self.keeps_rows = plan_waves(own, sum(p for _, p in groups), self.max_new_tokens,
                                                 self.budget_tokens(), [x / per_token for x in scratch])
        if not self.keeps_rows:                       # keep only the shared prefixes' entries
            self.memo = [m for m in self.memo if len(m[0]) <= max(P)]
        for idx, p in groups:                         # each group's shared prefix: prefilled once, remembered
            if p and any(self._cached(rows[i])[0] < p for i in idx):
                self.memo.append((rows[idx[0]][:p], [[kv] for kv in self._prefill(rows[idx[0]][:p])[0]]))
        outs, memo = [None] * len(rows), []
        for wave in self.waves:
            part = lambda xs: [xs[i] for i in wave]   # noqa: E731
            cache, prefixes, logits = self._prefill_wave(part(rows), part(P), part(gid))
            if self.keeps_rows:                       # (one wave) every row's remembered keys/values are in `cache`
                self.memo = []
            done, kept = self._sample(part(rows), part(P), part(gid), cache, prefixes, logits, remember=self.keeps_rows)
            for i, out in zip(wave, done):
                outs[i] = out
            memo += kept
        if self.keeps_rows:
            self.memo = memo
        return outs

    def _prefill_wave(self, rows: list[torch.Tensor], P: list[int], gid: list[int]):
        """Prefill each row after what the memo holds, straight into a decode cache. Row i continues the
        shared prefix of its group gid[i], P[i] tokens, whose keys/values are kept once per group
        (1, kv_heads, P, hd) per layer; its own part (n_i - P[i] tokens) sits left-padded in a
        (B, L + room) buffer. -> (cache, {group: per-layer prefix (k, v), or None}, last-token logits (B, V)).
        The rows of a group that continue its cached prefix are prefilled together, their new turns in one
        forward (kernels.attention.prefill_new_turns); others (a row alone) one at a time."""
        B, L, room = len(rows), max(len(r) - p for r, p in zip(rows, P)), self.max_new_tokens
        cached = [self._cached(r) for r in rows]
        cache, prefixes, logits = None, {}, [None] * B

        def put(i, layers):                           # row i's own keys/values into the decode buffer
            nonlocal cache
            cache = cache or Cache(layers=[KVBuffer(B, pieces[0][0], L, room) for pieces in layers])
            for layer, pieces in zip(cache.layers, layers):
                layer.put(i, pieces)
        for g in dict.fromkeys(gid):
            idx, p = [i for i in range(B) if gid[i] == g], P[gid.index(g)]
            if p and all(cached[i][0] >= p for i in idx):     # the usual case: a cached shared prefix
                prefixes[g] = [tuple(torch.cat(x, 2) for x in zip(*token_slice(pieces, 0, p)))
                               for pieces in cached[idx[0]][1]]
                chunks = []                           # rows whose new tokens fill one prefill forward: each chunk's
                for i in idx:                         # keys/values go into the decode buffer before the next's exist
                    if chunks and sum(len(rows[j]) - cached[j][0] for j in chunks[-1] + [i]) <= PREFILL_TOKENS:
                        chunks[-1].append(i)
                    else:
                        chunks.append([i])
                for chunk in chunks:
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

    def _sample(self, rows, P, gid, cache, prefixes, logits, remember: bool):
        """Decode all rows together until each samples end-of-turn or max_new_tokens. Row i's own part sits
        left-padded in `cache` (the attention mask hides the padding) and it attends its group's shared
        prefix, prefixes[gid[i]] (None: none); positions count the row's own tokens. -> ([(new ids,
        log-probs)] per row, if remember, memo entries: each row's ids + sampled tokens but the last, with
        their keys/values)."""
        eot, T, dev = self.fmt.end_of_turn_id, self.temperature, self.model.device
        n, B, room = [len(r) for r in rows], len(rows), self.max_new_tokens
        L = max(a - p for a, p in zip(n, P))
        own_len = torch.tensor([a - p for a, p in zip(n, P)])
        attn = (torch.arange(L + room)[None] >= L - own_len[:, None]).long().to(dev)   # (B, L + room)
        attn[:, L:] = 0                                                     # opened as tokens arrive
        live, group = torch.arange(B), torch.tensor(gid)                    # rows still decoding, their groups
        new, lps, memo = [[] for _ in rows], [[] for _ in rows], [None] * B
        with attention_implementation(self.model, "shared_prefix"), weight_major_linear():
            for s in range(room):
                logp = torch.log_softmax(logits / (T or 1.0), -1)               # (b, V)
                tok = logits.argmax(-1) if T == 0 else torch.multinomial(logp.exp(), 1)[:, 0]
                lp = logp.gather(-1, tok[:, None])[:, 0]
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
                shared = [((group == g).nonzero()[:, 0].to(dev), prefixes[g]) for g in group.unique().tolist()]
                logits = self.model(input_ids=tok[:, None], attention_mask=attn[:, :L + s + 1], past_key_values=cache,
                                    position_ids=torch.tensor([[n[i] + s] for i in live.tolist()], device=dev),
                                    shared_prefix=shared).logits[:, -1].float()
        return list(zip(new, lps)), memo if remember else []


# ----------------------------------------------------------------------------- tour and bench

class Profile:
    """Where a rollout's seconds go, from timers wrapped around the sampler's parts while it runs (removed after):
    the agent's calls (the rest is the users, the envs and the chat format); its forwards, decode steps inside the
    decode loop (_sample) and prefill outside it (the shared prefix, each round's new user/tool turns); inside a
    decode step the weight matmuls (every nn.Linear, the LM head's too) and the attention; the rest of the decode
    loop is sampling and per-token Python. The attention's split between the shared prefix and the rows' own
    tokens: every 10th decode call is run again over the own part alone (plain SDPA), timed apart, and its share
    scaled to all calls; those re-runs are the profiler's own cost, reported on a line of their own."""

    def __init__(self, agent):
        self.agent, self.s, self.undo, self.calls = agent, Counter(), [], 0
        self.sampling = self.decoding = False

    def wrap(self, owner, name, key, flag=None, only=None):
        """Time owner.name into self.s[key], or with only (a flag's name, or a function) only while it holds;
        self.<flag> is set while it runs (with only: while both are)."""
        plain, own = getattr(owner, name), isinstance(owner, type) or name in vars(owner)

        def timed(*a, **kw):
            counting = only is None or (only() if callable(only) else getattr(self, only))
            if flag:
                setattr(self, flag, counting)
            t0 = time.perf_counter()
            try:
                return plain(*a, **kw)
            finally:
                if flag:
                    setattr(self, flag, False)
                if counting:
                    self.s[key] += time.perf_counter() - t0
        setattr(owner, name, timed)
        self.undo.append((owner, name, plain, own))

    def attention(self, *a, **kw):
        t0 = time.perf_counter()
        out = shared_prefix_attention(*a, **kw)
        if self.decoding:
            self.s["attention"] += time.perf_counter() - t0
            self.calls += 1
            module, query, key, value, mask = a[:5]
            if self.calls % 10 == 0 and kw.get("shared_prefix") is not None:
                t1 = time.perf_counter()
                sdpa_attention_forward(module, query, key, value, mask, scaling=kw.get("scaling"))
                self.s["own sampled"] += time.perf_counter() - t1
                self.s["attention sampled"] += t1 - t0
        return out

    def __enter__(self):
        agent = self.agent
        self.wrap(agent, "act", "agent")
        self.wrap(agent, "_sample", "sample", flag="sampling")
        self.wrap(agent.model, "forward", "prefill", only=lambda: not self.sampling)
        self.wrap(agent.model, "forward", "decode", flag="decoding", only="sampling")
        self.wrap(torch.nn.Linear, "forward", "weight matmuls", only="decoding")
        AttentionInterface.register("shared_prefix", self.attention)
        return self

    def __exit__(self, *exc):
        AttentionInterface.register("shared_prefix", shared_prefix_attention)
        for owner, name, plain, own in reversed(self.undo):    # own: it was the owner's own attribute
            setattr(owner, name, plain) if own else delattr(owner, name)

    def report(self, total: float) -> str:
        s = self.s
        own = s["attention"] * s["own sampled"] / s["attention sampled"] if s["attention sampled"] else 0.0
        rows = [("users, envs, chat format (outside the agent)", total - s["agent"]),
                ("prefill forwards: the shared prefix, then each round's new user/tool turns", s["prefill"]),
                ("decode: weight matmuls (every linear, the LM head's too)", s["weight matmuls"]),
                ("decode: attention over the shared prefix", s["attention"] - own),
                ("decode: attention over each row's own tokens", own),
                ("decode: the rest of the forward (norms, rotary, residuals, KV writes, framework)",
                 s["decode"] - s["weight matmuls"] - s["attention"] - s["own sampled"]),
                ("the profiler's own re-runs of the attention (for the split above)", s["own sampled"]),
                ("sampling and per-token Python in the decode loop", s["sample"] - s["decode"]),
                ("the agent's other work (memo, caches, waves, LoRA merge)", s["agent"] - s["prefill"] - s["sample"])]
        return "\n".join(f"  {name:<82} {sec:7.1f} s {100 * sec / total:5.1f}%" for name, sec in rows)


def matmul_roofline(model, rows: int, reps: int = 5) -> float:
    """Seconds one decode step of `rows` rows spends in its weight matmuls alone (every nn.Linear of the model
    once, the LM head included, shaped as a decode step calls them, weight-major as the sampler runs them),
    measured now: rows / this is the tok/s a sampler would reach if nothing else took time."""
    shapes = Counter(tuple(m.weight.shape) for name, m in model.named_modules()   # the base weights (LoRA merged)
                     if isinstance(m, torch.nn.Linear) and m.weight.is_floating_point() and "lora_" not in name)
    total = 0.0
    with weight_major_linear():
        for (out, inp), count in shapes.items():
            w, x = torch.randn(out, inp, dtype=model.dtype), torch.randn(rows, 1, inp, dtype=model.dtype)
            F.linear(x, w)
            t0 = time.perf_counter()
            for _ in range(reps):
                F.linear(x, w)
            total += count * (time.perf_counter() - t0) / reps
    return total


def bench(model, tok, args):
    """Sampled tokens/s at each --rows (conversations: tasks x --group-size, advanced together as rl.py does),
    in one run: PlainAgent (one conversation at a time, the whole conversation fed every turn: the baseline, run
    at the smallest row count only, since it advances one conversation at a time),
    ModelAgent with the LoRA delta unmerged (only with --adapter), ModelAgent with each round's new turns padded
    into batches (kernels.attention.prefill_padded: the fast sampler as it was before its prefill was packed; the
    same tokens), ModelAgent; each against the weight-matmul roofline measured in the same run. Then where
    ModelAgent's seconds went at the largest row count."""
    g = args.group_size
    rows = sorted({-(-int(r) // g) * g for r in args.rows.split(",")})   # whole groups
    tasks = worlds.make_tasks(args.domain, "train", 1000, args.tiers and args.tiers.split(","), seed=args.seed)
    if len(tasks) < max(rows) // g:                  # the first 1000 tasks, filtered by tier: as rl.py's pool
        raise SystemExit(f"--rows {max(rows)}: {args.domain} has {len(tasks)} such tasks, {max(rows) // g} needed")
    tasks = tasks[:max(rows) // g]
    kw = dict(max_turns=args.max_turns, max_context=args.max_context, progress=False, seed=args.seed)
    agents = {"plain": lambda: PlainAgent(model, tok, args.temperature, args.max_new_tokens),
              "unmerged": lambda: ModelAgent(model, tok, args.temperature, args.max_new_tokens, merge_lora=False),
              "padded": lambda: ModelAgent(model, tok, args.temperature, args.max_new_tokens),
              "fast": lambda: ModelAgent(model, tok, args.temperature, args.max_new_tokens)}
    if not args.adapter:
        del agents["unmerged"]
    run_episodes(agents["fast"](), tok, tasks[:1], **{**kw, "max_turns": 1})   # untimed warm-up
    print(f"bench: {args.domain} {args.tiers or 'all tiers'}, groups of {g}, <= {args.max_turns} turns x "
          f"<= {args.max_new_tokens} new tokens, T {args.temperature}, {torch.get_num_threads()} threads, "
          f"{model.device}\nroof: the tok/s if a decode step cost only its weight matmuls, measured in this run\n"
          f"{'rows':>5} {'agent':>9} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'vs plain':>8} {'roof':>6} {'of roof':>7}")
    rates, profile, tokens = {}, None, {}
    for n in rows:
        roof = n / matmul_roofline(model, n)
        for name, make in agents.items():
            if name == "plain" and n != rows[0]:          # one conversation at a time: its tok/s is the same at any rows
                rates[n, name] = rates[rows[0], name]
                continue
            agent = make()
            torch.manual_seed(args.seed)
            with (prefill_padded() if name == "padded" else contextlib.nullcontext(),
                  Profile(agent) if name == "fast" and n == rows[-1] else contextlib.nullcontext() as prof):
                t0 = time.perf_counter()
                trajs = run_episodes(agent, tok, tasks[:n // g], g, **kw)
                dt = time.perf_counter() - t0
            tokens[name] = [t.token_ids for t in trajs]
            toks = sum(sum(t.loss_mask) for t in trajs)
            rates[n, name] = toks / dt
            if prof:
                profile = prof.report(dt)
            print(f"{n:>5} {name:>9} {toks:>7} {dt:>8.1f} {toks / dt:>7.1f} {rates[n, name] / rates[n, 'plain']:>7.2f}x "
                  f"{roof:>6.0f} {100 * toks / dt / roof:>6.1f}%", flush=True)
    lo, hi = rows[0], rows[-1]
    print(f"scaling: ModelAgent at {hi} rows runs at {rates[hi, 'fast'] / rates[lo, 'fast']:.2f}x its tok/s at {lo}")
    print(f"packed vs padded prefill, at {hi} rows: {rates[hi, 'fast'] / rates[hi, 'padded']:.2f}x the tok/s, the "
          f"same tokens: {tokens['fast'] == tokens['padded']}")
    print(f"profile (ModelAgent, {hi} rows): where the rollouts' {dt:.0f} seconds went\n{profile}")


def main():
    ap = common.Parser(description="Run a few MUA-RL rollouts and print them, or time the samplers.")
    common.add_model_args(ap, model_default=DEFAULT_MODEL)
    common.add_user_args(ap)
    ap.add_argument("--adapter", default=None, help="LoRA adapter dir to load (e.g. runs/rl/adapter)")
    ap.add_argument("--domain", default=None, help="a domain of worlds.py (retail, airline, tau2-..., ...) (preset)")
    ap.add_argument("--tiers", default=None, help="only tasks of these tiers, comma-separated (preset)")
    ap.add_argument("--split", default="train", help="train | test")
    ap.add_argument("--tasks", type=int, default=4, help="number of tasks")
    ap.add_argument("--group-size", type=int, default=None, help="rollouts per task (preset)")
    common.add_episode_args(ap)
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature, 0: greedy (preset)")
    ap.add_argument("--seed", type=int, default=0, help="task, user and sampling seed")
    ap.add_argument("--bench", action="store_true", help="tok/s of the plain and the fast sampler at --rows "
                    "conversations, against a matmul roofline, and where the fast one's seconds went; with --adapter "
                    "also LoRA unmerged. Its preset is rl.py's CPU rollouts")
    ap.add_argument("--rows", default="8,16", help="with --bench: conversations decoded together, comma-separated")
    args = ap.parse_args()
    common.fill_preset(args, PRESETS, "bench" if args.bench else "tour")
    if not all(r.isdigit() and int(r) > 0 for r in args.rows.split(",")):
        common.fail("--rows", f"{args.rows!r} is not a comma-separated list of positive integers")
    if args.domain not in worlds.DOMAINS:
        common.fail("--domain", f"unknown domain {args.domain!r}; use one of {', '.join(worlds.DOMAINS)}")
    common.check_args(args, at_least=dict(tasks=1, group_size=1, max_turns=1, max_new_tokens=1, max_context=2,
                                          user_workers=1),
                      finite=dict(temperature=(0, False)))
    common.start_run(args)
    model, tok = load_model(args.model, args.load_in_4bit)
    model = load_adapter(model, args.adapter) if args.adapter else model
    if args.bench:
        return bench(model, tok, args)
    torch.manual_seed(args.seed)
    tasks = worlds.make_tasks(args.domain, args.split, args.tasks, args.tiers and args.tiers.split(","), seed=args.seed)
    agent = ModelAgent(model, tok, args.temperature, args.max_new_tokens, int(args.kv_budget * 2**30) or None,
                       args.thinking)
    t0 = time.time()
    trajs = run_episodes(agent, tok, tasks, args.group_size, args.user, args.max_turns, args.max_context, seed=args.seed,
                         **common.user_kwargs(args, model, tok))
    for t in trajs:
        print(t.show() + "\n")
    reasons = dict(Counter(t.stop_reason for t in trajs))
    print(f"{len(trajs)} rollouts in {time.time() - t0:.0f} s | mean reward "
          f"{sum(t.reward for t in trajs) / len(trajs):.2f} | stop reasons {reasons} | sampled tokens "
          f"{sum(sum(t.loss_mask) for t in trajs)} | total tokens {sum(len(t.token_ids) for t in trajs)}")


if __name__ == "__main__":
    main()
