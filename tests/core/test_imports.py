"""pagedllm's import graph: no cycle among its modules, and every layer imports only downward.

The graph is read from the source (the AST of every module under pagedllm/), not from what
an import happens to execute, so every import statement counts: at the top of a module,
inside a function (a lazy import), under ``if TYPE_CHECKING:``. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``; relative imports are
resolved. Importing ``a.b.c`` also runs the ``__init__`` of ``a.b`` unless the importer is
inside ``a.b`` already, so that is an edge too. Modules imported by a computed name
(``importlib.import_module(variable)``) are not seen.

The layers, from the top (who asks) to the bottom (how to compute), as in docs/testing.md:
entrypoints -> engine -> models -> layers -> attention / kernels.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "pagedllm"

# A module of a layer may import modules of its own layer or of lower ones (larger number).
LAYERS = {"entrypoints": 0, "engine": 1, "models": 2, "layers": 3, "attention": 4, "kernels": 4}
# Subpackages that never import these, whatever their place above.
FORBIDDEN = {
    "loader": {"engine", "entrypoints", "bench"},
    **{low: {"engine", "entrypoints", "bench"} for low in ("models", "layers", "attention", "kernels")},
}

Edge = tuple[str, str]


# ---- the graph -------------------------------------------------------------------------------

def find_modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package (packages by __init__)."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (``a.b.attr`` -> ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, path: Path,
             modules: dict[str, Path]) -> list[str]:
    """The modules of ours that one import statement names."""
    if isinstance(node, ast.Import):
        return [t for alias in node.names if (t := _resolve(alias.name, modules))]
    if node.level:
        base = _package_of(module, path).split(".")
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    targets = []
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        target = submodule if submodule in modules else _resolve(source, modules)
        if target:
            targets.append(target)
    return targets


def _with_packages(target: str, importer: str) -> list[str]:
    """``target`` and each enclosing package whose __init__ importing it runs (those that do
    not also enclose the importer)."""
    parts = target.split(".")
    chain = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [p for p in chain if not (importer == p or importer.startswith(p + "."))]


def import_graph(package_dir: Path) -> dict[Edge, int]:
    """Every import edge between the package's modules -> the line of its first import."""
    modules = find_modules(package_dir)
    edges: dict[Edge, int] = {}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, module, path, modules):
                for dep in _with_packages(target, module):
                    if dep in modules and dep != module:
                        edges.setdefault((module, dep), node.lineno)
    return edges


def _successors(edges: dict[Edge, int]) -> dict[str, list[str]]:
    succ: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    return succ


def _strongly_connected(succ: dict[str, list[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative: the graph may be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in succ:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(succ[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _shortest_cycle(start: str, succ: dict[str, list[str]], within: set[str]) -> list[str]:
    """start -> ... -> start, as few steps as possible, staying inside ``within``."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in succ[node]:
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start] + path[::-1][1:] + [start]
            if child in within and child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle")


def find_cycles(edges: dict[Edge, int]) -> list[list[str]]:
    """Import cycles as chains [a, b, ..., a]: per cycle-forming group of modules, the
    shortest cycle through each member, each cycle once."""
    succ = _successors(edges)
    cycles: set[tuple[str, ...]] = set()
    for component in _strongly_connected(succ):
        if len(component) < 2:
            continue
        for member in component:
            ring = _shortest_cycle(member, succ, component)[:-1]
            turn = ring.index(min(ring))
            cycles.add(tuple(ring[turn:] + ring[:turn]))
    return [list(c) + [c[0]] for c in sorted(cycles)]


def format_chain(chain: list[str], edges: dict[Edge, int], package_dir: Path) -> str:
    """a.py:12 -> b.py:40 -> a.py: each file with the line of its import of the next."""
    modules = find_modules(package_dir)
    files = [str(modules[m].relative_to(package_dir.parent)) for m in chain]
    lines = [f":{edges[(a, b)]}" for a, b in zip(chain, chain[1:])] + [""]
    return " -> ".join(f + line for f, line in zip(files, lines))


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_violations(edges: dict[Edge, int]) -> list[str]:
    """Every import that goes up the layers or into a subpackage its layer must not use."""
    bad = []
    for (a, b), line in sorted(edges.items()):
        la, lb = _layer(a), _layer(b)
        if la is None or lb is None or la == lb:
            continue
        upward = la in LAYERS and lb in LAYERS and LAYERS[lb] < LAYERS[la]
        if upward or lb in FORBIDDEN.get(la, ()):
            bad.append(f"{a} imports {b} (line {line}): {la} must not depend on {lb}")
    return bad


# ---- the checks --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph() -> dict[Edge, int]:
    return import_graph(PACKAGE_DIR)


def test_the_graph_sees_every_kind_of_import(graph):
    """Guards the checker against reading nothing: known edges of each kind are found."""
    assert ("pagedllm.llm", "pagedllm.engine.llm_engine") in graph          # top level
    assert ("pagedllm.entrypoints.cli", "pagedllm.bench.main") in graph     # in a function
    assert ("pagedllm.loader.gguf_loader", "pagedllm.loader.errors") in graph   # relative
    assert len(find_modules(PACKAGE_DIR)) > 60


def test_no_import_cycle_among_pagedllm_modules(graph):
    cycles = [format_chain(c, graph, PACKAGE_DIR) for c in find_cycles(graph)]
    assert not cycles, "import cycles (file:line of each import):\n  " + "\n  ".join(cycles)


def test_layers_import_only_downward(graph):
    bad = layer_violations(graph)
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


# ---- the checker itself ------------------------------------------------------------------

def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_checker_reports_a_cycle_hidden_in_a_function(tmp_path):
    pkg = _write(tmp_path / "planted", {
        "__init__.py": "",
        "a.py": "from planted.b import g\n\ndef f():\n    return g()\n",
        "b.py": "def g():\n    from planted import a  # lazy: dodges the cycle at import time\n"
                "    return a\n",
        "c.py": "from . import a\n",
    })
    edges = import_graph(pkg)
    assert find_cycles(edges) == [["planted.a", "planted.b", "planted.a"]]
    text = format_chain(find_cycles(edges)[0], edges, pkg)
    assert text == "planted/a.py:1 -> planted/b.py:2 -> planted/a.py"


def test_checker_reports_a_cycle_through_a_package_init(tmp_path):
    """x imports sub.leaf, which runs sub/__init__.py, which imports y, which imports x."""
    pkg = _write(tmp_path / "planted", {
        "__init__.py": "",
        "x.py": "from planted.sub.leaf import K\n",
        "y.py": "import planted.x\n",
        "sub/__init__.py": "from .. import y\n",
        "sub/leaf.py": "K = 1\n",
    })
    assert find_cycles(import_graph(pkg)) == [["planted.sub", "planted.y", "planted.x", "planted.sub"]]


def test_checker_finds_no_cycle_in_a_sibling_import_of_a_package(tmp_path):
    """Modules of one package importing each other's names through the package's __init__
    is the usual layout, not a cycle: the package is already being imported."""
    pkg = _write(tmp_path / "planted", {
        "__init__.py": "from .outer import run\n",
        "errors.py": "class E(Exception): ...\n",
        "outer.py": "from .errors import E\nfrom planted.errors import E as F\n",
    })
    edges = import_graph(pkg)
    assert set(edges) == {("planted", "planted.outer"), ("planted.outer", "planted.errors")}
    assert find_cycles(edges) == []


def test_checker_reports_an_upward_import(tmp_path):
    pkg = _write(tmp_path / "pagedllm", {
        "__init__.py": "", "models/__init__.py": "", "engine/__init__.py": "", "loader/__init__.py": "",
        "models/llama.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from pagedllm.engine.runner import Runner\n",
        "engine/runner.py": "from pagedllm.models import llama\n",
        "loader/gguf.py": "def f():\n    import pagedllm.engine.runner\n",
    })
    assert layer_violations(import_graph(pkg)) == [
        "pagedllm.loader.gguf imports pagedllm.engine (line 2): loader must not depend on engine",
        "pagedllm.loader.gguf imports pagedllm.engine.runner (line 2): loader must not depend on engine",
        "pagedllm.models.llama imports pagedllm.engine (line 3): models must not depend on engine",
        "pagedllm.models.llama imports pagedllm.engine.runner (line 3): models must not depend on engine",
    ]
