"""More of the smoke DAG's contracts on test_pipeline_smoke's first run (its `first` fixture, run again for this
module): a changed OPD setting redoes only what follows it, RL and OPD resume exactly after a SIGKILL, and the
cross-stage workflow. `make test-slow`: each is a stage or a workflow more of smoke runs, ~25 minutes together on a
slow 2-core machine."""
import json

import pytest
from tests.test_pipeline_smoke import (  # noqa: F401 - first: the fixture, for this module
    _resumed_histories, first, posttrain, resume_after_kill)


@pytest.fixture(scope="module")
def resumed(first):  # noqa: F811
    return resume_after_kill(first, ["rl-general", "opd"])


def test_an_opd_change_redoes_only_downstream(first):
    """(A run without a change redoes nothing: the failing-gate test's.)"""
    home, _ = first
    # teachers as Ray actors (the smoke profile places them in the rollout worker): both placements run
    posttrain(home, "run", "--profile", "smoke-dense", "--set", "opd.lr=1e-4", "--set", "opd.teacher_placement=actor")
    changed = json.loads((home / "latest" / "report.json").read_text())
    redone = {s for s, v in changed["stages"].items() if not v["cached"]}
    assert redone == {"opd", "quantize", "evaluate"}


def test_rl_specialist_resumes_exactly_after_sigkill(first, resumed):
    """SIGKILL a specialist right after its step-1 checkpoint (weights, optimizer, RNG, request cursor,
    rollout buffer); the rerun continues at step 1, and every step's reward and loss is the
    uninterrupted run's: none lost, none repeated. (Whether two smoke steps reward anything depends on the
    samples: a group-normalised loss is 0 at ratio 1 while its gradient is not, and an all-equal group has
    neither; so resume is judged by exact equality, not by a loss being non-zero.)"""
    before, after = _resumed_histories(first, resumed, "rl-general")
    for key in ("reward", "loss", "grad_norm", "masked_fraction", "kl_behaviour", "staleness_mean", "val_score"):
        assert after[key] == before[key], key
    assert len(after["reward"]) == 2


def test_opd_resumes_exactly_after_sigkill(first, resumed):
    """The distillation node keeps its student buffer and teacher scores across a SIGKILL too."""
    before, after = _resumed_histories(first, resumed, "opd")
    for key in ("reverse_kl", "distill_loss", "student_tokens", "teacher_tokens", "val_score"):
        assert after[key] == before[key], key


def test_cross_stage_workflow_compares_three_consolidations(first):
    home, _ = first
    posttrain(home, "run", "--profile", "smoke-dense", "--workflow", "cross_stage")
    report = json.loads((home / "latest" / "report.json").read_text())
    assert all(report["stages"][s]["cached"] for s in ("sft", "rl-reasoning", "opd"))  # the main DAG is reused
    assert {"xs-agentic", "xs-general", "seq-agentic", "seq-general", "consolidation"} <= set(report["stages"])
    c = report["consolidation"]
    for method in ("multi_teacher_opd", "cross_stage", "sequential_rl"):
        assert set(c["scores"][method]) == set(c["recovery"][method]) == {"reasoning", "agentic", "general"}
        assert c["compute"][method]["student_tokens"] > 0 and c["compute"][method]["wall_s"] > 0
    # cross-stage scores earlier stages' prompts with their checkpoints; the baseline has no teacher
    assert c["compute"]["cross_stage"]["teacher_tokens"] > 0 == c["compute"]["sequential_rl"]["teacher_tokens"]
    assert set(c["forgetting"]["sequential_rl"]) == {"reasoning", "agentic"}
    assert (home / "runs" / report["run_id"] / "consolidation.md").exists()
