"""The chat layer: one rendering path for training, rollouts and serving, for any Hugging Face chat template.

Everything comes from the checkpoint (`chat_format`): stop ids, pad, BOS, thinking support, tool-call format.
Assistant-only loss masks come from rendering the conversation prefix by prefix (`render_with_mask`), so a
template needs no `{% generation %}` markers. Templates without a thinking switch carry our thinking format
as plain assistant text: `<think>...</think>` before the content, and an empty `<think></think>` after the
generation prompt when thinking is off.

Our own template (the embedded default): turn-level thinking, `enable_thinking=False` ends the generation
prompt with an empty think block; preserved thinking, `preserve_thinking=True` keeps earlier turns' thinking in
the history (off, the thinking of assistant turns before the last user message is dropped, and those turns are
context, not targets). Its `{% generation %}` markers agree with the prefix masks (tested) and serve tools that
read them (`return_assistant_tokens_mask`, TRL's `assistant_only_loss`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

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
    "{%- for tc in calls -%}<tool_call>{{ tc.function.name }} {{ tc.function.arguments.values() | join(' ') }}"
    "</tool_call>{%- endfor -%}<|end|>{% endgeneration %}"
    "{%- else -%}<think></think>{{ m.content }}"
    "{%- for tc in calls -%}<tool_call>{{ tc.function.name }} {{ tc.function.arguments.values() | join(' ') }}"
    "</tool_call>{%- endfor -%}<|end|>"
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


THINK_OFF = "<think></think>"  # our thinking-off marker, as text where the template has no switch


class ChatFormatError(ValueError):
    """The checkpoint's tokenizer or template cannot do what a stage needs; the message says which and why."""


@dataclass(frozen=True)
class ChatFormat:
    template: str            # "posttrain", or a family and the template's digest ("chatml:3f2a...")
    stop_ids: tuple[int, ...]  # ids that end an assistant turn: template's end of turn, eos, generation_config
    end_of_turn: int         # the id the template closes an assistant turn with
    pad_id: int
    thinking: bool           # the template has an `enable_thinking` switch
    tool_format: str         # "posttrain" (<tool_call>name args</tool_call>), "hermes" (<tool_call>{json}</tool_call>),
                             # "json" (a turn that is one JSON call, Llama-3.x) or "none"

    def summary(self) -> dict:
        return {"template": self.template, "thinking": self.thinking, "tool_format": self.tool_format}


def _family(template: str) -> str:
    if template == CHAT_TEMPLATE:
        return "posttrain"
    digest = hashlib.sha256(template.encode()).hexdigest()[:12]
    family = ("chatml" if "<|im_start|>" in template else "llama3" if "<|start_header_id|>" in template
              else "template")
    return f"{family}:{digest}"


def _generation_config_eos(tok) -> list[int]:
    path = Path(getattr(tok, "name_or_path", "") or ".") / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def chat_format(tok) -> ChatFormat:
    """What the checkpoint's tokenizer and template say about turns, stops, padding and thinking (cached on
    the tokenizer). Fails, naming the checkpoint, where a chat stage could not work."""
    cached = tok.__dict__.get("_posttrain_chat_format")
    if cached is not None:
        return cached
    where = getattr(tok, "name_or_path", "") or "the tokenizer"
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    if not template:
        raise ChatFormatError(f"{where}: no chat template (tokenizer_config.json has no chat_template and there is "
                              f"no chat_template.jinja): sft, rl and evaluation render conversations with it")
    if not getattr(tok, "is_fast", False):  # loss masks map characters to tokens through offsets
        raise ChatFormatError(f"{where}: needs a fast tokenizer (tokenizer.json)")
    user = [{"role": "user", "content": "Hi."}]
    try:
        prompt = _text(tok, user, add_generation_prompt=True)
        full = _text(tok, user + [{"role": "assistant", "content": "Hello."}])
        off = _text(tok, user, add_generation_prompt=True, enable_thinking=False)
    except Exception as e:  # a template that cannot render a plain exchange cannot be trained on
        raise ChatFormatError(f"{where}: the chat template fails on a plain user/assistant exchange: {e}") from None
    if not full.startswith(prompt):
        raise ChatFormatError(f"{where}: the generation prompt is not a prefix of the rendered conversation, "
                              f"so a rollout's tokens could not be trained on as they were sampled")
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    turn = [i for i in tok(full[len(prompt):], add_special_tokens=False)["input_ids"] if i in special]
    if not turn:
        raise ChatFormatError(f"{where}: the template closes an assistant turn with no special token; a rollout "
                              f"would not know where a turn ends")
    end = turn[-1]
    stops = tuple(dict.fromkeys(i for i in [end, tok.eos_token_id, *_generation_config_eos(tok)]
                                if isinstance(i, int) and i >= 0))
    tools = ("posttrain" if template == CHAT_TEMPLATE else "hermes" if "<tool_call>" in template
             else "json" if "tool_calls" in template else "none")
    fmt = ChatFormat(_family(template), stops, end, pad_id(tok), off != prompt, tools)
    tok.__dict__["_posttrain_chat_format"] = fmt
    return fmt


def bos_ids(tok) -> list[int]:
    """What starts a plain-text document: the BOS token where the tokenizer has one (Qwen has none)."""
    return [tok.bos_token_id] if tok.bos_token_id is not None else []


def doc_end_id(tok) -> int:
    """What ends a plain-text document: the end-of-text token where chat models have one beside their
    end-of-turn eos (ours, Qwen, Llama-3), else the eos token."""
    vocab = tok.get_vocab()
    for name in ("<|eos|>", "<|endoftext|>", "<|end_of_text|>"):
        if name in vocab:
            return vocab[name]
    if tok.eos_token_id is None:
        raise ChatFormatError(f"{getattr(tok, 'name_or_path', '') or 'the tokenizer'}: no eos token to end "
                              f"documents with (set eos_token in tokenizer_config.json)")
    return tok.eos_token_id


def pad_id(tok) -> int:
    """The tokenizer's pad, else the document end (padded positions are masked, their value never trains)."""
    return tok.pad_token_id if tok.pad_token_id is not None else doc_end_id(tok)


def _text(tok, messages: list[dict], **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def _fold_thinking(messages: list[dict]) -> list[dict]:
    """For templates without thinking: the reasoning as plain text at the head of the assistant's content."""
    return [{**{k: v for k, v in m.items() if k != "reasoning_content"},
             "content": f"<think>{m.get('reasoning_content') or ''}</think>{m.get('content') or ''}"}
            if m["role"] == "assistant" else m for m in messages]


def render_text(tok, messages: list[dict], *, add_generation_prompt: bool = False, enable_thinking: bool = True,
                preserve_thinking: bool = False) -> str:
    """The conversation as the checkpoint's template writes it (our thinking format as text where the template
    has no switch)."""
    fmt = chat_format(tok)
    text = _text(tok, messages if fmt.thinking else _fold_thinking(messages), add_generation_prompt=add_generation_prompt,
                 enable_thinking=enable_thinking, preserve_thinking=preserve_thinking)
    return text + THINK_OFF if add_generation_prompt and not enable_thinking and not fmt.thinking else text


def render_ids(tok, messages: list[dict], **kw) -> list[int]:
    """Token ids exactly as `AutoTokenizer.apply_chat_template(..., tokenize=True)` gives them (it tokenizes the
    rendered text without adding special tokens); keywords as `render_text`."""
    return list(tok(render_text(tok, messages, **kw), add_special_tokens=False)["input_ids"])


def render_with_mask(tok, messages: list[dict], *, enable_thinking: bool = True,
                     preserve_thinking: bool = False) -> tuple[list[int], list[int]]:
    """Token ids and the assistant-token mask (1 where the loss applies), by rendering prefix by prefix.

    Assistant turn k is trained from the end of the generation prompt of `messages[:k]` (rendered in the
    conversation's thinking mode, so an empty think block the prompt supplies is not trained) through its
    end-of-turn token. Spans are found in the text and mapped to tokens by offsets, so neither `{% generation %}`
    markers nor token-aligned boundaries are needed. A turn the template rewrites once later messages follow
    (thinking dropped from history) is context, not a target: the model never produced it that way.
    """
    stops = set(chat_format(tok).stop_ids)
    kw = {"enable_thinking": enable_thinking, "preserve_thinking": preserve_thinking}
    text = render_text(tok, messages, **kw)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = list(enc["input_ids"]), [a for a, _ in enc["offset_mapping"]]
    mask = [0] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt, upto = (render_text(tok, messages[:k], add_generation_prompt=True, **kw),
                        render_text(tok, messages[:k + 1], **kw))
        if not (text.startswith(prompt) and text.startswith(upto)):
            continue
        turn = [j for j, a in enumerate(starts) if len(prompt) <= a < len(upto)]
        ends = [j for j in turn if ids[j] in stops]
        for j in turn:  # through the end-of-turn token; what follows it is the next prompt's
            if not ends or j <= ends[-1]:
                mask[j] = 1
    return ids, mask


def plain_ids(tok, text: str) -> list[int]:
    """`text` tokenized as plain text: no special token, and no added token a template uses as markup (`<think>`,
    `<tool_call>`, ...), is ever made from it, so text from the world (a file's content, a file name) cannot end a
    turn or open a block from inside an observation. (`split_special_tokens` still matches added tokens that are
    not special, such as ChatML's `<tool_call>`: a copy of the tokenizer without those is used instead.)"""
    plain = tok.__dict__.get("_posttrain_plain")
    if plain is None:
        spec = json.loads(tok.backend_tokenizer.to_str())
        template = tok.chat_template if isinstance(tok.chat_template, str) else ""
        spec["added_tokens"] = [t for t in spec["added_tokens"] if not (t["special"] or t["content"] in template
                                                                        or t["content"] in SPECIAL)]
        plain = tok.__dict__["_posttrain_plain"] = Tokenizer.from_str(json.dumps(spec))
    return plain.encode(text, add_special_tokens=False).ids


_MARK = "PoStTrAiNcOnTeNtMaRk"  # letters only: no template escape or trim changes it


def ids_around_plain(tok, render: Callable[[str], str], content: str, memo: str = "") -> list[int]:
    """The ids of `render(content)`, where `render` puts `content` into a template's text: the template's own text
    tokenized as usual (its special tokens real), `content` as plain text (`plain_ids`), however the template
    escaped or trimmed it. `memo`: a key to keep the template's text around the content on the tokenizer."""
    key = f"_posttrain_around_{memo}"
    around = tok.__dict__.get(key) if memo else None
    if around is None:
        shaped = render(_MARK)
        if shaped.count(_MARK) != 1:
            raise ChatFormatError(f"{chat_format(tok).template}: the template does not write a message's content "
                                  f"once, as it is; its text cannot be kept apart from the template's")
        head, tail = shaped.split(_MARK)
        around = (head, tail, list(tok(head, add_special_tokens=False)["input_ids"]),
                  list(tok(tail, add_special_tokens=False)["input_ids"]))
        if memo:
            tok.__dict__[key] = around
    head, tail, head_ids, tail_ids = around
    text = render(content)
    if not (text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail)):
        raise ChatFormatError(f"{chat_format(tok).template}: the template's text around a message changes with "
                              f"its content; its text cannot be kept apart from the template's")
    return head_ids + plain_ids(tok, text[len(head):len(text) - len(tail)]) + tail_ids


def tool_response_ids(tok, content: str, *, enable_thinking: bool = True, then_user: str | None = None) -> list[int]:
    """The ids that follow an assistant's tool-call turn (after its end-of-turn token): the tool's response as
    the template renders it (and a user message after it, `then_user`), then the next generation prompt. Token
    in, token out: a rollout appends exactly these to the model's own ids. The response is the world's text:
    tokenized as plain text (`ids_around_plain`), whatever special tokens it spells."""
    fmt = chat_format(tok)
    call = [{"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "", "reasoning_content": "x",
             "tool_calls": [{"type": "function", "function": {"name": "read", "arguments": {"path": "a.txt"}}}]}]
    kw = {"enable_thinking": enable_thinking, "preserve_thinking": True}
    memo = f"_posttrain_tool_call_{enable_thinking}"  # the call's rendering does not depend on the response
    if memo not in tok.__dict__:
        before = render_text(tok, call, **kw)
        enc = tok(before, add_special_tokens=False, return_offsets_mapping=True)
        cut = max(b for i, (_, b) in zip(enc["input_ids"], enc["offset_mapping"]) if i in fmt.stop_ids)
        tok.__dict__[memo] = before[:cut]
    prefix = tok.__dict__[memo]
    user = [{"role": "user", "content": then_user}] if then_user is not None else []

    def after(text: str) -> str:
        rendered = render_text(tok, call + [{"role": "tool", "content": text}, *user], add_generation_prompt=True,
                               **kw)
        if not rendered.startswith(prefix):
            raise ChatFormatError(f"{fmt.template}: the template renders an assistant tool call differently once a "
                                  f"tool response follows it; token in, token out cannot hold")
        return rendered[len(prefix):]
    return ids_around_plain(tok, after, content, memo=f"tool_{enable_thinking}_{then_user!r}")
