"""Chat checkpoints in the shapes of the main families, built on the fly (no hub): a byte-level BPE trained on the
task world, the family's special tokens and a template written in the family's form.

- chatml: Qwen3-style. `<|im_start|>`/`<|im_end|>`, an `enable_thinking` switch and `<think>` blocks, Hermes
  `<tool_call>{json}</tool_call>`, tool responses inside a user turn, no BOS, no `{% generation %}` markers.
- llama3: Llama-3.x headers, BOS `<|begin_of_text|>`, `<|eot_id|>` ends a turn, no pad token, no thinking
  switch, a tool call is the turn's JSON (`{"name": ..., "parameters": ...}`), tool responses as `ipython`.
"""
from __future__ import annotations

from pathlib import Path

CHATML = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content or '' -}}"
    "{%- for tc in (m.tool_calls or []) -%}{%- set f = tc.function if tc.function is defined else tc -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}{%- set f = m.tool_calls[0].function -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + f.name + '\", \"parameters\": '"
    " + (f.arguments | tojson) + '}<|eot_id|>' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- else -%}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content or '') + '<|eot_id|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

FAMILIES = {
    "chatml": {"template": CHATML, "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               "added": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
               "tokens": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}},
    "llama3": {"template": LLAMA3, "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                               "<|end_header_id|>", "<|eot_id|>"],
               "added": [], "tokens": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}},
}


def make_tokenizer(family: str, path: Path, vocab_size: int = 400):
    """Train, save and reload (as any user would load it) a tokenizer of `family`."""
    import environments
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    spec = FAMILIES[family]
    texts = [t.prompt + " " + str(t.demo) for d in environments.DOMAINS
             for t in environments.get(d).generate("train", 100, 0)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["special"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **spec["tokens"])
    fast.add_tokens(spec["added"])
    fast.chat_template = spec["template"]
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def make_checkpoint(family: str, path: Path):
    """A tiny random Llama with a `family` tokenizer, saved as a plain Hugging Face folder."""
    from posttrain.config import ModelConfig
    from posttrain.models.preset import build_model
    tok = make_tokenizer(family, path)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                    max_position_embeddings=64), tok)
    model.save_pretrained(path, safe_serialization=True)
    return path
