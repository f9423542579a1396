"""The synchronous path's determinism on GLM-5's smoke DAG (the reason `posttrain figures` over seeds means something:
the same seed gives the same numbers). `make test-slow`: two more smoke runs, ~30 minutes on a slow 2-core machine."""
import json
from pathlib import Path

from tests.test_pipeline_smoke import at_once, posttrain

# synchronous (no staleness), with GRPO's and PPO's specialists
SYNC_TWO_SPECIALISTS = ["--set", "rl.domains=[reasoning, agentic]", "--set", "rl.max_staleness=0",
                        "--set", "opd.max_staleness=0"]


def _weights(report: dict) -> dict[str, str]:
    """Each stage's weight digests, from its manifest."""
    out = {}
    for stage, v in report["stages"].items():
        files = dict(json.loads((Path(v["artifact"]) / "manifest.json").read_text())["files"])
        out.update({f"{stage}/{k}": d for k, d in files.items() if k.endswith(".safetensors")})
    return out


def test_synchronous_path_gives_the_same_report_twice(tmp_path):
    """Same seed, same machine, rl.max_staleness=0 and opd.max_staleness=0, two fresh homes: every score,
    every generated-token count and every stage's weights are identical, so `posttrain figures` over the two
    runs shows no spread. (Timings differ, and so do run ids.) The routing is part of it: the routers' weights and
    biases, and each stage's expert-load and replay figures, over GRPO and PPO's multi-turn episodes."""
    root = tmp_path
    at_once([(root / name, ["run", "--profile", "smoke", *SYNC_TWO_SPECIALISTS]) for name in "ab"])
    a, b = (json.loads((root / name / "latest" / "report.json").read_text()) for name in "ab")
    for key in ("eval", "tokens", "pass_at_k", "moe"):
        assert a[key] == b[key], key
    assert "replay_probe_with" in a["moe"]["rl-agentic"]
    assert _weights(a) == _weights(b) and len(_weights(a)) >= 8  # base, ramp and its 2 rungs, sft, rl, opd, quantize
    runs = [str(root / n / "runs" / r["run_id"]) for n, r in zip("ab", (a, b))]
    posttrain(root / "figures", "figures", "--runs", *runs)
    f = json.loads((root / "figures" / "figures.json").read_text())
    assert f["seeds"] == [0, 0]
    assert all(v["min"] == v["max"] for suites in f["eval"].values() for v in suites.values())
    assert (root / "figures" / "figures.md").read_text().startswith("# figures: profile smoke, seeds")
