"""The house's contract, read from the source: every ``import`` (at module level and inside
functions) by an AST pass, so a deferred import cannot hide a cycle or a torch import.

- no import cycle among the package's modules, except the one lazy bridge from the
  submitit callable (``submit/task.py``) into ``train/``;
- each folder imports only the folders below it (common < cost < config < records < submit),
  and ``train/`` imports nothing of the package outside ``common/``;
- the login path (cli, submit/, config/, cost/, records/, common/ and the plan, jobs and data
  commands) imports no torch, here or through the package modules it imports;
- no job-directory file name is written as a string literal outside ``common/jobdir.py``.

Each failure names the offending import with its file and line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "axonn_launch"
ROOT = PACKAGE.parent
FOLDERS = ("common", "cost", "config", "records", "submit")  # bottom to top
BRIDGE = ("axonn_launch.submit.task", "axonn_launch.train")
LOGIN_COMMANDS = ("axonn_launch.cli", "axonn_launch.plan", "axonn_launch.jobs", "axonn_launch.data")
HEAVY = ("torch", "transformers", "safetensors", "tokenizers", "matplotlib")  # not at import
NEVER = ("torch",)  # not even inside a function: the data command may load a tokenizer
JOB_DIR_NAMES = (
    "job.json", "spec.json", "metrics.jsonl", "summary.json", "preflight.json",
    "preflight_expected.json", "memorization.json", "submission.sh", "site_submission.sh",
    "checkpoints", "latest", "failures", "nccl_rank{rank}.log",
)  # fmt: skip


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.source} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_names(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        if MODULES[module].name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    names = [f"{prefix}.{alias.name}" for alias in node.names]
    return [name if name in MODULES else prefix for name in names]


def owning_module(name: str) -> str | None:
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def all_imports() -> list[tuple[str, str, Path, int]]:
    """(module, imported dotted name, file, line) for every import statement anywhere."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in imported_names(node, module):
                    found.append((module, name, path, node.lineno))
    return found


IMPORTS = all_imports()


def package_edges() -> list[Edge]:
    edges = {}
    for module, name, path, line in IMPORTS:
        target = owning_module(name)
        if target and target != module and (module, target) not in edges:
            edges[module, target] = Edge(module, target, path, line)
    return list(edges.values())


EDGES = package_edges()


def crosses_bridge(edge: Edge) -> bool:
    return edge.source == BRIDGE[0] and in_folder(edge.target, BRIDGE[1])


def in_folder(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_cycle(edges: list[Edge]) -> list[Edge] | None:
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[Edge] = []

    def visit(module: str) -> list[Edge] | None:
        state[module] = 1
        for edge in graph.get(module, []):
            if state.get(edge.target) == 1:
                start = (
                    next(i for i, e in enumerate(path) if e.source == edge.target) if path else 0
                )
                return path[start:] + [edge]
            if edge.target not in state:
                path.append(edge)
                cycle = visit(edge.target)
                if cycle:
                    return cycle
                path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in FOLDERS:
        return FOLDERS.index(parts[1])
    return None


def test_the_graph_sees_function_level_imports():
    """The pass reads imports inside functions (the bridge is one), or it proves nothing."""
    bridge = [e for e in EDGES if crosses_bridge(e)]
    assert bridge, "the submitit callable's lazy import of train/ was not found"
    assert len(MODULES) > 60


def test_no_import_cycle():
    cycle = find_cycle([e for e in EDGES if not crosses_bridge(e)])
    assert cycle is None, "import cycle:\n" + "\n".join(f"  {e}" for e in cycle)


def test_each_folder_imports_only_the_folders_below():
    upward = [
        e
        for e in EDGES
        if layer(e.source) is not None
        and (layer(e.target) is None or layer(e.target) > layer(e.source))
        and not crosses_bridge(e)
        and e.target not in ("axonn_launch",)
    ]
    assert not upward, "imports from above:\n" + "\n".join(f"  {e}" for e in upward)


def test_train_imports_only_common():
    outside = [
        e
        for e in EDGES
        if in_folder(e.source, "axonn_launch.train")
        and not in_folder(e.target, "axonn_launch.train")
        and not in_folder(e.target, "axonn_launch.common")
        and e.target != "axonn_launch"
    ]
    assert not outside, "train/ reaches outside common/:\n" + "\n".join(f"  {e}" for e in outside)


def login_modules() -> list[str]:
    roots = [m for m in MODULES if layer(m) is not None or m in LOGIN_COMMANDS]
    return sorted(roots)


def test_login_path_imports_no_torch_even_lazily():
    """Every import the login path can reach, through the package's own modules, even the
    deferred ones: none is torch, and none is the job side."""
    reach = set(login_modules())
    frontier = list(reach)
    while frontier:
        module = frontier.pop()
        for edge in EDGES:
            if edge.source == module and not crosses_bridge(edge) and edge.target not in reach:
                reach.add(edge.target)
                frontier.append(edge.target)
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {module} imports {name}"
        for module, name, path, line in IMPORTS
        if module in reach and name.split(".")[0] in NEVER
    ]
    assert not any(in_folder(m, "axonn_launch.train") for m in reach)
    assert not offending, "the login path imports:\n" + "\n".join(f"  {o}" for o in offending)


def test_login_modules_import_no_torch_when_run():
    """The same, as Python sees it: third-party imports count too (submitit, hydra, yaml)."""
    code = (
        "import importlib, sys\n"
        f"for name in {login_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(len(sys.modules)); assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings
    ]  # fmt: skip


@pytest.mark.parametrize("name", JOB_DIR_NAMES)
def test_job_directory_names_live_in_one_module(name):
    owner = PACKAGE / "common" / "jobdir.py"
    assert any(value == name for _, value in string_literals(owner)), f"jobdir lacks {name!r}"
    elsewhere = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in MODULES.values()
        if path != owner
        for line, value in string_literals(path)
        if value == name
    ]
    assert not elsewhere, f"{name!r} written outside common/jobdir.py: " + ", ".join(elsewhere)


def test_registries_cover_every_name():
    """Each name the config accepts has its implementation registered, and no more."""
    from axonn_launch.common.machine import SCHEDULERS
    from axonn_launch.common.models import ARCHITECTURES
    from axonn_launch.submit.pipeline import STARTERS
    from axonn_launch.train.arch import MODELS as BUILDERS

    assert set(STARTERS) == set(SCHEDULERS)
    assert set(BUILDERS) == set(ARCHITECTURES)


def test_the_job_package_does_not_shadow_its_modules():
    """``axonn_launch.train.bootstrap`` is the module, not a function of the same name."""
    import types

    import axonn_launch.train as train

    assert isinstance(train.bootstrap, types.ModuleType)
    assert callable(train.bootstrap.discover_env)
