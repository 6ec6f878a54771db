"""The layering of the package, as a test: imports run down the layers, never back up, and no
modules import each other in a cycle. Lazy imports inside functions count (they only hide one), and
so do imports under `if TYPE_CHECKING:` (an annotation that needs a higher layer or a cycle to name a
type is a sign the type sits in the wrong place).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kiln

ROOT = Path(kiln.__file__).parent

# lowest first; a module belongs to the layer of the longest name here that it starts with
LAYERS: list[list[str]] = [
    ["kiln", "kiln.errors", "kiln.files", "kiln.events", "kiln.streams", "kiln.start_signals",
     "kiln.versions"],  # no imports of Kiln
    ["kiln.sizes", "kiln.config", "kiln.docs_ref"],  # the validated config (named sizes are plain data), its docs
    ["kiln.data", "kiln.model", "kiln.plan"],  # read, prepare and load data; the pure model; the planner
    ["kiln.docs_models"],  # the model tables of the docs, from the families and the native architectures
    ["kiln.parallel", "kiln.monitor", "kiln.state"],  # parallelism, sinks, checkpoints and the run directory
    # the loop and `kiln train` end to end; `kiln eval` of any model, benchmarks; sweeps of runs
    ["kiln.train", "kiln.evaluate", "kiln.eval", "kiln.sweep"],
    ["kiln.cli"],  # the command
]


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = module_names()


def layer_of(module: str) -> int:
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    if found is None or (found == 0 and module not in LAYERS[0]):
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return found


def imports_of(module: str) -> set[str]:
    """Kiln modules `module` imports anywhere in its file (top level, in functions, in classes)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            # `from kiln.data.read import readers` imports the module kiln.data.read.readers
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "kiln" or n.startswith("kiln."))
    return found - {module}


def test_the_config_loads_and_validates_without_the_model_or_torch():
    code = ("import sys, kiln.config; kiln.config.load_config(None, ['model.size=124m']); "
            "print(','.join(sorted(m for m in sys.modules if m.startswith(('kiln.model', 'torch')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_a_training_process_loads_torchs_compiler_only_to_compile():
    """torch._dynamo takes 2 s to import: every kiln process would pay it at start (the launcher, each rank,
    `kiln generate`), though only a compiled model needs it."""
    code = ("import sys, kiln.train.run, kiln.parallel.launch.local, kiln.parallel.launch.torchrun, "
            "kiln.state.weights; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_kiln_train_nproc_on_the_cpu_checks_its_job_without_importing_torch():
    """The launcher only starts torchrun: torch's 2 s import would be paid again by torchrun and each process."""
    code = ("import sys, kiln.config, kiln.parallel.launch.local as local; "
            "cfg = kiln.config.load_config(None, ['model.size=tiny', 'train.device=cpu']); "
            "local.under_torchrun(); local.check_world(cfg, 2); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_module_imports_a_higher_layer():
    upward = []
    for module in sorted(MODULES):
        mine = layer_of(module)
        for target in sorted(imports_of(module)):
            if target not in MODULES:
                upward.append(f"{module} imports {target}, which does not exist")
            elif layer_of(target) > mine:
                upward.append(f"{module} (layer {mine}) imports {target} (layer {layer_of(target)})")
    assert not upward, "imports that run back up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = {m: imports_of(m) & MODULES.keys() for m in MODULES}
    # a package's __init__ runs before its modules: an import of a package's own module from its
    # __init__ is the package re-exporting it, not a cycle
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack
                              else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "modules that import each other:\n" + "\n".join(cycles)


def test_the_layer_check_sees_lazy_imports(tmp_path, monkeypatch):
    """The checker itself: an import inside a function counts, and so does one under TYPE_CHECKING."""
    fake = tmp_path / "fake.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.cli import app\n"
                    "def f():\n    from kiln.train.run import run\n")
    monkeypatch.setitem(MODULES, "kiln.fake", fake)
    assert imports_of("kiln.fake") == {"kiln.cli.app", "kiln.train.run"}
