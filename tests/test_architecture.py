"""The package's rooms, checked on its source: no import cycles between mlxrl's modules (imports inside
functions included); the layers below the trainers (models, data, losses, optim) import no trainer and no
command and take no trainer config; only the commands and their `python -m` entries import `mlxrl.cli`,
an entry imports nothing else, and a command imports no underscored name of the library; the memory
model imports no trainer; the engine is the only training loop and a trainer overrides only its hooks,
never a private method; the Architecture page draws the package's root as it is. Each rule's checker is
shown failing on a planted violation.

    python -m pytest -q tests/test_architecture.py
"""

import ast
import re
from pathlib import Path

import pytest

from mlxrl.registry import TRAINERS

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
    assert len(graph) > 40 and "mlxrl.trainers.engine" in graph["mlxrl.trainers.sft.trainer"]
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("module", ["mlxrl.plan", "mlxrl.plan.model", "mlxrl.plan.report", "mlxrl.plan.suggest"])
def test_the_memory_model_imports_no_trainer(module):
    graph = import_graph()
    assert not {t for t in graph[module] if t.startswith("mlxrl.trainers")}


def class_methods(paths) -> list[tuple[str, set[str]]]:
    """(class name, the methods it defines) for every class of `paths`."""
    return [(node.name, {f.name for f in node.body if isinstance(f, ast.FunctionDef)})
            for path in paths for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]


def engine_methods() -> set[str]:
    """Every method the engine's rooms define (trainers/*.py: the engine, its mixins and objects, the hooks)."""
    return set().union(*(methods for _, methods in class_methods((ROOT / "trainers").glob("*.py"))))


def test_the_engine_is_the_only_loop():
    """No trainer overrides the engine's loop or its planning of the run (GRPO's rounds are a batch source)."""
    paths = [p for p in (ROOT / "trainers").rglob("*.py") if p.name != "engine.py"]
    for name, methods in class_methods(paths):
        assert not methods & {"_train", "_run", "_plan", "_step", "_accumulate", "_update_and_count", "train"}, name


CONFIG_NAMES = ("TrainConfig", "PairedConfig", *(e.config_name for e in TRAINERS))
LOWER = ("mlxrl.models", "mlxrl.data", "mlxrl.losses", "mlxrl.optim")
ENTRIES = ("mlxrl.__main__", *(f"mlxrl.{e.name}" for e in TRAINERS), "mlxrl.chat", "mlxrl.generate",
           "mlxrl.plan.__main__")


def _in(module: str, rooms) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that cross the layers: a lower room importing a trainer or a command, a library module
    importing a command, an entry importing anything but the commands and `runtime`."""
    out = []
    for module, targets in sorted(graph.items()):
        for t in sorted(targets):
            if _in(module, LOWER) and _in(t, ("mlxrl.trainers", "mlxrl.cli")):
                out.append(f"{module} imports {t}")
            elif module in ENTRIES and not _in(t, ("mlxrl.cli", "mlxrl.runtime", "mlxrl.generation")):
                out.append(f"entry {module} imports {t}")
            elif _in(t, ("mlxrl.cli",)) and not (_in(module, ("mlxrl.cli",)) or module in ENTRIES):
                out.append(f"{module} imports the command {t}")
    return out


def trainer_config_fields() -> set[str]:
    import dataclasses

    from mlxrl.registry import config_class, names

    return {f.name for name in names() for f in dataclasses.fields(config_class(name))}


def config_readers(source: str, fields: set[str]) -> list[str]:
    """Functions that take a trainer config: a parameter named `args` (the trainers' name for their config)
    or annotated with a *Config of the trainers, from which a trainer-config field is read (`args.x` or
    `getattr(args, "x")`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                  if a.arg == "args" or (a.annotation is not None
                                         and ast.unparse(a.annotation).split(".")[-1].strip("'\"")
                                         in CONFIG_NAMES)}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in params:
                name = sub.attr
            elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "getattr"
                  and len(sub.args) >= 2 and isinstance(sub.args[0], ast.Name) and sub.args[0].id in params
                  and isinstance(sub.args[1], ast.Constant)):
                name = sub.args[1].value
            else:
                continue
            if name in fields:
                out.append(f"{node.name} reads {name}")
                break
    return out


def private_overrides(engine_methods: set[str], source: str) -> list[str]:
    """Methods of a trainer class that override one of the engine's private (underscored) methods."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if (isinstance(f, ast.FunctionDef) and f.name.startswith("_") and not f.name.startswith("__")
                        and f.name in engine_methods):
                    out.append(f"{node.name}.{f.name}")
    return out


def test_the_rule_checkers_find_planted_violations():
    planted = {"mlxrl.models.lora": {"mlxrl.trainers.engine"}, "mlxrl.losses.sft": {"mlxrl.cli.common"},
               "mlxrl.trainers.engine": {"mlxrl.cli.common"}, "mlxrl.sft": {"mlxrl.trainers.sft.trainer"},
               "mlxrl.cli.sft": {"mlxrl.trainers.flags"}}
    assert layer_violations(planted) == [
        "mlxrl.losses.sft imports mlxrl.cli.common", "mlxrl.models.lora imports mlxrl.trainers.engine",
        "entry mlxrl.sft imports mlxrl.trainers.sft.trainer",
        "mlxrl.trainers.engine imports the command mlxrl.cli.common"]
    source = ("def f(model, args):\n    return getattr(args, 'use_peft', False)\n"
              "def g(x, args):\n    return args.learning_rate\n"
              "def h(lm, args: tuple):\n    return lm.dtype, args[0]\n")
    assert config_readers(source, {"use_peft", "learning_rate", "dtype"}) == ["f reads use_peft",
                                                                              "g reads learning_rate"]
    assert private_overrides({"_grad_fn", "loss"}, "class T(Trainer):\n    def _grad_fn(self): ...\n"
                                                 "    def loss(self): ...\n") == ["T._grad_fn"]


def private_imports(module: str, package: bool, source: str) -> list[str]:
    """Underscored names a module of `mlxrl.cli` imports from outside `mlxrl.cli`: a command uses the
    library's public names only."""
    here = module.split(".") if package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = (".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level else node.module or "")
            if base.split(".")[0] == "mlxrl" and not _in(base, ("mlxrl.cli",)):
                out += [f"{module} imports {base}.{a.name}" for a in node.names if a.name.startswith("_")]
    return out


def test_the_commands_use_public_names_only():
    assert private_imports("mlxrl.cli.sft", False, "from ..trainers.flags import _parse, build_parser\n"
                                                   "from .common import _one_line\n") == \
        ["mlxrl.cli.sft imports mlxrl.trainers.flags._parse"]
    found = [hit for name, (path, package) in _modules().items() if _in(name, ("mlxrl.cli",))
             for hit in private_imports(name, package, path.read_text())]
    assert not found, found


def test_the_layers_below_the_trainers_import_no_trainer_and_no_command():
    found = layer_violations(import_graph())
    assert not found, found


def test_the_layers_below_the_trainers_take_no_trainer_config():
    """Models, data, losses and optimizers take explicit arguments (bits and group size, a tile size, a
    resolved dtype, a keep-the-dtype flag); the trainers read their config and pass them on."""
    fields = trainer_config_fields()
    found = {name: hits for name, (path, _) in _modules().items() if _in(name, LOWER)
             if (hits := config_readers(path.read_text(), fields))}
    assert not found, found


def test_no_trainer_overrides_a_private_method_of_the_engine():
    """The hooks a trainer implements are public (`trainers.hooks.TrainerHooks`); the engine's private
    methods are its own."""
    engine = engine_methods()
    found = [hit for path in (ROOT / "trainers").rglob("trainer.py")
             for hit in private_overrides(engine, path.read_text())]
    assert not found, found


def mixins(source: str, allowed=("TRLSurface",)) -> list[str]:
    """Base classes of the engine's `Trainer` beyond its public TRL surface: what the engine holds (state,
    checkpoints, signals, ranks, the log) is an object it composes, not a class it inherits."""
    return [ast.unparse(b) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)
            and node.name == "Trainer" for b in node.bases if ast.unparse(b) not in allowed]


def test_the_engine_composes_its_parts():
    assert mixins("class Trainer(TRLSurface, Saving, reporting.Logging):\n    pass\n") == [
        "Saving", "reporting.Logging"]
    found = mixins((ROOT / "trainers" / "engine.py").read_text())
    assert not found, found


def test_a_trainer_overrides_only_the_hooks():
    """What a trainer defines that the engine also has is one of `TrainerHooks` (or its constructor)."""
    from mlxrl.trainers.hooks import TrainerHooks

    hooks = {n for n in dir(TrainerHooks) if not n.startswith("_")} | {"__init__"}
    engine = engine_methods()
    found = {name: sorted(extra) for name, methods in class_methods((ROOT / "trainers").rglob("trainer.py"))
             if (extra := methods & engine - hooks)}
    assert not found, found


def test_importing_mlxrl_imports_no_trainer_and_sets_nothing():
    """`import mlxrl` loads the BLAS (mlxrl.cpu) and the trainers' table (mlxrl.registry: names, no code) and
    nothing else: the trainers are imported on first use."""
    import subprocess
    import sys

    code = ("import sys, mlxrl; print(sorted(m for m in sys.modules if m.startswith('mlxrl.'))); "
            "from mlxrl import SFTTrainer; print(SFTTrainer.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    first, second = out.stdout.splitlines()[:2]
    cpu = ["mlxrl.cpu", "mlxrl.cpu.blas", "mlxrl.cpu.fastmath", "mlxrl.cpu.native", "mlxrl.registry"]
    assert first == str(cpu), out.stderr
    assert second == "mlxrl.trainers.sft.trainer"


def drawn_rooms(page: str) -> set[str]:
    """The root entries the Architecture page's drawing lists: the first text block after its "## Rooms",
    one room per line indented by two spaces (several names on a line are separated by single spaces)."""
    block = page.split("## Rooms", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    names = set()
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            names.update(n.rstrip("/") for n in re.split(r"\s{2,}", line.strip())[0].split())
    return names


def test_the_architecture_page_draws_the_tree():
    """docs/architecture.md's drawing lists exactly the files and folders at the package's root."""
    planted = "## Rooms\n```text\nmlxrl/\n  a.py b.py\n                 what they are\n  cli/     commands\n```\n"
    assert drawn_rooms(planted) == {"a.py", "b.py", "cli"}
    drawn = drawn_rooms((ROOT.parent / "docs" / "architecture.md").read_text())
    tree = {p.name for p in ROOT.iterdir() if p.name != "__pycache__" and not p.name.startswith(".")}
    assert drawn == tree, {"drawn, not in the tree": sorted(drawn - tree),
                           "in the tree, not drawn": sorted(tree - drawn)}
