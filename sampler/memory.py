"""sampler/memory.py: a GPU run's memory plan, said before the model loads, from the model's config alone.

Users of one-GPU RL frameworks most often report a run that hangs or runs out of memory in silence. rl.py and eval.py
print this plan on CUDA before anything loads, and refuse in one line (exit 2) a plan that cannot fit the card:

  weights         the NF4 body (4 bits a weight, an fp32 absmax a 64-weight block quantized again to 8 bits: ~0.52
                  bytes a weight), embeddings and lm_head in bf16, LoRA r on every projection in fp32 (Qwen3-8B with
                  r 16: 3.34 + 2.32 + 0.16 = 5.82 GiB, as measured on an H100, docs/gpu.md)
  sampling copy   bf16 sampling weights (sampler/static.py): every projection in bf16, 12.94 GiB for Qwen3-8B; none
                  with nf4. auto picks as static.choose_weights does, on the card's memory less the weights
  KV budget       --kv-budget, or what the card leaves (auto): the sampler's keys/values, the static decoder's
                  buffer, its graphs' pool and the decode step's scratch all count inside it (sampler.attention)
  the update      ModelAgent.KV_RESERVE, what the automatic budget leaves free for the GRPO update (rl.py; its
                  measured peak above the weights: 5.5 GiB for 8 sequences of 8k tokens with checkpointing)
A plan fits when their sum is within the card and the KV budget holds at least one conversation of --max-context
tokens (tests/test_static_decode.py plans Qwen3-8B on a 24 GiB card)."""
from sampler.attention import kv_bytes_per_token
from sampler.static import MIN_KV_BF16

GIB = 2**30
NF4_BYTES = 0.5 + 4 / 64 / 4 + 4 / 256 / 64      # 4 bits; an 8-bit absmax a block of 64, an fp32 one a block of 256


def projections(config) -> list[tuple[int, int]]:
    """(in, out) of every decoder projection: q, k, v, o, gate, up, down of each layer."""
    H, I = config.hidden_size, config.intermediate_size
    hd = getattr(config, "head_dim", None) or H // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, (getattr(config, "num_key_value_heads", None) or
                                              config.num_attention_heads) * hd
    return [(H, q), (H, kv), (H, kv), (q, H), (H, I), (H, I), (I, H)] * config.num_hidden_layers


def weight_bytes(config, load_in_4bit: bool, lora_r: int) -> dict:
    """The model's bytes on the GPU by part: the decoder's projections (NF4 or bf16), embeddings and lm_head (bf16,
    once if tied), LoRA (fp32)."""
    n = sum(i * o for i, o in projections(config))
    tables = config.vocab_size * config.hidden_size * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return dict(body=n * (NF4_BYTES if load_in_4bit else 2), tables=tables * 2,
                lora=sum(lora_r * (i + o) for i, o in projections(config)) * 4)


def memory_plan(config, card: int, load_in_4bit: bool, sample_weights: str, kv_budget: int | None, max_context: int,
                lora_r: int, reserve: int) -> tuple[str, str | None]:
    """(the plan as one line, why it cannot fit or None). card: the GPU's bytes; kv_budget None: auto."""
    import torch
    w = weight_bytes(config, load_in_4bit, lora_r)
    weights = sum(w.values())
    copy = sum(i * o for i, o in projections(config)) * 2
    if sample_weights == "auto":
        sample_weights = "bf16" if copy + reserve + (kv_budget or MIN_KV_BF16) <= card - weights else "nf4"
    copy = copy if sample_weights == "bf16" else 0
    kv = kv_budget if kv_budget is not None else card - weights - copy - reserve
    one_row = max_context * kv_bytes_per_token(config, torch.bfloat16)
    line = (f"memory plan for a {card / GIB:.1f} GiB card: weights {weights / GIB:.2f} GiB (body {w['body'] / GIB:.2f}"
            f"{' NF4' if load_in_4bit else ' bf16'}, embeddings and lm_head {w['tables'] / GIB:.2f}, LoRA "
            f"{w['lora'] / GIB:.2f}) + sampling copy {copy / GIB:.2f} ({sample_weights}) + KV budget {kv / GIB:.2f}"
            f"{' (auto)' if kv_budget is None else ''} + the update's reserve {reserve / GIB:.2f} = "
            f"{(weights + copy + kv + reserve) / GIB:.2f} GiB")
    fixed = weights + copy + reserve
    if kv_budget is not None and fixed + kv > card:
        room = card - fixed
        return line, (f"weights, sampling copy and the update's reserve take {fixed / GIB:.2f} GiB of the card's "
                      f"{card / GIB:.1f}: use a --kv-budget of at most {room / GIB:.2f}" if room >= one_row else
                      f"the weights, sampling copy and the update's reserve alone ({fixed / GIB:.2f} GiB) leave the "
                      f"card's {card / GIB:.1f} less than one {max_context}-token conversation "
                      f"({one_row / GIB:.2f} GiB): " + ("use --sample-weights nf4, " if copy else "")
                      + "a smaller --max-context or a larger card")
    if kv < one_row:
        return line, (f"the KV budget ({kv / GIB:.2f} GiB) holds less than one {max_context}-token conversation "
                      f"({one_row / GIB:.2f} GiB): " + ("use --sample-weights nf4, " if copy else "")
                      + ("a larger --kv-budget, " if kv_budget is not None else "")
                      + "a smaller --max-context or a larger card")
    return line, None
