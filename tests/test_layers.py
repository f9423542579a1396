"""The package's layering: the model layer (posttrain/models) sits below the engines and the trainers."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABOVE = ("posttrain.engines", "posttrain.rl", "posttrain.quant", "posttrain.pipeline.run", "posttrain.pipeline.nodes")


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_nothing_in_the_model_layer_imports_from_engines_or_trainers():
    files = sorted((ROOT / "posttrain" / "models").glob("*.py"))
    assert len(files) >= 10
    bad = {f.name: sorted(n for n in imported(f) if n.startswith(ABOVE)) for f in files}
    assert not {k: v for k, v in bad.items() if v}
