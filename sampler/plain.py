"""sampler/plain.py: the policy as a sampler, token ids in, token ids and their log-probs out. Read this one.

sample_turn is the whole idea: an HF forward pass with a KV cache, one token at a time, each sampled from
softmax(logits / T) (T = 0: greedy), with its log-prob kept for the GRPO ratio. PlainAgent runs it for each
waiting conversation, one after another: `python rl.py --sampler plain` and `python eval.py --sampler plain`
run it. sampler/fast.py is the same tokens, faster (tests/test_sampler.py).
"""
import torch
from transformers.cache_utils import DynamicCache

from rollout import ChatFormat


@torch.no_grad()
def sample_turn(model, ids: list[int], max_new_tokens: int, temperature: float, end_id: int, *, generator=None):
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

    def __init__(self, model, tokenizer, temperature=1.0, max_new_tokens=256, thinking=False, *, generator=None):
        self.model, self.fmt, self.generator = model, ChatFormat(tokenizer, thinking), generator
        self.temperature, self.max_new_tokens = temperature, max_new_tokens

    def act(self, batch):
        was_training = self.model.training
        self.model.eval()
        outs = [sample_turn(self.model, ids, self.max_new_tokens, self.temperature, self.fmt.end_of_turn_id,
                            generator=self.generator) for _, _, ids in batch]
        self.model.train(was_training)
        return outs

    def forget(self):
        """Nothing is kept between turns: every turn feeds the whole conversation again."""
