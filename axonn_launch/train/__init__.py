"""The job side: imported only inside a job, never by the login-node launcher.

Its face is ``run_job(spec)``, one rank's whole training job (``run.py``). The parts, each
folder importing only the folders before it: ``parallel/`` (ranks, groups, collectives,
sharded layers), ``models/`` (the architectures), ``checkpoint/`` (save, resume, export),
``health/`` (preflight, watchdog, faults, calibrate's measurements), ``inference/``
(generation, memorization); the training itself beside this module (``loop``, ``data``,
``goldfish``, ``metrics``, ``logs``) and ``assets/`` (the built-in corpus).
"""

from axonn_launch.train.run import run_job

__all__ = ["run_job"]
