"""How the modules import each other: one way, downward.

The graph is read from the source (every `import` statement, inside
functions and under TYPE_CHECKING too, since each is a dependency a
reader must follow), not from what happens to be loaded."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "gdnx").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """gdnx module -> the gdnx modules it imports (`from a.b import c` is
    a.b.c when c is a module, else a.b)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module, f"{path}: gdnx imports absolutely ({ast.unparse(node)})"
                base = node.module
                for a in node.names:
                    target = f"{base}.{a.name}"
                    deps.add(target if target in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (one path each), by depth-first search."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_graph_sees_an_import_cycle():
    """The check itself: a made-up cycle is found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


# The packages and top-level modules of gdnx by layer, lowest first: a module
# imports only from its own layer or the layers below (no cycle within one:
# test_no_import_cycles). A new package or module takes its place here.
LAYERS = (
    ("gdnx", "errors", "signals", "files", "measure", "scales", "progress", "distributed", "compile_cache"),
    ("ops", "aot", "gpu_kernels"),
    ("config", "stacking"),
    ("parallel", "loss", "quantization"),
    ("layers",),
    ("checkpoints",),
    ("models",),
    ("data",),
    ("serving",),
    ("generate", "rl"),
    ("training",),
    ("runs", "train_plan", "bench"),
    ("inference", "export"),
    ("evaluation",),
    ("cli", "__main__"),
)


def _part(module: str) -> str:
    """The package or top-level module of gdnx a module belongs to."""
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs whose import runs up the layers."""
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    return sorted((name, dep) for name, deps in graph.items() for dep in deps
                  if layer[_part(dep)] > layer[_part(name)])


def test_imports_run_downward():
    graph = import_graph()
    placed = {part for parts in LAYERS for part in parts}
    assert {_part(name) for name in graph} == placed, "a part of gdnx missing from LAYERS, or one that is gone"
    assert upward_imports(graph) == []


def test_the_layers_see_an_upward_import():
    """The check itself: the model importing the trainer is found."""
    assert upward_imports({"gdnx.models.causal_lm": {"gdnx.training.trainer", "gdnx.layers.mlp"}}) == [
        ("gdnx.models.causal_lm", "gdnx.training.trainer")]


def test_leaves_import_no_kernel_and_no_model():
    """The config, the op's options and the file helpers import neither the
    Pallas kernels nor the model (checked in a fresh interpreter)."""
    code = ("import sys, gdnx.config, gdnx.ops.delta_rule.options, gdnx.files; "
            "print(' '.join(m for m in sys.modules if m.startswith('gdnx.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    heavy = [m for m in loaded if m.split(".")[1] in ("models", "layers", "parallel", "training", "checkpoints")
             or m.startswith(("gdnx.ops.gated_delta_rule.", "gdnx.ops.kda."))
             or m.startswith("gdnx.ops.delta_rule.") and m.rpartition(".")[2] not in ("options",)]
    assert not heavy, heavy


def test_the_delta_rule_ops_share_only_their_family():
    """The gated delta rule and KDA packages import, of gdnx.ops, only their
    own modules and the family's shared package (gdnx.ops.delta_rule), never
    each other; the shared package imports neither."""
    graph = import_graph()
    ops = ("gdnx.ops.gated_delta_rule", "gdnx.ops.kda")
    seen = set()
    for name, deps in graph.items():
        own = next((p for p in ops if name == p or name.startswith(p + ".")), None)
        if own is not None:
            seen.add(own)
            bad = {d for d in deps if d.startswith("gdnx.ops") and not d.startswith((own, "gdnx.ops.delta_rule"))}
            assert not bad, (name, bad)
        if name.startswith("gdnx.ops.delta_rule"):
            assert not {d for d in deps if d.startswith(ops)}, (name, deps)
    assert seen == set(ops)


def test_checkpoints_know_the_model_by_interface():
    """Checkpoint code never imports the model class."""
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("gdnx.checkpoints"):
            assert not {d for d in deps if d.startswith("gdnx.models")}, (name, deps)


def test_no_command_module_imports_another():
    """gdnx.cli (the entry point) assembles the commands, one module each
    in gdnx.cli; those share the options of gdnx.cli.options and the
    library (gdnx.inference), never importing one another or gdnx.cli, and
    nothing in the library imports a CLI module (`python -m gdnx` runs gdnx.cli)."""
    graph = import_graph()
    cli = {name for name in graph if name == "gdnx.cli" or name.startswith("gdnx.cli.")}
    commands = cli - {"gdnx.cli", "gdnx.cli.options", "gdnx.cli.__main__"}
    assert commands >= {"gdnx.cli.generate", "gdnx.cli.serve", "gdnx.cli.eval", "gdnx.cli.train"}
    for name in commands:
        assert graph[name] & cli <= {"gdnx.cli.options"}, (name, graph[name] & cli)
    assert not graph["gdnx.cli.options"] & cli
    for name, deps in graph.items():
        if name not in cli and name != "gdnx.__main__":
            assert not deps & cli, (name, deps & cli)


def test_no_test_module_imports_another():
    """Tests share code through helper modules (tests/helpers, a
    directory's helpers), never by importing another test module."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(str(path.relative_to(tests)), n) for n in names
                      if n.startswith("tests.") and n.rpartition(".")[2].startswith("test_")]
    assert not found, found

