"""lm-eval-harness against any checkpoint folder (plain or W4A8), with tasks and data from local files.

The checkpoint is loaded by posttrain (so the compressed-tensors export runs on the CPU integer
kernels) and handed to lm-eval's own HF model wrapper; tasks come from YAML files under
`--include` (lm-eval's task format) whose datasets are local JSON/JSONL/CSV/Parquet files. Nothing is
fetched from a hub: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before lm-eval loads."""
from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.quant.int_linear import load_any

EXAMPLE_TASKS = Path(__file__).resolve().parents[2] / "lm_eval_tasks"


def run(checkpoint: str | Path, tasks: list[str], include: str | Path = EXAMPLE_TASKS, *, limit: int | None = None,
        batch_size: int = 16, num_fewshot: int | None = None, chat: bool = False) -> dict:
    """lm-eval's `results` (task -> metric -> value) for `checkpoint` on `tasks`. `chat`: prompts go through
    the checkpoint's chat template with thinking off (for post-trained checkpoints)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval  # lm-eval: only for `posttrain lm-eval`
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    include = Path(include)
    if not include.exists():
        raise FileNotFoundError(f"--include {include}: no such task folder")
    # the folder's own tasks first: indexing lm-eval's thousands of built-in ones took 3-6 minutes on a slow 2-core
    # machine; only a task the folder does not have needs them
    manager = TaskManager(include_path=str(include), include_defaults=False)
    if any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=str(include))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        local = sorted(p.stem for p in include.glob("*.yaml"))
        raise KeyError(f"lm-eval task(s) {unknown} not found (under {include}: {local})")
    model, tok = load_any(checkpoint)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size, device="cpu",
              max_length=model.config.max_position_embeddings, enable_thinking=False if chat else None)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                  apply_chat_template=chat, log_samples=False)
    return json.loads(json.dumps(out["results"], default=str))
