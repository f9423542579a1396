"""A real checkpoint's own tokenizer and template through every stage (issue: real models), built on the fly (no
hub): a ChatML model with thinking and Hermes tool calls, no `{% generation %}` markers and no BOS; and a Llama-3
model with header ids, BOS, no pad, JSON tool calls and no thinking switch."""
import json
from pathlib import Path

import pytest
from tests.chat_fixtures import make_checkpoint
from tests.test_pipeline_smoke import at_once

FAMILIES = {  # family -> (thinking switch, tool format, extra settings)
    "chatml": (True, "hermes", ["--set", "rl.domains=[reasoning, agentic]"]),  # thinking, and Hermes tool calls
    # the tool-calling domain alone: every stage still runs, in about half the time
    "llama3": (False, "json", ["--set", "rl.domains=[agentic]"]),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """Each family's smoke run from its checkpoint, all started at once: {family: report}."""
    root = tmp_path_factory.mktemp("real")
    calls = [(root / family / "home", ["run", "--profile", "smoke-dense", "--set",
                                       f"base.init_from={make_checkpoint(family, root / family / 'ckpt')}",
                                       "--set", "sft.steps=12", *extra])
             for family, (_, _, extra) in FAMILIES.items()]
    at_once(calls)
    return {family: json.loads((home / "latest" / "report.json").read_text())
            for family, (home, _) in zip(FAMILIES, calls)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_real_template_trains_in_every_stage(reports, family):
    thinking, tool_format, _ = FAMILIES[family]
    report = reports[family]
    fmt = report["chat_format"]
    domains = ["reasoning", "agentic"] if family == "chatml" else ["agentic"]
    # the user's chat checkpoint is scored as chat from the start (base); only the ramped one as completion
    assert set(fmt) == {"base", "sft", *(f"specialist/{d}" for d in domains), "generalist", "quantized"}
    assert fmt["sft"]["template"].startswith(f"{family}:") and fmt["sft"]["thinking"] is thinking
    assert fmt["sft"]["tool_format"] == tool_format
    hist = json.loads((Path(report["stages"]["sft"]["artifact"]) / "history.json").read_text())
    assert all(x > 0 for x in hist["loss"]) and hist["loss"][-1] < hist["loss"][0]  # it trained, and learned
    assert set(report["eval"]["generalist"]) >= {*domains, "agentic:nothink"}
    assert {"opd", *(f"rl-{d}" for d in domains), "evaluate"} <= set(report["stages"])
