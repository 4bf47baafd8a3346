"""The job side: imported only inside a job, never by the login-node launcher.

Its face is ``run_job(spec)``, one rank's whole training job (``run.py``), or with
``train.emulate`` the ranks this task hosts (``emulate/``, which imports no torch). The
parts, each folder importing only the folders before it: ``parallel/`` (ranks, groups,
collectives, sharded layers), ``models/`` (the architectures), ``checkpoint/`` (save,
resume, export), ``health/`` (preflight, watchdog, faults, calibrate's measurements),
``inference/`` (generation, memorization), ``emulate/`` (emulated ranks); the training
itself beside this module (``loop``, ``data``, ``goldfish``, ``metrics``, ``logs``) and
``assets/`` (the built-in corpus).
"""

from __future__ import annotations

from typing import Any

from axonn_launch.common.spec import JobSpec


def run_job(spec: JobSpec, **options: Any) -> dict:
    """``run.run_job(spec, env=, should_stop=)``; with ``train.emulate``, the emulated
    ranks this task hosts (imported first, so that an emulated task never imports torch).
    A rank that started Python afresh imports the job side here, with the collector off
    and frozen after (``zygote.import_frozen``)."""
    if spec.train.emulate:
        from axonn_launch.train.emulate import run_emulated
        from axonn_launch.train.logs import setup_logging

        return run_emulated(
            spec, should_stop=options.get("should_stop"), start_logging=setup_logging
        )
    from axonn_launch.train.zygote import RANK_IMPORTS, import_frozen

    import_frozen(RANK_IMPORTS)
    from axonn_launch.train.run import run_job as run_rank

    return run_rank(spec, **options)


__all__ = ["run_job"]
