"""lm-eval-harness through the adapter: local task files, a plain and a W4A8 checkpoint."""
import pytest
import torch

import environments
from environments.base import export_jsonl
from posttrain.chat import train_tokenizer
from posttrain.config import ModelConfig, QuantizeConfig
from posttrain.tools.lm_eval_adapter import EXAMPLE_TASKS, run
from posttrain.models.preset import build_model, save_checkpoint
from posttrain.stages.quantize import calibrate, export


def test_lm_eval_runs_local_tasks_on_plain_and_quantized_checkpoints(tmp_path, monkeypatch):
    tasks = list(environments.get("reasoning").generate("test", 6, 0))
    export_jsonl(tasks, str(tmp_path / "reasoning-test.jsonl"))
    monkeypatch.chdir(tmp_path)  # the example task's data_files path is relative
    torch.manual_seed(0)
    tok = train_tokenizer([f"Question: {t.prompt} Answer: {t.answer}." for t in tasks] * 5, 300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok).eval()
    save_checkpoint(model, tok, tmp_path / "fp")
    ints = calibrate(model, torch.randint(0, len(tok), (4, 16)), QuantizeConfig(group_size=32))
    export(model, tok, ints, QuantizeConfig(group_size=32), tmp_path / "q")
    for ck in ("fp", "q"):
        res = run(tmp_path / ck, ["posttrain_reasoning", "posttrain_reasoning_chat"], EXAMPLE_TASKS, chat=False)
        r = res["posttrain_reasoning"]
        assert r["sample_len"] == 6 and 0.0 <= r["acc,none"] <= 1.0 and r["perplexity,none"] > 1.0
