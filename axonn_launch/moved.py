"""Old module paths, kept importable after the package was laid out in folders.

submitit pickles a job's callable (``TrainJob``) and its ``JobSpec`` by module path. A job
submitted before the re-layout and requeued after it unpickles ``axonn_launch.job.TrainJob``,
``axonn_launch.spec.JobSpec``, ``axonn_launch.grid.Grid``... This finder answers each old
name with the module that now holds the code, so the same class object comes back. Users'
own scripts that import an old path keep working the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

OLD_TO_NEW = {
    "axonn_launch.grid": "axonn_launch.common.grid",
    "axonn_launch.models": "axonn_launch.common.models",
    "axonn_launch.spec": "axonn_launch.common.spec",
    "axonn_launch.machine": "axonn_launch.common.machine",
    "axonn_launch.hf": "axonn_launch.common.hf",
    "axonn_launch.slurmtext": "axonn_launch.common.slurmtext",
    "axonn_launch.traffic": "axonn_launch.common.traffic",
    "axonn_launch.rules": "axonn_launch.common.rules",
    "axonn_launch.tokenfile": "axonn_launch.common.tokenfile",
    "axonn_launch.memory": "axonn_launch.cost.memory",
    "axonn_launch.perf": "axonn_launch.cost.perf",
    "axonn_launch.jobcost": "axonn_launch.cost.jobcost",
    "axonn_launch.validate": "axonn_launch.config.validate",
    "axonn_launch.edf": "axonn_launch.config.edf",
    "axonn_launch.failures": "axonn_launch.records.failures",
    "axonn_launch.rankfail": "axonn_launch.records.firstfail",
    "axonn_launch.launch": "axonn_launch.submit.pipeline",
    "axonn_launch.sweep": "axonn_launch.submit.sweep",
    "axonn_launch.render": "axonn_launch.submit.render",
    "axonn_launch.slurm": "axonn_launch.submit.slurm",
    "axonn_launch.local": "axonn_launch.submit.local",
    "axonn_launch.job": "axonn_launch.submit.task",
    "axonn_launch.rehearse": "axonn_launch.submit.rehearse",
    "axonn_launch.summary": "axonn_launch.submit.summary",
}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module that replaced it (one module object, two names)."""

    def find_spec(self, fullname, path, target=None):  # noqa: ARG002 - the finder protocol
        if fullname not in OLD_TO_NEW:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(OLD_TO_NEW[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


def install() -> None:
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
