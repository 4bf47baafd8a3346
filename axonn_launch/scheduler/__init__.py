"""The schedulers a machine profile names (``machine.scheduler``): one object each behind one
registry (``base.py``), owning everything that differs between them: how a job is submitted
and followed, job states, cancelling, nodes and partitions, the commands they run. Built in:
``slurm.py`` (sbatch through submitit, and squeue, sacct, sinfo, scontrol, scancel) and
``local.py`` (processes on this computer, ``processes.py``). Login-node code: no torch.
"""

from axonn_launch.scheduler import local, slurm
from axonn_launch.scheduler.base import Scheduler, named, names, of, register

__all__ = ["Scheduler", "local", "named", "names", "of", "register", "slurm"]
