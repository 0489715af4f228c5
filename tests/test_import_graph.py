"""marin's packages are layered (docs/CONTRACTS.md "Layers"): a module imports only its own
package and the layers below it, at the top of a file or inside a function alike, and modules
import no circle. Every `import marin.x` / `from marin.x import ...` found by `ast` is an edge."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "marin"
TOOLS = 4  # the top layer: launch and the tools (marin/<tool>.py, marin/cli.py)
LAYERS = {"config": 0, "model": 1, "optim": 1, "data": 1, "track": 2, "train": 3, "launch": TOOLS}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """A subpackage's layer; `marin` itself and its top-level modules (the tools) are the top."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return LAYERS[parts[1]]
    return TOOLS


def _imports(path: Path):
    """(imported marin module, line) for every import in the file, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "marin")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "marin":
            yield node.module, node.lineno
            for a in node.names:  # `from marin.track import record` imports the module marin.track.record
                yield f"{node.module}.{a.name}", node.lineno


def _edges() -> list[tuple[str, str, str]]:
    """(importer, imported, file:line) over marin/, the imported name a module of marin."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    edges = []
    for name, path in sorted(modules.items()):
        for target, line in _imports(path):
            if target in modules and target != name and not name.startswith(target + "."):  # a package's own __init__
                edges.append((name, target, f"{path.relative_to(ROOT)}:{line}"))
    return edges


def violations(edges) -> list[str]:
    return [f"{a} -> {b} ({where})" for a, b, where in edges if layer(b) > layer(a)]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_packages_import_only_layers_below():
    found = violations(_edges())
    print("\n".join(found))
    assert not found, f"{len(found)} imports of a higher layer:\n" + "\n".join(found)


def test_no_import_circle():
    graph: dict[str, set[str]] = {}
    for a, b, _ in _edges():
        graph.setdefault(a, set()).add(b)
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " → ".join(cycle)


def test_the_checker_sees_a_circle_and_a_layer_break():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert layer("marin.config.schema") == 0 and layer("marin.report") == TOOLS and layer("marin") == TOOLS
    assert violations([("marin.model.moe", "marin.launch.mesh", "x.py:1"),
                       ("marin.launch.entry", "marin.track.record", "y.py:2")]) == [
        "marin.model.moe -> marin.launch.mesh (x.py:1)"]


def test_every_package_has_a_layer():
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} == set(LAYERS)


@pytest.mark.parametrize("module", ["marin.config.derive", "marin.model.accounting", "marin.launch.entry",
                                    "marin.launch.slurm", "marin.launch.resume", "marin.launch.verify", "marin.cli"])
def test_each_module_imports_fresh(module):
    """Imported first, in a fresh interpreter (an order-dependent circle fails here)."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
