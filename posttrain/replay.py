"""Self-distillation replay for sft: the base model's own greedy answers (thinking off) to ordinary prompts, mixed
into the task-world demonstrations so that learning the task world does not overwrite how it answers everything
else. On SmolLM2-135M-Instruct 40 sft steps of task-world data took its held-out chat score from 0.47 to 0.11
(seed 0): it answered "What is the capital of France?" with "France", in the task world's terse style. The ramp
already moves it (its plain-text training ends "The answer is: Canada."), so the answers replayed are the base's.

The targets are the tokens the model generated, as generated (never re-tokenised), so at the start of sft their
loss is what the model already does: they pull it back only where the task world pulls it away. No library does
this for a chat template's token layout; it is a few lines over the rollout engine."""
from __future__ import annotations

import json
from pathlib import Path

from posttrain.chat import chat_format, render_ids

# Everyday instructions for replay, written for this project. Disjoint from the held-out chat suite
# (environments/chat.py: tests/test_replay.py checks no question is shared), and mostly open-ended: what is
# replayed is the model's manner of answering, not facts it is taught.
PROMPTS: tuple[str, ...] = (
    "Write one sentence about the ocean.",
    "Give me three tips for sleeping better.",
    "Describe a cat in one sentence.",
    "Suggest a name for a pet goldfish.",
    "Write a short poem about autumn leaves.",
    "What is a library?",
    "Explain what a rainbow is to a child.",
    "List three fruits that are red.",
    "Why do people drink water?",
    "Write a friendly greeting for a new neighbour.",
    "What is the capital of Canada?",
    "What is the capital of Australia?",
    "What is the capital of Egypt?",
    "How many wheels does a bicycle have?",
    "What color is snow?",
    "What sound does a cow make?",
    "Name a musical instrument with strings.",
    "What do you use an umbrella for?",
    "Give me a synonym for happy.",
    "What is the opposite of big?",
    "Write a sentence using the word 'garden'.",
    "How do you make a cup of tea?",
    "What is a good breakfast?",
    "Tell me a fun fact about elephants.",
    "Describe the moon in two sentences.",
    "What is the weather like in summer?",
    "Why is exercise good for you?",
    "Name three animals that live in the sea.",
    "What do you call a baby cow?",
    "What do you call a baby sheep?",
    "What is the plural of goose?",
    "What is the plural of tooth?",
    "Which season comes after summer?",
    "How many minutes are there in an hour?",
    "How many sides does a square have?",
    "What is the first letter of the English alphabet?",
    "Write a thank-you note to a teacher.",
    "Give me two ideas for a rainy afternoon.",
    "What is the difference between a lake and a river?",
    "Explain what a computer does in one sentence.",
    "What are clouds made of?",
    "Name a vegetable that is orange.",
    "What do birds use their wings for?",
    "Write a short story opening about a lost key.",
    "What is a verb? Give an example.",
    "What is the boiling point of water in Fahrenheit?",
    "Who was the first person to walk on the moon?",
    "Which planet is closest to the sun?",
    "What is the largest desert in Africa?",
    "What language is spoken in Mexico?",
    "How do you say 'good morning' in Spanish?",
    "What shape is a ball?",
    "What do plants need to grow?",
    "Give me a tip for learning a new language.",
    "Write a polite way to decline an invitation.",
    "What is a noun?",
    "Describe a busy city street.",
    "What should you pack for a beach trip?",
    "Why do leaves change color in autumn?",
    "Name a famous bridge.",
    "What is the tallest mountain in the world?",
    "What is the longest river in the world?",
    "How many continents are there?",
    "What is a healthy snack?",
    "Write a sentence about your favourite food.",
    "What animal is known for its long neck and spots?",
    "What is the color of a ripe tomato?",
    "What is two plus two?",
    "What is ten minus three?",
    "Recommend a hobby for someone who likes being outdoors.",
    "How can I save energy at home?",
    "What is the purpose of a seatbelt?",
    "Explain why the sky gets dark at night.",
    "What is a dictionary used for?",
    "Write a short birthday message for a friend.",
    "What is the main ingredient in bread?",
    "Name three colors of the rainbow.",
    "What do you call a person who flies a plane?",
    "What do doctors do?",
    "What is the freezing point of water in Fahrenheit?",
    "Which animal says 'meow'?",
    "What is the capital of China?",
    "What is the capital of Russia?",
    "What is the hottest planet in the solar system?",
    "Describe how a snowman is built.",
    "Give me a word that rhymes with cat.",
    "What is a mammal?",
    "Why do we brush our teeth?",
    "Write a one-line motto for a bakery.",
    "Summarise the story of Little Red Riding Hood in two sentences.",
    "What is the opposite of fast?",
    "What does a thermometer measure?",
    "Name a sport played with a racket.",
    "How many players are on a soccer team on the field?",
    "What do caterpillars turn into?",
)


def load_prompts(path: str = "") -> list[str]:
    """The replay prompts: `path` (JSONL, one {"prompt": "..."} per line: a user's own general instructions) or the
    built-in everyday ones. A bad line fails with the file and line named."""
    if not path:
        return list(PROMPTS)
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8-sig").splitlines(), 1):  # a BOM is no prompt
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"{path}:{n}: each line must be an object with a non-empty string \"prompt\"")
        out.append(row["prompt"])
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def examples(engine, prompts: list[str], *, max_new_tokens: int, batch_size: int = 32
             ) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(ids, loss mask) per prompt the model answered within `max_new_tokens` (thinking off, greedy), and how many
    it left unfinished (dropped: a cut-off answer would teach the model to stop mid-sentence)."""
    tok = engine.tokenizer
    fmt = chat_format(tok)
    heads = [render_ids(tok, [{"role": "user", "content": p}], add_generation_prompt=True, enable_thinking=False)
             for p in prompts]
    gens = []
    for i in range(0, len(heads), batch_size):
        gens += engine.generate(heads[i:i + batch_size], max_new_tokens=max_new_tokens, temperature=0.0,
                                stop_ids=set(fmt.stop_ids))
    out = [(h + g.ids, [0] * len(h) + [1] * len(g.ids)) for h, g in zip(heads, gens)
           if g.stop_reason == "stop" and len(g.ids) > 1]
    return out, len(prompts) - len(out)


def mix(task_examples: list, replay: list, share: float) -> list:
    """The task examples with the replay ones repeated to make up `share` of the mixture (sft draws batches
    uniformly from it)."""
    if not replay or share <= 0:
        return task_examples
    want = round(share / (1 - share) * len(task_examples))
    return task_examples + [replay[i % len(replay)] for i in range(want)]
