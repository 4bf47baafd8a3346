"""The scheduler is an object, read from the source (an AST pass, like tests/test_house.py):

- no scheduler name (a registered scheduler's, ``"slurm"``, ``"local"``) is compared with
  anything that names a scheduler outside ``scheduler/`` and the machine profile's schema
  (``common/machine.py``): the code asks the object (``scheduler.of(machine).queued``);
- no Slurm command (``sinfo``, ``squeue``, ``sacct``, ``scontrol``, ``scancel``, ``sbatch``,
  ``srun``) is run outside ``scheduler/``: no literal naming one is a command's first word (a
  list's first element), an argument of a call that runs or looks up a program, or a
  constant of its own. The renderer's script text (``submit/render.py``) is allowed, and so
  are messages and help texts that name a command in a sentence.

Each check is first shown to find what it looks for in a planted sample, so that it can fail.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from axonn_launch import scheduler

PACKAGE = Path(__file__).resolve().parents[1] / "axonn_launch"
COMMANDS = frozenset({"sinfo", "squeue", "sacct", "scontrol", "scancel", "sbatch", "srun"})
# calls that run a program, or look one up, by name (subprocess, os, shutil, common/command)
RUNNERS = frozenset({"run", "Popen", "call", "check_call", "check_output", "getoutput",
                     "system", "execvp", "execlp", "spawnlp", "which", "command_output",
                     "command_result"})  # fmt: skip
OWNER = PACKAGE / "scheduler"
SCHEMA = PACKAGE / "common" / "machine.py"  # the profile schema: which keys a Slurm machine needs
RENDERER = PACKAGE / "submit" / "render.py"  # the batch script's text


def scheduler_names() -> set[str]:
    return set(scheduler.names())


def constants(node: ast.AST) -> list[str]:
    """The strings ``node`` is or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for e in node.elts for s in constants(e)]
    return []


@functools.cache
def parsed(source: str) -> ast.AST:
    """The module's tree, parsed once for both checks."""
    return ast.parse(source)


def name_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each comparison of a scheduler name with something whose text names a
    scheduler (``cfg.machine.scheduler``, ``record.get("scheduler")``)."""
    found = []
    for node in ast.walk(parsed(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = any(set(constants(o)) & names for o in operands)
        about = any("scheduler" in ast.unparse(o) for o in operands if not constants(o))
        if named and about:
            found.append((node.lineno, ast.unparse(node)))
    return found


def command_runs(source: str) -> list[tuple[int, str]]:
    """(line, command) of each literal that runs a Slurm command: a list's or tuple's first
    element, an argument of a call in ``RUNNERS`` (its first word), or a name bound to the
    command alone (or to a tuple of them)."""
    found = set()
    for node in ast.walk(parsed(source)):
        if isinstance(node, ast.List | ast.Tuple) and node.elts:
            texts = constants(node.elts[0])
        elif isinstance(node, ast.Call) and call_name(node) in RUNNERS:
            args = [*node.args, *(k.value for k in node.keywords)]
            texts = [s.split(" ", 1)[0] for a in args if isinstance(a, ast.Constant)
                     for s in constants(a)]  # fmt: skip
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            texts = constants(node.value)
        else:
            continue
        found |= {(node.lineno, text) for text in texts if text in COMMANDS}
    return sorted(found)


def call_name(node: ast.Call) -> str:
    return getattr(node.func, "attr", getattr(node.func, "id", ""))


def outside(*allowed: Path) -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if p != SCHEMA and OWNER not in p.parents and p not in allowed]  # fmt: skip


def test_the_checks_find_what_they_look_for():
    names = scheduler_names()
    assert {"slurm", "local"} <= names
    planted = 'if cfg.machine.scheduler != "slurm":\n    pass\nok = kind == "slurm"\n'
    assert name_comparisons(planted, names) == [(1, "cfg.machine.scheduler != 'slurm'")]
    planted = 'x = record.get("scheduler", "slurm") in ("local", "held")\n'
    assert [line for line, _ in name_comparisons(planted, names)] == [1]
    planted = (
        'subprocess.run(["sbatch", "--parsable", script])\n'
        'shutil.which("srun")\n'
        'subprocess.run("scancel 12", shell=True)\n'
        'SINFO = "sinfo"\n'
        'print(f"sbatch refused it: {why}")\n'
        'line.startswith("srun ")\n'
    )
    assert command_runs(planted) == [(1, "sbatch"), (2, "srun"), (3, "scancel"), (4, "sinfo")]


def test_no_scheduler_name_is_compared_outside_the_scheduler_package():
    names = scheduler_names()
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path in outside()
        for line, text in name_comparisons(path.read_text(), names)
    ]
    assert not found, "scheduler names compared outside scheduler/:\n" + "\n".join(found)


def test_no_slurm_command_runs_outside_the_scheduler_package():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {word}"
        for path in outside(RENDERER)
        for line, word in command_runs(path.read_text())
    ]
    assert not found, "Slurm commands run outside scheduler/:\n" + "\n".join(found)


def test_the_package_owns_every_command_it_runs():
    """The checks above see the package's own commands: it is where they went."""
    runs = {word for path in OWNER.rglob("*.py") for _, word in command_runs(path.read_text())}
    assert runs == COMMANDS
