"""The package's import graph: no cycles, and no import from a lower layer to a higher one
(read from the sources, so a lazy import inside a function counts too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "tvm_ext"

# Lowest first. tuning.tuner (the search) sits above the pipeline it tunes; the rest of tuning/
# (record I/O, design spaces) below the strategy that reads records.
LAYERS = ["errors", "_compat", "target", "asm", "relax_info", "intrin", "kernels", "dlight", "transform", "tuning",
          "strategy", "link", "pipeline", "report", "quantization", "train", "tuning.tuner", "ops", "models", "testing",
          "cli", "__main__", ""]

# Upward imports still to move: none (issue 32 moved the emulators' entry points into testing/).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the tvm_ext modules it imports (a package's submodule when one is named)."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("tvm_ext"):
                target = node.module
            else:
                continue
            for alias in node.names:
                imported = f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                if imported in modules and imported != name:
                    graph[name].add(imported)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> int:
    rest = module.removeprefix("tvm_ext").removeprefix(".")
    best = max((layer for layer in LAYERS if rest == layer or rest.startswith(layer + ".") or layer == ""),
               key=len)
    return LAYERS.index(best)


def test_no_import_cycle():
    assert _cycles(import_graph()) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    # a package's __init__ re-exporting its own submodules (tuning/ re-exports tune) is no layer
    upward = {(a, b) for a, targets in import_graph().items() for b in targets
              if _layer(b) > _layer(a) and not b.startswith(a + ".")}
    assert upward - KNOWN_UPWARD == set()


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The reader is not vacuous: a cycle and an upward import in a made-up graph are found."""
    graph = {"tvm_ext.kernels.a": {"tvm_ext.strategy.b"}, "tvm_ext.strategy.b": {"tvm_ext.kernels.a"}}
    assert _cycles(graph) == [["tvm_ext.kernels.a", "tvm_ext.strategy.b"]]
    assert _layer("tvm_ext.strategy.b") > _layer("tvm_ext.kernels.a")
    assert "tvm_ext.strategy.dispatch" in import_graph()["tvm_ext.pipeline"]


def private_imports(sources: dict[str, str]) -> list[tuple[str, str]]:
    """(module, name) for each private name (one leading underscore) a module imports from
    another tvm_ext module: what a module shares is public, the rest stays in it."""
    found = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tvm_ext")):
                found += [(name, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_crosses_modules():
    assert private_imports({name: path.read_text() for name, path in _modules().items()}) == []
    made_up = {"m": "from .conv2d import _pair, KERNEL_ATTR\nfrom . import __version__"}
    assert private_imports(made_up) == [("m", "_pair")]
