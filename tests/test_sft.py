"""Tests for sft.py: the loss counts agent tokens only, resume continues exactly, the oracle
solves tasks of every scenario, and `python sft.py --smoke` runs end to end.

The loss and resume tests use a tiny random Llama (fast); the oracle test uses the bundled
tokenizer only; the smoke test runs the real script in a subprocess (~1 min).
"""
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kernels import passes
import rollout
import sft
from envs import ours

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_lora_model(lora_seed=0, vocab=64):
    torch.manual_seed(0)                        # the same base weights every time
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    base = LlamaForCausalLM(cfg)
    torch.manual_seed(lora_seed)
    model = rollout.add_lora(base, r=4, alpha=8)
    with torch.no_grad():                       # LoRA B starts at 0; make the adapter matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _loss(model, rows, share_prefix, n_tok=1):
    """sft.py's loss on rows (summed -log p over mask-1 tokens / n_tok), its gradient accumulated."""
    args = SimpleNamespace(micro_batch_size=1, max_len=64, share_prefix=share_prefix, grad_checkpointing="off")
    return sft.backward_batch(model, rows, args, pad=0, n_tok=n_tok)


@pytest.mark.parametrize("share_prefix", ["on", "off"])
def test_loss_matches_hand_computation_on_agent_tokens_only(share_prefix):
    model = tiny_lora_model()
    ids = torch.randint(3, 64, (2, 12))
    ids[1, :3] = ids[0, :3]                                       # a shared "system prompt" (run once when on)
    mask = torch.zeros_like(ids)
    mask[0, 4:7] = 1; mask[0, 10:12] = 1; mask[1, 3:6] = 1        # "assistant" spans
    rows = [{"token_ids": ids[0].tolist(), "loss_mask": mask[0].tolist()},
            {"token_ids": ids[1, :9].tolist(), "loss_mask": mask[1, :9].tolist()}]   # row 1 is shorter
    got = _loss(model, rows, share_prefix)
    with torch.no_grad():
        logp = [torch.log_softmax(model(input_ids=torch.tensor([r["token_ids"]])).logits[0].float(), -1)
                for r in rows]
    want = -sum(logp[b][t - 1, r["token_ids"][t]] for b, r in enumerate(rows) for t, m in enumerate(r["loss_mask"]) if m)
    all_tokens = -sum(logp[b][t - 1, r["token_ids"][t]] for b, r in enumerate(rows) for t in range(1, len(r["token_ids"])))
    print(f"masked loss {got:.6f} hand {want.item():.6f} (all tokens {all_tokens.item():.4f})")
    assert abs(got - want.item()) < 1e-4 * abs(want.item())
    assert abs(got - all_tokens.item()) > 1.0                     # the mask really drops tokens


@pytest.mark.parametrize("share_prefix", ["on", "off"])
def test_user_and_tool_tokens_contribute_nothing(share_prefix):
    """Changing the tokens of a trailing user/tool turn (mask 0) leaves loss and grads identical,
    and a masked-out position's target is never read: the loss is a function of agent targets only."""
    model = tiny_lora_model()
    ids = torch.randint(3, 64, (16,))
    mask = [0] * 5 + [1] * 5 + [0] * 6                            # assistant turn; 10: are user/tool tokens

    def loss_and_grads(x):
        model.zero_grad()
        loss = _loss(model, [{"token_ids": x.tolist(), "loss_mask": mask}], share_prefix)
        return loss, [p.grad.clone() for p in model.parameters() if p.requires_grad]

    l1, g1 = loss_and_grads(ids)
    other = ids.clone()
    other[10:] = torch.randint(3, 64, (6,))                      # different user / tool text after the turn
    l2, g2 = loss_and_grads(other)
    assert l1 == l2 and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert any(g.abs().sum() > 0 for g in g1)                     # and there is a gradient at all
    changed = ids.clone()
    changed[7] = (ids[7] + 1) % 64                                # an agent token: the loss must move
    assert loss_and_grads(changed)[0] != l1


def test_lr_schedule_warmup_then_decay():
    cos = [sft.lr_lambda(s, 2, 10, "cosine") for s in range(10)]
    lin = [sft.lr_lambda(s, 2, 10, "linear") for s in range(10)]
    assert cos[:3] == pytest.approx([1 / 3, 2 / 3, 1.0]) and lin[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert cos[6] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8))) and lin[6] == pytest.approx(0.5)
    assert all(a > b for a, b in zip(cos[2:], cos[3:])) and cos[-1] > 0


def _train_args(out, **kw):
    base = dict(out=str(out), epochs=2, batch_size=2, micro_batch_size=1, lr=1e-2, warmup_ratio=0.25,
                schedule="cosine", weight_decay=0.0, max_grad_norm=1.0, max_len=32, save_every=1,
                stop_after=None, max_steps=None, seed=3, share_prefix="on", grad_checkpointing="off")
    base.update(kw)
    return SimpleNamespace(**base)


def _rows(n=4, seed=0):
    """Conversations that share a 4-token "system prompt", as one domain's do."""
    g = torch.Generator().manual_seed(seed)
    system, rows = torch.randint(3, 64, (4,), generator=g).tolist(), []
    for i in range(n):
        T = 12 + 3 * i
        mask = [0] * 5 + [1] * (T - 8) + [0] * 3
        rows.append({"token_ids": system + torch.randint(3, 64, (T - 4,), generator=g).tolist(), "loss_mask": mask})
    return rows


def test_batches_hold_one_domain_and_cover_each_epoch():
    rows = [{"scenario": f"{d}/x", "i": i} for i, d in enumerate(["retail"] * 7 + ["airline"] * 5)]
    per_epoch = [sft.epoch_batches(rows, 2, seed=0, epoch=e) for e in range(3)]
    assert [len(b) for b in per_epoch] == [7, 7, 7]               # ceil(7/2) + ceil(5/2), every epoch
    for batches in per_epoch:
        assert sorted(j for b in batches for j in b) == list(range(12))          # each row once
        assert all(len({rows[j]["scenario"] for j in b}) == 1 for b in batches)  # one domain a batch
    assert per_epoch[0] != per_epoch[1]                           # reshuffled each epoch
    args = SimpleNamespace(epochs=3, batch_size=2, seed=0, max_steps=None)
    assert sft.total_steps(args, rows) == 21
    assert [r["i"] for r in sft.batch_rows(rows, 8, 2, 0)] == per_epoch[1][1]


def test_shared_prefix_training_equals_plain_training(tmp_path):
    """Two steps with the system prompt run once per batch, and two with it run per conversation:
    same losses, same weights (the shared-prefix gradient is exact)."""
    tok, rows = SimpleNamespace(pad_token_id=0), _rows()
    runs = {}
    for share in ["on", "off"]:
        model = tiny_lora_model()
        metrics = sft.train(_train_args(tmp_path / share, share_prefix=share, max_steps=2), model, tok, rows)
        runs[share] = [m["loss"] for m in metrics], [p.detach().clone() for p in model.parameters()]
    print("losses on", runs["on"][0], "off", runs["off"][0])
    assert runs["on"][0] == pytest.approx(runs["off"][0], rel=1e-5, abs=1e-7)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(runs["on"][1], runs["off"][1]))
    assert passes.shared_prefix_len([r["token_ids"] for r in rows], [r["loss_mask"] for r in rows]) == 4   # it was shared


def test_resume_continues_with_identical_state(tmp_path):
    tok, rows = SimpleNamespace(pad_token_id=0), _rows()
    full_model, resumed_model = tiny_lora_model(), tiny_lora_model(lora_seed=1)
    full = sft.train(_train_args(tmp_path / "a"), full_model, tok, rows)                 # 4 steps straight
    sft.train(_train_args(tmp_path / "b", stop_after=2), tiny_lora_model(), tok, rows)  # killed after 2
    resumed = sft.train(_train_args(tmp_path / "b"), resumed_model, tok, rows)  # other LoRA init: overridden
    assert [m["step"] for m in full] == [1, 2, 3, 4] == [m["step"] for m in resumed]
    for a, b in zip(full, resumed):
        print(f"step {a['step']}: loss {a['loss']:.6f} vs {b['loss']:.6f}, lr {a['lr']:.2e} vs {b['lr']:.2e}")
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["lr"] == b["lr"]
    assert full[-1]["loss"] < full[0]["loss"]                     # it learns at all
    for (n, a), (_, b) in zip(full_model.named_parameters(), resumed_model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n                 # same final weights
    ref = sft.train(_train_args(tmp_path / "a"), tiny_lora_model(), tok, rows)           # finished: no-op
    assert [m["loss"] for m in ref] == [m["loss"] for m in full]
    lines = open(tmp_path / "b" / "metrics.jsonl").read().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [1, 2, 3, 4]


def test_smoke_run(tmp_path):
    """The real default model on real oracle data, tiny: the easy scenarios' data seen in three epochs, so the loss
    on the same data can be seen to fall."""
    t0 = time.time()
    out = tmp_path / "sft"
    r = subprocess.run([sys.executable, "sft.py", "--smoke", "--out", str(out), "--tiers", "easy", "--epochs", "3",
                        "--max-steps", "6"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0
    stats = json.load(open(out / "data_stats.json"))
    assert stats["kept"] > 0 and stats["acceptance_rate"] > 0.5
    data = [json.loads(l) for l in open(out / "data.jsonl")]
    assert len(data) == stats["kept"] and data[0]["messages"][0]["role"] == "system" and data[0]["tools"]
    metrics = [json.loads(l) for l in open(out / "metrics.jsonl")]
    losses = [m["loss"] for m in metrics]
    print("losses", losses)
    per_epoch = len(losses) // 3
    assert len(losses) == 3 * per_epoch and per_epoch >= 1 and all(x > 0 for x in losses)
    assert sum(losses[-per_epoch:]) < 0.5 * sum(losses[:per_epoch])     # the third pass over the data against the first
    for f in ("adapter/adapter_config.json", "loss.png", "args.json"):
        assert (out / f).exists(), f
    print(f"smoke run {time.time() - t0:.0f} s")   # ~30 s on a quiet 2-core machine; minutes when shared


def test_teacher_path_talks_openai_chat_and_drops_failures(monkeypatch, tmp_path):
    """--teacher: the endpoint gets plain chat (system, user, tool results as user turns); a teacher
    that solves nothing yields no data and one clear error line."""
    import openai
    seen = []

    class FakeOpenAI:                       # stands in for any OpenAI-compatible server
        def __init__(self, **kw):
            self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

        def create(self, model, messages, **kw):
            seen.append(messages)
            return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="Let me think."))])

    monkeypatch.setattr(openai, "OpenAI", FakeOpenAI)
    args = sft.parse_args(["--teacher", "fake-model", "--out", str(tmp_path), "--domains", "airline",
                           "--max-turns", "3"])
    with pytest.raises(SystemExit, match="no conversation reached reward 1"):
        sft.make_data(args, rollout.load_tokenizer())
    stats = json.load(open(tmp_path / "data_stats.json"))
    assert stats["agent"] == "fake-model" and stats["kept"] == 0
    tiers = args.tiers.split(",")                 # the preset's tiers or scenarios: each of those, tasks_per_scenario times
    n_scenarios = len({t.scenario for t in ours.make_tasks("airline", "train", 50, tiers)})
    assert stats["tried"] == args.tasks_per_scenario * n_scenarios
    assert seen and seen[0][0]["role"] == "system" and "<tools>" in seen[0][0]["content"]
    assert {m["role"] for msgs in seen for m in msgs} <= {"system", "user", "assistant"}
