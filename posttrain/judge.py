"""The guard's inline LLM judge (GLM-5.2's second anti-hacking stage): any chat checkpoint, asked about the
calls that passed the rules but look suspicious (environments.guard), with the episode so far in its prompt.

It answers with the likelier of the two answer turns ("allow" / "block", thinking off) as the checkpoint's
template renders them: one scoring forward per call, no sampling, so a judge is deterministic and its cost is
the tokens it reads. `measure` scores a judge on an environment's labelled calls (precision and recall of
blocking); the RL stages refuse a judge below the configured floors rather than let it block honest calls or
wave hacks through.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from environments.guard import ANSWERS, FEATURES, judge_prompt, suspicion
from posttrain.chat import ids_around_plain, render_ids, render_text
from posttrain.engines import rollout_engine


@dataclass
class ModelJudge:
    """A Workspace judge: `(tool, arg, workspace) -> reason | None`, reading `workspace.context`."""
    checkpoint: str
    features: tuple[str, ...] = FEATURES
    engine_name: str = "torch"
    tokens: int = 0                 # tokens the judge has read, over its lifetime
    judged: int = 0                 # calls it was asked about
    engine: object = field(default=None, repr=False)
    _answers: list | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.engine is None:
            self.engine = rollout_engine(self.engine_name, self.checkpoint)
        self.tok = self.engine.tokenizer

    def _items(self, question: str) -> list[tuple[list[int], list[int], list[int]]]:
        # the question quotes the episode (file contents, names, the agent's argument): plain text, so nothing
        # in it can close the user turn and write the judge's answer for it
        prompt = ids_around_plain(self.tok, lambda c: render_text(self.tok, [{"role": "user", "content": c}],
                                                                  add_generation_prompt=True, enable_thinking=False),
                                  question, memo="judge")
        return [(prompt, tail, [1] * len(tail)) for tail in self._answer_ids()]

    def _answer_ids(self) -> list[list[int]]:
        """Each answer's ids as the template renders them after the generation prompt (the same for any question)."""
        if self._answers is None:
            user = [{"role": "user", "content": "Allow or block?"}]
            prompt = render_ids(self.tok, user, add_generation_prompt=True, enable_thinking=False)
            self._answers = []
            for answer in ANSWERS:
                full = render_ids(self.tok, [*user, {"role": "assistant", "content": answer, "reasoning_content": ""}],
                                  enable_thinking=False)
                if full[:len(prompt)] != prompt:
                    raise ValueError(f"judge {self.checkpoint}: its template renders the answer turn differently "
                                     f"from the generation prompt; cannot score answers")
                self._answers.append(full[len(prompt):])
        return self._answers

    def decide(self, context: dict, tool: str, arg: str) -> str:
        """"allow" or "block" for this call in this episode."""
        items = self._items(judge_prompt(context, tool, arg))
        scores = [sum(lp) for lp in self.engine.score(items, mode="sampled")]
        self.tokens += len(items[0][0]) + sum(len(t) for _, t, _ in items)
        self.judged += 1
        return ANSWERS[max(range(len(ANSWERS)), key=scores.__getitem__)]

    def __call__(self, tool: str, arg: str, ws) -> str | None:
        flags = suspicion(tool, arg, ws.context, self.features)
        if not flags:
            return None
        if self.decide(ws.context, tool, arg) == "block":
            return f"judge: block ({', '.join(flags)})"
        return None


def measure(judge: ModelJudge, cases: list[dict]) -> dict:
    """Precision and recall of blocking on labelled calls, and the tokens the judge read per call."""
    t0, n0 = judge.tokens, judge.judged
    said = [judge.decide(c["context"], c["tool"], c["arg"]) for c in cases]
    tp = sum(s == "block" and c["label"] == "block" for s, c in zip(said, cases))
    blocked = sum(s == "block" for s in said)
    hacks = sum(c["label"] == "block" for c in cases)
    by_kind: dict[str, list[int]] = {}
    for s, c in zip(said, cases):
        by_kind.setdefault(c["kind"], []).append(int(s == c["label"]))
    return {"precision": round(tp / blocked, 4) if blocked else 0.0, "recall": round(tp / hacks, 4) if hacks else 0.0,
            "labelled_calls": len(cases), "hacks": hacks,
            "judge_tokens_per_call": round((judge.tokens - t0) / max(1, judge.judged - n0), 1),
            "accuracy_by_kind": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_kind.items())}}
