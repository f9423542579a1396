"""Held-out ordinary chat: everyday instructions and questions outside the task world, each with the words a
correct answer contains. Never trained on; scored before and after post-training (`eval.chat_suite`) to show
what a real chat model keeps of its general ability while it learns the task world.

Written by hand for this project (no hub at run time): short factual questions, word tasks and simple
instructions a 135M-parameter instruct model answers in part, so both a loss and a gain can show."""
from __future__ import annotations

import re

from environments.base import Task, final_answer

DOMAIN = "chat"
# (instruction, accepted answers: the reply passes when it contains any of them as a whole word, any case)
ITEMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the capital of the United Kingdom?", ("london",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What color are ripe bananas?", ("yellow",)),
    ("What color is fresh grass?", ("green",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("How many legs does a spider have?", ("eight", "8")),
    ("How many months are there in a year?", ("twelve", "12")),
    ("How many hours are there in a day?", ("24", "twenty-four", "twenty four")),
    ("What is the opposite of hot?", ("cold",)),
    ("What is the opposite of up?", ("down",)),
    ("What is the opposite of day?", ("night",)),
    ("What is the plural of mouse?", ("mice",)),
    ("What is the plural of child?", ("children",)),
    ("Which planet is the largest in our solar system?", ("jupiter",)),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("What star is at the center of our solar system?", ("sun",)),
    ("What do bees make?", ("honey",)),
    ("What gas do plants take in from the air to make food?", ("carbon dioxide", "co2")),
    ("What is frozen water called?", ("ice",)),
    ("At what temperature in Celsius does water freeze?", ("0", "zero")),
    ("At what temperature in Celsius does water boil?", ("100", "hundred")),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("Who painted the Mona Lisa?", ("leonardo", "da vinci")),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What is the tallest animal in the world?", ("giraffe",)),
    ("What is the largest mammal on Earth?", ("whale",)),
    ("Which language is mainly spoken in Brazil?", ("portuguese",)),
    ("How do you say 'thank you' in Spanish?", ("gracias",)),
    ("How do you say 'hello' in French?", ("bonjour", "salut")),
    ("Complete the sentence: The early bird catches the ...", ("worm",)),
    ("What do you call a baby cat?", ("kitten",)),
    ("What do you call a baby dog?", ("puppy",)),
    ("Which season comes after winter?", ("spring",)),
    ("What shape has three sides?", ("triangle",)),
    ("What is the chemical symbol for water?", ("h2o",)),
    ("Which organ pumps blood through the human body?", ("heart",)),
    ("What is the main language spoken in the United States?", ("english",)),
    ("Name the continent where Egypt is.", ("africa",)),
    ("What is the currency of Japan?", ("yen",)),
    ("Which metal is liquid at room temperature?", ("mercury",)),
    ("What instrument has black and white keys?", ("piano",)),
)


def generate(split: str = "test", n: int = len(ITEMS), seed: int = 0, **_) -> list[Task]:
    """The whole held-out set (it has only a test split: nothing of it is ever trained on)."""
    if split != "test":
        raise ValueError(f"environment chat: held-out only, it has no {split!r} split")
    return [Task(id=f"chat-{i:03d}", domain=DOMAIN, split="test", prompt=q, answer=accepted[0],
                 meta={"accepted": list(accepted)}) for i, (q, accepted) in enumerate(ITEMS[:n])]


def verify(task: Task, completion: str) -> tuple[float, str]:
    text = final_answer(completion).lower()
    for a in task.meta["accepted"]:
        if re.search(rf"(?<![a-z0-9]){re.escape(a)}(?![a-z0-9])", text):
            return 1.0, f"contains {a!r}"
    return 0.0, f"none of {task.meta['accepted']} in the reply"
