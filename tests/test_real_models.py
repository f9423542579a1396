"""A real checkpoint's own tokenizer and template through every stage (issue: real models): a ChatML model with
thinking and Hermes tool calls, no `{% generation %}` markers and no BOS, built on the fly (no hub)."""
import json
from pathlib import Path

from chat_fixtures import make_checkpoint
from test_pipeline_smoke import posttrain


def test_a_chatml_checkpoint_trains_in_every_stage(tmp_path):
    ckpt = make_checkpoint("chatml", tmp_path / "ckpt")
    home = tmp_path / "home"
    posttrain(home, "run", "--profile", "smoke", "--set", f"base.init_from={ckpt}", "--set", "sft.steps=12")
    report = json.loads((home / "latest" / "report.json").read_text())
    fmt = report["chat_format"]
    assert set(fmt) == {"sft", "specialist/reasoning", "specialist/agentic", "specialist/general", "generalist",
                        "quantized"}
    assert fmt["sft"]["template"].startswith("chatml:") and fmt["sft"]["thinking"] is True
    assert fmt["sft"]["tool_format"] == "hermes"
    hist = json.loads((Path(report["stages"]["sft"]["artifact"]) / "history.json").read_text())
    assert all(x > 0 for x in hist["loss"]) and hist["loss"][-1] < hist["loss"][0]  # it trained, and learned
    assert set(report["eval"]["generalist"]) >= {"reasoning", "agentic", "general", "agentic:nothink"}
