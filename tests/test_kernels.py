"""Tests for kernels/: the Triton kernel (under TRITON_INTERPRET=1 on CPU) and the torch reference,
both against an fp64 evaluation of the reference on the same input values.

Run:  .venv/bin/pytest tests/test_kernels.py -s      (-s shows each test's max difference)

Tolerances, |got - want| <= atol + rtol * |want|:
  values       fp32 out for every input dtype (math is fp32): atol 1e-5, rtol 1e-5
  gradients    fp32: atol 1e-5, rtol 1e-5;  fp16 (stored fp16, unit roundoff 4.9e-4): rtol 1e-3;
               bf16 (stored bf16, unit roundoff 3.9e-3): rtol 8e-3;  atol 1e-5 for both.
The fp64 reference is computed from the already-rounded half-precision logits, so the bounds
measure only the kernel's arithmetic, not the input rounding. (Triton's interpreter casts fp32 to
bf16 by truncation, error < 2**-7 relative, where the GPU rounds to nearest; 8e-3 covers both.)
"""
import os
import subprocess
import sys

import pytest
import torch

from kernels import logprobs_torch, masked_logprobs, masked_logprobs_chunked
from kernels.logprobs import HAVE_TRITON
from kernels.passes import MicroBatch, sequence_logprobs, shared_prefix_pass

IMPLS = ["triton", "torch"] if HAVE_TRITON else ["torch"]
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
ATOL, VALUE_RTOL = 1e-5, 1e-5


def assert_close(name, got, want, rtol, atol=ATOL):
    """Same non-finite pattern (NaN where NaN, same infinities); finite entries within atol + rtol*|want|."""
    got, want = got.detach().double(), want.detach().double()
    assert torch.equal(got.isnan(), want.isnan()), f"{name}: NaN pattern differs"
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf]), f"{name}: inf pattern differs"
    fin = want.isfinite()
    diff = (got[fin] - want[fin]).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    print(f"{name}: max |diff| = {worst:.3g}")
    assert (diff <= atol + rtol * want[fin].abs()).all(), f"{name}: max |diff| {worst:.3g} over the bound"
    return worst


def make_logits(N, V, dtype, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=gen) * scale).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[0], targets[1] = 0, V - 1  # both ends of the vocabulary
    return logits, targets, torch.randn(N, generator=gen)  # last: upstream gradient


def run_both(logits, targets, mask, temperature, impl, grad_out):
    """-> (out, grad) from the implementation under test and (out, grad) from the fp64 reference."""
    x = logits.clone().requires_grad_()
    out = masked_logprobs(x, targets, mask, temperature, impl=impl)
    out.backward(grad_out)
    x64 = logits.double().requires_grad_()
    ref = logprobs_torch(x64, targets.clamp(min=0), mask, temperature)  # -100 on masked rows is ignored
    ref.backward(grad_out.double())
    assert out.dtype == torch.float32 and x.grad.dtype == logits.dtype
    return out, x.grad, ref, x64.grad


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("V", [1000, 4096, 4097, 5003])
def test_values_and_grads_match_fp64(V, dtype, impl):
    N = 17  # odd
    logits, targets, g = make_logits(N, V, dtype, seed=V)
    mask = torch.rand(N, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[:2] = True  # keep the label-0 and label-(V-1) rows
    temperature = 0.7 if V % 2 else 1.0
    out, grad, ref, ref_grad = run_both(logits, targets, mask, temperature, impl, g)
    tag = f"{impl} V={V} {dtype} T={temperature}"
    assert_close(f"{tag} values", out, ref, VALUE_RTOL)
    assert_close(f"{tag} grads", grad, ref_grad, GRAD_RTOL[dtype])
    assert (out[~mask] == 0).all() and (grad[~mask] == 0).all()


def spans_mask(N):
    mask = torch.zeros(N, dtype=torch.bool)
    mask[3:9] = True  # like two assistant turns between user/tool tokens
    mask[15:27] = True
    return mask


MASKS = {"all0": lambda N: torch.zeros(N, dtype=torch.bool), "all1": lambda N: torch.ones(N, dtype=torch.bool),
         "random": lambda N: torch.rand(N, generator=torch.Generator().manual_seed(2)) < 0.5, "spans": spans_mask}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", list(MASKS))
def test_mask_kinds(kind, impl):
    N, V = 31, 4097
    logits, targets, g = make_logits(N, V, torch.float32, seed=7)
    mask = MASKS[kind](N)
    targets = torch.where(mask, targets, torch.full_like(targets, -100))  # masked targets are ignored
    out, grad, ref, ref_grad = run_both(logits, targets, mask, 1.3, impl, g)
    assert_close(f"{impl} mask={kind} values", out, ref, VALUE_RTOL)
    assert_close(f"{impl} mask={kind} grads", grad, ref_grad, GRAD_RTOL[torch.float32])
    assert (out[~mask] == 0).all()
    assert (grad[~mask] == 0).all() and not grad[~mask].signbit().any()  # exactly +0
    if kind == "all1":
        assert (out < 0).all()


def extreme_batch(V, dtype):
    """Rows with +-1e4 and -inf logits; see kernels/logprobs.py 'Special values'."""
    logits, targets, g = make_logits(8, V, torch.float32, seed=3)
    neg_inf = float("-inf")
    logits[0, targets[0]] = 1e4                       # huge target logit: log-prob ~ 0
    logits[1, ::3] = 1e4                              # target (V-1) far below the max: log-prob ~ -2e4
    logits[1, targets[1]] = -1e4
    logits[2] = neg_inf                               # only the target is finite: log-prob exactly 0
    logits[2, targets[2]] = 1.5
    logits[3, targets[3]] = neg_inf                   # -inf at the target: log-prob -inf
    logits[4, ::2] = neg_inf                          # a mix of +-1e4 and -inf
    logits[4, 1::4] = 1e4
    logits[4, 3::4] = -1e4
    logits[4, targets[4]] = 1e4 - 3
    logits[5] = neg_inf                               # an all -inf row, masked: 0, exactly 0 grad
    logits[6, targets[6]] = neg_inf                   # -inf at a masked row's target
    mask = torch.tensor([1, 1, 1, 1, 1, 0, 0, 1], dtype=torch.bool)
    return logits.to(dtype), targets, mask, g


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_extreme_logits(dtype, impl):
    logits, targets, mask, g = extreme_batch(4097, dtype)
    out, grad, ref, ref_grad = run_both(logits, targets, mask, 0.8, impl, g)
    assert_close(f"{impl} extreme {dtype} values", out, ref, VALUE_RTOL)
    assert_close(f"{impl} extreme {dtype} grads", grad, ref_grad, GRAD_RTOL[dtype])
    assert out[2] == 0 and (grad[2] == 0).all()       # only the target finite
    assert out[3] == float("-inf")                    # -inf at the target
    assert abs(out[0]) < 1e-6 and out[1] < -2e4
    assert torch.isfinite(grad).all(), "no NaN/inf may reach any gradient"
    assert (out[~mask] == 0).all() and (grad[~mask] == 0).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter: log(0), inf - inf
@pytest.mark.parametrize("impl", IMPLS)
def test_all_neg_inf_row_is_nan_only_in_that_row(impl):
    logits, targets, g = make_logits(5, 1000, torch.float32, seed=4)
    logits[2] = float("-inf")
    mask = torch.ones(5, dtype=torch.bool)
    out, grad, ref, ref_grad = run_both(logits, targets, mask, 1.0, impl, g)
    assert out[2].isnan() and grad[2].isnan().all()
    keep = torch.tensor([0, 1, 3, 4])
    assert_close(f"{impl} other rows values", out[keep], ref[keep], VALUE_RTOL)
    assert_close(f"{impl} other rows grads", grad[keep], ref_grad[keep], GRAD_RTOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_logits(impl):
    """Rows with a stride > V (a slice of a wider buffer) and a column-major view."""
    N, V = 9, 1000
    wide, targets, g = make_logits(N, V + 24, torch.float32, seed=5)
    targets = targets.clamp(max=V - 1)
    mask = torch.ones(N, dtype=torch.bool)
    for name, logits in [("row stride V+24", wide[:, :V]), ("transposed", wide[:, :V].T.contiguous().T)]:
        out = masked_logprobs(logits, targets, mask, impl=impl)
        ref = logprobs_torch(logits.double(), targets, mask)
        assert_close(f"{impl} {name}", out, ref, VALUE_RTOL)


def test_bad_impl_is_a_clear_error():
    logits, targets, _ = make_logits(3, 10, torch.float32, seed=0)
    with pytest.raises(ValueError, match="impl must be"):
        masked_logprobs(logits, targets, torch.ones(3, dtype=torch.bool), impl="cuda")


# ---------------------------------------------------------------------------------------------
# Chunked path: from hidden states and the lm_head weight.

def chunked_case(N, H, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / H ** 0.5 * 3).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    mask = spans_mask(N)
    return hidden, weight, targets, mask, torch.randn(N, generator=gen)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_matches_plain(dtype, impl):
    N, H, V = 29, 16, 4097
    hidden, weight, targets, mask, g = chunked_case(N, H, V, dtype, seed=11)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = masked_logprobs_chunked(h1, w1, targets, mask, temperature=0.9, chunk=5, impl=impl)
    out.backward(g)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = masked_logprobs(h2 @ w2.T, targets, mask, temperature=0.9, impl="torch")  # full (N, V) logits
    ref.backward(g)
    # fp32: both paths round the same matmuls; bf16: the chunked path accumulates the weight gradient
    # in fp32 while the plain one rounds the (N, V) logits gradient to bf16 first, so allow bf16 noise
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    atol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert_close(f"chunked {impl} {dtype} values", out, ref, rtol, atol)
    assert_close(f"chunked {impl} {dtype} d/dhidden", h1.grad, h2.grad, rtol, atol)
    assert_close(f"chunked {impl} {dtype} d/dweight", w1.grad, w2.grad, rtol, atol)
    assert (out[~mask] == 0).all() and (h1.grad[~mask] == 0).all()


def test_chunked_head_stays_fp32_under_bf16_autocast():
    """rl.py --train-bf16 runs the body under bf16 autocast; the chunked head turns it off for itself, in the
    forward and in the backward (which recomputes the logits, and runs inside the caller's autocast):
    values and gradients are exactly the fp32 ones, not bf16-rounded."""
    hidden, weight, targets, mask, g = chunked_case(29, 16, 4097, torch.float32, seed=12)
    grads = {}
    for bf16 in (False, True):
        h = (hidden * 8).clone().requires_grad_()          # logits of ~10-30, as a trained model's
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = masked_logprobs_chunked(h, weight, targets, mask, temperature=0.7, chunk=5, impl="torch")
            out.backward(g)
        grads[bf16] = out.detach(), h.grad
    assert torch.equal(grads[True][0], grads[False][0]) and torch.equal(grads[True][1], grads[False][1])


def test_chunked_never_materialises_full_logits():
    """Record every tensor produced during forward + backward: none may have more than `chunk` rows of V."""
    from torch.utils._python_dispatch import TorchDispatchMode

    N, H, V, chunk = 40, 4, 1000, 6  # H < chunk so the (H, V) view weight.T stays under the bar
    hidden, weight, targets, mask, g = chunked_case(N, H, V, torch.float32, seed=12)
    hidden.requires_grad_()
    rows_of_v = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in result if isinstance(result, (tuple, list)) else [result]:
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == V:
                    rows_of_v.append(t.shape[0])
            return result

    with Record():
        masked_logprobs_chunked(hidden, weight, targets, mask, chunk=chunk, impl="torch").backward(g)
    print(f"largest (rows, V) tensor seen: {max(rows_of_v)} rows (chunk={chunk}, N={N})")
    assert max(rows_of_v) == chunk  # the recorder saw the chunks, and nothing bigger


# ---------------------------------------------------------------------------------------------
# sequence_logprobs on a tiny Llama, plain and LoRA-wrapped.

@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 257, (3, 14), generator=gen)
    attn = torch.ones(3, 14, dtype=torch.long)
    attn[1, 10:] = 0  # right padding: real tokens start at position 0
    attn[2, 6:] = 0
    loss = attn.clone()
    loss[:, :4] = 0  # "prompt" tokens are not trained on
    return model, ids, attn, loss


def full_logits_reference(model, ids, attn, loss, temperature=1.0):
    logits = model(input_ids=ids, attention_mask=attn).logits.double() / temperature  # (B, T, V)
    ref = torch.zeros(ids.shape, dtype=torch.float64)
    ref[:, 1:] = logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(2)
    return ref * loss


def test_sequence_logprobs_matches_full_logits(tiny_llama):
    model, ids, attn, loss = tiny_llama
    with torch.no_grad():
        out = sequence_logprobs(model, ids, attn, loss, temperature=0.8, chunk=4)
        ref = full_logits_reference(model, ids, attn, loss, temperature=0.8)
    assert out.shape == ids.shape and out.dtype == torch.float32
    assert_close("sequence_logprobs vs full logits", out, ref, 1e-5)
    assert (out[loss == 0] == 0).all() and (out[loss == 1] < 0).all()


def test_sequence_logprobs_left_padding_gives_same_positions(tiny_llama):
    """The sampler left-pads; the trainer right-pads. Both must give the same log-probs."""
    model, ids, attn, loss = tiny_llama
    lengths = attn.sum(1)
    left_ids, left_attn, left_loss = torch.zeros_like(ids), torch.zeros_like(attn), torch.zeros_like(loss)
    T = ids.shape[1]
    for b, n in enumerate(lengths.tolist()):
        left_ids[b, T - n:], left_attn[b, T - n:], left_loss[b, T - n:] = ids[b, :n], attn[b, :n], loss[b, :n]
    with torch.no_grad():
        right = sequence_logprobs(model, ids, attn, loss)
        left = sequence_logprobs(model, left_ids, left_attn, left_loss)
    for b, n in enumerate(lengths.tolist()):
        assert_close(f"left vs right padding, row {b}", left[b, T - n:], right[b, :n], 1e-5)


def test_sequence_logprobs_lora_and_reference_policy(tiny_llama):
    from peft import LoraConfig, get_peft_model
    model, ids, attn, loss = tiny_llama
    with torch.no_grad():
        base = sequence_logprobs(model, ids, attn, loss)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  init_lora_weights=False))  # random B: LoRA changes outputs
    try:
        policy = sequence_logprobs(peft_model, ids, attn, loss)
        with peft_model.disable_adapter(), torch.no_grad():
            reference = sequence_logprobs(peft_model, ids, attn, loss)
        with torch.no_grad():
            ref_policy = full_logits_reference(peft_model, ids, attn, loss)
        assert_close("LoRA disabled == base model", reference, base, 1e-5)
        assert_close("LoRA policy vs full logits", policy, ref_policy, 1e-5)
        assert (policy - base).abs().max() > 1e-3  # the adapter is really active
        (-policy.sum()).backward()
        lora_grads = [p.grad for n, p in peft_model.named_parameters() if "lora_" in n]
        assert lora_grads and all(g is not None and torch.isfinite(g).all() for g in lora_grads)
        assert any(g.abs().max() > 0 for g in lora_grads)
        assert all(p.grad is None for n, p in peft_model.named_parameters() if "lora_" not in n)
    finally:
        peft_model.unload()  # leave the shared fixture model as it was


def backward_with_prefix_once(model, prefix, micro_batches, n_tok) -> list[float]:
    """sft.py's and rl.py's fast pass: the prefix once (passes.shared_prefix_pass), each micro-batch's loss
    backpropagated before the next."""
    micro = [MicroBatch([], ids, attn, mask, "one key", prefix) for ids, attn, mask in micro_batches]
    losses = []
    with shared_prefix_pass(model) as logprobs:
        for b in micro:
            loss = -logprobs(b).sum() / n_tok
            loss.backward()
            losses.append(loss.item())
    return losses


def test_the_prefix_run_once_gives_the_full_gradient(tiny_llama):
    """Prefix once + suffixes against its detached keys/values + one prefix backward == a full
    forward/backward per sequence: same losses, same LoRA gradients (incl. through the prefix)."""
    from peft import LoraConfig, get_peft_model
    model, _, _, _ = tiny_llama
    torch.manual_seed(2)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  init_lora_weights=False))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(3)
    P, lengths = 9, [20, 15, 17]
    prefix = torch.randint(0, 257, (P,), generator=gen)
    rows = [torch.cat([prefix, torch.randint(0, 257, (n - P,), generator=gen)]) for n in lengths]
    masks = [(torch.rand(n, generator=gen) < 0.6).long() for n in lengths]
    for m in masks:
        m[:P + 1] = 0                                    # the prompt and the first suffix token are not trained
    n_tok = sum(int(m.sum()) for m in masks)
    try:
        want = 0.0                                       # one full forward/backward per sequence
        for ids, m in zip(rows, masks):
            loss = -sequence_logprobs(peft_model, ids[None], torch.ones(1, len(ids)), m[None]).sum() / n_tok
            loss.backward()
            want += loss.item()
        want_grads = [p.grad.clone() for p in params]
        peft_model.zero_grad(set_to_none=True)
        batches = [(rows[0][None, P:], torch.ones(1, lengths[0] - P, dtype=torch.long), masks[0][None, P:])]
        T = max(lengths[1:]) - P                         # rows 1 and 2 as one right-padded micro-batch
        ids, attn, m = (torch.zeros(2, T, dtype=torch.long) for _ in range(3))
        for b, j in enumerate([1, 2]):
            n = lengths[j] - P
            ids[b, :n], attn[b, :n], m[b, :n] = rows[j][P:], 1, masks[j][P:]
        batches.append((ids, attn, m))
        got = backward_with_prefix_once(peft_model, prefix, batches, n_tok)
        assert abs(sum(got) - want) < 1e-5, (got, want)
        for k, (g, w) in enumerate(zip([p.grad for p in params], want_grads)):
            assert_close(f"LoRA grad {k}", g, w, 1e-4)
        assert max(w.abs().max() for w in want_grads) > 1e-3          # gradients are not trivially zero
        with pytest.raises(ValueError, match="loss_mask"):           # a trained first token is refused
            backward_with_prefix_once(peft_model, prefix, [(ids, attn, torch.ones_like(m))], n_tok)
    finally:
        peft_model.unload()


# ---------------------------------------------------------------------------------------------
# The GPU code path, checked without a GPU: compile both kernels for an H100 (sm_90).

SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import logprobs as K
common = {"targets_ptr": "*i64", "mask_ptr": "*u8", "max_ptr": "*fp32", "logz_ptr": "*fp32",
          "V": "i32", "inv_temp": "fp32", "BLOCK": "constexpr", "stride_row": "i64"}
signatures = [dict(common, logits_ptr="*bf16", out_ptr="*fp32"),
              dict(common, logits_ptr="*bf16", grad_logits_ptr="*bf16", grad_stride_row="i64", grad_out_ptr="*fp32")]
for fn, sig in zip([K._logprobs_fwd_kernel, K._logprobs_bwd_kernel], signatures):
    src = ASTSource(fn=fn, signature={name: sig[name] for name in fn.arg_names}, constexprs={"BLOCK": 4096})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": True})
    print(f"{fn.__name__}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")
"""


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_kernels_compile_for_sm90():
    """In a fresh process without TRITON_INTERPRET: the interpreter that runs the kernels on CPU in this
    process replaces triton.language's tensor methods, and the real compiler cannot work through them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", SM90_COMPILE], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode and "ptxas" in r.stderr:
        pytest.skip(f"no ptxas in this triton install: {r.stderr[-300:]}")
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    sizes = [int(line.split(": ")[1].split()[0]) for line in r.stdout.splitlines() if "sm_90 cubin" in line]
    assert len(sizes) == 2 and min(sizes) > 0


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1)])
def test_packed_prefill_attention_equals_attention_over_each_whole_row(heads, kv_heads):
    """sampler.attention's packed prefill: the new tokens of rows of different lengths in one sequence, each row
    with its own cached tokens (none for one of them), attending the shared prefix once for all rows and merging
    it with the row's own part by log-sum-exp. Each row must equal plain causal attention over its whole
    [prefix ; cached ; new] with the kv heads repeated (transformers' SDPA path)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from sampler.attention import Packed, packed_prefill_attention
    torch.manual_seed(0)
    P, D, g = 7, 8, heads // kv_heads
    module = SimpleNamespace(layer_idx=0, is_causal=True, num_key_value_groups=g, training=False)
    pk, pv = torch.randn(1, kv_heads, P, D), torch.randn(1, kv_heads, P, D)
    new, cached = [3, 1, 5], [4, 0, 6]                      # per row: new tokens, cached own tokens
    T = sum(new)
    q, k, v = torch.randn(1, heads, T, D), torch.randn(1, kv_heads, T, D), torch.randn(1, kv_heads, T, D)
    own = [(torch.randn(1, kv_heads, c, D), torch.randn(1, kv_heads, c, D)) for c in cached]
    ends = torch.tensor(new).cumsum(0).tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    masks = [torch.zeros(g * n, c + n).masked_fill_(~torch.ones(n, c + n, dtype=torch.bool).tril(c).repeat(g, 1),
                                                     float("-inf"))[None, None] for n, c in zip(new, cached)]
    layout = Packed(bounds, [[([ok], [ov])] for ok, ov in own], masks, [(pk, pv)])
    got = packed_prefill_attention(module, q, k, v, None, scaling=D ** -0.5, packed=layout)[0]
    assert got.shape == (1, T, heads, D)
    for (s, e), (ok, ov), c in zip(bounds, own, cached):
        n = e - s
        whole = torch.ones(1, 1, n, P + c + n, dtype=torch.bool).tril(P + c)      # new token i sees keys <= P + c + i
        want = sdpa_attention_forward(module, q[:, :, s:e], torch.cat([pk, ok, k[:, :, s:e]], 2),
                                      torch.cat([pv, ov, v[:, :, s:e]], 2), whole, scaling=D ** -0.5)[0]
        assert_close(f"packed row {s}:{e}", got[:, s:e], want, rtol=1e-5, atol=1e-6)
