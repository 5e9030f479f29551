"""sampler/: the policy as a sampler. plain.py is the one to read (sample_turn: a dozen lines over a KV cache);
fast.py is the same tokens, faster (many conversations at once, keys/values kept between rounds, the shared
system prompt attended once, waves that fit a KV budget), with its attention in attention.py and, on a GPU, its
decode step in static.py (fixed shapes, no host syncs: one CUDA graph a token); bench.py runs a few episodes, or
times the two (python -m sampler.bench)."""
from sampler.fast import ModelAgent
from sampler.plain import PlainAgent, sample_turn   # noqa: F401

SAMPLERS = ("fast", "plain")


def make_agent(kind: str, model, tok, temperature: float, max_new_tokens: int, kv_budget_gib: float = 0.0,
               thinking: bool = False, sample_weights: str = "auto", max_context: int | None = None):
    """rl.py's and eval.py's --sampler: "plain" samples one conversation at a time through sample_turn,
    "fast" (the default) is ModelAgent; kv_budget_gib 0 = ModelAgent's automatic budget; sample_weights: the GPU
    static decode step's weights (--sample-weights); max_context: the episodes' token limit (--max-context), the
    longest row the GPU static decoder's buffer is made for."""
    if kind == "plain":
        return PlainAgent(model, tok, temperature, max_new_tokens, thinking)
    return ModelAgent(model, tok, temperature, max_new_tokens, int(kv_budget_gib * 2**30) or None, thinking,
                      sample_weights=sample_weights, max_context=max_context)
