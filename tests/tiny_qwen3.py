"""A tiny Qwen3 built on the fly, for the GPU code path on CPU (tests/test_qwen3.py): Qwen3Config with random
weights and a few layers, and a tokenizer that carries Qwen3's special tokens and a chat template written
from Qwen3's documented format (tools in the system turn, tool results as user turns, the think block).
No Qwen3 tokenizer exists on these machines, so the vocabulary is the bundled SmolLM2's (byte-level BPE, as
Qwen's) plus the Qwen3 tokens it lacks."""
import torch

QWEN3_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen3's format, as its model card and tokenizer_config describe it:
#  - with tools, the system turn is the system text, then "# Tools" and one JSON schema a line in <tools>;
#  - a tool result is a user turn "<tool_response>\n...\n</tool_response>" (consecutive results share one);
#  - an assistant turn after the last real user query keeps its think block (the last one is always
#    written with one, empty if there is no reasoning); earlier assistant turns lose it;
#  - the generation prompt is "<|im_start|>assistant\n", plus the empty think block when thinking is off.
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "{%- set call = call.function or call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def qwen3_tokenizer():
    """SmolLM2's byte-level BPE + Qwen3's tokens and template; eos <|im_end|>, pad <|endoftext|> (as Qwen3)."""
    import rollout
    tok = rollout.load_tokenizer()
    tok.add_tokens(QWEN3_TOKENS)                         # Qwen3 keeps them as plain added tokens, not special
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    return tok


def qwen3_config(vocab_size: int, layers: int = 2):
    """Qwen3-8B's architecture (GQA, q/k norms, head_dim 128 in the real one, untied lm_head) at toy size."""
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                       tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)


def save_tiny_qwen3(path: str, seed: int = 0) -> str:
    """Random tiny Qwen3 (fp32) + the tokenizer above, saved to path: what --model takes."""
    from transformers import AutoModelForCausalLM
    tok = qwen3_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen3_config(len(tok)), dtype=torch.float32)
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
