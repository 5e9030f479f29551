"""sampler/plain.py: the policy as a sampler, token ids in, token ids and their log-probs out. Read this one.

sample_turn is the whole idea: an HF forward pass with a KV cache, one token at a time, each drawn from
softmax(logits / T) (T = 0: greedy) by sample_next, with its log-prob kept for the GRPO ratio. Every conversation
draws its tokens from its own random stream (rollout.start_conversations seeds it by seed, task and trial, as it
seeds the user): a block of max_new_tokens uniforms a turn, token s using the block's s-th. What a conversation
samples never depends on what else is in the batch, and every sampler with the same max_new_tokens draws the same
uniforms for it. PlainAgent runs it for each waiting conversation, one after another: `python rl.py --sampler
plain` and `python eval.py --sampler plain` run it. sampler/fast.py's eager loop (CPU) is the same tokens, faster
(tests/test_sampler.py: greedy, and at T = 0.7 up to the rounding its test bounds).
"""
import torch
from transformers.cache_utils import DynamicCache

from rollout import ChatFormat


def sample_next(logits: torch.Tensor, temperature, greedy, u: torch.Tensor):
    """THE sampling rule, written once: every sampler calls it (sample_turn, the fast sampler's decode loop, the GPU
    static step). logits (b, V) fp32; temperature: the divisor (callers pass 1.0 for T = 0); greedy: whether the
    caller's T was 0, a Python bool (the eager samplers) or a bool tensor on the device (the static step's graph:
    both tokens computed, the pick made on the device); u (b,): each row's next uniform from its conversation's
    stream.
    -> (tokens (b,), their log-probs under softmax(logits / temperature), as the update's pass computes them).
    Greedy: the argmax of the logits. Else the inverse CDF: the first token whose running sum of probabilities (fp64)
    is past u times the total (the total, not 1: the fp32 probabilities do not sum to exactly 1)."""
    logp = torch.log_softmax(logits / temperature, -1)                 # (b, V)
    if greedy is True:
        tok = logits.argmax(-1)
    else:
        cdf = logp.exp().double().cumsum(-1)
        tok = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
        tok = tok.clamp(max=logits.shape[-1] - 1)      # u * total rounded up to the last sum: V, so the last token
        if greedy is not False:                                          # the static step's tensor: chosen on device
            tok = torch.where(greedy, logits.argmax(-1), tok)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


@torch.no_grad()
def sample_turn(model, ids: list[int], max_new_tokens: int, temperature: float, end_id: int, *, rng=None):
    """One agent turn: feed the conversation so far, then sample one token at a time until end_id or
    max_new_tokens, token s from the turn's uniform u[s]. rng: the conversation's stream (None: torch's global RNG);
    the turn takes max_new_tokens uniforms from it however early it ends, so the next turn's do not depend on this
    one's length (sampler/fast.py draws them the same way; on the CPU, where the generator is, then moved). -> (new
    token ids, the log-prob of each under softmax(logits / T), T = 1 when greedy)."""
    cache, u = DynamicCache(), torch.rand(max_new_tokens, generator=rng, dtype=torch.float64).to(model.device)
    x = torch.tensor([ids], device=model.device)                    # (1, n): the whole prompt, once
    new, logprobs = [], []
    for s in range(max_new_tokens):
        logits = model(input_ids=x, past_key_values=cache).logits[:, -1].float()   # (1, V) for the last position
        tok, logp = sample_next(logits, temperature or 1.0, temperature == 0, u[s:s + 1])
        new.append(int(tok))
        logprobs.append(float(logp))
        if new[-1] == end_id:
            break
        x = tok.view(1, 1)                                           # next step feeds one token; the cache has the rest
    return new, logprobs


class PlainAgent:
    """run_episodes' agent interface over sample_turn: act(batch) advances each waiting conversation by one
    turn, one conversation after another. batch: [rollout.AgentTurn] -> [(new ids, log-probs)]."""

    def __init__(self, model, tokenizer, temperature=1.0, max_new_tokens=256, thinking=False):
        self.model, self.fmt = model, ChatFormat(tokenizer, thinking)
        self.temperature, self.max_new_tokens = temperature, max_new_tokens

    def act(self, batch):
        was_training = self.model.training
        self.model.eval()
        outs = [sample_turn(self.model, turn.token_ids, self.max_new_tokens, self.temperature,
                            self.fmt.end_of_turn_id, rng=turn.rng) for turn in batch]
        self.model.train(was_training)
        return outs

    def forget(self):
        """Nothing is kept between turns: every turn feeds the whole conversation again."""
