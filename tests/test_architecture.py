"""The package's rooms, checked on its source: no import cycles between mlxrl's modules (imports inside
functions included), the memory model imports no trainer, the engine is the only training loop.

    python -m pytest -q tests/test_architecture.py
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mlxrl"


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the mlxrl modules it imports by name (`from .x import y` counts as mlxrl...x.y when y is a
    module, else as mlxrl...x); a parent package run implicitly by importing its child is not an edge."""
    modules = _modules()
    graph = {}
    for name, (path, package) in modules.items():
        here = name.split(".") if package else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == "mlxrl")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != "mlxrl":
                    continue
                for a in node.names:
                    targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_module_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 40 and "mlxrl.trainers.engine" in graph["mlxrl.trainers.sft"]
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("module", ["mlxrl.plan", "mlxrl.plan.model", "mlxrl.plan.report", "mlxrl.plan.suggest"])
def test_the_memory_model_imports_no_trainer(module):
    graph = import_graph()
    assert not {t for t in graph[module] if t.startswith("mlxrl.trainers")}


def test_the_engine_is_the_only_loop():
    """No trainer overrides the engine's loop or its planning of the run (GRPO's rounds are a batch source)."""
    for path in (ROOT / "trainers").glob("*.py"):
        if path.name == "engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                assert not methods & {"_loop", "_plan", "_train_loop", "_optimizer_step", "train"}, \
                    (path.name, node.name)


def test_no_library_file_over_about_450_lines():
    """Small modules with clear rooms: a file that grows past this is split by responsibility."""
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 470}
    assert not long, long


def test_importing_mlxrl_imports_no_trainer_and_sets_nothing():
    """`import mlxrl` loads the BLAS (mlxrl.cpu) and nothing else: the trainers are imported on first use."""
    import subprocess
    import sys

    code = ("import sys, mlxrl; print(sorted(m for m in sys.modules if m.startswith('mlxrl.'))); "
            "from mlxrl import SFTTrainer; print(SFTTrainer.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    first, second = out.stdout.splitlines()[:2]
    cpu = ["mlxrl.cpu", "mlxrl.cpu.blas", "mlxrl.cpu.fastmath", "mlxrl.cpu.native"]
    assert first == str(cpu), out.stderr
    assert second == "mlxrl.trainers.sft"
