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

import envs
import rollout
import sft

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


def test_loss_matches_hand_computation_on_agent_tokens_only():
    model = tiny_lora_model()
    ids = torch.randint(3, 64, (2, 12))
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0                                               # row 1 is right-padded
    mask = torch.zeros_like(ids)
    mask[0, 4:7] = 1; mask[0, 10:12] = 1; mask[1, 3:6] = 1        # "assistant" spans
    got = sft.sft_loss_sum(model, ids, attn, mask)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    want = -sum(logp[b, t - 1, ids[b, t]] for b in range(2) for t in range(12) if mask[b, t])
    all_tokens = -sum(logp[b, t - 1, ids[b, t]] for b in range(2) for t in range(1, 12) if attn[b, t])
    print(f"masked loss {got.item():.6f} hand {want.item():.6f} (all tokens {all_tokens.item():.4f})")
    assert abs(got.item() - want.item()) < 1e-4 * abs(want.item())
    assert abs(got.item() - all_tokens.item()) > 1.0              # the mask really drops tokens


def test_user_and_tool_tokens_contribute_nothing():
    """Changing the tokens of a trailing user/tool turn (mask 0) leaves loss and grads identical,
    and a masked-out position's target is never read: the loss is a function of agent targets only."""
    model = tiny_lora_model()
    ids = torch.randint(3, 64, (1, 16))
    mask = torch.zeros_like(ids)
    mask[0, 5:10] = 1                                             # assistant turn; 10: are user/tool tokens
    attn = torch.ones_like(ids)

    def loss_and_grads(x):
        model.zero_grad()
        loss = sft.sft_loss_sum(model, x, attn, mask)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    l1, g1 = loss_and_grads(ids)
    other = ids.clone()
    other[0, 10:] = torch.randint(3, 64, (6,))                   # different user / tool text after the turn
    other[0, :5] = other[0, :5]                                   # (prefix kept: it is context for the turn)
    l2, g2 = loss_and_grads(other)
    assert l1 == l2 and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert any(g.abs().sum() > 0 for g in g1)                     # and there is a gradient at all
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % 64                          # an agent token: the loss must move
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
                stop_after=None, max_steps=None, seed=3)
    base.update(kw)
    return SimpleNamespace(**base)


def _rows(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        T = 12 + 3 * i
        mask = [0] * 5 + [1] * (T - 8) + [0] * 3
        rows.append({"token_ids": torch.randint(3, 64, (T,), generator=g).tolist(), "loss_mask": mask})
    return rows


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


def test_oracle_solves_tasks_of_every_scenario():
    for key, words in envs.FACT_KEYWORDS.items():                 # its questions use the user's keywords
        assert any(w in sft.QUESTIONS.get(key, words[0]) for w in words), key
    tok = rollout.load_tokenizer()
    agent = sft.OracleAgent(tok, seed=0)
    for domain in envs.DOMAINS:
        tasks = envs.make_tasks(domain, "train", 3 * len(envs.SCENARIOS[domain]), seed=5)   # 3 per scenario
        trajs = rollout.run_episodes(agent, tok, tasks, user="scripted", seed=0, progress=False)
        bad = [(t.task_id, t.scenario, t.stop_reason, t.diff[:200]) for t in trajs if t.reward != 1.0]
        print(domain, f"{len(trajs) - len(bad)}/{len(trajs)} solved")
        assert not bad, bad
        for t in trajs:                                           # the agent's tokens, and only them, are trained
            assert len(t.loss_mask) == len(t.token_ids) and 0 < sum(t.loss_mask) < len(t.token_ids)


def test_smoke_run(tmp_path):
    t0 = time.time()
    out = tmp_path / "sft"
    r = subprocess.run([sys.executable, "sft.py", "--smoke", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0
    stats = json.load(open(out / "data_stats.json"))
    assert stats["kept"] > 0 and stats["acceptance_rate"] > 0.5
    data = [json.loads(l) for l in open(out / "data.jsonl")]
    assert len(data) == stats["kept"] and data[0]["messages"][0]["role"] == "system" and data[0]["tools"]
    metrics = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert metrics and all(m["loss"] > 0 for m in metrics)
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
    assert stats["tried"] == args.tasks_per_scenario * len(envs.SCENARIOS["airline"])
    assert seen and seen[0][0]["role"] == "system" and "<tools>" in seen[0][0]["content"]
    assert {m["role"] for msgs in seen for m in msgs} <= {"system", "user", "assistant"}
