"""Tokenizer and chat template: one rendering path for training, rollouts and serving.

Turn-level thinking: `enable_thinking=False` ends the generation prompt with an empty think block.
Preserved thinking: `preserve_thinking=True` keeps earlier turns' thinking in the history; off, the
thinking of assistant turns before the last user message is dropped (and those turns are not
trained on: they sit outside `{% generation %}`).
"""
from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
           "<think>", "</think>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{%- set enable_thinking = enable_thinking if enable_thinking is defined else true -%}"
    "{%- set preserve_thinking = preserve_thinking if preserve_thinking is defined else false -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' -%}<|user|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|tool|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}<|assistant|>"
    "{%- set think = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' -%}"
    "{%- set calls = m.tool_calls if m.tool_calls is defined and m.tool_calls else [] -%}"
    "{%- if loop.index0 > ns.last_user or preserve_thinking -%}"
    "{% generation %}<think>{{ think }}</think>{{ m.content }}"
    "{%- for tc in calls -%}<tool_call>{{ tc.name }} {{ tc.arguments }}</tool_call>{%- endfor -%}"
    "<|end|>{% endgeneration %}"
    "{%- else -%}<think></think>{{ m.content }}"
    "{%- for tc in calls -%}<tool_call>{{ tc.name }} {{ tc.arguments }}</tool_call>{%- endfor -%}<|end|>"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- if not enable_thinking -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with digits split one by one (arithmetic needs digit-aligned tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", additional_special_tokens=SPECIAL[2:])
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def render_ids(tok, messages: list[dict], *, add_generation_prompt: bool = False, enable_thinking: bool = True,
               preserve_thinking: bool = False) -> list[int]:
    """Token ids exactly as `AutoTokenizer.apply_chat_template` gives them."""
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        enable_thinking=enable_thinking, preserve_thinking=preserve_thinking,
                                        return_dict=True)["input_ids"])


def render_with_mask(tok, messages: list[dict], *, preserve_thinking: bool = False) -> tuple[list[int], list[int]]:
    """Token ids and the assistant-token mask (1 where the loss applies)."""
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                  preserve_thinking=preserve_thinking)
    return list(out["input_ids"]), list(out["assistant_masks"])
