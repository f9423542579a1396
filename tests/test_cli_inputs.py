"""Bad input fails before any work: exit 2, one `posttrain: error` line naming the key or file and what is
allowed, nothing written to the home (no run folder, no mlflow.db)."""
import sys
from pathlib import Path

import pytest
from conftest import CliResult, run_cli

ROOT = Path(__file__).resolve().parent.parent


def posttrain(home: Path, *args: str) -> CliResult:
    """`posttrain *args` on `home`, in this process (conftest.run_cli); tests/test_cli_entry.py runs the installed
    entry point in a process of its own."""
    return run_cli(args, env={"POSTTRAIN_HOME": str(home)}, cwd=ROOT)


def _checkpoint_without_tool_calls(path: Path) -> Path:
    """SmolLM2-135M-Instruct's situation: a ChatML template that renders no tool calls."""
    sys.path.insert(0, str(Path(__file__).parent))
    from chat_fixtures import make_checkpoint
    make_checkpoint("chatml", path)
    plain = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}"
             "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    (path / "chat_template.jinja").write_text(plain)
    return path


@pytest.fixture(scope="module")
def no_tools(tmp_path_factory):
    return _checkpoint_without_tool_calls(tmp_path_factory.mktemp("ckpt"))


CASES = [
    (["run", "--profile", "smoke-dense", "--set", "registered_model=a/b c"], "registered_model: must be"),
    (["run", "--profile", "smoke-dense", "--set", "sft.lr=inf"], "sft.lr: must be a finite number"),
    (["run", "--profile", "smoke-dense", "--set", "rl.lr=nan"], "rl.lr: must be a finite number"),
    (["run", "--profile", "smoke-dense", "--set", "sft.steps=true"], "sft.steps: must be a number (got True)"),
    (["run", "--profile", "smoke-dense", "--set", "sft.warmup=100"], "sft.warmup: must be <= steps (got 100 > 4)"),
    (["run", "--profile", "smoke-dense", "--force", "xs-agentic"], "--force: unknown stage 'xs-agentic' in workflow post_train"),
    (["run", "--profile", "/x/nope.yaml"], "--profile /x/nope.yaml: no such file"),
    (["run", "--profile", "/tmp"], "--profile /tmp: is a directory"),
    (["rerun", "nosuchstage", "--from", "latest"], "rerun: unknown stage 'nosuchstage'"),
    (["lineage", "posttrain-smoke"], "expected NAME@VERSION"),
    (["lineage", "x@abc"], "expected NAME@VERSION"),
    (["lineage", "nosuch@1"], "no runs are tracked under"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a)[:40] for a, _ in CASES])
def test_bad_input_fails_before_any_work_with_one_line(tmp_path, args, message):
    p = posttrain(tmp_path, *args)
    errors = [line for line in p.stderr.splitlines() if line.startswith("posttrain: error")]
    assert p.returncode == 2 and len(errors) == 1 and message in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()


def test_an_empty_input_file_is_refused_before_any_work(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    p = posttrain(tmp_path, "run", "--profile", "smoke-dense", "--set", f"curate.inputs=['{empty}']")
    assert p.returncode == 2 and "curate.inputs: every file is empty (empty.jsonl)" in p.stderr, p.stderr[-2000:]
    p = posttrain(tmp_path, "run", "--profile", "smoke-dense", "--set", f"curate.inputs=['{tmp_path}/none*.jsonl']")
    assert p.returncode == 2 and "matches no file" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_a_template_without_tool_calls_is_refused_before_base_and_can_be_replaced(tmp_path, no_tools):
    p = posttrain(tmp_path, "run", "--profile", "smoke-dense", "--set", f"base.init_from={no_tools}")
    assert p.returncode == 2 and "renders no tool calls" in p.stderr and "base.chat_template" in p.stderr, p.stderr
    assert not (tmp_path / "runs").exists()
    from posttrain.stages.base import check_checkpoint
    from posttrain.chat import chat_format
    from posttrain.config import load_config
    cfg = load_config("smoke-dense", [f"base.init_from={no_tools}",
                                f"base.chat_template={ROOT / 'configs/templates/chatml-tools.jinja'}"])
    assert chat_format(check_checkpoint(cfg)).tool_format == "hermes"  # the checkpoint itself is untouched
    assert "tool_call" not in (no_tools / "chat_template.jinja").read_text()
