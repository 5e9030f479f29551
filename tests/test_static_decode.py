"""The static decode step (sampler/static.py, ModelAgent(decode="static"): what a GPU runs as one CUDA graph a
token) against the plain sampler (sampler/plain.py), the reference.

Greedy: the same conversations token for token over 3 rounds (the keys/values kept between rounds), with both
sampling weights (bf16: one dense copy with LoRA merged; nf4: the model's own layers and LoRA unmerged), on the tiny
Llama (its turns end at different steps: the host's look every few steps, and the live rows moved to a smaller
bucket), the tiny Qwen3 in fp32, and the tiny Qwen3 in bitsandbytes' CPU NF4. Sampled: every log-prob equals a
teacher-forced recomputation. Merged weights: the copy is W + s B A rounded once, and in bf16 its log-probs equal
the unmerged forward's within bf16 rounding. And the step itself: torch.compile(fullgraph=True) traces it with no
graph break, and it asks the host nothing (a TorchFunctionMode that raises on every call that would sync)."""
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rollout
import sampler.static as static
from conftest import with_lora
from envs import ours
from rollout import run_episodes
from sampler import ModelAgent, PlainAgent
from sampler.static import Merged, StaticDecoder, decode_step, dense_weight
from tiny_qwen3 import qwen3_config, qwen3_tokenizer, save_tiny_qwen3


@pytest.fixture(scope="module")
def qwen3_tok():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def qwen3(qwen3_tok):
    """The tiny random Qwen3 (q/k norms, GQA, untied lm_head) in fp32, with LoRA."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config(len(qwen3_tok)), dtype=torch.float32)
    model.config.eos_token_id, model.config.pad_token_id = qwen3_tok.eos_token_id, qwen3_tok.pad_token_id
    return with_lora(model)


@pytest.fixture(scope="module")
def qwen3_nf4(tmp_path_factory):
    """The same architecture saved and loaded as a GPU run loads Qwen3-8B: bitsandbytes NF4 (fp32 compute on CPU)."""
    model, _ = rollout.load_model(save_tiny_qwen3(str(tmp_path_factory.mktemp("qwen3"))), load_in_4bit=True)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    return with_lora(model)


@pytest.fixture
def check_often(monkeypatch):
    """The host looks every 4 steps instead of 16, so that 12-token turns are looked at and rows moved: -> the
    moves, (live rows, their new bucket) each."""
    monkeypatch.setattr(static, "CHECK_EVERY", 4)
    moves = []
    compact = StaticDecoder._compact
    monkeypatch.setattr(StaticDecoder, "_compact", lambda self, kv, live, b: moves.append((len(live), b))
                        or compact(self, kv, live, b))
    return moves


def two_tasks():
    """One task of each domain: two system prompts, so the step reads two shared prefixes."""
    return [ours.make_tasks(d, "train", 1)[0] for d in ours.DOMAINS]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_static_step_samples_the_plain_samplers_tokens_greedy(request, tok, qwen3_tok, name):
    model = request.getfixturevalue("tiny_lora" if name == "llama" else name)
    tk = tok if name == "llama" else qwen3_tok
    agents = {"plain": PlainAgent(model, tk, temperature=0.0, max_new_tokens=8)}
    agents.update({weights: ModelAgent(model, tk, temperature=0.0, max_new_tokens=8, decode="static",
                                       sample_weights=weights) for weights in ("nf4", "bf16")})
    turns = 2 if name == "llama" else 1              # two rounds (the caches kept between them) on one model
    runs = {kind: run_episodes(agent, tk, two_tasks(), group_size=2, max_turns=turns, progress=False, seed=1,
                               max_context=8192)
            for kind, agent in agents.items()}
    assert sum(t.turns for t in runs["plain"]) == turns * len(runs["plain"])
    for weights in ("nf4", "bf16"):
        gap = max(max(abs(a - b) for a, b in zip(p.logprobs, s.logprobs)) for p, s in zip(runs["plain"], runs[weights]))
        print(f"{name}, {weights}: max |log-prob gap| to the plain sampler {gap:.1e}")
        for a, b in zip(runs["plain"], runs[weights]):
            assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.messages == b.messages
        assert gap < 1e-4


def nf4_layers(model) -> list:
    """The model's bitsandbytes NF4 base layers (peft's LoRA wrappers answer to .weight too: not those)."""
    return [m for m in model.modules() if hasattr(getattr(m, "weight", None), "quant_state") and not hasattr(m, "lora_A")]


def portable(model):
    """A copy of model whose NF4 layers use bitsandbytes' portable CPU kernel (dequantize, then an fp32 matmul),
    not the one it takes on a CPU with AVX512-BF16 (weights repacked, inputs rounded to bf16)."""
    from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse
    model = copy.deepcopy(model)
    for m in nf4_layers(model):
        if getattr(m.weight.quant_state, "packing_format_for_cpu", False):
            m.weight.data, m.weight.quant_state = _convert_weight_packed_for_cpu_inverse(m.weight.data,
                                                                                         m.weight.quant_state)
        m.support_avx512bf16_for_cpu = False
    return model


def test_nf4_model_each_mode_samples_the_plain_samplers_tokens_under_the_kernel_it_computes(qwen3_nf4, qwen3_tok):
    """Qwen3 in bitsandbytes' CPU NF4, greedy, one round, every CPU kind. nf4 mode decodes with the model's own NF4
    layers: the plain sampler's tokens, log-probs within 1e-4 (fp32 summation order), whichever kernel bitsandbytes
    picks on this CPU. bf16 mode decodes with a dense copy of the dequantized weights: the product of bitsandbytes'
    portable CPU kernel (dequantize, then an fp32 matmul), so it is compared under that kernel, with the same bound.
    On a CPU with AVX512-BF16 bitsandbytes otherwise repacks the weights for a bf16 kernel whose product is not
    x W^T of the dequantized W (printed: its largest difference, as a share of the output's scale); a random 2-layer
    model turns that into logit differences as large as its logits' spread, and tokens then part at near-ties."""
    from sampler.static import dense_weight
    tk = qwen3_tok
    run = lambda agent: run_episodes(agent, tk, two_tasks(), group_size=2, max_turns=1, progress=False,   # noqa: E731
                                     seed=1, max_context=8192)
    for model, weights in ((qwen3_nf4, "nf4"), (portable(qwen3_nf4), "bf16")):
        plain = run(PlainAgent(model, tk, temperature=0.0, max_new_tokens=8))
        static = run(ModelAgent(model, tk, temperature=0.0, max_new_tokens=8, decode="static", sample_weights=weights))
        gap = max(max(abs(a - b) for a, b in zip(p.logprobs, s.logprobs)) for p, s in zip(plain, static))
        print(f"{weights} mode: max |log-prob gap| to the plain sampler {gap:.1e} over "
              f"{sum(sum(t.loss_mask) for t in plain)} sampled tokens")
        assert all(a.token_ids == b.token_ids and a.messages == b.messages for a, b in zip(plain, static))
        assert gap < 1e-4
    x = torch.randn(16, qwen3_nf4.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m = nf4_layers(qwen3_nf4)[0]
        y = m(x)
        share = ((y - x @ dense_weight(m).float().T).abs().max() / y.abs().max()).item()
    print(f"this CPU's NF4 kernel against x W^T of the dequantized W: {share:.1e} of the output's scale "
          f"(AVX512-BF16: {torch.cpu._is_avx512_bf16_supported()})")


def test_graphs_are_captured_once_per_rows_bucket_for_the_run(tiny_lora, tok, check_often, monkeypatch):
    """Three rl-like rounds at T = 1: turns that end at different lengths (the tiny Llama's end-of-turn bias), the
    host looking every 4 steps so the live rows move to smaller buckets, contexts growing every round. The graph
    keys the step would capture (on CUDA exactly these are captured; on CPU the decoder records them) are the rows
    buckets up to the first round's, one each, made before the first round decodes, and none after it."""
    static._decoders.pop(tiny_lora, None)            # a decoder of an earlier test would hold its buffers
    steps, step = [], StaticDecoder._step
    monkeypatch.setattr(StaticDecoder, "_step", lambda self, b: steps.append(b) or step(self, b))
    torch.manual_seed(0)
    agent = ModelAgent(tiny_lora, tok, temperature=1.0, max_new_tokens=16, decode="static", sample_weights="nf4",
                       max_context=3584)
    keys, act = [], agent.act
    agent.act = lambda batch: (act(batch), keys.append(list(agent.static.graph_keys)))[0]
    trajs = run_episodes(agent, tok, two_tasks(), group_size=4, max_turns=3, progress=False, seed=4, max_context=8192)
    contexts = sorted({len(t.token_ids) for t in trajs})
    print(f"graph keys after each round {keys}; buckets stepped {sorted(set(steps))}; moves {check_often}; "
          f"contexts {contexts[0]}..{contexts[-1]} tokens")
    assert len(keys) == 3 and keys[0] == static.rows_buckets(8) == [8, 4, 2, 1] and keys[1] == keys[2] == keys[0]
    assert check_often and len(set(steps)) >= 3                     # rows moved, and several buckets stepped


def teacher_forced_gaps(model, trajs, T: float) -> torch.Tensor:
    """|stored log-prob - the model's log-prob of the same token on the final ids| over every sampled token."""
    gaps = []
    for t in trajs:
        ids = torch.tensor(t.token_ids)
        at = torch.tensor(t.loss_mask[1:]).nonzero()[:, 0]             # token j + 1 is predicted at position j
        with torch.no_grad():
            logits = model(ids[None], logits_to_keep=at).logits[0].float()
        logp = torch.log_softmax(logits / T, -1).gather(-1, ids[at + 1, None])[:, 0]
        gaps.append((logp - torch.tensor(t.logprobs)[at + 1]).abs())
    return torch.cat(gaps)


@pytest.mark.parametrize("weights", ["nf4", "bf16"])
def test_sampled_logprobs_equal_a_teacher_forced_recomputation(tiny_lora, tok, check_often, weights):
    """T = 1.1, turns of different lengths (the tiny Llama ends one after ~10 tokens), looked at every 4 tokens: the
    live rows are moved to a smaller bucket, and every log-prob equals the policy's on the final ids."""
    torch.manual_seed(0)
    agent = ModelAgent(tiny_lora, tok, temperature=1.1, max_new_tokens=16, decode="static", sample_weights=weights)
    trajs = run_episodes(agent, tok, two_tasks(), group_size=2, max_turns=2, progress=False, seed=2, max_context=8192)
    gap = teacher_forced_gaps(tiny_lora, trajs, 1.1)
    print(f"{weights}: max |sampled - teacher-forced| log-prob {gap.max():.2e} over {gap.numel()} tokens; "
          f"(live rows, their new bucket) at each move: {check_often}")
    assert gap.numel() > 10 and gap.max() < 1e-4
    assert check_often and all(b < 4 for _, b in check_often)


def test_bf16_copy_is_the_merged_weight_rounded_once_and_samples_as_the_unmerged_model(qwen3, qwen3_tok):
    """Each projection's copy equals (W + s B A in fp32) rounded to bf16, exactly; and sampling from the copies, the
    log-probs equal a teacher-forced pass of the unmerged bf16 model within bf16 rounding, as do those of the
    unmerged step (nf4 mode): the copy adds one rounding, no error of its own."""
    model = copy.deepcopy(qwen3).to(torch.bfloat16)
    decoder = StaticDecoder(model, "bf16")
    copies = [group for layer in decoder.proj for group in layer]
    assert all(isinstance(g, Merged) and g.weight.dtype == torch.bfloat16 for g in copies)
    assert [len(g.modules) for g in decoder.proj[0]] == [3, 1, 2, 1]          # q/k/v and gate/up: one matmul each
    for g in copies:
        for lora, rows in zip(g.modules, g.weight.split(g.sizes)):
            exact = dense_weight(lora.get_base_layer()).float() + lora.scaling["default"] * (
                lora.lora_B["default"].weight.float() @ lora.lora_A["default"].weight.float())
            assert torch.equal(rows, exact.to(torch.bfloat16))
    gaps = {}
    for weights in ("bf16", "nf4"):
        torch.manual_seed(0)
        agent = ModelAgent(model, qwen3_tok, temperature=1.0, max_new_tokens=8, decode="static",
                           sample_weights=weights)
        trajs = run_episodes(agent, qwen3_tok, two_tasks(), group_size=2, max_turns=1, progress=False, seed=3,
                             max_context=8192)
        gaps[weights] = teacher_forced_gaps(model, trajs, 1.0)
    print("max / mean |sampler - training forward| log-prob in bf16: " + ", ".join(
        f"{w} {g.max():.2e} / {g.mean():.2e}" for w, g in gaps.items()))
    assert all(g.numel() > 10 for g in gaps.values())
    assert gaps["bf16"].max() < 0.05 and gaps["nf4"].max() < 0.05     # a few bf16 ulps of the logits


def recorded_step(model, tk, weights, monkeypatch, T=1.0):
    """(decoder, the arguments of one real decode step): a round of ModelAgent(decode="static"), _step recorded."""
    calls = []
    step = StaticDecoder._step
    monkeypatch.setattr(StaticDecoder, "_step", lambda self, b: calls.append(b) or step(self, b))
    agent = ModelAgent(model, tk, temperature=T, max_new_tokens=3, decode="static", sample_weights=weights)
    run_episodes(agent, tk, two_tasks(), group_size=2, max_turns=1, progress=False, seed=1, max_context=8192)
    b = calls[-1]
    agent.static.state.t.fill_(1)                 # the step after the round's last writes token 1 again, not past room
    return agent.static, (agent.static.body, agent.static.proj, *agent.static.views(b), agent.static.state, b)


@pytest.mark.parametrize("weights", ["nf4", "bf16"])
def test_the_decode_step_compiles_whole_with_no_graph_break(qwen3, qwen3_tok, monkeypatch, weights):
    _, args = recorded_step(qwen3, qwen3_tok, weights, monkeypatch)
    torch._dynamo.reset()
    with torch.no_grad():                             # as the sampler runs it
        explained = torch._dynamo.explain(decode_step)(*args)
    print(f"{weights}: {explained.graph_count} graph(s), {explained.graph_break_count} graph break(s), "
          f"{explained.op_count} ops; {explained.break_reasons}")
    assert explained.graph_count == 1 and explained.graph_break_count == 0 and explained.op_count > 50


class HostSync(Exception):
    pass


class NoHostSync(TorchFunctionMode):
    """Raises HostSync on every torch call that makes the host wait for the device or read device memory: a value
    back to Python (.item(), .tolist(), bool/int/float of a tensor, .numpy(), torch.equal), a copy to the CPU (.cpu(),
    .to("cpu")), a result whose size depends on the values (nonzero, boolean or list indexing, masked_select,
    unique, repeat_interleave), and a tensor made from host data (torch.tensor), which a CUDA graph would replay stale.
    On CPU nothing waits, so this is how a CPU test sees what torch.cuda.set_sync_debug_mode would on a GPU."""
    SYNCS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "equal", "allclose",
             "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "repeat_interleave", "tensor",
             "as_tensor"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_cpu = name == "to" and "cpu" in [*args[1:], *kwargs.values()]     # .to("cpu"); HF's .to(x.device) is no sync
        index = args[1] if name in ("__getitem__", "__setitem__") else None
        parts = index if isinstance(index, tuple) else (index,)
        by_value = any(isinstance(i, list) or isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)
        if name in self.SYNCS or to_cpu or by_value:
            raise HostSync(f"{name} inside the decode step")
        return func(*args, **kwargs)


def test_the_sync_detector_catches_each_kind_of_host_sync():
    """So that the test below can fail: every way of asking the host raises, the step's own ways of indexing do not."""
    x = torch.arange(6.0)
    asks = [lambda: x.sum().item(), lambda: x.tolist(), lambda: x.cpu(), lambda: x.to("cpu"), lambda: x.nonzero(),
            lambda: x[x > 2], lambda: x[[0, 1]], lambda: bool(x.any()), lambda: int(x[0]), lambda: torch.tensor([1.0]),
            lambda: x.masked_select(x > 2)]
    for ask in asks:
        with pytest.raises(HostSync), NoHostSync():
            ask()
    with NoHostSync():                                # what decode_step does instead
        x[:3].index_copy_(0, torch.zeros(1, dtype=torch.long), x[3:4])
        torch.zeros(3).masked_fill_(x[:3] > 1, float("-inf"))
        x[None, 2:]


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("weights", ["nf4", "bf16"])
def test_the_decode_step_asks_the_host_nothing(qwen3, qwen3_tok, monkeypatch, weights, T):
    decoder, args = recorded_step(qwen3, qwen3_tok, weights, monkeypatch, T)
    t = decoder.state.t.clone()
    with torch.no_grad(), NoHostSync():
        decode_step(*args)
    assert decoder.state.t == t + 1                   # it ran: one more token sampled


def test_the_step_decodes_the_layers_it_is_written_for_and_says_so_for_others(tiny_lora, qwen3):
    """ModelAgent's decode="auto" takes the static step on CUDA only for Llama and Qwen3 (unsupported(model) is None);
    asked for another architecture, the decoder names the way out."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from sampler.static import unsupported
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    assert unsupported(tiny_lora) is None and unsupported(qwen3) is None
    assert "not gpt2" in unsupported(gpt2)
    with pytest.raises(NotImplementedError, match="decode='eager'"):
        StaticDecoder(gpt2, "nf4")
