"""scripts/rl_trl.py: TRL's GRPOTrainer driving our world through rollout_func, on a tiny random Qwen3 (tests/tiny_qwen3.py)
with real retail and airline envs and the scripted user.

What is checked: the ids and masks TRL trains on are the Trajectory's, token for token, and the reward is Env.reward;
the one private TRL call (rl_trl.generate_turn) returns what TRLAgent assumes; under torchrun (2 CPU processes, gloo)
each rank rolls out whole groups and ends with the same LoRA weights; from an SFT adapter the KL of step 1 is 0 and
the reference stays the SFT adapter while the policy moves.

Run:  pytest tests/test_rl_trl.py -s            # ~1 min on 2 cores
      pytest tests/test_rl_trl.py -m slow -s    # torchrun, and the KL from an SFT adapter
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")

from scripts import rl_trl     # noqa: E402
import rollout    # noqa: E402
import envs     # noqa: E402
from tiny_qwen3 import save_tiny_qwen3   # noqa: E402
from users import visible_text           # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3")))


def smoke(model, out, *extra):
    """The smoke preset on one retail and one airline task (the first easy train task of each: --task-pool 1)."""
    return rl_trl.parse_args(["--smoke", "--model", model, "--out", str(out), "--init", "base", "--task-pool", "1",
                              *extra])


def rewards_by_trial(monkeypatch):
    """Rollout t of every group scores t % 2: each group has reward variance, so a step moves the weights (a random
    tiny model never solves a task)."""
    real = rollout.run_episodes

    def run(*a, **k):
        trajs = real(*a, **k)
        for t in trajs:
            t.reward = float(t.trial % 2)
        return trajs
    monkeypatch.setattr(rollout, "run_episodes", run)


@pytest.fixture(scope="module")
def one_step(tiny, tmp_path_factory):
    """One GRPOTrainer step; captures the trajectories, what rollout_func returned and the batch TRL built from it."""
    seen = {}
    real = rollout.run_episodes

    def run(*a, **k):
        seen["trajs"] = real(*a, **k)
        return seen["trajs"]
    rollout.run_episodes = run
    try:
        trainer = rl_trl.build_trainer(smoke(tiny, tmp_path_factory.mktemp("one-step")))
        func, score = trainer.rollout_func, trainer._generate_and_score_completions

        def rollout_func(prompts, tr):
            seen["prompts"], seen["out"] = list(prompts), func(prompts, tr)
            return seen["out"]

        def generate_and_score(inputs):
            seen["batch"] = score(inputs)
            return seen["batch"]
        trainer.rollout_func, trainer._generate_and_score_completions = rollout_func, generate_and_score
        trainer.train()
    finally:
        rollout.run_episodes = real
    return trainer, seen


def test_trl_trains_on_the_trajectory_ids_and_masks_token_for_token(one_step):
    trainer, seen = one_step
    trajs, out, batch = seen["trajs"], seen["out"], seen["batch"]
    assert len(trajs) == 4 and {t.domain for t in trajs} == {"retail", "airline"}     # 2 tasks x G = 2
    assert seen["prompts"] == [t.task_id for t in trajs]                                # whole groups, in order
    for i, t in enumerate(trajs):
        prompt, completion = out["prompt_ids"][i], out["completion_ids"][i]
        assert prompt + completion == t.token_ids
        assert out["env_mask"][i] == t.loss_mask[len(prompt):] and not any(t.loss_mask[:len(prompt)])
        env = envs.make_env(next(x for x in envs.make_tasks(t.domain, "train", 1, ["easy"]) if x.id == t.task_id))
        fmt = rollout.ChatFormat(trainer.processing_class)     # the prompt = system prompt + the first user message
        assert prompt == fmt.prompt_ids(env.policy, t.messages[1]["content"], env.tools)
        # TRL's batch: left-padded prompts, right-padded completions; what it trains is completion_mask * tool_mask
        pm, cm = batch["prompt_mask"][i].bool(), batch["completion_mask"][i].bool()
        ids = batch["prompt_ids"][i][pm].tolist() + batch["completion_ids"][i][cm].tolist()
        assert ids == t.token_ids
        assert batch["tool_mask"][i][cm].tolist() == t.loss_mask[len(prompt):]
        trained = (batch["completion_mask"][i] * batch["tool_mask"][i]).sum().item()
        assert trained == sum(t.loss_mask) == t.stats["sampled_tokens"] > 0
    print(trajs[0].show())
    print("trained tokens per row:", [sum(t.loss_mask) for t in trajs], "of", [len(t.token_ids) for t in trajs])


def test_the_reward_trl_sees_is_env_reward(one_step):
    trainer, seen = one_step
    trajs = seen["trajs"]
    assert list(trainer._logs["rewards"]["env_reward"])[-len(trajs):] == [t.reward for t in trajs]
    for t in trajs:       # replay the episode's tool calls (first of a turn) on a fresh Env: the same reward
        env = envs.make_env(next(x for x in envs.make_tasks(t.domain, "train", 1, ["easy"]) if x.id == t.task_id))
        said = [m for m in t.messages if m["role"] == "assistant"]
        for m in said:
            if m["tool_calls"]:
                env.step(m["tool_calls"][0]["name"], m["tool_calls"][0]["arguments"])
        assert env.score([visible_text(m["content"]) for m in said], stop_reason=t.stop_reason).reward == t.reward


def test_generate_turn_is_one_sampled_turn_a_row_cut_after_eos(one_step):
    trainer, seen = one_step
    rows = [seen["out"]["prompt_ids"][0], seen["out"]["prompt_ids"][2][:-5]]      # two lengths: left padding inside
    new, logprobs = rl_trl.generate_turn(trainer, rows)
    assert logprobs is None                                    # transformers generate keeps no log-probs
    assert len(new) == 2 and all(1 <= len(x) <= trainer.max_completion_length for x in new)
    for x in new:
        assert all(isinstance(i, int) for i in x)
        eos = [j for j, i in enumerate(x) if i in trainer.eos_token_ids]
        assert eos in ([], [len(x) - 1])                       # nothing after the first end-of-turn
    agent = rl_trl.TRLAgent(trainer, trainer.processing_class)
    (ids, lp), = agent.act([rollout.AgentTurn(None, [], rows[0])])
    assert len(lp) == len(ids) and not agent.has_logprobs


def test_trl_fields_keeps_one_masked_token_for_an_episode_cut_before_its_first_turn():
    t = rollout.Trajectory("x", "retail", "s", "easy", 0, 0, [1, 2, 3], [0, 0, 0], [0.0] * 3, [])
    out = rl_trl.trl_fields([t])
    assert (out["prompt_ids"], out["completion_ids"], out["env_mask"]) == ([[1, 2]], [[3]], [[0]])


def test_tasks_must_split_into_whole_groups_over_the_processes(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        rl_trl.parse_args(["--smoke", "--tasks", "3"])
    assert e.value.code == 2 and "--tasks: 3 tasks do not split into whole groups over 2" in capsys.readouterr().err


def test_a_changed_setting_into_a_used_folder_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    """As rl.py and sft.py: a folder whose args.json holds a run with other settings (here --init) is refused in one
    line, exit 2, before the trainer is built, and its args.json is left as it was."""
    saved = vars(rl_trl.parse_args(["--smoke", "--out", str(tmp_path)]))
    (tmp_path / "args.json").write_text(json.dumps(saved))
    before = (tmp_path / "args.json").read_bytes()
    monkeypatch.setattr(rl_trl, "build_trainer", lambda args: pytest.fail("the trainer was built"))
    with pytest.raises(SystemExit) as stop:
        rl_trl.main(["--smoke", "--out", str(tmp_path), "--init", "base"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "--init 'auto' there, 'base' now" in err
    assert (tmp_path / "args.json").read_bytes() == before


@pytest.mark.slow      # two trainers, each a step: most of a minute
def test_from_an_sft_adapter_kl_is_zero_before_the_first_update_and_the_reference_stays(tiny, tmp_path, monkeypatch):
    model, _ = rollout.load_model(tiny)
    model = rollout.add_lora(model, r=16, alpha=32)
    torch.manual_seed(1)
    for n, p in model.named_parameters():        # an SFT adapter that is not the base: lora_B != 0
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "sft")
    sft = {n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    rewards_by_trial(monkeypatch)
    trainer = rl_trl.main(["--smoke", "--model", tiny, "--out", str(tmp_path / "rl"), "--init", str(tmp_path / "sft"),
                           "--task-pool", "1", "--tasks", "1", "--steps", "2"])
    kl = [json.loads(x)["kl"] for x in open(tmp_path / "rl" / "metrics.jsonl")]
    print("kl by step:", kl)
    assert kl[0] == 0.0 and kl[1] > 0              # step 1: the policy is the reference; step 2: it has moved
    params = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    for n, p in sft.items():
        ref = params[n.replace("lora_A.", "lora_A.ref.").replace("lora_B.", "lora_B.ref.")]
        assert torch.equal(ref, p) and not ref.requires_grad     # the KL reference: the SFT adapter, frozen
    assert any(not torch.equal(params[n.replace("lora_B.", "lora_B.default.")], p) for n, p in sft.items() if "lora_B" in n)
    assert os.path.isfile(tmp_path / "rl" / "adapter" / "adapter_config.json")
    assert not os.path.isdir(tmp_path / "rl" / "adapter" / "ref")             # the trained adapter only


DRIVER = """
import hashlib, json, os, sys
import torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
import rollout
from scripts import rl_trl
real = rollout.run_episodes
def run(*a, **k):                      # rollout t of every group scores t % 2 (see rewards_by_trial)
    trajs = real(*a, **k)
    for t in trajs:
        t.reward = float(t.trial % 2)
    return trajs
rollout.run_episodes = run
trainer = rl_trl.build_trainer(rl_trl.parse_args(sys.argv[1:]))
seen, func = [], trainer.rollout_func
trainer.rollout_func = lambda prompts, tr: seen.append(list(prompts)) or func(prompts, tr)
lora = lambda: {{n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n and ".default" in n}}
before = lora()
trainer.train()
after = lora()
digest = hashlib.sha256(b"".join(after[n].numpy().tobytes() for n in sorted(after))).hexdigest()
json.dump(dict(prompts=seen, sha=digest, moved=any(not torch.equal(before[n], after[n]) for n in after)),
          open(os.path.join({out!r}, "rank%s.json" % os.environ["RANK"]), "w"))
"""


@pytest.mark.slow      # two processes, each importing TRL and building the trainer: most of a minute
def test_torchrun_two_processes_hold_whole_groups_and_end_with_identical_lora(tiny, tmp_path):
    (tmp_path / "driver.py").write_text(DRIVER.format(root=ROOT, tests=os.path.join(ROOT, "tests"), out=str(tmp_path)))
    env = dict(os.environ, OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "driver.py"), "--smoke", "--model", tiny, "--out", str(tmp_path / "rl"), "--init", "base",
           "--task-pool", "1", "--micro-batch", "1"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    ranks = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    print({i: (r["prompts"], r["sha"][:12]) for i, r in enumerate(ranks)})
    for r in ranks:                                    # one step: one call, one task's whole group of 2
        assert len(r["prompts"]) == 1 and len(r["prompts"][0]) == 2 and len(set(r["prompts"][0])) == 1
        assert r["moved"]                              # the update did something...
    assert {r["prompts"][0][0] for r in ranks} == {"retail-train-00000", "airline-train-00000"}
    assert ranks[0]["sha"] == ranks[1]["sha"]          # ...and DDP kept the ranks' LoRA weights identical
