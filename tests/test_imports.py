"""The package's imports point one way: no module imports itself back through others, counting the
imports inside functions (they are imports all the same, only later). Imports under
``if TYPE_CHECKING:`` never run and are left out."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "slmedge"


def module_name(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree):
    """Every node but those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the slmedge modules it imports, anywhere in its body (a ``from a import b`` of a
    submodule ``a.b`` counts as importing ``a.b``; of a name, as importing ``a``)."""
    files = {module_name(p, pkg): p for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _runtime_nodes(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, mod, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # `import slmedge.a.b` of a name inside: the module that holds it
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("slmedge"):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / "slmedge"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "low.py").write_text("def f():\n    from ..high import g\n    return g\n")
    (pkg / "high.py").write_text("from .a.low import f\n")
    (pkg / "other.py").write_text("import slmedge.high\nfrom typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from .a.low import f\n")
    graph = import_graph(pkg)
    assert graph["slmedge.a.low"] == {"slmedge.high"} and graph["slmedge.other"] == {"slmedge.high"}
    assert cycles(graph) == [["slmedge.a.low", "slmedge.high"]]
    (pkg / "a" / "low.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(pkg)) == []


def test_slmedge_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


# Layers, lowest first: a module may import its own layer and those below, never one above.
LAYERS = [("errors", "fsutil", "hub", "limits", "paths", "procs", "progress", "quiet", "registry", "__init__"), ("backends", "data"), ("models",), ("compress",), ("export",),
          ("runtimes", "targets"), ("evaluate", "lm_eval_model"), ("study",), ("cli", "__main__")]


def layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_dependencies_point_down_the_layers():
    up = sorted(f"{m} -> {t}" for m, ts in import_graph().items() for t in ts if layer(t) > layer(m))
    assert not up, "imports of a layer above: " + "; ".join(up)
