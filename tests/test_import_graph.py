"""posttrain's modules import each other without circles: every import of a posttrain module, at module level, inside
a function or under TYPE_CHECKING (a function-local import hides a circle, it does not cut it), is an edge between two
files, and the graph of files has no cycle. `from posttrain.x import y` imports posttrain/x/y.py where y is a
submodule, else posttrain/x.py or posttrain/x/__init__.py; importing a package imports its __init__.py. The parent
packages' __init__ files that Python runs first are not edges: a package's __init__ that imports its own modules would
otherwise close a circle with each of them."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """posttrain/a/b.py or posttrain/a/b/__init__.py under `root` for the dotted module `name`; None outside
    posttrain."""
    parts = name.split(".")
    if parts[0] != "posttrain":
        return None
    base = root.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path, root: Path = ROOT) -> set[Path]:
    """The posttrain files `path` imports, anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[Path] = set()

    def add(name: str) -> None:
        if (f := module_file(name, root)) is not None:
            out.add(f)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("posttrain"):
                continue
            sub = [f"{mod}.{alias.name}" for alias in node.names
                   if module_file(f"{mod}.{alias.name}", root) is not None]
            out.update(module_file(s, root) for s in sub)
            named = [alias.name for alias in node.names if module_file(f"{mod}.{alias.name}", root) is None]
            if named or not sub:
                add(mod)
    out.discard(path)
    return out


def graph(root: Path = ROOT) -> dict[Path, set[Path]]:
    return {p: imports_of(p, root) for p in sorted((root / "posttrain").rglob("*.py"))}


def components(g: dict[Path, set[Path]]) -> list[set[Path]]:
    """The strongly connected components of more than one file: every file of one reaches every other (Tarjan's
    algorithm, without recursion)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on: set[Path] = set()
    out: list[set[Path]] = []

    def enter(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)

    for root in sorted(g):
        if root in index:
            continue
        enter(root)
        work = [(root, iter(sorted(g.get(root, ()))))]
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    enter(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def circle(g: dict[Path, set[Path]], comp: set[Path]) -> list[Path]:
    """A shortest circle through the first file of `comp`, inside it (breadth-first), as [a, b, ..., a]."""
    start = min(comp)
    prev: dict[Path, Path] = {}
    frontier, last = [start], None
    while last is None:
        nxt = []
        for v in frontier:
            for w in sorted(g[v] & comp):
                if w == start:
                    last = v
                    break
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
            if last is not None:
                break
        frontier = nxt
    back = [last]
    while back[-1] != start:
        back.append(prev[back[-1]])
    return back[::-1] + [start]


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_checker_finds_a_circle(tmp_path):
    a, b, c, d = (tmp_path / n for n in "abcd")
    g = {a: {b}, b: {c, d}, c: {a}, d: set()}
    (comp,) = components(g)
    assert comp == {a, b, c} and circle(g, comp) == [a, b, c, a]
    assert components({a: {b}, b: {c}, c: set()}) == []


def test_checker_reads_every_kind_of_import(tmp_path):
    files = {"posttrain/__init__.py": "",
             "posttrain/a/__init__.py": "from posttrain.a.b import f\n",
             "posttrain/a/b.py": "def f():\n    from posttrain.c import g  # function-local\n",
             "posttrain/a/d.py": "from posttrain.a import b, f\nfrom . import e\n",  # a submodule and a name
             "posttrain/a/e.py": "import posttrain.a\nfrom ..c import g\n",  # a package, and relative
             "posttrain/c.py": "import os\ng = 1\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = {p.relative_to(tmp_path).as_posix(): {q.relative_to(tmp_path).as_posix() for q in qs}
             for p, qs in graph(tmp_path).items()}
    assert edges["posttrain/a/__init__.py"] == {"posttrain/a/b.py"}
    assert edges["posttrain/a/b.py"] == {"posttrain/c.py"}
    assert edges["posttrain/a/d.py"] == {"posttrain/a/b.py", "posttrain/a/__init__.py", "posttrain/a/e.py"}
    assert edges["posttrain/a/e.py"] == {"posttrain/a/__init__.py", "posttrain/c.py"}
    assert edges["posttrain/c.py"] == set()


def test_no_import_cycles():
    g = graph()
    found = components(g)
    shown = "\n".join(" -> ".join(map(_rel, circle(g, comp))) + f"  ({len(comp)} files import each other)"
                      for comp in found)
    print(shown)
    assert not found, f"import circles among posttrain's files (cut them, do not hide them):\n{shown}"
