"""Which code a job ran: its provenance in job.json, and the snapshot its attempts import.

At submission the launcher records (``record``) the git revision of the checkout that
holds the package (a package at the root of a git work tree, as an editable install of this
repository is; none for a package installed into site-packages), whether that tree was
dirty (the diff itself in ``code.diff``), the versions of Python, torch, its collective
library and the project, and the installed distributions in ``pip_freeze.txt`` (as ``pip
freeze`` lists them, read with ``importlib.metadata``: no second interpreter, and no pip
needed). torch's versions are read from its metadata and its ``version.py``, never by
importing it (the login wing never imports torch); the NCCL or RCCL version the ranks
loaded is in the job log's start-up line (``train/health/startup.py``).

``code_snapshot`` (on by default on Slurm machines) copies the package, as it is at
submission and without ``__pycache__``, into the job dir's ``code/``. The batch script
(``submit/render.py``) and the recovery job's script (``submit/chain.py``) put ``code/``
first on ``PYTHONPATH``, so every attempt imports it: a requeue and a restart in place run
the same script, and a recovery attempt is launched from the snapshot and snapshots it.
A manual ``jobs resubmit`` or ``resume=true`` runs the installed code, and snapshots that.

``jobs status`` warns in one line when the installed package differs from the one the
run was submitted with (``code_warnings``: a hash of the snapshot against one of the
installed package).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

from axonn_launch import scheduler
from axonn_launch.common.jobdir import CODE, JobPaths, is_job_dir, read_record_or_empty
from axonn_launch.config.compose import LaunchConfig

PACKAGE = Path(__file__).resolve().parents[1]  # the package this process imported
PROJECT = PACKAGE.name
SKIPPED = ("__pycache__", "*.pyc")  # what neither the snapshot nor its hash holds
GIT_TIMEOUT_S = 20
UNTRACKED_SHOWN = 50  # untracked files named in job.json; the snapshot holds them all
NCCL_WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu11", "nvidia-nccl-cu13")


def snapshot_on(cfg: LaunchConfig) -> bool:
    """``code_snapshot`` as given; unset (null): on for Slurm machines. Off on this
    computer (``config/compose.py`` refuses true there): a local job's supervisor imports
    the installed package before the job is composed."""
    if cfg.code_snapshot is not None:
        return cfg.code_snapshot
    return scheduler.of(cfg.machine).queued


def import_first(folder: str | Path) -> str:
    """The shell line that has every Python started after it import the package from
    ``folder`` (a snapshot's ``code/``) before the installed one: first on ``PYTHONPATH``,
    and, with ``PYTHONSAFEPATH`` (Python 3.11 and up), before the working directory that
    ``python -m`` would otherwise put first (a job started from the checkout)."""
    first = shlex.quote(str(folder))
    return f'export PYTHONPATH={first}"${{PYTHONPATH:+:$PYTHONPATH}}" PYTHONSAFEPATH=1'


def record(job_dir: Path, *, snapshot: bool, dry_run: bool = False) -> dict:
    """job.json's ``provenance`` of a launch into ``job_dir``: the revision, versions and
    hash of the package; for a job that runs (not ``dry_run``) also ``pip_freeze.txt``,
    ``code.diff`` when the tree is dirty and, with ``snapshot``, the copy in ``code/``."""
    found = {"package": str(PACKAGE), **git_state(job_dir, write=not dry_run)}
    found["versions"] = versions()
    if dry_run:
        return found
    paths = JobPaths(job_dir)
    write_freeze(paths.pip_freeze)
    found["freeze"] = paths.pip_freeze.name
    if snapshot:
        copy_package(paths.code)
    found["snapshot"] = paths.code.name if snapshot else None
    found["hash"] = package_hash(paths.code / PROJECT if snapshot else PACKAGE)
    return found


# --- the copy and its hash -----------------------------------------------------------------


def copy_package(code: Path) -> Path:
    """A copy of the package this process imported, in ``code``/<package>; returns it."""
    target = code / PROJECT
    shutil.rmtree(code, ignore_errors=True)  # a dir launched into again: this launch's
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns(*SKIPPED), symlinks=True)
    return target


def package_hash(folder: Path) -> str:
    """``sha256:<hex>`` of a package tree: every file's path and bytes, in order of path,
    leaving out ``SKIPPED``."""
    digest = hashlib.sha256()
    for path in sorted(package_files(folder)):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with contextlib.suppress(OSError):
            digest.update(path.read_bytes())
        digest.update(b"\0")
    return f"sha256:{digest.hexdigest()}"


def package_files(folder: Path) -> list[Path]:
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files += [Path(root, n) for n in names if not n.endswith(".pyc")]
    return files


@functools.lru_cache(maxsize=1)
def installed_hash() -> str:
    """The hash of the package this process imported (once per process)."""
    return package_hash(PACKAGE)


def code_warnings(job_dir: Path, record: dict) -> list[str]:
    """One line when the installed package differs from the one the job was submitted
    with (its snapshot, or the package as it was then); none when they match or the
    record holds no hash (a dry run, a job from before provenance)."""
    found = record.get("provenance")
    wanted = found.get("hash") if isinstance(found, dict) else None
    if not isinstance(wanted, str) or wanted == installed_hash():
        return []
    if found.get("snapshot"):
        imported = f"its attempts import the snapshot in {JobPaths(job_dir).code}"
    else:
        imported = "its later attempts (requeues, recovery) import the installed code"
    return [f"warning: code: the installed {PACKAGE} differs from the code submitted; {imported}"]


# --- the checkout ----------------------------------------------------------------------------


def git_state(job_dir: Path, *, write: bool) -> dict:
    """``revision``, ``dirty`` and ``untracked`` of the checkout holding the package, with
    the diff in ``code.diff`` when it is dirty (and ``write``). A package run from another
    job's snapshot (a recovery attempt) has that job's. {} outside a git work tree."""
    snapshot_of = PACKAGE.parent.parent
    if PACKAGE.parent.name == CODE and is_job_dir(os.listdir(snapshot_of)):
        return inherited(snapshot_of, job_dir, write=write)
    root = PACKAGE.parent
    if not (root / ".git").exists():
        return {}
    revision = git(root, "rev-parse", "HEAD").strip()
    if not revision:
        return {"revision": None}
    changed = git(root, "status", "--porcelain").splitlines()
    untracked = [line[3:] for line in changed if line.startswith("??")]
    found = {"revision": revision, "dirty": bool(changed), "untracked": untracked[:UNTRACKED_SHOWN]}
    if changed and write:
        JobPaths(job_dir).code_diff.write_text(git(root, "diff", "HEAD"))
        found["diff"] = JobPaths(job_dir).code_diff.name
    return found


def inherited(snapshot_of: Path, job_dir: Path, *, write: bool) -> dict:
    """The git state that the job in ``snapshot_of`` recorded, for a job launched from its
    snapshot; its diff is copied along."""
    before = read_record_or_empty(snapshot_of).get("provenance") or {}
    keys = ("revision", "dirty", "untracked", "diff")
    found = {k: before[k] for k in keys if k in before} | {"inherited_from": str(snapshot_of)}
    diff = JobPaths(snapshot_of).code_diff
    if write and found.get("diff") and diff.is_file():
        shutil.copyfile(diff, JobPaths(job_dir).code_diff)
    return found


# While ``read_once`` is in use: what ``git`` and ``versions`` read, by their arguments
_READ: dict[tuple, object] | None = None


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """While in use, the checkout's git state and the installed versions are read once: the
    points of a sweep are launched by one process, at one moment, from one checkout."""
    global _READ
    _READ = {}
    try:
        yield
    finally:
        _READ = None


def _read(key: tuple, read: Callable[[], object]) -> object:
    if _READ is None:
        return read()
    if key not in _READ:
        _READ[key] = read()
    return _READ[key]


def git(root: Path, *args: str) -> str:
    """``git -C root ARGS``'s output; '' when git is missing or fails (a checkout owned by
    someone else, a broken repository). Read once per ``read_once``."""
    return _read(("git", root, *args), lambda: _git(root, *args))


def _git(root: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


# --- versions --------------------------------------------------------------------------------


def versions() -> dict:
    """Python, the project, torch and its collective library, as installed here (read once
    per ``read_once``)."""
    return dict(_read(("versions",), _versions))


def _versions() -> dict:
    torch = version_of("torch")
    return {
        "python": platform.python_version(),
        PROJECT: version_of(PROJECT),
        "torch": torch,
        "collectives": collectives(torch_build()) if torch else None,
    }


def version_of(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def torch_build() -> dict:
    """``cuda`` and ``hip`` of the installed torch, read from its ``version.py`` (a file of
    plain assignments) without importing torch; {} when it cannot be read."""
    try:
        text = metadata.distribution("torch").locate_file("torch/version.py").read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError, metadata.PackageNotFoundError):
        return {}
    found = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        target = node.targets[0] if isinstance(node, ast.Assign) else target
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip"):
            with contextlib.suppress(ValueError):
                found[target.id] = ast.literal_eval(node.value)
    return found


def collectives(build: dict) -> str:
    """The collective library the installed torch uses, in words: NCCL's wheel's version
    when torch takes NCCL from one; else what the build says."""
    if build.get("hip"):
        return f"rccl (bundled with torch for ROCm {build['hip']}; its version: the job log)"
    if build.get("cuda"):
        wheel = next((w for w in NCCL_WHEELS if version_of(w)), None)
        if wheel:
            return f"nccl {version_of(wheel)} ({wheel})"
        return f"nccl (bundled with torch for CUDA {build['cuda']}; its version: the job log)"
    return "gloo (a CPU build of torch)" if build else "unknown (torch/version.py unreadable)"


# --- the installed distributions --------------------------------------------------------------


def write_freeze(path: Path) -> None:
    """The installed distributions, one ``name==version`` a line sorted by name (as ``pip
    freeze`` writes them); an editable install as pip writes it, with its folder (before
    the ``.egg-info`` a build leaves in that folder, which the path may show first)."""
    lines: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        line = freeze_line(dist, name) if name else ""
        if line and (name.lower() not in lines or line.startswith("# Editable")):
            lines[name.lower()] = line
    path.write_text("".join(lines[k] + "\n" for k in sorted(lines)))


def freeze_line(dist: metadata.Distribution, name: str) -> str:
    try:
        url = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        url = {}
    if url.get("dir_info", {}).get("editable"):
        where = url.get("url", "").removeprefix("file://")
        return f"# Editable install with no version control ({name}=={dist.version})\n-e {where}"
    return f"{name}=={dist.version}"
