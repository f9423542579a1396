"""IFEval-style instruction following with verifiable constraints (word, count, case, ending)."""
from __future__ import annotations

import random

from environments.base import Task, collect, final_answer

DOMAIN = "general"
WORDS = ("cat sun tree blue river stone bird moon fish lamp road cloud apple wind gold snow ship rain fire leaf "
         "door book hill star milk bread chair glass horse light night paper plant sand sea song table water wood "
         "king queen house grass field garden flower window bell coat ring salt seed shell smoke storm tooth wheel "
         "wing cake coin").split()
SEPARATORS = {"spaces": " ", "commas": ", "}
CASES = {"uppercase": str.upper, "lowercase": str.lower, "title case": str.title}
ENDINGS = {"": "", "an exclamation mark": "!", "a period": "."}


def _make(rng: random.Random) -> tuple[str, Task]:
    word, k = rng.choice(WORDS), rng.randint(1, 5)
    case, ending, sep = rng.choice(list(CASES)), rng.choice(list(ENDINGS)), rng.choice(list(SEPARATORS))
    prompt = (f"Write the word {word} {k} times in {case}, separated by {sep}"
              + (f", ending with {ending}." if ending else "."))
    answer = SEPARATORS[sep].join([CASES[case](word)] * k) + ENDINGS[ending]
    think = f"word={word}. times={k}. case={case}. sep={sep}." + (f" end={ENDINGS[ending]}" if ending else "")
    meta = {"word": word, "k": k, "case": case, "ending": ENDINGS[ending], "sep": SEPARATORS[sep]}
    return prompt, Task(id="", domain=DOMAIN, split="", prompt=prompt, answer=answer, meta=meta,
                        demo=[{"role": "assistant", "reasoning_content": think, "content": answer}])


def generate(split: str, n: int, seed: int, **_) -> list[Task]:
    return collect(DOMAIN, split, n, seed, _make)


def verify(task: Task, completion: str) -> tuple[float, str]:
    """Fraction of the four constraints met; the reason names the ones missed."""
    m, text = task.meta, final_answer(completion)
    body = text[:-1] if m["ending"] and text.endswith(m["ending"]) else text
    words = body.split(m["sep"].strip() or None) if m["sep"].strip() else body.split()
    words = [w.strip() for w in words]
    checks = {
        "ending": text.endswith(m["ending"]) if m["ending"] else not text.endswith(("!", ".")),
        "word": bool(words) and all(w.lower() == m["word"] for w in words),
        "count": len(words) == m["k"],
        "case": bool(words) and all(CASES[m["case"]](w) == w for w in words),
    }
    failed = [k for k, ok in checks.items() if not ok]
    return sum(checks.values()) / len(checks), "all constraints met" if not failed else "missed " + ",".join(failed)


def shortcut(task: Task) -> list[dict]:
    """A careless teacher's demonstration: it forgets the required ending (when there is one)."""
    m = task.meta
    content = task.answer[:-len(m["ending"])] if m["ending"] else task.answer
    think = task.demo[0]["reasoning_content"].split(" end=")[0]
    return [{"role": "assistant", "reasoning_content": think, "content": content}]
