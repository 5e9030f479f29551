"""GRPO with a simulated user, scaled out: TRL's GRPOTrainer (accelerate, vLLM) driving our world.

rl.py is the algorithm in one readable loop on one device. This file gives the same algorithm to an existing engine,
TRL's GRPOTrainer, so that it runs on 1-8 GPUs with vLLM generating: TRL owns the update (log-probs, clipped loss +
k3 KL, AdamW, DDP, checkpoints); we own the rollout. Its `rollout_func` calls rollout.run_episodes with envs/' environments
and simulated users; the agent inside generates through TRL's own generator (the colocated vLLM engine, else
transformers generate). Each Trajectory becomes one TRL row: prompt = the system prompt + the user's first message,
completion = everything after it (agent, tool and user turns), env_mask = the trajectory's loss_mask over the
completion (1 only on sampled tokens: only those are trained), reward = Env.reward.

Run:
    python scripts/rl_trl.py                       # CPU preset (transformers generate); from runs/sft/adapter if present
    python scripts/rl_trl.py --smoke --out /tmp/t  # 1 tiny step (tests/test_rl_trl.py)
    python scripts/rl_trl.py --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o --vllm colocate       # 1 GPU
    accelerate launch --num_processes 8 scripts/rl_trl.py --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o \\
        --vllm colocate                    # 8 GPUs: 32 tasks x 8 rollouts a step, 4 tasks a GPU
GPU machines install scripts/requirements-gpu.txt (vLLM 0.31 needs transformers < 5.18); `python scripts/bench_trl.py`
times one step of this file against one of rl.py on the same tasks.

Where this differs from rl.py (TRL's semantics, kept):
- No dynamic sampling: every drawn group is trained; a group whose rewards are all equal gets advantage 0 and adds
  only its KL term (the paper's GRPO). TRL logs their share as frac_reward_zero_std.
- Advantages (r - mean) / (std + 1e-4) with the unbiased std (rl.py: population std, so TRL's are smaller by
  sqrt((G-1)/G)); --loss-agg token-mean is TRL's "dapo" (sum over the step's sampled tokens on all ranks / their
  count), seq-mean its "grpo".
- The KL reference: TRL copies the starting adapter into a frozen "ref" adapter (from --init base, the zero LoRA:
  the base model), as rl.py does; kept in memory, not in <out>/reference.
- transformers generate feeds the whole conversation again every turn (no KV kept between turns, no shared system
  prompt): slow on CPU, for tests; vLLM's prefix cache does that reuse on GPU. No held-out curve in the loop: run
  `python eval.py --agents <out>/adapter`.
- vLLM colocate with tensor_parallel_size 1 only: ranks run different numbers of turns, so anything collective per
  generate call deadlocks or mis-slices (server mode gathers prompts and assumes groups of num_generations, trl#6673;
  TP > 1 and DeepSpeed ZeRO-3 / FSDP generation gather per call). Use DDP (accelerate's default) or ZeRO-1/2.
"""
import json
import os
import time
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
import common  # noqa: E402
import rl  # noqa: E402   the GRPO flags are rl.py's

# CPU: rl.py's limits (common.CPU_LIMITS), 2 tasks x 4 rollouts: transformers generate re-reads the conversation
# every turn, so a CPU step costs several times rl.py's (scripts/bench_trl.py).
PRESETS = {
    "gpu": dict(steps=100, tasks=32, group_size=8, max_turns=30, max_new_tokens=256, max_context=8192, micro_batch=1,
                lr=2e-5, temperature=1.0, domains="retail,airline", tiers="easy,medium,hard", grad_checkpointing="on",
                vllm="colocate", save_every=10),
    "cpu": dict(steps=1, tasks=2, group_size=4, **common.CPU_LIMITS, micro_batch=2, lr=1e-4, temperature=0.7,
                domains="retail,airline", tiers=common.CPU_TIERS, user="scripted:train", grad_checkpointing="off",
                vllm="off", save_every=1),
    "smoke": dict(steps=1, tasks=2, group_size=2, max_turns=2, max_new_tokens=8, max_context=2560, micro_batch=2,
                  lr=1e-4, temperature=1.0, domains="retail,airline", tiers="easy", grad_checkpointing="off",
                  vllm="off", save_every=1),
}


def parse_args(argv=None):
    p = common.Parser(description=__doc__.split("\n")[0])
    common.add_run_args(p, out="runs/rl_trl", smoke="one tiny step (tests)")
    common.add_model_args(p)
    common.add_user_args(p)
    rl.add_grpo_args(p)             # --tasks: over all processes, a multiple of their number (whole groups each)
    p.group("world").add_argument("--task-pool", type=int, default=1000, help="train tasks generated per domain to "
                                  "sample from")
    g = p.group("more")
    g.add_argument("--vllm", default=None, choices=["off", "colocate"], help="generate with a vLLM engine on each GPU "
                   "beside training (scripts/requirements-gpu.txt), or with transformers generate")
    g.add_argument("--vllm-memory", type=float, default=0.3, help="share of each GPU's memory vLLM may take")
    p.group("run").add_argument("--save-every", type=int, default=None, help="checkpoint every N steps; rerun to "
                                "resume")
    args = common.parse_with_preset(p, PRESETS, argv)
    common.check_args(args, at_least=dict(steps=1, tasks=1, group_size=2, max_turns=1, max_new_tokens=1,
                                          micro_batch=1, save_every=1, lora_r=1),
                      finite=dict(lr=(0, True), temperature=(0, True), kl_coef=(0, False), clip=(0, True)), training=True)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.tasks % world:
        common.fail("--tasks", f"{args.tasks} tasks do not split into whole groups over {world} processes; "
                               f"use a multiple of {world}")
    if args.tasks * args.group_size // world % args.micro_batch:
        common.fail("--micro-batch", f"{args.micro_batch} does not divide a process's "
                                     f"{args.tasks * args.group_size // world} rollouts")
    if args.vllm != "off":
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            common.fail("--vllm", "vLLM is not installed: pip install -r scripts/requirements-gpu.txt, or pass --vllm off")
    return args


# ---------------------------------------------------------------- the agent: our run_episodes, TRL's generator

def generate_turn(trainer, prompt_ids: list[list[int]]):
    """The one call into TRL's private API (GRPOTrainer._generate_single_turn, trl==1.16.0): one sampled turn per
    row with TRL's sampling settings on its backend (the colocated vLLM engine, weights synced at each step; else
    transformers generate on the unwrapped model). -> (new ids a row, cut after the first EOS; their log-probs, or
    None from transformers generate). tests/test_rl_trl.py pins what it returns."""
    return trainer._generate_single_turn(prompt_ids, None, {}, 1)


class TRLAgent:
    """run_episodes' agent: act([(task, messages, token_ids)]) -> [(new ids, log-probs)], the ids ending with the
    end-of-turn token unless cut at max_new_tokens. Token in, token out: the history is never re-tokenized."""

    def __init__(self, trainer, tok, thinking: bool = False):
        import rollout
        self.trainer, self.fmt = trainer, rollout.ChatFormat(tok, thinking)
        self.max_new_tokens = trainer.max_completion_length    # TRL's cap per generate call = ours per turn
        self.has_logprobs = True                                # False once a call returned None (transformers)

    def act(self, batch):
        new, logprobs = generate_turn(self.trainer, [list(turn.token_ids) for turn in batch])
        if logprobs is None:                                    # run_episodes marks ids with log-probs as sampled
            self.has_logprobs, logprobs = False, [[0.0] * len(ids) for ids in new]
        return [(list(ids), list(lp)) for ids, lp in zip(new, logprobs)]


def trl_fields(trajs, with_logprobs: bool = True, rollout_s: float = 0.0) -> dict:
    """Trajectories -> rollout_func's dict, a row each, in order. The prompt ends where the agent's first turn
    starts (the first mask-1 token: system prompt + first user message + the assistant header); the completion is
    everything after it and env_mask its loss_mask, so prompt + completion = token_ids and exactly the sampled tokens
    are trained. An episode cut before its first turn keeps one masked token as its completion (TRL needs one).
    Other keys reach the reward function as keyword arguments."""
    out = dict(prompt_ids=[], completion_ids=[], env_mask=[], logprobs=[] if with_logprobs else None,
               episode_reward=[], turns=[], sampled=[], rollout_s=[rollout_s] * len(trajs))
    for t in trajs:
        p = t.loss_mask.index(1) if 1 in t.loss_mask else len(t.token_ids) - 1
        out["prompt_ids"].append(t.token_ids[:p])
        out["completion_ids"].append(t.token_ids[p:])
        out["env_mask"].append(t.loss_mask[p:])
        if with_logprobs:
            out["logprobs"].append(t.logprobs[p:])               # 0.0 on env tokens, masked out by TRL
        out["episode_reward"].append(t.reward)
        out["turns"].append(t.turns)
        out["sampled"].append(sum(t.loss_mask))
    return out


def make_rollout_func(args, tasks, tok, model):
    """TRL calls it with this process's prompts (task ids, each repeated G times in a row) and itself."""
    import rollout
    import users
    by_id, make_user = {t.id: t for t in tasks}, common.user_factory(args, model, tok)

    def rollout_func(prompts, trainer):
        G = trainer.num_generations
        if prompts != [p for p in prompts[::G] for _ in range(G)]:
            raise ValueError(f"rollout_func needs whole groups of {G} rollouts of one task in a row; got {prompts}")
        t0, agent = time.time(), TRLAgent(trainer, tok, args.thinking)
        try:   # a fresh Env and simulated user per rollout, inside run_episodes; seeds differ by step and process
            trajs = rollout.run_episodes(agent, tok, [by_id[p] for p in prompts[::G]], group_size=G, user=make_user,
                                         max_turns=args.max_turns, max_context=args.max_context,
                                         seed=args.seed * rl.SEED_STRIDE + trainer.state.global_step * 101
                                         + trainer.accelerator.process_index,
                                         shaped=args.reward == "shaped", progress=False,
                                         user_workers=args.user_workers)
        except users.UserSimulatorError as e:
            raise SystemExit(str(e))
        return trl_fields(trajs, agent.has_logprobs, time.time() - t0)
    return rollout_func


def env_reward(prompts, completions, episode_reward, turns, sampled, rollout_s, log_metric=None, **_):
    """TRL's reward function: Env.reward, computed in run_episodes and passed through rollout_func."""
    if log_metric:                                  # averaged over processes by TRL
        log_metric("pass_rate", sum(r >= 1 for r in episode_reward) / len(episode_reward))
        log_metric("turns", sum(turns) / len(turns))
        log_metric("rollout_s", rollout_s[0])
        log_metric("sampled_tok_per_s", sum(sampled) / max(rollout_s[0], 1e-9))
    return list(episode_reward)


# ---------------------------------------------------------------- the trainer

def build_trainer(args):
    """Model + LoRA (from --init), our train tasks as the dataset, rollout_func and env_reward -> GRPOTrainer."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")    # rollout_func is experimental: trl is pinned, tested
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    import rollout
    import envs
    cuda = torch.cuda.is_available()
    if cuda:                       # each process on its own GPU (load_model places weights on the current one)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model, tok = rollout.load_model(args.model or rollout.DEFAULT_MODEL, load_in_4bit=args.load_in_4bit)
    init = args.init if args.init != "auto" else "runs/sft/adapter" if os.path.isdir("runs/sft/adapter") else "base"
    # a PeftModel with beta > 0: TRL copies its adapter into a frozen "ref" adapter, the KL reference
    model = rollout.add_lora(model, r=args.lora_r, alpha=args.lora_alpha) if init == "base" else \
        rollout.load_adapter(model, init, trainable=True)
    tasks = [t for d in args.domains.split(",")
             for t in envs.make_tasks(d, "train", args.task_pool, args.tiers.split(","), args.seed)]
    world = int(os.environ.get("WORLD_SIZE", 1))
    rows = args.tasks * args.group_size // world              # rollouts per process and step
    config = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, seed=args.seed, use_cpu=not cuda, bf16=cuda,
        ddp_backend="gloo" if world > 1 and not cuda else None,
        # one rollout batch per optimizer step, accumulated over micro-batches (rl.py's --mini-batches 1)
        generation_batch_size=args.tasks * args.group_size, num_generations=args.group_size,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=rows // args.micro_batch,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        beta=args.kl_coef, epsilon=args.clip, scale_rewards="group",
        loss_type={"token-mean": "dapo", "seq-mean": "grpo"}[args.loss_agg], mask_truncated_completions=False,
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=args.grad_checkpointing == "on",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        use_vllm=args.vllm != "off", vllm_mode="colocate", vllm_tensor_parallel_size=1,
        vllm_max_model_length=args.max_context, vllm_gpu_memory_utilization=args.vllm_memory,
        logging_steps=1, save_steps=args.save_every, save_total_limit=2, report_to="none", disable_tqdm=True)
    return GRPOTrainer(model=model, reward_funcs=[env_reward], args=config, processing_class=tok,
                       train_dataset=Dataset.from_dict({"prompt": [t.id for t in tasks]}),
                       rollout_func=make_rollout_func(args, tasks, tok, model))


def log_line(args):
    """One fixed-field line a step and a metrics.jsonl line (TRL's logs: means over processes)."""
    from transformers import TrainerCallback

    class Log(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kw):
            if not state.is_world_process_zero or "reward" not in (logs or {}):
                return
            m = dict(step=state.global_step, **logs)
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(m) + "\n")
            g = lambda k, spec: "-" if m.get(k) is None else format(m[k], spec)   # noqa: E731
            print(f"step {m['step']:3d}/{args.steps} | reward {g('reward', '.3f')} | pass {g('pass_rate', '.3f')} | "
                  f"zero-std groups {g('frac_reward_zero_std', '.2f')} | kl {g('kl', '.5f')} | ent {g('entropy', '.3f')}"
                  f" | clip {g('clip_ratio/region_mean', '.3f')} | gnorm {g('grad_norm', '.3f')} | sampled/rollout "
                  f"{g('completions/mean_length', '.0f')} | {g('step_time', '.0f')} s/step | rollout "
                  f"{g('rollout_s', '.0f')} s | {g('sampled_tok_per_s', '.1f')} tok/s", flush=True)
    return Log()


def plot(metrics, path):
    common.plot_panels(path, [("pass^1", {"train rollouts": [(m["step"], m.get("pass_rate")) for m in metrics]},
                               (-0.02, 1.02)),
                              ("KL to the reference (k3)", {"": [(m["step"], m.get("kl")) for m in metrics]}, None)])


RESUME_FREE = {"steps", "save_every", "user_workers", "user_base_url", "vllm_memory", "kv_budget"}


def main(argv=None):
    args = parse_args(argv)
    if int(os.environ.get("RANK", 0)) == 0:
        common.start_run(args, args.out, may_change=RESUME_FREE)
    elif not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.trainer_utils import get_last_checkpoint
    trainer = build_trainer(args)
    for cb in (PrinterCallback, ProgressCallback):            # our line replaces TRL's printed dicts
        trainer.remove_callback(cb)
    trainer.add_callback(log_line(args))
    ckpt = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
    if ckpt:
        print(f"resuming from {ckpt}")
    elif trainer.accelerator.is_main_process:                  # a fresh run: a fresh metrics file
        open(os.path.join(args.out, "metrics.jsonl"), "w").close()
    trainer.train(resume_from_checkpoint=ckpt)
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.save_pretrained(os.path.join(args.out, "adapter"), selected_adapters=["default"])   # not "ref"
        metrics = [json.loads(x) for x in open(os.path.join(args.out, "metrics.jsonl"))]
        plot(metrics, os.path.join(args.out, "rl_trl.png"))
        print(f"adapter -> {os.path.join(args.out, 'adapter')}")
    return trainer


if __name__ == "__main__":
    main()
