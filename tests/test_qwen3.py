"""The GPU code path on CPU: a tiny random Qwen3 (tests/tiny_qwen3.py) with Qwen3's special tokens and chat
template, loaded in bitsandbytes NF4 (fp32 compute on CPU), through the chat format, the sampler, the three
stages and scripts/bench_update.py --memory-check. Token-exactness with a template that rewrites earlier turns: Qwen3's drops
old think blocks when it re-renders a conversation; we never re-render, so what is trained is what was sampled.

Run:  pytest tests/test_qwen3.py -s     # ~1-2 min on 2 cores
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from envs import ours
import rollout
from kernels.passes import sequence_logprobs
from rollout import ChatFormat, run_episodes
from sampler import ModelAgent
from test_rollout import ScriptAgent
from tiny_qwen3 import QWEN3_TOKENS, save_tiny_qwen3

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMPTY_THINK = "<think>\n\n</think>\n\n"       # what Qwen3's template writes after the header when thinking is off


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="module")
def tok(qwen3_dir):
    return rollout.load_tokenizer(qwen3_dir)


def cancel_task():
    return next(t for t in ours.make_tasks("retail", "train", 14) if t.scenario == "cancel_order")


def qwen3_turn(role: str, content: str) -> str:
    """A user or tool turn as Qwen3 writes it after an assistant turn, then the next header (thinking off)."""
    body = f"<tool_response>\n{content}\n</tool_response>" if role == "tool" else content
    return f"\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n{EMPTY_THINK}"


def test_tokenizer_has_qwen3_tokens_and_its_template_renders_tools_and_the_think_block(tok):
    for t in QWEN3_TOKENS + ["<|im_start|>", "<|im_end|>"]:
        assert len(tok(t, add_special_tokens=False).input_ids) == 1, t        # one token each, as in Qwen3
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")  # pad != eos, unlike SmolLM2
    fmt = ChatFormat(tok)
    assert fmt.native and fmt.end_of_turn == "<|im_end|>"
    env = ours.Env(cancel_task())
    text = tok.decode(fmt.prompt_ids(env.policy, "Hi", env.tools))
    assert text.startswith("<|im_start|>system\n" + env.policy + "\n\n# Tools\n")
    assert text.count('{"type": "function", "function": {"name": ') == len(env.tools)   # the template's rendering
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK)
    thinking = ChatFormat(tok, thinking=True)
    assert tok.decode(thinking.prompt_ids(env.policy, "Hi", env.tools)).endswith("<|im_start|>assistant\n")
    assert tok.decode(thinking.delta_ids("user", "ok")) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(SystemExit, match="enable_thinking"):                 # SmolLM2's template has no thinking
        ChatFormat(rollout.load_tokenizer(), thinking=True)


def test_history_is_never_rerendered_although_the_template_rewrites_earlier_turns(tok):
    """Each assistant turn was sampled after an empty think block; those blocks stay in the token ids.
    Re-rendering the same conversation with Qwen3's template drops all but the last: the ids would no longer
    be what the policy saw."""
    task = cancel_task()
    find = {"name": "find_user_id_by_email", "arguments": {"email": task.hidden_facts["email"]}}
    script = ["Sure. What is your email?", f"<tool_call>\n{json.dumps(find)}\n</tool_call>", "Which order id is it?"]
    t = run_episodes(ScriptAgent(tok, script), tok, [task], max_turns=3, progress=False, max_context=8192)[0]
    env = ours.Env(task)
    assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "user", "assistant", "tool", "assistant", "user"]
    expected = tok.decode(ChatFormat(tok).prompt_ids(env.policy, t.messages[1]["content"], env.tools))
    for m, nxt in zip(t.messages[2::2], t.messages[3::2]):        # assistant turn, then the user/tool turn after it
        expected += m["content"] + "<|im_end|>" + qwen3_turn(nxt["role"], nxt["content"])
    text = tok.decode(t.token_ids)
    print(text[-700:])
    assert text == expected and text.count(EMPTY_THINK) == 4      # one per assistant header
    msgs = [{"role": "system", "content": env.policy}] + [{"role": m["role"], "content": m["content"]} for m in t.messages[1:]]
    rerendered = tok.apply_chat_template(msgs, tools=env.tools, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)
    assert rerendered == text.replace(EMPTY_THINK, "", 3)        # the earlier three think blocks are gone
    tool_call_id = tok.convert_tokens_to_ids("<tool_call>")
    trained = [i for i, m in zip(t.token_ids, t.loss_mask) if m]
    assert tool_call_id in trained and tok.convert_tokens_to_ids("<tool_response>") in t.token_ids
    assert tok.decode(trained) == "<|im_end|>".join(script) + "<|im_end|>"   # the empty think blocks are prompt


def test_sampled_logprobs_equal_training_logprobs_in_4bit(qwen3_dir, tok):
    """NF4 weights on CPU, the Qwen3 template: over several rounds, each sampled token's log-prob equals the
    training pass's log-prob of the same token in the stored ids, so training sees what sampling saw."""
    model, tok = rollout.load_model(qwen3_dir, load_in_4bit=True)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8 and isinstance(model.lm_head, torch.nn.Linear)
    tasks = [t for t in ours.make_tasks("retail", "train", 14)][:2]
    torch.manual_seed(0)
    trajs = run_episodes(ModelAgent(model, tok, temperature=1.0, max_new_tokens=5), tok, tasks, group_size=2,
                         max_turns=3, progress=False, max_context=8192)
    for t in trajs:
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            lp = sequence_logprobs(model, ids, torch.ones_like(ids), torch.tensor([t.loss_mask]))[0]
        m = torch.tensor(t.loss_mask).bool()
        diff = (lp[m] - torch.tensor(t.logprobs)[m]).abs().max().item()
        print(f"{t.task_id}: {t.turns} turns, {int(m.sum())} sampled tokens, max |sampled - training| log-prob {diff:.2e}")
        assert t.turns == 3 and diff < 1e-4
        assert tok.decode(t.token_ids).count("<|im_start|>assistant\n" + EMPTY_THINK) == 4   # 3 turns + the next header


def test_thinking_mode_trains_on_the_reasoning_and_users_never_see_it(tok):
    task = cancel_task()
    reasoning = "<think>\nI need the email. I must not <tool_call>{\"name\": \"cancel_pending_order\"}</tool_call> yet.\n</think>\n\n"
    script = [reasoning + "Could you give me your email?", "<think>\nok\n</think>\n\nThanks."]
    agent = ScriptAgent(tok, script)
    agent.fmt = ChatFormat(tok, thinking=True)                  # what ModelAgent(..., thinking=True) holds
    t = run_episodes(agent, tok, [task], max_turns=2, progress=False, max_context=8192)[0]
    text = tok.decode(t.token_ids)
    assert EMPTY_THINK not in text and text.count("<|im_start|>assistant\n<think>\n") == 2
    assert tok.decode([i for i, m in zip(t.token_ids, t.loss_mask) if m]) == "<|im_end|>".join(script) + "<|im_end|>"
    assert t.stats["tool_calls"] == 0 and t.stats["malformed_calls"] == 0     # a call inside the reasoning is no call
    assert task.hidden_facts["email"] in t.messages[3]["content"]             # the user answered the visible question


def test_sft_rl_eval_run_on_tiny_qwen3_in_4bit_with_checkpointing(qwen3_dir, tmp_path, monkeypatch):
    """The three stages as a GPU run would use them (--load-in-4bit, activation checkpointing, the
    tokenizer's own template, a KV budget that makes the sampler decode in waves), at tiny sizes. A random
    model never earns a reward, so rl.py would train on nothing: here a rollout's reward is 1 when the
    first token it sampled has an odd id, which gives groups with reward variance and real GRPO updates
    through the NF4 layers."""
    import eval as ev
    import rl
    import sft
    from sampler.attention import kv_bytes_per_token
    loaded, load = [], rollout.load_model
    monkeypatch.setattr(rollout, "load_model", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    waves, act = [], ModelAgent.act
    monkeypatch.setattr(ModelAgent, "act", lambda self, batch: (act(self, batch), waves.append(len(self.waves)))[0])
    model = ["--model", qwen3_dir, "--load-in-4bit"]
    sft.main(["--smoke", "--out", str(tmp_path / "sft"), "--grad-checkpointing", "on", "--domains", "retail",
              "--max-len", "2400", *model])
    sft_metrics = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    assert sft_metrics and all(m["loss"] > 0 and m["trained_tokens"] > 0 for m in sft_metrics)

    run = rollout.run_episodes

    def run_and_score(*a, **k):
        trajs = run(*a, **k)
        for t in trajs:
            t.reward = float(t.token_ids[t.loss_mask.index(1)] % 2)
        return trajs
    monkeypatch.setattr(rollout, "run_episodes", run_and_score)
    env, tok = ours.Env(cancel_task()), loaded[0][1]
    P = len(ChatFormat(tok).prompt_ids(env.policy, "", env.tools))           # about the prefix the rows share
    budget = (2 * P + 300) * kv_bytes_per_token(loaded[0][0].config, torch.float32)   # once rows grow: < 4 a wave
    metrics = rl.main(["--smoke", "--init", str(tmp_path / "sft" / "adapter"), "--out", str(tmp_path / "rl"),
                       "--grad-checkpointing", "on", "--steps", "1", "--group-size", "4", "--max-turns", "2",
                       "--max-new-tokens", "6",
                       "--kv-budget", str(budget / 2**30), *model])
    metrics = [m for m in metrics if "reward" in m]             # not the held-out entries (step 0)
    print("rl:", [(m["reward"], m["train_tokens"], round(m["grad_norm"], 4)) for m in metrics], "waves per round:", waves)
    assert len(metrics) == 1 and metrics[0]["train_tokens"] > 0 and metrics[0]["grad_norm"] > 0
    assert max(waves) > 1
    assert json.load(open(tmp_path / "rl" / "args.json"))["grad_checkpointing"] == "on"
    monkeypatch.setattr(rollout, "run_episodes", run)
    results = ev.main(["--smoke", "--agents", str(tmp_path / "rl" / "adapter"), "--out", str(tmp_path / "eval"),
                       "--domains", "retail", *model])
    assert len(results) == 1 and (tmp_path / "eval" / "results.md").exists()
    assert len(loaded) == 3                                      # sft, rl, eval
    for m, _ in loaded:
        base = m.get_base_model() if hasattr(m, "get_base_model") else m
        assert type(base.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"


def test_memory_check_runs_on_cpu_at_tiny_qwen3_shapes():
    out = subprocess.run([sys.executable, "scripts/bench_update.py", "--memory-check"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("memory-check (cpu)"))
    print(line)
    assert "2x256 tokens" in line and "256 trained tokens" in line
    assert float(line.split("grad norm ")[1].split(",")[0]) > 0


def test_memory_check_model_is_nf4_with_lora_on_every_decoder_projection():
    from scripts.bench_update import nf4_lora_model, qwen3_shapes
    model = nf4_lora_model(qwen3_shapes(tiny=True), "cpu")
    modules = dict(model.named_modules())
    nf4 = [n for n, m in modules.items() if type(m).__name__ == "Linear4bit"]     # peft keeps each as base_layer
    assert len(nf4) == 2 * 7 and all(modules[n].weight.dtype == torch.uint8 for n in nf4)   # 7 projections a layer
    lora = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert lora == {n.rsplit(".base_layer", 1)[0] for n in nf4}
    assert type(modules["base_model.model.lm_head"]) is torch.nn.Linear
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
