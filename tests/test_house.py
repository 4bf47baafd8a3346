"""The house's contract, read from the source: every ``import`` (at module level and inside
functions) by an AST pass, so a deferred import cannot hide a cycle or a torch import.

- no import cycle among the package's modules, except the one lazy bridge from the
  submitit callable (``submit/task.py``) into ``train/``;
- each folder imports only the folders below it (common < cost < config < records < submit),
  and ``train/`` imports nothing of the package outside ``common/``;
- the login path (cli, submit/, config/, cost/, records/, common/ and the plan, jobs and data
  commands) imports no torch, here or through the package modules it imports;
- no command module (``python -m axonn_launch.<name>``) imports another command module;
- no job-directory file name is written as a string literal outside ``common/jobdir.py``.

Each failure names the offending import with its file and line.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "axonn_launch"
ROOT = PACKAGE.parent
FOLDERS = ("common", "scheduler", "cost", "config", "records", "submit", "batch")  # bottom to top
BRIDGE = ("axonn_launch.submit.task", "axonn_launch.train")
LOGIN_COMMANDS = ("axonn_launch.cli", "axonn_launch.plan", "axonn_launch.jobs", "axonn_launch.data",
                  "axonn_launch.api")  # fmt: skip
HEAVY = ("torch", "transformers", "safetensors", "tokenizers", "matplotlib")  # not at import
NEVER = ("torch",)  # not even inside a function: the data command may load a tokenizer
# names common/jobdir.py must hold (the test collects every name it defines, and more)
JOB_DIR_NAMES = (
    "job.json", "spec.json", "metrics.jsonl", "summary.json", "preflight.json",
    "preflight_expected.json", "memorization.json", "submission.sh", "site_submission.sh",
    "checkpoints", "latest", "failures", "nccl_rank{rank}.log", "config.yaml", "slurm", "%j",
    "rank_{rank}.log", "axonn_launch.log",
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
    parts = module.split(".")  # a folder's own package (its registry's face) is in it too
    if len(parts) > 1 and parts[1] in FOLDERS:
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


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


JOB_DIR_OWNER = PACKAGE / "common" / "jobdir.py"
# What a job dir's file looks like, as the last part of a literal joined to a job dir: a
# name with a file suffix; and anywhere in a path, a rank's file or submitit's folder.
SUFFIXED = re.compile(r"(?:^|/)[\w.{}-]+\.(?:json|jsonl|yaml|yml|log|sh|pkl|pt|txt)$")
RANK_OR_SLURM = re.compile(r"(?:^|/)(?:rank_\{\}|slurm/)")
# Literals that look like a job dir's file and are not one: where each belongs.
NOT_JOB_DIR = {"rank_{}.pt": "a per-rank-shards checkpoint's own files (its legacy format)"}
# Calls whose string arguments are parts of a path.
PATH_CALLS = {"join", "Path", "joinpath", "glob", "rglob", "open", "with_name"}
# What a path built under a job dir starts from.
JOB_DIR_ROOT = re.compile(r"job_dir|JobPaths|\.folder\b")


def job_dir_names(owner: Path = JOB_DIR_OWNER) -> set[str]:
    """Every file or folder name ``owner`` defines: its module-level string constants that
    are one name (``"job.json"``, ``"rank_{rank}.log"``, ``"%j"``; not a sentence)."""
    return {
        node.value.value
        for node in ast.parse(owner.read_text()).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str) and re.fullmatch(r"[\w.%*{}-]+", node.value.value)
    }  # fmt: skip


def as_pattern(text: str) -> str:
    """A name or a literal with its placeholders (``{rank}``, an f-string's values, a glob's
    ``*``) all written ``{}``."""
    return re.sub(r"\{[^{}]*\}|\*", "{}", text)


def code_literals(path: Path) -> list[tuple[ast.AST, ast.AST | None, str]]:
    """(node, parent, text) of each string literal of code: an f-string whole (its values as
    ``{}``); not docstrings, and not prose (a literal with whitespace: a message or a help
    text may name a file, as a docstring or a comment may)."""
    tree = ast.parse(path.read_text())
    skipped = docstrings(tree)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    inside_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                       for part in ast.walk(node) if part is not node}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and id(node) not in inside_fstrings:
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in skipped or id(node) in inside_fstrings:
                continue
            text = node.value
        else:
            continue
        if not re.search(r"\s", text):
            found.append((node, parents.get(id(node)), as_pattern(text)))
    return found


def path_root(node: ast.AST, parent: ast.AST | None) -> str | None:
    """The source of what the literal is joined to when it is a part of a path (an operand
    of ``/``, an argument of a path call, an f-string's first value before a ``/``)."""
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return ast.unparse(parent.left)
    if (
        isinstance(parent, ast.Call)
        and getattr(parent.func, "attr", getattr(parent.func, "id", "")) in PATH_CALLS
    ):
        return ast.unparse(parent)
    if isinstance(node, ast.JoinedStr) and isinstance(node.values[0], ast.FormattedValue):
        return ast.unparse(node.values[0].value)
    return None


def job_dir_literals(package: Path = PACKAGE) -> list[str]:
    """``file:line: 'literal'`` for each literal of code outside ``common/jobdir.py`` that
    spells a job dir's file: one of the names jobdir defines, as the literal or a part of
    its path (a bare word such as ``slurm``, also a scheduler's name, only in a path); a
    suffixed file name joined to a job dir; a rank's file or ``slurm/`` in any path."""
    owner = package / "common" / "jobdir.py"
    names = {as_pattern(n) for n in job_dir_names(owner)}
    files = {n for n in names if re.search(r"[.{]", n)}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == owner:
            continue
        for node, parent, text in code_literals(path):
            root = path_root(node, parent)
            in_a_path = "/" in text or root is not None
            parts = set(text.split("/"))
            named = parts & files or in_a_path and parts & names
            suffixed = SUFFIXED.search(text) and JOB_DIR_ROOT.search(root or "")
            looks = suffixed or in_a_path and RANK_OR_SLURM.search(text)
            if named or looks and text not in NOT_JOB_DIR:
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {text!r}")
    return found


def test_job_directory_names_live_in_one_module():
    """Every file name of the job dir is a name of common/jobdir.py and nowhere else: found
    by pattern, not from a list (JOB_DIR_NAMES is only the floor of what jobdir holds)."""
    names = job_dir_names()
    assert set(JOB_DIR_NAMES) <= names, f"jobdir lacks {set(JOB_DIR_NAMES) - names}"
    found = job_dir_literals()
    assert not found, "job-dir names written outside common/jobdir.py:\n" + "\n".join(found)


def runs_as_command(path: Path) -> bool:
    """A module with a ``main`` or a ``__main__`` block: ``python -m axonn_launch.<name>``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            return True
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def command_modules() -> set[str]:
    """The package's top-level commands (its own ``__main__`` is the launcher's entry)."""
    return {
        module
        for module, path in MODULES.items()
        if module.count(".") == 1 and path.name != "__main__.py" and runs_as_command(path)
    }


def test_no_command_imports_another_command():
    """A command parses, calls a library and prints: what two commands share lives in a
    folder (or ``usage.py``), never in one of them. In-function imports count too."""
    commands = command_modules()
    named = {"cli", "data", "study", "generate", "memorization", "recover", "plan", "jobs"}
    assert {f"axonn_launch.{name}" for name in named} <= commands, sorted(commands)
    crossing = [e for e in EDGES if e.source in commands and e.target in commands]
    assert not crossing, "commands importing commands:\n" + "\n".join(f"  {e}" for e in crossing)


def test_registries_cover_every_name():
    """Each name the config accepts has its implementation registered, and no more."""
    from axonn_launch import scheduler
    from axonn_launch.common.machine import SCHEDULERS
    from axonn_launch.common.models import ARCHITECTURES
    from axonn_launch.submit.pipeline import STARTERS
    from axonn_launch.train.models.registry import MODELS as BUILDERS

    assert set(scheduler.names()) == set(SCHEDULERS)  # what a profile may name
    assert all(scheduler.named(n).queued in STARTERS for n in scheduler.names())
    assert set(BUILDERS) == set(ARCHITECTURES)


def test_the_job_package_does_not_shadow_its_modules():
    """``axonn_launch.train.parallel.bootstrap`` is the module, not a function of the same name."""
    import types

    import axonn_launch.train.parallel as train  # bootstrap's folder
    import axonn_launch.train.parallel.bootstrap  # noqa: F401 (axonn_launch.train is lazy)

    assert isinstance(train.bootstrap, types.ModuleType)
    assert callable(train.bootstrap.discover_env)


# train/'s folders, bottom to top; its top-level modules (the training loop, data, metrics,
# logs and the driver that runs them) sit above every folder
TRAIN_FOLDERS = ("parallel", "models", "checkpoint", "health", "inference", "emulate", "rehearse")
TRAIN_TOP_MODULES = 10  # at most, __init__ and __main__ included


def train_layer(module: str) -> int | None:
    """A train/ module's place in ``TRAIN_FOLDERS`` (a top-level module: above them all)."""
    parts = module.split(".")
    if parts[:2] != ["axonn_launch", "train"]:
        return None
    if len(parts) > 2 and parts[2] in TRAIN_FOLDERS:
        return TRAIN_FOLDERS.index(parts[2])
    return len(TRAIN_FOLDERS)


def test_train_folders_import_only_the_folders_before_them():
    """train/ keeps at most ``TRAIN_TOP_MODULES`` modules at its top; every folder of it is
    placed in ``TRAIN_FOLDERS``, and a module imports only from its own folder, the folders
    before it, or (a top-level module) anywhere: a folder never reaches up into a later
    folder or into the training at the top."""
    train = PACKAGE / "train"
    top = sorted(p.name for p in train.glob("*.py"))
    assert len(top) <= TRAIN_TOP_MODULES, f"{len(top)} modules at train/'s top: {top}"
    folders = {p.parent.name for p in train.glob("*/__init__.py")}
    assert folders == set(TRAIN_FOLDERS), f"train/ folders {sorted(folders)} != TRAIN_FOLDERS"
    upward = [
        e
        for e in EDGES
        if train_layer(e.source) is not None
        and train_layer(e.target) is not None
        and train_layer(e.source) < train_layer(e.target)
    ]
    assert not upward, "train/ imports from above:\n" + "\n".join(f"  {e}" for e in upward)


# "Where to add" in docs/architecture.md: each thing's files, checked on one that exists
WHERE_TO_ADD = {
    "A machine": ["conf/machine/slurm_local.yaml"],
    "A model architecture": ["axonn_launch/common/arch/llama.py",
                             "axonn_launch/common/arch/__init__.py",
                             "axonn_launch/train/models/llama.py",
                             "axonn_launch/train/models/registry.py", "conf/model/llama_*.yaml"],
    "A failure class": ["axonn_launch/records/failures.py", "conf/recovery/auto.yaml"],
    "A command": ["axonn_launch/plan.py", "axonn_launch/usage.py"],
    "A scheduler": ["axonn_launch/scheduler/local.py", "axonn_launch/scheduler/__init__.py"],
    "A metric sink": ["axonn_launch/train/sinks.py", "axonn_launch/common/tracking.py"],
}  # fmt: skip
WORDS = {1: "1 package file", 2: "2 files", 3: "3 files", 5: "5 files"}


def test_where_to_add_counts_the_files_each_needs():
    """The doc's count for each thing is the number of files an existing one of it holds."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Where to add", 1)[1].split("\n## ", 1)[0]
    for thing, files in WHERE_TO_ADD.items():
        line = re.search(rf"\*\*{thing}\*\*: ([^,:(]+)", section)
        assert line, f"docs/architecture.md's Where to add lacks {thing!r}"
        assert line.group(1).strip() == WORDS[len(files)], (thing, line.group(1))
        missing = [f for f in files if not list(ROOT.glob(f))]
        assert not missing, f"{thing}: {missing}"


def test_each_metric_sink_name_has_its_opener():
    """A ``metrics.sinks`` name the login side accepts opens on the job side."""
    from axonn_launch.common.tracking import SINKS
    from axonn_launch.train.sinks import opener_of

    assert {"jsonl", "tensorboard", "wandb"} <= set(SINKS)
    assert all(callable(opener_of(s.opener)) for s in SINKS.values() if s.opener)


def test_the_job_reads_failure_class_names_from_the_one_table():
    """``"hang"``/``"non_finite"`` are written once, in common/failure_classes.py."""
    from axonn_launch.common import failure_classes
    from axonn_launch.records import failures

    assert set(failures.RECOVERY) == {
        v for k, v in vars(failure_classes).items() if k.isupper() and isinstance(v, str)
    }
    written = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("failure_classes.py", "faults.py")  # faults: injected fault kinds
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in failure_classes.DIAGNOSED
    ]
    assert not written, written


RECORDS = "axonn_launch.records"


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def records_bindings(tree: ast.AST) -> set[str]:
    """The local names a module binds to records/ modules (``from axonn_launch.records import
    status``, ``import axonn_launch.records.status as s``)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == RECORDS:
            bound |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            named = [a for a in node.names if in_folder(a.name, RECORDS) and a.asname]
            bound |= {alias.asname for alias in named}
    return bound


def private_records_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of each private (underscore) name of records/ that ``source`` imports,
    or reads off a records/ module it imported (``status._walk``)."""
    tree = ast.parse(source)
    found = []
    bound = records_bindings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and in_folder(node.module or "", RECORDS):
            found += [(node.lineno, a.name) for a in node.names if is_private(a.name)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if in_folder(a.name, RECORDS)]
            found += [(node.lineno, n) for n in names if any(map(is_private, n.split(".")))]
        elif isinstance(node, ast.Attribute) and read_off(node, bound):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def read_off(node: ast.Attribute, bound: set[str]) -> bool:
    """``node`` is ``<records module>._name``."""
    return is_private(node.attr) and isinstance(node.value, ast.Name) and node.value.id in bound


def test_no_module_outside_records_uses_its_private_helpers():
    """What a module outside ``records/`` needs of it is public: a private helper is free to
    change with its module. The check sees imports and module attributes, in functions too."""
    sample = "from axonn_launch.records import status\ndef f():\n    return status._walk\n"
    assert private_records_uses(sample) == [(3, "status._walk")]
    sample = "from axonn_launch.records.jobdirs import _finite, run_results\n"
    assert private_records_uses(sample) == [(1, "_finite")]
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for module, path in MODULES.items()
        if not in_folder(module, RECORDS)
        for line, name in private_records_uses(path.read_text())
    ]
    assert not found, "private helpers of records/ used outside it:\n" + "\n".join(found)
